"""Attention over the paged KV cache: which backend attends a pass, and the inputs it reads.

A pass's layout (``executor.paged_kv.ForwardBatch``: rows, slots, positions, which keys each
query sees) knows no kernel. Here a block's queries are attended by one of:

- **Strata's paged kernel** (``executor.cuda_attention``, MLX's CUDA backend): one call for every
  row of the pass where it takes the whole pass (:func:`kernel_attention`), else one call per
  short chunk (:func:`chunk_attention`). Its inputs (each input's slot table, each row's table
  and position, the query groups that share a block) are derived from the layout here, once per
  pass, and kept in the batch's ``backend`` memo for every block (:func:`kernel_layout`,
  :func:`kernel_groups`, :func:`chunk_rows`, :func:`chunk_groups`);
- **MLX's SDPA** over gathered keys: the decode group together (a boolean mask for padding and
  windows), each prefill chunk on its own with its causal mask;
- **plain operations** (:func:`_explicit_attention`) for chunks of 2 to the runtime config's
  ``explicit_attention_max_queries`` queries (CUDA) where the kernel does not apply.

:func:`attend` makes that choice for one block of a pass; the model only projects, RoPEs and
writes the keys and values before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from strata.executor import cuda_attention
from strata.executor.config import RuntimeConfig
from strata.executor.ops import bucket_rows

if TYPE_CHECKING:
    from strata.executor.paged_kv import Chunk, ForwardBatch, PagedKVCache


def attend(
    q: mx.array,
    kv: PagedKVCache,
    layer: int,
    batch: ForwardBatch,
    window: int,
    scale: float,
    config: RuntimeConfig,
    sinks: mx.array | None = None,
) -> mx.array:
    """Block ``layer``'s attention of the pass's R rows (queries ``q`` [R, heads, 1, head_dim],
    RoPE'd, each row at its own position; the pass's keys and values written already), within
    a sliding ``window`` (0: none), scores scaled by ``scale``, under the model's runtime
    ``config``.

    ``sinks``: one learned logit per query head (float [heads], gpt-oss's ``attn_sinks``), an
    extra term exp(sink) in every softmax denominator with no value behind it, as llama.cpp's
    ``ggml_soft_max_ext`` takes them; every path below honours it (MLX's SDPA through its
    ``sinks`` argument, :func:`_explicit_attention` itself), and Strata's paged kernel, which
    has no sinks, is not used for such a model. They are taken in ``q``'s dtype on every path:
    MLX's SDPA refuses sinks of a wider type than its output ("Type of sinks must promote to
    output type"), so float32 sinks under a float16/bfloat16 compute dtype would fail there.

    Where Strata's paged kernel takes the whole pass (:func:`kernel_attention`, asked once per
    pass), one call attends every row over its own sequence's slots; otherwise the batch's
    layout is followed: the decode group together, each chunk on its own
    (:func:`chunk_attention`), zeros for the rows past ``batch.num_tokens`` that pad the pass.

    Returns:
        [R, heads * head_dim] (the kernel) or [1, R, heads * head_dim], in ``q``'s dtype, as the
        output projection reads either.
    """
    rows, heads, d = q.shape[0], q.shape[1], q.shape[-1]
    n = batch.num_tokens
    if sinks is not None and sinks.dtype != q.dtype:
        sinks = sinks.astype(q.dtype)
    if sinks is None and whole_pass(
        batch, kv, layer, heads, q.dtype, window, config.lone_decode_kernel
    ):
        tables, meta = kernel_layout(batch, rows)
        return cuda_attention.attention(
            q,
            kv.keys[layer],
            kv.values[layer],
            tables,
            meta,
            scale,
            window,
            flat=True,
            groups=kernel_groups(batch),
        )  # [R, heads * head_dim], as the output projection reads it
    q = q.reshape(rows, heads, d)
    outs = []
    b = batch.decode_rows
    if b:
        keys, values = kv.gather(layer, batch.decode_table)
        mask = batch.decode_mask(window)
        o = mx.fast.scaled_dot_product_attention(
            q[:b, :, None], keys, values, scale=scale, mask=mask, sinks=sinks
        )
        outs.append(o[:, :, 0])  # [B, heads, head_dim]
    for c in batch.chunks:
        qc = q[c.row : c.row + c.length].transpose(1, 0, 2)[None]  # [1, heads, T, D]
        outs.append(chunk_attention(qc, kv, layer, c, window, scale, config, sinks))
    if rows > n:  # the padding rows' attention output: zeros
        outs.append(mx.zeros((rows - n, heads, kv.value_width), dtype=q.dtype))
    return _cat(outs).reshape(1, rows, -1)


def whole_pass(
    batch: ForwardBatch,
    kv: PagedKVCache,
    layer: int,
    heads: int,
    dtype: mx.Dtype,
    window: int,
    lone_decode: bool = False,
) -> bool:
    """:func:`kernel_attention`, asked once per pass, pool shape and dtype, and window (every
    block's pool has one shape and dtype, and each ask cost a few us of host time per block):
    the answer is kept in the batch's ``backend`` memo."""
    pool = kv.keys[layer]
    key = ("whole", pool.dtype, tuple(pool.shape), heads, dtype, window)
    ok = batch.backend.get(key)
    if ok is None:
        ok = kernel_attention(batch, kv, layer, heads, dtype, window, lone_decode)
        batch.backend[key] = ok
    return ok


def kernel_attention(
    batch: ForwardBatch,
    kv: PagedKVCache,
    layer: int,
    heads: int,
    dtype: mx.Dtype,
    window: int = 0,
    lone_decode: bool = False,
) -> bool:
    """Whether one call of Strata's paged kernel (``executor.cuda_attention``) attends the whole
    pass in block ``layer`` (sliding ``window``, 0: none): on MLX's CUDA backend, for a pool of
    the compute ``dtype``, ``heads`` query heads and a pool the kernel takes, every chunk at most
    ``cuda_attention.MAX_QUERIES`` queries, its scratch within ``cuda_attention.fits`` (a pass
    too large takes the per-chunk path), and anything but a lone decode that MLX's SDPA takes
    unmasked (its fused vector kernel; the lone decode was measured against the paged kernel's
    first design, a block per query and key/value head, 8 for a decode of the Llama-3-8B shape,
    too few to fill a GPU, and not against the split design since). Longer prefill chunks keep
    cuDNN (``chunk_attention``). One call for the whole pass saved a few ms a pass over one per
    chunk (a pass's decodes otherwise take a padded gather, a boolean mask and MLX's unfused
    fallback): docs/kernels.md#the-paged-attention-kernel. ``lone_decode``: the kernel takes the
    lone decode too (``RuntimeConfig.lone_decode_kernel``), so that its pass can be compiled."""
    lone = not batch.chunks and batch.decode_rows < 2 and batch.decode_mask(window) is None
    if lone and not lone_decode:
        return False
    pool = kv.keys[layer]
    return (
        pool.dtype == dtype
        # Values stored as part of the keys (multi-head latent attention, K wider than V): the
        # kernel reads a value pool as wide as the keys, so such a cache takes the MLX paths.
        and kv.value_dim is None
        and all(c.length <= cuda_attention.MAX_QUERIES for c in batch.chunks)
        and cuda_attention.supported(1, heads, pool.shape[1], pool.shape[2], dtype)
        and cuda_attention.fits(
            bucket_rows(batch.num_tokens), heads, batch.table_width, pool.shape[2]
        )
    )


def chunk_attention(
    q: mx.array,
    kv: PagedKVCache,
    layer: int,
    c: Chunk,
    window: int,
    scale: float,
    config: RuntimeConfig,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of one chunk's queries q [1, heads, T, head_dim] over its sequence's keys in
    block ``layer`` of the paged cache (the chunk's own tokens included, written already), causal
    and within a sliding ``window`` (0: none); [T, heads, head_dim].

    On MLX's CUDA backend a chunk of up to ``cuda_attention.MAX_QUERIES`` queries takes Strata's
    paged kernel (``executor.cuda_attention``: one compiled kernel for every query count and key
    length, where cuDNN builds a plan per shape); where that kernel does not apply (a head size
    or grouping it does not take, float32), chunks of 2 to ``config.
    explicit_attention_max_queries`` queries attend with plain operations, for the same reason.
    Otherwise the keys are gathered and ``mx.fast.scaled_dot_product_attention`` runs with
    ``Chunk.attention_mask``. ``sinks``: as :func:`attend`'s (the paged kernel is then not
    used)."""
    _, heads, t, d = q.shape
    pool_k = kv.keys[layer]
    if (
        sinks is None
        and pool_k.dtype == q.dtype
        and kv.value_dim is None  # values part of the keys: the MLX paths (kernel_attention)
        and cuda_attention.supported(t, heads, pool_k.shape[1], d, q.dtype)
        and cuda_attention.fits(t, heads, c.start + c.length, d)
    ):
        rows = q[0].transpose(1, 0, 2)  # [T, heads, head_dim] (the kernel makes it contiguous)
        pool_v = kv.values[layer]
        return cuda_attention.attention(
            rows, pool_k, pool_v, c.table, chunk_rows(c), scale, window, groups=chunk_groups(c)
        )
    keys, values = kv.gather(layer, c.table)
    first, mask = c.attention_mask(window)
    if first:
        keys, values = keys[:, :, first:], values[:, :, first:]
    if 1 < t <= config.explicit_attention_max_queries:
        if isinstance(mask, str):  # "causal", bottom-right aligned: query i sees keys <= L - T + i
            length = keys.shape[2]
            mask = mx.arange(length)[None, :] <= mx.arange(length - t, length)[:, None]
        o = _explicit_attention(q, keys, values, scale, mask, sinks)
    else:
        o = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    return o[0].transpose(1, 0, 2)


def _explicit_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Softmax attention with plain operations, grouped-query heads as MLX's SDPA maps them
    (query head i reads kv head i // (heads / kv_heads)): q [B, heads, T, D], keys/values
    [B, kv_heads, L, D], ``mask`` bool [T, L] (True: seen) or None, ``sinks`` float [heads]
    (one more logit per head in the softmax, with no value: :func:`attend`) or None;
    [B, heads, T, D] in q's dtype. Scores and softmax in float32, as the fused kernels
    accumulate."""
    b, heads, t, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    qg = q.reshape(b, kv_heads, group * t, d).astype(mx.float32)
    scores = (qg * scale) @ keys.astype(mx.float32).transpose(0, 1, 3, 2)
    scores = scores.reshape(b, kv_heads, group, t, length)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, kv_heads, group, 1, 1), (b, kv_heads, group, t, 1)
        )
        scores = mx.concatenate([scores, sink], axis=-1)
        probs = mx.softmax(scores, axis=-1)[..., :length].reshape(b, kv_heads, group * t, length)
    else:
        probs = mx.softmax(scores, axis=-1).reshape(b, kv_heads, group * t, length)
    out = probs @ values.astype(mx.float32)  # values may be narrower than keys (latent attention)
    return out.reshape(b, heads, t, values.shape[-1]).astype(q.dtype)


