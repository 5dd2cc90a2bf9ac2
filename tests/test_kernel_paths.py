"""The kernel paths of quantized projections (``executor.ops.quantized_product``), Strata's CUDA
dequantize kernel (``executor.cuda_dequant``) and its tensor-core matmul (``executor.cuda_mma``);
the kernels' own tests need MLX's CUDA backend and skip elsewhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from executor import cuda_dequant, cuda_mma
from executor.ops import (
    QuantLinear,
    kernel_path,
    linear,
    quantized_product,
    set_dequant_min_rows,
    set_mma_rows,
)
from planner.profile import DEQUANT_ROWS, measure_dequant_crossover, measure_mma_rows, mma_range

CUDA = mx.cuda.is_available()


def _weight(n: int, k: int, bits: int = 4, group: int = 32, dtype=mx.float32) -> QuantLinear:
    w = mx.array(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return QuantLinear(wq, scales, biases, bits, group)


def _dense_reference(w: QuantLinear, dtype) -> mx.array:
    return mx.dequantize(
        w.weight,
        w.scales.astype(mx.float32),
        w.biases.astype(mx.float32),
        group_size=w.group_size,
        bits=w.bits,
        dtype=mx.float32,
    ).astype(dtype)


def test_linear_takes_the_dense_path_from_the_plans_row_count():
    w = _weight(64, 128)
    x = mx.array(np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32))
    dense = x @ mx.dequantize(w.weight, w.scales, w.biases, group_size=32, bits=4).T
    quantized = mx.quantized_matmul(
        x, w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=4
    )
    try:
        set_dequant_min_rows(8)
        assert mx.array_equal(linear(x, w), dense)
        # 4 rows (a power of two: on CUDA rows are padded to one, ``executor.ops.bucket_rows``;
        # and there a row's result depends on the call's row count, so the same 4-row call)
        assert mx.array_equal(
            linear(x[:4], w),
            mx.quantized_matmul(
                x[:4], w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=4
            ),
        )
        set_dequant_min_rows(0)
        assert mx.array_equal(linear(x, w), quantized)
    finally:
        set_dequant_min_rows(0)
    # The two paths compute the same product up to float rounding (CUDA's float32 matmuls may
    # round through TF32).
    tol = 1e-2 if CUDA else 1e-4
    np.testing.assert_allclose(np.array(dense), np.array(quantized), rtol=tol, atol=tol)
    assert mx.array_equal(quantized_product(x, w, "dense"), dense)


def test_crossover_measurement_reports_every_row_count():
    figure, times = measure_dequant_crossover((64, 32), "float32", repeats=1)
    assert set(times) == set(DEQUANT_ROWS)
    assert all(q > 0 and d > 0 for q, d in times.values())
    assert figure.value in (0, *DEQUANT_ROWS)
    assert figure.source == "measured" and "mx.dequantize" in figure.how


@pytest.mark.skipif(CUDA, reason="checks the refusal off CUDA")
def test_cuda_dequantize_refuses_off_cuda():
    w = _weight(8, 64, dtype=mx.float16)
    assert not cuda_dequant.supported(4, 32, mx.float16)
    with pytest.raises(ValueError, match="mx.dequantize"):
        cuda_dequant.dequantize(w.weight, w.scales, w.biases, 32, 4, mx.float16)


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize(
    "bits, group, dtype",
    [(4, 32, mx.float16), (8, 32, mx.float16), (4, 64, mx.bfloat16), (4, 128, mx.float16)],
)
def test_cuda_dequantize_is_the_correctly_rounded_weight(bits, group, dtype):
    w = _weight(96, 512, bits, group, dtype)
    got = cuda_dequant.dequantize(w.weight, w.scales, w.biases, group, bits, dtype)
    assert got.dtype == dtype and got.shape == (96, 512)
    assert mx.array_equal(got, _dense_reference(w, dtype))


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
def test_cuda_dequantize_refuses_what_it_cannot_unpack():
    w = _weight(8, 64, dtype=mx.float16)
    assert not cuda_dequant.supported(3, 32, mx.float16)
    assert not cuda_dequant.supported(4, 32, mx.float32)
    with pytest.raises(ValueError, match="do not form"):
        cuda_dequant.dequantize(w.weight, w.scales[:, :1], w.biases[:, :1], 32, 4, mx.float16)


def test_mma_range_is_the_winning_run_that_ends_at_the_largest_win():
    # {rows: (quantized s, tensor-core s)}: wins at 2, 8, 16, 32; loses at 4 and 64
    times = {2: (2, 1), 4: (1, 2), 8: (2, 1), 16: (2, 1), 32: (2, 1), 64: (1, 2)}
    assert mma_range(times) == (8, 32)
    assert mma_range({2: (1, 2), 4: (1, 2)}) == (0, 0)
    assert mma_range({2: (2, 1), 4: (2, 1)}) == (2, 4)


def test_kernel_path_follows_the_plans_row_ranges():
    w16 = _weight(64, 128, dtype=mx.float16)
    try:
        set_dequant_min_rows(128)
        set_mma_rows(2, 32)
        assert kernel_path(1, w16, mx.float16) == "quantized"
        assert kernel_path(16, w16, mx.float16) == ("mma" if CUDA else "quantized")
        assert kernel_path(64, w16, mx.float16) == "quantized"
        assert kernel_path(128, w16, mx.float16) == "dense"
        # activations of another dtype than the scales: never the tensor-core kernel
        assert kernel_path(16, w16, mx.float32) == "quantized"
        set_mma_rows(0, 0)
        assert kernel_path(16, w16, mx.float16) == "quantized"
    finally:
        set_dequant_min_rows(0)
        set_mma_rows(0, 0)
    with pytest.raises(ValueError, match="unknown kernel path"):
        quantized_product(mx.zeros((2, 128), mx.float16), w16, "fast")


@pytest.mark.skipif(CUDA, reason="checks the refusal off CUDA")
def test_tensor_core_kernel_refuses_off_cuda():
    w = _weight(64, 128, dtype=mx.float16)
    assert not cuda_mma.supported(16, 64, 128, 4, 32, mx.float16)
    with pytest.raises(ValueError, match="quantized_matmul"):
        cuda_mma.matmul(mx.zeros((16, 128), mx.float16), w.weight, w.scales, w.biases, 32)
    lo, hi, times = measure_mma_rows((64, 128), "float16", repeats=1)
    assert (lo.value, hi.value, times) == (0, 0, {}) and "does not apply" in lo.how


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 24, 33, 64])
@pytest.mark.parametrize("group, dtype", [(32, mx.float16), (64, mx.bfloat16), (128, mx.float16)])
@pytest.mark.parametrize("n", [96, 80])  # blocks of 32 columns where n allows, else of 16
def test_tensor_core_kernel_matches_the_dequantized_product(rows, group, dtype, n):
    k = 640  # 10 slabs of 64: an uneven split over the 8 warps; a multiple of every group size
    w = _weight(n, k, 4, group, dtype)
    x = mx.array(np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32))
    x = x.astype(dtype)
    got = cuda_mma.matmul(x, w.weight, w.scales, w.biases, group)
    assert got.dtype == dtype and got.shape == (rows, n)
    ref = x.astype(mx.float32) @ _dense_reference(w, dtype).astype(mx.float32).T
    err = mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()
    assert err.item() < (4e-3 if dtype == mx.bfloat16 else 1e-3)
    # a row's result does not depend on the other rows or their number
    assert mx.array_equal(cuda_mma.matmul(x[:1], w.weight, w.scales, w.biases, group)[0], got[0])


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
def test_tensor_core_range_measurement_reports_every_row_count():
    lo, hi, times = measure_mma_rows((256, 512), "float16", repeats=1)
    assert set(times) == {2, 4, 8, 16, 32, 64}
    assert (lo.value, hi.value) == mma_range(times)


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("rows", [1, 5, 16, 24, 33])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_fused_kernels_match_their_parts(rows, dtype):
    """The fused products (a stacked Q/K/V weight split into three outputs; SwiGLU of a stacked
    gate/up weight) equal the float32 products of their parts within the kernel's tolerance, and
    a row's result does not depend on the other rows."""
    from executor.ops import fuse

    k, tol = 640, (4e-3 if dtype == mx.bfloat16 else 1e-3)
    x = mx.array(np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32))
    x = x.astype(dtype)
    parts = [_weight(n, k, 4, 32, dtype) for n in (96, 32, 32)]
    fused, views = fuse(parts)
    assert all(mx.array_equal(v.weight, p.weight) for v, p in zip(views, parts, strict=True))
    s = fused.stacked
    outs = cuda_mma.matmul_split(x, s.weight, s.scales, s.biases, 32, fused.widths)
    for got, p in zip(outs, parts, strict=True):
        ref = x.astype(mx.float32) @ _dense_reference(p, dtype).astype(mx.float32).T
        assert got.shape == (rows, p.shape[0])
        assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < tol
    alone = cuda_mma.matmul_split(x[:1], s.weight, s.scales, s.biases, 32, fused.widths)
    assert all(mx.array_equal(a[0], o[0]) for a, o in zip(alone, outs, strict=True))

    gate, up = _weight(80, k, 4, 32, dtype), _weight(80, k, 4, 32, dtype)
    up = type(up)(up.weight[::-1], up.scales[::-1], up.biases[::-1], 4, 32)  # differ from gate
    fused, _ = fuse([gate, up])
    s = fused.stacked
    got = cuda_mma.swiglu(x, s.weight, s.scales, s.biases, 32)
    xf = x.astype(mx.float32)
    g = xf @ _dense_reference(gate, dtype).astype(mx.float32).T
    u = xf @ _dense_reference(up, dtype).astype(mx.float32).T
    ref = g * mx.sigmoid(g) * u
    assert got.shape == (rows, 80) and got.dtype == dtype
    assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 2 * tol
    assert mx.array_equal(cuda_mma.swiglu(x[:1], s.weight, s.scales, s.biases, 32)[0], got[0])
    with pytest.raises(ValueError, match="multiples of 16"):
        cuda_mma.matmul_split(x, s.weight, s.scales, s.biases, 32, (80, 70, 10))
