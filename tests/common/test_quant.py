"""strata.common.quant / executor.ops: GGUF quants repacked onto MLX affine, exact or measured.

Reference: ``gguf.quants.dequantize`` (gguf-py's numpy port of ggml-quants.c). Tensors
are written with ``gguf.GGUFWriter`` and read back with ``gguf.GGUFReader`` so the bytes
are exactly what a real file holds. Exact types must match it bit for bit; the requantized
ones (Q6_K, Q2_K) within half a step of their groups, with their error measured on random
blocks and on realistic weights (Gemma-3-270M's own Q6_K tensors; Gaussian weights
quantized to Q2_K here).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from strata.common.describe import mlx_size
from strata.common.quant import (
    EXACT_TYPES,
    SUPPORTED_TYPES,
    PackedWeight,
    UnsupportedQuantError,
    _pack_bits,
    _requantize,
    gguf_nbytes,
    mlx_nbytes,
    repack,
)
from strata.executor.config import RuntimeConfig
from strata.executor.ops import QuantLinear, embedding, linear, to_mlx

T = GGMLQuantizationType
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)

#: type -> (MLX bits, group size, scale dtype): executor/quant.py's table.
LAYOUT = {
    T.Q4_0: (4, 32, F16),
    T.Q4_1: (4, 32, F16),
    T.Q5_0: (5, 32, F16),
    T.Q5_1: (5, 32, F16),
    T.Q8_0: (8, 32, F16),
    T.IQ4_NL: (8, 32, F16),
    T.Q4_K: (4, 32, F32),
    T.Q5_K: (5, 32, F32),
    T.IQ4_XS: (8, 32, F32),
    T.Q3_K: (8, 128, F16),
    T.Q6_K: (8, 32, F16),
    T.Q2_K: (4, 32, F16),
}
REQUANTIZED = [T.Q6_K, T.Q2_K]
EXACT = [t for t in LAYOUT if t not in REQUANTIZED]
FLOATS = {T.F32, T.F16, T.BF16}

#: Byte offsets of each block's float16 fields (d, then dmin or m): ggml-common.h.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.IQ4_NL: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.IQ4_XS: [0],
    T.Q3_K: [108],
    T.Q6_K: [208],
    T.Q2_K: [80, 82],
}


def shapes(qtype: GGMLQuantizationType) -> list[tuple[int, int]]:
    """A square-ish and a 3-row matrix of whole blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    return [(64, 256), (3, 3 * block)]


def _random_d(rng: np.random.Generator, n: int, max_exp: int) -> np.ndarray:
    """Non-zero float16 scales of varied magnitude (2**-14 .. 2**max_exp) and sign."""
    mag = 2.0 ** rng.uniform(-14, max_exp, n) * rng.uniform(1, 2, n)
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * mag).astype(np.float16)


def make_raw(
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    seed: int = 0,
    d: np.ndarray | None = None,
    max_exp: int = 6,
) -> np.ndarray:
    """Random GGUF blocks for a (rows, cols) tensor: uint8 [rows, bytes_per_row].

    Every byte is random but the float16 fields, which are random non-zero finite values
    below ``2**(max_exp + 1)`` (``d``, when given, for the first field of each block).
    """
    rng = np.random.default_rng(seed)
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_size
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for i, offset in enumerate(F16_FIELDS[qtype]):
        values = d if d is not None and i == 0 else _random_d(rng, n, max_exp)
        blocks[:, offset : offset + 2] = values.astype(np.float16).reshape(n, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def roundtrip(tmp_path: Path, tensors: dict[str, tuple[GGMLQuantizationType, np.ndarray]]):
    """Write raw tensors into a GGUF file and read them back: name -> ReaderTensor."""
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(path, arch="llama")
    for name, (qtype, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in GGUFReader(path).tensors}


def numpy_shape(tensor) -> tuple[int, ...]:
    """GGUF shape [ne0, ne1, ...] reversed into numpy order."""
    return tuple(int(s) for s in reversed(tensor.shape))


def mlx_dequantize_f32(p: PackedWeight) -> np.ndarray:
    out = mx.dequantize(
        mx.array(p.weight),
        mx.array(p.scales.astype(np.float32)),
        mx.array(p.biases.astype(np.float32)),
        group_size=p.group_size,
        bits=p.bits,
    )
    return np.array(out)


def expected_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, int], dtype=None) -> int:
    bits, group, scale_dtype = LAYOUT[qtype]
    itemsize = np.dtype(dtype or scale_dtype).itemsize
    return shape[0] * shape[1] * bits // 8 + 2 * shape[0] * shape[1] // group * itemsize


