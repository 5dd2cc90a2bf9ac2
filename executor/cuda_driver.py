"""The CUDA runtime and driver libraries of this process, through ctypes, for what MLX does not
expose: page-locking host memory (``executor.pinned``) and advising the driver where managed
memory lives (:func:`keep_on_host`, ``executor.host_inputs``). Nothing here on other backends:
each function answers None or False there."""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np


@functools.cache
def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library (None where there is none, or not MLX's CUDA backend): the one
    MLX loaded where it is in ``/proc/self/maps``, else the system's or a pip package's (MLX may
    link the runtime statically). Any of them works on the device's primary context, which MLX
    uses too, so the pointers they give are valid in MLX's kernels."""
    if not mx.cuda.is_available():
        return None
    mx.eval(mx.zeros(1))  # MLX has initialised CUDA in this process
    candidates: list[str] = []
    try:
        maps = Path("/proc/self/maps").read_text()
        candidates += sorted({ln.split()[-1] for ln in maps.splitlines() if "libcudart.so" in ln})
    except OSError:
        pass
    candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for base in sys.path:
        candidates += sorted(str(p) for p in Path(base or ".").glob("nvidia/*/lib/libcudart.so*"))
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


ADVISE_SET_PREFERRED_LOCATION, ADVISE_UNSET_PREFERRED_LOCATION = 3, 4
ADVISE_SET_ACCESSED_BY, ADVISE_UNSET_ACCESSED_BY = 5, 6
DEVICE_CPU = -1
"""``CUmem_advise`` values and ``CU_DEVICE_CPU`` (``cuda.h``), for ``cuMemAdvise``'s first
signature (a device ordinal), which the driver keeps exporting for programs built before 12.2."""


@functools.cache
def _driver() -> tuple[ctypes.CDLL, int] | None:
    """The CUDA driver library and the device MLX computes on (the runtime's current device),
    or None where either is unavailable."""
    rt = cudart()
    if rt is None:
        return None
    try:
        drv = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev = ctypes.c_int(0)
    if rt.cudaGetDevice(ctypes.byref(dev)) != 0:
        rt.cudaGetLastError()
        return None
    drv.cuMemAdvise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    return drv, dev.value


def keep_on_host(host: np.ndarray, keep: bool = True) -> bool:
    """Advise the driver that the managed memory under ``host`` (an MLX array's own memory, as
    ``np.asarray`` of it gives) stays in host memory and is mapped into the page tables of
    MLX's device (``keep``), or take that back (not ``keep``: before the memory goes back to
    MLX's buffer cache, where a GPU output may land in it). Kept, the GPU reads it over PCIe
    where it otherwise faulted its pages over after every host write. False where the memory
    is not managed or the driver refuses (then nothing changed, or part of it: undo it)."""
    found = _driver()
    if found is None or host.nbytes == 0:
        return False
    drv, dev = found
    if keep:
        calls = [(ADVISE_SET_PREFERRED_LOCATION, DEVICE_CPU), (ADVISE_SET_ACCESSED_BY, dev)]
    else:
        calls = [(ADVISE_UNSET_ACCESSED_BY, dev), (ADVISE_UNSET_PREFERRED_LOCATION, DEVICE_CPU)]
    return all(
        drv.cuMemAdvise(host.ctypes.data, host.nbytes, advice, where) == 0
        for advice, where in calls
    )
