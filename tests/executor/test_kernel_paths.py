"""The kernel paths of quantized projections (``executor.ops.quantized_product``), Strata's CUDA
dequantize kernel (``executor.cuda_dequant``) and its tensor-core matmul (``executor.cuda_mma``);
the kernels' own tests need MLX's CUDA backend and skip elsewhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from strata.executor import cuda_dequant, cuda_mma, ops
from strata.executor.config import RuntimeConfig
from strata.executor.ops import QuantLinear, kernel_path, linear, quantized_product
from strata.executor.profile import (
    DEQUANT_ROWS,
    MMA_ROWS,
    measure_dequant_crossover,
    measure_mma_rows,
    mma_range,
)

CUDA = mx.cuda.is_available()
CONFIG = RuntimeConfig.build()  # this backend's defaults, no measured kernel paths


def _weight(
    n: int, k: int, bits: int = 4, group: int = 32, dtype=mx.float32, seed: int = 0
) -> QuantLinear:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w = mx.array(w).astype(dtype)
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
    from_8 = CONFIG.replace(dequant_min_rows=8)
    assert mx.array_equal(linear(x, w, from_8), dense)
    # 4 rows (a power of two: on CUDA rows are padded to one, ``executor.ops.bucket_rows``;
    # and there a row's result depends on the call's row count, so the same 4-row call)
    assert mx.array_equal(
        linear(x[:4], w, from_8),
        mx.quantized_matmul(
            x[:4], w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=4
        ),
    )
    assert mx.array_equal(linear(x, w, CONFIG), quantized)
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


def test_a_path_that_computes_wrongly_is_never_timed_as_winning(monkeypatch):
    """The profile checks each path's product against MLX's quantized matmul before timing it: a
    kernel that is fast and wrong on this machine is timed as infinitely slow, so no plan's
    crossover takes it."""
    real = ops.quantized_product

    def broken(x, w, path):
        out = real(x, w, "quantized")
        return out if path == "quantized" else out * 1.5

    monkeypatch.setattr(ops, "quantized_product", broken)
    figure, times = measure_dequant_crossover((64, 32), "float32", repeats=1)
    assert all(d == float("inf") for _, d in times.values()) and figure.value == 0

    def unbuildable(x, w, path):
        if path != "quantized":
            raise RuntimeError("[jit] nvrtc: error: identifier undefined\nmore")
        return real(x, w, path)

    monkeypatch.setattr(ops, "quantized_product", unbuildable)
    figure, times = measure_dequant_crossover((64, 32), "float32", repeats=1)
    assert all(d == float("inf") for _, d in times.values()) and figure.value == 0

    def silent(x, w, path):  # an exception without a message is refused the same way
        if path != "quantized":
            raise RuntimeError
        return real(x, w, path)

    monkeypatch.setattr(ops, "quantized_product", silent)
    figure, times = measure_dequant_crossover((64, 32), "float32", repeats=1)
    assert all(d == float("inf") for _, d in times.values()) and figure.value == 0


@pytest.mark.skipif(CUDA, reason="checks the refusal off CUDA")
def test_cuda_dequantize_refuses_off_cuda():
    w = _weight(8, 64, dtype=mx.float16)
    assert not cuda_dequant.supported(4, 32, mx.float16)
    with pytest.raises(ValueError, match="mx.dequantize"):
        cuda_dequant.dequantize(w.weight, w.scales, w.biases, 32, 4, mx.float16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bits, group, dtype",
    [(4, 32, mx.float16), (8, 32, mx.float16), (4, 64, mx.bfloat16), (4, 128, mx.float16)],
)
def test_cuda_dequantize_is_the_correctly_rounded_weight(bits, group, dtype):
    w = _weight(96, 512, bits, group, dtype)
    got = cuda_dequant.dequantize(w.weight, w.scales, w.biases, group, bits, dtype)
    assert got.dtype == dtype and got.shape == (96, 512)
    assert mx.array_equal(got, _dense_reference(w, dtype))


@pytest.mark.gpu
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
    plan = CONFIG.replace(dequant_min_rows=128, mma_rows=(2, 32))
    assert kernel_path(1, w16, mx.float16, plan) == "quantized"
    assert kernel_path(16, w16, mx.float16, plan) == ("mma" if CUDA else "quantized")
    assert kernel_path(64, w16, mx.float16, plan) == "quantized"
    assert kernel_path(128, w16, mx.float16, plan) == "dense"
    # activations of another dtype than the scales: never the tensor-core kernel
    assert kernel_path(16, w16, mx.float32, plan) == "quantized"
    # answers are kept per shape and settings: another config's are its own
    assert kernel_path(16, w16, mx.float16, plan.replace(mma_rows=(0, 0))) == "quantized"
    assert kernel_path(128, w16, mx.float16, CONFIG) == "quantized"
    with pytest.raises(ValueError, match="unknown kernel path"):
        quantized_product(mx.zeros((2, 128), mx.float16), w16, "fast")


@pytest.mark.skipif(CUDA, reason="checks the refusal off CUDA")
def test_tensor_core_kernel_refuses_off_cuda():
    w = _weight(64, 128, dtype=mx.float16)
    assert not cuda_mma.supported(16, 64, 128, 4, 32, mx.float16)
    with pytest.raises(ValueError, match="quantized_matmul"):
        cuda_mma.matmul(mx.zeros((16, 128), mx.float16), w.weight, w.scales, w.biases, 32)
    lo, hi, times = measure_mma_rows((64, 128), "float16", repeats=1)
    assert (lo.value, hi.value, times) == (0, 0, {}) and "do not apply" in lo.how


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 24, 33, 64])
@pytest.mark.parametrize("group, dtype", [(32, mx.float16), (64, mx.bfloat16), (128, mx.float16)])
@pytest.mark.parametrize(
    "n, k",
    # k = 640: 5 chunks of 128, an uneven split over 2 warps, one row tile per warp; 576: two
    # words per lane, 9 chunks over 4 warps (one gets none); the 8B shape: 8 warps, two row
    # tiles up to 32 rows
    [(96, 640), (80, 640), (576, 576), (4096, 4096)],
)
def test_tensor_core_kernel_matches_the_dequantized_product(rows, group, dtype, n, k):
    if k % group:
        pytest.skip("the group size does not divide k")
    w = _weight(n, k, 4, group, dtype)
    x = mx.array(np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32))
    x = x.astype(dtype)
    got = cuda_mma.matmul(x, w.weight, w.scales, w.biases, group)
    assert got.dtype == dtype and got.shape == (rows, n)
    ref = x.astype(mx.float32) @ _dense_reference(w, dtype).astype(mx.float32).T
    err = mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()
    assert err.item() < (4e-3 if dtype == mx.bfloat16 else 1e-3)
    # from two rows on (the tensor-core kernel), a row's result does not depend on the other
    # rows or their number; one row takes the matvec (executor.cuda_qmv), which rounds otherwise
    if rows > 1:
        two = cuda_mma.matmul(x[:2], w.weight, w.scales, w.biases, group)
        assert mx.array_equal(two[0], got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group, dtype", [(32, mx.float16), (64, mx.bfloat16), (128, mx.float16)])
@pytest.mark.parametrize(
    "n, k",
    # 32: one lane's 16 bytes at 8 bits, two at 4; 576: a partial slab (18 or 36 of 32 lanes'
    # vectors); 14336: 14 (28) slabs, U of them in flight; 49152 x 576: a SmolLM2-sized head
    [(16, 32), (96, 640), (576, 576), (4096, 14336), (49152, 576)],
)
def test_one_row_kernel_matches_the_dequantized_product(bits, group, dtype, n, k):
    """One row takes ``executor.cuda_qmv`` (4 and 8 bits): within rounding of the float32
    product of the exactly dequantized weight; every one-row call of that row gives the same
    bits, of any rank and with the residual added in the store (bit for bit ``r + product``);
    the kernel path offers it for one row where the plan's range starts at 1."""
    if k % group:
        pytest.skip("the group size does not divide k")
    w = _weight(n, k, bits, group, dtype, seed=11)
    rng = np.random.default_rng(12)
    x = mx.array(rng.standard_normal((1, k)).astype(np.float32)).astype(dtype)
    got = cuda_mma.matmul(x, w.weight, w.scales, w.biases, group)
    assert got.dtype == dtype and got.shape == (1, n)
    ref = x.astype(mx.float32) @ _dense_reference(w, mx.float32).T
    err = mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()
    assert err.item() < (4e-3 if dtype == mx.bfloat16 else 1e-3)
    again = cuda_mma.matmul(x.reshape(1, 1, k), w.weight, w.scales, w.biases, group)
    assert again.shape == (1, 1, n) and mx.array_equal(again.reshape(1, n), got)
    r = mx.array(rng.standard_normal((1, 1, n)).astype(np.float32)).astype(dtype)
    fused = cuda_mma.matmul(x, w.weight, w.scales, w.biases, group, residual=r)
    assert fused.shape == (1, 1, n) and mx.array_equal(fused, r + got)
    assert kernel_path(1, w, dtype, CONFIG.replace(mma_rows=(1, 32))) == "mma"
    assert kernel_path(1, w, dtype, CONFIG.replace(mma_rows=(2, 32))) == "quantized"