def check_linear_embedding(p: PackedWeight, values: np.ndarray) -> None:
    """``linear`` (float16 or widened scales) is ``x @ values.T`` to float32 accuracy, and
    ``embedding`` gives exactly ``values``' rows; ``values`` is what ``p`` dequantizes to."""
    rows, cols = p.shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, cols)).astype(np.float32)
    want = x.astype(np.float64) @ values.T.astype(np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(values).T) + 1e-30
    outs = []
    for dtype in (None, mx.float32):
        w = to_mlx(p, dtype)
        assert isinstance(w, QuantLinear) and w.shape == p.shape
        widened = p.weight.nbytes + 2 * p.scales.size * 4  # float32 scales and biases
        assert w.nbytes == (p.nbytes if dtype is None else widened)
        y = linear(mx.array(x), w, RuntimeConfig.build())
        assert y.dtype == mx.float32 and y.shape == (2, 5, rows)
        outs.append(np.array(y))
        assert np.all(np.abs(outs[-1] - want) <= bound)
    # float16 scales are cast to the activation dtype, identically
    np.testing.assert_array_equal(outs[0], outs[1])

    # embedding: exactly the dequantized rows, any ids shape, stored scales
    ids = np.array([[rows - 1, 0, 1], [2, 2, rows - 1]], dtype=np.int32)
    emb = embedding(mx.array(ids), to_mlx(p))
    assert emb.dtype == mx.float32 and emb.shape == (2, 3, cols)
    np.testing.assert_array_equal(np.array(emb), values[ids])
    np.testing.assert_array_equal(
        np.array(embedding(mx.array(7 % rows), to_mlx(p))), values[7 % rows]
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_matches_mlx(bits):
    """MLX's layout: each row a little-endian bit stream of its codes (mx.dequantize)."""
    q = np.random.default_rng(bits).integers(0, 1 << bits, (3, 128), dtype=np.uint8)
    words = _pack_bits(q.reshape(-1), bits).view(np.uint32).reshape(3, -1)
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    got = mx.dequantize(mx.array(words), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), q.astype(np.float32))


