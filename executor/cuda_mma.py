"""A batched 4-bit matmul on NVIDIA tensor cores, for products of a few dozen rows.

On MLX's CUDA backend a product of a few rows by a 4-bit weight is slow: ``mx.quantized_matmul``
took 133-471 us for 16-32 rows by Llama-3-8B FFN weights on the H200 (``bench/cuda_qmm.py``, call
by call), where reading such a weight (29 MB) at the H200's 4.8 TB/s takes 6 us, and the dense path
pays a full dequantized copy per call. A pass of a few dozen rows (a prompt's suffix after a
prefix-cache hit, a step of 16 decoded tokens) then costs a third of a 1,000-token prefill. This
kernel reads each packed weight once per call and multiplies on tensor cores (WMMA, 16x16x16 tiles,
float32 accumulators):

- a block of ``WARPS`` warps owns 16 (or, for at most two 16-row tiles of ``x``, 32) output
  columns, i.e. weight rows; its warps split the K dimension into slabs of 64 elements;
- per slab, each lane loads one 16-byte vector of packed weights per 16 weight rows (each row's
  32 bytes: full 32-byte sectors) with its group's scale and bias, dequantizes it in registers
  into the warp's shared-memory tile, and the warp multiplies that tile by every 16-row tile of
  ``x`` (read from global memory, where it stays in cache; a 32-column block reads each ``x``
  fragment once for both of its column tiles);
- dequantizing converts no integers: ``q | 0x6400`` is the float16 1024 + q (``q | 0x4300`` the
  bfloat16 128 + q), the base is subtracted exactly and ``scale * q + bias`` is one fused
  multiply-add of 16-bit pairs (one rounding of the exact value); conversion instructions issue
  at a quarter of the FMA rate on sm_90, and the first version, which converted in float32, was
  slower (16 rows by the [14336, 4096] weight: 76 against 60 us in a stream of calls);
- a warp issues the loads of several slabs (``UNROLL`` vectors per lane) before using any, so
  enough reads are in flight; the partial sums of the warps meet in shared memory and are added
  in warp order (deterministic).

A row's result does not depend on the other rows or on how many there are (each 16-row tile is
computed alike), so products through this kernel are batch invariant across its row counts.

Measured on the lent H200 (MLX 0.32.4, 2026-11-30): results within 3.5e-4 (float16) and 2.3e-3
(bfloat16) of the float32 product of the dequantized weight, relative to its largest element; each
row equal alone and in the batch. Speed is what ``planner.profile.measure_mma_rows`` records: call
by call on a [16384, 16384] weight it beat MLX's quantized matmul from 2 to 32 rows (32 rows: 360
against 456 us) and lost at 64 (820 against 464), so the H200 profile's range is 2-32. In a
Llama-3-8B-shaped model it took a 16-sequence decode step from 31-34 to 25-27 ms and a 24-token
prompt from 38-45 to 25-26 ms. It reads the weights at 0.2-0.5 TB/s (16 rows by the [14336, 4096]
weight, 29 MB: 60 us in a stream of calls, 105-131 call by call), a tenth or less of the H200's
bandwidth: there is room left in it.

Layout (``executor.quant``): element ``j`` of a uint32 word sits at bits ``4 * j``; ``w = scale * q
+ bias`` per group of ``group_size`` (32, 64 or 128) elements along a row."""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["MAX_ROWS", "matmul", "supported"]

MAX_ROWS = 64
"""Most rows one call computes: four 16-row tiles of float32 accumulators per warp."""

WARPS = 8
"""Warps per block, splitting K: enough independent reads in flight on the few blocks of a
[4096, 14336] weight (256 blocks)."""

UNROLL = 8
"""16-byte weight vectors per lane that one warp loads before using any: 8 slabs of a 16-column
block, 4 of a 32-column block."""

SLAB = 64
"""K elements per slab: two 16-byte vectors of 4-bit elements per weight row."""

LDW = SLAB + 8
"""Shared-memory row stride of the dequantized tile, in elements (padding against bank
conflicts; a multiple of 8, as WMMA loads of 16-bit elements require)."""

OUT_DTYPES = (mx.float16, mx.bfloat16)
"""Activation dtypes: the tensor cores' 16-bit inputs."""

_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

