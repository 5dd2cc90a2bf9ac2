"""The model runner: a scheduled batch turned into logits, and a serving step into tokens.

As vLLM v1's model runner is to its engine core, this module is to ``executor.serving``: the
serving engine keeps the requests, the scheduler and the events; the runner, given a scheduler
step, lays its chunks out over the paged KV cache (``executor.paged_kv``), writes their integer
inputs into kept buffers (``executor.host_inputs``), runs one forward pass (replayed from a
compiled graph where ``executor.pass_graph`` takes it, else eager: :func:`forward`), and samples
each finished chunk's next token, or verifies its speculative draft (``Sampler.verify``,
``accept_greedy``), with the log-probabilities a request asked for. It also warms the kernels
up before serving (:meth:`ModelRunner.warm_up`).

The model (``executor.models``) only computes a pass; whether that pass is replayed is decided
here, so the model never imports the graphs that trace it.

Interrupting a pass. MLX evaluates a graph without a way to stop it, so a pass given an
``interrupt`` callable (the serving engine's: it is closing, or every request of the step is
being aborted) is evaluated in pieces where it is long enough to matter (:func:`interruptible`),
the callable asked between pieces (:func:`forward_in_pieces`); once it answers True the pass raises
:class:`PassInterrupted` and leaves the rest of its blocks unbuilt. What it computed stays in the
KV slots of the step's sequences, which the scheduler has not advanced past them (``update``
never ran), so nothing reads those slots as computed and the prefix cache never holds them. On
the CPU a piece is one block, evaluated before the next is built; where the runtime config
schedules blocks ahead (``async_eval_blocks``: MLX's CUDA backend) a piece is that many blocks,
handed to ``mx.async_eval`` as the uninterrupted pass hands them, and the next is built while it
computes, so at most two pieces run after the callable turns True. Such a pass skips the output
head where its step samples nothing (a prefill chunk before the prompt's last), whose logits no
one reads. A model that streams units from NVMe is never left half way through a pass by an
abort (the stream's order would break): the serving engine's callable answers True for it only
when the engine closes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor import cuda_attention, pass_graph
from strata.executor.config import RuntimeConfig
from strata.executor.grammar import GRAMMAR_FAILED, Constraint, GrammarError, next_masks
from strata.executor.host_inputs import InputStaging
from strata.executor.models.llama import LlamaModel
from strata.executor.ops import bucket_rows
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput, SequenceCache, slot_table
from strata.executor.sampling import Sampler, accept_greedy
from strata.executor.scheduler import PENDING, ScheduledChunk, SchedulerStep

INTERRUPTIBLE_MIN_ROWS = 8
"""A pass given an ``interrupt`` callable is evaluated in pieces from this many rows on where
blocks are evaluated as they are built (the CPU; module docstring). A shorter one (a decode
step, a small batch of decodes) is one piece: its few rows end well within a second."""

INTERRUPTIBLE_MIN_ROWS_AHEAD = pass_graph.MAX_ROWS + 1
"""The same where the runtime config schedules blocks ahead (a GPU): only passes longer than
the compiled graphs take, whose time is the device's (prefill chunks); decode steps there take
milliseconds and keep their schedule untouched. A pass whose units stream from NVMe is in
pieces whatever its rows: each streamed unit is evaluated as it is released anyway."""


class PassInterrupted(Exception):
    """A forward pass stopped between two of its blocks because its ``interrupt`` callable said
    so (module docstring); the step it belonged to computed nothing that counts."""


def forward(
    model: LlamaModel,
    batch: ForwardBatch,
    kv: PagedKVCache,
    layers: int | None = None,
    skip: frozenset[str] = frozenset(),
    interrupt: Callable[[], bool] | None = None,
    head: bool = True,
) -> mx.array:
    """One forward pass of ``batch`` over ``kv``: replayed from a compiled graph where the
    model's config compiles passes and ``executor.pass_graph`` takes this one (every block, no
    unit skipped), else eager (``LlamaModel.forward_rows``), in pieces where it may be
    interrupted (:func:`forward_in_pieces`).

    Args:
        model: the model.
        batch: the tokens and their KV slots.
        kv: the paged KV cache.
        layers, skip: the self-drafter's early exit and layer skip (``LlamaModel.forward_rows``);
            such a pass is always eager.
        interrupt: asked between the pieces of a pass long enough (:func:`interruptible`): True
            stops the pass (None: never asked; the pass is built whole).
        head: compute the output head; False (a pass evaluated in pieces, whose logits no one
            reads) returns the residual stream after the last block instead.

    Returns:
        float32 logits [S, vocab] of the batch's ``logit_rows``, in their order (unevaluated),
        or with ``head`` False where the pass ran in pieces, the residual stream.

    Raises:
        PassInterrupted: ``interrupt`` answered True between two blocks.
    """
    if model.pipeline is not None:  # a cluster plan's rank 0: eager, the other ranks relay
        if layers is not None or skip:
            raise StrataError("the self-drafter does not run on cluster plans")
        if interrupt is not None and interrupt():  # once sent, a pass runs on every rank
            raise PassInterrupted("the pass stopped before it started")
        return model.pipeline.forward(model, batch, kv, head)
    x = model.embed_pass(batch)
    if model.config.compiled_passes and layers is None and not skip:
        logits = pass_graph.replay(model, batch, kv, x, x.shape[1])
        if logits is not None:
            return logits
    if interrupt is not None and interruptible(model, batch.num_tokens):
        return forward_in_pieces(model, x, batch, kv, interrupt, layers, skip, head)
    return model.forward_rows(x, batch, kv, layers, skip)


def interruptible(model: LlamaModel, tokens: int) -> bool:
    """Whether a pass of ``tokens`` tokens given an ``interrupt`` callable runs in pieces
    (``INTERRUPTIBLE_MIN_ROWS``, ``INTERRUPTIBLE_MIN_ROWS_AHEAD``)."""
    if model.store.pool is not None:
        return True
    ahead = model.config.async_eval_blocks > 0
    return tokens >= (INTERRUPTIBLE_MIN_ROWS_AHEAD if ahead else INTERRUPTIBLE_MIN_ROWS)


def forward_in_pieces(
    model: LlamaModel,
    x: mx.array,
    batch: ForwardBatch,
    kv: PagedKVCache,
    interrupt: Callable[[], bool],
    layers: int | None = None,
    skip: frozenset[str] = frozenset(),
    head: bool = True,
) -> mx.array:
    """``LlamaModel.forward_rows`` of the embedded rows ``x`` in pieces, asking ``interrupt``
    between them (module docstring): the same operations on the same arrays as the pass built
    whole, so the same logits. A piece is one block, or where the runtime config schedules
    blocks ahead (``async_eval_blocks``) that many, each handed to ``mx.async_eval`` as the
    whole pass hands them, the wait being for the piece before it.

    Returns:
        the logits (unevaluated), or with ``head`` False (and no unit streamed) the residual
        stream after the last block.

    Raises:
        PassInterrupted: ``interrupt`` answered True; the blocks after it are not built.
    """
    end = model.arch.block_count if layers is None else layers
    rope = model.rope_factors()
    every = model.config.async_eval_blocks
    step = max(1, every)
    pending: mx.array | None = None
    for a in range(0, end, step):
        b = min(a + step, end)
        x = model.blocks(x, batch, kv, rope, a, b, skip)
        if every:  # this piece computes while the next one is built; wait for the one before
            mx.async_eval(x)
            if pending is not None:
                mx.eval(pending)
            pending = x
        else:
            mx.eval(x)
        if b < end and interrupt():
            raise PassInterrupted(f"the pass stopped after block {b - 1} of {end}")
    if head or model.store.pool is not None:  # a streamed head unit must still be taken
        return model.head(x, batch)
    return x


def forward_sequence(
    model: LlamaModel, ids: list[int], cache: SequenceCache, all_logits: bool = False
) -> mx.array:
    """Run ``ids`` (the next T tokens of one sequence) through ``model`` (:func:`forward`) and
    advance ``cache`` past them.

    Returns:
        float32 logits, [T, vocab] if ``all_logits`` else [1, vocab] for the last token.

    Raises:
        StrataError: the sequence would exceed the cache's ``max_tokens``.
    """
    seq = cache.next_input(ids, "all" if all_logits else "last")
    logits = forward(model, ForwardBatch.build([seq]), cache.kv)
    cache.advance(len(ids))
    return logits


@dataclass
class TokenLogprob:
    """The model's log-probabilities at one generated token: natural log, float, of the
    distribution of the raw logits (before temperature, top-k or top-p: what vLLM reports).

    Attributes:
        logprob: of the generated token.
        top: the most likely tokens, ``(token id, logprob)``, most likely first (ties by id).
    """

    logprob: float
    top: list[tuple[int, float]]


class SampledRequest(Protocol):
    """What the runner reads of a live request to sample its tokens."""

    @property
    def sampler(self) -> Sampler:
        """The request's sampler (its parameters, seeded generator and penalties)."""
        ...

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token whose log-probabilities it asks (None: none)."""
        ...


@dataclass
class StepOutput:
    """What one step computed (:meth:`ModelRunner.execute`).

    Attributes:
        sampled: by request id, the new tokens of each sequence whose chunk reached its last
            known token: one sampled token, or for a chunk with a draft the accepted drafts and
            one more.
        logprobs: by request id, the log-probabilities of those tokens, for the requests that
            asked for them.
        failed: by request id, the error of each request whose sampling failed (it has no
            tokens).
        draft_proposed, draft_accepted: draft tokens verified and accepted in this step.
        verifications: chunks with a non-empty draft that were verified.
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    draft_proposed: int = 0
    draft_accepted: int = 0
    verifications: int = 0

    def count_draft(self, draft: list[int], tokens: list[int]) -> None:
        """Count a verified chunk: ``tokens`` (the accepted drafts and one more) for ``draft``
        (an empty draft is a plain decode, not a verification)."""
        if draft:
            self.draft_proposed += len(draft)
            self.draft_accepted += len(tokens) - 1
            self.verifications += 1


