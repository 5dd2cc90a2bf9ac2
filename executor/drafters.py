"""Drafters for speculative decoding: cheap guesses of a sequence's next tokens.

Each serving step gives every decoding sequence a verification chunk of its pending token (sampled
last step, not yet in the target's KV cache) plus up to K draft tokens from a drafter; the target
scores the whole chunk in one pass and ``Sampler.verify`` keeps the drafts its own distribution
agrees with (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"). A
drafter only has to be cheap and often right: whatever it proposes, the output distribution is
the target's. Every drafter here is deterministic (its drafts are a function of the sequence's
tokens), so the acceptance rule is the one for a point-mass draft distribution.

The interface (:class:`Drafter`): ``propose`` takes a batch of :class:`DraftInput` (a sequence's
tokens, the last one pending, and how many drafts are wanted) and returns 0..k tokens for each;
``accepted`` says how many leading tokens of a sequence are final after verification, so a
drafter with per-sequence state can roll back; ``release`` drops a finished sequence's state.
All calls come from one thread (the serving engine's), in any interleaving of requests.

Prompt lookup (:class:`PromptLookupDrafter`, ``"prompt_lookup"``)
    No weights. The longest n-gram (``max_ngram`` down to ``min_ngram`` tokens) that ends the
    sequence and also occurs earlier in it (prompt and outputs), at its most recent earlier
    occurrence; the draft is what followed it there, copied LZ77-style so that a match close to
    the end continues periodically. Saxena 2023, "Prompt Lookup Decoding"
    (github.com/apoorvumang/prompt-lookup-decoding); vLLM's ``ngram`` speculative method. Strong
    on inputs the output quotes: code edits, summaries, retrieval answers, repetitive text.
    Cost: an incremental per-request index (n-gram -> its last end position), O(max_ngram) dict
    work per new token, O(max_ngram + k) per proposal.

Draft model (:class:`DraftModelDrafter`, ``"draft_model"``)
    A second, smaller GGUF of the same vocabulary (same family, or the first blocks of the
    target: ``scripts/cut_gguf.py``) run greedily on its own paged KV cache and block pool. Per
    step: one batched pass catches every sequence up with its tokens (the pending one included)
    and gives each its first draft, then k-1 batched one-token passes give the rest; one host
    transfer per pass (the argmax ids). The small-model drafter of Leviathan et al. 2023 and
    Chen et al. 2023, greedy; vLLM's draft-model proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor import pass_graph
from strata.executor.block_pool import BlockPool
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput, slot_table
from strata.executor.runner import forward

if TYPE_CHECKING:
    from strata.executor.engine import Engine


@dataclass
class DraftInput:
    """One sequence to draft for.

    Attributes:
        request_id: the sequence's request (the key of any per-sequence drafter state).
        tokens: the sequence's token ids, prompt then outputs; the last one is pending (sampled,
            not yet verified into the target's KV cache). Append-only over a request's life:
            drafters may index what they saw.
        k: most draft tokens wanted (>= 1; 0 or less gets none).
        start: the pending token's position in the target's KV cache (its
            ``num_computed_tokens``); -1 when not given. The self-drafter writes there.
        slots: int32 [start + 1 + k], the target's KV slots of positions ``0..start + k`` (the
            blocks the scheduler reserved for the verification chunk); None when not given.
    """

    request_id: str
    tokens: list[int]
    k: int
    start: int = -1
    slots: np.ndarray | None = None


class Drafter(Protocol):
    """What the serving engine asks of a drafter (module docstring)."""

    name: str
    """``"prompt_lookup"``, ``"draft_model"`` or ``"self"``."""

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Draft tokens for each input, in the same order: 0..k ids each, the guesses for the
        positions right after the pending token."""
        ...

    def accepted(self, request_id: str, num_valid: int) -> None:
        """The first ``num_valid`` tokens of the sequence are final; anything the drafter
        assumed after them was rejected (roll back state that depended on it)."""
        ...

    def release(self, request_id: str) -> None:
        """The sequence finished or was aborted: drop its state (unknown ids are ignored)."""
        ...

    def close(self) -> None:
        """The engine thread is ending: drop what it made (KV pool, compiled passes)."""
        ...


# ====================================================================== prompt lookup


@dataclass
class _NgramIndex:
    """One sequence's n-grams: ``last[n - min_ngram][gram]`` is the position of the last token of
    the most recent occurrence of ``gram`` (n tokens) among those ending before ``upto``."""

    last: list[dict[tuple[int, ...], int]]
    upto: int = 0
    tail: tuple[int, ...] = ()  # tokens[upto - max_ngram : upto]: detects a changed sequence


