"""MXFP4 (gpt-oss's expert type) repacked onto MLX's ``mode="mxfp4"``: exact against gguf-py's
dequantization, the file's bytes, and usable by MLX's quantized matmul."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from strata.common.describe import mlx_size
from strata.common.quant import (
    EXACT_TYPES,
    SUPPORTED_TYPES,
    UnsupportedQuantError,
    gguf_nbytes,
    mlx_nbytes,
    repack,
)
from strata.executor.config import RuntimeConfig
from strata.executor.ops import QuantLinear, embedding, linear, to_mlx

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def _mlx_values(packed) -> np.ndarray:
    w = to_mlx(packed)
    assert isinstance(w, QuantLinear) and w.mode == "mxfp4" and w.biases is None
    out = mx.dequantize(w.weight, w.scales, None, 32, 4, mode="mxfp4", dtype=mx.float32)
    return np.array(out)


def test_every_code_and_scale_is_exact():
    """Every scale byte 0..254 (subnormal 2^-128 and 2^-127 included, and the largest, whose
    big codes overflow to inf in both) with every 4-bit code in both nibble halves: MLX's values
    equal gguf-py's (code 8 is -0 in MLX's E2M1 and +0 in ggml's table: the same number)."""
    rng = np.random.default_rng(0)
    scales = np.arange(255, dtype=np.uint8)
    codes = np.stack([rng.permutation(16) for _ in range(2 * len(scales))]).astype(np.uint8)
    low, high = codes[0::2], codes[1::2]
    blocks = np.concatenate([scales[:, None], low | (high << 4)], axis=1)  # [255, 17]
    rows, cols = 15, 17 * 32  # 255 blocks as a 15 x 544 matrix
    packed = repack(MXFP4, blocks.reshape(-1), (rows, cols))
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in both
        want = gguf.quants.dequantize(blocks.reshape(rows, -1), MXFP4)
    got = _mlx_values(packed)
    assert want.shape == got.shape == (rows, cols)
    with np.errstate(over="ignore"):
        want = want.astype(np.float32)
    assert np.array_equal(got, want)
    assert np.array_equal(np.abs(got).view(np.uint32), np.abs(want).view(np.uint32))


def test_quantized_weights_are_exact_and_keep_the_files_bytes():
    rng = np.random.default_rng(1)
    values = rng.normal(0, 0.05, (48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, MXFP4)
    packed = repack(MXFP4, raw, values.shape)
    assert packed.mode == "mxfp4" and packed.scales.dtype == np.uint8
    assert packed.nbytes == gguf_nbytes(MXFP4, values.shape) == mlx_nbytes(MXFP4, values.shape)
    assert mlx_size(MXFP4, [96, 48]) == (packed.nbytes, True)
    assert MXFP4 in SUPPORTED_TYPES and MXFP4 in EXACT_TYPES
    want = gguf.quants.dequantize(raw, MXFP4)
    assert np.array_equal(_mlx_values(packed), want)


def test_products_and_rows_use_the_exact_values():
    rng = np.random.default_rng(2)
    values = rng.normal(0, 0.05, (40, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, MXFP4)
    w = to_mlx(repack(MXFP4, raw, values.shape), mx.float32)
    dense = gguf.quants.dequantize(raw, MXFP4)
    x = rng.normal(0, 1, (5, 64)).astype(np.float32)
    got = np.array(linear(mx.array(x), w, RuntimeConfig.build()))
    np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-5)
    rows = np.array(embedding(mx.array(np.array([3, 0, 39], np.int32)), w))
    assert np.array_equal(rows, dense[[3, 0, 39]])


def test_scale_255_is_refused():
    """As an UnsupportedQuantError, which ``executor.pack`` turns into one line naming the
    tensor (a plain ValueError would reach the user as a traceback)."""
    block = np.zeros((1, 17), np.uint8)
    block[0, 0] = 255
    with pytest.raises(UnsupportedQuantError, match="scale byte 255"):
        repack(MXFP4, np.tile(block, (1, 1)).reshape(-1), (1, 32))
