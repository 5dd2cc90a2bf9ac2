"""A chunk's attention (``executor.attention.chunk_attention``): on MLX's CUDA backend chunks of
up to ``cuda_attention.MAX_QUERIES`` 16-bit queries take Strata's paged kernel
(``executor.cuda_attention``), elsewhere the gathered keys go to MLX's SDPA with
``Chunk.attention_mask``. Both must give softmax attention by its definition: causal, sliding
window, grouped-query heads, a prefix in the cache, keys scattered over the pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from strata.executor import attention, cuda_attention
from strata.executor.attention import chunk_attention, chunk_groups, chunk_rows
from strata.executor.config import RuntimeConfig
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput

CUDA = mx.cuda.is_available()


def _reference(q, k, v, start, window, scale):
    """Softmax attention by definition (float64): query i at position start + i sees key j iff
    j <= start + i and (window) start + i - j < window."""
    q, k, v = (np.array(a, dtype=np.float64)[0] for a in (q, k, v))
    group = q.shape[0] // k.shape[0]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        s = q[h] @ k[h // group].T * scale
        qpos = start + np.arange(q.shape[1])[:, None]
        kpos = np.arange(k.shape[1])[None, :]
        seen = kpos <= qpos
        if window:
            seen &= qpos - kpos < window
        s = np.where(seen, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[h] = (p / p.sum(axis=1, keepdims=True)) @ v[h // group]
    return out


CASES = [
    (9, 3, 5, 40, 0, 64),
    (4, 1, 7, 20, 0, 64),
    (4, 2, 3, 300, 8, 64),  # a window: keys before it are sliced off (or skipped)
    (8, 8, 2, 0, 0, 64),
    (4, 2, 33, 250, 0, 128),
    (32, 8, 24, 992, 0, 128),  # Llama-3-8B's heads: a suffix after a 992-token prefix hit
    (4, 1, 24, 992, 600, 256),  # Gemma-3's head size with a window inside the prefix
    (16, 2, 64, 130, 0, 96),
    (2, 1, 1, 70, 16, 64),  # one query
    (8, 1, 7, 40, 4, 256),  # a window shorter than the chunk; a block of 8 holds its 7 queries
]


def _chunk_case(heads, kv_heads, t, start, window, d, dtype, seed=0):
    rng = np.random.default_rng(heads * 100 + t + seed)
    length = start + t
    slots_total = length + 1000
    pool_k = rng.standard_normal((slots_total, kv_heads, d)).astype(np.float32)
    pool_v = rng.standard_normal((slots_total, kv_heads, d)).astype(np.float32)
    slots = rng.permutation(slots_total)[:length].astype(np.int32)
    kv = PagedKVCache(1, kv_heads, d, slots_total, 1, dtype)
    kv.keys[0], kv.values[0] = mx.array(pool_k).astype(dtype), mx.array(pool_v).astype(dtype)
    # with a tile of 1 every input, a one-token one too, is a chunk
    c = ForwardBatch.build([SeqInput(list(range(t)), start, slots)], tile=0 if t > 1 else 1)
    chunk = c.chunks[0]
    assert np.array_equal(np.array(chunk.table)[0], slots)
    q = rng.standard_normal((1, heads, t, d)).astype(np.float32)
    want = _reference(
        q,
        pool_k[slots].transpose(1, 0, 2)[None],
        pool_v[slots].transpose(1, 0, 2)[None],
        start,
        window,
        d**-0.5,
    )
    return kv, chunk, mx.array(q).astype(dtype), want


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "t", "start", "window", "d"), CASES)
def test_chunk_attention_matches_the_definition(dtype, heads, kv_heads, t, start, window, d):
    """16-bit queries take the paged kernel on CUDA."""
    kv, chunk, q, want = _chunk_case(heads, kv_heads, t, start, window, d, dtype)
    got = chunk_attention(q, kv, 0, chunk, window, d**-0.5, RuntimeConfig.build())
    assert got.shape == (t, heads, d) and got.dtype == dtype
    # float32 on CUDA is MLX's SDPA with TensorFloat-32 products (7e-4 measured on the H200)
    tol = {mx.float32: 2e-3 if CUDA else 1e-4, mx.float16: 1e-2, mx.bfloat16: 3e-2}[dtype]
    got = np.array(got.astype(mx.float32)).transpose(1, 0, 2)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_paged_kernel_rows_do_not_depend_on_the_chunk(dtype):
    """A query's output is the same, bit for bit, alone (a one-query call over its own keys)
    and inside a chunk of 24."""
    kv, chunk, q, _ = _chunk_case(32, 8, 24, 500, 0, 128, dtype, seed=3)
    rows = q[0].transpose(1, 0, 2)  # [T, heads, head_dim]
    whole = cuda_attention.attention(
        rows,
        kv.keys[0],
        kv.values[0],
        chunk.table,
        chunk_rows(chunk),
        0.088,
        groups=chunk_groups(chunk),  # three groups of 8 rows
    )
    for i in (0, 7, 23):
        alone = cuda_attention.attention(
            rows[i : i + 1],
            kv.keys[0],
            kv.values[0],
            chunk.table[:, : 500 + i + 1],
            mx.array([[0, 500 + i]], dtype=mx.int32),
            0.088,
        )
        same = alone[0].astype(mx.float32), whole[i].astype(mx.float32)  # exact widening
        assert np.array_equal(np.array(same[0]), np.array(same[1]))
    # RoPE's [R, heads, 1, head_dim] in, the output projection's [R, heads * head_dim] out
    four = cuda_attention.attention(
        rows[:, :, None],
        kv.keys[0],
        kv.values[0],
        chunk.table,
        chunk_rows(chunk),
        0.088,
        flat=True,
    )
    assert four.shape == (24, 32 * 128) and mx.array_equal(four, whole.reshape(24, -1))


def test_paged_kernel_scope_and_refusals():
    """Where the kernel applies, and the error that names the problem elsewhere."""
    assert cuda_attention.supported(24, 32, 8, 128, mx.float16) == CUDA
    assert not cuda_attention.supported(65, 32, 8, 128, mx.float16)  # a prefill chunk
    assert not cuda_attention.supported(24, 32, 8, 80, mx.float16)  # head size
    assert not cuda_attention.supported(24, 32, 2, 128, mx.float16)  # 16 heads per kv head
    assert not cuda_attention.supported(24, 32, 8, 128, mx.float32)
    assert not cuda_attention.supported(24, 32, 0, 128, mx.float16)
    # a block holds the largest group's queries rounded up to a power of two (1, 2, 4, 8)
    assert [cuda_attention._block_queries(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert cuda_attention._block_warps(8, 4) == 2  # Llama-3-8B: 32 rows, two tensor-core tiles
    assert cuda_attention._block_warps(1, 4) == 1 and cuda_attention._block_warps(8, 3) == 2
    assert cuda_attention._block_warps(8, 8) == 4
    assert (
        max(cuda_attention._smem_bytes(d) for d in cuda_attention.HEAD_DIMS)
        <= cuda_attention.SMEM_BYTES
    )


def test_query_groups_hold_consecutive_rows_of_one_input():
    """Groups never mix inputs or skip a row, hold at most ``GROUP_QUERIES`` rows, and leave
    padding rows out; every query row is in exactly one."""
    inputs = np.array([1, 2, 3] + [0] * 19 + [4, 4, 0, 0])
    positions = np.array([30, 90, 3, *range(40, 59), 61, 62, -1, -1])
    g = cuda_attention.query_groups(inputs, positions)
    got = np.array(g.array).tolist()
    assert got == [[0, 1], [1, 1], [2, 1], [3, 8], [11, 8], [19, 3], [22, 2]]
    assert g.largest == 8
    covered = [r for first, n in got for r in range(first, first + n)]
    assert covered == list(range(24))  # the two padding rows are in none
    for first, n in got:
        assert len(set(inputs[first : first + n])) == 1
    # one input's rows split by another's are two runs
    g = cuda_attention.query_groups(np.array([0, 1, 0]), np.array([5, 2, 6]))
    assert np.array(g.array).tolist() == [[0, 1], [1, 1], [2, 1]] and g.largest == 1
    # a pass of padding only: one empty group
    g = cuda_attention.query_groups(np.array([0, 0]), np.array([-1, -1]))
    assert np.array(g.array).tolist() == [[0, 0]]


@pytest.mark.parametrize(
    ("q_dtype", "pool_dtype", "tables", "rows", "why"),
    [
        (mx.float32, mx.float32, mx.zeros((1, 5), mx.int32), mx.zeros((4, 2), mx.int32), "f32"),
        (mx.float16, mx.float32, mx.zeros((1, 5), mx.int32), mx.zeros((4, 2), mx.int32), "pool"),
        (mx.float16, mx.float16, mx.zeros((5,), mx.int32), mx.zeros((4, 2), mx.int32), "1-D"),
        (mx.float16, mx.float16, mx.zeros((1, 5), mx.int64), mx.zeros((4, 2), mx.int32), "i64"),
        (mx.float16, mx.float16, mx.zeros((1, 5), mx.int32), mx.zeros((3, 2), mx.int32), "rows"),
        (mx.float16, mx.float16, mx.zeros((1, 0), mx.int32), mx.zeros((4, 2), mx.int32), "W=0"),
        (mx.float16, mx.float16, mx.zeros((0, 5), mx.int32), mx.zeros((4, 2), mx.int32), "S=0"),
    ],
)
def test_paged_kernel_refuses_what_it_cannot_take(
    q_dtype, pool_dtype, tables, rows, why, monkeypatch
):
    """Each malformed input is refused by its own check (CUDA is pretended on the CPU, so the
    backend check does not answer for them), before any kernel is built."""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    q = mx.zeros((4, 4, 64), dtype=q_dtype)
    pool = mx.zeros((10, 2, 64), dtype=pool_dtype)
    with pytest.raises(ValueError, match="not handled here"):
        cuda_attention.attention(q, pool, pool, tables, rows, 0.125)


@pytest.mark.parametrize(
    ("groups", "why"),
    [
        (cuda_attention.QueryGroups(mx.zeros((2, 2), mx.int64), 1), "int64"),
        (cuda_attention.QueryGroups(mx.zeros((2, 3), mx.int32), 1), "3 columns"),
        (cuda_attention.QueryGroups(mx.zeros((0, 2), mx.int32), 1), "no group"),
        (cuda_attention.QueryGroups(mx.zeros((2, 2), mx.int32), 0), "largest 0"),
        (cuda_attention.QueryGroups(mx.zeros((2, 2), mx.int32), 9), "largest 9"),
    ],
)
def test_paged_kernel_refuses_malformed_groups(groups, why, monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    q, pool = mx.zeros((4, 4, 64), dtype=mx.float16), mx.zeros((10, 2, 64), dtype=mx.float16)
    tables, rows = mx.zeros((1, 5), mx.int32), mx.zeros((4, 2), mx.int32)
    with pytest.raises(ValueError, match="not handled here"):
        cuda_attention.attention(q, pool, pool, tables, rows, 0.125, groups=groups)


def test_paged_kernel_refuses_a_call_without_rows(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    q, pool = mx.zeros((0, 4, 64), dtype=mx.float16), mx.zeros((10, 2, 64), dtype=mx.float16)
    with pytest.raises(ValueError, match="R >= 1 query rows"):
        cuda_attention.attention(
            q, pool, pool, mx.zeros((1, 5), mx.int32), mx.zeros((0, 2), mx.int32), 0.125
        )


def test_a_pass_whose_scratch_is_too_large_takes_the_per_chunk_path(monkeypatch):
    """``kernel_attention`` declines a pass whose split scratch (rows x heads x splits of the
    longest table x (head_dim + 2) floats) exceeds ``MAX_SCRATCH_BYTES``."""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    batch, kv, _, _ = _pass_case(mx.float16, 0)
    need = cuda_attention.scratch_bytes(16, 8, 91, 128)  # 10 tokens in a bucket of 16; W 91
    assert need == 4 * 16 * 8 * 2 * 130 and batch.table_width == 91
    monkeypatch.setattr(cuda_attention, "MAX_SCRATCH_BYTES", need)
    assert attention.kernel_attention(batch, kv, 0, 8, mx.float16)
    monkeypatch.setattr(cuda_attention, "MAX_SCRATCH_BYTES", need - 1)
    assert not attention.kernel_attention(batch, kv, 0, 8, mx.float16)


# A pass whose inputs are not in row order: a 5-token suffix after 40 cached tokens, three
# decodes and a 2-token chunk (a verification). (ids, start) per input, in input order.
PASS_INPUTS = [(list(range(5)), 40), ([7], 30), ([8], 90), ([9], 3), ([1, 2], 61)]
PASS_ROWS = [1, 2, 3, 0, 0, 0, 0, 0, 4, 4]  # the input of each row: decodes first, then chunks
PASS_POSITIONS = [30, 90, 3, 40, 41, 42, 43, 44, 61, 62]


def _pass_case(dtype, window, heads=8, kv_heads=2, d=128, seed=0):
    """``PASS_INPUTS`` over one shuffled pool: the batch, the cache, the queries [N, heads, d]
    and the definition's output per row (from the inputs as written above, not from the
    batch's own layout)."""
    rng = np.random.default_rng(seed)
    total = sum(start + len(ids) for ids, start in PASS_INPUTS)
    slots_total = total + 50
    pool_k = rng.standard_normal((slots_total, kv_heads, d)).astype(np.float32)
    pool_v = rng.standard_normal((slots_total, kv_heads, d)).astype(np.float32)
    perm = rng.permutation(slots_total).astype(np.int32)
    seqs, used = [], 0
    for ids, start in PASS_INPUTS:
        seqs.append(SeqInput(ids, start, perm[used : used + start + len(ids)]))
        used += start + len(ids)
    batch = ForwardBatch.build(seqs)
    kv = PagedKVCache(1, kv_heads, d, slots_total, 1, dtype)
    kv.keys[0], kv.values[0] = mx.array(pool_k).astype(dtype), mx.array(pool_v).astype(dtype)
    n = len(PASS_ROWS)
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    want = np.zeros((n, heads, d))
    for r, (i, pos) in enumerate(zip(PASS_ROWS, PASS_POSITIONS, strict=True)):
        sl = seqs[i].slots[: pos + 1]
        one = _reference(
            q[r][:, None][None],
            pool_k[sl].transpose(1, 0, 2)[None],
            pool_v[sl].transpose(1, 0, 2)[None],
            pos,
            window,
            d**-0.5,
        )
        want[r] = one[:, 0]
    return batch, kv, q, want