def _record(
    out: StepOutput,
    c: ScheduledChunk,
    req: SampledRequest,
    choose: Callable[[], list[int]],
    rows_of: Callable[[int], np.ndarray],
) -> None:
    """Record chunk ``c``'s tokens in ``out``: ``choose()`` gives them, ``req``'s sampler
    observes them (its penalties count what was generated) and, where asked, their
    log-probabilities come from ``rows_of(n)``, the chunk's first n logit rows (token j was
    chosen from row j). A failure ends that request only, never the step's others."""
    rid = c.seq.request_id
    try:
        toks = out.sampled[rid] = choose()
        req.sampler.observe(toks)
        if req.logprobs is not None:
            out.logprobs[rid] = token_logprobs(rows_of(len(toks)), toks, req.logprobs)
    except Exception as e:
        out.sampled.pop(rid, None)
        out.logprobs.pop(rid, None)
        if isinstance(e, GrammarError):
            out.failed[rid] = f"{GRAMMAR_FAILED}{e}"
        else:
            out.failed[rid] = f"sampling failed: {type(e).__name__}: {e}"
        return
    out.count_draft(c.draft, toks)


def grammar_masks(
    chunks: list[ScheduledChunk], live: Mapping[str, SampledRequest]
) -> dict[str, list[np.ndarray] | GrammarError]:
    """By request id, the grammar masks the sampling ``chunks`` of constrained requests will
    pick under (``Constraint.masks_along`` their drafts; the plain decodes' together, on
    llguidance's threads: ``executor.grammar.next_masks``), or the error one raised. They depend
    only on the tokens taken so far, so :meth:`ModelRunner.execute` works them out while the
    device runs the pass rather than after it."""
    out: dict[str, list[np.ndarray] | GrammarError] = {}
    plain: list[tuple[str, Constraint]] = []
    for c in chunks:
        rid = c.seq.request_id
        constraint = live[rid].sampler.constraint
        if constraint is None:
            continue
        if not c.draft:
            plain.append((rid, constraint))
            continue
        try:
            out[rid] = constraint.masks_along(c.draft)
        except GrammarError as e:
            out[rid] = e
    for (rid, _), m in zip(plain, next_masks([k for _, k in plain]), strict=True):
        out[rid] = m if isinstance(m, GrammarError) else [m]
    return out


