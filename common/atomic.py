"""Files written whole or not at all, safely beside other processes writing the same file.

A file is written under a name of its own (``tempfile.mkstemp`` in the target's folder: unique
between processes, threads and hosts sharing the folder) and renamed over the target once
complete (``os.replace``: atomic on POSIX and Windows). Readers see the old file or the new one,
never a part; writers racing on one target each replace it whole, the last one winning. On any
failure, Ctrl-C included, the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
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
    """A new empty file beside ``target``, of a name of its own (``.NAME.XXXXXXXX.partial``)
    and the permissions ``open()`` would give it, for a writer that opens a path itself (gguf's
    ``GGUFWriter``); the caller renames it over ``target`` (``os.replace``) or removes it.

    Raises:
        OSError: the file cannot be created (a missing or read-only folder) or given its
            permissions (then it is removed).
    """
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        os.fchmod(fd, _MODE)
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    os.close(fd)
    return Path(name)