// Eight 4-bit elements of one packed word (element j at bits 4j) to 16-bit floats, in order, as
// one 16-byte vector: w = scale * q + bias with one rounding (a fused multiply-add of 16-bit
// pairs). The integer-to-float conversion is the exponent trick (q | 0x6400 is the half 1024 + q,
// q | 0x4300 the bfloat16 128 + q; subtracting the base is exact), so no conversion
// instructions run: they issue at a quarter of the FMA rate on sm_90.
__device__ __forceinline__ uint4 strata_dq8(uint32_t w, __half s, __half b) {
    const __half2 s2 = __half2half2(s), b2 = __half2half2(b);
    const __half2 base = __half2half2(__ushort_as_half((unsigned short)0x6400));
    uint32_t u[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {  // (e_i, e_{i+4}) per pair
        uint32_t t = ((w >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
        __half2 v = __hfma2(__hsub2(*reinterpret_cast<__half2*>(&t), base), s2, b2);
        u[i] = *reinterpret_cast<uint32_t*>(&v);
    }
    return make_uint4(__byte_perm(u[0], u[1], 0x5410), __byte_perm(u[2], u[3], 0x5410),
                      __byte_perm(u[0], u[1], 0x7632), __byte_perm(u[2], u[3], 0x7632));
}

__device__ __forceinline__ uint4 strata_dq8(uint32_t w, __nv_bfloat16 s, __nv_bfloat16 b) {
    const __nv_bfloat162 s2 = __bfloat162bfloat162(s), b2 = __bfloat162bfloat162(b);
    const __nv_bfloat162 base =
        __bfloat162bfloat162(__ushort_as_bfloat16((unsigned short)0x4300));
    uint32_t u[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t t = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
        __nv_bfloat162 v =
            __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&t), base), s2, b2);
        u[i] = *reinterpret_cast<uint32_t*>(&v);
    }
    return make_uint4(__byte_perm(u[0], u[1], 0x5410), __byte_perm(u[2], u[3], 0x5410),
                      __byte_perm(u[0], u[1], 0x7632), __byte_perm(u[2], u[3], 0x7632));
}
"""

_SOURCE = r"""
    using namespace nvcuda;
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int KW = K / 8;                        // packed words per weight row
    const int G = K / GS;                        // scale groups per weight row
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n0 = blockIdx.x * 16 * NT;
    __shared__ __align__(32) unsigned char smem[SMEM];
    T* ws = reinterpret_cast<T*>(smem) + warp * 16 * NT * LDW;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MT][NT];
    #pragma unroll
    for (int t = 0; t < MT; ++t)
        #pragma unroll
        for (int j = 0; j < NT; ++j) wmma::fill_fragment(acc[t][j], 0.0f);

    const int slabs = K / SLAB;
    const int per = (slabs + WARPS - 1) / WARPS;
    const int s0 = min(warp * per, slabs);
    const int s1 = min(s0 + per, slabs);
    const int r = lane >> 1;                     // this lane's weight row in each 16-row tile
    const int h = lane & 1;                      // which 32 elements of the slab it unpacks

    for (int s = s0; s < s1; s += UNROLL) {
        uint4 q[UNROLL][NT];
        T sc[UNROLL][NT], bi[UNROLL][NT];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (s + u < s1) {
                const int k0 = (s + u) * SLAB + h * 32;
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const size_t row = (size_t)(n0 + j * 16 + r);
                    q[u][j] = reinterpret_cast<const uint4*>(w + row * KW)[k0 / 32];
                    sc[u][j] = scales[row * G + k0 / GS];
                    bi[u][j] = biases[row * G + k0 / GS];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (s + u < s1) {
                const int kb = (s + u) * SLAB;
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[SLAB / 16][MT];
                #pragma unroll
                for (int kk = 0; kk < SLAB / 16; ++kk)
                    #pragma unroll
                    for (int t = 0; t < MT; ++t)
                        wmma::load_matrix_sync(a[kk][t], x + (size_t)t * 16 * K + kb + kk * 16, K);
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    T* dst = ws + (j * 16 + r) * LDW + h * 32;
                    reinterpret_cast<uint4*>(dst)[0] = strata_dq8(q[u][j].x, sc[u][j], bi[u][j]);
                    reinterpret_cast<uint4*>(dst)[1] = strata_dq8(q[u][j].y, sc[u][j], bi[u][j]);
                    reinterpret_cast<uint4*>(dst)[2] = strata_dq8(q[u][j].z, sc[u][j], bi[u][j]);
                    reinterpret_cast<uint4*>(dst)[3] = strata_dq8(q[u][j].w, sc[u][j], bi[u][j]);
                }
                __syncwarp();
                #pragma unroll
                for (int kk = 0; kk < SLAB / 16; ++kk) {
                    #pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                        wmma::load_matrix_sync(b, ws + j * 16 * LDW + kk * 16, LDW);
                        #pragma unroll
                        for (int t = 0; t < MT; ++t)
                            wmma::mma_sync(acc[t][j], a[kk][t], b, acc[t][j]);
                    }
                }
                __syncwarp();
            }
        }
    }

    __syncthreads();                             // every warp is done with its tile
    float* cs = reinterpret_cast<float*>(smem);
    #pragma unroll
    for (int t = 0; t < MT; ++t)
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            wmma::store_matrix_sync(
                cs + ((warp * MT + t) * NT + j) * 256, acc[t][j], 16, wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < MT * NT * 256; i += blockDim.x) {
        const int tile = i / 256, e = i % 256;   // tile = t * NT + j
        float sum = 0.0f;
        #pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += cs[(v * MT * NT + tile) * 256 + e];
        const int m = (tile / NT) * 16 + e / 16, n = n0 + (tile % NT) * 16 + e % 16;
        out[(size_t)m * N + n] = static_cast<T>(sum);
    }