@pytest.mark.gpu
@pytest.mark.parametrize("u, wpb, ks", [(2, 4, 2), (1, 4, 4), (4, 8, 4), (1, 8, 8)])
@pytest.mark.parametrize("bits", [4, 8])
def test_one_row_kernel_with_k_split_matches_the_dequantized_product(monkeypatch, u, wpb, ks, bits):
    """K split over warps (``cuda_qmv.MAX_K_SPLIT``): every form within rounding of the float32
    product (down's 14,336 columns in parts of several runs, Q/K/V's 4,096 in one slab each),
    Q/K/V in one call equal to three calls bit for bit (a split depends on K alone), SwiGLU
    against its float32 reference."""
    from strata.executor import cuda_qmv

    monkeypatch.setattr(cuda_qmv, "MAX_SLABS_IN_FLIGHT", u)
    monkeypatch.setattr(cuda_qmv, "WARPS_PER_BLOCK", wpb)
    monkeypatch.setattr(cuda_qmv, "MAX_K_SPLIT", ks)
    monkeypatch.setattr(cuda_mma, "_LAUNCHES", {})
    dtype, group = mx.float16, 32
    rng = np.random.default_rng(21)
    for n, k in [(256, 14336), (96, 4096), (576, 576)]:
        w = _weight(n, k, bits, group, dtype, seed=n)
        x = mx.array(rng.standard_normal((1, k)).astype(np.float32)).astype(dtype)
        got = cuda_mma.matmul(x, w.weight, w.scales, w.biases, group)
        ref = x.astype(mx.float32) @ _dense_reference(w, mx.float32).T
        assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 1e-3
    k = 4096
    parts = [_weight(n, k, bits, group, dtype, seed=30 + n) for n in (512, 128, 128)]
    quants = [(p.weight, p.scales, p.biases) for p in parts]
    x = mx.array(rng.standard_normal((1, k)).astype(np.float32)).astype(dtype)
    for fused, q in zip(cuda_mma.matmul3(x, quants, group), quants, strict=True):
        assert mx.array_equal(fused, cuda_mma.matmul(x, *q, group))
    gate, up = parts[0], _weight(512, k, bits, group, dtype, seed=99)
    xf = x.astype(mx.float32)
    g = xf @ _dense_reference(gate, mx.float32).T
    want = g * mx.sigmoid(g) * (xf @ _dense_reference(up, mx.float32).T)
    got = cuda_mma.swiglu(x, quants[0], (up.weight, up.scales, up.biases), group)
    assert (mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item() < 2e-3


def test_k_split_depends_on_k_and_bits_alone_and_leaves_each_warp_a_run(monkeypatch):
    """``cuda_qmv.k_split``: ``U`` slabs in flight, at most the slabs there are; ``KS`` a power
    of two within ``MAX_K_SPLIT`` with at least ``U`` slabs a warp; a block of whole row groups."""
    from strata.executor import cuda_qmv

    monkeypatch.setattr(cuda_qmv, "MAX_SLABS_IN_FLIGHT", 4)
    monkeypatch.setattr(cuda_qmv, "MAX_K_SPLIT", 4)
    assert cuda_qmv.k_split(4096, 4) == (4, 1)  # 4 slabs of 1,024 elements
    assert cuda_qmv.k_split(14336, 4) == (4, 2)  # 14 slabs: runs of 4, the parts 8 and 6
    assert cuda_qmv.k_split(4096, 8) == (4, 2)  # 8 slabs of 512
    assert cuda_qmv.k_split(576, 4) == (1, 1)
    monkeypatch.setattr(cuda_qmv, "MAX_SLABS_IN_FLIGHT", 1)
    assert cuda_qmv.k_split(4096, 4) == (1, 4)
    monkeypatch.setattr(cuda_qmv, "_get_kernel", lambda store: store)  # the geometry alone
    for wpb, ks in [(4, 2), (4, 4), (8, 2), (8, 8)]:
        monkeypatch.setattr(cuda_qmv, "WARPS_PER_BLOCK", wpb)
        monkeypatch.setattr(cuda_qmv, "MAX_K_SPLIT", ks)
        _, template, grid, threads = cuda_qmv.launch("plain", 4096, mx.float16, 4, 32, [4096])
        t, used = dict(template), min(ks, 4)  # 4 slabs of one run each: at most 4 parts
        assert t["KS"] == used and threads[0] == 32 * t["WPB"] and t["WPB"] % used == 0
        assert 4 * t["WPB"] // used <= 16  # every warp of a block live: rows come in 16s
        assert grid[0] // 32 == 4096 // 4 * used  # a warp per row group and part of K
    monkeypatch.setattr(cuda_qmv, "MAX_K_SPLIT", 1)
    assert cuda_qmv.k_split(14336, 4) == (1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(1, 16), (2, 8), (1, 5), (3,)])
