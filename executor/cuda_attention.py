"""Paged attention of a pass's short chunks and decodes on MLX's CUDA backend, one kernel pair for
every shape.

A chunk of a few queries (a prompt's suffix after a prefix-cache hit, a speculative verification
of K + 1 tokens) attends over its sequence's cached keys. MLX sends a multi-query
``mx.fast.scaled_dot_product_attention`` to cuDNN, whose execution plan MLX builds and caches per
exact (query length, key length, mask) shape (``mlx/backend/cuda/scaled_dot_product_attention.cpp``,
``sdpa_cache``). Such chunks meet a new shape nearly every time, and a plan's build cost more
than the attention itself; bucketing the shapes made each bucket's build slower still
(docs/kernels.md#the-paged-attention-kernel). ``benchmarks/kernels/chunk_attention.py`` times
these kernels against cuDNN.

The kernels are compiled once per (dtype, query heads per key head, head dimension, sliding
window, and for the split kernel the queries a block holds: 1, 2, 4 or 8; serving's warm-up
meets each) and take any query count and key length at run time.
Each query row names its slot table and its position, so one call serves every sequence of a
pass: a decode group (which MLX otherwise attends with a padded gather, a boolean mask and its
unfused fallback, since cuDNN and its vector kernel refuse array masks), prompt suffixes and
verifications, and the zero rows that pad the pass to its row bucket. They read keys and
values straight from the paged pool through the slot tables (no gathered copy), and write the
output in the ``[R, heads, head_dim]`` layout the output projection reads. In a serving pass,
see ``executor.attention``, which chooses where it attends.

Flash-decoding in two kernels (Dao et al., "Flash-Decoding for long-context inference", 2023):

- **split**: a block owns a group of up to ``QT`` queries of one sequence (:func:`query_groups`:
  a chunk's rows, 8 at a time; a decode is a group of one), one key/value head and one split of
  ``SPLIT_KEYS`` keys. Its query rows are the group's queries times the heads that share the
  key/value head (grouped-query attention), 16 rows per warp: one tensor-core tile. Tile by
  tile (32 keys), the block copies the keys and values its queries see into shared memory,
  coalesced and once for all of them; then each warp takes its rows' scores on tensor cores
  (PTX ``mma.sync.m16n8k16``: 16-bit queries and keys, float32 sums; the queries' fragments
  stay in registers), scales and masks them, keeps a running max and sum per row (online
  softmax, Milakov and Gimelshein 2018), rounds the weights to the 16-bit type and multiplies
  them by the values on tensor cores too (the values' fragments by ``ldmatrix.trans``), as
  FlashAttention-2 does (Dao 2023). The split's unnormalized output, max and sum go to float32
  scratch.
- **combine**: each output element adds its query's splits in split order.

A query's arithmetic depends only on its own position and keys: tiles and splits sit at fixed
key positions (multiples of 32 and ``SPLIT_KEYS``), a warp walks its tiles in order, a tensor-core
product's row depends on that row's inputs alone, and a tile with no key a row sees leaves the
row as it was (weights of zero, a factor of one). Outputs are deterministic, and a query's output
is the same bit for bit alone, in any group and in any pass (batch invariance: a query alone and
in a group of 8 give equal outputs, ``tests/executor/test_chunk_attention.py``). One
caveat: a key another query of the group sees enters the row's product as zero weight times its
value, so a non-finite value there (a float16 overflow in a later token) would reach the row,
where alone it would not. The sum of the weights is taken in float32 before they are rounded for
the product with the values, as FlashAttention-2 does: weights and sum differ by that rounding
(under 2^-9 relative in bfloat16). The groups only decide which queries share a block's copies
of keys and its tensor-core tiles.

The split kernel's float32 scratch holds ``head_dim + 2`` floats per row, query head and split of
the longest sequence's table, whatever each row's own length: :func:`fits` bounds it
(``MAX_SCRATCH_BYTES``), and callers attend larger passes otherwise.

The designs before this one (a block per query and key/value head; splits on CUDA cores) and
their timings against it: docs/kernels.md#the-paged-attention-kernel.

A query at position p sees keys ``j <= p`` of its table (and ``p - j < window`` with a sliding
window): for a chunk, MLX's bottom-right causal mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from strata.executor.cuda_source import MMA_M16N8K16, compact, tensor_cores

__all__ = ["GROUP_QUERIES", "MAX_QUERIES", "QueryGroups", "attention", "query_groups", "supported"]

MAX_QUERIES = 64
"""Most queries of a chunk this kernel takes; longer chunks (prefill) keep cuDNN's flash kernel,
whose tensor cores won there against this kernel's first design (the split design has not been
timed against it beyond 64 queries: docs/kernels.md#the-paged-attention-kernel) and whose
per-shape plan is paid once per prompt chunk."""

GROUP_QUERIES = 8
"""Most queries of one sequence that share a block's copies of keys (:func:`query_groups`)."""