@pytest.mark.parametrize(
    ("qtype", "shape"),
    [(t, s) for t in EXACT for s in shapes(t)],
    ids=lambda v: v.name if isinstance(v, GGMLQuantizationType) else "x".join(map(str, v)),
)
def test_repack_bit_exact_linear_embedding(tmp_path, qtype, shape):
    tensor = roundtrip(tmp_path, {"w": (qtype, make_raw(qtype, shape))})["w"]
    assert tensor.tensor_type == qtype
    assert numpy_shape(tensor) == shape
    ref = dequantize(tensor.data, qtype).reshape(shape)
    assert np.count_nonzero(ref) > ref.size // 2

    p = repack(qtype, tensor.data, numpy_shape(tensor))
    assert isinstance(p, PackedWeight)
    bits, group, dtype = LAYOUT[qtype]
    assert (p.bits, p.group_size, p.shape) == (bits, group, shape)
    assert p.weight.dtype == np.uint32 and p.weight.shape == (shape[0], shape[1] * bits // 32)
    assert p.scales.shape == p.biases.shape == (shape[0], shape[1] // group)
    assert p.scales.dtype == p.biases.dtype == dtype

    # dequantize: bit for bit
    np.testing.assert_array_equal(mlx_dequantize_f32(p), ref)
    check_linear_embedding(p, ref)

    # size: what mlx_nbytes and the planner's model description count
    assert p.nbytes == mlx_nbytes(qtype, shape) == expected_nbytes(qtype, shape)
    assert mlx_size(qtype, [shape[1], shape[0]]) == (p.nbytes, True)
    assert gguf_nbytes(qtype, shape) == tensor.n_bytes
    assert mlx_nbytes(qtype, shape, scale_dtype=np.float32) == expected_nbytes(
        qtype, shape, np.float32
    )


def requantization_error(p: PackedWeight, ref: np.ndarray) -> np.ndarray:
    """|MLX - reference| per group ``[n_groups, group_size]``, checked against the stated
    bounds: every element within half a step (plus float32 rounding), and each group's step
    its range over ``2**bits - 1``, rounded up to ``p.scales.dtype``."""
    got = mlx_dequantize_f32(p).astype(np.float64)
    ref = ref.astype(np.float64).reshape(-1, p.group_size)
    err = np.abs(got.reshape(ref.shape) - ref)
    scale = p.scales.astype(np.float64).reshape(-1, 1)
    bias = p.biases.astype(np.float64).reshape(-1, 1)
    assert np.all(err <= scale / 2 + 2e-7 * (np.abs(ref) + np.abs(bias)))

    top = (1 << p.bits) - 1
    lo, hi = ref.min(axis=1, keepdims=True), ref.max(axis=1, keepdims=True)
    ulp = 2.0 ** -(np.finfo(p.scales.dtype).nmant)
    tiny = float(np.finfo(p.scales.dtype).smallest_subnormal)
    assert np.all(bias <= lo) and np.all(lo - bias <= ulp * np.abs(lo) + tiny)
    assert np.all(scale * top <= (hi - lo + ulp * np.abs(lo) + tiny) * (1 + ulp) + top * tiny)
    return err


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: t.name)
def test_requantized_random_blocks(tmp_path, qtype):
    """Random blocks (unrelated neighbouring sub-blocks: the worst case) stay within half a
    step; their measured relative RMS error is bounded."""
    shape = (64, 512)
    raw = make_raw(qtype, shape, max_exp=2)  # Q6_K values up to 2**3 * 128 * 32: float16 scales
    tensor = roundtrip(tmp_path, {"w": (qtype, raw)})["w"]
    ref = dequantize(tensor.data, qtype).reshape(shape)
    p = repack(qtype, tensor.data, shape)
    bits, group, dtype = LAYOUT[qtype]
    assert (p.bits, p.group_size, p.scales.dtype, p.biases.dtype) == (bits, group, dtype, dtype)
    assert qtype not in EXACT_TYPES

    err = requantization_error(p, ref)
    rel_rms = np.sqrt(np.mean(err**2) / np.mean(ref.astype(np.float64) ** 2))
    # measured: Q6_K 4.0e-3, Q2_K 2.5e-2
    assert rel_rms <= {T.Q6_K: 5e-3, T.Q2_K: 3e-2}[qtype]

    values = mlx_dequantize_f32(p)
    check_linear_embedding(p, values)
    assert p.nbytes == mlx_nbytes(qtype, shape) == expected_nbytes(qtype, shape)
    assert mlx_size(qtype, [shape[1], shape[0]]) == (p.nbytes, True)


def noise_ratio(values: np.ndarray, step: np.ndarray, bits: int) -> float:
    """RMS error of requantizing ``values`` [n, 256] to ``bits`` over the RMS noise of the
    source type's own rounding, ``step / sqrt(12)`` (``step`` per element)."""
    q, scale, bias = _requantize(values.astype(np.float64), bits, 32)
    got = scale.reshape(-1, 1).astype(np.float64) * q.reshape(-1, 32) + bias.reshape(-1, 1)
    err = got.reshape(values.shape) - values
    return float(np.sqrt(np.mean(err**2) / np.mean(step.astype(np.float64) ** 2 / 12)))


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Float weights [n, 256] -> Q2_K blocks uint8 [n, 84]: min/max per sub-block of 16 (mins
    at most 0), 4-bit scales and mins relative to the block's float16 ``d`` and ``dmin``."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    d = ((hi - lo).max(1) / 45).astype(np.float16).reshape(n, 1)  # step = range/3 = d * sc
    dmin = ((-lo).max(1) / 15).astype(np.float16).reshape(n, 1)
    sc = np.clip(np.rint((hi - lo) / 3 / d.astype(np.float64)), 1, 15)
    m = np.clip(np.rint(-lo / np.maximum(dmin.astype(np.float64), 1e-30)), 0, 15)
    step = (d.astype(np.float64) * sc)[..., None]
    q = np.rint((sub + (dmin.astype(np.float64) * m)[..., None]) / step)
    q = np.clip(q, 0, 3).astype(np.uint8).reshape(n, 2, 4, 32)  # element h*128 + 32f + i
    qs = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(n, 64)
    scales = sc.astype(np.uint8) | (m.astype(np.uint8) << 4)
    return np.concatenate([scales, qs, d.view(np.uint8), dmin.view(np.uint8)], axis=1)


def test_q2_k_requantization_on_gaussian_weights(tmp_path):
    """4 bits add at most a quarter of Q2_K's own rounding noise; 3 bits would add more."""
    x = np.random.default_rng(5).standard_normal((256, 256)) * 0.02
    raw = quantize_q2_k(x).reshape(16, -1)  # a [16, 4096] tensor
    tensor = roundtrip(tmp_path, {"w": (T.Q2_K, raw)})["w"]
    ref = dequantize(tensor.data, T.Q2_K).reshape(16, 4096)
    p = repack(T.Q2_K, tensor.data, (16, 4096))
    err = requantization_error(p, ref)
    assert np.sqrt(np.mean(err**2) / np.mean(ref.astype(np.float64) ** 2)) <= 0.07  # 6.4e-2

    blocks = tensor.data.reshape(-1, 84)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float64)
    step = (d * (blocks[:, :16] & 15)).repeat(16, axis=1)
    values = ref.reshape(-1, 256)
    assert noise_ratio(values, step, 4) <= 0.25  # measured 0.20
    assert noise_ratio(values, step, 3) > 0.25  # measured 0.48