class PromptLookupDrafter:
    """Prompt lookup decoding (module docstring): no weights, deterministic.

    Args:
        max_ngram: longest n-gram matched (tried first).
        min_ngram: shortest n-gram matched (1: a single repeated token is enough).

    Raises:
        StrataError: ``not 1 <= min_ngram <= max_ngram``.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise StrataError(
                f"prompt lookup n-gram sizes {min_ngram}..{max_ngram} are not a range; give "
                "1 <= min_ngram <= max_ngram"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Drafts for each input (0..k tokens; [] when no n-gram of the suffix recurs).

        Returns:
            ``[[token ids]]``, one list per input, in order.
        """
        return [self._propose(x) for x in inputs]

    def accepted(self, request_id: str, num_valid: int) -> None:
        """Nothing to roll back: the index only ever holds the sequence's own tokens."""

    def release(self, request_id: str) -> None:
        """Drop the sequence's n-gram index."""
        self._index.pop(request_id, None)

    def close(self) -> None:
        """Nothing made on the engine thread."""

    def _index_for(self, x: DraftInput) -> _NgramIndex:
        """The request's index, extended to every n-gram ending before the last token (the
        suffix's own occurrence is not "earlier")."""
        toks = x.tokens
        idx = self._index.get(x.request_id)
        if (
            idx is None
            or idx.upto > len(toks)
            or toks[idx.upto - len(idx.tail) : idx.upto] != list(idx.tail)
        ):
            # New request, or tokens that do not extend what was indexed (a reused id): rebuild.
            idx = _NgramIndex([{} for _ in range(self.min_ngram, self.max_ngram + 1)])
            self._index[x.request_id] = idx
        lo, hi = self.min_ngram, self.max_ngram
        for end in range(idx.upto, len(toks) - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                idx.last[n - lo][tuple(toks[end - n + 1 : end + 1])] = end
        idx.upto = max(idx.upto, len(toks) - 1)
        idx.tail = tuple(toks[max(0, idx.upto - hi) : idx.upto])
        return idx

    def _propose(self, x: DraftInput) -> list[int]:
        toks = x.tokens
        if x.k < 1 or len(toks) < 2:
            return []
        idx = self._index_for(x)
        lo = self.min_ngram
        for n in range(min(self.max_ngram, len(toks) - 1), lo - 1, -1):
            end = idx.last[n - lo].get(tuple(toks[-n:]))
            if end is None:
                continue
            # Copy what followed the match, LZ77-style: past the sequence's end the copy reads
            # its own output, i.e. continues the period (len - 1 - end) the match implies.
            length = len(toks)
            out: list[int] = []
            for pos in range(end + 1, end + 1 + x.k):
                out.append(toks[pos] if pos < length else out[pos - length])
            return out
        return []


# ====================================================================== draft model


@dataclass
class _DraftSeq:
    """The draft model's state of one sequence.

    ``num_real`` leading positions of its KV hold the sequence's own tokens; ``drafted`` are the
    draft ids computed after them (this drafter's own guesses, positions ``num_real ..``), kept
    until the next ``propose`` compares them with the tokens the target accepted.
    """

    num_real: int = 0
    drafted: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    last_use: int = 0

    @property
    def computed(self) -> int:
        """Positions whose KV is in the draft's cache."""
        return self.num_real + len(self.drafted)


def _vocab_tokens(engine: Engine) -> tuple[str | None, list[bytes]]:
    """(``tokenizer.ggml.model``, every token's bytes) of an engine's GGUF."""
    g = engine.loaded.gguf
    tokens = g.string_bytes("tokenizer.ggml.tokens") or []
    return g.field("tokenizer.ggml.model"), tokens


def check_same_vocab(target: Engine, draft: Engine) -> None:
    """Refuse a draft model whose token ids mean other text than the target's.

    The rule is strict: same tokenizer model and the same token list, id by id (llama.cpp's
    speculative example tolerates a few differing ids; a draft of another vocabulary would
    only be rejected, at full cost). The embedding widths may differ (padded vocabularies):
    a draft id past the target's tokens ends that sequence's draft (:class:`DraftModelDrafter`).

    Raises:
        StrataError: the tokenizers differ (names both models and the first difference).
    """
    if target is draft:
        return
    tm, tt = _vocab_tokens(target)
    dm, dt = _vocab_tokens(draft)
    tname, dname = target.loaded.gguf.path.name, draft.loaded.gguf.path.name
    problem = None
    if tm != dm:
        problem = f"tokenizer {dm!r} vs the target's {tm!r}"
    elif len(tt) != len(dt):
        problem = f"{len(dt)} tokens vs the target's {len(tt)}"
    elif tt != dt:
        i = next(i for i, (a, b) in enumerate(zip(tt, dt, strict=True)) if a != b)
        problem = f"token {i} is {dt[i]!r} vs the target's {tt[i]!r}"
    if problem:
        raise StrataError(
            f"draft model {dname} has another vocabulary than {tname} ({problem}); give a draft "
            "model of the same tokenizer (the same family, or scripts/cut_gguf.py of the target)"
        )


class DraftModelDrafter:
    """Greedy drafts from a smaller model of the same vocabulary (module docstring).

    Its own KV cache (``engine.model.make_paged_cache``, made on the first ``propose`` so that its
    MLX arrays belong to the calling thread: MLX streams are per thread) and its own
    ``BlockPool`` (no prefix caching). Per request it keeps its computed tokens and block ids.

    Each ``propose``: every sequence is reconciled first (its drafted ids that the target did not
    keep are dropped, whatever ``accepted`` said), then one batched pass computes, per sequence,
    the tokens the draft has not computed yet (the pending one included: at least one token) and
    takes the argmax of the last logits as the first draft; then k-1 batched one-token passes
    feed each draft and take the next argmax. The KV of draft ``j < k`` is written at position
    ``len(tokens) + j - 1``; the last draft is never fed. Catch-ups longer than the draft plan's
    ``prefill_chunk`` are computed in leading passes of that many tokens.

    Short pool: blocks of requests absent from the call are dropped first (least recently used;
    they recompute later), then a sequence drafts as many tokens as its blocks allow, and a
    sequence that cannot get a block for its catch-up gets [] (it is retried next step).

    Args:
        engine: the draft model, loaded (``Engine(load_plan(draft_plan))``); only its model
            is used (``executor.runner.forward``), on the calling thread.
        num_blocks: KV blocks of the draft's pool.
        block_size: tokens per block.
        target: the target model's engine, whose vocabulary the draft must share.

    Raises:
        StrataError: the vocabularies differ (:func:`check_same_vocab`); pool sizes below 1.
    """

    name = "draft_model"

    def __init__(self, engine: Engine, num_blocks: int, block_size: int, *, target: Engine):
        check_same_vocab(target, engine)
        self.engine = engine
        self.model = engine.model
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=False)
        self.kv: PagedKVCache | None = None
        self.max_chunk = max(1, engine.prefill_chunk)
        # Ids the target can take: a draft argmax past them (a padded embedding row) stops there.
        self.vocab_limit = min(
            target.loaded.desc.architecture.vocab_size, engine.loaded.desc.architecture.vocab_size
        )
        self._seqs: dict[str, _DraftSeq] = {}
        self._clock = 0
        self.passes = 0  # forward passes run (a counter for benchmarks)

    # ---------------------------------------------------------------- protocol

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Greedy drafts of the draft model for each input (0..k tokens; [] when its pool is
        short or k < 1).

        Returns:
            ``[[token ids]]``, one list per input, in order.

        Raises:
            StrataError: a request id twice in one call.
        """
        if self.kv is None:
            self.kv = self.model.make_paged_cache(self.pool.num_blocks, self.pool.block_size)
        self._clock += 1
        ids = [x.request_id for x in inputs]
        if len(set(ids)) != len(ids):
            raise StrataError("a request was given twice to one propose call; this is a bug")
        present = set(ids)
        # (input index, state, tokens, drafts wanted) of the sequences that draft this step.
        work: list[tuple[int, _DraftSeq, list[int], int]] = []
        for i, x in enumerate(inputs):
            if x.k < 1 or not x.tokens:
                continue
            st = self._seqs.setdefault(x.request_id, _DraftSeq())
            st.last_use = self._clock
            self._reconcile(st, x.tokens)
            k = self._reserve(st, len(x.tokens), x.k, present)
            if k:
                work.append((i, st, x.tokens, k))
        out: list[list[int]] = [[] for _ in inputs]
        if not work:
            return out
        drafts = self._catch_up(work)
        for i, tok in drafts.items():
            out[i].append(tok)
        for j in range(1, max(k for _, _, _, k in work)):
            # Sequences still drafting: k > j and no stop (an id the target cannot take).
            live = [w for w in work if w[3] > j and len(out[w[0]]) == j]
            if not live:
                break
            bs = self.pool.block_size
            seqs = []
            for i, st, toks, _ in live:
                pos = len(toks) + j - 1  # where draft j goes
                seqs.append(SeqInput([out[i][-1]], pos, slot_table(st.blocks, bs, pos + 1)))
            nxt = self._argmax(seqs)
            for (i, st, _, _), tok in zip(live, nxt, strict=True):
                st.drafted.append(out[i][-1])  # its KV is now computed
                if tok < self.vocab_limit:
                    out[i].append(tok)
        return out

    def accepted(self, request_id: str, num_valid: int) -> None:
        """Forget what the draft computed past the first ``num_valid`` tokens and free the
        blocks it no longer needs (the next ``propose`` recomputes from there)."""
        st = self._seqs.get(request_id)
        if st is None:
            return
        if num_valid < st.num_real:
            st.num_real, st.drafted = max(0, num_valid), []
        else:
            del st.drafted[num_valid - st.num_real :]
        keep = -(-st.computed // self.pool.block_size)
        if keep < len(st.blocks):
            self.pool.free(st.blocks[keep:])
            del st.blocks[keep:]

    def release(self, request_id: str) -> None:
        """Free the sequence's draft KV blocks."""
        st = self._seqs.pop(request_id, None)
        if st is not None and st.blocks:
            self.pool.free(st.blocks)

    def close(self) -> None:
        """Drop the draft KV pool and its compiled passes on the engine thread, which made them
        (``pass_graph.release`` says why)."""
        if self.kv is not None:
            mx.synchronize()
            pass_graph.release(self.kv)
            self.kv = None

    # ---------------------------------------------------------------- internals

    def _reconcile(self, st: _DraftSeq, tokens: list[int]) -> None:
        """Make the state's computed positions a prefix of ``tokens`` that leaves the pending
        (last) token to compute: keep the drafted ids the target accepted, drop the rest.
        O(drafted): the real prefix is trusted (tokens are append-only)."""
        n = len(tokens)
        if st.num_real > n:  # not an extension of what was seen (a reused id): start over
            st.num_real, st.drafted = 0, []
        m = 0
        for a, b in zip(st.drafted, tokens[st.num_real :], strict=False):
            if a != b:
                break
            m += 1
        # The pending token's logits give the first draft, so it is always (re)computed.
        st.num_real = min(st.num_real + m, n - 1)
        st.drafted = []

    def _reserve(self, st: _DraftSeq, n: int, k: int, present: set[str]) -> int:
        """Blocks for a sequence of ``n`` tokens drafting ``k``: positions ``0 .. n + k - 2``
        (the last draft is never fed). Returns the drafts it can make (0: no block for its
        catch-up)."""
        bs = self.pool.block_size

        def short(kk: int) -> int:  # blocks missing for kk drafts
            return max(0, -(-(n + kk - 1) // bs) - len(st.blocks)) - self.pool.num_free_blocks()

        if short(k) > 0:
            self._evict_idle(short(k), present)
        while k > 0 and short(k) > 0:
            k -= 1
        if k:
            got = self.pool.allocate(max(0, -(-(n + k - 1) // bs) - len(st.blocks)))
            assert got is not None  # short(k) <= 0: the pool has them
            st.blocks += got
        return k

    def _evict_idle(self, blocks: int, present: set[str]) -> None:
        """Free at least ``blocks`` blocks (if possible) from requests not in this call, least
        recently used first; they recompute their KV when they draft again."""
        idle = sorted(
            (st.last_use, rid) for rid, st in self._seqs.items() if rid not in present and st.blocks
        )
        for _, rid in idle:
            if blocks <= 0:
                return
            st = self._seqs[rid]
            blocks -= len(st.blocks)
            self.pool.free(st.blocks)
            st.blocks, st.num_real, st.drafted = [], 0, []

    def _catch_up(self, work: list[tuple[int, _DraftSeq, list[int], int]]) -> dict[int, int]:
        """Compute every working sequence's missing tokens; returns its first draft by input
        index. Leading passes take ``max_chunk`` tokens of the sequences with more than that
        left; the last pass has them all."""
        bs, chunk = self.pool.block_size, self.max_chunk
        while True:
            long = [(st, toks) for _, st, toks, _ in work if len(toks) - st.num_real > chunk]
            if not long:
                break
            seqs = [
                SeqInput(
                    toks[st.num_real : st.num_real + chunk],
                    st.num_real,
                    slot_table(st.blocks, bs, st.num_real + chunk),
                )
                for st, toks in long
            ]
            logits = forward(self.model, ForwardBatch.build(seqs), self.kv)
            mx.eval(logits)  # the KV writes (every layer's attention reads them)
            self.passes += 1
            for st, _ in long:
                st.num_real += chunk
        seqs = [
            SeqInput(toks[st.num_real :], st.num_real, slot_table(st.blocks, bs, len(toks)))
            for _, st, toks, _ in work
        ]
        first = self._argmax(seqs)
        drafts = {}
        for (i, st, toks, _), tok in zip(work, first, strict=True):
            st.num_real = len(toks)
            if tok < self.vocab_limit:
                drafts[i] = tok
        return drafts

    def _argmax(self, seqs: Sequence[SeqInput]) -> list[int]:
        """One forward pass; the greedy next token of each input (argmax on the device, one
        host transfer)."""
        logits = forward(self.model, ForwardBatch.build(list(seqs)), self.kv)
        self.passes += 1
        return np.array(mx.argmax(logits, axis=-1)).tolist()
