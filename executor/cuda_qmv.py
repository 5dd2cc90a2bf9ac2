"""A one-row quantized product on NVIDIA GPUs: the matrix-vector kernel of a lone decode step,
in the forms ``executor.cuda_mma`` offers (plain, residual added, Q/K/V in one call with RoPE in
the store, SwiGLU), for 4- and 8-bit affine weights.

One token's decode step reads every weight once, so its products are bound by the memory: at
one row MLX's 4-bit quantized matvec read a Llama-3-8B block's weights at 0.2-0.9 TB/s on an H100
(3.35 TB/s peak), and the tensor-core kernel is built for 8-row tiles. This kernel is laid out
for the memory (how it compares, shape by shape: docs/kernels.md#the-one-row-kernel):

- a warp computes ``R`` weight rows (4: two RoPE pairs, or two SwiGLU columns' gate and up rows)
  by the one row of ``x``; per slab of ``32 * EPL`` K elements each lane reads 16 contiguous bytes
  of every row (``EPL`` elements: 32 at 4 bits, 16 at 8) and the 16-bit ``x`` elements there, so a
  warp's loads are whole 512-byte runs of a row; ``U`` slabs' loads are issued before any is
  used (reads in flight);
- no integer is converted: a 4-bit element moved to bits 16-19 (or 12-15) of the float 1.0 reads
  ``1 + q / 128`` (``1 + q / 2048``), an 8-bit one at bits 15-22 ``1 + q / 256``, each exact, and
  so is its product with an ``x`` element (few significant bits); a lane's products are summed in
  float32 per 16-byte group and the group's scale and bias applied once:
  ``sum((s q + b) x) = s 2^P (d - sum x) + b sum x`` (``d`` the sum of ``(1 + q / 2^P) x``);
- the lanes' sums meet by a butterfly of shuffles, which leaves the same bits in every lane (each
  step adds the same two values, in either order); lanes 0.. ``R - 1`` store, in the form the
  store asks (:data:`_STORE`).

Its results are float32 sums rounded once to ``x``'s dtype. The weight is not rounded to 16 bits
first as the tensor-core kernel rounds it, so the two differ in the last bits: a token's row gives
the same bits in every one-row pass, not the same as in a pass of several rows (which
``executor.cuda_mma`` computes; batch-invariant serving tiles every product by 16 rows and never
comes here).

Layout (``strata.common.quant``): element ``j`` of a uint32 word sits at bits ``bits * j``;
``w = scale * q + bias`` per group of ``group_size`` (32, 64 or 128) elements along a row.
Timings: docs/kernels.md#the-one-row-kernel."""

from __future__ import annotations

import functools
import math

import mlx.core as mx
from strata.executor.cuda_source import compact

__all__ = ["BITS", "INPUTS", "OUTPUTS", "ROWS_PER_WARP", "k_split", "launch", "supported"]

BITS = (4, 8)
"""Bit widths this kernel unpacks (whole elements per 32-bit word)."""

ROWS_PER_WARP = 4
"""Weight rows one warp computes (``R``): two RoPE pairs of Q or K, or the gate and up rows of
two SwiGLU columns; ``x``'s elements are read once for all of them."""

WARPS_PER_BLOCK = 4
"""Warps of one block (128 threads): 16 rows of a weight, the multiple its rows come in."""

MAX_SLABS_IN_FLIGHT = 4
"""Most slabs (``U``) whose weight loads a warp issues before using any: 4 x ``R`` 16-byte loads
a lane, 8 KB a warp, enough reads in flight with a dozen warps a multiprocessor."""

MAX_K_SPLIT = 1
"""Most warps that share a row group, each summing every ``KS``-th run of ``U`` slabs of K, their
partial sums added in shared memory (``KS``): more warps in flight for a product of few rows
(a 4,096-row weight fills 1,024 warps of one row group each, about 8 of a multiprocessor's 64).
``KS`` is a function of K and the bit width alone (:func:`k_split`), so a row's sum has the same
bits in every call of that K, fused or not."""

OUT_DTYPES = (mx.float16, mx.bfloat16)