def _cat(parts: list[mx.array]) -> mx.array:
    """Row-wise concatenation (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def kernel_layout(batch: ForwardBatch, rows: int, width: int = 0) -> tuple[mx.array, mx.array]:
    """The pass laid out for one call of ``executor.cuda_attention.attention`` over ``rows``
    rows (``batch.num_tokens``, or more: the extra rows pad the pass and attend to nothing):

    - ``tables``: int32 [inputs, W], each input's slots up to its last new token, padded
      with 0 to the longest, or to ``width`` where that is wider (W);
    - ``rows``: int32 [rows, 2], each row's table and position (-1 for padding).

    Made once per pass, for every layer (the first call's ``width`` holds for the pass).

    Raises:
        StrataError: ``rows`` is below the pass's tokens.
    """
    key = ("layout", rows)
    memo = batch.backend
    if key not in memo:
        batch.check_rows(rows)
        n = batch.num_tokens
        width = max(width, batch.table_width)
        tables = np.zeros((len(batch.seq_slots), width), dtype=np.int32)
        for i, t in enumerate(batch.seq_slots):
            tables[i, : len(t)] = t
        meta = np.full((rows, 2), -1, dtype=np.int32)
        meta[:n, 0], meta[:n, 1] = batch.row_inputs, batch.row_positions
        memo[key] = (batch.to_device(tables), batch.to_device(meta))
    return memo[key]


def kernel_groups(batch: ForwardBatch) -> cuda_attention.QueryGroups:
    """The pass's query rows in groups of one input's consecutive rows, as
    ``executor.cuda_attention.attention`` shares its copies of keys among them
    (``executor.cuda_attention.query_groups``; padding rows belong to none, so one answer
    serves every ``rows`` of :func:`kernel_layout`). Made once per pass, for every layer."""
    memo = batch.backend
    if "groups" not in memo:
        memo["groups"] = cuda_attention.query_groups(
            batch.row_inputs, batch.row_positions, batch.to_device
        )
    return memo["groups"]


def traced_inputs(
    rows: int, tables: mx.array, meta: mx.array, groups: cuda_attention.QueryGroups
) -> dict:
    """A ``backend`` memo whose kernel inputs are the given arrays (:func:`kernel_layout`'s
    ``tables`` and ``rows`` for ``rows`` rows, :func:`kernel_groups`'s groups): how
    ``executor.pass_graph`` hands a traced pass its placeholders."""
    return {("layout", rows): (tables, meta), "groups": groups}


def chunk_rows(chunk: Chunk) -> mx.array:
    """int32 [T, 2]: each of the chunk's queries' table row (0, ``chunk.table``'s only one) and
    position, as ``executor.cuda_attention.attention`` reads them. Made once, for every layer."""
    memo = chunk.backend
    if "rows" not in memo:
        pos = np.arange(chunk.start, chunk.start + chunk.length, dtype=np.int32)
        memo["rows"] = chunk.to_device(np.stack([np.zeros_like(pos), pos], axis=1))
    return memo["rows"]


def chunk_groups(chunk: Chunk) -> cuda_attention.QueryGroups:
    """The chunk's queries in groups that share the kernel's copies of keys
    (``executor.cuda_attention.query_groups``). Made once, for every layer."""
    memo = chunk.backend
    if "groups" not in memo:
        pos = np.arange(chunk.start, chunk.start + chunk.length)
        memo["groups"] = cuda_attention.query_groups(np.zeros_like(pos), pos, chunk.to_device)
    return memo["groups"]
