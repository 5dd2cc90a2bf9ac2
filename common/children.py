"""Child processes that die with the process that started them.

A child started with ``subprocess`` outlives its parent: a Strata process killed outright
(SIGKILL, the OOM killer) would leave pip downloading or CBC searching, holding a CPU and memory
with nobody to read the answer. On Linux, :func:`tied_to_parent` gives ``subprocess`` a
``preexec_fn`` that asks the kernel to signal the child when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); elsewhere there is no such call and it gives None.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""``prctl`` option (linux/prctl.h): the signal a process gets when its parent thread exits."""


def libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up in the parent (a child between fork and exec must not load
    libraries); None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with(
    parent: int, prctl: Callable[..., int], sig: int = signal.SIGTERM
) -> Callable[[], None]:
    """What a child runs between fork and exec (Linux): ``sig`` when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), and an exit at once if the parent died before that (the child
    was then adopted, and its parent id is no longer ``parent``).

    Args:
        parent: the parent's process id, ``os.getpid()`` read before the fork.
        prctl: libc's ``prctl`` (:func:`libc_prctl`), looked up before the fork.
        sig: the signal the child gets; SIGTERM lets it clean up, SIGKILL is certain.
    """

    def child() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return child


def tied_to_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess`` that makes the child get ``sig`` when this process
    dies (Linux), or None where that cannot be asked for (other systems, no libc ``prctl``).

    The kernel sends the signal when the *thread* that started the child exits: call
    ``subprocess`` from a thread that outlives the child (one that waits for it).
    """
    if sys.platform != "linux":
        return None
    prctl = libc_prctl()
    return None if prctl is None else die_with(os.getpid(), prctl, sig)