def _verify(
    sampler: Sampler,
    rows: np.ndarray,
    draft: list[int],
    masks: list[np.ndarray] | GrammarError | None,
) -> list[int]:
    """``sampler.verify`` under the masks :func:`grammar_masks` worked out (raising the error
    one of them raised, which ends that request)."""
    if isinstance(masks, GrammarError):
        raise masks
    if masks is None:
        return sampler.verify(rows, draft)
    return sampler.verify(rows, draft, masks)


def greedy(req: SampledRequest) -> bool:
    """Whether ``req``'s tokens are its logits' argmax, chosen on the device: temperature 0, no
    logit adjustments and no grammar (whose mask is computed on the host)."""
    p = req.sampler.params
    return p.temperature == 0 and not p.adjusts_logits and req.sampler.constraint is None


@dataclass
class LaunchedStep:
    """A step whose pass and greedy choices are queued on the device, not read yet
    (:meth:`ModelRunner.launch`).

    Attributes:
        step: the scheduler step.
        ids: int32 [S] on the device: each logit row's argmax, -1 where the row's logits are
            not finite; unevaluated until collected. A step that samples nothing: its logits.
        logits: the pass's float32 logits [S, vocab] (log-probabilities are read from them).
        rows: request id -> the ``[lo, hi)`` rows of ``ids`` of its sampling chunk.
        requests: request id -> the live request (its sampler observes the tokens).
    """

    step: SchedulerStep
    ids: mx.array
    logits: mx.array
    rows: dict[str, tuple[int, int]]
    requests: dict[str, SampledRequest]