def test_tensor_core_kernels_take_any_rank_and_write_the_shapes_asked(lead):
    """``x`` of any rank gives ``[..., n]`` equal to the 2-D product (8-row multiples written in
    place, others padded and cut); ``matmul3``'s ``shapes`` view the same results; a bad
    signature is refused on every call, not just the first (the launch cache validates)."""
    k, widths = 4096, (4096, 1024, 1024)
    parts = [_weight(n, k, 4, 32, mx.float16, seed=i) for i, n in enumerate(widths)]
    quants = [(p.weight, p.scales, p.biases) for p in parts]
    m = int(np.prod(lead))
    flat = mx.array(np.random.default_rng(4).standard_normal((m, k)).astype(np.float16))
    x = flat.reshape(*lead, k)
    got = cuda_mma.matmul(x, *quants[1], 32)
    assert got.shape == (*lead, widths[1])
    assert mx.array_equal(got.reshape(m, -1), cuda_mma.matmul(flat, *quants[1], 32))
    shapes = [(m, 32, 1, 128), (m, 8, 1, 128), (m, 8, 128)]
    for o, ref, shape in zip(
        cuda_mma.matmul3(x, quants, 32, shapes),
        cuda_mma.matmul3(flat, quants, 32),
        shapes,
        strict=True,
    ):
        assert o.shape == shape and mx.array_equal(o.reshape(m, -1), ref)
    gate, up = quants[1], (parts[2].weight, parts[2].scales, parts[2].biases)
    sw = cuda_mma.swiglu(x, gate, up, 32)
    assert sw.shape == (*lead, widths[1])
    assert mx.array_equal(sw.reshape(m, -1), cuda_mma.swiglu(flat, gate, up, 32))
    with pytest.raises(ValueError, match="output shapes"):
        cuda_mma.matmul3(x, quants, 32, [(m, 4096), (m, 1024), (m, 1000)])
    bad = (quants[1][0], quants[1][1].astype(mx.float32), quants[1][2])
    for _ in range(2):
        with pytest.raises(ValueError, match="scales and biases must be"):
            cuda_mma.matmul(x, *bad, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16, 5])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_tensor_core_matmul_adds_the_residual_bit_for_bit(rows, dtype):
    """``matmul(..., residual=r)`` is ``r + matmul(...)`` bit for bit, in ``r``'s shape (a
    residual stream ``[1, rows, n]``, rows of whole 8-row tiles or padded); ``linear_add`` takes
    it on the tensor-core path and equals ``residual + linear`` either way; a residual of
    another dtype is refused."""
    n, k = 1024, 4096
    w = _weight(n, k, 4, 32, dtype, seed=7)
    rng = np.random.default_rng(8)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    r = mx.array(rng.standard_normal((1, rows, n)).astype(np.float32) * 4).astype(dtype)
    fused = cuda_mma.matmul(x, w.weight, w.scales, w.biases, 32, residual=r)
    assert fused.shape == (1, rows, n)
    assert mx.array_equal(fused, r + cuda_mma.matmul(x, w.weight, w.scales, w.biases, 32))
    mma = CONFIG.replace(mma_rows=(2, 32))
    xb = x if rows in (8, 16) else mx.zeros((8, k), dtype=dtype)
    rb = r if rows in (8, 16) else mx.zeros((1, 8, n), dtype=dtype)
    assert mx.array_equal(ops.linear_add(xb, w, rb, mma), rb + ops.linear(xb, w, mma))
    with pytest.raises(ValueError, match="residual"):
        cuda_mma.matmul(x, w.weight, w.scales, w.biases, 32, residual=r.astype(mx.float32))
    with pytest.raises(ValueError, match="does not hold"):
        cuda_mma.matmul(x, w.weight, w.scales, w.biases, 32, residual=r[:, :, :8])


