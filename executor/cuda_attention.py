"""Paged attention of a pass's short chunks and decodes on MLX's CUDA backend, one kernel pair for
every shape.

A chunk of a few queries (a prompt's suffix after a prefix-cache hit, a speculative verification
of K + 1 tokens) attends over its sequence's cached keys. MLX sends a multi-query
``mx.fast.scaled_dot_product_attention`` to cuDNN, whose execution plan MLX builds and caches per
exact (query length, key length, mask) shape (``mlx/backend/cuda/scaled_dot_product_attention.cpp``,
``sdpa_cache``). Such chunks meet a new shape nearly every time. Measured on the lent H200
(2026-12-01, Llama-3-8B shape, the serving engine in-process): a warm request whose suffix length
was new took 62-107 ms against about 20 ms for a seen one, the difference being cuDNN's plan
build; padded into buckets with an additive mask, the shapes were few but cuDNN took 0.2-1.7 s
to build each bucket's plan. ``bench/chunk_attention.py`` times these kernels against cuDNN.

The kernels are compiled once per (dtype, query heads per key head, head dimension, sliding
window, and for the split kernel the queries a block holds: 1, 2, 4 or 8, or fewer where they do
not fit; serving's warm-up meets each) and take any query count and key length at run time.
Each query row names its slot table and its position, so one call serves every sequence of a
pass: a decode group (which MLX otherwise attends with a padded gather, a boolean mask and its
unfused fallback, since cuDNN and its vector kernel refuse array masks), prompt suffixes and
verifications, and the zero rows that pad the pass to its row bucket. They read keys and
values straight from the paged pool through the slot tables (no gathered copy), and write the
output in the ``[R, heads, head_dim]`` layout the output projection reads. In a serving pass,
see ``executor.models.llama.kernel_attention``.

Flash-decoding in two kernels (Dao et al., "Flash-Decoding for long-context inference", 2023):

- **split**: a block owns a group of up to ``QT`` queries of one sequence (:func:`query_groups`:
  a chunk's rows, 8 at a time; a decode is a group of one), one key/value head and one split of
  ``SPLIT_KEYS`` keys. Tile by tile (32 keys), the block copies the keys and values its queries
  see into shared memory, coalesced and once for all of them (grouped-query attention: once for
  the query heads that share the key head too); then each warp, one query, gives each lane one
  key: its scores for the group's heads (float32, against the scaled queries in shared memory),
  a running max and sum per head (online softmax), then the values of the keys it sees, each
  lane owning ``head_dim / 32`` output dimensions. The split's unnormalized output, max and sum
  go to float32 scratch.
- **combine**: each output element adds its query's splits in split order.

A query's arithmetic depends only on its own position and keys: tiles and splits sit at fixed
key positions (multiples of 32 and ``SPLIT_KEYS``), a warp walks its tiles in order, and a key
its query does not see adds no operation. Outputs are deterministic, and a query's output is the
same bit for bit alone, in any group and in any pass (batch invariance): the builds for 1 and 8
queries a block gave equal outputs on the H200 (``tests/test_chunk_attention.py``). The groups
only decide which queries share the copies of keys into shared memory.

The split kernel's float32 scratch holds ``head_dim + 2`` floats per row, query head and split of
the longest sequence's table, whatever each row's own length: :func:`fits` bounds it
(``MAX_SCRATCH_BYTES``), and callers attend larger passes otherwise.

Before this design (one block per query and key/value head, each warp reading its keys straight
from the pool), a warm 24-token pass of the Llama-3-8B shape spent 74 us a layer here, 2.36 ms
of its 8.61 ms of kernel time (Nsight Compute, H200, 2026-12-02, ``bench/pass_kernels.py``,
each kernel alone with emptied caches): the blocks of each of the 24 queries read all of the
sequence's keys and values, and each of a warp's key loads touched 32 cache lines. With it, the
same pass spent 2.06 ms (split 1.78, combine 0.28; ``bench/results/2026-12-02.pass-kernels-split.
h200.llama3-8b-shape.json``). Per call in a chain of 100, wall clock, old kernel against these
(``bench/results/2026-12-02.attention-split-ab.h200.json``, 8B heads): 24 queries by 1,016 keys
77.6 / 66.1 us, 64 by 2,000 219.1 / 176.1, 16 decodes of about 1,016 keys 75.9 / 80.5, 5 by
1,016 54.5 / 59.4, 2 by 300 32.9 / 41.9: the split's gain is in chunks of many queries, and a
short call pays for the second kernel. Without asynchronous copies a block of one warp (a
decode) waited for each round of its loads in turn: 16 decodes took 134 us.

A query at position p sees keys ``j <= p`` of its table (and ``p - j < window`` with a sliding
window): for a chunk, MLX's bottom-right causal mask.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from executor.cuda_source import compact

__all__ = ["GROUP_QUERIES", "MAX_QUERIES", "QueryGroups", "attention", "query_groups", "supported"]

MAX_QUERIES = 64
"""Most queries of a chunk this kernel takes; longer chunks (prefill) keep cuDNN's flash kernel,
whose tensor cores win there (64 queries by 2,000 keys, 8B shape: 230 us here, 108 us for cuDNN
once its plan is built, with the kernel before the split design) and whose per-shape plan is paid
once per prompt chunk."""

GROUP_QUERIES = 8
"""Most queries of one sequence that share a block's copies of keys (:func:`query_groups`)."""

