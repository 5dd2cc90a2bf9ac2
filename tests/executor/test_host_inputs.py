"""``executor.host_inputs``: a pass's integer inputs written into kept buffers, and the fences
that keep a buffer from being rewritten while a pass may still read it. Runs on the default
device (the GPU where MLX has one)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from strata.executor import host_inputs
from strata.executor.host_inputs import InputStaging


def test_inputs_keep_their_values_shapes_and_int32():
    staged = InputStaging().begin()
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.array([7, -1, 2**31 - 1], dtype=np.int32)
    c = np.zeros((0, 2), dtype=np.int32)
    xa, xb, xc = staged.put(a), staged.put(b), staged.put(c)
    assert xa.dtype == mx.int32 and xa.shape == (2, 3) and xc.shape == (0, 2)
    # computed on the device from the views, after both were written
    assert np.array_equal(np.array(xa * 2), a * 2)
    assert np.array_equal(np.array(xb + 0), b)


def test_a_pass_outgrowing_its_buffer_gets_a_larger_one_and_keeps_what_it_wrote(monkeypatch):
    monkeypatch.setattr(host_inputs, "MIN_CAPACITY", 32)
    staging = InputStaging(slots=1)
    staged = staging.begin()
    small = staged.put(np.arange(20))
    # the first buffer holds 40 elements: 200 more after the first input's 32 need a new one
    big = staged.put(np.arange(100, 300))
    assert staging.grown == 2
    assert np.array_equal(np.array(small), np.arange(20))
    assert np.array_equal(np.array(big), np.arange(100, 300))
    staged.fence(big + 1)
    again = staging.begin().put(np.arange(200))  # the larger buffer serves the next pass
    assert staging.grown == 2 and np.array_equal(np.array(again), np.arange(200))


def test_a_buffer_is_rewritten_only_after_its_last_pass_fence_is_evaluated(monkeypatch):
    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(host_inputs.mx, "eval", lambda *a: (evaluated.append(a), real_eval(*a)))
    staging = InputStaging(slots=2)
    first = staging.begin()
    x = first.put(np.array([1, 2, 3]))
    out = x * 10  # not evaluated yet: the pass may still read its inputs
    first.fence(out)
    staging.begin().fence(mx.array([0]))  # the second buffer: nothing waited for
    assert evaluated == []
    third = staging.begin()  # the first buffer again: its pass's output is evaluated first
    assert len(evaluated) == 1 and evaluated[0][0] is out
    third.put(np.array([4, 5, 6]))  # rewrites the buffer x views
    assert np.array_equal(np.array(out), [10, 20, 30])


def test_a_pass_that_recorded_no_fence_gives_up_its_buffer():
    """A pass that failed before its fence may have left lazy reads of its inputs (a KV write
    not yet evaluated): its buffer is never rewritten, the next pass gets a new one."""
    staging = InputStaging(slots=1)
    slots = staging.begin().put(np.array([1, 2]))  # failed: no fence
    pool = mx.zeros(8, dtype=mx.int32)
    pool[slots] = 1  # a lazy write through the failed pass's view
    staging.begin().put(np.array([5, 6]))
    assert staging.grown == 2
    assert np.array(pool).tolist() == [0, 1, 1, 0, 0, 0, 0, 0]


def test_a_failing_fence_gives_up_the_buffer(monkeypatch):
    staging = InputStaging(slots=1)
    first = staging.begin()
    first.put(np.array([1]))
    first.fence(mx.array([0]))

    def failing(*a):
        raise RuntimeError("the pass failed on the device")

    monkeypatch.setattr(host_inputs.mx, "eval", failing)
    staging.begin().put(np.array([2]))
    assert staging.grown == 2


def test_a_fenced_or_superseded_pass_takes_no_more_inputs():
    staging = InputStaging(slots=1)
    staged = staging.begin()
    staged.fence(staged.put(np.array([1])))
    with pytest.raises(ValueError, match="fenced"):
        staged.put(np.array([2]))
    stale = staging.begin()  # unfenced, then a later pass begins on the same buffer
    live = staging.begin()
    kept = live.put(np.array([5, 5, 5]))
    with pytest.raises(ValueError, match="later pass"):
        stale.put(np.array([9, 9, 9]))
    stale.fence(mx.array([0]))  # recorded for no one: the live pass's buffer keeps no stale fence
    assert np.array(kept).tolist() == [5, 5, 5]


def test_a_staged_batch_lays_out_what_a_fresh_one_does(monkeypatch):
    """Every integer input a pass's kernels read (the CUDA attention kernel's tables, rows and
    groups included, built here on any backend) equals the unstaged array, also where the
    buffer grows in mid-pass."""
    from strata.executor import attention
    from strata.executor.paged_kv import ForwardBatch, SeqInput

    monkeypatch.setattr(host_inputs, "MIN_CAPACITY", 40)
    slots = np.arange(200, 300, dtype=np.int32)
    seqs = [SeqInput([3], 9, slots[:10]), SeqInput([4, 5, 6, 7], 20, slots[50:74])]
    for tile in (0, 16):
        fresh = ForwardBatch.build(seqs, tile=tile)
        staged = ForwardBatch.build(seqs, tile=tile, staged=InputStaging().begin())
        pairs = [
            (fresh.id_array, staged.id_array),
            (fresh.write_slots, staged.write_slots),
            (fresh.logit_rows, staged.logit_rows),
            (fresh.positions(8), staged.positions(8)),
            *zip(
                attention.kernel_layout(fresh, 8, 40),
                attention.kernel_layout(staged, 8, 40),
                strict=True,
            ),
            (attention.kernel_groups(fresh).array, attention.kernel_groups(staged).array),
        ]
        if not tile:
            pairs.append((fresh.decode_table, staged.decode_table))
        for a, b in zip(fresh.chunks, staged.chunks, strict=True):
            pairs += [(a.table, b.table), (attention.chunk_rows(a), attention.chunk_rows(b))]
            pairs.append((attention.chunk_groups(a).array, attention.chunk_groups(b).array))
        for a, b in pairs:
            assert b.dtype == mx.int32 and np.array_equal(np.array(a), np.array(b))


def test_a_ring_needs_a_buffer():
    with pytest.raises(ValueError, match="at least one buffer"):
        InputStaging(slots=0)


@pytest.mark.parametrize("grow", [False, True])
def test_mapped_buffers_read_the_same_and_are_given_back(monkeypatch, grow):
    """``mapped``: on MLX's CUDA backend each buffer is kept on the host and mapped for the GPU
    (``cuda_driver.keep_on_host``) until it is dropped or the ring closes; elsewhere nothing is
    mapped. Either way the kernels read what was written, across a buffer's growth too."""
    if grow:
        monkeypatch.setattr(host_inputs, "MIN_CAPACITY", 32)
    staging = InputStaging(slots=2, mapped=True)
    cuda = mx.cuda.is_available()
    for i in range(4):
        staged = staging.begin()
        want_a, want_b = np.arange(20) + i, np.arange(100, 140 if grow else 120) * (i + 1)
        a, b = staged.put(want_a), staged.put(want_b)
        out = a.sum() + b.sum()  # computed on the device from the views
        staged.fence(out)
        assert out.item() == int(want_a.sum() + want_b.sum())
        assert np.array_equal(np.array(a), want_a) and np.array_equal(np.array(b), want_b)
        assert staging.mapped == (min(i + 1, 2) if cuda else 0)
    staging.close()
    assert staging.mapped == 0
