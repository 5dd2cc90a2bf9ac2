"""``executor.cuda_attention.attention`` by its definition, in MLX operations, for the tests that
run the whole-pass attention path on the CPU (``test_serving``, ``test_pass_graph``).

It reads only arrays (no host copy of the tables or positions), so ``mx.compile`` can trace it.
"""

from __future__ import annotations

import mlx.core as mx


def attention_by_definition(
    q, keys, values, tables, rows, scale, window=0, flat=False, groups=None
):
    """Each query row over its own table's slots up to its position (and within ``window``),
    zeros for padding rows (position < 0), float32 inside, rounded once to q's dtype.

    q ``[R, heads, (1,) d]``; keys/values ``[slots, kv_heads, d]``; tables int32 ``[S, W]``;
    rows int32 ``[R, 2]`` (table, position). Returns ``[R, heads, d]``, or ``[R, heads * d]``
    when ``flat``.

    ``groups`` (``cuda_attention.QueryGroups``) are followed as the kernel follows them: a row
    reads its group's first row's table, and a query row in no group gets NaN (the kernel would
    leave it unwritten), so that a wrong grouping fails the tests that run this on the CPU.
    """
    r, heads, d = q.shape[0], q.shape[1], q.shape[-1]
    kv_heads = keys.shape[1]
    table_rows, lost = rows[:, 0], mx.zeros((r,), dtype=mx.bool_)
    if groups is not None:
        first, count = groups.array[:, 0], groups.array[:, 1]
        at = mx.arange(r)
        marks = mx.full((r,), -1, dtype=mx.int32).at[first].maximum(first)
        leader = mx.maximum(mx.cummax(marks), 0)  # the first row of the group a row is in
        size = mx.zeros((r,), dtype=mx.int32).at[first].maximum(count)
        lost = (at - leader >= size[leader]) | (mx.cummax(marks) < 0)
        table_rows = rows[leader, 0]
    slots = tables[mx.maximum(table_rows, 0)]  # [R, W]
    k, v = keys[slots].astype(mx.float32), values[slots].astype(mx.float32)
    qg = q.reshape(r, kv_heads, heads // kv_heads, d).astype(mx.float32) * scale
    scores = mx.einsum("rkgd,rwkd->rkgw", qg, k)
    pos, j = rows[:, 1:2], mx.arange(tables.shape[1])[None]
    seen = (j <= pos) & (pos >= 0)
    if window:
        seen = seen & (pos - j < window)
    scores = mx.where(seen[:, None, None, :], scores, -mx.inf)
    probs = mx.where((pos >= 0)[:, :, None, None], mx.softmax(scores, axis=-1), 0.0)
    out = mx.einsum("rkgw,rwkd->rkgd", probs, v)
    out = mx.where((lost & (pos[:, 0] >= 0))[:, None, None, None], mx.nan, out).astype(q.dtype)
    return out.reshape(r, heads * d) if flat else out.reshape(r, heads, d)
