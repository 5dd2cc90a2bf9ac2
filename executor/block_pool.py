"""The paged KV cache's block pool: reference counts, the free list and the prefix cache.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots; a sequence holds a list of
blocks (its block table) that covers its computed tokens. This module only does the bookkeeping
(pure Python, no MLX): which block is free, who holds it, which blocks hold which token prefix.

Free list. Every block whose reference count is 0 is on one free list, an ``OrderedDict`` kept in
eviction order: ``allocate`` takes blocks from its head and a freed block goes to its tail, so the
block handed out next is the one released longest ago. ``free`` is given a sequence's block table
and appends it in reverse: the table's last block (a sequence's own tail, the least likely to be
shared with another prompt) is then evicted before its first blocks (a system prompt or a chat
history other requests are likely to share). vLLM v1 orders its free queue the same way.

Prefix cache. A full block is identified by a hash chained on its parent: ``sha256(parent block's
hash + the block's token ids)`` (``hash_block``; the first block's parent is ``ROOT_HASH``), so
equal block contents under different prefixes never match, and the hashes are the same in every
run. ``commit`` registers the full blocks among a sequence's computed tokens; ``match_prefix``
finds the longest run of registered blocks that starts a new prompt, so its prefill starts after
them. A registered block keeps its hash when it is freed: it stays on the free list, still
matchable, until ``allocate`` hands it out, which evicts it (drops the hash, counts an eviction).
The free list's order therefore makes eviction least-recently-used (by release time), with a
sequence's tail blocks first. A block matched while free is taken off the list (ref 0 -> 1); it
goes back to the tail when released again.

Partial blocks. Where the full-block match ends, the next block of the prompt may still begin
like a cached block: a document shared by many prompts ends inside a block, and each prompt's own
question follows. ``match_partial`` finds, among the registered children of the last matched
block (blocks committed with that parent hash) that begin with the prompt's next
``lend_min_tokens`` tokens (half a block: a copy's cost does not pay for a shared BOS), the one
that agrees longest, and lends it: the new sequence reads those leading slots from the cached
block and computes from the first token that differs, as SGLang's radix cache reuses a prefix at
token granularity where vLLM recomputes the partial block. The lent block is only read; the
sequence's own block for those positions gets the lent slots copied in after its first pass
(``executor.scheduler``, ``PagedKVCache.copy_slots``), before it can be registered itself. The
children are indexed by parent and first ``lend_min_tokens`` tokens, at most
``LEND_CANDIDATES`` of them per key (the latest registered; older ones stay cached whole), so a
lookup compares at most that many blocks.

Costs: every operation is O(blocks it touches); only ``reset_prefix_cache`` scans the pool.
``commit`` only hashes blocks that are not registered yet (it walks back from the last full block
to the first one already hashed), so calling it every decode step costs O(1) between block
boundaries.

Counters (ints, read by the serving metrics): ``prefix_query_tokens`` (tokens of the prompts
looked up), ``prefix_hit_tokens`` (tokens served by cached blocks, whole or partial) and
``evictions`` (registered blocks dropped to be reused). With ``prefix_caching`` False nothing is
hashed, ``match_prefix`` returns ``[]`` and the counters stay 0.

``reset_prefix_cache`` forgets every hash at once (benchmarks, vLLM's ``/reset_prefix_cache``):
blocks in use stay allocated, free blocks stay on the free list in their order, counters keep
their values; later prompts miss until their blocks are committed again.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from strata.common.errors import StrataError

ROOT_HASH = b""
"""The parent hash of a sequence's first block."""

LEND_CANDIDATES = 16
"""Registered blocks kept as lending candidates per parent and first ``lend_min_tokens`` tokens
(the latest registered): many conversations under one system prompt that ends inside a block
share that key, and ``match_partial`` compares each candidate token by token."""