def test_kernel_layout_names_each_row_its_table_and_position():
    """``attention.kernel_layout`` and ``ForwardBatch.positions``: every row points at its own
    input's slots at its own position (checked against the slot each row writes, which the
    layout does not compute), padding rows at -1 and position 0."""
    batch, _, _, _ = _pass_case(mx.float16, 0)
    n = batch.num_tokens
    tables, meta = (np.array(a) for a in attention.kernel_layout(batch, n + 3))
    positions = np.array(batch.positions(n + 3))
    assert n == 10 and positions.shape == (13,) and meta.shape == (13, 2)
    assert meta[:, 0].tolist() == PASS_ROWS + [-1] * 3
    assert meta[:, 1].tolist() == PASS_POSITIONS + [-1] * 3
    assert positions.tolist() == PASS_POSITIONS + [0] * 3
    assert tables.shape == (5, 91)  # the longest input: the decode at position 90
    written = np.array(batch.write_slots)
    for r in range(n):
        assert tables[meta[r, 0], meta[r, 1]] == written[r]  # the slot the row's token goes to
    for bad in (lambda r: attention.kernel_layout(batch, r), batch.positions):
        with pytest.raises(Exception, match="cannot be laid out"):
            bad(n - 1)


def test_a_short_slot_table_is_refused():
    """An input with fewer slots than its positions is a bug upstream, named here rather than
    read out of bounds by a kernel."""
    with pytest.raises(Exception, match="fewer than its positions"):
        ForwardBatch.build([SeqInput([1, 2], 5, np.arange(6, dtype=np.int32))])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("window", [0, 6])
