"""The KV block pool on its own (pure Python): reference counts, the free list's eviction order,
chained prefix-cache hashes, ``match_prefix``'s cap, ``commit``'s idempotence, the counters,
``reset_prefix_cache``."""

from __future__ import annotations

import hashlib
import struct

import pytest
from strata.common.errors import StrataError
from strata.executor.block_pool import ROOT_HASH, BlockPool, hash_block


def _cached_seq(pool: BlockPool, token_ids: list[int]) -> list[int]:
    """Allocate blocks for ``token_ids``, commit them all as computed, free them.

    Returns the block table (now on the free list, cached)."""
    blocks = pool.allocate(-(-len(token_ids) // pool.block_size))
    assert blocks is not None
    pool.commit(token_ids, blocks, len(token_ids))
    pool.free(blocks)
    return blocks


def test_allocate_free_and_ref_counts():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert (pool.num_blocks, pool.block_size) == (4, 2)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free_blocks(), pool.num_used_blocks()) == (1, 3)
    assert pool.allocate(2) is None  # only 1 free: nothing changes
    assert (pool.num_free_blocks(), pool.num_used_blocks()) == (1, 3)
    assert pool.allocate(0) == []
    pool.free([0, 1, 2])
    assert (pool.num_free_blocks(), pool.num_used_blocks()) == (4, 0)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_shared_block_is_freed_by_its_last_holder():
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = [5, 6, 7, 8, 9]
    blocks = pool.allocate(3)
    pool.commit(ids, blocks, 5)
    assert pool.match_prefix(ids, 4) == blocks[:2]  # a second holder of blocks 0 and 1
    pool.free(blocks)
    assert pool.num_used_blocks() == 2  # the matched two are still held
    assert pool.allocate(3) is None  # and cannot be handed out
    pool.free(blocks[:2])
    assert pool.num_used_blocks() == 0


def test_free_appends_in_reverse_and_allocate_takes_the_head():
    pool = BlockPool(num_blocks=5, block_size=2, prefix_caching=False)
    a, b = pool.allocate(2), pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    pool.free(a)  # tail: 1, 0
    pool.free(b)  # tail: 4, 3, 2
    assert pool.allocate(5) == [1, 0, 4, 3, 2]


def test_init_errors_name_the_fix():
    with pytest.raises(StrataError, match="kv_num_blocks >= 1"):
        BlockPool(0, 16)
    with pytest.raises(StrataError, match="kv_block_size >= 1"):
        BlockPool(4, 0)


def test_hash_is_sha256_chained_on_the_parent():
    want = hashlib.sha256(b"" + struct.pack("<2q", 1, 2)).digest()
    assert hash_block(ROOT_HASH, [1, 2]) == want
    child = hash_block(want, [3, 4])
    assert child == hashlib.sha256(want + struct.pack("<2q", 3, 4)).digest()
    assert child != hash_block(ROOT_HASH, [3, 4])


def test_commit_then_match_prefix_and_counters():
    pool = BlockPool(num_blocks=8, block_size=4)
    ids = list(range(10))
    blocks = _cached_seq(pool, ids)  # 2 full blocks cached, the third (2 tokens) not
    assert pool.num_free_blocks() == 8
    got = pool.match_prefix(ids, len(ids) - 1)
    assert got == blocks[:2]
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens) == (10, 8)
    assert (pool.num_free_blocks(), pool.num_used_blocks()) == (6, 2)  # taken off the free list
    # Counted once per call, hit or miss.
    assert pool.match_prefix([99, 98, 97, 96, 95], 4) == []
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens) == (15, 8)


def test_match_prefix_is_capped_by_max_tokens_in_whole_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    ids = list(range(8))
    blocks = _cached_seq(pool, ids)
    # The whole prompt is cached; len - 1 leaves the last token (and its block) to compute.
    assert pool.match_prefix(ids, 7) == blocks[:1]
    assert pool.match_prefix(ids, 8) == blocks[:2]
    assert pool.match_prefix(ids, 100) == blocks[:2]
    assert pool.match_prefix(ids, 3) == []
    assert pool.match_prefix(ids, -1) == []
    assert pool.prefix_hit_tokens == 4 + 8 + 8


def test_same_block_tokens_under_another_prefix_do_not_match():
    pool = BlockPool(num_blocks=8, block_size=4)
    x = _cached_seq(pool, [0, 1, 2, 3, 4, 5, 6, 7])
    y = _cached_seq(pool, [8, 8, 8, 8])
    # First block cached (y's), second block's tokens equal x's second block: the parent differs.
    assert pool.match_prefix([8, 8, 8, 8, 4, 5, 6, 7, 1], 8) == y
    assert pool.match_prefix([0, 1, 2, 3, 4, 5, 6, 7, 1], 8) == x
    # x's second block alone, at the start of a prompt, is another block.
    assert pool.match_prefix([4, 5, 6, 7, 1], 4) == []
    assert pool.prefix_hit_tokens == 4 + 8