@pytest.fixture(scope="module")
def gemma3_tensors(gemma3_gguf):
    """The tensors of Gemma-3-270M Q4_K_M (reading its header takes ~8 s: read it once)."""
    return GGUFReader(gemma3_gguf).tensors


def test_q6_k_requantization_on_gemma(gemma3_tensors):
    """On Gemma-3-270M's real Q6_K tensors 8 bits add at most a quarter of Q6_K's own
    rounding noise (6 bits would add about as much again)."""
    tensors = [t for t in gemma3_tensors if t.tensor_type == T.Q6_K]
    assert len(tensors) == 9
    for t in tensors:
        shape = numpy_shape(t)
        ref = dequantize(t.data, T.Q6_K).reshape(shape)
        p = repack(T.Q6_K, t.data, shape)
        assert p.scales.dtype == F16
        err = requantization_error(p, ref)
        assert np.sqrt(np.mean(err**2) / np.mean(ref.astype(np.float64) ** 2)) <= 5.5e-3  # 4.9e-3

        blocks = t.data.reshape(-1, 210)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)
        step = (d * blocks[:, 192:208].view(np.int8)).repeat(16, axis=1)
        values = ref.reshape(-1, 256)
        assert noise_ratio(values, step, 8) <= 0.25  # measured at most 0.235
        assert noise_ratio(values, step, 6) > 0.9  # measured 0.95


