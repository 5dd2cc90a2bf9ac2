"""Dequantizing MLX affine-quantized weights on NVIDIA GPUs with a kernel of Strata's own.

The dense kernel path of a batched projection (``executor.ops``, the plan's
``runtime.dequant_matmul_min_rows``) dequantizes the weight for the call and multiplies densely.
On MLX's CUDA backend ``mx.dequantize`` made that path slow. This kernel is one pass: a thread
reads one packed uint32 word and its group's scale and bias and writes the word's elements as one
vector store (16 bytes for 4-bit float16), so reads and writes are coalesced. It beats
``mx.dequantize`` on large weights and loses a few us to its launch on small ones (figures,
``benchmarks/kernels/dequant_kernel.py``: docs/kernels.md#the-dequantization-kernel).

Layout (``strata.common.quant``): element ``j`` of a word sits at bits ``bits * j``;
``w = scale * q + bias`` per group of ``group_size`` elements along a row. The product is computed
in float32 and rounded once to the output dtype, so each element is the correctly rounded value
of the exact dequantized weight (``mx.dequantize`` with float16 scales computes in float16,
which can differ from it in the last bit).
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["dequantize", "supported"]

BITS = (4, 8)
"""Bit widths this kernel unpacks: whole elements per 32-bit word. Others (3, 5, 6 bits) cross
word boundaries and go through ``mx.dequantize``."""

OUT_DTYPES = (mx.float16, mx.bfloat16)
"""Output dtypes (the CUDA backend's compute dtypes): two bytes, so a word's elements form one
8- or 16-byte vector store."""

THREADS = 256
"""Threads per block: one word each."""

_SOURCE = r"""
    constexpr int EPW = 32 / BITS;                 // elements per packed word
    constexpr uint32_t QMASK = (1u << BITS) - 1u;
    const size_t words = w_shape[0] * (size_t)w_shape[1];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= words) return;
    const size_t kw = w_shape[1];                  // words per weight row
    const size_t row = i / kw;
    const size_t col = (i - row * kw) * EPW;       // first element of this word in its row
    const size_t group = row * (kw * EPW / GS) + col / GS;
    const float s = static_cast<float>(scales[group]);
    const float b = static_cast<float>(biases[group]);
    const uint32_t q = w[i];
    alignas(16) T vals[EPW];
    #pragma unroll
    for (int j = 0; j < EPW; ++j)
        vals[j] = static_cast<T>(fmaf(s, static_cast<float>((q >> (BITS * j)) & QMASK), b));
    if (EPW == 8) {  // a compile-time constant: one branch is compiled in
        reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(vals);
    } else {
        reinterpret_cast<uint2*>(out)[i] = *reinterpret_cast<const uint2*>(vals);
    }
"""


@functools.cache
def _get_kernel():
    """The kernel, built on first use (MLX compiles it per template instantiation)."""
    return mx.fast.cuda_kernel(
        name="strata_dequantize",
        input_names=["w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def supported(bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`dequantize` handles ``bits``-bit weights in groups of ``group_size`` into
    ``dtype`` on this process's backend (MLX's CUDA backend only)."""
    return (
        mx.cuda.is_available()
        and bits in BITS
        and dtype in OUT_DTYPES
        and group_size % (32 // bits) == 0
    )


def dequantize(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dtype: mx.Dtype,
) -> mx.array:
    """The dense ``[n, k]`` matrix of an affine-quantized weight, on MLX's CUDA backend.

    Args:
        weight: uint32 ``[n, k * bits / 32]``, row-major contiguous.
        scales: float ``[n, k / group_size]`` (any float dtype).
        biases: like ``scales``.
        group_size: elements per scale/bias group along a row (a multiple of ``32 / bits``).
        bits: 4 or 8.
        dtype: float16 or bfloat16, the result's dtype.

    Returns:
        ``[n, k]`` of ``dtype``: ``scale * q + bias`` computed in float32, rounded once.

    Raises:
        ValueError: a combination :func:`supported` refuses, or mismatched shapes.
    """
    if not supported(bits, group_size, dtype):
        raise ValueError(
            f"cuda_dequant: {bits}-bit weights in groups of {group_size} to {dtype} are not "
            "handled here (MLX CUDA, 4 or 8 bits, float16/bfloat16); use mx.dequantize"
        )
    n, kw = weight.shape
    k = kw * 32 // bits
    if k % group_size or scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        raise ValueError(
            f"cuda_dequant: weight {tuple(weight.shape)} with scales {tuple(scales.shape)} and "
            f"biases {tuple(biases.shape)} do not form {bits}-bit groups of {group_size}"
        )
    words = n * kw
    (out,) = _get_kernel()(
        inputs=[weight, scales, biases],
        # The scales' dtype is in the template: MLX names (and caches) a compiled kernel by its
        # template arguments, while its signature follows the inputs' dtypes.
        template=[("T", dtype), ("S", scales.dtype), ("BITS", bits), ("GS", group_size)],
        grid=(-(-words // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, k)],
        output_dtypes=[dtype],
    )
    return out
