"""Files written whole or not at all, safely beside other processes writing the same file.

A file is written under a name of its own (``tempfile.mkstemp`` in the target's folder: unique
between processes, threads and hosts sharing the folder) and renamed over the target once
complete (``os.replace``: atomic on POSIX and Windows). Readers see the old file or the new one,
never a part; writers racing on one target each replace it whole, the last one winning. On any
failure, Ctrl-C included, the temporary file is removed.

A process killed outright (``kill -9``, a power cut) cannot remove its temporary file: each one's
name carries its writer (host name and process id, ``owner_tag``), and ``sweep`` removes those
of this host whose process is gone (``cache_dir`` sweeps the cache folder once per process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _default_mode() -> int:
    """The permissions ``open()`` would give a new file (0o666 less the umask), as mkstemp's
    0o600 is not what a cache shared by its owner's tools expects. Read once, at import:
    reading the umask sets it, which another thread creating a file meanwhile would feel."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _default_mode()


@contextlib.contextmanager
def replaced(target: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``target`` for writing (``mode``: ``"wb"`` or ``"w"``);
    when the block ends without an exception, rename it over ``target``.

    Raises:
        OSError: the file cannot be created, written or renamed (the temporary file is gone).
    """
    name = temporary_beside(target)
    try:
        with open(name, mode) as f:
            yield f
        os.replace(name, target)
    except BaseException:
        name.unlink(missing_ok=True)
        raise


def temporary_beside(target: Path) -> Path:
    """A new empty file beside ``target``, of a name of its own
    (``.NAME.HOST~PID.XXXXXXXX.partial``) and the permissions ``open()`` would give it, for a
    writer that opens a path itself (gguf's ``GGUFWriter``); the caller renames it over
    ``target`` (``os.replace``) or removes it.

    Raises:
        OSError: the file cannot be created (a missing or read-only folder) or given its
            permissions (then it is removed).
    """
    fd, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.{owner_tag()}.", suffix=PARTIAL
    )
    try:
        os.fchmod(fd, _MODE)
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    os.close(fd)
    return Path(name)


PARTIAL = ".partial"
"""The suffix of everything written under a temporary name (files and folders)."""

LEGACY_AGE_S = 24 * 3600
"""Age after which a temporary file of the older naming (no owner in its name) is taken as
abandoned: no write of Strata's takes a day."""


def owner_tag() -> str:
    """``HOST~PID``: who writes a temporary file or folder (``sweep`` reads it back). HOST is
    the full host name with its PID namespace where the system has one (containers that share a
    host name have namespaces of their own), so that a PID is only ever read where it means
    the same process."""
    host = socket.gethostname() or "host"
    with contextlib.suppress(OSError):
        host += f"-ns{os.stat('/proc/self/ns/pid').st_ino}"
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in host)
    return f"{host}~{os.getpid()}"


def temporary_folder(parent: Path, what: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in ``parent`` named for its writer (``.WHAT.HOST~PID.XXXX.partial``),
    removed when its ``with`` block ends, and by ``sweep`` if the process is killed first."""
    return tempfile.TemporaryDirectory(dir=parent, prefix=f".{what}.{owner_tag()}.", suffix=PARTIAL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's, or no such number:
        return True  # never taken for a dead writer
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` whose writer is gone: this host's,
    of a process that no longer runs (another host's are left alone: its processes cannot be
    seen from here), and ones of the older naming older than ``LEGACY_AGE_S``. Returns what
    was removed; what cannot be removed (permissions) is left."""
    host = owner_tag().split("~")[0]
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        name = p.name
        if not (name.startswith(".") and name.endswith(PARTIAL)):
            continue
        # The owner is the part before the random one and the suffix (the target's own name
        # may hold anything): ".NAME.OWNER.RANDOM.partial".
        parts = name.split(".")
        owner = parts[-3] if len(parts) >= 5 and "~" in parts[-3] else None
        if owner is not None:
            who, _, pid = owner.rpartition("~")
            if who != host or not pid.isdigit() or _alive(int(pid)):
                continue
        else:
            try:
                if time.time() - p.lstat().st_mtime < LEGACY_AGE_S:
                    continue
            except OSError:
                continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed
