"""Repack GGUF tensors into MLX's affine quantization layout, on the host, in numpy.

MLX's affine format (``mx.quantize`` / ``mx.dequantize`` / ``mx.quantized_matmul``,
``mode="affine"``) stores a ``[rows, cols]`` matrix as

* ``weight``: uint32 ``[rows, cols * bits // 32]``; each row is a little-endian bit stream,
  element ``j`` at bits ``bits * j`` to ``bits * (j + 1) - 1`` (so 4 bits: low nibble first,
  8 bits: one byte each; 3, 5 and 6 bits cross byte and word boundaries). Verified against
  ``mx.dequantize`` for bits 2, 3, 4, 5, 6 and 8 on MLX 0.32.4;
* ``scales`` and ``biases``: ``[rows, cols // group_size]``, one pair per group of
  ``group_size`` consecutive elements of a row, ``w = scales * q + biases``. MLX accepts
  group sizes 32, 64 and 128 only: there is no group of 16.

Every GGUF type below maps onto it without expanding the weights to floats, except the two
requantized ones. The GGUF block is ggml's (``ggml-common.h`` / ``ggml-quants.c``, ported in
gguf-py's ``gguf/quants.py``); ``d``/``dmin``/``m`` are float16, ``sc``/``m`` of the K-quants
the sub-block scales and mins (6 bits for Q4_K/Q5_K, 4 for Q2_K, 6 signed for Q3_K, int8 for
Q6_K). Bytes/weight is what MLX holds (weights + scales + biases) and, in parentheses, the
GGUF file's. "Error" is measured against ``gguf.quants.dequantize`` (tests/test_quant.py):
the relative RMS error ``|mlx - gguf| / |gguf|`` on realistic weights and, in parentheses,
the RMS error it adds over the RMS of the type's own rounding noise (see below):

======  ================================  ====  =====  =======  ============  ===============
type    GGUF block                        bits  group  scales   bytes/w       error
======  ================================  ====  =====  =======  ============  ===============
Q4_0    32: d*(q-8), q 4 bits             4     32     float16  0.625 (.56)   exact
Q4_1    32: d*q + m                       4     32     float16  0.625 (.63)   exact
Q5_0    32: d*(q-16), q 5 bits            5     32     float16  0.75 (.69)    exact
Q5_1    32: d*q + m                       5     32     float16  0.75 (.75)    exact
Q8_0    32: d*q, q int8                   8     32     float16  1.125 (1.06)  exact
IQ4_NL  32: d*kv[q], kv an int8 table     8     32     float16  1.125 (.56)   exact
Q4_K    256 = 8 x 32: d*sc*q - dmin*m     4     32     float32  0.75 (.56)    exact
Q5_K    256 = 8 x 32: d*sc*q - dmin*m     5     32     float32  0.875 (.69)   exact
IQ4_XS  256 = 8 x 32: d*(sc-32)*kv[q]     8     32     float32  1.25 (.53)    exact
Q3_K    256 = 16 x 16: d*(sc-32)*(q-4)    8     128    float16  1.031 (.43)   exact
Q6_K    256 = 16 x 16: d*sc*(q-32)        8     32     float16  1.125 (.82)   4.9e-3 (0.23)
Q2_K    256 = 16 x 16: d*sc*q - dmin*m    4     32     float16  0.625 (.33)   6.3e-2 (0.19)
MXFP4   32: e8m0 scale x e2m1 value       4     32     uint8    0.531 (.53)   exact
======  ================================  ====  =====  =======  ============  ===============

MXFP4 (gpt-oss's experts) is not affine: it maps onto MLX's ``mode="mxfp4"`` quantization
(``mx.quantized_matmul``/``mx.dequantize`` with ``mode="mxfp4"``, group 32, no biases), whose
format is the file's: a ggml block is one E8M0 byte ``e`` and 32 E2M1 codes, value
``kvalues_mxfp4[q] * 2^(e - 128)`` with ``kvalues_mxfp4`` the E2M1 values doubled
(``ggml-common.h``, ``GGML_E8M0_TO_FP32_HALF``), i.e. ``e2m1[q] * 2^(e - 127)``: exactly MLX's
mxfp4 element (scale byte ``e``, value ``e2m1[q] * 2^(scale - 127)``, code ``q`` the same 4
bits). Repacking only moves nibbles (ggml byte ``i`` holds element ``i`` in its low nibble and
``i + 16`` in its high one; MLX packs element ``j`` at bits ``4 j`` of its row) and copies the
scale bytes, so the bytes are the file's (17 per 32 weights) and ``mx.dequantize`` reproduces
``gguf.quants.dequantize`` exactly (tests/executor/test_quant_mxfp4.py; code 8 is -0 in MLX and
+0 in ggml, the same number), subnormal scales 0 and 1 included (measured on MLX 0.32.4, CPU).
Scale byte 255 is refused: E8M0's NaN in MLX, a scale
of 2^128 in ggml (no real weight has it; ``UnsupportedQuantError``). A :class:`PackedWeight` of
this type has ``biases`` None (its ``mode`` is ``"mxfp4"``).

Exact mappings (scale, bias; MLX code ``q'``):

* Q4_0 / Q5_0: ``d``, ``-8 d`` / ``-16 d``; Q4_1 / Q5_1: ``d``, ``m``; ``q' = q``.
* Q8_0: ``d``, ``-128 d``, ``q' = q + 128``; IQ4_NL: ``d``, ``-128 d``, ``q' = kv[q] + 128``.
* Q4_K / Q5_K: ``d*sc``, ``-dmin*m`` per sub-block of 32, ``q' = q``.
* IQ4_XS: ``d*(sc-32)``, ``-128 d*(sc-32)`` per sub-block of 32, ``q' = kv[q] + 128``.
* Q3_K: its sub-blocks are 16 wide, but ``(sc-32)*(q-4)`` is an integer in ``[-124, 128]``:
  ``q' = 128 - (sc-32)*(q-4)`` in ``[0, 252]`` with scale ``-d`` and bias ``128 d`` per
  superblock, so 8 bits and the largest MLX group (128) are exact, at 2.4x the file's bytes.
  IQ4_NL and IQ4_XS (a non-uniform codebook) likewise take 8 bits to stay exact.

Requantized: Q6_K and Q2_K have 16-wide sub-blocks with independent scales that one MLX
group of 32 cannot hold exactly (Q6_K's ``sc*(q-32)`` spans 13 bits; Q2_K's two mins differ
by ``dmin*m``, off the ``d*sc`` grid). Each group of 32 is requantized from its exact values
``w`` with ``bias = min(w)`` rounded down and ``scale = (max(w) - bias) / (2**bits - 1)``
rounded up to float16 (float32 for a tensor whose values overflow float16), so the grid
covers the group and every element is off by at most ``scale / 2`` (asserted in the tests on
random blocks, where it measures 4.0e-3 for Q6_K and 2.5e-2 for Q2_K). The width is the
smallest whose added RMS error stays within a quarter of the RMS of the type's own rounding
noise (``d*sc / sqrt(12)`` per sub-block), so the total error grows by at most 3 %: for Q6_K,
measured on the 9 Q6_K tensors of Gemma-3-270M Q4_K_M, 8 bits add at most 0.23 of it (6
bits: 0.95, nearly doubling the noise power); for Q2_K, measured on Gaussian weights
quantized to Q2_K by min/max, 4 bits add 0.19 (3 bits: 0.48).

Scale dtype. Scales and biases are stored in float16 when every one of a tensor's values is
exactly a float16, else float32 for the whole tensor. The legacy types' ``d`` and ``m`` are
float16 in the file and ``-8 d``, ``-16 d``, ``±128 d`` (also Q3_K's ``-d``, ``128 d``) are
exact in float16 (multiplying by a power of two only changes the exponent) unless they
overflow float16's 65504 (e.g. ``|d| > 8188`` for Q4_0, ``|d| > 511.75`` for Q8_0), so these
are float16. The K-quants' products ``d*sc`` (11 + 6 significant bits) are exact only in
float32, so Q4_K, Q5_K and IQ4_XS are always float32. The requantized types' scales are
chosen here, as float16 values. On Gemma-3-270M Q4_K_M (F32, Q8_0, Q5_0, Q4_K, Q6_K) the MLX
form takes 1.0915x the file's tensor bytes. Measured on MLX 0.32.4 (CPU), see
``executor/ops.py`` for how this is used: ``mx.quantized_matmul`` accepts float16
scales/biases with float32 activations (it casts them to the activation dtype, result
float32, bit-identical to passing the same values as float32), but
``mx.dequantize(..., dtype=mx.float32)`` with float16 scales computes in float16 and only
then casts, losing precision; ``ops.embedding`` therefore casts the gathered rows' scales to
float32 before dequantizing.

Every product ``scale * q'`` of an exact mapping is exact in float32 (at most 24
significant bits: IQ4_XS's is the widest, 11 + 5 + 8), so ``mx.dequantize`` of a repacked
tensor with float32 scales reproduces ``gguf.quants.dequantize`` bit for bit: both round
``scale * q' + bias`` once. Block and type sizes come from ``gguf.constants.GGML_QUANT_SIZES``.

Sources: ggml ``ggml-common.h`` (block structs, ``kvalues_iq4nl``) and ``ggml-quants.c``
(``dequantize_row_*``; in Q4_0/Q4_1/Q5_*/IQ4_* byte ``i`` of ``qs`` holds element ``i`` in its
low nibble and element ``i + 16`` in its high nibble, the K-quants lay out nibbles, 2-bit
fields and bits likewise over runs of 32 or 64 bytes: see :func:`_fields`); MLX
``mlx/ops.cpp`` and the ``mx.quantize`` docstring (affine layout).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "EXACT_TYPES",
    "SUPPORTED_TYPES",
    "PackedWeight",
    "UnsupportedQuantError",
    "gguf_nbytes",
    "mlx_nbytes",
    "repack",
]

_T = GGMLQuantizationType

#: Float types returned as plain numpy arrays -> the numpy dtype they come back as.
_FLOAT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    _T.F32: np.dtype(np.float32),
    _T.F16: np.dtype(np.float16),
    _T.BF16: np.dtype(np.float32),  # numpy has no bfloat16; widening is exact
}

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)

#: Elements decoded per step of :func:`repack`, bounding its temporaries (float64 for the
#: requantized types: 8 bytes per element per temporary).
_CHUNK_ELEMENTS = 1 << 21

#: ggml's ``kvalues_iq4nl`` (IQ4_NL and IQ4_XS codebook) + 128, as unsigned 8-bit codes.
_IQ4_CODES = (
    np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128
).astype(np.uint8)


class UnsupportedQuantError(ValueError):
    """Raised for a GGML tensor type this version cannot repack (e.g. IQ2_XXS)."""


@dataclass(frozen=True)
class PackedWeight:
    """A ``[rows, cols]`` matrix in MLX affine-quantized form (or MLX's mxfp4 form: MXFP4,
    ``biases`` None), held in host memory.

    Attributes:
        weight: uint32 ``[rows, cols * bits // 32]``, MLX packing (see module docstring).
        scales: float16 or float32 ``[rows, cols // group_size]``.
        biases: same dtype and shape as ``scales``; ``w = scales * q + biases``.
        bits: bits per element (4, 5 or 8).
        group_size: elements per scale/bias group (32, or 128 for Q3_K).
        shape: logical ``(rows, cols)`` = ``(out_features, in_features)``; this is the GGUF
            tensor shape ``[ne0 = cols, ne1 = rows]`` reversed.
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None
    bits: int
    group_size: int
    shape: tuple[int, int]

    @property
    def mode(self) -> str:
        """MLX's quantization mode: ``"affine"``, or ``"mxfp4"`` (no biases, uint8 E8M0
        scales)."""
        return "affine" if self.biases is not None else "mxfp4"

    @property
    def nbytes(self) -> int:
        """Bytes of weight + scales + biases (what the tensor occupies in MLX)."""
        biases = 0 if self.biases is None else self.biases.nbytes
        return int(self.weight.nbytes + self.scales.nbytes + biases)


#: ``decode(blocks)``: uint8 ``[n_blocks, type_size]`` GGUF blocks -> ``(q, scale, bias)``:
#: uint8 codes ``[n_blocks, block_size]`` in element order (each ``< 2**bits``) and float32
#: ``[n_blocks, block_size // group_size]`` scales and biases, ``w = scale * q + bias``.
_Decode = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class _Repacking:
    """How one GGML block type maps onto MLX affine quantization (module docstring table).

    Attributes:
        bits: MLX bits per element.
        group_size: MLX elements per scale/bias group (divides the GGUF block size).
        scale_dtype: float16 (kept per tensor when every value is exact in it, else float32)
            or float32 (always).
        exact: whether ``decode`` reproduces ``gguf.quants.dequantize`` exactly.
        decode: the block decoder (see ``_Decode``).
    """

    bits: int
    group_size: int
    scale_dtype: np.dtype
    exact: bool
    decode: _Decode


def _type_name(ggml_type: GGMLQuantizationType) -> str:
    return getattr(ggml_type, "name", str(ggml_type))


# --- bit fields ----------------------------------------------------------------------------


def _fields(b: np.ndarray, width: int, *, byte_major: bool = False) -> np.ndarray:
    """Split bytes into ``width``-bit fields (lowest first): uint8 ``[..., n]`` -> ``[..., k*n]``.

    With ``k = 8 // width`` fields per byte, output ``f * n + i`` is field ``f`` of byte ``i``
    (ggml's quant layout: the low nibbles, 2-bit fields or bits of a run of bytes are the
    first elements, the next field the following ones); with ``byte_major`` it is output
    ``i * k + f`` instead (a little-endian bit stream of fields, as in Q5_0's ``qh`` and
    IQ4_XS's scales).
    """
    k = 8 // width
    out = np.empty((*b.shape, k) if byte_major else (*b.shape[:-1], k, b.shape[-1]), np.uint8)
    for f in range(k):  # in place: about twice as fast as broadcasting the shifts
        np.right_shift(b, np.uint8(width * f), out=out[..., f] if byte_major else out[..., f, :])
    out &= np.uint8((1 << width) - 1)
    return out.reshape(*b.shape[:-1], -1)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of codes: uint8 ``[n]`` (each ``< 2**bits``, ``n % 8 == 0``) -> uint8
    ``[n * bits // 8]``, the little-endian bit stream of the codes (module docstring)."""
    if bits == 8:
        return q.reshape(-1)
    if 8 % bits == 0:  # whole codes per byte (4 bits: two)
        q = q.reshape(-1, 8 // bits)
        out = q[:, 0].copy()
        for i in range(1, q.shape[1]):
            out |= q[:, i] << np.uint8(bits * i)
        return out
    q = q.reshape(-1, 8)  # 3, 5, 6 bits: 8 codes fill ``bits`` bytes
    out = np.zeros((q.shape[0], bits), np.uint8)
    for i in range(8):
        byte, shift = divmod(bits * i, 8)
        v = q[:, i].astype(np.uint16) << np.uint16(shift)
        out[:, byte] |= v.astype(np.uint8)  # the low byte
        if shift + bits > 8:
            out[:, byte + 1] |= (v >> np.uint16(8)).astype(np.uint8)
    return out.reshape(-1)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte offset ``start`` of every block, as float32 ``[n_blocks, 1]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


# --- block decoders (ggml-quants.c dequantize_row_*) ---------------------------------------


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes ``[n, 32]``: low nibbles from ``qs`` [n, 16], bit ``j`` of the
    little-endian uint32 ``qh`` [n, 4] is element ``j``'s fifth bit."""
    return _fields(qs, 4) | (_fields(qh, 1, byte_major=True) << np.uint8(4))


def _decode_q4_0(b: np.ndarray):
    d = _f16_field(b, 0)
    return _fields(b[:, 2:], 4), d, -8 * d


def _decode_q4_1(b: np.ndarray):
    return _fields(b[:, 4:], 4), _f16_field(b, 0), _f16_field(b, 2)


def _decode_q5_0(b: np.ndarray):
    d = _f16_field(b, 0)
    return _q5_codes(b[:, 2:6], b[:, 6:]), d, -16 * d


def _decode_q5_1(b: np.ndarray):
    return _q5_codes(b[:, 4:8], b[:, 8:]), _f16_field(b, 0), _f16_field(b, 2)


def _decode_q8_0(b: np.ndarray):
    d = _f16_field(b, 0)
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q -> q + 128: flip the sign bit


def _decode_iq4_nl(b: np.ndarray):
    d = _f16_field(b, 0)
    return _IQ4_CODES[_fields(b[:, 2:], 4)], d, -128 * d


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 6-bit scales and mins: uint8 ``[n, 12]`` -> two uint8 ``[n, 8]``
    (ggml ``get_scale_min_k4``: sub-blocks 4-7 keep their top 2 bits in bytes 0-7)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & np.uint8(63), (c & np.uint8(15)) | ((a >> 2) & np.uint8(48))], 1)
    mn = np.concatenate([b & np.uint8(63), (c >> 4) | ((b >> 2) & np.uint8(48))], 1)
    return sc, mn


def _decode_q4_k(b: np.ndarray):
    # d f16, dmin f16, scales[12], qs[128]: 32 bytes per pair of sub-blocks, low nibbles first
    sc, mn = _k_scales_mins(b[:, 4:16])
    q = _fields(b[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, 256)
    return q, _f16_field(b, 0) * sc, -(_f16_field(b, 2) * mn)


def _decode_q5_k(b: np.ndarray):
    # d f16, dmin f16, scales[12], qh[32] (bit k of byte i: sub-block k, element i), qs[128]
    sc, mn = _k_scales_mins(b[:, 4:16])
    low = _fields(b[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 256)
    q = low | (_fields(b[:, 16:48], 1) << np.uint8(4))
    return q, _f16_field(b, 0) * sc, -(_f16_field(b, 2) * mn)


def _decode_iq4_xs(b: np.ndarray):
    # d f16, scales_h u16 (2 bits each), scales_l[4] (4 bits each), qs[128] (16 per sub-block)
    low, high = _fields(b[:, 4:8], 4, byte_major=True), _fields(b[:, 2:4], 2, byte_major=True)
    dl = _f16_field(b, 0) * ((low | (high << np.uint8(4))).astype(np.float32) - 32)
    q = _IQ4_CODES[_fields(b[:, 8:].reshape(-1, 8, 16), 4).reshape(-1, 256)]
    return q, dl, -128 * dl


def _decode_q3_k(b: np.ndarray):
    # hmask[32], qs[64], scales[12], d f16; sub-block of 16 j: scale (sc_j - 32), q in [-4, 3]
    low = _fields(b[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 256).astype(np.int16)
    q = low + 4 * _fields(b[:, :32], 1).astype(np.int16) - 4  # high bit 0 means -4
    sc = _fields(b[:, 96:104], 4) | (_fields(b[:, 104:108], 2) << np.uint8(4))
    v = (sc.astype(np.int16) - 32).repeat(16, axis=1) * q  # in [-124, 128]
    d = _f16_field(b, 108)
    return (128 - v).astype(np.uint8), np.repeat(-d, 2, 1), np.repeat(128 * d, 2, 1)


def _q6_k_values(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks -> float64 ``[n, 256]`` exact values ``d * sc * (q - 32)``.

    ql[128] (low nibbles, 64 bytes per half), qh[64] (2-bit fields, 32 bytes per half),
    scales int8[16] (one per 16 elements), d f16.
    """
    low = _fields(b[:, :128].reshape(-1, 2, 64), 4)
    high = _fields(b[:, 128:192].reshape(-1, 2, 32), 2)
    q = (low | (high << np.uint8(4))).reshape(-1, 256).astype(np.float64) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float64).repeat(16, axis=1)
    return _f16_field(b, 208).astype(np.float64) * sc * q


def _q2_k_values(b: np.ndarray) -> np.ndarray:
    """Q2_K blocks -> float64 ``[n, 256]`` exact values ``d * sc * q - dmin * m``.

    scales[16] (sc low nibble, m high nibble, one per 16 elements), qs[64] (2-bit fields, 32
    bytes per half), d f16, dmin f16.
    """
    q = _fields(b[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 256).astype(np.float64)
    s = b[:, :16].repeat(16, axis=1)
    d, dmin = _f16_field(b, 80).astype(np.float64), _f16_field(b, 82).astype(np.float64)
    return d * (s & np.uint8(15)) * q - dmin * (s >> 4)


def _round_toward(x: np.ndarray, dtype: np.dtype, toward: float) -> np.ndarray:
    """``x`` (float64) rounded to ``dtype`` in the direction of ``toward`` (``±inf``)."""
    with np.errstate(over="ignore"):
        y = x.astype(dtype)
    past = y > x if toward < 0 else y < x
    return np.where(past, np.nextafter(y, dtype.type(toward)), y)


def _requantize(values: np.ndarray, bits: int, group_size: int):
    """Requantize exact values to ``bits`` per group (module docstring), as a ``_Decode``.

    Args:
        values: float64 ``[n, block]``, ``block`` a multiple of ``group_size``.

    Returns:
        uint8 codes ``[n, block]``; float32 scales and biases ``[n, block // group_size]``,
        float16 values unless one would overflow float16; every value is within
        ``scale / 2`` of ``scale * q + bias``.
    """
    n = values.shape[0]
    w = values.reshape(-1, group_size)
    top = (1 << bits) - 1
    lo, hi = w.min(axis=1), w.max(axis=1)
    for dtype in (_F16, _F32):
        bias = _round_toward(lo, dtype, -np.inf).astype(np.float64)
        scale = _round_toward((hi - bias) / top, dtype, np.inf).astype(np.float64)
        if np.isfinite(bias).all() and np.isfinite(scale).all():
            break
    step = np.where(scale > 0, scale, 1.0)[:, None]
    q = np.clip(np.rint((w - bias[:, None]) / step), 0, top).astype(np.uint8)
    scale, bias = (x.astype(np.float32).reshape(n, -1) for x in (scale, bias))
    return q.reshape(n, -1), scale, bias


def _requantized(values: Callable[[np.ndarray], np.ndarray], bits: int) -> _Repacking:
    return _Repacking(bits, 32, _F16, False, lambda b: _requantize(values(b), bits, group_size=32))


_REPACKINGS: dict[GGMLQuantizationType, _Repacking] = {
    _T.Q4_0: _Repacking(4, 32, _F16, True, _decode_q4_0),
    _T.Q4_1: _Repacking(4, 32, _F16, True, _decode_q4_1),
    _T.Q5_0: _Repacking(5, 32, _F16, True, _decode_q5_0),
    _T.Q5_1: _Repacking(5, 32, _F16, True, _decode_q5_1),
    _T.Q8_0: _Repacking(8, 32, _F16, True, _decode_q8_0),
    _T.IQ4_NL: _Repacking(8, 32, _F16, True, _decode_iq4_nl),
    _T.Q4_K: _Repacking(4, 32, _F32, True, _decode_q4_k),
    _T.Q5_K: _Repacking(5, 32, _F32, True, _decode_q5_k),
    _T.IQ4_XS: _Repacking(8, 32, _F32, True, _decode_iq4_xs),
    _T.Q3_K: _Repacking(8, 128, _F16, True, _decode_q3_k),
    _T.Q6_K: _requantized(_q6_k_values, bits=8),
    _T.Q2_K: _requantized(_q2_k_values, bits=4),
}

#: Every GGML type :func:`repack` handles; anything else raises UnsupportedQuantError.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = (
    frozenset(_REPACKINGS) | frozenset(_FLOAT_DTYPES) | {_T.MXFP4}
)

#: GGML types whose repacking is exact (the others are requantized, see the module docstring).
EXACT_TYPES: frozenset[GGMLQuantizationType] = (
    frozenset(t for t, r in _REPACKINGS.items() if r.exact) | frozenset(_FLOAT_DTYPES) | {_T.MXFP4}
)


# --- shapes and sizes ----------------------------------------------------------------------


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
    scale_dtype: np.dtype | type | None = None,
) -> int:
    """Bytes the tensor takes once repacked by :func:`repack` (and on the MLX side).

    For the quantized types this is ``rows * cols * bits / 8`` for the packed words plus
    two scale values (scale and bias) per group (module docstring table). By default the
    scale dtype is the type's own: float32 for Q4_K, Q5_K and IQ4_XS, float16 for the
    others, which ``repack`` widens to float32 only for a tensor whose values would
    overflow float16 (rare), so the default is exact for nearly every real tensor; pass
    ``scale_dtype=np.float32`` for the worst case. F32 and BF16 come back as float32
    (4 bytes per element), F16 as float16 (2 bytes).

    Args:
        ggml_type: one of :data:`SUPPORTED_TYPES`.
        shape: numpy order, ``(rows, cols)`` for quantized types.
        scale_dtype: dtype assumed for scales and biases of quantized types (None: the
            type's own).

    Raises:
        UnsupportedQuantError: the type is not supported.
        ValueError: bad shape (quantized types need 2-D, cols a multiple of the block size).
    """
    _check_supported(ggml_type)
    shape = tuple(int(s) for s in shape)
    if ggml_type in _FLOAT_DTYPES:
        return prod(shape) * _FLOAT_DTYPES[ggml_type].itemsize
    rows, cols = _check_quant_shape(ggml_type, shape)
    if ggml_type == _T.MXFP4:  # 4-bit codes and one scale byte per 32: the file's bytes
        return rows * cols // 2 + rows * cols // 32
    r = _REPACKINGS[ggml_type]
    itemsize = np.dtype(scale_dtype or r.scale_dtype).itemsize
    return rows * cols * r.bits // 8 + 2 * rows * (cols // r.group_size) * itemsize


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


def _store_scales(
    scale: np.ndarray, bias: np.ndarray, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases (float32) as ``dtype`` float16 when every value converts exactly,
    else as float32 (e.g. a Q8_0 bias ``-128 d`` beyond float16's 65504)."""
    if dtype == _F16:
        with np.errstate(over="ignore"):
            scale16, bias16 = scale.astype(_F16), bias.astype(_F16)
        if np.array_equal(scale16, scale, equal_nan=True) and np.array_equal(
            bias16, bias, equal_nan=True
        ):
            return scale16, bias16
    return scale, bias


def _repack_blocks(r: _Repacking, blocks: np.ndarray, rows: int, cols: int) -> PackedWeight:
    """The PackedWeight of a ``[rows, cols]`` tensor from its GGUF blocks (uint8
    ``[n_blocks, type_size]``, row-major), decoded ``_CHUNK_ELEMENTS`` at a time."""
    n_blocks, block_size = blocks.shape[0], rows * cols // blocks.shape[0]
    per_chunk = max(1, _CHUNK_ELEMENTS // block_size)
    weight = np.empty(rows * cols * r.bits // 8, np.uint8)
    scales = np.empty((n_blocks, block_size // r.group_size), np.float32)
    biases = np.empty_like(scales)
    packed_per_block = block_size * r.bits // 8
    for start in range(0, n_blocks, per_chunk):
        stop = min(start + per_chunk, n_blocks)
        q, scales[start:stop], biases[start:stop] = r.decode(blocks[start:stop])
        weight[start * packed_per_block : stop * packed_per_block] = _pack_bits(q, r.bits)
    scales, biases = _store_scales(scales, biases, r.scale_dtype)
    n_groups = cols // r.group_size
    return PackedWeight(
        weight=weight.view("<u4").astype(np.uint32, copy=False).reshape(rows, -1),
        scales=scales.reshape(rows, n_groups),
        biases=biases.reshape(rows, n_groups),
        bits=r.bits,
        group_size=r.group_size,
        shape=(rows, cols),
    )


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
        For a quantized type: a :class:`PackedWeight` with the bits and group size of the
        module docstring's table; scales/biases float16 or float32 as described there.
        Exact for every type but Q6_K and Q2_K, which are requantized.
        For F32: float32 array of ``shape``; F16: float16 array of ``shape``; BF16: float32
        array of ``shape`` (numpy has no bfloat16; the widening is exact). Float arrays may
        share memory with ``raw`` (e.g. a read-only view of the GGUFReader memmap).

    Raises:
        UnsupportedQuantError: any other type (IQ2_XXS, TQ1_0, ...), naming the type.
        ValueError: ``raw`` holds a different number of bytes than ``shape`` needs, or the
            shape is invalid for the type (quantized: not 2-D, or cols not a multiple of
            the block size).
    """
    _check_supported(ggml_type)
    shape = tuple(int(s) for s in shape)
    name = _type_name(ggml_type)
    if ggml_type in _REPACKINGS or ggml_type == _T.MXFP4:
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

    if sys.byteorder != "little":  # the byte shuffles build little-endian uint32 words
        raise NotImplementedError("repack needs a little-endian host")
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    if ggml_type == _T.MXFP4:
        return _repack_mxfp4(data.reshape(-1, type_size), rows, cols)
    return _repack_blocks(_REPACKINGS[ggml_type], data.reshape(-1, type_size), rows, cols)


def _repack_mxfp4(blocks: np.ndarray, rows: int, cols: int) -> PackedWeight:
    """MXFP4 blocks (uint8 ``[n_blocks, 17]``: the E8M0 byte, then 16 bytes of codes, element
    ``i`` in byte ``i``'s low nibble and ``i + 16`` in its high one) as MLX's mxfp4 form of a
    ``[rows, cols]`` matrix (module docstring): uint32 codes ``[rows, cols / 8]``, element
    ``j`` at bits ``4 j``; uint8 scales ``[rows, cols / 32]``, the blocks' own bytes.

    Raises:
        UnsupportedQuantError: a block scale of 255 (MLX's E8M0 NaN, ggml's 2^128; no real
            weight has it): a ValueError that ``executor.pack`` reports as one line naming the
            tensor.
    """
    scales = blocks[:, 0]
    if (scales == 255).any():
        raise UnsupportedQuantError(
            "an MXFP4 block has scale byte 255 (2^128 in ggml), which MLX's mxfp4 reads as NaN; "
            "the tensor's weights are not a model's: re-quantize it"
        )
    codes = _fields(blocks[:, 1:], 4)  # [n_blocks, 32] in element order
    weight = _pack_bits(codes.reshape(-1), 4)
    return PackedWeight(
        weight=weight.view("<u4").astype(np.uint32, copy=False).reshape(rows, -1),
        scales=np.ascontiguousarray(scales).reshape(rows, cols // 32),
        biases=None,
        bits=4,
        group_size=32,
        shape=(rows, cols),
    )
