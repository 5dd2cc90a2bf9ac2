"""Repack GGUF tensors into MLX's affine quantization layout, on the host, in numpy.

MLX's affine format (``mx.quantize`` / ``mx.dequantize`` / ``mx.quantized_matmul``,
``mode="affine"``) stores a ``[rows, cols]`` matrix as

* ``weight``: uint32 ``[rows, cols * bits // 32]``; element ``j`` of a row sits at bits
  ``bits * (j % (32 // bits))`` of word ``j // (32 // bits)`` (lowest bits first), so on a
  little-endian host the byte stream of a row is the elements in order, packed low nibble
  first for 4 bits and one byte each for 8 bits;
* ``scales`` and ``biases``: ``[rows, cols // group_size]``, one pair per group of
  ``group_size`` consecutive elements of a row, and ``w = scales * q + biases``.

The legacy GGUF block types map onto it exactly, one GGUF block (32 elements) per MLX
group (group_size 32), without ever expanding the weights to floats:

========  ============================  =====  ===========  ================
type      GGUF block (ggml-quants.c)     bits   scale        bias
========  ============================  =====  ===========  ================
Q4_0      f16 d, 16 B nibbles; d*(q-8)   4      d            -8 d
Q4_1      f16 d, f16 m, 16 B; d*q + m    4      d            m
Q8_0      f16 d, 32 x int8 q; d*q        8      d            -128 d (q+128)
========  ============================  =====  ===========  ================

Scale dtype. ``d`` and ``m`` are float16 in the file, and ``-8 d`` / ``-128 d`` are exact
in float16 too (multiplying by a power of two only changes the exponent) unless they
overflow float16's 65504, i.e. ``|d| > 8188`` (Q4_0) or ``|d| > 511.75`` (Q8_0). So scales
and biases are stored as float16 per tensor, and the whole tensor falls back to float32
when any of its biases would overflow. Measured on MLX 0.32.4 (CPU), see ``executor/ops.py``
for how this is used: ``mx.quantized_matmul`` accepts float16 scales/biases with float32
activations (it casts them to the activation dtype, result float32, bit-identical to
passing the same values as float32), but ``mx.dequantize(..., dtype=mx.float32)`` with
float16 scales computes in float16 and only then casts, losing precision; ``ops.embedding``
therefore casts the gathered rows' scales to float32 before dequantizing.

Every product here is exact in float32 (an 11-bit float16 significand times an at most
8-bit integer), so ``mx.dequantize`` of a repacked tensor with float32 scales reproduces
``gguf.quants.dequantize`` bit for bit. Block and type sizes come from
``gguf.constants.GGML_QUANT_SIZES``.

Sources: ggml ``ggml-quants.c`` / gguf-py ``gguf/quants.py`` (block layouts: in Q4_0 and
Q4_1, byte ``i`` of ``qs`` holds element ``i`` in its low nibble and element ``i + 16`` in
its high nibble); MLX ``mlx/ops.cpp`` and the ``mx.quantize`` docstring (affine layout).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from math import prod

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "SUPPORTED_TYPES",
    "PackedWeight",
    "UnsupportedQuantError",
    "gguf_nbytes",
    "mlx_nbytes",
    "repack",
]

_T = GGMLQuantizationType

#: GGUF quantized types repacked onto MLX affine quantization -> MLX bits per element.
_QUANT_BITS: dict[GGMLQuantizationType, int] = {_T.Q4_0: 4, _T.Q4_1: 4, _T.Q8_0: 8}
#: Float types returned as plain numpy arrays -> the numpy dtype they come back as.
_FLOAT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    _T.F32: np.dtype(np.float32),
    _T.F16: np.dtype(np.float16),
    _T.BF16: np.dtype(np.float32),  # numpy has no bfloat16; widening is exact
}

#: Every GGML type :func:`repack` handles; anything else raises UnsupportedQuantError.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_QUANT_BITS) | frozenset(_FLOAT_DTYPES)

_F16_MAX = float(np.finfo(np.float16).max)  # 65504


class UnsupportedQuantError(ValueError):
    """Raised for a GGML tensor type this version cannot repack (e.g. the K-quants)."""


@dataclass(frozen=True)
class PackedWeight:
    """A ``[rows, cols]`` matrix in MLX affine-quantized form, held in host memory.

    Attributes:
        weight: uint32 ``[rows, cols * bits // 32]``, MLX packing (see module docstring).
        scales: float16 or float32 ``[rows, cols // group_size]``.
        biases: same dtype and shape as ``scales``; ``w = scales * q + biases``.
        bits: bits per element (4 or 8).
        group_size: elements per scale/bias group (32 for the legacy GGUF types).
        shape: logical ``(rows, cols)`` = ``(out_features, in_features)``; this is the GGUF
            tensor shape ``[ne0 = cols, ne1 = rows]`` reversed.
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes of weight + scales + biases (what the tensor occupies in MLX)."""
        return int(self.weight.nbytes + self.scales.nbytes + self.biases.nbytes)


def _type_name(ggml_type: GGMLQuantizationType) -> str:
    return getattr(ggml_type, "name", str(ggml_type))


def _check_supported(ggml_type: GGMLQuantizationType) -> None:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(_type_name(t) for t in SUPPORTED_TYPES))
        raise UnsupportedQuantError(
            f"GGML tensor type {_type_name(ggml_type)} is not supported by this version of "
            f"Strata (supported: {supported}); it comes in a later version"
        )


def gguf_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``shape`` occupies in a GGUF file, from ``GGML_QUANT_SIZES``.

    Args:
        ggml_type: the tensor's GGML type (any type GGML_QUANT_SIZES knows).
        shape: numpy order (``(rows, cols)``, the GGUF shape reversed); the last
            dimension runs along the blocks.

    Raises:
        UnsupportedQuantError: ``ggml_type`` is not in ``GGML_QUANT_SIZES``.
        ValueError: the last dimension is not a multiple of the type's block size.
    """
    if ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedQuantError(
            f"GGML tensor type {_type_name(ggml_type)} has no known block size"
        )
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    shape = tuple(int(s) for s in shape)
    cols = shape[-1] if shape else 1
    if cols % block_size:
        raise ValueError(
            f"tensor of shape {shape} and type {_type_name(ggml_type)}: last dimension {cols} "
            f"is not a multiple of the block size {block_size}"
        )
    return prod(shape) // block_size * type_size


def mlx_nbytes(
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    *,
    scale_dtype: np.dtype | type = np.float16,
) -> int:
    """Bytes the tensor takes once repacked by :func:`repack` (and on the MLX side).

    For the quantized types this is ``rows * cols * bits / 8`` for the packed words plus
    two ``scale_dtype`` values (scale and bias) per group of 32. ``repack`` picks float16
    scales unless they would overflow (rare; then float32), so the default is exact for
    nearly every real tensor; pass ``scale_dtype=np.float32`` for the worst case. F32 and
    BF16 come back as float32 (4 bytes per element), F16 as float16 (2 bytes).

    Args:
        ggml_type: one of :data:`SUPPORTED_TYPES`.
        shape: numpy order, ``(rows, cols)`` for quantized types.
        scale_dtype: dtype assumed for scales and biases of quantized types.

    Raises:
        UnsupportedQuantError: the type is not supported.
        ValueError: bad shape (quantized types need 2-D, cols a multiple of 32).
    """
    _check_supported(ggml_type)
    shape = tuple(int(s) for s in shape)
    if ggml_type in _FLOAT_DTYPES:
        return prod(shape) * _FLOAT_DTYPES[ggml_type].itemsize
    rows, cols = _check_quant_shape(ggml_type, shape)
    group_size = GGML_QUANT_SIZES[ggml_type][0]
    bits = _QUANT_BITS[ggml_type]
    n_groups = rows * (cols // group_size)
    return rows * cols * bits // 8 + 2 * n_groups * np.dtype(scale_dtype).itemsize


def _check_quant_shape(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(
            f"tensor of shape {shape} and type {_type_name(ggml_type)}: quantized tensors must be "
            "2-D (rows, cols)"
        )
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    rows, cols = shape
    if rows <= 0 or cols <= 0 or cols % block_size:
        raise ValueError(
            f"tensor of shape {shape} and type {_type_name(ggml_type)}: cols must be a positive "
            f"multiple of the block size {block_size}"
        )
    return rows, cols


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    """The flat uint8 view of ``raw`` (no copy when it is already contiguous)."""
    raw = np.ascontiguousarray(raw)
    return raw.reshape(-1).view(np.uint8)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte offset ``start`` of every block, shape ``[n_blocks]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16)[:, 0]


def _pack_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF Q4 nibble bytes ``[n, 16]`` -> MLX 4-bit bytes ``[n, 16]`` (elements in order).

    GGUF: byte i holds element i (low nibble) and element i+16 (high nibble). MLX wants
    byte b = element 2b (low) | element 2b+1 (high). The first 8 output bytes pair up the
    low nibbles of consecutive input bytes, the last 8 the high nibbles.
    """
    even = qs[:, 0::2]
    odd = qs[:, 1::2]
    lo = (even & np.uint8(0x0F)) | ((odd & np.uint8(0x0F)) << np.uint8(4))
    hi = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))
    return np.concatenate([lo, hi], axis=1)


def _scale_pair(scale16: np.ndarray, bias32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Store as float16 when the bias fits float16 (then exactly), else both as float32.

    ``bias32`` is an exact power-of-two multiple of ``scale16``, so it is exact in float16
    unless it overflows (or underflows, which a power-of-two *increase* cannot do).
    """
    with np.errstate(over="ignore"):
        bias16 = bias32.astype(np.float16)
    # Compare values rather than test for inf so any inexact conversion falls back too.
    inexact = np.isfinite(bias32) & (bias16.astype(np.float32) != bias32)
    if inexact.any():
        return scale16.astype(np.float32), bias32
    return scale16, bias16


def repack(
    ggml_type: GGMLQuantizationType,
    raw: np.ndarray,
    shape: tuple[int, ...],
) -> PackedWeight | np.ndarray:
    """Convert one GGUF tensor's bytes into MLX affine form (or a plain float array).

    Args:
        ggml_type: the tensor's ``gguf.GGMLQuantizationType``.
        raw: the tensor's bytes exactly as in the file (uint8; any other dtype, such as the
            float32 view ``GGUFReader`` gives F32 tensors, is reinterpreted as bytes).
        shape: numpy order, i.e. the GGUF shape reversed: ``(rows, cols)`` for a matrix
            whose GGUF shape is ``[ne0 = cols, ne1 = rows]``.

    Returns:
        For Q4_0 / Q4_1 (4 bits) and Q8_0 (8 bits): a :class:`PackedWeight` with
        group_size 32; scales/biases float16, or float32 for a tensor where float16 would
        overflow (Q4_0 ``|d| > 8188``, Q8_0 ``|d| > 511.75``).
        For F32: float32 array of ``shape``; F16: float16 array of ``shape``; BF16: float32
        array of ``shape`` (numpy has no bfloat16; the widening is exact). Float arrays may
        share memory with ``raw`` (e.g. a read-only view of the GGUFReader memmap).

    Raises:
        UnsupportedQuantError: any other type (K-quants, IQ*, ...), naming the type.
        ValueError: ``raw`` holds a different number of bytes than ``shape`` needs, or the
            shape is invalid for the type (quantized: not 2-D, or cols not a multiple of
            the block size).
    """
    _check_supported(ggml_type)
    shape = tuple(int(s) for s in shape)
    name = _type_name(ggml_type)
    if ggml_type in _QUANT_BITS:
        rows, cols = _check_quant_shape(ggml_type, shape)
    data = _as_bytes(raw)
    expected = gguf_nbytes(ggml_type, shape)
    if data.size != expected:
        raise ValueError(
            f"tensor of shape {shape} and type {name}: got {data.size} bytes, expected {expected}"
        )

    if ggml_type == _T.F32:
        return data.view("<f4").astype(np.float32, copy=False).reshape(shape)
    if ggml_type == _T.F16:
        return data.view("<f2").astype(np.float16, copy=False).reshape(shape)
    if ggml_type == _T.BF16:
        # bfloat16 is the top half of a float32: shift the 16 bits into place.
        return (data.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)

    if sys.byteorder != "little":  # the byte shuffles below build little-endian uint32 words
        raise NotImplementedError("repack needs a little-endian host")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    bits = _QUANT_BITS[ggml_type]
    n_groups = cols // block_size
    blocks = data.reshape(rows * n_groups, type_size)
    d = _f16_field(blocks, 0)

    if ggml_type == _T.Q4_0:
        # w = d*(q-8) = d*q + (-8d)
        packed = _pack_nibbles(blocks[:, 2:])
        scales, biases = _scale_pair(d, d.astype(np.float32) * np.float32(-8))
    elif ggml_type == _T.Q4_1:
        # w = d*q + m, both float16 in the file: always exact in float16
        packed = _pack_nibbles(blocks[:, 4:])
        scales, biases = d, _f16_field(blocks, 2)
    else:  # Q8_0
        # int8 q -> unsigned q+128 (flip the sign bit); w = d*(q+128) + (-128d)
        packed = blocks[:, 2:] ^ np.uint8(0x80)
        scales, biases = _scale_pair(d, d.astype(np.float32) * np.float32(-128))

    weight = np.ascontiguousarray(packed).view("<u4").astype(np.uint32, copy=False)
    return PackedWeight(
        weight=weight.reshape(rows, cols * bits // 32),
        scales=np.ascontiguousarray(scales).reshape(rows, n_groups),
        biases=np.ascontiguousarray(biases).reshape(rows, n_groups),
        bits=bits,
        group_size=block_size,
        shape=(rows, cols),
    )
