"""The paged KV pool's slot bookkeeping: ``slot_table`` with lent slots (a partial prefix-cache
hit) and ``PagedKVCache.copy_slots``, which moves those slots into the borrower's own block."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from strata.executor.paged_kv import PagedKVCache, slot_table


def test_slot_table_reads_lent_positions_from_the_lent_block():
    plain = slot_table([5, 2, 7], 4, 11)
    assert plain.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30]
    lent = slot_table([5, 2, 7], 4, 11, lent=(4, 9, 3))  # positions 4-6 from block 9
    assert lent.tolist() == [20, 21, 22, 23, 36, 37, 38, 11, 28, 29, 30]
    assert slot_table([5, 2], 4, 6, lent=(4, 9, 3)).tolist() == [20, 21, 22, 23, 36, 37]


def test_copy_slots_copies_every_layer_in_place():
    """Every layer's keys and values of the source slots land in the destination slots, the rest
    of the pools unchanged, and no pool is copied whole (peak memory stays under one pool)."""
    kv = PagedKVCache(3, 2, 32, 4096, 4, mx.float16)  # 2 MiB pools
    rng = np.random.default_rng(0)
    for i in range(3):
        kv.keys[i] = mx.array(rng.standard_normal(kv.keys[i].shape).astype(np.float16))
        kv.values[i] = mx.array(rng.standard_normal(kv.values[i].shape).astype(np.float16))
    mx.eval(kv.keys + kv.values)
    before = [np.array(a) for a in (*kv.keys, *kv.values)]
    src, dst = np.array([9, 10, 11], np.int32), np.array([40, 41, 42], np.int32)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    kv.copy_slots(mx.array(src), mx.array(dst))
    mx.eval(kv.keys + kv.values)
    assert mx.get_peak_memory() - base < kv.keys[0].nbytes
    for old, new in zip(before, (*kv.keys, *kv.values), strict=True):
        want = old.copy()
        want[dst] = old[src]
        assert np.array_equal(np.array(new), want)
