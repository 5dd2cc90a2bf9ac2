"""A batched 4-bit matmul on NVIDIA tensor cores, for products of a few dozen rows, and two
fused forms of it: three weights of one input in one call (Q, K, V), and SwiGLU (gate, up, SiLU
and their product in one call). A single row (a lone decode step) takes the same calls to
``executor.cuda_qmv``'s matvec instead, which reads each weight at the memory's pace and takes
8-bit weights too (the output head of a Q8_0 model).

On MLX's CUDA backend a product of a few rows by a 4-bit weight is slow: ``mx.quantized_matmul``
reads the weight far below the memory's bandwidth, so a pass of a few dozen rows (a prompt's
suffix after a prefix-cache hit, a step of 16 decoded tokens) costs a large part of a long prefill
(figures: docs/kernels.md#the-tensor-core-4-bit-matmul). This kernel reads each packed weight
once per call and multiplies on tensor cores with PTX ``mma.sync.m16n8k16`` (float32
accumulators), the weight as the 16-row ``a`` operand and 8 rows (tokens) of ``x`` as the ``b``
operand:

- a warp owns ``RT`` tiles of 16 weight rows (output columns) and a run of K chunks; a block's
  ``WARPS`` warps split K between them (:func:`warps_per_block`, a function of the weight's shape
  alone), and their partial sums meet in shared memory, added in warp order (deterministic);
- per chunk of ``32 * WPL`` K elements, lane ``(g, t)`` loads ``WPL`` packed words (16 or 8
  bytes) of weight rows ``g`` and ``g + 8`` of each tile, from K element ``32 * WPL * chunk + 8 *
  WPL * t``: the four lanes of a row read its contiguous bytes. Each word (8 elements) is
  dequantized in registers straight into ``a`` fragments of two k16 products: the mma pairs
  ``a`` and ``b`` by their fragment positions, so any permutation of K that is the same for both
  is exact, and this one lets each lane read its 8 ``x`` elements as one 16-byte vector of ``x``
  (no shared memory, no shuffles, and no copy of the weight to a tile);
- dequantizing converts no integers: ``q | 0x6400`` is the float16 1024 + q (``q | 0x4300`` the
  bfloat16 128 + q), the base is subtracted exactly and ``scale * q + bias`` is one fused
  multiply-add of 16-bit pairs (one rounding of the exact value); conversion instructions issue at
  a quarter of the FMA rate on sm_90;
- a warp issues the weight loads of several chunks (``LOAD_WORDS`` words per lane) before using
  any, so that enough reads are in flight.

A row's result does not depend on the other rows or on how many there are (each 8-row column
tile is computed alike), so products through this kernel are batch invariant across its row
counts. The fused forms take one call where the model made three (Q, K, V) or four (gate, up,
SiLU, the product), and each call on MLX's CUDA backend costs the host several us beside its work
(docs/kernels.md#the-tensor-core-4-bit-matmul). They read each weight where it lies (any tier's
arrays, nothing stacked): a block's warps are assigned to one weight's row tiles. ``matmul3``'s
products equal :func:`matmul`'s bit for bit (:func:`fusable`: the same K split); ``swiglu``
rounds once where the unfused form rounds each step, the same for every tier.

Its timings against MLX's quantized matmul and the WMMA kernel it replaced, its Nsight Compute
profile, and the variants tried and not shipped (x, or the weights, staged in shared memory):
docs/kernels.md#the-tensor-core-4-bit-matmul.

``matmul(..., residual=r)`` adds the residual in the store (``plain_add``: ``r + T(sum)`` by the
dtype's own ``+``, bit for bit the separate add), one operation of the graph fewer per block
output projection. Each call's launch (validation, grid, template) is worked out once per
signature (:data:`_LAUNCHES`).

Layout (``strata.common.quant``): element ``j`` of a uint32 word sits at bits ``4 * j``;
``w = scale * q + bias`` per group of ``group_size`` (32, 64 or 128) elements along a row."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass

import mlx.core as mx
from strata.executor import cuda_qmv
from strata.executor.cuda_source import MMA_M16N8K16, compact, tensor_cores

__all__ = ["MAX_ROWS", "Rope", "fusable", "matmul", "matmul3", "supported", "swiglu"]

MAX_ROWS = 64
"""Most rows one call computes: eight 8-token column tiles of the mma products."""

TARGET_WARPS = 2048
"""Warps a call aims for (about 16 per multiprocessor of the H200's 132): :func:`warps_per_block`
splits K over more warps until the grid has this many."""

MAX_WARPS = 8
"""Most warps of one block (256 threads: at 512, the kernel's registers exceeded what one
multiprocessor has for a block, and the launch failed on the H200)."""

MIN_CHUNKS = 2
""":func:`warps_per_block` splits K further only while each warp would get at least this many
K chunks on average (the last warps may get fewer, or none: K = 576 is 9 chunks over 4 warps,
3/3/3/0)."""

LOAD_WORDS = 32
"""Packed words per lane in flight: :func:`matmul` issues ``U`` chunks' weight loads (``RT`` row
tiles of two rows of ``WPL`` words each) before it uses any, ``U * RT * 2 * WPL`` = 32 (128
bytes)."""

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

_MMA = r"""
// XW 16-byte vectors (8 elements each, from element kx on) of each of NTOK rows 8j + g of the
// row-major [rows, K] activations x.
template <int XW, int NTOK, typename T>
__device__ __forceinline__ void strata_ldx(uint4 (&xv)[XW][NTOK], const T* x, int K, int g,
                                           int kx) {
    #pragma unroll
    for (int e = 0; e < XW; ++e)
        #pragma unroll
        for (int j = 0; j < NTOK; ++j)
            xv[e][j] = *reinterpret_cast<const uint4*>(x + (size_t)(8 * j + g) * K + kx + 8 * e);
}
"""

_BODY = r"""
    const int K = STRATA_K;
    const int KW = K / 8;                        // packed words per weight row
    const int G = K / GS;                        // scale groups per weight row
    constexpr int CK = 32 * WPL;                 // K elements per chunk: WPL words per lane quad
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;       // mma fragment coordinates
    // The warp's RT row tiles: tile r is rows rr[r] .. + 15 of the weight wr[r] (scales sr[r],
    // biases br[r]); the block's results go to o (row stride ld, first column base).
    const uint32_t* wr[RT];
    const T* sr[RT];
    const T* br[RT];
    int rr[RT];
    T* o;
    int ld, base;
    bool rot = false;                            // split3_rope: Q's or K's columns (RoPE'd)
    STRATA_TILES
    const int chunks = K / CK;
    const int per = (chunks + WARPS - 1) / WARPS;
    const int c0 = min(warp * per, chunks);
    const int c1 = min(c0 + per, chunks);
    const T* tag = nullptr;

    float acc[RT][NTOK][4];
    #pragma unroll
    for (int r = 0; r < RT; ++r)
        #pragma unroll
        for (int j = 0; j < NTOK; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.0f;

    // x is read through the cache in batches of XW words per lane (NTOK 16-byte vectors each).
    constexpr int XW = NTOK <= 2 ? WPL : (NTOK <= 4 ? 2 : 1);
    constexpr int BPC = WPL / XW;                // batches per chunk
    uint4 xv[XW][NTOK];

    for (int c = c0; c < c1; c += U) {
        // Issue every weight load of U chunks before using any (reads in flight).
        uint32_t q[U][RT][2][WPL];
        T sc[U][RT][2], bi[U][RT][2];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c + u < c1) {
                const int kw = (c + u) * (CK / 8) + t * WPL;
                const int gi = ((c + u) * CK + t * 8 * WPL) / GS;
                #pragma unroll
                for (int r = 0; r < RT; ++r)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const size_t row = (size_t)(rr[r] + 8 * h + g);
                        const uint32_t* p = wr[r] + row * KW + kw;
                        if constexpr (WPL == 4) {
                            const uint4 v = *reinterpret_cast<const uint4*>(p);
                            q[u][r][h][0] = v.x; q[u][r][h][1] = v.y;
                            q[u][r][h][2] = v.z; q[u][r][h][3] = v.w;
                        } else {
                            const uint2 v = *reinterpret_cast<const uint2*>(p);
                            q[u][r][h][0] = v.x; q[u][r][h][1] = v.y;
                        }
                        sc[u][r][h] = sr[r][row * G + gi];
                        bi[u][r][h] = br[r][row * G + gi];
                    }
            }
        }
        #pragma unroll
        for (int s = 0; s < U * BPC; ++s) {
            const int u = s / BPC, d0 = (s % BPC) * XW;
            if (c + u < c1) {
                strata_ldx<XW, NTOK>(xv, x, K, g, (c + u) * CK + t * 8 * WPL + 8 * d0);
                // Word d of this lane: K elements kx + 8d .. + 7, two k16 products. The lanes'
                // K indices are a permutation of the chunk's, the same for a and b.
                #pragma unroll
                for (int e = 0; e < XW; ++e) {
                    const int d = d0 + e;
                    #pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        const uint4 lo = strata_dq8(q[u][r][0][d], sc[u][r][0], bi[u][r][0]);
                        const uint4 hi = strata_dq8(q[u][r][1][d], sc[u][r][1], bi[u][r][1]);
                        #pragma unroll
                        for (int j = 0; j < NTOK; ++j) {
                            strata_mma(acc[r][j], make_uint4(lo.x, hi.x, lo.y, hi.y),
                                       make_uint2(xv[e][j].x, xv[e][j].y), tag);
                            strata_mma(acc[r][j], make_uint4(lo.z, hi.z, lo.w, hi.w),
                                       make_uint2(xv[e][j].z, xv[e][j].w), tag);
                        }
                    }
                }
            }
        }
    }

    // The warps' partial sums meet in shared memory, 8 tokens at a time, and are added in warp
    // order (deterministic).
    __shared__ float red[WARPS][8][16 * RT];
    #pragma unroll
    for (int j = 0; j < NTOK; ++j) {
        #pragma unroll
        for (int r = 0; r < RT; ++r) {
            red[warp][2 * t][16 * r + g] = acc[r][j][0];
            red[warp][2 * t + 1][16 * r + g] = acc[r][j][1];
            red[warp][2 * t][16 * r + g + 8] = acc[r][j][2];
            red[warp][2 * t + 1][16 * r + g + 8] = acc[r][j][3];
        }
        __syncthreads();
"""

_TILES = {
    # One weight [N, K]; a block owns 16 * RT rows side by side.
    "plain": r"""
    #pragma unroll
    for (int r = 0; r < RT; ++r) {
        wr[r] = w; sr[r] = scales; br[r] = biases; rr[r] = blockIdx.x * 16 * RT + 16 * r;
    }
    o = out; ld = w_shape[0]; base = blockIdx.x * 16 * RT;
""",
    # Three weights of one input (Q, K, V): the blocks cover their rows in order, each block
    # within one of them (their row counts are multiples of 16 * RT).
    "split3": r"""
    {
        const int n0 = blockIdx.x * 16 * RT, e0 = w0_shape[0], e1 = e0 + w1_shape[0];
        const uint32_t* pw = w0; const T* ps = s0; const T* pb = b0;
        o = out0; ld = e0; base = n0; rot = true;
        if (n0 >= e1) {
            pw = w2; ps = s2; pb = b2; o = out2; ld = w2_shape[0]; base = n0 - e1; rot = false;
        } else if (n0 >= e0) {
            pw = w1; ps = s1; pb = b1; o = out1; ld = w1_shape[0]; base = n0 - e0;
        }
        #pragma unroll
        for (int r = 0; r < RT; ++r) { wr[r] = pw; sr[r] = ps; br[r] = pb; rr[r] = base + 16 * r; }
    }
""",
    # Gate and up weights of one shape [F, K] (RT == 2): tile 0 the gate's rows, tile 1 the
    # same rows of up.
    "swiglu": r"""
    wr[0] = wg; sr[0] = sg; br[0] = bg; wr[1] = wu; sr[1] = su; br[1] = bu;
    rr[0] = rr[1] = blockIdx.x * 16;
    o = out; ld = wg_shape[0]; base = blockIdx.x * 16;
""",
}
"""How each kernel maps its row tiles to weights and its results to outputs."""

_SUMS = r"""
        for (int i = threadIdx.x; i < 8 * 16 * RT; i += blockDim.x) {
            const int tok = i / (16 * RT), col = i % (16 * RT);
            float sum = 0.0f;
            #pragma unroll
            for (int v = 0; v < WARPS; ++v) sum += red[v][tok][col];
            o[(size_t)(8 * j + tok) * ld + base + col] = static_cast<T>(sum);
        }
        __syncthreads();
    }
