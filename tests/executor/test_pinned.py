"""The RAM tier read from page-locked host memory (``executor.pinned``, MLX's CUDA backend): the
copy kernel gives the host bytes exactly, whatever the size and dtype; a plan with units on the
RAM tier gives the all-resident plan's greedy ids with the kernel's copies. On the CPU
``pinned_for`` is None (nothing to page-lock) and these skip."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from strata.executor.pinned import pinned_for

cuda_only = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


def test_not_on_the_cpu():
    if mx.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert pinned_for() is None


@cuda_only
@pytest.mark.parametrize("dtype", [np.uint32, np.float16, np.float32, np.uint8])
@pytest.mark.parametrize("n", [1, 7, 16, 4096 + 3, 3 << 20])
def test_copy_kernel_gives_the_host_bytes(dtype, n):
    p = pinned_for()
    assert p is not None
    rng = np.random.default_rng(n)
    host = rng.integers(0, 255, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    host = host.reshape(-1, 1) if n % 2 else host
    try:
        host = p.adopt(host)  # a page-aligned, registered copy
        out = p.to_device(host)
        assert out is not None
        assert out.shape == host.shape
        np.testing.assert_array_equal(np.array(out).view(np.uint8), host.view(np.uint8))
        host[...] = 0  # the next copy reads the host memory as it is now
        np.testing.assert_array_equal(np.array(p.to_device(host)).view(np.uint8), 0)
    finally:
        p.close()
