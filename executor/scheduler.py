"""Continuous batching in vLLM v1's style: which tokens of which sequences the next step runs.

Model. A sequence is its tokens (prompt, then the outputs sampled so far) and
``num_computed_tokens``, how many of them have their KV in the cache. There are no prefill and
decode phases: each step, every sequence's computed tokens catch up with its tokens by a chunk
``(start=num_computed_tokens, num_tokens)``. A prompt is caught up in prefill chunks; afterwards
each step has one new token to compute (a decode). A chunk that reaches the sequence's last token
samples the next token from its last logits (``ScheduledChunk.sample``); ``update`` appends it.

Budget. One token budget per step (``max_num_batched_tokens``), shared by prefill chunks and
decodes, bounds the step's work, so a long prompt never stalls running decodes for more than one
chunk (``prefill_chunk``) and TPOT stays flat while others prefill. Running sequences come first,
in arrival order: each gets ``min(tokens left, prefill_chunk, budget left)``. Then waiting
sequences are admitted first come, first served while budget is left and fewer than
``max_num_seqs`` run; admission looks the sequence up in the prefix cache (``BlockPool
.match_prefix``, leaving at least the last token to compute), so a shared prompt starts its
prefill after the cached blocks, and then within the next block (``BlockPool.match_partial``:
a cached block that begins with at least half a block of the prompt's next tokens is lent, so
prefill starts at the first token that differs rather than at the block's start). The
admitted chunk carries the lent slots (``ScheduledChunk.lent``): its pass reads those positions'
KV from the lent block, and the engine then copies them into the sequence's own block
(``take_copies``), which releases the lent block, before any later step can read or register
that block. A waiting sequence whose blocks cannot be allocated stops admission: nothing behind
it skips ahead (no starvation of long prompts).

Preemption. A running sequence whose chunk needs a block the pool does not have preempts the
*latest-arrived* running sequence, itself included, and retries. Recompute, not swap: the
victim's blocks are freed and its ``num_computed_tokens`` reset, its outputs kept, and it goes
back to the front of the waiting queue. Its full blocks were committed to the prefix cache as they
were computed, and freed blocks keep their hashes until reused, so re-admission usually finds most
of them and recomputes little; there is no host copy path to maintain. Latest-arrived first keeps
FCFS fairness, and it guarantees progress: the earliest running sequence is never preempted while
others run, and ``add`` refuses a sequence that could not run alone in the whole pool (prompt +
``max_tokens``, capped by the context, where the engine finishes it), so it always gets its
blocks. No sequence is admitted in a step that preempted (the pool is short).

Speculative decoding (``num_draft_tokens`` K > 0): a decode also gets ``draft_room``, up to K
draft tokens to verify after its pending token, capped by the budget, its ``max_tokens`` and the
context, with their blocks allocated now but never by preempting (a draft is an optimisation).
The engine fills the chunk's ``draft``; ``update`` advances the sequence past the pending token
and the accepted drafts only, so the rejected drafts' KV slots are overwritten later (the
rollback), and only computed full blocks are committed to the prefix cache.

Chunk alignment (``chunk_align`` A > 0, batch-invariant serving): a chunk that stops short of the
sequence's known tokens (``num_tokens``) ends on a multiple of A (absolute position), its length
rounded down; one rounded to nothing is not scheduled this step (a running sequence is skipped
and the next one tried; an admission stops admitting, FCFS). A chunk that reaches ``num_tokens``
(a prompt's last chunk, a decode) is not rounded. So every prompt is cut at the same positions
(multiples of A) whatever the budget left by the others, and with A the KV block size a
prefix-cache hit (whole blocks: no partial blocks are lent in this mode) ends on such a position
too. Progress: a chunk of A or more tokens always contains an aligned end, and the first sequence
of a step has the whole budget, so with ``prefill_chunk`` and ``max_num_batched_tokens`` at least
A (checked) it always advances.

Order invariant: every running sequence arrived before every waiting one (admission takes the
queue's head, a preempted sequence is the latest running one and goes back to the head), so
``running`` stays in arrival order by appending, and its last entry is the latest-arrived.

Costs per step: O(running + admitted) list work; sha256 only when a block fills (in ``update``)
and for the prompt of each admission (``match_prefix``); nothing scans the pool.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from strata.common.errors import StrataError
from strata.executor.block_pool import BlockPool

PENDING = -1
"""The id of a token sampled on the device whose value the host has not read yet (pipelined
steps, ``executor.serving``): ``update`` appends it in place of the token, the next step's pass
takes the value from the device, and the engine writes the value over it once read. It is
always a sequence's last token, never part of a committed block (``commit`` hashes only
computed tokens, and this one is not computed yet)."""


class SeqStatus(enum.Enum):
    """Where a sequence is: waiting for admission, running (holds KV blocks), finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and its scheduling state.

    Attributes:
        request_id: unique among the scheduler's waiting and running sequences.
        prompt_ids: the prompt's token ids.
        max_tokens: most tokens to generate (the engine finishes the sequence there).
        output_ids: tokens sampled so far (kept across preemption).
        num_computed_tokens: leading tokens of ``all_ids`` whose KV is in the cache.
        block_ids: the block table: block ``i`` holds tokens ``[i * block_size, (i+1) *
            block_size)``.
        num_cached_tokens: prompt tokens served by the prefix cache at the (last) admission.
        num_preemptions: times this sequence was preempted.
        status: waiting, running or finished.
        finish_reason: why it finished (``"stop"``, ``"length"``, ``"abort"``, ...), else None.
        arrival: order of arrival, set by ``Scheduler.add`` (monotonic).
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    arrival: int = 0

    @property
    def all_ids(self) -> list[int]:
        """Prompt and outputs, a new list (O(tokens): prefer ``ScheduledChunk.ids`` per step)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the prompt and outputs."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class LentSlots:
    """KV slots a sequence borrows from a cached block until they are copied into its own.

    Attributes:
        position: the first borrowed position (a multiple of the block size).
        src: the lent block; slot ``i`` holds position ``position + i``.
        dst: the sequence's own block for those positions.
        tokens: positions borrowed (1 to block size - 1).
    """

    position: int
    src: int
    dst: int
    tokens: int


@dataclass
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``seq`` to compute in this step.

    Attributes:
        seq: the sequence.
        start: the first token's position (the sequence's ``num_computed_tokens`` when scheduled).
        num_tokens: tokens to compute.
        sample: the chunk reaches the sequence's last token when scheduled, so a new token is
            sampled from its last logits. Fixed at construction, so it still reads True after
            ``update`` appended that token.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool = field(init=False)
    draft_room: int = 0
    """Speculative decoding: draft tokens this decode may verify (blocks and budget reserved)."""
    draft: list[int] = field(default_factory=list)
    """The drafter's tokens, verified after the pending one (see :meth:`set_draft`)."""
    lent: LentSlots | None = None
    """A partial prefix-cache hit (admission only): positions whose KV this chunk's pass reads
    from a cached block lent by ``BlockPool.match_partial``."""

    def __post_init__(self) -> None:
        self.sample = self.start + self.num_tokens == self.seq.num_tokens

    def set_draft(self, draft: list[int]) -> None:
        """Verify ``draft`` (at most ``draft_room`` tokens) after the pending token: the chunk
        becomes ``1 + len(draft)`` tokens.

        Raises:
            StrataError: more tokens than ``draft_room`` (a drafter bug).
        """
        if len(draft) > self.draft_room:
            raise StrataError(
                f"the drafter proposed {len(draft)} tokens for {self.seq.request_id} but the "
                f"step reserved room for {self.draft_room}; this is a bug in the drafter"
            )
        self.draft = list(draft)
        self.num_tokens = 1 + len(draft)

    @property
    def ids(self) -> list[int]:
        """The chunk's token ids, ``seq.all_ids[start:start + num_tokens]`` (then the draft)
        without building ``all_ids`` (a decode copies one id, not the whole sequence)."""
        prompt, out = self.seq.prompt_ids, self.seq.output_ids
        p, s = len(prompt), self.start
        e = s + self.num_tokens - len(self.draft)
        if s >= p:
            known = out[s - p : e - p]
        elif e <= p:
            known = prompt[s:e]
        else:
            known = prompt[s:] + out[: e - p]
        return known + self.draft if self.draft else known