def lend_min_tokens(block_size: int) -> int:
    """The fewest agreeing tokens that make a partial match: half a block (at least 1). Whatever
    their number, lent slots cost a copy of four operations per layer after the pass (host time
    in the next step), so a match of a token or two (a shared BOS, a first word) is computed
    instead."""
    return max(1, block_size // 2)


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache hash of one full block.

    Args:
        parent: the hash of the block before it (``ROOT_HASH`` for a sequence's first block).
        token_ids: the block's token ids (``block_size`` of them).

    Returns:
        ``sha256(parent + token ids as little-endian int64)``, 32 bytes; the same on every run and
        platform (Python's ``hash`` is salted per process, so it is not used).
    """
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockPool:
    """KV-cache blocks: allocation with reference counts, an LRU free list, a prefix cache.

    Args:
        num_blocks: blocks in the KV cache (the plan's ``kv_num_blocks``).
        block_size: token slots per block (the plan's ``kv_block_size``).
        prefix_caching: register computed full blocks and reuse them for later prompts.

    Raises:
        StrataError: ``num_blocks`` or ``block_size`` is below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise StrataError(
                f"the KV cache has {num_blocks} blocks; give the plan's batch limits "
                "kv_num_blocks >= 1"
            )
        if block_size < 1:
            raise StrataError(
                f"the KV cache's block size is {block_size} tokens; give the plan's batch limits "
                "kv_block_size >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        # Blocks with ref 0, head = next to hand out. Values are unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The hash each block was committed with (None: not committed, or evicted since).
        self._hash: list[bytes | None] = [None] * num_blocks
        # hash -> the block that serves it (the first one committed with that hash).
        self._cached: dict[bytes, int] = {}
        # Partial matches: each lending candidate's index key (parent hash, first
        # ``lend_min`` token ids) and token ids, and the candidates by key, oldest first (kept
        # in step with ``_cached``).
        self.lend_min = lend_min_tokens(block_size)
        self._key: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._children: dict[tuple[bytes, tuple[int, ...]], dict[int, None]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0

    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: ref count 0, cached or not."""
        return len(self._free)

    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence (ref count > 0)."""
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks from the head of the free list, each with ref count 1.

        A block that still holds a cached prefix is evicted on the way (its hash dropped,
        ``evictions`` += 1).

        Args:
            n: blocks wanted (>= 0).

        Returns:
            The block ids, or None when fewer than ``n`` are free (then nothing changes: the
            caller decides whether to preempt, wait or give up).

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                self._hash[block] = None
                # A duplicate (its hash served by an older block) was never in the cache.
                if self._cached.get(h) == block:
                    del self._cached[h]
                    self._forget_child(block)
                    self.evictions += 1
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Release one reference to each block; a block that reaches 0 goes to the free list.

        Args:
            blocks: a sequence's block table, in order; appended to the free list's tail in
                reverse, so its last block is evicted first.

        Raises:
            ValueError: a block was released more often than it was taken (a caller bug).
        """
        for block in reversed(blocks):
            ref = self._ref[block] - 1
            if ref < 0:
                raise ValueError(f"KV block {block} freed more often than it was allocated")
            self._ref[block] = ref
            if ref == 0:
                self._free[block] = None  # a cached block keeps its hash until reallocated

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Take the cached blocks that hold the longest full-block prefix of ``token_ids``.

        Each returned block gets ref += 1 (taken off the free list if it was there); the caller
        owns those references (``free`` them if the sequence is not admitted after all). Counts
        ``prefix_query_tokens += len(token_ids)`` and ``prefix_hit_tokens += len(blocks) *
        block_size``, once per call.

        Args:
            token_ids: the sequence's token ids from its start.
            max_tokens: most tokens the match may cover, rounded down to whole blocks; pass
                ``len(token_ids) - 1`` so that at least the last token is computed (its logits
                give the next token).

        Returns:
            The block ids covering the first ``len(result) * block_size`` tokens, in order;
            ``[]`` without prefix caching.
        """
        if not self.prefix_caching:
            return []
        bs = self.block_size
        n_full = max(0, min(len(token_ids), max_tokens)) // bs
        hits: list[int] = []
        h = ROOT_HASH
        for i in range(n_full):
            h = hash_block(h, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_tokens += len(hits) * bs
        return hits

    def match_partial(
        self, token_ids: Sequence[int], hits: Sequence[int], max_tokens: int
    ) -> tuple[int, int] | None:
        """Lend the registered block whose first tokens agree longest with the prompt's tokens
        after ``hits`` (``match_prefix``'s result for it), short of a whole block.

        The block gets ref += 1 (taken off the free list if it was there), which the caller
        releases with ``free`` once the lent slots are copied, or at once if the sequence is not
        admitted. Counts ``prefix_hit_tokens += k``.

        Args:
            token_ids: the sequence's token ids from its start.
            hits: the blocks ``match_prefix`` returned for them.
            max_tokens: most tokens the whole match may cover (``len(token_ids) - 1``).

        Returns:
            ``(block, k)``: the first ``k`` >= ``lend_min`` slots of ``block`` hold the KV of
            tokens ``len(hits) * block_size`` to ``len(hits) * block_size + k - 1`` (the
            longest agreement; the latest registered among equals); None where no lending
            candidate under the last hit (the root without hits) begins with the next
            ``lend_min`` tokens, or without prefix caching.
        """
        if not self.prefix_caching:
            return None
        m, start = self.lend_min, len(hits) * self.block_size
        want = tuple(token_ids[start : min(start + self.block_size, len(token_ids), max_tokens)])
        parent = self._hash[hits[-1]] if hits else ROOT_HASH
        if len(want) < m or parent is None:
            return None
        best, best_k = -1, 0
        for block in reversed(self._children.get((parent, want[:m]), ())):  # latest first
            k = m
            for cached, wanted in zip(self._tokens[block][m:], want[m:], strict=False):
                if cached != wanted:
                    break
                k += 1
            if k > best_k:
                best, best_k = block, k
        if best_k == 0:
            return None
        if self._ref[best] == 0:
            del self._free[best]
        self._ref[best] += 1
        self.prefix_hit_tokens += best_k
        return best, best_k

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash: no later ``match_prefix`` hits until blocks are
        committed again. Reference counts, the free list and the counters are unchanged, and a
        block still in use is re-hashed from its sequence's first block by its next ``commit``.
        O(num_blocks)."""
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        self._key.clear()
        self._tokens.clear()
        self._children.clear()

    def commit(self, token_ids: Sequence[int], blocks: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among a sequence's first ``num_computed`` tokens.

        Idempotent: blocks already registered are skipped, and only the blocks after the last
        registered one are hashed. A hash already served by another block keeps that (older)
        block; the new block is then a plain copy, reused only by its own sequence.

        Args:
            token_ids: the sequence's token ids from its start.
            blocks: the sequence's block table (from ``allocate`` / ``match_prefix``); block ``i``
                holds tokens ``[i * block_size, (i + 1) * block_size)``.
            num_computed: tokens whose KV is written in those blocks.
        """
        if not self.prefix_caching:
            return
        bs = self.block_size
        n_full = min(min(num_computed, len(token_ids)) // bs, len(blocks))
        # A block registered for this sequence implies all blocks before it are (hashes chain),
        # so walk back from the last full block: O(new blocks), O(1) between block boundaries.
        first = n_full
        while first > 0 and self._hash[blocks[first - 1]] is None:
            first -= 1
        h = self._hash[blocks[first - 1]] if first else ROOT_HASH
        assert h is not None
        for i in range(first, n_full):
            parent, ids = h, token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, ids)
            self._hash[blocks[i]] = h
            if self._cached.setdefault(h, blocks[i]) == blocks[i]:
                self._add_candidate(blocks[i], parent, tuple(ids))

    def _add_candidate(self, block: int, parent: bytes, ids: tuple[int, ...]) -> None:
        """Index a newly registered block for ``match_partial`` (dropping its key's oldest
        candidate past ``LEND_CANDIDATES``)."""
        key = (parent, ids[: self.lend_min])
        kids = self._children.setdefault(key, {})
        kids[block] = None
        self._key[block], self._tokens[block] = key, ids
        if len(kids) > LEND_CANDIDATES:
            self._forget_child(next(iter(kids)))

    def _forget_child(self, block: int) -> None:
        """Drop a block from the partial-match index (evicted, or an older candidate); a no-op
        for a block not in it."""
        key = self._key.pop(block, None)
        if key is None:
            return
        del self._tokens[block]
        kids = self._children[key]
        del kids[block]
        if not kids:
            del self._children[key]
