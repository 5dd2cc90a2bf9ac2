"""Paged attention of a pass's short chunks and decodes on MLX's CUDA backend, one kernel for every
shape.

A chunk of a few queries (a prompt's suffix after a prefix-cache hit, a speculative verification
of K + 1 tokens) attends over its sequence's cached keys. MLX sends a multi-query
``mx.fast.scaled_dot_product_attention`` to cuDNN, whose execution plan MLX builds and caches per
exact (query length, key length, mask) shape (``mlx/backend/cuda/scaled_dot_product_attention.cpp``,
``sdpa_cache``). Such chunks meet a new shape nearly every time. Measured on the lent H200
(2026-12-01, Llama-3-8B shape, the serving engine in-process): a warm request whose suffix length
was new took 62-107 ms against about 20 ms for a seen one, the difference being cuDNN's plan
build; padded into buckets with an additive mask, the shapes were few but cuDNN took 0.2-1.7 s
to build each bucket's plan. The plain-operations path that stood in for SDPA at 2-32 queries
cost 175 us per layer at 24 queries by 1,016 keys, cuDNN 51 us once built (scratch scripts;
``bench/chunk_attention.py`` repeats the kernel's and cuDNN's timings).

This kernel is compiled once per (dtype, query heads per key head, head dimension, sliding
window) and takes any query count and key length at run time. Each query row names its slot
table and its position, so one call serves every sequence of a pass: a decode group (which MLX
otherwise attends with a padded gather, a boolean mask and its unfused fallback, since cuDNN and
its vector kernel refuse array masks), prompt suffixes and verifications, and the zero rows that
pad the pass to its row bucket. It reads keys and values straight from the paged KV pool through
the slot tables (no gathered copy), and writes the output in the ``[R, heads, head_dim]`` layout
the output projection reads. Measured there for one chunk (``bench/chunk_attention.py``,
``bench/results/2026-12-01.chunk-attention.h200.json``; 8B heads, per call in a chain): 24
queries by 1,016 keys 90.7 us (cuDNN, its plan built: 76.1), 5 queries 61.2 us (76.2), 2 queries
by 300 keys 39.9 us (49.9); a first call at a new shape 0.2-0.9 ms, cuDNN's 47-70 ms. In a
serving pass, see ``executor.models.llama.kernel_attention``:

- a block of ``WARPS`` (8, or 4) warps owns one query and one key/value head, for all the query
  heads that share it (grouped-query attention reads each key once for the group);
- each warp takes tiles of 32 keys, one key per lane: the lane computes its key's scores for the
  group's heads (float32, against the scaled queries in shared memory, read in 16-byte vectors:
  a quarter of the key loop's shared-memory instructions of one read per element, by the PTX;
  the tests pass on the H200, 2026-12-02, not yet timed), the warp updates a running
  max and sum per head (online softmax), then accumulates the values of the tile's keys, ``PV``
  keys' loads issued together, each lane owning ``head_dim / 32`` output dimensions;
- the warps' partial results meet in shared memory and are combined in warp order, so results are
  deterministic and a query's output does not depend on the other queries of the pass.

In a warm 24-token pass of the Llama-3-8B shape (Nsight Compute, H200, 2026-12-02, before the
vector reads; ``bench/pass_kernels.py``, each kernel alone with emptied caches) the kernel took
74 us a layer, 2.36 ms of the pass's 8.61 ms of kernel time: the blocks of each of the 24
queries read all of the sequence's keys and values. Reading them once for a chunk's queries is
the lever there.

A query at position p sees keys ``j <= p`` of its table (and ``p - j < window`` with a sliding
window): for a chunk, MLX's bottom-right causal mask.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from executor.cuda_source import compact

__all__ = ["MAX_QUERIES", "attention", "supported"]

MAX_QUERIES = 64
"""Most queries of a chunk this kernel takes; longer chunks (prefill) keep cuDNN's flash kernel,
whose tensor cores win there (64 queries by 2,000 keys, 8B shape: 230 us here, 108 us for cuDNN
once its plan is built) and whose per-shape plan is paid once per prompt chunk."""

WARPS = 8
"""Warps per block, splitting the keys (32 per warp per step); 4 where the warps' partial sums
(``WARPS * group * head_dim`` floats) would not fit ``SMEM_BYTES``."""

SMEM_BYTES = 46 * 1024
"""Shared memory a block may use (under the 48 KiB of a static allocation): the scaled queries,
each warp's running max and sum, and each warp's partial output (:func:`_smem_bytes`)."""

PV = 8
"""Keys whose values a lane loads before using any (32 is the tile: a multiple of it)."""

HEAD_DIMS = (64, 96, 128, 256)
"""Head dimensions handled (multiples of 32: each lane owns ``head_dim / 32`` output dimensions;
multiples of 8: keys are read in 16-byte vectors)."""

MAX_GROUP = 8
"""Most query heads per key/value head (their scores and sums live in registers)."""

DTYPES = (mx.float16, mx.bfloat16)

_SOURCE = r"""
    constexpr int E = D / 32;                    // output dimensions per lane
    const int HEADS = q_shape[1];
    const int KVH = kp_shape[1];
    const int W = tables_shape[1];
    const int g = blockIdx.x % KVH;
    const int t = blockIdx.x / KVH;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int last = rows[2 * t + 1];            // this query's position: it sees keys <= last
    if (last < 0) {                              // a padding row: zeros (the whole block)
        for (int i = threadIdx.x; i < G * D; i += blockDim.x)
            out[((size_t)t * HEADS + g * G) * D + i] = static_cast<T>(0.0f);
        return;
    }
    const int* table = tables + (size_t)rows[2 * t] * W;
    const int first = WINDOW > 0 ? max(0, last - WINDOW + 1) : 0;
    const size_t stride = (size_t)KVH * D;       // elements per KV slot

    __shared__ __align__(16) float qs[G][D];
    __shared__ float ms[WARPS][G];
    __shared__ float ls[WARPS][G];
    __shared__ float accs[WARPS][G][D];
    const float scale = scale_in[0];
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        qs[h][d] = static_cast<float>(q[((size_t)t * HEADS + g * G + h) * D + d]) * scale;
    }
    __syncthreads();

    float m[G], l[G], acc[G][E];
    #pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = 0.0f;
    }

    for (int base = first + warp * 32; base <= last; base += WARPS * 32) {
        const int j = base + lane;
        const bool valid = j <= last;
        const int slot = valid ? table[j] : 0;
        float s[G];
        #pragma unroll
        for (int h = 0; h < G; ++h) s[h] = 0.0f;
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(kp + slot * stride + g * D);
            #pragma unroll 4
            for (int c = 0; c < D / 8; ++c) {
                const uint4 u = kr[c];
                const T* kv8 = reinterpret_cast<const T*>(&u);
                float kf[8];
                #pragma unroll
                for (int e = 0; e < 8; ++e) kf[e] = static_cast<float>(kv8[e]);
                // The scaled queries in two 16-byte reads per head (a quarter of the shared
                // memory instructions of one read per element); each head's sum adds the
                // elements in the same order.
                #pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float4 qa = *reinterpret_cast<const float4*>(&qs[h][c * 8]);
                    const float4 qb = *reinterpret_cast<const float4*>(&qs[h][c * 8 + 4]);
                    s[h] += kf[0] * qa.x; s[h] += kf[1] * qa.y;
                    s[h] += kf[2] * qa.z; s[h] += kf[3] * qa.w;
                    s[h] += kf[4] * qb.x; s[h] += kf[5] * qb.y;
                    s[h] += kf[6] * qb.z; s[h] += kf[7] * qb.w;
                }
            }
        }
        float p[G];
        #pragma unroll
        for (int h = 0; h < G; ++h) {
            const float x = valid ? s[h] : -INFINITY;
            float mt = x;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m[h], mt);    // finite: lane 0's key is always valid
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
        // Values of the tile's keys, PV keys at a time: their loads are issued together. A key
        // past the last has p = 0 and is not read.
        const int n = min(32, last - base + 1);
        for (int k0 = 0; k0 < n; k0 += PV) {
            float vf[PV][E];
            #pragma unroll
            for (int u = 0; u < PV; ++u) {
                const int sl = __shfl_sync(0xffffffffu, slot, k0 + u);
                const T* vr = vp + sl * stride + g * D + lane * E;
                #pragma unroll
                for (int e = 0; e < E; ++e)
                    vf[u][e] = k0 + u < n ? static_cast<float>(vr[e]) : 0.0f;
            }
            #pragma unroll
            for (int u = 0; u < PV; ++u) {
                #pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float ph = __shfl_sync(0xffffffffu, p[h], k0 + u);
                    #pragma unroll
                    for (int e = 0; e < E; ++e) acc[h][e] += ph * vf[u][e];
                }
            }
        }
    }

    if (lane == 0) {
        #pragma unroll
        for (int h = 0; h < G; ++h) {
            ms[warp][h] = m[h];
            ls[warp][h] = l[h];
        }
    }
    #pragma unroll
    for (int h = 0; h < G; ++h)
        #pragma unroll
        for (int e = 0; e < E; ++e) accs[warp][h][lane * E + e] = acc[h][e];
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        float mx_ = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mx_ = fmaxf(mx_, ms[w][h]);
        float num = 0.0f, den = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            if (ms[w][h] > -INFINITY) {          // a warp that met no key adds nothing
                const float f = expf(ms[w][h] - mx_);
                num += accs[w][h][d] * f;
                den += ls[w][h] * f;
            }
        }
        out[((size_t)t * HEADS + g * G + h) * D + d] = static_cast<T>(num / den);
    }