_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// d_e += (1 + q_j / 128) x_j over the even elements j of a packed 4-bit word (element j at bits
// 4j), d_o += (1 + q_j / 2048) x_j over the odd ones: each nibble moved to bits 16-19 or 12-15 of
// the float 1.0 (exponent 127), whose value is then exactly 1 + q * 2^(16 - 23) or 2^(12 - 23);
// its product with a 16-bit x is exact in float32. Four shifts place all eight nibbles.
__device__ __forceinline__ void strata_dot4(uint32_t w, const float* x, float& de, float& dob) {
    const uint32_t a = w << 16, b = w << 8, c = w >> 8, d = w >> 16;
    de = fmaf(__uint_as_float((a & 0x000F0000u) | 0x3F800000u), x[0], de);
    dob = fmaf(__uint_as_float((b & 0x0000F000u) | 0x3F800000u), x[1], dob);
    de = fmaf(__uint_as_float((b & 0x000F0000u) | 0x3F800000u), x[2], de);
    dob = fmaf(__uint_as_float((w & 0x0000F000u) | 0x3F800000u), x[3], dob);
    de = fmaf(__uint_as_float((w & 0x000F0000u) | 0x3F800000u), x[4], de);
    dob = fmaf(__uint_as_float((c & 0x0000F000u) | 0x3F800000u), x[5], dob);
    de = fmaf(__uint_as_float((c & 0x000F0000u) | 0x3F800000u), x[6], de);
    dob = fmaf(__uint_as_float((d & 0x0000F000u) | 0x3F800000u), x[7], dob);
}

// The same for an 8-bit word (element j at bits 8j): each byte at bits 15-22 of the float 1.0
// reads 1 + q / 256 (even elements to d_e, odd ones to d_o, both of that form).
__device__ __forceinline__ void strata_dot8(uint32_t w, const float* x, float& de, float& dob) {
    de = fmaf(__uint_as_float(((w << 15) & 0x007F8000u) | 0x3F800000u), x[0], de);
    dob = fmaf(__uint_as_float(((w << 7) & 0x007F8000u) | 0x3F800000u), x[1], dob);
    de = fmaf(__uint_as_float(((w >> 1) & 0x007F8000u) | 0x3F800000u), x[2], de);
    dob = fmaf(__uint_as_float(((w >> 9) & 0x007F8000u) | 0x3F800000u), x[3], dob);
}

__device__ __forceinline__ float2 strata_f2(uint32_t v, const __half*) {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
}