def test_linear_add_is_the_residual_plus_the_product():
    """Off the tensor-core path (here: the CPU, or rows outside the plan's range),
    ``linear_add`` is ``residual + linear`` exactly, broadcasting as ``+`` does."""
    w = _weight(64, 128, 4, 32, mx.float32, seed=3)
    rng = np.random.default_rng(9)
    x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
    r = mx.array(rng.standard_normal((1, 3, 64)).astype(np.float32))
    got = ops.linear_add(x, w, r, CONFIG)
    assert got.shape == (1, 3, 64) and mx.array_equal(got, r + ops.linear(x, w, CONFIG))
    column = mx.array(rng.standard_normal((3, 1, 64)).astype(np.float32))
    wide = ops.linear_add(x, w, column, CONFIG)  # broadcasts to [3, 3, 64], as + does
    assert wide.shape == (3, 3, 64) and mx.array_equal(wide, column + ops.linear(x, w, CONFIG))


@pytest.mark.gpu
def test_tensor_core_range_measurement_reports_every_row_count():
    lo, hi, times = measure_mma_rows((256, 512), "float16", repeats=1)
    assert set(times) == set(MMA_ROWS)
    assert (lo.value, hi.value) == mma_range(times)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 24, 33])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "widths, k",
    [((96, 32, 32), 640), ((4096, 1024, 1024), 4096), ((576, 192, 192), 576)],
    ids=["small", "two-row-tiles", "two-words-per-lane"],
)
def test_fused_kernels_match_their_parts(rows, dtype, widths, k):
    """matmul3 gives each of three weights' products bit for bit as matmul does (the 8B shape
    takes two row tiles per warp up to 32 rows; K = 576 reads two words per lane, over warps
    some of which get no chunk); SwiGLU of a gate and an up weight matches the float32
    reference; a row's result does not depend on the other rows."""
    tol = 4e-3 if dtype == mx.bfloat16 else 1e-3
    x = mx.array(np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32))
    x = x.astype(dtype)
    parts = [_weight(n, k, 4, 32, dtype, seed=i) for i, n in enumerate(widths)]  # all differ
    quants = [(p.weight, p.scales, p.biases) for p in parts]
    assert cuda_mma.fusable(quants, k)
    outs = cuda_mma.matmul3(x, quants, 32)
    for got, p in zip(outs, parts, strict=True):
        assert got.shape == (rows, p.shape[0]) and got.dtype == dtype
        assert mx.array_equal(got, cuda_mma.matmul(x, p.weight, p.scales, p.biases, 32))
        ref = x.astype(mx.float32) @ _dense_reference(p, dtype).astype(mx.float32).T
        assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < tol
    few = x[:2] if rows > 1 else x  # one row is the matvec's, more the tensor cores'
    alone = cuda_mma.matmul3(few, quants, 32)
    assert all(mx.array_equal(a[0], o[0]) for a, o in zip(alone, outs, strict=True))

    gate, up = parts[0], _weight(widths[0], k, 4, 32, dtype, seed=5)
    got = cuda_mma.swiglu(x, quants[0], (up.weight, up.scales, up.biases), 32)
    xf = x.astype(mx.float32)
    g = xf @ _dense_reference(gate, dtype).astype(mx.float32).T
    u = xf @ _dense_reference(up, dtype).astype(mx.float32).T
    ref = g * mx.sigmoid(g) * u
    assert got.shape == (rows, widths[0]) and got.dtype == dtype
    assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 2 * tol
    one = cuda_mma.swiglu(few, quants[0], (up.weight, up.scales, up.biases), 32)
    assert mx.array_equal(one[0], got[0])
    with pytest.raises(ValueError, match="differ in shape"):
        cuda_mma.swiglu(x, quants[0], quants[1], 32)


