"""executor.quant / executor.ops: GGUF legacy quants repacked onto MLX affine, bit-exact.

Reference: ``gguf.quants.dequantize`` (gguf-py's numpy port of ggml-quants.c). Tensors
are written with ``gguf.GGUFWriter`` and read back with ``gguf.GGUFReader`` so the bytes
are exactly what a real file holds.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from executor.ops import QuantLinear, embedding, linear, to_mlx
from executor.quant import (
    SUPPORTED_TYPES,
    PackedWeight,
    UnsupportedQuantError,
    gguf_nbytes,
    mlx_nbytes,
    repack,
)

T = GGMLQuantizationType
QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
SHAPES = [(64, 256), (3, 96)]


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
) -> np.ndarray:
    """Random non-zero GGUF blocks for a (rows, cols) tensor: uint8 [rows, bytes_per_row]."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_size
    if d is None:
        d = _random_d(rng, n, max_exp=6)
    parts = [d.astype(np.float16).reshape(n, 1).view(np.uint8)]
    if qtype == T.Q4_1:
        parts.append(_random_d(rng, n, max_exp=8).reshape(n, 1).view(np.uint8))
    if qtype == T.Q8_0:
        parts.append(rng.integers(-128, 128, (n, 32), dtype=np.int8).view(np.uint8))
    else:
        parts.append(rng.integers(0, 256, (n, 16), dtype=np.uint8))
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape == (n, type_size)
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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_repack_bit_exact_linear_embedding(tmp_path, qtype, shape):
    tensor = roundtrip(tmp_path, {"w": (qtype, make_raw(qtype, shape))})["w"]
    assert tensor.tensor_type == qtype
    assert numpy_shape(tensor) == shape
    ref = dequantize(tensor.data, qtype).reshape(shape)
    assert np.count_nonzero(ref) > ref.size // 2

    p = repack(qtype, tensor.data, numpy_shape(tensor))
    assert isinstance(p, PackedWeight)
    bits = 8 if qtype == T.Q8_0 else 4
    assert (p.bits, p.group_size, p.shape) == (bits, 32, shape)
    assert p.weight.dtype == np.uint32 and p.weight.shape == (
        shape[0],
        shape[1] * bits // 32,
    )
    assert p.scales.shape == p.biases.shape == (shape[0], shape[1] // 32)
    assert p.scales.dtype == p.biases.dtype == np.float16

    # dequantize: bit for bit
    np.testing.assert_array_equal(mlx_dequantize_f32(p), ref)

    # linear, with the stored float16 scales and with scales widened to float32
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(ref).T) + 1e-30
    outs = []
    for dtype in (None, mx.float32):
        w = to_mlx(p, dtype)
        assert isinstance(w, QuantLinear) and w.shape == shape
        assert w.nbytes == (
            p.nbytes if dtype is None else mlx_nbytes(qtype, shape, scale_dtype=np.float32)
        )
        y = linear(mx.array(x), w)
        assert y.dtype == mx.float32 and y.shape == (2, 5, shape[0])
        outs.append(np.array(y))
        assert np.all(np.abs(outs[-1] - want) <= bound)
    # float16 scales are cast to the activation dtype, identically
    np.testing.assert_array_equal(outs[0], outs[1])

    # embedding: exactly the dequantized rows, any ids shape, stored float16 scales
    ids = np.array([[shape[0] - 1, 0, 1], [2, 2, shape[0] - 1]], dtype=np.int32)
    emb = embedding(mx.array(ids), to_mlx(p))
    assert emb.dtype == mx.float32 and emb.shape == (2, 3, shape[1])
    np.testing.assert_array_equal(np.array(emb), ref[ids])
    np.testing.assert_array_equal(
        np.array(embedding(mx.array(7 % shape[0]), to_mlx(p))), ref[7 % shape[0]]
    )

    # size: exactly what mlx_nbytes predicts, and at most 1.25x the GGUF bytes
    assert p.nbytes == mlx_nbytes(qtype, shape)
    assert gguf_nbytes(qtype, shape) == tensor.n_bytes
    assert p.nbytes <= 1.25 * tensor.n_bytes


@pytest.mark.parametrize(
    ("qtype", "big_d"),
    [(T.Q4_0, 8192.0), (T.Q8_0, 512.0), (T.Q8_0, -60000.0)],
    ids=["q4_0", "q8_0", "q8_0_neg"],
)
def test_float16_overflow_falls_back_to_float32(tmp_path, qtype, big_d):
    shape = (4, 64)
    d = _random_d(np.random.default_rng(3), 8, max_exp=4)
    d[5] = big_d  # one block whose bias (-8d or -128d) overflows float16
    tensor = roundtrip(tmp_path, {"w": (qtype, make_raw(qtype, shape, d=d))})["w"]
    ref = dequantize(tensor.data, qtype).reshape(shape)

    p = repack(qtype, tensor.data, shape)
    assert p.scales.dtype == p.biases.dtype == np.float32
    np.testing.assert_array_equal(mlx_dequantize_f32(p), ref)
    assert p.nbytes == mlx_nbytes(qtype, shape, scale_dtype=np.float32)
    np.testing.assert_array_equal(np.array(embedding(mx.arange(4), to_mlx(p))), ref)
    with pytest.raises(ValueError, match="would change values"):
        to_mlx(p, mx.float16)


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
    np.testing.assert_allclose(np.array(linear(mx.array(x), w)), x @ f32.T, rtol=1e-5)
    np.testing.assert_array_equal(np.array(embedding(mx.array([2, 0]), w)), f32[[2, 0]])
    assert to_mlx(f16.reshape(1, 7), mx.float32).dtype == mx.float32


def test_unsupported_type():
    with pytest.raises(UnsupportedQuantError, match=r"Q4_K.*later version"):
        repack(T.Q4_K, np.zeros(144, np.uint8), (1, 256))
    with pytest.raises(ValueError):  # UnsupportedQuantError is a ValueError
        mlx_nbytes(T.IQ2_XXS, (1, 256))
    assert T.Q4_K not in SUPPORTED_TYPES
    assert {T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16, T.BF16} <= SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_bad_sizes(qtype):
    raw = make_raw(qtype, (3, 96))
    with pytest.raises(ValueError, match=rf"\(3, 96\).*{qtype.name}.*bytes"):
        repack(qtype, raw.reshape(-1)[:-1], (3, 96))
    with pytest.raises(ValueError, match=rf"\(4, 96\).*{qtype.name}"):
        repack(qtype, raw, (4, 96))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        repack(qtype, raw, (3 * 96 // 48, 48))
    with pytest.raises(ValueError, match="2-D"):
        repack(qtype, raw, (288,))
    with pytest.raises(ValueError, match="multiple of the block size"):
        gguf_nbytes(qtype, (3, 40))


def test_linear_shape_mismatch():
    p = repack(T.Q4_0, make_raw(T.Q4_0, (3, 96)), (3, 96))
    with pytest.raises(ValueError, match="expects 96"):
        linear(mx.zeros((1, 64)), to_mlx(p))


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