@pytest.mark.parametrize(
    ("qtype", "big_d"),
    [
        (T.Q4_0, 8192.0),
        (T.Q8_0, 512.0),
        (T.Q8_0, -60000.0),
        (T.Q5_0, 4096.0),
        (T.IQ4_NL, 512.0),
        (T.Q3_K, 512.0),
    ],
    ids=["q4_0", "q8_0", "q8_0_neg", "q5_0", "iq4_nl", "q3_k"],
)
def test_float16_overflow_falls_back_to_float32(tmp_path, qtype, big_d):
    shape = (4, 2 * GGML_QUANT_SIZES[qtype][0])
    d = _random_d(np.random.default_rng(3), 8, max_exp=4)
    d[5] = big_d  # one block whose bias (-8d, -16d, -128d or 128d) overflows float16
    tensor = roundtrip(tmp_path, {"w": (qtype, make_raw(qtype, shape, d=d))})["w"]
    ref = dequantize(tensor.data, qtype).reshape(shape)

    p = repack(qtype, tensor.data, shape)
    assert p.scales.dtype == p.biases.dtype == np.float32
    np.testing.assert_array_equal(mlx_dequantize_f32(p), ref)
    assert p.nbytes == mlx_nbytes(qtype, shape, scale_dtype=np.float32)
    np.testing.assert_array_equal(np.array(embedding(mx.arange(4), to_mlx(p))), ref)
    with pytest.raises(ValueError, match="would change values"):
        to_mlx(p, mx.float16)


def test_requantized_float16_overflow_falls_back_to_float32(tmp_path):
    shape = (2, 512)
    d = _random_d(np.random.default_rng(4), 4, max_exp=4)
    d[1] = 60000.0  # values up to 60000 * 128 * 32: no float16 scale or bias holds them
    tensor = roundtrip(tmp_path, {"w": (T.Q6_K, make_raw(T.Q6_K, shape, d=d))})["w"]
    ref = dequantize(tensor.data, T.Q6_K).reshape(shape)
    p = repack(T.Q6_K, tensor.data, shape)
    assert p.scales.dtype == p.biases.dtype == np.float32
    requantization_error(p, ref)
    assert p.nbytes == mlx_nbytes(T.Q6_K, shape, scale_dtype=np.float32)


def test_largest_float16_bias_stays_float16():
    # |d| = 8188 gives -8d = -65504, float16's largest finite value: still exact
    d = np.full(2, 8188.0, dtype=np.float16)
    p = repack(T.Q4_0, make_raw(T.Q4_0, (1, 64), d=d), (1, 64))
    assert p.scales.dtype == np.float16
    assert np.all(p.biases == np.float16(-65504))


def test_float_types(tmp_path):
    rng = np.random.default_rng(2)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((7,)).astype(np.float16)
    tensors = roundtrip(tmp_path, {"a": (T.F32, f32), "b": (T.F16, f16)})
    a = repack(T.F32, tensors["a"].data, numpy_shape(tensors["a"]))
    b = repack(T.F16, tensors["b"].data, numpy_shape(tensors["b"]))
    assert a.dtype == np.float32 and np.array_equal(a, f32)
    assert b.dtype == np.float16 and np.array_equal(b, f16)
    assert mlx_nbytes(T.F32, (3, 5)) == a.nbytes and mlx_nbytes(T.F16, (7,)) == b.nbytes

    # BF16: the top 16 bits of float32 -> widened exactly to float32
    bf = (f32.view(np.uint32) >> 16).astype(np.uint16)
    c = repack(T.BF16, bf.view(np.uint8), (3, 5))
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c.view(np.uint32), bf.astype(np.uint32) << 16)

    # dense linear / embedding
    w = to_mlx(a)
    x = rng.standard_normal((2, 5)).astype(np.float32)
    got = linear(mx.array(x), w, RuntimeConfig.build())
    np.testing.assert_allclose(np.array(got), x @ f32.T, rtol=1e-5)
    np.testing.assert_array_equal(np.array(embedding(mx.array([2, 0]), w)), f32[[2, 0]])
    assert to_mlx(f16.reshape(1, 7), mx.float32).dtype == mx.float32