def test_fused_products_answer_only_where_the_tensor_core_path_applies(monkeypatch):
    """``fused_qkv`` / ``fused_swiglu`` call the fused kernels only where every weight's product
    takes the tensor-core path for the (bucketed) row count, no row tile is set, the group sizes
    agree and (Q/K/V) the K splits agree; else they answer None and the model calls
    :func:`linear`. The kernels are replaced by recorders here, so this runs on every backend."""
    import strata.executor.ops as ops
    from strata.executor.ops import fused_qkv, fused_swiglu, set_row_tile

    calls: list[str] = []

    def matmul3(x, parts, group, shapes=None, signature=None, rope=None):
        calls.append("qkv")
        shapes = shapes or [(*x.shape[:-1], p[0].shape[0]) for p in parts]
        return [mx.zeros(s, x.dtype) for s in shapes]

    def swiglu(x, gate, up, group, signature=None):
        calls.append("swiglu")
        return mx.zeros((*x.shape[:-1], gate[0].shape[0]), x.dtype)

    paths: dict[int, str] = {}
    monkeypatch.setattr(ops.cuda_mma, "matmul3", matmul3)
    monkeypatch.setattr(ops.cuda_mma, "swiglu", swiglu)
    monkeypatch.setattr(ops, "kernel_path", lambda rows, w, dtype, c: paths.get(rows, "mma"))
    monkeypatch.setattr(ops, "_FUSABLE", {})  # answers kept per shape: none from other tests
    c = CONFIG
    ws = [_weight(n, 128, dtype=mx.float16, seed=i) for i, n in enumerate((64, 32, 32))]
    x = mx.zeros((1, 5, 128), mx.float16)
    q, k, v = fused_qkv(x, ws, c)
    assert (q.shape, k.shape, v.shape) == ((1, 5, 64), (1, 5, 32), (1, 5, 32))
    calls.clear()
    shaped = fused_qkv(x, ws, c, [(5, 2, 1, 32), (5, 1, 1, 32), (5, 1, 32)])
    assert [a.shape for a in shaped] == [(5, 2, 1, 32), (5, 1, 1, 32), (5, 1, 32)]
    assert fused_swiglu(x, ws[1], ws[2], c).shape == (1, 5, 32) and calls == ["qkv", "swiglu"]
    calls.clear()
    assert fused_swiglu(x, ws[0], ws[1], c) is None  # gate and up of different shapes
    paths[8 if c.pad_rows else 5] = "quantized"  # the row count's path is not the kernel's
    ops._FUSABLE.clear()  # the answers above came from the paths before this change
    assert fused_qkv(x, ws, c) is None and fused_swiglu(x, ws[1], ws[2], c) is None
    paths.clear()
    ops._FUSABLE.clear()
    try:
        set_row_tile(16)  # batch-invariant serving: every product on linear's tiles
        assert fused_qkv(x, ws, c) is None and fused_swiglu(x, ws[1], ws[2], c) is None
    finally:
        set_row_tile(0)
    other_group = _weight(32, 128, group=64, dtype=mx.float16)
    assert fused_qkv(x, [ws[0], ws[1], other_group], c) is None
    assert fused_swiglu(x, ws[1], other_group, c) is None
    split = [_weight(n, 1024, dtype=mx.float16) for n in (16384, 16, 16)]  # 2 and 4 warps
    assert not cuda_mma.fusable([(w.weight, w.scales, w.biases) for w in split], 1024)
    assert fused_qkv(mx.zeros((1, 5, 1024), mx.float16), split, c) is None
    # one row (the matvec) of mixed bits, as a Q4_K_M model's 8-bit V by 4-bit Q and K: the
    # kernel unpacks one bit width a call, so each weight takes its own
    mixed = [_weight(32, 128, bits, dtype=mx.float16) for bits in (4, 4, 8)]
    row = mx.zeros((1, 1, 128), mx.float16)
    assert not cuda_mma.fusable([w.parts for w in mixed], 128, 1)
    assert cuda_mma.fusable([w.parts for w in mixed[:2]], 128, 1)
    assert fused_qkv(row, mixed, c) is None and fused_swiglu(row, mixed[1], mixed[2], c) is None
    assert calls == []