def test_commit_registers_only_computed_full_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    ids = list(range(12))
    blocks = pool.allocate(3)
    pool.commit(ids, blocks, 6)  # KV of 6 tokens: one full block
    assert pool.match_prefix(ids, 11) == blocks[:1]
    pool.commit(ids, blocks, 12)
    pool.commit(ids, blocks, 12)  # idempotent
    assert pool.match_prefix(ids, 12) == blocks
    for held in (blocks[:1], blocks, blocks):  # first match, second match, the allocation
        pool.free(held)
    assert pool.num_used_blocks() == 0
    # Three cached blocks, each evicted exactly once when everything is reallocated.
    assert pool.allocate(8) is not None
    assert pool.evictions == 3
    assert pool.match_prefix(ids, 12) == []


def test_commit_hashes_only_new_blocks(monkeypatch):
    """Per decode step, commit must not rehash the sequence (O(1) between block boundaries)."""
    import strata.executor.block_pool as bp

    calls = []
    real = bp.hash_block
    monkeypatch.setattr(bp, "hash_block", lambda p, t: calls.append(tuple(t)) or real(p, t))
    pool = BlockPool(num_blocks=8, block_size=2)
    ids = list(range(9))
    blocks = pool.allocate(5)
    pool.commit(ids, blocks, 4)
    assert calls == [(0, 1), (2, 3)]
    pool.commit(ids, blocks, 5)
    assert calls == [(0, 1), (2, 3)]
    pool.commit(ids, blocks, 8)
    assert calls == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_duplicate_hash_keeps_the_older_block():
    pool = BlockPool(num_blocks=6, block_size=2)
    ids = [1, 2, 3, 4]
    a = pool.allocate(2)
    b = pool.allocate(2)  # another sequence computed the same prompt concurrently
    pool.commit(ids, a, 4)
    pool.commit(ids, b, 4)
    pool.free(b)
    pool.free(a)
    assert pool.match_prefix(ids, 4) == a
    pool.free(a)
    # Only a's two blocks were in the cache: reallocating all six evicts two.
    assert pool.allocate(6) is not None
    assert pool.evictions == 2


def test_eviction_is_lru_and_a_sequence_tail_goes_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    old = [1, 2, 3, 4]
    new = [5, 6, 7, 8]
    old_blocks = _cached_seq(pool, old)  # freed first: least recently used
    new_blocks = _cached_seq(pool, new)
    assert (old_blocks, new_blocks) == ([0, 1], [2, 3])
    assert pool.allocate(1) == [1]  # old's tail block (freed in reverse)
    assert pool.evictions == 1
    assert pool.match_prefix(old, 4) == [0]  # its first block is still cached
    assert pool.match_prefix(new, 4) == new_blocks
    # A matched block goes back to the tail when released: 0, released last, is evicted last.
    pool.free(new_blocks)
    pool.free([0])
    assert pool.allocate(3) == [3, 2, 0]
    assert pool.evictions == 4
    assert pool.match_prefix(new, 4) == []
    assert pool.match_prefix(old, 4) == []


def test_reset_prefix_cache_forgets_hashes_and_keeps_blocks():
    pool = BlockPool(num_blocks=6, block_size=2)
    old = [1, 2, 3, 4]
    old_blocks = _cached_seq(pool, old)  # free, cached
    held = pool.allocate(2)  # in use by a running sequence, committed
    pool.commit([5, 6, 7, 8], held, 4)
    assert pool.match_prefix(old, 4) == old_blocks
    pool.free(old_blocks)
    counters = (pool.prefix_query_tokens, pool.prefix_hit_tokens, pool.evictions)
    pool.reset_prefix_cache()
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens, pool.evictions) == counters
    assert (pool.num_used_blocks(), pool.num_free_blocks()) == (2, 4)  # held stays allocated
    assert pool.match_prefix(old, 4) == [] and pool.match_prefix([5, 6, 7, 8], 4) == []
    # The held sequence's next commit hashes its blocks again; nothing counts as evicted.
    pool.commit([5, 6, 7, 8], held, 4)
    assert pool.match_prefix([5, 6, 7, 8], 4) == held
    assert pool.allocate(4) is not None and pool.evictions == 0


def test_without_prefix_caching_nothing_is_cached_or_counted():
    pool = BlockPool(num_blocks=4, block_size=2, prefix_caching=False)
    ids = [1, 2, 3, 4, 5]
    _cached_seq(pool, ids)
    assert pool.match_prefix(ids, 4) == []
    assert pool.allocate(4) == [3, 2, 1, 0]
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens, pool.evictions) == (0, 0, 0)