def test_supported_and_unsupported_types():
    # MXFP4: MLX's mxfp4 mode, not affine (tests/executor/test_quant_mxfp4.py).
    assert SUPPORTED_TYPES == set(LAYOUT) | FLOATS | {T.MXFP4}
    assert EXACT_TYPES == set(EXACT) | FLOATS | {T.MXFP4}
    for qtype in (T.IQ2_XXS, T.TQ1_0):
        raw = np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8)
        with pytest.raises(UnsupportedQuantError, match=rf"{qtype.name}.*later version"):
            repack(qtype, raw, (1, 256))
        with pytest.raises(ValueError):  # UnsupportedQuantError is a ValueError
            mlx_nbytes(qtype, (1, 256))
        assert mlx_size(qtype, [256, 1]) == (GGML_QUANT_SIZES[qtype][1], False)


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda t: t.name)
def test_bad_sizes(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (3, 3 * block)
    raw = make_raw(qtype, shape)
    with pytest.raises(ValueError, match=rf"\(3, {3 * block}\).*{qtype.name}.*bytes"):
        repack(qtype, raw.reshape(-1)[:-1], shape)
    with pytest.raises(ValueError, match=rf"\(4, {3 * block}\).*{qtype.name}"):
        repack(qtype, raw, (4, 3 * block))
    with pytest.raises(ValueError, match=f"multiple of the block size {block}"):
        repack(qtype, raw, (6, 3 * block // 2))
    with pytest.raises(ValueError, match="2-D"):
        repack(qtype, raw, (9 * block,))
    with pytest.raises(ValueError, match="multiple of the block size"):
        gguf_nbytes(qtype, (3, block + 8))


def test_linear_shape_mismatch():
    p = repack(T.Q4_0, make_raw(T.Q4_0, (3, 96)), (3, 96))
    with pytest.raises(ValueError, match="expects 96"):
        linear(mx.zeros((1, 64)), to_mlx(p), RuntimeConfig.build())


def test_smollm2_real_file(smollm2_gguf):
    """Every tensor of the real SmolLM2 file repacks; spot-check two bit for bit."""
    reader = GGUFReader(smollm2_gguf)
    total_gguf = total_mlx = 0
    for t in reader.tensors:
        shape = numpy_shape(t)
        w = repack(t.tensor_type, t.data, shape)
        total_gguf += t.n_bytes
        total_mlx += w.nbytes
        assert w.nbytes == mlx_nbytes(t.tensor_type, shape)
        if t.name == "blk.0.attn_q.weight":
            np.testing.assert_array_equal(
                mlx_dequantize_f32(w), dequantize(t.data, t.tensor_type).reshape(shape)
            )
        if t.name == "token_embd.weight":
            ids = np.array([0, 1, 2, 1000, 49151], dtype=np.int32)
            got = np.array(embedding(mx.array(ids), to_mlx(w)))
            np.testing.assert_array_equal(got, dequantize(t.data[ids], t.tensor_type))
    assert total_mlx <= 1.05 * total_gguf


def test_gemma3_real_file(gemma3_tensors):
    """Every tensor of Gemma-3-270M Q4_K_M (F32, Q8_0, Q5_0, Q4_K, Q6_K) repacks; in MLX form
    its weights take at most 1.10x the file's tensor bytes (measured 1.0915); the exact types
    are bit-exact (spot checks), and every size is what the model description counts."""
    total_gguf = total_mlx = 0
    exact = {"blk.0.attn_q.weight": T.Q5_0, "blk.3.attn_output.weight": T.Q4_K}
    for t in gemma3_tensors:
        shape = numpy_shape(t)
        w = repack(t.tensor_type, t.data, shape)
        total_gguf += t.n_bytes
        total_mlx += w.nbytes
        assert w.nbytes == mlx_nbytes(t.tensor_type, shape)
        assert mlx_size(t.tensor_type, [int(s) for s in t.shape]) == (w.nbytes, True)
        if t.name in exact:
            assert t.tensor_type == exact[t.name]
            np.testing.assert_array_equal(
                mlx_dequantize_f32(w), dequantize(t.data, t.tensor_type).reshape(shape)
            )
        if t.name == "token_embd.weight":
            ids = np.array([0, 2, 106, 262143], dtype=np.int32)
            got = np.array(embedding(mx.array(ids), to_mlx(w)))
            np.testing.assert_array_equal(got, dequantize(t.data[ids], t.tensor_type))
    assert total_mlx <= 1.10 * total_gguf