"""


@functools.cache
def _get_kernel():
    """The kernel, built on first use (MLX compiles it per template instantiation)."""
    return mx.fast.cuda_kernel(
        name="strata_mma_qmm",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
    )


def supported(rows: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`matmul` computes ``rows`` rows by an ``[n, k]`` weight of ``bits`` bits in
    groups of ``group_size`` with ``dtype`` activations on this process's backend."""
    return (
        mx.cuda.is_available()
        and 1 <= rows <= MAX_ROWS
        and bits == 4
        and group_size in (32, 64, 128)
        and dtype in OUT_DTYPES
        and n % 16 == 0
        and k % SLAB == 0
        and k % group_size == 0
    )


def matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
) -> mx.array:
    """``x @ dequantize(w).T`` for a 4-bit affine-quantized ``w``, on tensor cores.

    Args:
        x: ``[m, k]`` float16 or bfloat16, ``m <= MAX_ROWS``.
        weight: uint32 ``[n, k / 8]``, row-major contiguous.
        scales: float ``[n, k / group_size]`` (any float dtype).
        biases: like ``scales``.
        group_size: 32, 64 or 128.

    Returns:
        ``[m, n]`` of ``x``'s dtype: float32 sums of the 16-bit products of ``x`` and the
        dequantized weight (each weight element ``scale * q + bias`` rounded once), rounded once.

    Raises:
        ValueError: a shape or dtype :func:`supported` refuses.
    """
    m, k = x.shape
    n = weight.shape[0]
    if not supported(m, n, k, 4, group_size, x.dtype) or weight.shape[1] * 8 != k:
        raise ValueError(
            f"cuda_mma: [{m}, {k}] {x.dtype} by a {tuple(weight.shape)} 4-bit weight in groups "
            f"of {group_size} is not handled here (MLX CUDA, rows <= {MAX_ROWS}, n % 16 == 0, "
            f"k % {SLAB} == 0, 16-bit activations); use mx.quantized_matmul"
        )
    if scales.dtype != x.dtype or biases.dtype != x.dtype:
        raise ValueError(
            f"cuda_mma: scales and biases must be {x.dtype} like the activations (the kernel "
            f"dequantizes in pairs of them); got {scales.dtype}, {biases.dtype}"
        )
    if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        raise ValueError(
            f"cuda_mma: scales {tuple(scales.shape)} and biases {tuple(biases.shape)} do not "
            f"match a [{n}, {k}] weight in groups of {group_size}"
        )
    tiles = -(-m // 16)
    nt = 2 if tiles <= 2 and n % 32 == 0 else 1  # two column tiles share each x fragment
    unroll = UNROLL // nt
    if tiles * 16 != m:  # WMMA tiles are 16 rows: pad with zero rows, dropped below
        x = mx.concatenate([x, mx.zeros((tiles * 16 - m, k), dtype=x.dtype)])
    smem = max(WARPS * 16 * nt * LDW * 2, WARPS * tiles * nt * 256 * 4)
    (out,) = _get_kernel()(
        inputs=[x, weight, scales, biases],
        template=[
            ("T", x.dtype),
            ("GS", group_size),
            ("MT", tiles),
            ("WARPS", WARPS),
            ("NT", nt),
            ("UNROLL", unroll),
            ("SLAB", SLAB),
            ("LDW", LDW),
            ("SMEM", smem),
        ],
        grid=(n // (16 * nt) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(tiles * 16, n)],
        output_dtypes=[x.dtype],
    )
    return out if tiles * 16 == m else out[:m]