def test_match_partial_lends_the_child_that_agrees_longest():
    """``match_partial`` looks only at blocks registered under the last hit (the root without
    hits), takes the one whose first tokens agree longest with the prompt's next ones (capped by
    ``max_tokens``; at least ``lend_min``, half a block), references it (off the free list) and
    counts its tokens as hits."""
    pool = BlockPool(num_blocks=8, block_size=4)
    first = _cached_seq(pool, [1, 2, 3, 4, 5, 6, 7, 8])  # [1 2 3 4] then [5 6 7 8]
    near = _cached_seq(pool, [1, 2, 3, 4, 5, 6, 0, 0])[1]  # [5 6 0 0] under the same parent
    _cached_seq(pool, [9, 9, 9, 9, 5, 6, 7, 0])  # [5 6 7 0] under another parent: not a child
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 1]
    hits = pool.match_prefix(prompt, len(prompt) - 1)
    assert hits == [first[0]]
    before = pool.prefix_hit_tokens
    free = pool.num_free_blocks()
    assert pool.match_partial(prompt, hits, len(prompt) - 1) == (first[1], 3)
    assert pool.prefix_hit_tokens - before == 3 and pool.num_free_blocks() == free - 1
    pool.free([first[1]])  # the borrower's release: back on the free list, still cached
    assert pool.lend_min == 2
    # capped at 6: two tokens, on which both children agree; the latest registered is lent
    assert pool.match_partial([1, 2, 3, 4, 5, 6, 7], hits, 6) == (near, 2)
    pool.free([near])
    assert pool.match_partial([1, 2, 3, 4, 5, 6], hits, 5) is None  # 1 token: under lend_min
    assert pool.match_partial([1, 2, 3, 4, 5, 6, 0, 3], hits, 7) == (near, 3)
    pool.free([near])
    assert pool.match_partial([1, 2, 3, 4, 8, 8], hits, 5) is None  # no child starts with 8
    assert pool.match_partial([5, 6, 7, 1], [], 3) is None  # no root block starts with 5
    assert pool.match_partial([1, 2, 0], [], 2) == (first[0], 2)  # a root block does
    pool.free([first[0], first[0]])  # match_prefix's reference and this one
    assert pool.num_used_blocks() == 0


def test_match_partial_forgets_evicted_and_reset_blocks():
    """An evicted block, and every block after ``reset_prefix_cache``, is never lent."""
    pool = BlockPool(num_blocks=3, block_size=2)
    blocks = _cached_seq(pool, [1, 2, 3, 4])
    hits = pool.match_prefix([1, 2, 3, 9], 3)
    assert pool.match_partial([1, 2, 3, 9], hits, 3) == (blocks[1], 1)
    pool.free([blocks[1], *hits])
    taken = pool.allocate(3)  # evicts both cached blocks
    assert taken is not None and pool.evictions == 2
    pool.free(taken)
    assert pool.match_partial([1, 2, 3, 9], [], 3) is None
    blocks = _cached_seq(pool, [1, 2, 3, 4])
    pool.reset_prefix_cache()
    assert pool.match_partial([1, 2, 3], [], 2) is None
    pool.commit([1, 2], blocks[:1], 2)  # registered again after the reset
    assert pool.match_partial([1, 2, 3], [], 2) == (blocks[0], 2)
    pool.free([blocks[0]])


def test_without_prefix_caching_nothing_is_lent():
    pool = BlockPool(num_blocks=4, block_size=2, prefix_caching=False)
    _cached_seq(pool, [1, 2, 3, 4])
    assert pool.match_partial([1, 2, 3], [], 2) is None and pool.prefix_hit_tokens == 0


def test_lending_candidates_per_key_are_capped(monkeypatch):
    """Past ``LEND_CANDIDATES`` blocks under one parent that begin alike, the oldest is no
    longer lent (so a lookup compares a bounded number of blocks), but stays cached whole."""
    from strata.executor import block_pool

    monkeypatch.setattr(block_pool, "LEND_CANDIDATES", 2)
    pool = BlockPool(num_blocks=16, block_size=4)
    tails = ([1, 1], [2, 2], [3, 3])  # three blocks [7 7 x x] under the root, oldest first
    blocks = [_cached_seq(pool, [7, 7, *t])[0] for t in tails]
    # blocks[0] would agree on 3 tokens, but it was dropped: the two left agree on 2 (latest)
    assert pool.match_partial([7, 7, 1, 9, 9], [], 4) == (blocks[2], 2)
    pool.free([blocks[2]])
    assert pool.match_partial([7, 7, 3, 9, 9], [], 4) == (blocks[2], 3)
    pool.free([blocks[2]])
    assert pool.match_prefix([7, 7, 1, 1, 5], 4) == [blocks[0]]  # still a whole-block hit
    pool.free([blocks[0]])