"""
"""The block's 16 * RT columns of 8 tokens, each the warps' sum, rounded once."""

_SUMS_ADD = _SUMS.replace(
    "= static_cast<T>(sum);",
    "= res[(size_t)(8 * j + tok) * ld + base + col] + static_cast<T>(sum);",
)
"""As ``_SUMS``, each result then added to the residual's element in its place by ``T``'s own
``+`` (as MLX's add of two ``T`` arrays: the same bits as adding the rounded product after)."""

_ROPE_SUMS = r"""
        for (int i = threadIdx.x; i < 8 * 8 * RT; i += blockDim.x) {
            const int tok = i / (8 * RT), col = 2 * (i % (8 * RT));
            float s0 = 0.0f, s1 = 0.0f;
            #pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                s0 += red[v][tok][col];
                s1 += red[v][tok][col + 1];
            }
            T y0 = static_cast<T>(s0), y1 = static_cast<T>(s1);
            const int row = 8 * j + tok, pair = ((base + col) % HD) / 2;
            if (rot && 2 * pair < RD) {
                // MLX's rope kernel's arithmetic (mlx/backend/cuda/rope.cu, rope_impl and
                // rope_freqs / rope) on the rounded product, step for step.
                float inv;
                if constexpr (FREQS) {
                    inv = 1.0 / freqs[pair];
                } else {
                    const float d = static_cast<float>(pair) / static_cast<float>(RD / 2);
                    inv = exp2(-d * rope[1]);
                }
                const int p = row < positions_shape[0] ? positions[row] : 0;
                const float L = rope[0] * static_cast<float>(p);
                const float theta = L * inv;
                const float ct = cos(theta), st = sin(theta);
                const float x1 = static_cast<float>(y0), x2 = static_cast<float>(y1);
                y0 = static_cast<T>(x1 * ct - x2 * st);
                y1 = static_cast<T>(x1 * st + x2 * ct);
            }
            T* dst = o + (size_t)row * ld + base + col;
            dst[0] = y0;
            dst[1] = y1;
        }
        __syncthreads();
    }
"""
"""As ``_SUMS`` for adjacent column pairs, each pair of Q's and K's first ``RD`` columns of a
head (``HD`` columns) then rotated as MLX's ``mx.fast.rope`` with ``traditional=True`` rotates
the rounded product (its offset the row's ``positions`` entry, its inverse frequency
``1 / freqs[pair]`` with ``FREQS``, else ``2 ** (-pair / (RD / 2) * log2(base))``, ``rope`` =
[scale, log2(base)]); V's columns as ``_SUMS`` writes them."""

_STORE = {
    "plain": _SUMS,
    "plain_add": _SUMS_ADD,
    "split3": _SUMS,
    "split3_rope": _ROPE_SUMS,
    # silu(gate) * up of the float32 sums of the two row tiles, rounded once.
    "swiglu": r"""
        for (int i = threadIdx.x; i < 8 * 16; i += blockDim.x) {
            const int tok = i / 16, col = i % 16;
            float gate = 0.0f, up = 0.0f;
            #pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                gate += red[v][tok][col];
                up += red[v][tok][16 + col];
            }
            o[(size_t)(8 * j + tok) * ld + base + col] =
                static_cast<T>(gate / (1.0f + __expf(-gate)) * up);
        }
        __syncthreads();
    }
""",
}

_TILES["plain_add"] = _TILES["plain"]
_TILES["split3_rope"] = _TILES["split3"]

_INPUTS = cuda_qmv.INPUTS
_OUTPUTS = cuda_qmv.OUTPUTS
"""The same inputs and outputs as the one-row kernel's: ``_call`` hands either kernel one list."""


_K = {
    "plain": "w_shape[1] * 8",
    "plain_add": "w_shape[1] * 8",
    "split3": "w0_shape[1] * 8",
    "split3_rope": "w0_shape[1] * 8",
    "swiglu": "wg_shape[1] * 8",
}
"""K of each kernel, from its (first) weight's packed words: ``x`` may be of any rank."""


@functools.cache
def _get_kernel(store: str):
    """The kernel writing its results as ``store`` says (a key of ``_STORE``), built on first
    use (MLX compiles it per template instantiation)."""
    source = _BODY.replace("STRATA_TILES", _TILES[store]).replace("STRATA_K", _K[store])
    return mx.fast.cuda_kernel(
        name=f"strata_mma_qmm_{store}",
        input_names=_INPUTS[store],
        output_names=_OUTPUTS[store],
        source=compact(source + _STORE[store]),
        header=compact(_HEADER + MMA_M16N8K16 + _MMA),
    )


def words_per_lane(k: int) -> int:
    """Packed words (8 elements each) a lane reads per row per K chunk: 4 (chunks of 128
    elements, 16-byte loads) where 128 divides ``k``, else 2 (64 elements)."""
    return 4 if k % 128 == 0 else 2


@functools.cache  # asked on every fused projection's call (executor.ops._fusable)
def warps_per_block(n: int, k: int) -> int:
    """Warps that split the K dimension of an ``[n, k]`` weight, a function of the weight's
    shape alone (so that a row's result does not depend on the row count): doubled from 1
    while the grid of ``n / 16`` row tiles has fewer than ``TARGET_WARPS`` warps, a block fewer
    than ``MAX_WARPS`` and the doubled split leaves each warp ``MIN_CHUNKS`` chunks of K on
    average."""
    tiles, chunks = n // 16, k // (32 * words_per_lane(k))
    warps = 1
    while warps < MAX_WARPS and tiles * warps < TARGET_WARPS and chunks >= 2 * MIN_CHUNKS * warps:
        warps *= 2
    return warps


def supported(rows: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`matmul` computes ``rows`` rows by an ``[n, k]`` weight of ``bits`` bits in
    groups of ``group_size`` with ``dtype`` activations on this process's backend: one row by
    ``executor.cuda_qmv`` (4 or 8 bits, MLX CUDA), more on tensor cores (4 bits, MLX CUDA on
    sm_80 or later: ``tensor_cores``)."""
    if rows == 1 and cuda_qmv.supported(n, k, bits, group_size, dtype):
        return True
    return (
        tensor_cores()
        and 1 <= rows <= MAX_ROWS
        and bits == 4
        and group_size in (32, 64, 128)
        and dtype in OUT_DTYPES
        and n % 16 == 0
        and k % 64 == 0
        and k % group_size == 0
    )


def _check(m: int, k: int, dtype: mx.Dtype, weight: Quant, group_size: int) -> None:
    """Raise ValueError unless :func:`supported` takes ``m`` rows of ``dtype`` by ``weight``
    (``[n, k]``) and its scales and biases match it."""
    weight, scales, biases = weight
    n = weight.shape[0]
    bits = cuda_qmv.weight_bits(weight, k) if m == 1 else 4
    if not supported(m, n, k, bits, group_size, dtype) or weight.shape[1] * 32 != k * bits:
        raise ValueError(
            f"cuda_mma: [{m}, {k}] {dtype} by a {tuple(weight.shape)} packed weight in groups "
            f"of {group_size} is not handled here (MLX CUDA, 4 bits, rows <= {MAX_ROWS}, n % 16 "
            f"== 0, k % 64 == 0, or one row of 4 or 8 bits with k % 32 == 0; groups of 32, 64 or "
            f"128 dividing k, 16-bit activations); use mx.quantized_matmul"
        )
    if scales.dtype != dtype or biases.dtype != dtype:
        raise ValueError(
            f"cuda_mma: scales and biases must be {dtype} like the activations (the kernel "
            f"dequantizes in pairs of them); got {scales.dtype}, {biases.dtype}"
        )
    if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        raise ValueError(
            f"cuda_mma: scales {tuple(scales.shape)} and biases {tuple(biases.shape)} do not "
            f"match a [{n}, {k}] weight in groups of {group_size}"
        )


Quant = tuple[mx.array, mx.array, mx.array]
"""A 4-bit weight as (packed uint32 ``[n, k / 8]``, scales, biases ``[n, k / group_size]``)."""


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding (Su et al. 2021, "RoFormer") of Q and K in :func:`matmul3`'s
    store, rotating adjacent pairs (MLX's ``traditional=True``, llama.cpp's NORM RoPE), with
    ``mx.fast.rope``'s arithmetic: a rounded product's pair ``(x1, x2)`` of head column pair
    ``i < dims / 2`` at position ``p`` becomes ``(x1 cos t - x2 sin t, x1 sin t + x2 cos t)``,
    ``t = scale * p * inv``, ``inv = 1 / freqs[i]`` where ``freqs`` is given, else
    ``2 ** (-(i / (dims / 2)) * log2(base))``; the rest of a head passes as it is.

    Attributes:
        positions: int32 ``[m]``, each row's position (MLX's ``offset``).
        params: float32 ``[2]``: ``scale`` and ``log2(base)`` (as MLX rounds it: the float32
            ``log2`` of the float32 base; unused with ``freqs``).
        freqs: float32 ``[dims / 2]``, MLX's ``freqs`` (periods), or None.
        head_dim: columns of a head (Q's and K's widths are multiples of it).
        dims: rotated columns of a head (even, at most ``head_dim``).
    """

    positions: mx.array
    params: mx.array
    freqs: mx.array | None
    head_dim: int
    dims: int


@dataclass(frozen=True)
class _Launch:
    """One call's arguments to MLX, worked out once per signature (:func:`_call`).

    ``pad``: zero rows that make ``x``'s ``m`` rows whole 8-row column tiles of the mma. With
    none the kernel writes the results in their ``shapes`` (the same row-major layout: no
    reshape in the graph); with some, ``x`` is flattened and padded, the kernel writes
    ``[m + pad, n_i]`` (``written``), and the results are cut back and reshaped."""

    kernel: object
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    shapes: list[tuple[int, ...]]
    written: list[tuple[int, ...]]
    dtypes: list[mx.Dtype]
    m: int
    k: int
    pad: int


_LAUNCHES: dict[tuple, _Launch] = {}
"""Signature (kernel, ``x``'s shape and dtype, group size, output shapes, the residual's shape
and dtype, the weights' shapes and dtypes or the caller's ``signature`` for them, and a RoPE's
:func:`_rope_key`) -> its :class:`_Launch`. Validating and working out a call cost more host
time than MLX's own cost of a call, and a pass of the Llama-3-8B shape makes 160 of them
(docs/kernels.md#the-tensor-core-4-bit-matmul)."""

_MAX_LAUNCHES = 4096
"""Signatures kept (the cache is emptied past this: a pass meets a few dozen)."""


def _row_tiles(n: int, k: int, m: int) -> int:
    """Row tiles per warp: two (each x fragment used twice) where the weight's rows come in
    32s, that still leaves half of ``TARGET_WARPS`` and the accumulators fit (at most 32 rows
    of ``x``); else one. A row's sums are the same either way."""
    warps = warps_per_block(n, k)
    return 2 if n % 32 == 0 and n // 32 * warps >= TARGET_WARPS // 2 and m <= 32 else 1


def _prepare(
    store: str,
    x_shape: tuple[int, ...],
    dtype: mx.Dtype,
    weights: list[Quant],
    group_size: int,
    shapes: list[tuple[int, ...]] | None,
    residual: tuple[tuple[int, ...], mx.Dtype] | None = None,
    rope: tuple | None = None,
) -> _Launch:
    """Validate a call of the ``store`` kernel and work out its arguments (``residual``: the
    shape and dtype of ``plain_add``'s residual; ``rope``: ``split3_rope``'s :func:`_rope_key`).

    Raises:
        ValueError: as :func:`matmul`, :func:`matmul3` and :func:`swiglu` say.
    """
    if not x_shape:
        raise ValueError("cuda_mma: x must have at least one dimension, [..., k]")
    k, m = x_shape[-1], math.prod(x_shape[:-1])
    for w in weights:
        _check(m, k, dtype, w, group_size)
    widths = [w[0].shape[0] for w in weights]
    if store.startswith("split3") and (len(weights) != 3 or not fusable(weights, k, m)):
        raise ValueError(
            "cuda_mma.matmul3: needs three weights with the same K split, or for one row the "
            "same bits (cuda_mma.fusable); call matmul per weight"
        )
    if store == "swiglu" and weights[0][0].shape != weights[1][0].shape:
        raise ValueError(
            f"cuda_mma.swiglu: gate {tuple(weights[0][0].shape)} and up "
            f"{tuple(weights[1][0].shape)} differ in shape"
        )
    if store == "swiglu":
        widths, rt = widths[:1], 2
    elif store.startswith("split3"):
        rt = _row_tiles(sum(widths), k, m) if all(n % 32 == 0 for n in widths) else 1
    else:
        rt = _row_tiles(widths[0], k, m)
    lead = tuple(x_shape[:-1])
    if residual is not None:
        if residual[1] != dtype:
            raise ValueError(
                f"cuda_mma.matmul: the residual is {residual[1]}, the activations {dtype}; "
                f"give both one dtype"
            )
        shapes = [tuple(residual[0])]
    out = shapes or [(*lead, n) for n in widths]
    sizes = [math.prod(s) for s in out]
    if residual is not None and sizes != [m * n for n in widths]:
        raise ValueError(
            f"cuda_mma.matmul: the residual {tuple(residual[0])} does not hold the [{m}, "
            f"{widths[0]}] product; give one of {m * widths[0]} elements"
        )
    if sizes != [m * n for n in widths]:
        raise ValueError(
            f"cuda_mma: output shapes {out} do not hold [{m}, n] results for widths {widths}"
        )
    if m == 1:  # the one-row kernel (executor.cuda_qmv): no padding, any K split
        bits = {cuda_qmv.weight_bits(w[0], k) for w in weights}
        if len(bits) != 1:
            raise ValueError(f"cuda_mma: the weights of one call differ in bits ({sorted(bits)})")
        kernel, template, grid, threads = cuda_qmv.launch(
            store, k, dtype, bits.pop(), group_size, widths
        )
        if store == "split3_rope":
            template += _rope_template(rope, m, widths)
        shapes = [tuple(s) for s in out]
        return _Launch(
            kernel, template, grid, threads, shapes, shapes, [dtype] * len(widths), m, k, 0
        )
    ntok = -(-m // 8)
    warps, wpl = warps_per_block(weights[0][0].shape[0], k), words_per_lane(k)
    # A swiglu block's two row tiles are the same rows of gate and up.
    blocks = widths[0] // 16 if store == "swiglu" else sum(widths) // (16 * rt)
    pad = ntok * 8 - m
    template = [
        ("T", dtype),
        ("GS", group_size),
        ("NTOK", ntok),
        ("RT", rt),
        ("WARPS", warps),
        ("WPL", wpl),
        ("U", LOAD_WORDS // (rt * 2 * wpl)),
    ]
    if store == "split3_rope":
        template += _rope_template(rope, m, widths)
    return _Launch(
        kernel=_get_kernel(store),
        template=template,
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        shapes=[tuple(s) for s in out],
        written=[(m + pad, n) for n in widths] if pad else [tuple(s) for s in out],
        dtypes=[dtype] * len(widths),
        m=m,
        k=k,
        pad=pad,
    )


def _rope_key(rope: Rope) -> tuple:
    """What of a :class:`Rope` a launch depends on: the arrays' shapes and dtypes, the head's
    columns and the rotated ones."""
    arrays = (rope.positions, rope.params, rope.freqs)
    return (
        *((None, None) if a is None else (a.shape, a.dtype) for a in arrays),
        rope.head_dim,
        rope.dims,
    )


def _rope_template(key: tuple | None, m: int, widths: list[int]) -> list[tuple[str, object]]:
    """``split3_rope``'s template arguments (``HD``, ``RD``, ``FREQS``) for a :func:`_rope_key`.

    Raises:
        ValueError: arrays of the wrong shape or dtype; dims odd or above ``head_dim``; Q's or
            K's width not a multiple of ``head_dim``.
    """
    assert key is not None  # matmul3 passes it with the store
    (pos_shape, pos_dtype), (par_shape, par_dtype), (fr_shape, fr_dtype), hd, dims = key
    if not (0 < dims <= hd and dims % 2 == 0 and hd % 2 == 0):
        raise ValueError(
            f"cuda_mma.matmul3: RoPE of {dims} of {hd} columns: give an even dims <= head_dim"
        )
    if any(n % hd for n in widths[:2]):
        raise ValueError(
            f"cuda_mma.matmul3: Q and K widths {widths[:2]} are not whole heads of {hd}"
        )
    if pos_dtype != mx.int32 or pos_shape != (m,):
        raise ValueError(
            f"cuda_mma.matmul3: RoPE positions must be int32 [{m}], got {pos_dtype} {pos_shape}"
        )
    if par_dtype != mx.float32 or par_shape != (2,):
        raise ValueError("cuda_mma.matmul3: RoPE params must be float32 [2] (scale, log2(base))")
    if fr_shape is not None and (fr_dtype != mx.float32 or fr_shape != (dims // 2,)):
        raise ValueError(
            f"cuda_mma.matmul3: RoPE freqs must be float32 [{dims // 2}], got {fr_dtype} {fr_shape}"
        )
    return [("HD", hd), ("RD", dims), ("FREQS", fr_shape is not None)]


def _call(
    store: str,
    x: mx.array,
    weights: list[Quant],
    group_size: int,
    shapes: list[tuple[int, ...]] | None = None,
    signature: Hashable | None = None,
    residual: mx.array | None = None,
    rope: Rope | None = None,
) -> list[mx.array]:
    """One call of the ``store`` kernel (a key of ``_STORE``), its arguments from the
    signature's :class:`_Launch` (validated and worked out on its first call). ``signature``
    stands for the weights' shapes and dtypes in the cache key where the caller has one (see
    :func:`matmul`); else they are read from the arrays."""
    if signature is None:
        signature = tuple((w.shape, s.shape, s.dtype, b.shape, b.dtype) for w, s, b in weights)
    res = None if residual is None else (residual.shape, residual.dtype)
    rk = None if rope is None else _rope_key(rope)
    key = (store, x.shape, x.dtype, group_size, None if shapes is None else tuple(shapes))
    key += (res, signature, rk)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        launch = _prepare(store, x.shape, x.dtype, weights, group_size, shapes, res, rk)
        _LAUNCHES[key] = launch
    extra = [] if residual is None else [residual]
    if rope is not None:  # freqs unused without FREQS: any float32 array stands in
        extra = [rope.positions, rope.params if rope.freqs is None else rope.freqs, rope.params]
    if launch.pad:  # whole 8-row column tiles: zero rows appended, dropped below
        zeros = mx.zeros((launch.pad, launch.k), dtype=x.dtype)
        x = mx.concatenate([x.reshape(launch.m, launch.k), zeros])
        if residual is not None:
            n = launch.written[0][1]
            extra = [
                mx.concatenate(
                    [residual.reshape(launch.m, n), mx.zeros((launch.pad, n), dtype=residual.dtype)]
                )
            ]
    outs = launch.kernel(
        inputs=[x, *(a for w in weights for a in w), *extra],
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.written,
        output_dtypes=launch.dtypes,
    )
    if launch.pad:
        return [o[: launch.m].reshape(s) for o, s in zip(outs, launch.shapes, strict=True)]
    return list(outs)


def matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    residual: mx.array | None = None,
    signature: Hashable | None = None,
) -> mx.array:
    """``x @ dequantize(w).T`` for a 4-bit affine-quantized ``w``, on tensor cores; with a
    ``residual``, ``residual + x @ dequantize(w).T`` in the same call (a block's output
    projection added to the residual stream: one operation of the graph fewer, each costing
    MLX's CUDA backend a few us of host time).

    Args:
        x: ``[..., k]`` float16 or bfloat16, row-major, at most ``MAX_ROWS`` rows in all
            (``m``, the product of the leading dimensions).
        weight: uint32 ``[n, k / 8]``, row-major contiguous (one row of ``x``: also 8-bit,
            ``[n, k / 4]``, by ``executor.cuda_qmv``).
        scales: float ``[n, k / group_size]`` of ``x``'s dtype.
        biases: like ``scales``.
        group_size: 32, 64 or 128.
        residual: None, or ``m * n`` elements of ``x``'s dtype (any shape, row-major: the
            result takes its shape), e.g. the ``[1, m, n]`` residual stream.
        signature: a hashable standing for the weight's shapes and dtypes in the kernel's
            launch cache (``executor.ops.QuantLinear.signature``), where reading them from the
            arrays costs each call a few us; None reads them. It must change whenever they do.

    Returns:
        ``[..., n]`` (or ``residual``'s shape) of ``x``'s dtype: float32 sums of the 16-bit
        products of ``x`` and the dequantized weight (each weight element ``scale * q + bias``
        rounded once), rounded once, then added to ``residual`` by its dtype's ``+`` (bit for
        bit ``residual + matmul(x, ...)``). Where ``m`` is a multiple of 8 the kernel writes
        this shape itself (no reshape). One row (``executor.cuda_qmv``) sums the exact weights
        in float32 instead, so it differs from the same row in a pass of several in the last
        bits.

    Raises:
        ValueError: a shape or dtype :func:`supported` refuses; a residual of another dtype or
            size.
    """
    store = "plain" if residual is None else "plain_add"
    return _call(store, x, [(weight, scales, biases)], group_size, None, signature, residual)[0]


def fusable(weights: list[Quant], k: int, rows: int = 0) -> bool:
    """Whether :func:`matmul3` may compute these weights in one call with each one's results
    equal to its own :func:`matmul`'s, bit for bit: the same K split (:func:`warps_per_block`)
    for all of them, or one row (``rows`` 1: ``executor.cuda_qmv`` sums every row alike) by
    weights of one bit width (one call unpacks one: a Q4_K_M model's 8-bit V beside 4-bit Q
    and K takes three calls)."""
    if rows == 1:
        return len({cuda_qmv.weight_bits(w[0], k) for w in weights}) == 1
    return len({warps_per_block(w[0].shape[0], k) for w in weights}) == 1


def matmul3(
    x: mx.array,
    weights: list[Quant],
    group_size: int,
    shapes: list[tuple[int, ...]] | None = None,
    signature: Hashable | None = None,
    rope: Rope | None = None,
) -> list[mx.array]:
    """:func:`matmul` of ``x`` by three weights of the same input (an attention block's Q, K
    and V) in one kernel call, where three calls would each pay MLX's per-call cost: each result
    equal to that weight's own :func:`matmul`, bit for bit.

    Args:
        weights: three (weight, scales, biases) of ``[n_i, k]`` weights, each ``n_i`` a multiple
            of 16, :func:`fusable`.
        shapes: each result's shape, of ``m * n_i`` elements (the row-major ``[m, n_i]``
            viewed so, e.g. ``[m, heads, 1, head_dim]`` for RoPE); None: ``[..., n_i]``.
        signature: as :func:`matmul`'s, for the three weights.
        rope: None, or the RoPE of the first two results (Q and K), applied in the store as
            ``mx.fast.rope(..., traditional=True)`` would apply it to them (:class:`Rope`): two
            operations of the graph fewer per attention block.
        others: as :func:`matmul`.

    Returns:
        the three results, in order.

    Raises:
        ValueError: as :func:`matmul` for any of them; not three, or not :func:`fusable`;
            ``shapes`` of the wrong sizes; a ``rope`` :func:`_rope_template` refuses.
    """
    if rope is None:
        return _call("split3", x, weights, group_size, shapes, signature)
    return _call("split3_rope", x, weights, group_size, shapes, signature, rope=rope)


def swiglu(
    x: mx.array, gate: Quant, up: Quant, group_size: int, signature: Hashable | None = None
) -> mx.array:
    """``silu(x @ gate.T) * (x @ up.T)`` in one kernel call: SwiGLU (Shazeer 2020, "GLU Variants
    Improve Transformer"), as Llama's FFN computes before its down projection, where the unfused
    form takes four calls (two products, SiLU, their product).

    Args:
        gate, up: (weight, scales, biases) of two ``[f, k]`` weights.
        signature: as :func:`matmul`'s, for the two weights.
        others: as :func:`matmul` (``m`` up to ``MAX_ROWS``; from 33 rows each warp holds 40-64
            float32 accumulators, more registers than the 2-32 rows the profile gives it).

    Returns:
        ``[m, f]`` of ``x``'s dtype: the gate's and up's float32 sums (as :func:`matmul` forms
        them), combined in float32 and rounded once. The unfused form rounds each product,
        then SiLU, then their product: the two differ by rounding.

    Raises:
        ValueError: as :func:`matmul`; gate and up of different shapes.
    """
    return _call("swiglu", x, [gate, up], group_size, None, signature)[0]
