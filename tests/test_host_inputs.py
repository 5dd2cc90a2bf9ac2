"""``executor.host_inputs``: a pass's integer inputs written into kept buffers, and the fences
that keep a buffer from being rewritten while a pass may still read it. Runs on the default
device (the GPU where MLX has one)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from executor import host_inputs
from executor.host_inputs import InputStaging


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


def test_a_pass_that_recorded_no_fence_makes_the_next_user_wait_for_the_stream(monkeypatch):
    synced = []
    monkeypatch.setattr(host_inputs.mx, "synchronize", lambda *a: synced.append(a))
    staging = InputStaging(slots=1)
    staging.begin().put(np.array([1]))  # failed before its fence
    staging.begin()
    assert len(synced) == 1


def test_a_fenced_pass_takes_no_more_inputs():
    staged = InputStaging().begin()
    staged.fence(staged.put(np.array([1])))
    with pytest.raises(ValueError, match="fenced"):
        staged.put(np.array([2]))


def test_a_ring_needs_a_buffer():
    with pytest.raises(ValueError, match="at least one buffer"):
        InputStaging(slots=0)