def test_paged_kernel_attends_a_whole_pass(dtype, window):
    """Decodes, a chunk and a verification in one call, with padding rows: each row matches the
    definition over its own sequence, and padding rows are zeros."""
    batch, kv, q, want = _pass_case(dtype, window)
    n = batch.num_tokens
    tables, meta = attention.kernel_layout(batch, n + 6)
    qq = mx.concatenate([mx.array(q), mx.ones((6, *q.shape[1:]))]).astype(dtype)
    groups = attention.kernel_groups(batch)
    assert groups.largest == 5  # the 5-token chunk shares its blocks
    got = cuda_attention.attention(
        qq, kv.keys[0], kv.values[0], tables, meta, 128**-0.5, window, groups=groups
    )
    alone = cuda_attention.attention(qq, kv.keys[0], kv.values[0], tables, meta, 128**-0.5, window)
    assert mx.array_equal(got, alone)  # groups change which blocks copy keys, not the result
    got = np.array(got.astype(mx.float32))
    tol = 1e-2 if dtype == mx.float16 else 3e-2
    np.testing.assert_allclose(got[:n], want, rtol=tol, atol=tol)
    assert not got[n:].any()


def test_explicit_fallback_matches_the_definition(monkeypatch):
    """Where the kernel does not apply on CUDA (say, a head size it does not take), chunks of up
    to ``explicit_attention_max_queries`` queries attend with plain operations: forced here."""
    config = RuntimeConfig.build(explicit_attention_max_queries=32)
    monkeypatch.setattr(cuda_attention, "supported", lambda *a: False)
    for heads, kv_heads, t, start, window, d in CASES:
        kv, chunk, q, want = _chunk_case(heads, kv_heads, t, start, window, d, mx.float32)
        got = chunk_attention(q, kv, 0, chunk, window, d**-0.5, config)
        got = np.array(got).transpose(1, 0, 2)
        np.testing.assert_allclose(
            got, want, rtol=2e-3 if CUDA else 1e-4, atol=2e-3 if CUDA else 1e-4
        )