def test_kernel_source_is_compacted_without_changing_code():
    """What MLX is given (and hashes at every evaluation) loses comments, indentation and blank
    lines, keeps one line per line and a macro's backslashes, and refuses where dropping text
    could change the code."""
    from strata.executor.cuda_source import compact

    src = """
    // a comment
    #pragma unroll
    for (int i = 0; i < 4; ++i)   // trailing
        x += i;

    #define M(a)     \\
        a + 1
    """
    want = ["#pragma unroll", "for (int i = 0; i < 4; ++i)", "x += i;", "#define M(a) \\", "a + 1"]
    assert compact(src) == "\n".join(want) + "\n"
    for unsafe in (
        'printf("a"); // b',  # the // could be inside the string
        "x = 1; /* b */",
        "x = 1; // b \\\ny = 2;",  # the comment continues onto y = 2
        "#define M(a) \\\n\n  a + 1",  # a blank line ends the macro; dropping it would not
        "#define M(a) \\\n  // note\n  a + 1",
        'const char* s = "a \\\n  b";',  # the indentation is inside the string
    ):
        with pytest.raises(ValueError, match="cannot compact"):
            compact(unsafe)
    assert compact("#define M(a) \\\n  a + 1 // sum") == "#define M(a) \\\na + 1\n"
    for store in cuda_mma._STORE:  # Strata's own sources pass, and shrink
        body = cuda_mma._BODY.replace("STRATA_TILES", cuda_mma._TILES[store])
        body += cuda_mma._STORE[store]
        assert len(compact(body)) < 0.7 * len(body)
    from strata.executor import cuda_attention
    from strata.executor.cuda_source import MMA_M16N8K16

    for header in (cuda_attention._HEADER + MMA_M16N8K16, cuda_mma._HEADER + MMA_M16N8K16):
        assert "strata_mma(" in compact(header)  # the shared tensor-core product survives


@pytest.mark.parametrize(
    ("info", "ok"),
    [
        ({"architecture": "sm_90"}, True),
        ({"architecture": "sm_80"}, True),
        ({"architecture": "sm_90a"}, True),
        ({"architecture": "sm_75"}, False),  # no mma.m16n8k16 of bfloat16, no cp.async
        ({}, True),  # an MLX that does not report it: assumed
    ],
)
def test_kernels_need_sm_80(info, ok, monkeypatch):
    """Strata's tensor-core kernels are offered only on a GPU that runs them, by the
    architecture MLX reports; never off MLX's CUDA backend."""
    from strata.executor import cuda_attention, cuda_source

    monkeypatch.setattr(mx, "device_info", lambda *a: info)
    cuda_source._compute_capability.cache_clear()
    try:
        monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
        assert cuda_source.tensor_cores() is ok
        assert cuda_attention.supported(24, 32, 8, 128, mx.float16) is ok
        assert cuda_mma.supported(24, 4096, 4096, 4, 32, mx.float16) is ok
        monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
        assert not cuda_source.tensor_cores()
    finally:
        cuda_source._compute_capability.cache_clear()