TILES = 2
"""Tiles of 32 keys per split: ``SPLIT_KEYS`` keys. Fixed, since a query's rounding depends on
it. 2 was as fast as 4 and 8, or faster, in every case timed
(docs/kernels.md#the-paged-attention-kernel)."""

SPLIT_KEYS = TILES * 32
"""Keys per split (blocks per query and key/value head: its keys / ``SPLIT_KEYS``)."""

MAX_SCRATCH_BYTES = 256 * 1024 * 1024
"""Most bytes of a call's split scratch (:func:`scratch_bytes`): 64 decodes beside one sequence
of 8,000 tokens (Llama-3-8B heads) need 134 MB; 256 beside 32,000 would need 2.1 GB."""

SMEM_BYTES = 46 * 1024
"""Shared memory a block may use (under the 48 KiB of a static allocation): one tile of keys and
values (:func:`_smem_bytes`; the queries stay in registers)."""

HEAD_DIMS = (64, 96, 128, 256)
"""Head dimensions handled (multiples of 16: the tensor-core products step through the head
dimension 16 at a time, and ``ldmatrix`` reads two 8-wide output tiles at once; keys are copied
in 16-byte vectors)."""

MAX_GROUP = 8
"""Most query heads per key/value head (a block's ``GROUP_QUERIES`` queries then make 64 rows:
four warps, each holding its rows' output sums in registers)."""

DTYPES = (mx.float16, mx.bfloat16)


class QueryGroups(NamedTuple):
    """Which query rows share a block (:func:`query_groups`).

    Attributes:
        array: int32 ``[NG, 2]``: each group's first row and row count; the rows of a group
            follow each other and belong to one sequence (one table row).
        largest: the most rows of a group (a block then holds that many queries, rounded up to
            a power of two: :func:`_block_queries`).
    """

    array: mx.array
    largest: int


def query_groups(
    inputs: np.ndarray,
    positions: np.ndarray,
    to_device: Callable[[np.ndarray], mx.array] = mx.array,
) -> QueryGroups:
    """The query rows of a pass in groups of at most ``GROUP_QUERIES`` consecutive rows of one
    input; padding rows (position < 0) belong to none.

    Args:
        inputs: int ``[R]``, each row's input (its table row).
        positions: int ``[R]``, each row's position (< 0: padding).
        to_device: how the groups' int32 array becomes an array (``mx.array``, or a staged
            pass's ``put``: ``executor.host_inputs``).

    Returns:
        the groups (a pass without query rows gets one empty group of row 0).
    """
    idx = np.flatnonzero(np.asarray(positions) >= 0)
    if not len(idx):
        return QueryGroups(to_device(np.zeros((1, 2), dtype=np.int32)), 1)
    inputs = np.asarray(inputs)[idx]
    run = np.ones(len(idx), dtype=bool)  # a row that starts a run of one input's rows
    run[1:] = (inputs[1:] != inputs[:-1]) | (idx[1:] != idx[:-1] + 1)
    starts = np.flatnonzero(run)
    offset = np.arange(len(idx)) - starts[np.cumsum(run) - 1]  # the row's place in its run
    first = np.flatnonzero(offset % GROUP_QUERIES == 0)
    counts = np.diff(np.append(first, len(idx)))
    # A group never crosses a run: a run's rows are consecutive and each starts at offset 0.
    groups = np.stack([idx[first], counts], axis=1).astype(np.int32)
    return QueryGroups(to_device(groups), int(counts.max()))