class ModelRunner:
    """The forward passes of one serving engine, on its engine thread.

    Args:
        model: the target model.
        config: the runtime settings (``stage_inputs``: staged integer inputs).
        tile: the attention tile of batch-invariant serving (``ForwardBatch.build``; 0: none).

    Attributes:
        kv: the paged KV cache (:meth:`make_kv`, on the engine thread; None before).
        staging: the kept input buffers (made by the first pass that stages).
    """

    def __init__(self, model: LlamaModel, config: RuntimeConfig, tile: int = 0):
        self.model, self.config, self.tile = model, config, tile
        self.kv: PagedKVCache | None = None
        self.staging = InputStaging(mapped=config.mapped_inputs)

    def make_kv(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Make the KV pool: ``num_blocks`` blocks of ``block_size`` tokens. Call it on the
        thread that runs the passes (MLX streams belong to the thread that made them)."""
        self.kv = self.model.make_paged_cache(num_blocks, block_size)
        self.kv.keep_layers(*self.model.stage)
        return self.kv

    def close(self) -> None:
        """Finish the queued work and drop the KV pool and its compiled passes; call it on the
        thread that made them, before it ends (``pass_graph.release`` says why)."""
        if self.kv is not None:
            mx.synchronize()
            pass_graph.release(self.kv)
            self.kv = None
        self.staging.close()

    def run(
        self,
        inputs: list[SeqInput],
        interrupt: Callable[[], bool] | None = None,
        head: bool = True,
        feed: tuple[list[int], mx.array] | None = None,
    ) -> tuple[ForwardBatch, mx.array]:
        """One batched forward pass of ``inputs`` over the KV cache: its layout and its logits
        (unevaluated), its integer inputs staged where the config's ``stage_inputs`` says.
        ``interrupt`` and ``head``: as :func:`forward`'s. ``feed``: per input, the index in a
        device array of ids (the second item) of the token that replaces its last ``PENDING``
        one, or -1 (:meth:`launch`).

        Raises:
            PassInterrupted: ``interrupt`` stopped the pass (its staged buffer is given up).
        """
        staged = self.staging.begin() if self.config.stage_inputs else None
        batch = ForwardBatch.build(inputs, tile=self.tile, staged=staged)
        if feed is not None:
            src, tokens = feed
            # Input i's last row: each input's rows are contiguous and end at its last token.
            pending = np.flatnonzero(np.array(src) >= 0)
            if pending.size:
                last = np.zeros(len(inputs), dtype=np.int64)  # each input's last row
                np.maximum.at(last, batch.row_inputs, np.arange(batch.num_tokens))
                index = batch.to_device(np.array(src, dtype=np.int32)[pending])
                batch.take_ids(last[pending], tokens[index])
        logits = forward(self.model, batch, self.kv, interrupt=interrupt, head=head)
        if staged is not None:
            staged.fence(logits)  # the buffer is rewritten once these are computed
        return batch, logits

    def execute(
        self,
        step: SchedulerStep,
        live: Mapping[str, SampledRequest],
        interrupt: Callable[[], bool] | None = None,
    ) -> StepOutput:
        """Run the step's chunks as one forward pass and sample what it finished
        (:class:`StepOutput`). ``live``: the step's requests by id; ``interrupt``: asked between
        the pass's blocks (:func:`forward`).

        Greedy requests without logit adjustments or log-probabilities take one argmax on the
        device and one host transfer (:meth:`launch`, then :meth:`collect`); otherwise the
        logits come to the host and each request's sampler chooses (or verifies its draft).
        One request's sampling failing ends that request, not the step's others; a failed pass
        raises. A step that samples nothing skips the output head where the pass runs in pieces
        (no one reads its logits).

        A request whose logits hold NaN or infinity fails (``StepOutput.failed``, naming the
        step: :func:`non_finite_logits`) instead of sampling from them.

        Raises:
            PassInterrupted: ``interrupt`` stopped the pass; nothing was sampled.
        """
        want = [i for i, c in enumerate(step.chunks) if c.sample]
        if all(greedy(live[step.chunks[i].seq.request_id]) for i in want):
            return self.collect(self.launch(step, live, interrupt=interrupt))
        batch, logits = self.run(self._inputs(step), interrupt, head=bool(want))
        if want:
            mx.async_eval(logits)  # the device computes while the grammars' masks are worked out
        masks = grammar_masks([step.chunks[i] for i in want], live)
        out = StepOutput()
        first = np.cumsum([0, *batch.logit_counts])  # chunk i's rows: first[i]:first[i + 1]
        host = np.array(logits)  # all logits on the host: the samplers need them
        for i in want:
            c = step.chunks[i]
            rid = c.seq.request_id
            req = live[rid]
            rows = host[first[i] : first[i + 1]]
            if not np.isfinite(rows).all():
                out.failed[rid] = non_finite_logits(c)
                continue
            verify = functools.partial(_verify, req.sampler, rows, c.draft, masks.get(rid))
            _record(out, c, req, verify, lambda n, r=rows: r[:n])
        return out

    def launch(
        self,
        step: SchedulerStep,
        live: Mapping[str, SampledRequest],
        after: LaunchedStep | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> LaunchedStep:
        """Build the step's pass and its greedy choices and queue them on the device
        (``mx.async_eval``) without waiting: the tokens are read by :meth:`collect`. Every
        sampling chunk's request must sample greedily without logit adjustments
        (:func:`greedy`). ``after``: the step launched before this one and not collected yet
        (pipelined steps): a chunk whose last token is ``PENDING`` takes it from that step's
        device ids.

        A row's sum is finite only when every logit is (a NaN or an infinity carries into it):
        such a row's id is -1, in the same transfer. NaN logits would otherwise pick token 0
        forever. The sum costs about as much as the argmax's own reduction.

        Raises:
            PassInterrupted: ``interrupt`` stopped the pass; nothing was launched.
            StrataError: a chunk's ``PENDING`` token is not one ``after`` sampled (a bug).
        """
        inputs = self._inputs(step)
        want = [i for i, c in enumerate(step.chunks) if c.sample]
        feed = None
        if after is not None:
            feed = self._pending_rows(step, after)
        batch, logits = self.run(inputs, interrupt, head=bool(want), feed=feed)
        first = np.cumsum([0, *batch.logit_counts])
        rows = {step.chunks[i].seq.request_id: (int(first[i]), int(first[i + 1])) for i in want}
        if want:
            finite = mx.isfinite(mx.sum(logits, axis=-1))
            ids = mx.where(finite, mx.argmax(logits, axis=-1).astype(mx.int32), -1)
        else:
            ids = logits  # evaluated for its KV writes; nothing is read
        mx.async_eval(ids)
        return LaunchedStep(step, ids, logits, rows, {r: live[r] for r in rows})

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """The tokens of a launched step (:meth:`launch`): one host transfer, which waits for
        its pass (not for a step launched after it).

        Raises:
            whatever evaluating the pass raises (the step failed).
        """
        out = StepOutput()
        if not launched.rows:
            mx.eval(launched.ids)
            return out
        targets = np.array(launched.ids).tolist()  # one host transfer
        chunks = {c.seq.request_id: c for c in launched.step.chunks if c.sample}
        for rid, (lo, hi) in launched.rows.items():
            c, req = chunks[rid], launched.requests[rid]
            if min(targets[lo:hi]) < 0:
                out.failed[rid] = non_finite_logits(c)
                continue
            choose = functools.partial(accept_greedy, targets[lo:hi], c.draft)
            _record(out, c, req, choose, lambda n, lo=lo: np.array(launched.logits[lo : lo + n]))
        return out

    def _inputs(self, step: SchedulerStep) -> list[SeqInput]:
        """The step's chunks as forward-pass inputs over their sequences' KV slots."""
        bs = self.kv.block_size
        inputs = []
        for c in step.chunks:
            lent = (c.lent.position, c.lent.src, c.lent.tokens) if c.lent else None
            slots = slot_table(c.seq.block_ids, bs, c.start + c.num_tokens, lent)
            # Every input returns at least its last row's logits (the forward pass must produce
            # something to evaluate); only sampling chunks use them; verification needs all.
            wanted = "all" if c.draft else "last"
            inputs.append(SeqInput(c.ids, c.start, slots, wanted, one_per_piece=bool(c.draft)))
        return inputs

    @staticmethod
    def _pending_rows(step: SchedulerStep, after: LaunchedStep) -> tuple[list[int], mx.array]:
        """For each input of ``step`` whose last token is ``PENDING``: its index in ``after``'s
        device ids (-1 for the others), and those ids.

        Raises:
            StrataError: a ``PENDING`` token that ``after`` did not sample (a bug).
        """
        src = []
        for c in step.chunks:
            ids = c.ids
            if PENDING not in ids:
                src.append(-1)
                continue
            rid = c.seq.request_id
            if ids.index(PENDING) != len(ids) - 1 or rid not in after.rows:
                raise StrataError(
                    f"request {rid}: a token not yet read from the device is not its last, or "
                    "not the previous step's; this is a bug in pipelined scheduling"
                )
            src.append(after.rows[rid][1] - 1)
        return src, after.ids

    def warm_up(
        self, max_tokens: int, max_seqs: int, context: int, stop: threading.Event | None = None
    ) -> None:
        """Forward passes in every row bucket, laid out as serving lays them out (the
        batch-invariant tile included): passes of 1, 2, 4, ... tokens in every bucket of
        ``executor.ops.bucket_rows`` up to ``max_tokens`` (the plan's
        ``max_num_batched_tokens``; and the KV pool, and the ``context``), as prefill chunks of
        at most ``cuda_attention.MAX_QUERIES`` tokens (the attention kernel's, which builds
        nothing per key length and one split kernel per queries a block holds: chunks of 2, 4
        and 8 tokens and the decode groups meet each), then decode groups of 2, 4, ...
        sequences of different lengths up to ``max_seqs`` (the output head at those row
        counts). They write KV slots of free blocks only and touch neither the block pool nor
        the prefix cache. ``stop``, once set (the engine closing: Ctrl-C), skips the passes
        left.

        Raises:
            whatever a forward pass raises (the serving engine then fails to start).
        """
        limit = min(max_tokens, self.kv.num_slots, context)
        slots = np.arange(limit, dtype=np.int32)
        piece = cuda_attention.MAX_QUERIES

        def run(inputs: list[SeqInput]) -> None:
            if stop is None or not stop.is_set():
                mx.eval(self.run(inputs)[1])

        for n in warm_up_sizes(limit):  # chunk j: positions 0.. in slots from j * piece on
            run([SeqInput([0] * min(piece, n - j), 0, slots[j:n]) for j in range(0, n, piece)])
        for b in warm_up_sizes(min(max_seqs, limit - 1)):
            if b > 1:  # sequence i: one token at position i
                run([SeqInput([0], i, slots[: i + 1]) for i in range(b)])
        chunk = [SeqInput([0, 0], 0, slots[:2])]
        compiled = self.model.pipeline is None  # cluster plans run eager passes
        if (
            compiled
            and limit >= 2
            and pass_graph.compiles(self.model, ForwardBatch.build(chunk), self.kv)
        ):
            # One layout traced (seen COMPILE_AFTER times): the kernels mx.compile fuses are
            # built here, not in a request, whose first trace took seconds on a fresh GPU
            # (docs/kernels.md#compiled-passes).
            for _ in range(pass_graph.COMPILE_AFTER):
                run(chunk)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy every layer's keys and values of slots ``src`` into slots ``dst`` (int [N]
        each; ``PagedKVCache.copy_slots``) and schedule the pools' evaluation.

        Raises:
            whatever MLX raises: the ``dst`` slots may then hold wrong keys and values.
        """
        kv = self.kv
        if self.model.pipeline is not None:  # every rank's KV cache copies the same slots
            self.model.pipeline.copy_slots(src, dst)
        kv.copy_slots(mx.array(src.astype(np.int32)), mx.array(dst.astype(np.int32)))
        # Queued after the step's pass on the same stream (with a pipelined step in flight,
        # after it too): every KV array is one chain of updates.
        mx.async_eval(kv.keys + kv.values)

    def graph_counters(self) -> tuple[int, int]:
        """``(traces, replays)`` of the compiled passes over the KV cache so far."""
        return pass_graph.counters(self.kv)


def non_finite_logits(chunk: ScheduledChunk) -> str:
    """The error of a request whose logits are NaN or infinite: which step (prefill, or the
    decode step's number) and position, and what to check."""
    # Outputs known when the chunk was scheduled (its sequence may have advanced since).
    done = chunk.start + chunk.num_tokens - len(chunk.draft) - len(chunk.seq.prompt_ids)
    step = "the prompt's prefill" if done == 0 else f"decode step {done}"
    return (
        f"the model produced NaN or infinite logits at {step} (position "
        f"{chunk.start + chunk.num_tokens - 1}); its weights or hyperparameters are broken "
        "(a NaN weight, an extreme RoPE base or norm epsilon): re-download or re-convert the model"
    )


def warm_up_sizes(limit: int) -> list[int]:
    """Token counts whose passes meet every row bucket of ``executor.ops.bucket_rows`` up to
    ``limit`` rows: each bucket's size, the last capped at ``limit`` (36: 1, 2, 4, 8, 16, 24,
    32, 36; 600: 1, ..., 32, 64, 128, 256, 512, 600). Empty below 1."""
    out = []
    n = 1
    while n < limit:
        out.append(n)
        n = bucket_rows(n + 1)
    return out + [limit] if limit >= 1 else out


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens[j]`` under logits ``rows[j]`` and the ``top`` most likely
    tokens of each row.

    Args:
        rows: float logits ``[len(tokens), vocab]``.
        tokens: the token chosen from each row.
        top: alternatives per row (0 for none).

    Returns:
        one :class:`TokenLogprob` per token: log-softmax computed in float64.
    """
    x = rows.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    out = []
    for j, tok in enumerate(tokens):
        best: list[tuple[int, float]] = []
        if top:
            ids = np.argpartition(-lp[j], top - 1)[:top]
            ids = sorted(ids.tolist(), key=lambda t: (-lp[j, t], t))
            best = [(int(t), float(lp[j, t])) for t in ids]
        out.append(TokenLogprob(float(lp[j, tok]), best))
    return out
