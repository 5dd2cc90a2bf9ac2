"""Reads that bypass the page cache: Linux ``O_DIRECT``, macOS ``F_NOCACHE``; reads that finish.

Streaming must read what the disk delivers, not what the page cache remembers, both for honest
bandwidth figures and so that streamed weights do not silently occupy RAM. Where the filesystem
refuses ``O_DIRECT`` (tmpfs; some overlays) the file is read buffered after
``posix_fadvise(POSIX_FADV_DONTNEED)``, and the caller is told (``direct`` is False).
The macOS branch cannot be run on the Linux machines this project is tested on.

Every read goes through :func:`read_once` (one OS call; the point where tests inject faults) and
:func:`pread_into`, which finishes it: a short read (which direct I/O may legally return) is
continued where it stopped, and an interrupted call (``InterruptedError``) is retried; only a read
that returns 0 bytes, the end of the file, ends it early. :class:`UncachedFile` adds the fallback
of the packed store: ``EINVAL`` from a direct read, at open or at any later read, switches that
file to buffered reads for the rest of the run, with one warning line on stderr.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from pathlib import Path

ALIGN = 4096
"""O_DIRECT needs offsets, sizes and buffers aligned to the logical block size (512 B or 4 KiB);
4 KiB covers both."""

_F_NOCACHE_DARWIN = 48
"""``F_NOCACHE`` from macOS's <sys/fcntl.h>; Python's fcntl module does not always export it."""

MAX_INTERRUPTED = 100
"""Interrupted calls (``EINTR``) in a row after which a read gives up: a signal storm, not bad
luck. CPython itself retries ``EINTR`` in ``os.preadv``/``os.pread`` (PEP 475) unless a signal
handler raises, so this only counts what reaches Python as ``InterruptedError``."""

BUFFERED = "buffered reads after posix_fadvise(POSIX_FADV_DONTNEED)"
"""The method of a file read through the page cache (the cache dropped for it first)."""

_warned: set[str] = set()
"""Files whose fallback to buffered reads was already reported in this process (one warning
line per file, however many readers it has)."""
_warned_lock = threading.Lock()


def drop_from_page_cache(fd: int) -> None:
    """Evict a file's clean pages from the page cache (Linux; a no-op elsewhere)."""
    # After fsync the pages are clean, so DONTNEED really evicts them (Linux).
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def set_nocache(fd: int) -> None:
    """Turn the page cache off for ``fd`` (macOS)."""
    import fcntl

    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE_DARWIN), 1)


def read_once(fd: int, mv: memoryview, offset: int) -> int:
    """One OS read into ``mv`` at file ``offset``: the bytes the OS returned (maybe fewer than
    ``len(mv)``; 0 at the end of the file).

    Every read of the packed store and of the disk test goes through this function, so tests
    can wrap it to inject short reads, ``EINTR`` and ``EINVAL``.

    Raises:
        OSError: the OS refused the read (``InterruptedError`` for ``EINTR``).
    """
    if hasattr(os, "preadv"):
        return os.preadv(fd, [mv], offset)
    data = os.pread(fd, len(mv), offset)  # macOS before 11 has no preadv
    mv[: len(data)] = data
    return len(data)


def pread_into(fd: int, mv: memoryview, offset: int) -> int:
    """Read ``len(mv)`` bytes into ``mv`` at file ``offset``, continuing short reads and
    retrying interrupted calls; returns the bytes read, fewer than ``len(mv)`` only where the
    file ends first.

    After a short direct-I/O read the next call starts where it stopped: still aligned when the
    OS returned whole blocks; where it did not, the OS refuses that call with ``EINVAL``, which
    :class:`UncachedFile` answers by reading buffered.

    Raises:
        OSError: the OS refused a read (``InterruptedError`` after ``MAX_INTERRUPTED`` in a row).
    """
    got, interrupted = 0, 0
    while got < len(mv):
        part = mv[got:]
        try:
            n = read_once(fd, part, offset + got)
        except InterruptedError:
            interrupted += 1
            if interrupted >= MAX_INTERRUPTED:
                raise
            continue
        finally:
            # Released now, so that no frame of a failed read keeps the buffer exported (an
            # mmap with exports cannot be closed).
            part.release()
        if n == 0:
            break  # end of file
        got, interrupted = got + n, 0
    return got


def open_uncached(path: Path) -> tuple[int, bool, str]:
    """Open ``path`` for reading past the page cache: (fd, direct, method)."""
    if sys.platform == "darwin":
        # macOS has no O_DIRECT; F_NOCACHE on the descriptor turns its caching off.
        fd = os.open(path, os.O_RDONLY)
        try:
            set_nocache(fd)
        except OSError:
            os.close(fd)
            raise
        return fd, True, "F_NOCACHE"
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:  # tmpfs refuses O_DIRECT at open with EINVAL
                raise
        else:
            # Some filesystems (overlay on some kernels) accept the flag but refuse the read.
            probe = mmap.mmap(-1, ALIGN)
            try:
                with memoryview(probe) as mv:
                    pread_into(fd, mv, 0)
                return fd, True, "O_DIRECT"
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
            finally:
                probe.close()
    return _open_buffered(path), False, f"{BUFFERED} (the filesystem refused O_DIRECT)"


def _open_buffered(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    drop_from_page_cache(fd)
    return fd


def warn_buffered(path: Path, why: str) -> None:
    """Say once per file and process, on one stderr line, that ``path`` is read buffered."""
    key = str(path)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    print(
        f"warning: {path}: {why}; reading it through the page cache (buffered) for the rest of "
        "the run: streamed weights may then occupy RAM and read figures include the cache",
        file=sys.stderr,
        flush=True,
    )


class UncachedFile:
    """A file read past the page cache by several threads, buffered once direct I/O fails.

    Opened with :func:`open_uncached`. When the filesystem refuses direct I/O (``EINVAL``) at
    open, or on any later read, the file is read buffered for the rest of the run, after one
    warning line on stderr naming the file and why (:func:`warn_buffered`); ``direct`` and
    ``method`` then say so. The descriptor of the refused reads stays open until :meth:`close`,
    since other threads may still be reading through it.

    Args:
        path: the file.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd, self.direct, self.method = open_uncached(self.path)  # fd: where reads go now
        self._lock = threading.Lock()
        self._retired: list[int] = []
        if not self.direct:
            warn_buffered(self.path, "the filesystem refused O_DIRECT at open (EINVAL)")

    @property
    def read_method(self) -> str:
        """``direct`` (O_DIRECT or F_NOCACHE) or ``buffered``."""
        return "direct" if self.direct else "buffered"

    def fall_back(self, fd: int, offset: int, err: OSError) -> None:
        """Answer ``err``, raised by a read through ``fd`` at ``offset``: from then on the file is
        read buffered when it is ``EINVAL`` on a direct read (another thread may have switched
        already: then nothing more happens). The caller then reads again through :attr:`fd`.

        Raises:
            OSError: ``err`` itself when it is not ``EINVAL`` on a direct read.
        """
        with self._lock:
            if fd != self.fd:
                return  # another thread's read fell back already: retry on the buffered fd
            if err.errno != errno.EINVAL or not self.direct:
                raise err
            why = f"a direct read at byte {offset} was refused (EINVAL)"
            new = _open_buffered(self.path)
            self._retired.append(self.fd)
            self.fd, self.direct, self.method = new, False, f"{BUFFERED} ({why})"
        warn_buffered(self.path, why)

    def close(self) -> None:
        """Close the file's descriptors (the refused direct one too)."""
        for fd in (self.fd, *self._retired):
            os.close(fd)
        self._retired = []