def check_kv_fits(
    request_id: str,
    prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Refuse a request whose prompt and ``max_tokens`` (capped by the context: the engine
    finishes it there) need more KV blocks than the whole pool has, so it could not run even
    alone (:meth:`Scheduler.check_fits`'s rule, without a scheduler: ``strata run`` checks its
    request with it before the weights load).

    Args:
        request_id: the request's id, for the message.
        prompt_tokens, max_tokens: the request's prompt length and most generated tokens.
        max_model_len: the context (tokens per sequence).
        num_blocks, block_size: the KV cache's blocks and token slots per block (the plan's
            ``batch.kv_num_blocks`` and ``batch.kv_block_size``).

    Raises:
        StrataError: the request cannot fit; the message says what to lower or re-plan.
    """
    peak = min(prompt_tokens + max_tokens, max_model_len)
    need = -(-peak // block_size)
    if need > num_blocks:
        raise StrataError(
            f"request {request_id!r} needs up to {need} KV blocks ({peak} tokens: a prompt "
            f"of {prompt_tokens} + max_tokens {max_tokens}, within the "
            f"{max_model_len}-token context) but the KV cache has {num_blocks} "
            f"blocks of {block_size} tokens in all; lower max_tokens, shorten the "
            "prompt or plan more KV blocks (kv_num_blocks)"
        )


@dataclass
class SchedulerStep:
    """What one forward pass runs.

    Attributes:
        chunks: running sequences first (arrival order), then the ones admitted in this step.
        preempted: sequences preempted while scheduling (now waiting, with no blocks).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the step (at most the scheduler's ``max_num_batched_tokens``)."""
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Decides each step's chunks; owns the waiting queue and the running list.

    The engine loop: ``step = schedule()``; run the model on ``step.chunks`` and sample a token
    for each chunk with ``sample``; ``update(step, sampled)``; ``finish`` the sequences that are
    done (end-of-generation token, ``max_tokens``, context).

    Args:
        pool: the KV block pool (its ``block_size`` is the scheduler's).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks and decodes together).
        prefill_chunk: most tokens of one sequence in one step.
        max_model_len: the context: a sequence never holds more tokens.
        num_draft_tokens: speculative decoding: each decode gets room to verify this many draft
            tokens after its pending one (capped by the budget, its ``max_tokens`` and the
            context); 0 turns speculation off.
        chunk_align: a chunk that does not reach its sequence's last known token ends on a
            multiple of this many tokens (module docstring); 0 (the default) turns it off.
        lend_partial_blocks: admissions borrow the leading slots of a cached block where the
            prompt's next tokens agree with them (``BlockPool.match_partial``); False: whole-block
            hits only (``RuntimeConfig.lend_partial_blocks``, for measuring the difference;
            aligned chunks never lend).

    Raises:
        StrataError: a limit is below 1; ``chunk_align`` is negative, or above
            ``prefill_chunk`` or ``max_num_batched_tokens`` (no chunk could ever be cut).
    """

    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk: int,
        max_model_len: int,
        num_draft_tokens: int = 0,
        chunk_align: int = 0,
        lend_partial_blocks: bool = True,
    ):
        limits = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "prefill_chunk": prefill_chunk,
            "max_model_len (the context)": max_model_len,
        }
        for name, value in limits.items():
            if value < 1:
                raise StrataError(f"{name} is {value}; the scheduler needs it >= 1: fix the plan")
        if chunk_align < 0:
            raise StrataError(f"chunk_align is {chunk_align}; give 0 (off) or a block size")
        for name, value in (
            ("prefill_chunk", prefill_chunk),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if chunk_align > value:
                raise StrataError(
                    f"chunks aligned to {chunk_align} tokens (batch-invariant serving: the KV "
                    f"block size) need {name} >= {chunk_align}, but the plan has {value}; "
                    f"set batch.{name} to at least {chunk_align} (strata plan, or edit the plan), "
                    "or serve without batch invariance"
                )
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.max_model_len = max_model_len
        self.num_draft_tokens = max(0, num_draft_tokens)
        self.chunk_align = chunk_align
        self.lend_partial_blocks = lend_partial_blocks
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._live: dict[str, Sequence] = {}  # request_id -> waiting or running sequence
        self._arrivals = itertools.count()
        self._copies: list[LentSlots] = []  # lent slots to copy, each holding its src block

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def _aligned(self, seq: Sequence, start: int, n: int) -> int:
        """``n`` tokens from ``start``, cut to end on a multiple of ``chunk_align`` unless they
        reach ``seq``'s last known token (module docstring); may be 0."""
        a, end = self.chunk_align, start + n
        if not a or end >= seq.num_tokens:
            return n
        return end // a * a - start

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, ``arrival`` set); it runs when admitted.

        A sequence with outputs already (e.g. one resumed by the caller) resumes with all its
        tokens.

        Args:
            seq: the sequence; its ``request_id`` must not be waiting or running.

        Raises:
            StrataError: the prompt is empty; it leaves no room to generate in the context
                (``len(prompt) >= max_model_len``); ``max_tokens`` < 1; the sequence could not
                run even alone, its prompt and ``max_tokens`` (capped by the context) needing
                more blocks than the whole pool has; the id is taken.
        """
        rid, n = seq.request_id, len(seq.prompt_ids)
        if n == 0:
            raise StrataError(f"request {rid!r} has an empty prompt; send at least one token")
        if n >= self.max_model_len:
            raise StrataError(
                f"request {rid!r}: its prompt of {n} tokens leaves no room to generate in the "
                f"{self.max_model_len}-token context; shorten it to at most "
                f"{self.max_model_len - 1} tokens or plan a larger context"
            )
        if seq.max_tokens < 1:
            raise StrataError(
                f"request {rid!r} asks for max_tokens {seq.max_tokens}; ask for at least 1"
            )
        # Refusing what cannot fit alone is what makes preemption always end.
        self.check_fits(rid, n, seq.max_tokens)
        if rid in self._live:
            raise StrataError(
                f"request id {rid!r} is already waiting or running; give each request its own id"
            )
        seq.arrival = next(self._arrivals)
        seq.status = SeqStatus.WAITING
        seq.finish_reason = None
        seq.num_computed_tokens = 0
        seq.block_ids = []
        self._live[rid] = seq
        self.waiting.append(seq)

    def check_fits(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt and ``max_tokens`` (capped by the context: the engine
        finishes it there) need more KV blocks than the whole pool has, so it could not run even
        alone. Reads only fixed settings: safe from any thread.

        Raises:
            StrataError: the request cannot fit; the message says what to lower or re-plan.
        """
        check_kv_fits(
            request_id,
            prompt_tokens,
            max_tokens,
            self.max_model_len,
            self.pool.num_blocks,
            self.pool.block_size,
        )

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running sequence with reason ``"abort"``, freeing its blocks.

        Args:
            request_id: the sequence's id.

        Returns:
            The sequence, or None when no sequence of that id is waiting or running (unknown, or
            already finished).
        """
        seq = self._live.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the running list (or the waiting queue) and free its blocks.

        Its computed full blocks stay in the prefix cache. A no-op for a sequence that is not
        waiting or running in this scheduler (already finished).

        Args:
            seq: the sequence.
            reason: its ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, ``"error"``).
        """
        if self._live.get(seq.request_id) is not seq:
            return
        del self._live[seq.request_id]
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        """True while a sequence is waiting or running."""
        return bool(self.running or self.waiting)

    def _preempt(self, step: SchedulerStep) -> Sequence:
        """Preempt the latest-arrived running sequence (the last of ``running``) by recompute."""
        seq = self.running.pop()
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)
        return seq

    def _at_end(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds ``max_tokens`` outputs or fills the context: its last token
        (sampled, perhaps still ``PENDING``) is its last, and nothing more is computed for it.
        The engine finishes such a sequence before scheduling, except where a pipelined step's
        token is still on the device."""
        return len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """Draft tokens a decode of ``seq`` may verify this step: ``num_draft_tokens``, capped by
        the step's budget, the outputs ``max_tokens`` still allows after the pending token and
        the bonus, and the context; its blocks are allocated here, never by preempting (a draft
        is an optimisation: with a short pool it shrinks to the blocks the sequence has)."""
        room = min(
            self.num_draft_tokens,
            budget,
            seq.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return 0
        bs = self.pool.block_size
        extra = self._blocks_for(seq.num_computed_tokens + 1 + room) - len(seq.block_ids)
        if extra > 0:
            new = self.pool.allocate(extra)
            if new is None:
                return max(0, min(room, len(seq.block_ids) * bs - seq.num_computed_tokens - 1))
            seq.block_ids.extend(new)
        return room

    def schedule(self) -> SchedulerStep:
        """The next step's chunks: running sequences first, then admissions (see the module).

        Allocates the blocks each chunk writes; may preempt running sequences (listed in
        ``preempted``). Changes no ``num_computed_tokens`` of a scheduled sequence: ``update``
        does, once the step has run.

        Returns:
            The step; its ``chunks`` are empty when nothing can run.
        """
        step = SchedulerStep()
        budget = self.max_num_batched_tokens
        chunk_cap = self.prefill_chunk
        pool = self.pool
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._at_end(seq):  # its last token ends it: the engine finishes it once read
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, chunk_cap, budget)
            n = self._aligned(seq, seq.num_computed_tokens, n)
            if n <= 0:  # nothing to compute (no token sampled yet), or no aligned end in budget
                i += 1
                continue
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_ids)
            if need > 0:
                new = pool.allocate(need)
                while new is None:
                    # Victims come after seq (arrival order), so none was scheduled yet.
                    if self._preempt(step) is seq:
                        break
                    new = pool.allocate(need)
                if new is None:
                    break  # seq was the latest: nothing runs after it
                seq.block_ids.extend(new)
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, n)
            if self.num_draft_tokens and seq.num_tokens - seq.num_computed_tokens == 1:
                chunk.draft_room = self._draft_room(seq, budget - 1)
            step.chunks.append(chunk)
            budget -= n + chunk.draft_room
            i += 1

        if step.preempted:
            return step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # An admission always needs a new block (a prefix hit ends on a block boundary and
            # at least one token is computed): skip the prefix lookup when none is free.
            if pool.num_free_blocks() == 0:
                break
            seq = self.waiting[0]
            ids = seq.all_ids
            counters = pool.prefix_query_tokens, pool.prefix_hit_tokens
            matched = pool.match_prefix(ids, len(ids) - 1)  # the last token always runs
            # Aligned chunks (batch invariance) start on block boundaries: no partial blocks.
            lendable = self.lend_partial_blocks and not self.chunk_align
            lent = pool.match_partial(ids, matched, len(ids) - 1) if lendable else None
            got = self._admission_blocks(seq, matched, lent, budget)
            if got is None and lent is not None:
                # The lent block may be the free block the admission needs (a cached block on
                # the free list is also what allocate hands out): admit without it.
                pool.free([lent[0]])
                pool.prefix_hit_tokens -= lent[1]
                lent = None
                got = self._admission_blocks(seq, matched, None, budget)
            if got is None:
                # FCFS: wait for blocks (or for budget to reach an aligned end) rather than let a
                # later sequence skip ahead. The lookup is repeated next step, so it is not
                # counted now.
                pool.free(matched)
                pool.prefix_query_tokens, pool.prefix_hit_tokens = counters
                break
            new, computed, n = got
            self.waiting.popleft()
            seq.block_ids = matched + new
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = min(computed, len(seq.prompt_ids))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)  # still in arrival order (see the module docstring)
            chunk = ScheduledChunk(seq, computed, n)
            if lent:
                # new[0] holds the lent positions; the lent block's reference moves to the copy.
                chunk.lent = LentSlots(len(matched) * pool.block_size, lent[0], new[0], lent[1])
                self._copies.append(chunk.lent)
            step.chunks.append(chunk)
            budget -= n
        return step

    def _admission_blocks(
        self, seq: Sequence, matched: list[int], lent: tuple[int, int] | None, budget: int
    ) -> tuple[list[int], int, int] | None:
        """``(new blocks, computed tokens, first chunk's tokens)`` of an admission after
        ``matched`` (and ``lent`` tokens), the blocks allocated; None when the chunk is empty
        (aligned away) or the pool is short."""
        computed = len(matched) * self.pool.block_size + (lent[1] if lent else 0)
        n = self._aligned(seq, computed, min(seq.num_tokens - computed, self.prefill_chunk, budget))
        new = self.pool.allocate(self._blocks_for(computed + n) - len(matched)) if n > 0 else None
        return None if new is None else (new, computed, n)

    def take_copies(self) -> list[LentSlots]:
        """The lent slots of the steps scheduled since the last call, for the engine to copy
        into their sequences' own blocks once their pass is built (before the next step's): then
        ``release_copies``. Until then each holds a reference to its lent block."""
        copies, self._copies = self._copies, []
        return copies

    def release_copies(self, copies: list[LentSlots]) -> None:
        """Release the lent blocks of ``copies`` (their slots are copied, or the copy is moot)."""
        self.pool.free([c.src for c in copies])

    def update(self, step: SchedulerStep, sampled: dict[str, int | list[int]]) -> None:
        """Record that ``step`` ran: advance computed tokens, append samples, cache full blocks.

        A verification chunk (one with a ``draft``) advances by its pending token and the
        accepted drafts only: the rejected drafts' KV slots lie past ``num_computed_tokens``,
        where the next step overwrites them (the rollback). Chunks of sequences finished,
        aborted or preempted since ``schedule`` are skipped.

        Args:
            step: the step ``schedule`` returned, after the model ran it.
            sampled: request id -> the token sampled for each chunk with ``sample``; for a chunk
                with a draft, the accepted drafts then one more token (``Sampler.verify``).

        Raises:
            KeyError: a chunk with ``sample`` has no token in ``sampled``.
            StrataError: more tokens than the draft could yield (a verification bug).
        """
        bs, caching = self.pool.block_size, self.pool.prefix_caching
        for chunk in step.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING or seq.num_computed_tokens != chunk.start:
                continue
            before = seq.num_computed_tokens
            computed = chunk.num_tokens
            if chunk.sample:
                got = sampled[seq.request_id]
                tokens = [got] if isinstance(got, int) else list(got)
                if not 1 <= len(tokens) <= len(chunk.draft) + 1:
                    raise StrataError(
                        f"{len(tokens)} tokens for a chunk verifying {len(chunk.draft)} drafts "
                        f"of {seq.request_id}; this is a bug in verification"
                    )
                computed -= len(chunk.draft) - (len(tokens) - 1)  # rejected drafts roll back
                seq.output_ids.extend(tokens)
            seq.num_computed_tokens = after = before + computed
            if caching and after // bs != before // bs:  # a block filled: offer it to the cache
                self.pool.commit(seq.all_ids, seq.block_ids, after)
