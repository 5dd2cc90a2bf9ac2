"""Reads that bypass the page cache: Linux ``O_DIRECT``, macOS ``F_NOCACHE``.

Streaming must read what the disk delivers, not what the page cache remembers, both for honest
bandwidth figures and so that streamed weights do not silently occupy RAM. Where the filesystem
refuses ``O_DIRECT`` (tmpfs; some overlays) the file is read buffered after
``posix_fadvise(POSIX_FADV_DONTNEED)``, and the caller is told (``direct`` is False).
The macOS branch cannot be run on the Linux machines this project is tested on.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from pathlib import Path

ALIGN = 4096
"""O_DIRECT needs offsets, sizes and buffers aligned to the logical block size (512 B or 4 KiB);
4 KiB covers both."""

_F_NOCACHE_DARWIN = 48
"""``F_NOCACHE`` from macOS's <sys/fcntl.h>; Python's fcntl module does not always export it."""


def drop_from_page_cache(fd: int) -> None:
    """Evict a file's clean pages from the page cache (Linux; a no-op elsewhere)."""
    # After fsync the pages are clean, so DONTNEED really evicts them (Linux).
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def set_nocache(fd: int) -> None:
    """Turn the page cache off for ``fd`` (macOS)."""
    import fcntl

    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE_DARWIN), 1)


def pread_into(fd: int, mv: memoryview, offset: int) -> int:
    """Read into ``mv`` at file ``offset``; returns the bytes the OS returned."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [mv], offset)
    data = os.pread(fd, len(mv), offset)  # macOS before 11 has no preadv
    mv[: len(data)] = data
    return len(data)


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
                    os.preadv(fd, [mv], 0)
                return fd, True, "O_DIRECT"
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
            finally:
                probe.close()
    fd = os.open(path, os.O_RDONLY)
    drop_from_page_cache(fd)
    why = "the filesystem refused O_DIRECT"
    return fd, False, f"buffered reads after posix_fadvise(POSIX_FADV_DONTNEED) ({why})"