__device__ __forceinline__ float2 strata_f2(uint32_t v, const __nv_bfloat16*) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
"""

_BODY = r"""
    constexpr int EPL = 128 / BITS;              // elements per lane per slab: 16 bytes
    constexpr int EPW = 32 / BITS;               // elements per packed word
    // d_e's and d_o's scale: the nibble's (byte's) place in the float (see strata_dot4/8).
    constexpr float CE = BITS == 4 ? 128.0f : 256.0f;
    constexpr float CO = BITS == 4 ? 2048.0f : 256.0f;
    const int K = STRATA_K;
    const int VW = K / EPL;                      // 16-byte vectors per weight row
    const int G = K / GS;                        // scale groups per weight row
    const int lane = threadIdx.x & 31;
    // KS warps of the block share a row group (its K split into KS parts): ``warp`` numbers the
    // row groups, ``part`` the warp's share of K (every KS-th run of U slabs).
    const int wib = threadIdx.x >> 5;
    const int part = wib % KS;
    const int warp = blockIdx.x * (WPB / KS) + wib / KS;
    // The warp's R rows: row r is row rr[r] of the weight wr[r] (scales sr[r], biases br[r]);
    // results go to o from column col on.
    const uint32_t* wr[R];
    const T* sr[R];
    const T* br[R];
    int rr[R];
    T* o;
    int col;
    bool live = true, rot = false;
    STRATA_TILES
    if (!live) return;                           // the whole warp (KS 1 only: see launch)
    const T* tag = nullptr;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        wv[r] = reinterpret_cast<const uint4*>(wr[r] + (size_t)rr[r] * (K / EPW));
        sr[r] += (size_t)rr[r] * G;
        br[r] += (size_t)rr[r] * G;
    }
    float acc[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    const int slabs = (VW + 31) / 32;
    for (int s0 = part * U; s0 < slabs; s0 += U * KS) {
        // Every weight load of U slabs before any is used (reads in flight).
        uint4 q[U][R];
        T sc[U][R], bi[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = (s0 + u) * 32 + lane;
            if (v < VW) {
                const int gi = v * EPL / GS;
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    q[u][r] = wv[r][v];
                    sc[u][r] = sr[r][gi];
                    bi[u][r] = br[r][gi];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = (s0 + u) * 32 + lane;
            if (v < VW) {
                // x's EPL elements here as floats, and their even and odd sums.
                float xf[EPL];
                #pragma unroll
                for (int i = 0; i < EPL / 8; ++i) {
                    const uint4 t = xv[v * (EPL / 8) + i];
                    const float2 f0 = strata_f2(t.x, tag), f1 = strata_f2(t.y, tag);
                    const float2 f2 = strata_f2(t.z, tag), f3 = strata_f2(t.w, tag);
                    xf[8 * i] = f0.x; xf[8 * i + 1] = f0.y; xf[8 * i + 2] = f1.x;
                    xf[8 * i + 3] = f1.y; xf[8 * i + 4] = f2.x; xf[8 * i + 5] = f2.y;
                    xf[8 * i + 6] = f3.x; xf[8 * i + 7] = f3.y;
                }
                float xe = 0.0f, xo = 0.0f;
                #pragma unroll
                for (int i = 0; i < EPL; i += 2) {
                    xe += xf[i];
                    xo += xf[i + 1];
                }
                const float x1 = fmaf(CE, xe, CO * xo), xs = xe + xo;
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    float de = 0.0f, dob = 0.0f;
                    const uint32_t words[4] = {q[u][r].x, q[u][r].y, q[u][r].z, q[u][r].w};
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if constexpr (BITS == 4) {
                            strata_dot4(words[j], xf + EPW * j, de, dob);
                        } else {
                            strata_dot8(words[j], xf + EPW * j, de, dob);
                        }
                    }
                    // sum(q x) = CE (d_e - x_e) + CO (d_o - x_o); then s * that + b * sum(x).
                    const float y = fmaf(CE, de, fmaf(CO, dob, -x1));
                    const float s = static_cast<float>(sc[u][r]);
                    const float b = static_cast<float>(bi[u][r]);
                    acc[r] = fmaf(s, y, fmaf(b, xs, acc[r]));
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    // Lane i < R holds row i's sum (the same bits in every lane: see the module docstring).
    float mine = acc[0];
    #pragma unroll
    for (int r = 1; r < R; ++r)
        if (lane == r) mine = acc[r];
    if constexpr (KS > 1) {
        // The group's KS partial sums meet in shared memory, added in part order by its first
        // warp, which stores (every warp of the block is live: launch).
        __shared__ float strata_parts[WPB * R];
        if (lane < R) strata_parts[wib * R + lane] = mine;
        __syncthreads();
        if (part != 0) return;
        if (lane < R) {
            mine = strata_parts[wib * R + lane];
            #pragma unroll
            for (int p = 1; p < KS; ++p) mine += strata_parts[(wib + p) * R + lane];
        }
    }
"""

_TILES = {
    # One weight [N, K]: the warp's R rows side by side.
    "plain": r"""
    {
        const int n0 = warp * R;
        live = n0 < w_shape[0];
        #pragma unroll
        for (int r = 0; r < R; ++r) { wr[r] = w; sr[r] = scales; br[r] = biases; rr[r] = n0 + r; }
        o = out; col = n0;
    }
""",
    # Three weights of one input (Q, K, V), their rows in order; a warp's rows lie in one of
    # them (each width a multiple of R).
    "split3": r"""
    {
        const int n0 = warp * R, e0 = w0_shape[0], e1 = e0 + w1_shape[0];
        live = n0 < e1 + w2_shape[0];
        const uint32_t* pw = w0; const T* ps = s0; const T* pb = b0;
        o = out0; col = n0; rot = true;
        if (n0 >= e1) {
            pw = w2; ps = s2; pb = b2; o = out2; col = n0 - e1; rot = false;
        } else if (n0 >= e0) {
            pw = w1; ps = s1; pb = b1; o = out1; col = n0 - e0;
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) { wr[r] = pw; sr[r] = ps; br[r] = pb; rr[r] = col + r; }
    }
""",
    # Gate and up weights of one shape [F, K]: the warp's rows are gate rows c, c + 1 and up
    # rows c, c + 1 (R == 4).
    "swiglu": r"""
    {
        const int c = warp * 2;
        live = c < wg_shape[0];
        wr[0] = wr[1] = wg; sr[0] = sr[1] = sg; br[0] = br[1] = bg;
        wr[2] = wr[3] = wu; sr[2] = sr[3] = su; br[2] = br[3] = bu;
        rr[0] = rr[2] = c; rr[1] = rr[3] = c + 1;
        o = out; col = c;
    }
""",
}
"""How each kernel maps a warp's rows to weights and its results to outputs."""

_STORE = {
    "plain": r"""
    if (lane < R) o[col + lane] = static_cast<T>(mine);
""",
    # Added to the residual's element by T's own + (as MLX's add of two T arrays).
    "plain_add": r"""
    if (lane < R) o[col + lane] = res[col + lane] + static_cast<T>(mine);
""",
    # Pairs of adjacent columns (lanes 0 and 2), each of Q's and K's first RD columns of a head
    # (HD columns) rotated as MLX's mx.fast.rope with traditional=True rotates the rounded
    # product (the same arithmetic as executor.cuda_mma's store).
    "split3_rope": r"""
    {
        const float other = __shfl_down_sync(0xffffffffu, mine, 1);
        if (lane < R && (lane & 1) == 0) {
            T y0 = static_cast<T>(mine), y1 = static_cast<T>(other);
            const int pair = ((col + lane) % HD) / 2;
            if (rot && 2 * pair < RD) {
                float inv;
                if constexpr (FREQS) {
                    inv = 1.0 / freqs[pair];
                } else {
                    const float d = static_cast<float>(pair) / static_cast<float>(RD / 2);
                    inv = exp2(-d * rope[1]);
                }
                const float L = rope[0] * static_cast<float>(positions[0]);
                const float theta = L * inv;
                const float ct = cos(theta), st = sin(theta);
                const float x1 = static_cast<float>(y0), x2 = static_cast<float>(y1);
                y0 = static_cast<T>(x1 * ct - x2 * st);
                y1 = static_cast<T>(x1 * st + x2 * ct);
            }
            o[col + lane] = y0;
            o[col + lane + 1] = y1;
        }
    }
""",
    # silu(gate) * up of the two float32 sums, rounded once (lanes 0, 1: columns c, c + 1).
    "swiglu": r"""
    {
        const float up = __shfl_down_sync(0xffffffffu, mine, 2);
        if (lane < 2) o[col + lane] = static_cast<T>(mine / (1.0f + __expf(-mine)) * up);
    }
""",
}
_STORE["split3"] = _STORE["plain"]
_TILES["plain_add"] = _TILES["plain"]
_TILES["split3_rope"] = _TILES["split3"]

INPUTS = {
    "plain": ["x", "w", "scales", "biases"],
    "plain_add": ["x", "w", "scales", "biases", "res"],
    "split3": ["x", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2"],
    "swiglu": ["x", "wg", "sg", "bg", "wu", "su", "bu"],
}
INPUTS["split3_rope"] = [*INPUTS["split3"], "positions", "freqs", "rope"]
"""Each kernel's inputs in the order a call passes them (``executor.cuda_mma``'s too: its calls
hand either kernel the same arrays)."""
OUTPUTS = {
    "plain": ["out"],
    "plain_add": ["out"],
    "split3": ["out0", "out1", "out2"],
    "split3_rope": ["out0", "out1", "out2"],
    "swiglu": ["out"],
}
"""Each kernel's outputs."""
_K = {
    "plain": "w_shape[1] * (32 / BITS)",
    "plain_add": "w_shape[1] * (32 / BITS)",
    "split3": "w0_shape[1] * (32 / BITS)",
    "split3_rope": "w0_shape[1] * (32 / BITS)",
    "swiglu": "wg_shape[1] * (32 / BITS)",
}
"""K of each kernel, from its (first) weight's packed words."""


def source(store: str) -> tuple[str, str]:
    """``(header, body)`` of the ``store`` kernel as MLX is given them (compacted)."""
    body = _BODY.replace("STRATA_TILES", _TILES[store]).replace("STRATA_K", _K[store])
    return compact(_HEADER), compact(body + _STORE[store])


@functools.cache
def _get_kernel(store: str):
    """The ``store`` kernel (a key of ``_STORE``), built on first use (MLX compiles it per
    template instantiation)."""
    header, body = source(store)
    return mx.fast.cuda_kernel(
        name=f"strata_qmv_{store}",
        input_names=INPUTS[store],
        output_names=OUTPUTS[store],
        source=body,
        header=header,
    )


def supported(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`launch` takes one row of ``dtype`` by an ``[n, k]`` weight of ``bits``
    bits in groups of ``group_size`` on this process's backend (MLX's CUDA backend)."""
    return (
        mx.cuda.is_available()
        and bits in BITS
        and group_size in (32, 64, 128)
        and dtype in OUT_DTYPES
        and n % 16 == 0
        and k % 32 == 0
        and k % group_size == 0
    )


def k_split(k: int, bits: int) -> tuple[int, int]:
    """``(U, KS)`` for a row of ``k`` elements of ``bits`` bits: ``U`` slabs in flight (at most
    ``MAX_SLABS_IN_FLIGHT``), and ``KS`` warps splitting K, a power of two up to
    ``MAX_K_SPLIT`` that leaves each of them at least one run of ``U`` slabs."""
    slabs = -(-k // (32 * (128 // bits)))
    u = max(1, min(MAX_SLABS_IN_FLIGHT, slabs))
    ks = 1
    while ks * 2 <= MAX_K_SPLIT and ks * 2 * u <= slabs:
        ks *= 2
    return u, ks


def launch(
    store: str, k: int, dtype: mx.Dtype, bits: int, group_size: int, widths: list[int]
) -> tuple[object, list, tuple[int, int, int], tuple[int, int, int]]:
    """``(kernel, template, grid, threadgroup)`` of one call of the ``store`` kernel for one row
    of ``k`` elements of ``dtype`` by weights of ``widths`` rows (the swiglu store: gate's) of
    ``bits`` bits in groups of ``group_size``; the caller (``executor.cuda_mma``) validates the
    arrays (every width a multiple of 16) and adds a RoPE's template arguments.

    A block holds ``WARPS_PER_BLOCK / KS`` row groups of ``ROWS_PER_WARP`` rows (at least one);
    split K (``KS`` > 1) at most 16 rows, so that every warp of every block is live (its
    ``__syncthreads``)."""
    rows = widths[0] * 2 if store == "swiglu" else sum(widths)
    u, ks = k_split(k, bits)
    groups = max(1, WARPS_PER_BLOCK // ks)
    if ks > 1:
        groups = min(groups, 16 // ROWS_PER_WARP)
    wpb = groups * ks
    row_groups = -(-rows // ROWS_PER_WARP)
    blocks = -(-row_groups // groups)
    template = [
        ("T", dtype),
        ("GS", group_size),
        ("BITS", bits),
        ("R", ROWS_PER_WARP),
        ("WPB", wpb),
        ("U", u),
        ("KS", ks),
    ]
    threads = wpb * 32
    return _get_kernel(store), template, (blocks * threads, 1, 1), (threads, 1, 1)


def weight_bits(weight: mx.array, k: int) -> int:
    """Bits per element of a packed uint32 ``[n, k * bits / 32]`` weight of ``k`` columns (0
    where its width fits no whole bit count)."""
    words = int(weight.shape[1])
    return words * 32 // k if k and (words * 32) % k == 0 else 0


def row_count(shape: tuple[int, ...]) -> int:
    """Rows of ``x`` of ``shape`` ``[..., k]``: the product of its leading dimensions."""
    return math.prod(shape[:-1])