TILES = 2
"""Tiles of 32 keys per split: ``SPLIT_KEYS`` keys. Fixed, since a query's rounding depends on
it. 2 against 4 and 8 on the H200 (2026-12-02, ``bench/results/2026-12-02.attention-split-ab.
h200.json``): as fast or faster in every case timed."""

SPLIT_KEYS = TILES * 32
"""Keys per split (blocks per query and key/value head: its keys / ``SPLIT_KEYS``)."""

MAX_SCRATCH_BYTES = 256 * 1024 * 1024
"""Most bytes of a call's split scratch (:func:`scratch_bytes`): 64 decodes beside one sequence
of 8,000 tokens (Llama-3-8B heads) need 134 MB; 256 beside 32,000 would need 2.1 GB."""

SMEM_BYTES = 46 * 1024
"""Shared memory a block may use (under the 48 KiB of a static allocation): the scaled queries
and one tile of keys and values (:func:`_smem_bytes`)."""

HEAD_DIMS = (64, 96, 128, 256)
"""Head dimensions handled (multiples of 32: each lane owns ``head_dim / 32`` output dimensions;
multiples of 8: keys are copied in 16-byte vectors)."""

MAX_GROUP = 8
"""Most query heads per key/value head (their scores and sums live in registers)."""

DTYPES = (mx.float16, mx.bfloat16)


class QueryGroups(NamedTuple):
    """Which query rows share a block (:func:`query_groups`).

    Attributes:
        array: int32 ``[NG, 2]``: each group's first row and row count; the rows of a group
            follow each other and belong to one sequence (one table row).
        largest: the most rows of a group (the blocks' warps).
    """

    array: mx.array
    largest: int


def query_groups(inputs: np.ndarray, positions: np.ndarray) -> QueryGroups:
    """The query rows of a pass in groups of at most ``GROUP_QUERIES`` consecutive rows of one
    input; padding rows (position < 0) belong to none.

    Args:
        inputs: int ``[R]``, each row's input (its table row).
        positions: int ``[R]``, each row's position (< 0: padding).

    Returns:
        the groups (a pass without query rows gets one empty group of row 0).
    """
    idx = np.flatnonzero(np.asarray(positions) >= 0)
    if not len(idx):
        return QueryGroups(mx.array(np.zeros((1, 2), dtype=np.int32)), 1)
    inputs = np.asarray(inputs)[idx]
    run = np.ones(len(idx), dtype=bool)  # a row that starts a run of one input's rows
    run[1:] = (inputs[1:] != inputs[:-1]) | (idx[1:] != idx[:-1] + 1)
    starts = np.flatnonzero(run)
    offset = np.arange(len(idx)) - starts[np.cumsum(run) - 1]  # the row's place in its run
    first = np.flatnonzero(offset % GROUP_QUERIES == 0)
    counts = np.diff(np.append(first, len(idx)))
    # A group never crosses a run: a run's rows are consecutive and each starts at offset 0.
    groups = np.stack([idx[first], counts], axis=1).astype(np.int32)
    return QueryGroups(mx.array(groups), int(counts.max()))


@functools.cache
def _single(rows: int) -> QueryGroups:
    """Every row its own group (:func:`attention` without groups; no rows: no group, which
    ``_prepare`` refuses)."""
    groups = np.stack([np.arange(rows), np.ones(rows)], axis=1).astype(np.int32)
    return QueryGroups(mx.array(groups), 1)