@functools.cache
def _single(rows: int) -> QueryGroups:
    """Every row its own group (:func:`attention` without groups; no rows: no group, which
    ``_prepare`` refuses)."""
    groups = np.stack([np.arange(rows), np.ones(rows)], axis=1).astype(np.int32)
    return QueryGroups(mx.array(groups), 1)


_SOURCE = r"""
    constexpr int ROWS = QT * G;                 // query rows of a block: QT queries x G heads
    constexpr int SPLIT = TILES * 32;
    constexpr int KS = D + 8;                    // a key's row in shared memory: see below
    const int HEADS = q_shape[1];
    const int KVH = kp_shape[1];
    const int W = tables_shape[1];
    const int NS = (W + SPLIT - 1) / SPLIT;      // splits of the table (part's third axis)
    int b = blockIdx.x;
    const int s = b % NS;
    b /= NS;
    const int kvh = b % KVH;
    b /= KVH;
    const int r0 = groups[2 * b];                // the block's group: QT >= its rows
    const int nq = min(QT, groups[2 * b + 1]);
    if (nq <= 0) return;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int gq = lane >> 2, t = lane & 3;      // mma fragment coordinates

    // The keys any query of the block sees in this split (the whole block returns, or none).
    int lo = 0x7fffffff, hi = -1;
    for (int i = 0; i < nq; ++i) {
        const int p = rows[2 * (r0 + i) + 1];
        if (p >= 0) {
            hi = max(hi, p);
            lo = min(lo, WINDOW > 0 ? max(0, p - WINDOW + 1) : 0);
        }
    }
    const int k0 = s * SPLIT;
    const int klo = max(lo, k0), khi = min(hi, k0 + SPLIT - 1);
    if (klo > khi) return;
    const int* table = tables + (size_t)rows[2 * r0] * W;   // the group's: one sequence

    // This lane's two rows of the warp's 16 (row = query * G + head): gq and gq + 8. Each
    // sees keys mf..ml of this split; its query's a-fragments (16-bit pairs) stay in registers.
    int mf[2], ml[2], head[2], query[2];
    bool live[2];
    uint32_t qa[D / 16][4];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * warp + gq + 8 * h;
        query[h] = row / G;
        head[h] = kvh * G + row % G;
        const int pos = row < ROWS && query[h] < nq ? rows[2 * (r0 + query[h]) + 1] : -1;
        mf[h] = max(k0, WINDOW > 0 ? max(0, pos - WINDOW + 1) : 0);
        ml[h] = min(pos, k0 + SPLIT - 1);
        live[h] = pos >= 0 && mf[h] <= ml[h];
        const uint32_t* qw = reinterpret_cast<const uint32_t*>(
            q + ((size_t)(r0 + query[h]) * HEADS + head[h]) * D);
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            qa[kk][h] = pos >= 0 ? qw[8 * kk + t] : 0u;          // columns 2t, 2t + 1
            qa[kk][2 + h] = pos >= 0 ? qw[8 * kk + 4 + t] : 0u;  // columns 2t + 8, 2t + 9
        }
    }
    const bool wlive = __any_sync(0xffffffffu, live[0] || live[1]);

    float o[D / 8][4], m[2], l[2];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const float scale = scale_in[0];
    const T* tag = nullptr;

    // Key rows padded by 16 bytes: the 8 rows of an ldmatrix (and the 8 keys of a b-fragment's
    // loads) then start on distinct banks.
    __shared__ __align__(16) T ks[32][KS];
    __shared__ __align__(16) T vs[32][KS];
    const size_t stride = (size_t)KVH * D;       // elements per KV slot
    for (int kb = klo & ~31; kb <= khi; kb += 32) {
        // The tile's keys and values into shared memory, 16 bytes a thread per copy: a key's
        // D / 8 vectors are copied by neighbouring threads (coalesced), once for the block's
        // queries, all copies in flight together (asynchronous copies on sm_80 and later). Keys
        // no query of the block sees are zeros: their scores are masked, and a zero value
        // times a zero weight adds nothing (a stale value could be a NaN).
        for (int i = threadIdx.x; i < 32 * (D / 8); i += blockDim.x) {
            const int key = i / (D / 8), c = i % (D / 8);
            const int j = kb + key;
            if (j >= klo && j <= khi) {
                const size_t off = (size_t)table[j] * stride + kvh * D + c * 8;
                strata_copy16(&ks[key][c * 8], kp + off);
                strata_copy16(&vs[key][c * 8], vp + off);
            } else {
                *reinterpret_cast<uint4*>(&ks[key][c * 8]) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(&vs[key][c * 8]) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        strata_copies_wait();
        __syncthreads();
        if (wlive) {
            // Scores of the tile's 32 keys on tensor cores: sc[n] is the c-fragment of keys
            // kb + 8n .. + 7 (rows gq and gq + 8, keys 2t and 2t + 1), float32.
            float sc[4][4];
            #pragma unroll
            for (int n = 0; n < 4; ++n) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) sc[n][e] = 0.0f;
                const uint32_t* kw = reinterpret_cast<const uint32_t*>(&ks[8 * n + gq][0]);
                #pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    const uint32_t b0 = kw[8 * kk + t], b1 = kw[8 * kk + 4 + t];
                    strata_mma(sc[n], make_uint4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]),
                               make_uint2(b0, b1), tag);
                }
            }
            // Online softmax per row: the tile's max over the row's visible keys (the quad's
            // four lanes hold the row's 32 scores), then the weights. A row that sees no key
            // of the tile changes nothing (its weights are zeros, its factor 1).
            float mt[2] = {-INFINITY, -INFINITY};
            #pragma unroll
            for (int n = 0; n < 4; ++n)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e >> 1, j = kb + 8 * n + 2 * t + (e & 1);
                    const bool seen = live[h] && j >= mf[h] && j <= ml[h];
                    sc[n][e] = seen ? sc[n][e] * scale : -INFINITY;
                    mt[h] = fmaxf(mt[h], sc[n][e]);
                }
            float corr[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
                mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
                const float mn = fmaxf(m[h], mt[h]);
                corr[h] = mt[h] == -INFINITY ? 1.0f : expf(m[h] - mn);
                m[h] = mn;
            }
            float ls[2] = {0.0f, 0.0f};
            #pragma unroll
            for (int n = 0; n < 4; ++n)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e >> 1;
                    sc[n][e] = sc[n][e] == -INFINITY ? 0.0f : expf(sc[n][e] - m[h]);
                    ls[h] += sc[n][e];
                }
            #pragma unroll
            for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + ls[h];
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][0] *= corr[0]; o[n][1] *= corr[0];
                o[n][2] *= corr[1]; o[n][3] *= corr[1];
            }
            // The weights (rounded to T: the a-fragments of 16 keys are the c-fragments of
            // two 8-key tiles) times the values: b-fragments by ldmatrix.trans, two 8-wide
            // tiles of the head dimension per load.
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                const uint4 pa = make_uint4(strata_pack(sc[2 * k][0], sc[2 * k][1], tag),
                                            strata_pack(sc[2 * k][2], sc[2 * k][3], tag),
                                            strata_pack(sc[2 * k + 1][0], sc[2 * k + 1][1], tag),
                                            strata_pack(sc[2 * k + 1][2], sc[2 * k + 1][3], tag));
                #pragma unroll
                for (int n = 0; n < D / 16; ++n) {
                    uint32_t v0, v1, v2, v3;
                    const T* vrow = &vs[16 * k + (lane & 15)][16 * n + 8 * (lane >> 4)];
                    strata_ldmatrix_t(v0, v1, v2, v3, vrow);
                    strata_mma(o[2 * n], pa, make_uint2(v0, v1), tag);
                    strata_mma(o[2 * n + 1], pa, make_uint2(v2, v3), tag);
                }
            }
        }
        __syncthreads();
    }

    // Each row's sum over its quad (the lanes' partial sums, in a fixed order), then the
    // split's unnormalized output, max and sum.
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        if (live[h]) {
            const size_t at = ((size_t)(r0 + query[h]) * HEADS + head[h]) * NS + s;
            #pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<float2*>(&part[at * D + 8 * n + 2 * t]) =
                    make_float2(o[n][2 * h], o[n][2 * h + 1]);
            if (t == 0) {
                stats[2 * at] = m[h];
                stats[2 * at + 1] = l[h];
            }
        }
    }
"""

