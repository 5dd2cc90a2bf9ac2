"""Serving many requests from one plan: continuous batching over the paged KV cache.

:class:`ServingEngine` owns one engine thread that does all MLX work. Each step it asks the
scheduler (``executor.scheduler``: vLLM-style, one token budget shared by prefill chunks and
decodes, the plan's ``batch`` limits) which sequences advance by how many tokens, hands the step
to its model runner (``executor.runner.ModelRunner.execute``: one batched forward pass over
``executor.paged_kv``, in which every unit, streamed ones included, is read once for the whole
batch; then one token sampled for each sequence whose chunk reached its last known token), and
reports the tokens through each request's ``on_event`` callback. This module keeps the requests,
the scheduler, the drafter and the events; the runner keeps the KV pool and the passes.
Requests, aborts and prefix-cache resets arrive from other threads through a queue and are
applied between steps, so the scheduler and the KV block pool are only ever touched by the
engine thread.

Speculative decoding (the plan's ``speculative`` section, or a drafter given): the scheduler
reserves budget and KV blocks for up to K draft tokens after each decode's pending token; before
the forward pass the drafter (``executor.drafters``, ``executor.self_drafter``) proposes them, the
chunk becomes the pending token plus its draft, the one batched pass gives logits for every
position, and ``Sampler.verify`` keeps the accepted drafts plus one token (greedy: exactly greedy
decoding's tokens; sampling: the target's distribution). ``Scheduler.update`` advances the
sequence past the accepted tokens only, which rolls the rejected drafts' KV back. Counters:
draft tokens verified and accepted, verifications (``spec_stats``), counted once a draft's
sampling succeeded (a failed step or request verifies nothing).

Batch invariance (``batch_invariant=True``, ``strata serve --batch-invariant``): greedy outputs
are meant to be identical for a request run alone or in any batch, and with or without a
prefix-cache hit, also where MLX's kernels round a row differently with the shape of the call
(its CUDA backend; tested bit for bit on the CPU only, whose kernels are batch-invariant
anyway). Every kernel call that computes a token has the same shape whatever else the step
holds: the engine thread computes every weight product in tiles of ``BATCH_INVARIANT_ROWS`` rows
(``executor.ops.set_row_tile``, padding with zero rows); each sequence's tokens attend in pieces
cut at multiples of the KV block size, decodes included, each piece on its own
(``ForwardBatch.build(..., tile=block_size)``, no padded decode group); and the scheduler ends
every chunk that is not a prompt's last on a multiple of the block size
(``Scheduler(chunk_align=block_size)``), where prefix-cache hits end too. Costs: a step of fewer
than 16 rows (a lone decode) computes 16, and attention runs one call per piece instead of one
for all decodes. Limits: a preempted sequence's tokens that are recomputed (outputs included) are
computed as prefill pieces, not as the decodes that first computed them, so a preempted request
may differ (as may a prefix hit on blocks holding another request's generated tokens).
Speculative decoding works in this mode: a verification's tokens attend one per piece
(``SeqInput.one_per_piece``), each as the decode of that token would, and their weight products
are rows of the same tiles, so every accepted token is the one plain decoding computes.
Teacher-forced logits (``Engine.logits_for``), on any other thread, are unaffected (the row
tile is per thread).

Finishing: an end-of-generation token (kept, finish reason ``stop``) unless ``ignore_eos``;
``max_tokens`` or the plan's context (``length``); ``abort``; ``error`` when a step fails (every
sequence of that step is finished with the message; the thread keeps serving the others).
A finished or aborted sequence's KV blocks go back to the pool at once; its full blocks stay in
the prefix cache until evicted, or until ``reset_prefix_cache`` (refused while any request runs
or waits, as in vLLM) forgets them all.

Pipelined steps (``RuntimeConfig.pipelined_steps``, on by default). Where every live request samples
greedily on the device (temperature 0, no logit adjustments: ``runner.greedy``), no drafter runs, no
unit or expert streams from NVMe and the embedding table is on the device tier, a step is launched
(``ModelRunner.launch``: its pass and argmax built and handed to ``mx.async_eval``) before the step
before it is read, as mlx-lm's ``generate_step`` overlaps with ``mx.async_eval`` and vLLM schedules
asynchronously: the host builds step N+1 while the device computes step N. A launched step advances
its sequences at once (``Scheduler.update``) with a ``PENDING`` token for each sampled one; the next
step's chunk for that sequence takes the token from the device (``ForwardBatch.take_ids``), and the
host reads it when that next step has been launched (``_land``), writes it over the ``PENDING``, and
then cuts at an end-of-generation token, emits and finishes as an unpipelined step does. A sequence
that turns out to have stopped was computed once more in the step launched meanwhile; its blocks are
freed when its stop is read, and that step's result for it is dropped (stream order puts its KV
writes before any later use of the blocks). A sequence at ``max_tokens`` or the context is never
scheduled again, so nothing is computed past what the request may hold. Greedy outputs are those of
unpipelined steps (``tests/executor/test_pipelined_steps.py``); a request that needs its tokens on
the host first (sampling, a drafter) turns pipelining off while it runs, the step in flight read
first. ``STRATA_PIPELINED_STEPS=0`` turns it off; ``/metrics`` counts pipelined steps.

Stopping promptly (Ctrl-C). MLX cannot interrupt an evaluation, so the engine bounds the work
between two points where it can stop: on the CPU a prefill chunk is at most
``CPU_PREFILL_CHUNK`` tokens (whatever the plan's ``prefill_chunk``), and a pass of many rows is
evaluated one block at a time (``executor.runner.forward_in_pieces``), the engine asking between
blocks whether to stop. It stops the pass once :meth:`ServingEngine.close` was called, or once
every request of the step is being aborted (:meth:`ServingEngine.abort`; not where units stream
from NVMe, whose read order a half pass would break: there an abort waits for the step's end);
the stopped step computes nothing that counts (``executor.runner.PassInterrupted``) and the
abort or stop queued behind it is applied at once. So ``close`` and ``abort`` take effect within
one block of one chunk, a fraction of a second on the CPU for the catalog's small models, rather
than after the whole prefill.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.common.schemas import Plan
from strata.executor.block_pool import BlockPool
from strata.executor.drafters import Drafter, DraftInput, DraftModelDrafter, PromptLookupDrafter
from strata.executor.engine import Engine, check_prompt_ids
from strata.executor.grammar import Constraint, vocabulary
from strata.executor.ops import set_row_tile
from strata.executor.paged_kv import PagedKVCache, slot_table
from strata.executor.plan_loader import load_draft
from strata.executor.runner import (
    LaunchedStep,
    ModelRunner,
    PassInterrupted,
    StepOutput,
    TokenLogprob,
    greedy,
)
from strata.executor.sampling import Sampler, SamplingParams
from strata.executor.scheduler import (
    PENDING,
    Scheduler,
    SchedulerStep,
    Sequence,
    check_kv_fits,
)
from strata.executor.self_drafter import SelfDrafter, streamed_units

THREAD_CHECK_S = 1.0
"""Seconds between checks that the engine thread is alive while a caller waits on it."""

STOP_WAIT_S = 5.0
"""Seconds ``strata run`` waits for the engine thread after Ctrl-C (``ServingEngine.close``'s
``timeout``) before it exits without it: a pass stops within one block, so this is only reached
where the thread waits on something else (a slow disk read)."""

CPU_PREFILL_CHUNK = 64
"""Most tokens of a prefill chunk on the CPU, where the plan's ``prefill_chunk`` is larger
(``ServingEngine.prefill_chunk`` is the one in force). One block of a pass is the smallest piece
MLX evaluates without a stop (module docstring), and on the CPU its time grows with the chunk's
rows: a 512-token chunk kept a stop waiting for seconds, 64 tokens keep it well under one. The
CPU's weight products cost in proportion to their rows, so smaller chunks cost about the same
in all (measured: docs/benchmarks.md, "First token"), the output head being skipped for a chunk
that samples nothing (``executor.runner.forward_in_pieces``). Prompts of at most 64 tokens are one
chunk, as before; a longer one's logits move within rounding (chunked attention sums in another
order)."""

STALL_WAIT_S = 0.01
"""Seconds the engine thread waits for a message after a step that could schedule nothing,
before it tries again (instead of a busy loop)."""

BATCH_INVARIANT_ROWS = 16
"""Row tile of every weight product in batch-invariant serving (``executor.ops.set_row_tile``):
a step's rows are computed 16 at a time, the last tile padded. On a GPU's 4-bit kernel 16 rows
cost about one, and they cover a decode batch of the plans' usual 16 sequences in one call; on
the CPU a row costs in proportion (docs/kernels.md#batch-invariance)."""


MAX_LOGPROBS = 20
"""Most alternatives per generated token a request may ask log-probabilities of (vLLM's default
``max_logprobs``; OpenAI's chat API allows 20)."""


@dataclass
class GenerationRequest:
    """One request to the serving engine.

    Attributes:
        request_id: unique among live requests.
        prompt_ids: the prompt's token ids.
        max_tokens: most tokens to generate (>= 1).
        params: sampling parameters (temperature 0 = greedy; a seeded generator per request).
        ignore_eos: keep generating past end-of-generation tokens (benchmarks).
        logprobs: None, or the log-probability of each generated token and of its ``logprobs``
            most likely alternatives (``0..MAX_LOGPROBS``) in the events.
        grammar: None, or an llguidance grammar (``executor.grammar``: a JSON schema's, a forced
            tool call's) that every generated token must fit; it ends in an end-of-generation
            token once complete.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None


def check_request(req: GenerationRequest, plan: Plan, vocab_size: int) -> None:
    """Refuse a request that could never run on ``plan`` (:meth:`ServingEngine.validate`'s rule,
    without an engine: ``strata run`` checks its request with it before the weights load).

    Args:
        req: the request.
        plan: the plan it would run on (its context, KV blocks and block size).
        vocab_size: the model's vocabulary size (tokens).

    Raises:
        StrataError: empty prompt, ids outside the vocabulary, a prompt that leaves no room for a
            generated token in the plan's context, max_tokens < 1, logprobs outside
            ``0..MAX_LOGPROBS``, or a request that needs more KV blocks than the whole cache has.
    """
    context = plan.request.context
    check_prompt_ids(req.prompt_ids, vocab_size, context)
    if req.max_tokens < 1:
        raise StrataError(f"max_tokens is {req.max_tokens}; ask for at least 1 token")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise StrataError(
            f"logprobs is {req.logprobs}; ask for 0 to {MAX_LOGPROBS} alternatives per token"
        )
    b = plan.batch
    check_kv_fits(
        req.request_id,
        len(req.prompt_ids),
        req.max_tokens,
        context,
        b.kv_num_blocks,
        b.kv_block_size,
    )


@dataclass
class TokenEvent:
    """New tokens of a request, or its end.

    Attributes:
        request_id: the request.
        token_ids: tokens generated since the last event (an end-of-generation token included).
        finish_reason: None while running; ``stop``, ``length``, ``abort`` or ``error``.
        prompt_tokens, completion_tokens: token counts so far.
        cached_tokens: prompt tokens served by the prefix cache.
        error: the message, for ``error``.
        logprobs: one per token of ``token_ids`` when the request asked for them, else None.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Live:
    req: GenerationRequest
    seq: Sequence
    sampler: Sampler
    on_event: Callable[[TokenEvent], None]

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token whose log-probabilities the request asks (None: none)."""
        return self.req.logprobs


class ServingEngine:
    """Continuous batching of many requests over one loaded plan (module docstring).

    Args:
        engine: a loaded plan made runnable (``executor.engine.Engine``); its weights, streaming
            pool and expert cache serve every request.
        drafter: speculative decoding's drafter (None: the plan's, when ``speculative``).
        num_draft_tokens: draft tokens per decode with ``drafter``.
        speculative: take the plan's ``speculative`` section when no drafter is given.
        batch_invariant: greedy outputs identical alone and in any batch, with or without a
            prefix hit (module docstring: how, what it costs, its limits).

    Raises:
        StrataError: the plan's ``prefill_chunk`` or ``max_num_batched_tokens`` below its KV
            block size with ``batch_invariant``.

    Attributes:
        tokenizer: the model's tokenizer.
        context: the plan's context (prompt + output tokens per sequence).
        batch: the plan's batch limits, which the scheduler enforces.
    """

    def __init__(
        self,
        engine: Engine,
        drafter: Drafter | None = None,
        num_draft_tokens: int = 0,
        speculative: bool = True,
        batch_invariant: bool = False,
    ):
        self.engine = engine
        # A failed request's error on stderr (the server's log); the commands that wait on their
        # request themselves (run, chat, bench: ``generate``) say it once, and turn this off.
        self.log_failures = True
        self.config = engine.config  # the runtime settings (executor.config), the engine's
        self.batch_invariant = batch_invariant
        self._draft_engine: Engine | None = None
        if drafter is None and speculative:
            drafter, num_draft_tokens = self._plan_drafter()
        try:
            self._setup(drafter, num_draft_tokens)
        except BaseException:
            if self._draft_engine is not None:  # the draft model's I/O threads, loaded above
                self._draft_engine.close()
            raise

    def _setup(self, drafter: Drafter | None, num_draft_tokens: int) -> None:
        """The rest of ``__init__``: a failure here closes the draft model loaded before it."""
        engine, batch_invariant = self.engine, self.batch_invariant
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        plan = engine.loaded.plan
        self.batch = b = plan.batch
        self.tokenizer = engine.tokenizer
        self.context = engine.context
        self.vocab_size = engine.loaded.desc.architecture.vocab_size
        self.pool = BlockPool(b.kv_num_blocks, b.kv_block_size)
        # Batch invariance: attention pieces and chunk ends on KV block boundaries, where
        # prefix-cache hits end too.
        self._tile = b.kv_block_size if batch_invariant else 0
        # On the CPU a chunk's block of work is kept short enough to stop promptly (module
        # docstring); an aligned chunk still holds at least one tile.
        self.prefill_chunk = b.prefill_chunk
        if mx.default_device() == mx.cpu:
            self.prefill_chunk = min(b.prefill_chunk, max(CPU_PREFILL_CHUNK, self._tile))
        # The forward passes; its KV pool is made on the engine thread (MLX streams belong to
        # the thread that made them).
        self.runner = ModelRunner(engine.model, self.config, self._tile)
        self.scheduler = Scheduler(
            self.pool,
            b.max_num_seqs,
            b.max_num_batched_tokens,
            self.prefill_chunk,
            self.context,
            self.num_draft_tokens,
            chunk_align=self._tile,
            lend_partial_blocks=self.config.lend_partial_blocks,
        )
        self._eog = set(self.tokenizer.eog_ids)
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()  # set once the thread serves (after any warm-up)
        self._stopping = threading.Event()  # set by close(): a warm-up or a pass stops early
        # Requests abort() was called for whose message the engine thread has not applied yet:
        # a pass of only these stops early (module docstring). Added to by any thread, removed
        # by the engine thread (each a single set operation: atomic under the GIL).
        self._aborting: set[str] = set()
        self._streams = engine.store.pool is not None  # units stream from NVMe
        self._warm_s, self._start_error = 0.0, None  # the engine thread's start, for start()
        self.steps = self.batched_tokens = 0
        self.pipelined_steps = 0  # steps launched while the step before was still computing
        # Pipelined steps (module docstring): the step launched and not yet read, and whether
        # this engine may pipeline at all (its requests decide step by step).
        self._inflight: LaunchedStep | None = None
        # The embedding looks up device ids only where its table is on the device tier.
        embed_tier = engine.store.tier("token_embd")
        # Not where units stream from NVMe (the pool's or the expert cache's reads, issued per
        # pass in order and counted per request, would run for a step that may be discarded).
        self._may_pipeline = (
            self.config.pipelined_steps
            and drafter is None
            and not self._streams
            and engine.store.experts_cache is None
            and embed_tier == "gpu"
        )
        # Speculative decoding: draft tokens verified and accepted, verification chunks.
        self.spec_proposed = self.spec_accepted = self.spec_verifications = 0

    def _plan_drafter(self) -> tuple[Drafter | None, int]:
        """The drafter and draft tokens of the plan's ``speculative`` section (none: off)."""
        loaded = self.engine.loaded
        spec = loaded.plan.speculative
        if spec.method == "none" or spec.num_draft_tokens == 0:
            return None, 0
        if spec.method == "prompt_lookup":
            return PromptLookupDrafter(), spec.num_draft_tokens
        if spec.method == "self":
            model = self.engine.model
            skip = streamed_units(model.store, spec.draft_layers, model.arch.expert_count)
            drafter = SelfDrafter(model, lambda: self.kv, spec.draft_layers, skip)
            return drafter, spec.num_draft_tokens
        self._draft_engine = Engine(load_draft(loaded), config=self.engine.config)
        b = loaded.plan.batch
        drafter = DraftModelDrafter(
            self._draft_engine, b.kv_num_blocks, b.kv_block_size, target=self.engine
        )
        return drafter, spec.num_draft_tokens

    # ------------------------------------------------------------------ any thread

    def start(self, warm_up: bool | None = None) -> float:
        """Start the engine thread (idempotent). With ``warm_up`` (None: the runtime config's
        ``warm_up_row_buckets``)
        it first runs one forward pass per row bucket (``ModelRunner.warm_up``), and this call waits
        for it.

        Returns:
            seconds the warm-up took (0.0 without one, or when already started).

        Raises:
            StrataError: the engine thread failed to set up or a warm-up forward pass failed
                (the thread is stopped).
        """
        if self._thread is not None:
            return 0.0
        warm = self.config.warm_up_row_buckets if warm_up is None else warm_up
        self._thread = threading.Thread(
            target=self._run, args=(warm,), name="strata-engine", daemon=True
        )
        self._thread.start()
        while not self._ready.wait(THREAD_CHECK_S):
            if not self._thread.is_alive():
                break
        if self._start_error is not None or not self._ready.is_set():
            self._thread.join()
            raise StrataError(f"the serving engine could not start: {self._start_error}")
        return self._warm_s

    def validate(self, req: GenerationRequest) -> None:
        """Refuse a request that could never run.

        Raises:
            StrataError: empty prompt, ids outside the vocabulary, a prompt that leaves no room
                for a generated token in the plan's context, max_tokens < 1, or a request that
                needs more KV blocks than the whole cache has.
        """
        check_request(req, self.engine.loaded.plan, self.vocab_size)
        if req.grammar is not None:
            if req.ignore_eos:
                raise StrataError(
                    "ignore_eos cannot go with a grammar (response_format, tool_choice): a "
                    "complete answer ends in an end-of-generation token; leave ignore_eos out"
                )
            self._constraint(req.grammar)  # compiles (and keeps) it: its errors are the caller's

    def compile_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` against this model's vocabulary and keep it (``executor.grammar``'s
        prototypes), so that a request's :meth:`submit` only copies it: the HTTP layer calls
        this off its event loop.

        Raises:
            GrammarError: the grammar does not compile against this model's vocabulary.
        """
        self._constraint(grammar)

    def _constraint(self, grammar: str) -> Constraint:
        """A fresh grammar state for a request (``executor.grammar``).

        Raises:
            GrammarError: the grammar does not compile against this model's vocabulary.
        """
        return Constraint(vocabulary(self.tokenizer, self.vocab_size), grammar)

    def submit(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None]) -> None:
        """Queue a request; ``on_event`` is called on the engine thread with its tokens.

        Raises:
            StrataError: the request could never run (:meth:`validate`), or the engine stopped.
        """
        self.validate(req)
        if self._thread is None or not self._thread.is_alive():
            raise StrataError("the serving engine is not running")
        if self.failure is not None:
            raise StrataError(self.failure)
        self._inbox.put(("submit", req, on_event))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (no more events; unknown ids are ignored).

        Returns at once; the engine thread applies it between steps, and a step whose every
        request is being aborted stops within one block of its pass (module docstring), so the
        engine is free for the next request promptly (a Ctrl-C in ``strata chat``)."""
        # Marked before the message is queued: the engine thread unmarks it when it applies the
        # message, so it is never left marked (a step it stops meanwhile is stopped again until
        # the message arrives, microseconds later).
        self._aborting.add(request_id)
        self._inbox.put(("abort", request_id, None))

    @property
    def failure(self) -> str | None:
        """Why this engine can run no pass any more (a cluster plan's rank stopped:
        ``executor.pipeline``), or None."""
        pipeline = self.engine.pipeline
        return pipeline.failure if pipeline is not None else None

    def running(self) -> bool:
        """Whether the engine thread runs (started, not stopped): a caller waiting for a
        request's events checks it, since a stopped thread sends no more."""
        return self._thread is not None and self._thread.is_alive()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (``BlockPool.reset_prefix_cache``), as vLLM's
        ``reset_prefix_cache``: applied on the engine thread between steps; waits until it is.

        Returns:
            True once the cache is reset; False, with nothing changed, while any request is
            running or waiting.

        Raises:
            StrataError: the engine thread is not running (or stopped before applying it).
        """
        if threading.current_thread() is self._thread:  # an on_event callback: apply it now
            return self._reset_if_idle()
        done: Future[bool] = Future()
        if self._thread is None or not self._thread.is_alive():
            raise StrataError("the serving engine is not running")
        self._inbox.put(("reset", None, done))
        while True:
            try:
                return done.result(timeout=THREAD_CHECK_S)
            except TimeoutError:
                if not self._thread.is_alive() and not done.done():
                    raise StrataError("the serving engine stopped") from None

    def close(self, timeout: float | None = None) -> bool:
        """Abort what is left (events ``abort``), stop the thread and the engine's I/O.

        A pass in progress stops within one block (module docstring), a warm-up after its
        current pass. Safe to call again, e.g. after a ``timeout`` ran out.

        Args:
            timeout: seconds to wait for the engine thread, at most (None: until it ends).

        Returns:
            True once everything is stopped; False when the thread was still computing after
            ``timeout`` seconds (then the engine's I/O is left open for it: the process may
            exit, the thread is a daemon).
        """
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("stop", None, None))
            self._stopping.set()  # after the message: a stopped pass finds it queued
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self.engine.close()
        if self._draft_engine is not None:
            self._draft_engine.close()
        return True

    def metrics(self) -> dict:
        """A snapshot of the serving counters (read without locking: each value is one int)."""
        read = self.engine.store.counters()
        traces, replays = self.runner.graph_counters()
        pipeline = self.engine.pipeline  # a cluster plan's rank 0
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_in_use": self.pool.num_used_blocks(),
            "prefix_query_tokens": self.pool.prefix_query_tokens,
            "prefix_hit_tokens": self.pool.prefix_hit_tokens,
            "bytes_read": {t: int(read[t]) for t in ("gpu", "ram", "nvme")},
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.steps,
            "pipelined_steps": self.pipelined_steps,
            "cluster_passes_flowed": pipeline.flowed if pipeline is not None else 0,
            "cluster_passes_micro_batched": pipeline.micro_batched if pipeline is not None else 0,
            "batched_tokens": self.batched_tokens,
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_verification_steps": self.spec_verifications,
            "batch_invariant": int(self.batch_invariant),
            "compiled_pass_traces": traces,
            "compiled_pass_replays": replays,
        }

    def spec_stats(self) -> dict[str, float]:
        """Speculative decoding's figures: draft tokens proposed and accepted, the acceptance
        rate (accepted / proposed) and tokens per verification step (each verification of a
        sequence's non-empty draft yields its accepted drafts plus one token; a decode whose
        drafter proposed nothing is not a verification). A draft counts once verified: not
        where its step's forward pass or its request's sampling failed."""
        n, p, a = self.spec_verifications, self.spec_proposed, self.spec_accepted
        return {
            "proposed": p,
            "accepted": a,
            "acceptance_rate": round(a / p, 6) if p else 0.0,
            "tokens_per_verification_step": round((a + n) / n, 6) if n else 0.0,
        }

    # ------------------------------------------------------------------ engine thread

    def _run(self, warm_up: bool) -> None:
        try:
            self._serve(warm_up)
        finally:
            self._release()

    def _release(self) -> None:
        """Drop the drafter's and the runner's KV pools and compiled passes on this thread,
        which made them, however it ends (``pass_graph.release`` says why)."""
        closers = [self.runner.close] + ([self.drafter.close] if self.drafter else [])
        for close in closers:
            try:
                close()
            except Exception as e:  # the other must still be released
                print(f"error: releasing the engine thread's buffers: {e}", file=sys.stderr)

    def _serve(self, warm_up: bool) -> None:
        # MLX streams are thread-local (MLX >= 0.31.2): this thread computes on its own stream,
        # and the KV pool is made here so that its lazy arrays belong to it.
        try:
            mx.set_default_stream(mx.new_stream(mx.default_device()))
            # Per thread, like the stream: only this thread's products are tiled.
            set_row_tile(BATCH_INVARIANT_ROWS if self.batch_invariant else 0)
            b = self.batch
            self.runner.make_kv(b.kv_num_blocks, b.kv_block_size)
            if warm_up:
                t0 = time.perf_counter()
                # Its all-zero ids are not traffic: no routing recorded for a routing profile.
                with self.engine.store.routing_unrecorded():
                    self.runner.warm_up(
                        b.max_num_batched_tokens, b.max_num_seqs, self.context, self._stopping
                    )
                self._warm_s = time.perf_counter() - t0
        except Exception as e:  # reported by start()
            self._start_error = f"{type(e).__name__}: {e}"
            self._ready.set()
            return
        self._ready.set()
        if self._stopping.is_set():
            return
        stalled = False  # the last step could schedule nothing
        while True:
            idle = not self.scheduler.has_work() and self._inflight is None
            msgs = []
            try:
                # Sleep when there is no work; after a step that could schedule nothing (waiting
                # requests need blocks that only a finish or an abort frees), wait a little for
                # a message rather than spin, which would starve the server's event loop of
                # the GIL.
                wait = None if idle else STALL_WAIT_S if stalled else 0.0
                msgs.append(self._inbox.get(block=wait != 0.0, timeout=wait))
                while True:
                    msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for kind, arg, cb in msgs:
                if kind == "stop":
                    if self._inflight is not None:
                        self._land()  # its tokens are computed: emitted, as unpipelined
                    for rid in list(self._live):
                        self._finish(self._live[rid], "abort")
                    return
                if kind == "submit":
                    self._admit(arg, cb)
                elif kind == "abort":
                    self._aborting.discard(arg)
                    live = self._live.pop(arg, None)
                    if live is not None:
                        self.scheduler.abort(arg)
                        if self.drafter is not None:
                            self.drafter.release(arg)
                elif kind == "reset":
                    cb.set_result(self._reset_if_idle())
            if self.scheduler.has_work() or self._inflight is not None:
                stalled = not self.step()

    def _reset_if_idle(self) -> bool:
        if self._inflight is not None:
            self._land()  # its blocks were offered to the cache: the reset must come after
        if self.scheduler.has_work():
            return False
        self.pool.reset_prefix_cache()
        return True

    def _admit(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None]) -> None:
        seq = Sequence(req.request_id, list(req.prompt_ids), req.max_tokens)
        try:
            constraint = None if req.grammar is None else self._constraint(req.grammar)
        except StrataError as e:
            self._emit(_Live(req, seq, Sampler(req.params), on_event), [], "error", str(e))
            return
        live = _Live(req, seq, Sampler(req.params, constraint), on_event)
        if req.request_id in self._live:
            self._emit(live, [], "error", f"request id {req.request_id} is already running")
            return
        try:
            self.scheduler.add(seq)
        except StrataError as e:
            self._emit(live, [], "error", str(e))
            return
        self._live[req.request_id] = live

    def step(self) -> bool:
        """One scheduler step: drafts, a batched forward pass, sampling (or verification),
        events, then the copies of the KV slots lent by partial prefix-cache hits
        (``Scheduler.take_copies``: after the events, so a request's first token does not wait
        for them; before the next step, which may read or register those blocks). Where every
        live request samples greedily the step is pipelined (module docstring): launched, then
        the step before it read. Returns False when the scheduler had nothing to run."""
        if self._inflight is not None and not self._pipelining():
            self._land()  # a request needs this step's tokens on the host before the next
        step = self.scheduler.schedule()
        if not step.chunks:
            if self._inflight is None:
                return False
            self._land()
            return True
        try:
            if self._pipelining():
                return self._launch_step(step)
            return self._run_step(step)
        finally:
            self._copy_lent_slots()

    def _pipelining(self) -> bool:
        """Whether the next step may be launched before the last is read: the engine allows it
        (``_may_pipeline``) and every live request samples greedily on the device."""
        return self._may_pipeline and all(greedy(live) for live in self._live.values())

    def _launch_step(self, step: SchedulerStep) -> bool:
        """Launch ``step`` after the step in flight, then read that one (whose pass ran while
        this one was built) and record this one with ``PENDING`` tokens."""
        before = self._inflight
        try:
            launched = self.runner.launch(step, self._live, before, self._interrupter(step))
        except PassInterrupted:
            if before is not None:
                self._land()
            return True  # as in _run_step: nothing of this step counts
        except Exception as e:
            if before is not None:
                self._land()
            self._fail_step(step, e)
            return True
        self._inflight = launched
        if before is not None:
            self.pipelined_steps += 1
            self._land(before)
        # Its sequences advance now, each sampled token PENDING until read (skipped: those
        # that the step before ended, or that failed).
        self.scheduler.update(step, {rid: PENDING for rid in launched.rows})
        return True

    def _land(self, launched: LaunchedStep | None = None) -> None:
        """Read the tokens of a launched step (the one in flight unless given) and apply them:
        each ``PENDING`` token takes its value, then events and finishes as ``_run_step``'s. A
        step whose pass failed ends its sequences."""
        if launched is None:
            launched, self._inflight = self._inflight, None
        assert launched is not None
        try:
            out = self.runner.collect(launched)
        except Exception as e:
            # Its blocks were offered to the prefix cache at launch: none may be served now.
            self.pool.reset_prefix_cache()
            self._fail_step(launched.step, e)
            return
        if out.failed:
            self.pool.reset_prefix_cache()  # as above, for the failed requests' blocks
        # Only the sequences this step ran: a request finished, aborted or failed meanwhile
        # (its id perhaps reused by a new request since) has no use for its tokens.
        ran = {c.seq.request_id: c.seq for c in launched.step.chunks}
        for part in (out.sampled, out.failed, out.logprobs):
            for rid in [r for r in part if self._owner(r) is not ran.get(r)]:
                del part[rid]
        for rid, toks in list(out.sampled.items()):
            out_ids = self._live[rid].seq.output_ids
            if not out_ids or out_ids[-1] != PENDING:  # written at launch, read only here
                del out.sampled[rid]  # never expected: end the request, not the engine thread
                out.failed[rid] = "a token read from the device had no place (a serving bug)"
                continue
            del out_ids[-1]
            out_ids.extend(toks)  # in place of PENDING (greedy: exactly one, no draft)
        self._apply(launched.step, out, updated=True)

    def _owner(self, rid: str) -> Sequence | None:
        """The sequence of live request ``rid`` (None: none is live)."""
        live = self._live.get(rid)
        return None if live is None else live.seq

    def _fail_step(self, step: SchedulerStep, e: Exception) -> None:
        """End every live sequence of a step whose forward pass failed (never the thread); said
        on stderr where failures are logged (the server; ``run`` says its request's error)."""
        if self.log_failures:
            print(f"error: serving step failed: {e}", file=sys.stderr)
        for c in step.chunks:
            live = self._live.get(c.seq.request_id)
            if live is not None and live.seq is c.seq:  # not a new request of a reused id
                self._finish(live, "error", f"the forward pass failed: {e}")

    @property
    def kv(self) -> PagedKVCache | None:
        """The paged KV cache (the runner's; None until the engine thread has made it)."""
        return self.runner.kv

    def _copy_lent_slots(self) -> None:
        """Copy the slots lent to the step's admissions into their own blocks, then release the
        lent blocks (``executor.scheduler.LentSlots``).

        First the thread sleeps the config's ``lent_copy_yield_s``: the step's token events have
        woken the server's event loop, which needs the GIL to send them, and the copy's Python
        and MLX calls (about 130 operations for 32 layers, and a synchronization) would hold it
        for a millisecond or more (docs/kernels.md#host-costs-around-the-pass). A sleep lets a
        waiting thread take the GIL; ``time.sleep(0)`` gives it back before the other thread wakes.

        A copy that fails leaves the borrowers' blocks wrong: the prefix cache is forgotten
        (``reset_prefix_cache``) and each live sequence holding such a block ends with
        ``error``."""
        copies = self.scheduler.take_copies()
        if not copies:
            return
        time.sleep(self.config.lent_copy_yield_s)
        bs = self.pool.block_size
        src = np.concatenate([c.src * bs + np.arange(c.tokens) for c in copies])
        dst = np.concatenate([c.dst * bs + np.arange(c.tokens) for c in copies])
        try:
            self.runner.copy_slots(src, dst)
        except Exception as e:  # the blocks would hold wrong KV: no one may read them
            print(f"error: copying lent KV slots failed: {e}", file=sys.stderr)
            if self._inflight is not None:
                self._land()  # its tokens read the lent slots, not the copies: they stand
            self.pool.reset_prefix_cache()
            ruined = {c.dst for c in copies}
            for live in list(self._live.values()):
                if ruined.intersection(live.seq.block_ids):
                    self._finish(live, "error", f"copying its cached KV slots failed: {e}")
        finally:
            self.scheduler.release_copies(copies)

    def _interrupter(self, step: SchedulerStep) -> Callable[[], bool]:
        """What the step's pass asks between its blocks: stop, because the engine is closing,
        or because every request of the step is being aborted and no unit streams (module
        docstring)."""
        rids = [c.seq.request_id for c in step.chunks]
        stopping, aborting, streams = self._stopping, self._aborting, self._streams

        def interrupt() -> bool:
            if stopping.is_set():
                return True
            return not streams and all(r in aborting for r in rids)

        return interrupt

    def _run_step(self, step: SchedulerStep) -> bool:
        try:
            if self.drafter is not None:
                self._draft(step)
            out = self.runner.execute(step, self._live, self._interrupter(step))
        except PassInterrupted:
            # Its requests' abort, or the engine's stop, is queued: the loop applies it next.
            # Nothing was sampled and the scheduler was not advanced past the pass.
            return True
        except Exception as e:  # a failed step ends its sequences, never the thread
            self._fail_step(step, e)
            return True
        self._apply(step, out)
        return True

    def _apply(self, step: SchedulerStep, out: StepOutput, updated: bool = False) -> None:
        """A computed step's results: counters, failures, the scheduler advanced (unless
        ``updated``: a pipelined step advanced at launch, its tokens now written over their
        ``PENDING``), each sequence's new tokens cut at what ends it, events and finishes."""
        # Counted once verified: a failed step or request verifies nothing.
        self.spec_proposed += out.draft_proposed
        self.spec_accepted += out.draft_accepted
        self.spec_verifications += out.verifications
        sampled, logprobs = out.sampled, out.logprobs
        for rid, error in out.failed.items():  # before update, which then skips their chunks
            live = self._live.get(rid)
            if live is None:
                continue  # ended meanwhile (a pipelined step's)
            if self.log_failures:
                print(f"error: request {rid}: {error}", file=sys.stderr)
            self._finish(live, "error", error)
        self.steps += 1
        self.batched_tokens += step.num_tokens
        sampled = {rid: toks for rid, toks in sampled.items() if rid in self._live}
        finished = {
            rid: self._cut(self._live[rid], toks, len(toks) if updated else 0)
            for rid, toks in sampled.items()
        }
        if not updated:
            self.scheduler.update(step, sampled)
        for rid, toks in sampled.items():
            live = self._live[rid]
            if self.drafter is not None:
                self.drafter.accepted(rid, live.seq.num_computed_tokens)
            lps = logprobs.get(rid)
            if lps is not None:
                del lps[len(toks) :]  # the tokens _cut dropped
            if finished[rid] is None:
                self._emit(live, toks, None, logprobs=lps)
            else:
                self._finish(live, finished[rid], tokens=toks, logprobs=lps)

    def _cut(self, live: _Live, toks: list[int], appended: int = 0) -> str | None:
        """Cut ``toks`` (new tokens of one sequence, in place) at the first that ends it: an
        end-of-generation token (kept), ``max_tokens``, the context; the finish reason or
        None. ``appended``: how many of them the sequence holds already (a pipelined step's
        one token, written over its ``PENDING``: never cut, as nothing follows it)."""
        seq, req = live.seq, live.req
        have = len(seq.output_ids) - appended
        tokens = len(seq.prompt_ids) + have
        for i, tok in enumerate(toks):
            if tok in self._eog and not req.ignore_eos:
                del toks[i + 1 :]
                return "stop"
            if have + i + 1 >= req.max_tokens or tokens + i + 1 >= self.context:
                del toks[i + 1 :]
                return "length"
        return None

    def _draft(self, step: SchedulerStep) -> None:
        """Ask the drafter for the draft tokens of every decode with room to verify some."""
        want = [c for c in step.chunks if c.draft_room > 0]
        if not want:
            return
        bs = self.pool.block_size
        inputs = [
            DraftInput(
                c.seq.request_id,
                c.seq.all_ids,
                c.draft_room,
                start=c.start,
                slots=slot_table(c.seq.block_ids, bs, c.start + 1 + c.draft_room),
            )
            for c in want
        ]
        for c, draft in zip(want, self.drafter.propose(inputs), strict=True):
            c.set_draft(draft)  # counted once verified (_run_step): a failed step verifies none

    def _emit(
        self,
        live: _Live,
        tokens: list[int],
        reason: str | None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        seq = live.seq
        ev = TokenEvent(
            live.req.request_id,
            tokens,
            reason,
            len(seq.prompt_ids),
            len(seq.output_ids),
            seq.num_cached_tokens,
            error,
            logprobs,
        )
        try:
            live.on_event(ev)
        except Exception as e:  # a broken consumer must not stop the engine
            print(
                f"warning: request {live.req.request_id}: event handler failed: {e}",
                file=sys.stderr,
            )

    def _finish(
        self,
        live: _Live,
        reason: str,
        error: str | None = None,
        tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self._live.pop(live.req.request_id, None)
        out = live.seq.output_ids
        if out and out[-1] == PENDING:  # a pipelined step's token, never read: not generated
            out.pop()
        if self.drafter is not None:
            self.drafter.release(live.req.request_id)
        if reason in ("abort", "error"):
            self.scheduler.abort(live.req.request_id)  # running or waiting alike
        else:
            self.scheduler.finish(live.seq, reason)
        self._emit(live, tokens or [], reason, error, logprobs)