_SOURCE = r"""
    constexpr int E = D / 32;                    // output dimensions per lane
    constexpr int KS = D + 8;                    // a key's row in shared memory: see below
    constexpr int SPLIT = TILES * 32;
    const int HEADS = q_shape[1];
    const int KVH = kp_shape[1];
    const int W = tables_shape[1];
    const int NS = (W + SPLIT - 1) / SPLIT;      // splits of the table (part's third axis)
    const int NG = groups_shape[0];
    int b = blockIdx.x;
    const int s = b % NS;
    b /= NS;
    const int g = b % KVH;
    b /= KVH;
    const int pieces = gridDim.x / (NG * KVH * NS);
    const int r0 = groups[2 * (b / pieces)] + (b % pieces) * QT;
    const int nq = min(QT, groups[2 * (b / pieces) + 1] - (b % pieces) * QT);
    if (nq <= 0) return;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

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

    // This warp's query (row r0 + warp) and the keys mf..ml it sees in this split.
    const int r = r0 + warp;
    const int pos = warp < nq ? rows[2 * r + 1] : -1;
    const int mf = max(k0, WINDOW > 0 ? max(0, pos - WINDOW + 1) : 0);
    const int ml = min(pos, k0 + SPLIT - 1);
    const bool active = pos >= 0 && mf <= ml;

    __shared__ __align__(16) float qs[QT][G][D];
    // Key rows padded by 16 bytes: a quarter-warp's 16-byte reads of 8 lanes' keys land on
    // distinct banks (a row of D halfs would put them all on the same four).
    __shared__ __align__(16) T ks[32][KS];
    __shared__ __align__(16) T vs[32][D];
    const float scale = scale_in[0];
    if (active) {
        for (int i = lane; i < G * D; i += 32) {
            const int h = i / D, d = i % D;
            qs[warp][h][d] = static_cast<float>(q[((size_t)r * HEADS + g * G + h) * D + d]) * scale;
        }
    }

    float m[G], l[G], acc[G][E];
    #pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = 0.0f;
    }

    const size_t stride = (size_t)KVH * D;       // elements per KV slot
    for (int kb = klo & ~31; kb <= khi; kb += 32) {
        // The tile's keys and values into shared memory, 16 bytes a thread per copy: a key's
        // D / 8 vectors are copied by neighbouring threads (coalesced), once for the block's
        // queries, all copies in flight together (asynchronous copies on sm_80 and later: a
        // block of one warp otherwise waits for each of its 32 rounds of loads in turn). Keys
        // no query of the block sees are not copied, and never read.
        for (int i = threadIdx.x; i < 32 * (D / 8); i += blockDim.x) {
            const int key = i / (D / 8), c = i % (D / 8);
            const int j = kb + key;
            if (j >= klo && j <= khi) {
                const size_t off = (size_t)table[j] * stride + g * D + c * 8;
                strata_copy16(&ks[key][c * 8], kp + off);
                strata_copy16(&vs[key][c * 8], vp + off);
            }
        }
        strata_copies_wait();
        __syncthreads();
        if (active && kb <= ml && kb + 31 >= mf) {
            // One key per lane: its scores for the group's heads, float32.
            const int j = kb + lane;
            const bool valid = j >= mf && j <= ml;
            float sc[G];
            #pragma unroll
            for (int h = 0; h < G; ++h) sc[h] = 0.0f;
            if (valid) {
                #pragma unroll 4
                for (int c = 0; c < D / 8; ++c) {
                    const uint4 u = *reinterpret_cast<const uint4*>(&ks[lane][c * 8]);
                    const T* k8 = reinterpret_cast<const T*>(&u);
                    float kf[8];
                    #pragma unroll
                    for (int e = 0; e < 8; ++e) kf[e] = static_cast<float>(k8[e]);
                    #pragma unroll
                    for (int h = 0; h < G; ++h) {
                        const float4 qa = *reinterpret_cast<const float4*>(&qs[warp][h][c * 8]);
                        const float4 qb = *reinterpret_cast<const float4*>(&qs[warp][h][c * 8 + 4]);
                        sc[h] += kf[0] * qa.x; sc[h] += kf[1] * qa.y;
                        sc[h] += kf[2] * qa.z; sc[h] += kf[3] * qa.w;
                        sc[h] += kf[4] * qb.x; sc[h] += kf[5] * qb.y;
                        sc[h] += kf[6] * qb.z; sc[h] += kf[7] * qb.w;
                    }
                }
            }
            // Online softmax over the tile (a running max and sum per head); the tile holds a
            // key this query sees, so the max is finite.
            float p[G];
            #pragma unroll
            for (int h = 0; h < G; ++h) {
                const float x = valid ? sc[h] : -INFINITY;
                float mt = x;
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1)
                    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
                const float mn = fmaxf(m[h], mt);
                const float corr = expf(m[h] - mn);
                p[h] = valid ? expf(x - mn) : 0.0f;
                float ps = p[h];
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                l[h] = l[h] * corr + ps;
                #pragma unroll
                for (int e = 0; e < E; ++e) acc[h][e] *= corr;
                m[h] = mn;
            }
            // The values of the keys this query sees, in key order (the same operations
            // whichever other queries share the block).
            const int ua = max(mf - kb, 0), ub = min(ml - kb, 31);
            #pragma unroll 4
            for (int u = ua; u <= ub; ++u) {
                float vf[E];
                #pragma unroll
                for (int e = 0; e < E; ++e) vf[e] = static_cast<float>(vs[u][lane * E + e]);
                #pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float ph = __shfl_sync(0xffffffffu, p[h], u);
                    #pragma unroll
                    for (int e = 0; e < E; ++e) acc[h][e] += ph * vf[e];
                }
            }
        }
        __syncthreads();
    }

    if (active) {
        #pragma unroll
        for (int h = 0; h < G; ++h) {
            const size_t at = ((size_t)r * HEADS + g * G + h) * NS + s;
            #pragma unroll
            for (int e = 0; e < E; ++e) part[at * D + lane * E + e] = acc[h][e];
            if (lane == 0) {
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
// 16 bytes from global to shared memory: asynchronous (cp.async) on sm_80 and later.
__device__ __forceinline__ void strata_copy16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d), "l"(src));
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
// Wait for this thread's asynchronous copies (a __syncthreads() must follow).
__device__ __forceinline__ void strata_copies_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
#endif
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
        header=_HEADER,
    )
    combine = mx.fast.cuda_kernel(
        name="strata_attention_combine",
        input_names=["part", "stats", "rows"],
        output_names=["out"],
        source=compact(_COMBINE),
        header=_HEADER,
    )
    return split, combine


@functools.cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def _smem_bytes(queries: int, group: int, head_dim: int) -> int:
    """Shared memory of a split block (the kernel's ``qs``, ``ks`` and ``vs``), bytes."""
    return 4 * queries * group * head_dim + 2 * 32 * (2 * head_dim + 8)


def _block_queries(group: int, head_dim: int) -> int:
    """Queries a split block holds (``QT``): ``GROUP_QUERIES``, or fewer where their scaled
    queries would not fit ``SMEM_BYTES`` beside a tile (a larger group then takes several
    blocks)."""
    room = (SMEM_BYTES - _smem_bytes(0, group, head_dim)) // (4 * group * head_dim)
    return max(1, min(GROUP_QUERIES, room))


def scratch_bytes(rows: int, heads: int, width: int, head_dim: int) -> int:
    """Bytes of the split kernel's float32 scratch for ``rows`` query rows of ``heads`` heads
    over tables of ``width`` slots: partial outputs and their max and sum per split."""
    return 4 * rows * heads * -(-width // SPLIT_KEYS) * (head_dim + 2)


def fits(rows: int, heads: int, width: int, head_dim: int) -> bool:
    """Whether a call's scratch stays within ``MAX_SCRATCH_BYTES``."""
    return scratch_bytes(rows, heads, width, head_dim) <= MAX_SCRATCH_BYTES


def supported(queries: int, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether :func:`attention` takes a chunk of ``queries`` queries with these heads and
    ``dtype`` on this process's backend (MLX CUDA, 1..``MAX_QUERIES`` queries, 16-bit floats,
    ``HEAD_DIMS``, at most ``MAX_GROUP`` query heads per key/value head)."""
    return (
        mx.cuda.is_available()
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
            sequence (padded past its end; ``ForwardBatch.kernel_layout``).
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
        head, float32 inside, rounded once.

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
take (H200 host, 2026-12-01)."""

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
    fit = _block_queries(group, d)
    # The template's queries: the largest group's rounded up to a power of two (few builds),
    # at most what fits; a block of a pass of decodes then holds one query's shared memory,
    # not eight, and more blocks share a multiprocessor.
    qt = min(fit, 1 << (min(fit, groups.largest) - 1).bit_length())
    warps = min(qt, groups.largest)
    pieces = -(-groups.largest // qt)  # blocks per group and split
    splits = -(-tables.shape[1] // SPLIT_KEYS)
    blocks = g.shape[0] * pieces * kv_heads * splits
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