_COMBINE = r"""
    constexpr int SPLIT = TILES * 32;
    const int HEADS = part_shape[1];
    const int NS = part_shape[2];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows_shape[0] * HEADS * D) return;
    const size_t rh = i / D;                     // row * HEADS + head
    const int d = i % D;
    const int pos = rows[2 * (rh / HEADS) + 1];
    if (pos < 0) {                               // a padding row: zeros
        out[i] = static_cast<T>(0.0f);
        return;
    }
    const int first = WINDOW > 0 ? max(0, pos - WINDOW + 1) : 0;
    const int sf = first / SPLIT, sl = pos / SPLIT;   // every split between holds a key it sees
    const float* st = stats + rh * NS * 2;
    float top = -INFINITY;
    for (int s = sf; s <= sl; ++s) top = fmaxf(top, st[2 * s]);
    float num = 0.0f, den = 0.0f;
    for (int s = sf; s <= sl; ++s) {
        const float f = expf(st[2 * s] - top);
        num += part[(rh * NS + s) * D + d] * f;
        den += st[2 * s + 1] * f;
    }
    out[i] = static_cast<T>(num / den);
"""


_HEADER = r"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
// 16 bytes from global to shared memory, asynchronously (cp.async, sm_80 and later: supported()).
__device__ __forceinline__ void strata_copy16(void* dst, const void* src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d), "l"(src));
}
// Wait for this thread's asynchronous copies (a __syncthreads() must follow).
__device__ __forceinline__ void strata_copies_wait() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
}
// Two floats as one 16-bit pair (x in the low half), rounded to nearest.
__device__ __forceinline__ uint32_t strata_pack(float x, float y, const __half*) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t strata_pack(float x, float y, const __nv_bfloat16*) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
}
// Four 8x8 16-bit matrices from shared memory, transposed (ldmatrix .trans): lanes 8i .. 8i + 7
// give the rows of matrix i; lane (g, t) receives rows 2t, 2t + 1 of column g of each, a
// b-fragment's half when the rows are keys and the columns head dimensions.
__device__ __forceinline__ void strata_ldmatrix_t(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3, const void* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
"""


@functools.cache
def _kernels():
    """The split and combine kernels, built on first use (MLX compiles each per template
    instantiation)."""
    split = mx.fast.cuda_kernel(
        name="strata_attention_split",
        input_names=["q", "kp", "vp", "tables", "rows", "groups", "scale_in"],
        output_names=["part", "stats"],
        source=compact(_SOURCE),
        header=compact(_HEADER + MMA_M16N8K16),
    )
    combine = mx.fast.cuda_kernel(
        name="strata_attention_combine",
        input_names=["part", "stats", "rows"],
        output_names=["out"],
        source=compact(_COMBINE),
        header=compact(_HEADER),
    )
    return split, combine


@functools.cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def _smem_bytes(head_dim: int) -> int:
    """Shared memory of a split block (the kernel's ``ks`` and ``vs``: one tile of keys and
    values), bytes."""
    return 2 * 2 * 32 * (head_dim + 8)


def _block_queries(largest: int) -> int:
    """Queries a split block holds (``QT``): the largest group's, rounded up to a power of two
    (few builds: 1, 2, 4, 8), at most ``GROUP_QUERIES``."""
    return min(GROUP_QUERIES, 1 << (min(GROUP_QUERIES, largest) - 1).bit_length())


def _block_warps(queries: int, group: int) -> int:
    """Warps of a split block: one per 16 query rows (a tensor-core tile) of ``queries``
    queries of ``group`` heads."""
    return -(-queries * group // 16)


def scratch_bytes(rows: int, heads: int, width: int, head_dim: int) -> int:
    """Bytes of the split kernel's float32 scratch for ``rows`` query rows of ``heads`` heads
    over tables of ``width`` slots: partial outputs and their max and sum per split."""
    return 4 * rows * heads * -(-width // SPLIT_KEYS) * (head_dim + 2)


def fits(rows: int, heads: int, width: int, head_dim: int) -> bool:
    """Whether a call's scratch stays within ``MAX_SCRATCH_BYTES``."""
    return scratch_bytes(rows, heads, width, head_dim) <= MAX_SCRATCH_BYTES


def supported(queries: int, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`attention` takes a chunk of ``queries`` queries with these heads and
    ``dtype`` on this process's backend (MLX CUDA on sm_80 or later: ``tensor_cores``,
    1..``MAX_QUERIES`` queries, 16-bit floats, ``HEAD_DIMS``, at most ``MAX_GROUP`` query heads
    per key/value head)."""
    return (
        tensor_cores()
        and 1 <= queries <= MAX_QUERIES
        and dtype in DTYPES
        and head_dim in HEAD_DIMS
        and kv_heads >= 1
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
    )


def attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    tables: mx.array,
    rows: mx.array,
    scale: float,
    window: int = 0,
    flat: bool = False,
    groups: QueryGroups | None = None,
) -> mx.array:
    """Causal attention of R query rows, each over its own sequence's cached keys (its own token
    included), read from the paged pool: a chunk's queries, a decode group's, or a whole pass's.

    Args:
        q: ``[R, heads, head_dim]`` (or ``[R, heads, 1, head_dim]``, as RoPE leaves it)
            float16/bfloat16, the queries (RoPE applied), row-major.
        keys: ``[slots, kv_heads, head_dim]``, one layer's key pool (``PagedKVCache.keys``), same
            dtype.
        values: like ``keys``.
        tables: int32 ``[S, W]``: row s holds the slot of every position ``0 ..`` of one
            sequence (padded past its end; ``executor.attention.kernel_layout``).
        rows: int32 ``[R, 2]``: query r reads table row ``rows[r, 0]`` and sits at position
            ``p = rows[r, 1] < W``, seeing keys ``j <= p`` (and ``p - j < window``); ``p < 0``
            marks a padding row, whose output is zeros.
        scale: the score scale (1 / sqrt(head_dim), or the model's).
        window: a sliding window in tokens (0: none).
        flat: return ``[R, heads * head_dim]`` (the same layout), as the output projection
            reads it, with no reshape in the graph.
        groups: rows that share blocks (:func:`query_groups` over ``rows``; each group's rows
            must read one table row). None: each row alone. They change the speed, not the
            result.

    Returns:
        ``[R, heads, head_dim]`` (or ``flat``) of ``q``'s dtype: softmax(scale * q k^T) v per
        head, with float32 scores, sums and outputs (the weights rounded to the 16-bit type for
        their product with the values), the output rounded once.

    Raises:
        ValueError: a shape or dtype :func:`supported` refuses (R is not limited here: the
            limit on a chunk's queries is the caller's choice of kernel), no query rows, an
            empty or malformed ``tables``, or malformed ``rows``/``groups``. Positions and
            groups are not checked against ``W`` and the tables (that would cost a device
            sync): the caller builds them, groups by :func:`query_groups` (a group whose rows
            are of two sequences, or larger than ``largest``, gives wrong rows).
    """
    if groups is None:
        groups = _single(q.shape[0] if q.ndim else 0)
    g = groups.array
    key = (q.shape, q.dtype, keys.shape, keys.dtype, values.shape, values.dtype)
    key += (tables.shape, tables.dtype, rows.shape, rows.dtype, float(scale), int(window), flat)
    key += (g.shape, g.dtype, groups.largest)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = _prepare(q, keys, values, tables, rows, window, flat, groups)
    split_launch, combine_launch = launch
    split, combine = _kernels()
    part, stats = split(
        inputs=[q, keys, values, tables, rows, g, _scale(float(scale))], **split_launch
    )
    (out,) = combine(inputs=[part, stats, rows], **combine_launch, output_dtypes=[q.dtype])
    return out


_LAUNCHES: dict[tuple, tuple] = {}
"""Call signature (the arrays' shapes and dtypes, scale, window, ``flat``, groups) -> the
kernels' launch arguments, validated on the signature's first call: a pass's blocks repeat one
signature, and validating each call cost the host several us of the few tens a pass's block may
take."""

_MAX_LAUNCHES = 1024
"""Signatures kept (emptied past this: the key length of ``tables`` changes from pass to pass)."""


def _prepare(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    tables: mx.array,
    rows: mx.array,
    window: int,
    flat: bool,
    groups: QueryGroups,
) -> tuple[dict, dict]:
    """Validate a call of :func:`attention` and work out its kernels' launch arguments.

    Raises:
        ValueError: as :func:`attention` says.
    """
    # A q of another rank reads as 0 heads, which supported() refuses below.
    r, d = q.shape[0] if q.ndim else 0, q.shape[-1] if q.ndim else 0
    heads = q.shape[1] if q.ndim in (3, 4) else 0
    kv_heads = keys.shape[1] if keys.ndim == 3 else 0
    g = groups.array
    if (
        q.ndim not in (3, 4)
        or (q.ndim == 4 and q.shape[2] != 1)
        or not supported(1, heads, kv_heads, d, q.dtype)
        or keys.dtype != q.dtype
        or values.shape != keys.shape
        or values.dtype != q.dtype
        or keys.shape[2] != d
        or r < 1
        or tables.ndim != 2
        or tables.shape[0] < 1
        or tables.shape[1] < 1
        or tables.dtype != mx.int32
        or rows.shape != (r, 2)
        or rows.dtype != mx.int32
        or g.ndim != 2
        or g.shape[0] < 1
        or g.shape[1] != 2
        or g.dtype != mx.int32
        or not 1 <= groups.largest <= GROUP_QUERIES
    ):
        raise ValueError(
            f"cuda_attention: queries {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} "
            f"{keys.dtype}, tables {tuple(tables.shape)} {tables.dtype}, rows "
            f"{tuple(rows.shape)} {rows.dtype}, groups {tuple(g.shape)} {g.dtype} of at most "
            f"{groups.largest} rows are not handled here (MLX CUDA, head_dim in {HEAD_DIMS}, "
            f"16-bit floats, R >= 1 query rows, int32 tables [S >= 1, W >= 1], rows [R, 2] and "
            f"groups [NG, 2] of 1..{GROUP_QUERIES} rows); use mx.fast.scaled_dot_product_attention"
        )
    group = heads // kv_heads
    # A block of a pass of decodes holds one query (its heads' rows), not eight: fewer idle
    # tensor-core rows and warps.
    qt = _block_queries(groups.largest)  # >= every group's rows: a block per group and split
    warps = _block_warps(qt, group)
    splits = -(-tables.shape[1] // SPLIT_KEYS)
    blocks = g.shape[0] * kv_heads * splits
    split = {
        "template": [
            ("T", q.dtype),
            ("G", group),
            ("D", d),
            ("WINDOW", int(window)),
            ("QT", qt),
            ("TILES", TILES),
        ],
        "grid": (blocks * warps * 32, 1, 1),
        "threadgroup": (warps * 32, 1, 1),
        "output_shapes": [(r, heads, splits, d), (r, heads, splits, 2)],
        "output_dtypes": [mx.float32, mx.float32],
    }
    threads = 256
    elements = r * heads * d
    combine = {
        "template": [("T", q.dtype), ("D", d), ("WINDOW", int(window)), ("TILES", TILES)],
        "grid": (-(-elements // threads) * threads, 1, 1),
        "threadgroup": (threads, 1, 1),
        "output_shapes": [(r, heads * d) if flat else (r, heads, d)],
    }
    return split, combine
