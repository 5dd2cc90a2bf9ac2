"""RAM-tier weights read by the GPU from page-locked host memory (MLX's CUDA backend).

Why: on MLX's CUDA backend ``mx.array(numpy)`` makes an array in managed memory, which the GPU's
first reader then faults over a page at a time: about 2 GB/s for the RAM tier's per-use copies
on an H100 (``executor.profile.measure_host_to_device``). Host memory that is page-locked and
mapped into the device's address space (``cudaHostRegister`` with ``cudaHostRegisterMapped``)
is read by a kernel straight over PCIe instead, at tens of GB/s, without the copy engine and
without managed memory (which must never grow past what a shared card has free).

How: the RAM tier's host arrays are registered once, when the weights load (:meth:`Pinned.register`,
one ``cudaHostRegister`` each, through the CUDA runtime that MLX itself loaded, found in
``/proc/self/maps``); each use copies one array into a new device array with a grid-stride
kernel of 16-byte loads (:meth:`Pinned.to_device`), an operation of the pass's lazy graph like
any other, so the device copies it when the pass reaches it, overlapped with the blocks before.
The arrays stay registered until :meth:`Pinned.close` (``WeightStore.close``).

Where the runtime or registration is unavailable (no CUDA, another platform, a registration
refused), :func:`pinned_for` returns None and the RAM tier keeps ``mx.array``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import mlx.core as mx
import numpy as np
from strata.executor.cuda_driver import cudart
from strata.executor.cuda_source import compact

HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
"""``cudaHostRegister`` flags (``cuda_runtime_api.h``): usable from every context, and mapped
into the device's address space (its device pointer from ``cudaHostGetDevicePointer``)."""

THREADS = 256
MAX_BLOCKS = 2048
"""The copy kernel's block size and most blocks: enough 16-byte loads in flight to keep a PCIe
5.0 x16 link busy (each thread loops over the array in strides of the whole grid)."""

_SOURCE = compact(
    """
    const uint64_t addr = src[0];
    const size_t n = nbytes[0];
    const size_t vec = n / 16;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* from = reinterpret_cast<const uint4*>(addr);
    uint4* to = reinterpret_cast<uint4*>(out);
    for (size_t i = first; i < vec; i += stride) {
        to[i] = from[i];
    }
    const uint8_t* tail = reinterpret_cast<const uint8_t*>(addr);
    for (size_t i = vec * 16 + first; i < n; i += stride) {
        out[i] = tail[i];
    }
"""
)


@functools.cache
def _kernel():
    """The copy kernel, built on first use."""
    return mx.fast.cuda_kernel(
        name="strata_pinned_copy",
        input_names=["src", "nbytes"],
        output_names=["out"],
        source=_SOURCE,
    )


class Pinned:
    """Host arrays registered with the CUDA runtime, copied to the device by a kernel.

    Args:
        cudart: the CUDA runtime (``cuda_driver.cudart``).
    """

    def __init__(self, cudart: ctypes.CDLL):
        self._rt = cudart
        self._rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._rt.cudaHostGetDevicePointer.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        self._by_address: dict[int, tuple[np.ndarray, mx.array, mx.array]] = {}
        self._areas: list[mmap.mmap] = []  # the page-aligned copies' memory (adopt)
        self.registered_bytes = 0

    def register(self, host: np.ndarray) -> bool:
        """Page-lock ``host`` (C-contiguous, 16-byte aligned) and map it for the device; False
        where the runtime refuses (the array is then copied the ordinary way)."""
        if not host.flags.c_contiguous or host.nbytes == 0:
            return False
        addr = host.ctypes.data
        if addr % 16 or addr in self._by_address:
            return addr in self._by_address
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
        if self._rt.cudaHostRegister(ctypes.c_void_p(addr), host.nbytes, flags) != 0:
            self._rt.cudaGetLastError()  # clear the sticky error of the refused call
            return False
        dev = ctypes.c_void_p()
        if self._rt.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(addr), 0) != 0:
            self._rt.cudaHostUnregister(ctypes.c_void_p(addr))
            self._rt.cudaGetLastError()
            return False
        # The kernel's two scalar inputs, made once per array (tiny managed arrays).
        src = mx.array(np.array([dev.value], dtype=np.uint64))
        size = mx.array(np.array([host.nbytes], dtype=np.uint64))
        mx.eval(src, size)
        self._by_address[addr] = (host, src, size)
        self.registered_bytes += host.nbytes
        return True

    def adopt(self, host: np.ndarray) -> np.ndarray:
        """``host`` copied into page-aligned memory of its own (an anonymous mapping) and
        registered: small arrays from the heap share pages with others, and a page can be
        registered once only. Returns the copy, or ``host`` itself where registration failed
        (it is then copied the ordinary way)."""
        if host.nbytes == 0 or host.dtype not in _MX_DTYPES:
            return host
        size = -(-host.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        area = mmap.mmap(-1, size)
        copy = np.frombuffer(area, dtype=host.dtype, count=host.size).reshape(host.shape)
        copy[...] = host
        if not self.register(copy):
            return host
        self._areas.append(area)
        return copy

    def to_device(self, host: np.ndarray) -> mx.array | None:
        """A new device array holding ``host``'s bytes, its dtype and shape (lazy: copied when
        evaluated), or None where ``host`` is not registered."""
        held = self._by_address.get(host.ctypes.data)
        if held is None or held[0].nbytes != host.nbytes or host.dtype not in _MX_DTYPES:
            return None
        _, src, size = held
        n = host.nbytes
        blocks = max(1, min(MAX_BLOCKS, -(-n // (16 * THREADS))))
        (out,) = _kernel()(
            inputs=[src, size],
            grid=(blocks * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(n,)],
            output_dtypes=[mx.uint8],
        )
        return out.view(_MX_DTYPES[host.dtype]).reshape(host.shape)

    def close(self) -> None:
        """Unregister every array (call once nothing reads them: after ``mx.synchronize``)."""
        for addr in list(self._by_address):
            self._rt.cudaHostUnregister(ctypes.c_void_p(addr))
        self._by_address.clear()
        self.registered_bytes = 0
        self._areas.clear()  # each mapping goes with the last array viewing it


_MX_DTYPES = {
    np.dtype(np.uint32): mx.uint32,
    np.dtype(np.uint8): mx.uint8,
    np.dtype(np.float16): mx.float16,
    np.dtype(np.float32): mx.float32,
    np.dtype(np.int8): mx.int8,
}
"""The MLX dtype of each numpy dtype the RAM tier holds; an array of another dtype is copied the
ordinary way (``Pinned.adopt`` leaves it as it is)."""


def pinned_for(enabled: bool = True) -> Pinned | None:
    """A :class:`Pinned` on MLX's CUDA backend (Linux), else None (or where not ``enabled``)."""
    if not enabled or not sys.platform.startswith("linux"):
        return None
    rt = cudart()
    return Pinned(rt) if rt is not None else None