"""


@functools.cache
def _kernel():
    """The kernel, built on first use (MLX compiles it per template instantiation)."""
    return mx.fast.cuda_kernel(
        name="strata_chunk_attention",
        input_names=["q", "kp", "vp", "tables", "rows", "scale_in"],
        output_names=["out"],
        source=compact(_SOURCE),
        header="#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n",
    )


@functools.cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def _smem_bytes(warps: int, group: int, head_dim: int) -> int:
    """Shared memory of a block (the kernel's ``qs``, ``ms``, ``ls`` and ``accs``), bytes."""
    return 4 * (group * head_dim + 2 * warps * group + warps * group * head_dim)


def _warps(group: int, head_dim: int) -> int:
    """Warps per block: ``WARPS``, or 4 where ``WARPS`` warps' partial sums exceed
    ``SMEM_BYTES``."""
    return WARPS if _smem_bytes(WARPS, group, head_dim) <= SMEM_BYTES else 4


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

    Returns:
        ``[R, heads, head_dim]`` (or ``flat``) of ``q``'s dtype: softmax(scale * q k^T) v per
        head, float32 inside, rounded once.

    Raises:
        ValueError: a shape or dtype :func:`supported` refuses (R is not limited here: the
            limit on a chunk's queries is the caller's choice of kernel), or a malformed
            ``tables``/``rows``. Positions are not checked against ``W`` (that would cost a
            device sync): the caller builds them.
    """
    key = (q.shape, q.dtype, keys.shape, keys.dtype, values.shape, values.dtype)
    key += (tables.shape, tables.dtype, rows.shape, rows.dtype, float(scale), int(window), flat)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = _prepare(q, keys, values, tables, rows, scale, window, flat)
    template, grid, threadgroup, shape = launch
    (out,) = _kernel()(
        inputs=[q, keys, values, tables, rows, _scale(float(scale))],
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[shape],
        output_dtypes=[q.dtype],
    )
    return out


_LAUNCHES: dict[tuple, tuple] = {}
"""Call signature (the arrays' shapes and dtypes, scale, window, ``flat``) -> the kernel's
template, grid, block and output shape, validated on the signature's first call: a pass's
blocks repeat one signature, and validating each call cost the host several us of the few tens
a pass's block may take (H200 host, 2026-12-01)."""

_MAX_LAUNCHES = 1024
"""Signatures kept (emptied past this: the key length of ``tables`` changes from pass to pass)."""


def _prepare(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    tables: mx.array,
    rows: mx.array,
    scale: float,
    window: int,
    flat: bool,
) -> tuple[list, tuple[int, int, int], tuple[int, int, int], tuple[int, ...]]:
    """Validate a call of :func:`attention` and work out its kernel's arguments.

    Raises:
        ValueError: as :func:`attention` says.
    """
    # A q of another rank reads as 0 heads, which supported() refuses below.
    r, d = q.shape[0] if q.ndim else 0, q.shape[-1] if q.ndim else 0
    heads = q.shape[1] if q.ndim in (3, 4) else 0
    kv_heads = keys.shape[1] if keys.ndim == 3 else 0
    if (
        q.ndim not in (3, 4)
        or (q.ndim == 4 and q.shape[2] != 1)
        or not supported(1, heads, kv_heads, d, q.dtype)
        or keys.dtype != q.dtype
        or values.shape != keys.shape
        or values.dtype != q.dtype
        or keys.shape[2] != d
        or tables.ndim != 2
        or tables.dtype != mx.int32
        or rows.shape != (r, 2)
        or rows.dtype != mx.int32
    ):
        raise ValueError(
            f"cuda_attention: queries {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} "
            f"{keys.dtype}, tables {tuple(tables.shape)} {tables.dtype}, rows "
            f"{tuple(rows.shape)} {rows.dtype} are not handled here (MLX CUDA, head_dim in "
            f"{HEAD_DIMS}, 16-bit floats, int32 tables [S, W] and rows [R, 2]); use "
            "mx.fast.scaled_dot_product_attention"
        )
    group = heads // kv_heads
    warps = _warps(group, d)
    template = [
        ("T", q.dtype),
        ("G", group),
        ("D", d),
        ("WINDOW", int(window)),
        ("WARPS", warps),
        ("PV", PV),
    ]
    shape = (r, heads * d) if flat else (r, heads, d)
    return template, (r * kv_heads * warps * 32, 1, 1), (warps * 32, 1, 1), shape