def test_only_the_models_own_silu_takes_the_fused_swiglu():
    """A subclass that changes the FFN's activation (Gemma 3's GeGLU) never takes
    ``fused_swiglu``, which computes SiLU itself."""
    from strata.executor.models.gemma3 import Gemma3Model
    from strata.executor.models.llama import LlamaModel
    from strata.executor.models.qwen3 import Qwen3Model

    assert object.__new__(LlamaModel).swiglu
    assert object.__new__(Qwen3Model).swiglu
    assert not object.__new__(Gemma3Model).swiglu


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 24])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "freqs, dims, scale, hd",
    [(True, 128, 1.0, 128), (False, 128, 1.0, 128), (False, 64, 0.25, 128), (True, 72, 1.0, 72)],
)
def test_rope_in_the_qkv_store_is_mlx_rope(rows, dtype, freqs, dims, scale, hd):
    """``matmul3(..., rope=Rope(...))`` gives Q and K as ``mx.fast.rope(traditional=True)``
    rotates ``matmul3``'s products, bit for bit (Llama 3's frequencies, a base alone, a partial
    rotation with a linear position scale, heads of 72 columns that a block's 16-column tiles
    straddle), and V untouched; K written ``[m, kv_heads, d]``. The heads-of-72 case was added
    after the H200 run that passed the others (2026-12-02) and has not run there yet."""
    from strata.executor.models.llama import _log2f

    rng = np.random.default_rng(7)
    k, base = 4096, 500000.0
    heads, kv_heads = (32, 8) if hd == 128 else (16, 4)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    widths = (heads * hd, kv_heads * hd, kv_heads * hd)
    parts = [_weight(n, k, 4, 32, dtype, seed=i) for i, n in enumerate(widths)]
    quants = [(p.weight, p.scales, p.biases) for p in parts]
    positions = mx.array(rng.integers(0, 6000, rows).astype(np.int32))
    inv = None
    if freqs:  # as LlamaModel._inverse_freqs makes them: base ** (2i / dims) times the factors
        factors = mx.array(rng.uniform(1.0, 8.0, dims // 2).astype(np.float32))
        inv = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors
    params = mx.array([scale, _log2f(base)], dtype=mx.float32)
    rope = cuda_mma.Rope(positions, params, inv, hd, dims)
    shapes = [(rows, heads, 1, hd), (rows, kv_heads, hd), (rows, kv_heads, hd)]
    q, kk, v = cuda_mma.matmul3(x, quants, 32, shapes, rope=rope)
    unrotated = [shapes[0], (rows, kv_heads, 1, hd), shapes[2]]
    q0, k0, v0 = cuda_mma.matmul3(x, quants, 32, unrotated)

    def mlx_rope(a):
        return mx.fast.rope(
            a, dims, traditional=True, base=None if freqs else base, scale=scale,
            offset=positions, freqs=inv,
        )  # fmt: skip

    assert mx.array_equal(v, v0)
    assert q.shape == shapes[0] and mx.array_equal(q, mlx_rope(q0))
    assert kk.shape == shapes[1] and mx.array_equal(kk, mlx_rope(k0).reshape(shapes[1]))
    with pytest.raises(ValueError, match="positions must be int32"):
        bad = cuda_mma.Rope(positions.astype(mx.int64), params, inv, hd, dims)
        cuda_mma.matmul3(x, quants, 32, shapes, rope=bad)
    with pytest.raises(ValueError, match="whole heads"):
        odd = cuda_mma.Rope(positions, params, None, 96 if hd == 128 else 128, 96)
        cuda_mma.matmul3(x, quants, 32, shapes, rope=odd)


@pytest.mark.parametrize("rope_freqs", [True, False], ids=["llama3-factors", "base"])
def test_the_model_hands_the_qkv_product_its_own_rope(
    rope_freqs, monkeypatch, tmp_path, smollm2_gguf
):
    """Where the fused Q/K/V product applies, the model gives it the RoPE it would apply itself
    (``LlamaModel._fused_rope``) and skips its own: with the fused product replaced by its
    definition (the three products, then ``mx.fast.rope`` from the ``cuda_mma.Rope`` received),
    a pass's logits and KV pool equal those of the pass that RoPEs in the model, bit for bit.
    Each Rope carries the pass's positions, Llama 3's frequencies (or none) and the base's
    float32 log2. Runs on every backend."""
    import dataclasses

    import gguf
    import strata.executor.models.llama as llama
    from conftest import make_plan_file
    from gguf_factory import ARCH_MODELS, write_arch_model
    from strata.executor.engine import Engine
    from strata.executor.paged_kv import ForwardBatch, SeqInput
    from strata.executor.plan_loader import load_plan

    # Q4_0 block matrices: quantized weights, which the fused product takes.
    arch = dataclasses.replace(ARCH_MODELS["llama3"], matrix_type=gguf.GGMLQuantizationType.Q4_0)
    if not rope_freqs:
        arch = dataclasses.replace(arch, rope_freqs=0)
    gguf = write_arch_model(tmp_path / "m.gguf", "llama3", smollm2_gguf, model=arch)
    loaded = load_plan(make_plan_file(str(gguf), tmp_path / "p.yaml"))
    config = RuntimeConfig.build(loaded.plan.runtime)
    engines = {f: Engine(loaded, config=config.replace(fused_rope=f)) for f in (False, True)}
    model = engines[True].model
    hd, base = model.arch.head_dim, model.arch.rope_freq_base
    received: list = []

    def fused_by_definition(x, ws, config, shapes=None, rope=None):
        outs = [linear(x, w, config).reshape(s) for w, s in zip(ws, shapes, strict=True)]
        received.append(rope)
        if rope is None:
            return outs
        rows = shapes[0][0]

        def rotate(a, shape):
            a = a.reshape(rows, -1, 1, hd)
            scale = rope.params[0].item()
            b = None if rope.freqs is not None else base
            r = mx.fast.rope(a, rope.dims, traditional=True, base=b, scale=scale,
                             offset=rope.positions, freqs=rope.freqs)  # fmt: skip
            return r.reshape(shape)

        return [rotate(outs[0], shapes[0]), rotate(outs[1], shapes[1]), outs[2]]

    monkeypatch.setattr(llama, "fused_qkv", fused_by_definition)
    monkeypatch.setattr(llama, "fused_swiglu", lambda *a: None)
    vocab = model.arch.vocab_size
    rng = np.random.default_rng(1)
    seqs = [
        SeqInput(rng.integers(0, vocab, 7).tolist(), 0, np.arange(7, dtype=np.int32), "all"),
        SeqInput(rng.integers(0, vocab, 5).tolist(), 0, np.arange(40, 45, dtype=np.int32), "all"),
    ]

    def run(fused: bool):
        model = engines[fused].model
        received.clear()
        kv = model.make_paged_cache(16, 4)
        batch = ForwardBatch.build(seqs)
        logits = model.forward_batch(batch, kv)
        return np.array(logits), [np.array(a) for a in kv.keys + kv.values], batch

    want, want_kv, _ = run(False)
    assert received and all(r is None for r in received)
    got, got_kv, batch = run(True)
    assert len(received) == model.arch.block_count and all(received)
    rows = model.pass_rows(batch.num_tokens)
    for r in received:
        assert np.array_equal(np.array(r.positions), np.array(batch.positions(rows)))
        assert (r.freqs is not None) == rope_freqs and (r.head_dim, r.dims) == (hd, hd)
        assert r.params.tolist() == pytest.approx([1.0, np.log2(base)], rel=1e-6)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_kv, want_kv, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_rope_in_the_store_is_declined_where_the_model_ropes_otherwise():
    """``LlamaModel._fused_rope`` hands the Q/K/V product a RoPE only for llama's own adjacent-pair
    RoPE of an even width within the head: none for NEOX RoPE (qwen2), Q/K norms (qwen3), a
    subclass with its own ``_rope``, a width of 0, odd or wider than the head, YaRN or a RoPE
    magnitude factor (``rope.scaling.attn_factor``), or with the config's ``fused_rope`` off."""
    from types import SimpleNamespace

    from strata.executor.models.llama import LayerAttention, LlamaModel
    from strata.executor.models.qwen2 import Qwen2Model
    from strata.executor.models.qwen3 import Qwen3Model

    class OwnRope(LlamaModel):
        def _rope(self, x, la, offset, freqs):
            return x

    def model(
        cls,
        dims: int = 64,
        head_dim: int = 64,
        config: RuntimeConfig = CONFIG,
        scaling: str = "none",
        attn_factor: float = 1.0,
    ):
        m = object.__new__(cls)
        m.arch = SimpleNamespace(
            rope_dimension_count=dims,
            head_dim=head_dim,
            rope_scaling_type=scaling,
            rope_attn_factor=attn_factor,
        )
        m._rope_params, m.config = {}, config
        return m

    la = LayerAttention(10000.0, 1.0, False, 0)
    positions = mx.array(np.arange(4, dtype=np.int32))
    rope = model(LlamaModel)._fused_rope(la, positions, None)
    assert rope is not None and (rope.head_dim, rope.dims, rope.freqs) == (64, 64, None)
    assert rope.params.tolist() == pytest.approx([1.0, np.log2(10000.0)], rel=1e-6)
    for m in (model(Qwen2Model), model(Qwen3Model), model(OwnRope)):
        assert m._fused_rope(la, positions, None) is None
    for dims in (0, 63, 66):
        assert model(LlamaModel, dims)._fused_rope(la, positions, None) is None
    off = CONFIG.replace(fused_rope=False)
    assert model(LlamaModel, config=off)._fused_rope(la, positions, None) is None
    assert model(LlamaModel, scaling="yarn")._fused_rope(la, positions, None) is None
    assert model(LlamaModel, attn_factor=1.25)._fused_rope(la, positions, None) is None


def test_fused_projections_off_makes_each_projection_its_own_call(
    monkeypatch, tmp_path, smollm2_gguf
):
    """With the runtime config's ``fused_projections`` off the model never asks for the fused
    Q/K/V or gate/up product (each projection is its own ``linear``); on, it asks once per
    block for each (here they decline, as off CUDA): the same logits either way."""
    import dataclasses

    import gguf
    import strata.executor.models.llama as llama
    from conftest import make_plan_file
    from gguf_factory import ARCH_MODELS, write_arch_model
    from strata.executor.engine import Engine
    from strata.executor.paged_kv import ForwardBatch, SeqInput
    from strata.executor.plan_loader import load_plan

    arch = dataclasses.replace(ARCH_MODELS["llama3"], matrix_type=gguf.GGMLQuantizationType.Q4_0)
    path = write_arch_model(tmp_path / "m.gguf", "llama3", smollm2_gguf, model=arch)
    loaded = load_plan(make_plan_file(str(path), tmp_path / "p.yaml"))
    config = RuntimeConfig.build(loaded.plan.runtime)
    asked: list[str] = []
    monkeypatch.setattr(llama, "fused_qkv", lambda *a: asked.append("qkv"))
    monkeypatch.setattr(llama, "fused_swiglu", lambda *a: asked.append("swiglu"))
    logits = {}
    for fused in (True, False):
        model = Engine(loaded, config=config.replace(fused_projections=fused)).model
        asked.clear()
        seq = SeqInput(list(range(5)), 0, np.arange(5, dtype=np.int32), "all")
        out = model.forward_batch(ForwardBatch.build([seq]), model.make_paged_cache(4, 4))
        logits[fused] = np.array(out)
        blocks = model.arch.block_count
        assert sorted(asked) == (["qkv"] * blocks + ["swiglu"] * blocks if fused else [])
    np.testing.assert_array_equal(logits[True], logits[False])
