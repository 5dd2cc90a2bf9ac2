"""One request through the serving engine, with its measured figures: ``strata run`` and
``strata bench``.

``run``, ``bench`` and ``serve`` share one engine (:class:`~strata.executor.serving.ServingEngine`:
its warm-up, kernels, paged KV cache, prefix cache and the plan's speculative decoding), so a
plan decodes at the same speed whichever command runs it. :func:`generate` submits one request,
streams its text to a callback on the caller's thread and measures what happened: time to the
first token (prefill) and after it (decode), bytes read per tier, I/O wait, host copies, expert
cache counters and speculative decoding's drafts, each as the difference of the engine's own
counters around the request. One request at a time: a request running beside it would be
counted in its figures.

Ctrl-C. A ``KeyboardInterrupt`` while :func:`generate` waits aborts the request
(``ServingEngine.abort``: its pass stops within one block) and is raised again as
:class:`GenerationInterrupted`, a ``KeyboardInterrupt`` that carries what was generated until
then, with figures that say so (``finish_reason`` ``interrupted``): ``strata run`` prints it and
exits with status 130, a caller that wants no partial result treats it as any Ctrl-C, and an
interactive caller (``strata chat``) keeps the partial reply and goes on with the same engine.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
from strata.common.errors import StrataError
from strata.executor.sampling import SamplingParams
from strata.executor.serving import THREAD_CHECK_S, GenerationRequest, ServingEngine, TokenEvent
from strata.executor.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from strata.executor.plan_loader import LoadedPlan, PeekedPlan
    from strata.executor.tokenizer import GGUFTokenizer

TIERS = ("gpu", "ram", "nvme")

_request_ids = itertools.count()
"""Numbers the requests of :func:`generate` (ids unique in this process)."""


@dataclass
class Generation:
    """The result of one request.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated ids, including a final end-of-generation token if one was produced.
        text: the generated text (special tokens dropped, as llama.cpp does).
        stats: the request's figures (:func:`generate`): ``prefill_tok_s``, ``decode_tok_s``,
            ``peak_rss_bytes``, ``peak_mlx_bytes``, ``bytes_read`` ({tier: bytes}), token and
            step counts, ``finish_reason``, ...
    """

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stats: dict = field(default_factory=dict)


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`generate`; the request was aborted.

    Its message says how far the request got (``strata.common.errors.run_command`` prints it
    after ``interrupted``).

    Attributes:
        generation: what was generated until then (the tokens the caller had received), its
            ``stats`` those of :func:`interrupted_stats`.
    """

    def __init__(self, generation: Generation):
        s = generation.stats
        super().__init__(
            f"after {s['output_tokens']} generated tokens, {s['elapsed_s']:.1f} s into the request"
        )
        self.generation = generation


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes.

    On Linux ``VmHWM`` (/proc/self/status), the high-water mark of this program's own memory:
    ``ru_maxrss`` carries over the RSS of the process that started it (exec keeps the larger of
    the two), so a run started from a big process, such as a test runner, would report that
    process's size. Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def expert_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Expert counters between two ``WeightStore.expert_counters`` readings, rates recomputed
    (hit rate over this span's uses, prefetch accuracy over its used + wasted prefetches)."""
    d = {
        k: after[k] - before.get(k, 0) for k in after if k not in ("hit_rate", "prefetch_accuracy")
    }
    if "hits" in d:
        uses = d["hits"] + d["misses"]
        d["hit_rate"] = round(d["hits"] / uses, 6) if uses else 0.0
        done = d["prefetch_used"] + d["prefetch_wasted"]
        d["prefetch_accuracy"] = round(d["prefetch_used"] / done, 6) if done else 0.0
        d["prefetch_pending"] = after["prefetch_pending"]
        d["io_wait_s"] = round(d["io_wait_s"], 6)
    rates = ("hit_rate", "prefetch_accuracy", "io_wait_s")
    return {k: v if k in rates else int(v) for k, v in d.items()}


@dataclass
class _Mark:
    """The engine's counters at one moment of a request (read on the thread that saw it)."""

    t: float
    read: dict[str, float]
    copy_s: float
    experts: dict[str, float]
    serving: dict

    @classmethod
    def now(cls, serving: ServingEngine) -> _Mark:
        store = serving.engine.store
        return cls(
            time.perf_counter(),
            store.counters(),
            store.copy_seconds,
            store.expert_counters(),
            serving.metrics(),
        )


def request_for(
    prompt_ids: list[int], params: SamplingParams, max_tokens: int, stop_at_eog: bool = True
) -> GenerationRequest:
    """The serving request :func:`generate` submits (a fresh id; ``max_tokens`` 0 asks for one
    token, which is not kept), so a caller can ``ServingEngine.validate`` it first.

    Raises:
        StrataError: a negative ``max_tokens``.
    """
    if max_tokens < 0:
        raise StrataError(f"--max-tokens {max_tokens} is negative")
    rid = f"generate-{next(_request_ids)}"
    return GenerationRequest(rid, list(prompt_ids), max(1, max_tokens), params, not stop_at_eog)


def generate(
    serving: ServingEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    max_tokens: int = 256,
    on_text: Callable[[str], None] | None = None,
    stop_at_eog: bool = True,
) -> Generation:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` as one request of ``serving``
    (started), and measure it.

    Generation stops at the GGUF's end-of-generation tokens (kept in ``output_ids``), at
    ``max_tokens``, or at the plan's context (``finish_reason`` ``stop``, ``length`` or
    ``context``). With ``max_tokens`` 0 the prompt is computed and its token dropped.

    Args:
        serving: a started serving engine with no other request running.
        prompt_ids: token ids of the prompt.
        params: sampling parameters (temperature 0 = greedy; seeded: the same tokens each run).
        max_tokens: most tokens to generate.
        on_text: called on this thread with each new piece of text as it is decoded (never a
            split UTF-8 character); an exception it raises (Ctrl-C) aborts the request.
        stop_at_eog: stop at an end-of-generation token (benchmarks run a fixed length).

    Returns:
        the request's ids, text and ``stats``: ``prompt_tokens``, ``cached_tokens`` (prompt
        tokens the prefix cache served), ``output_tokens``, ``finish_reason``, ``prefill_s``
        (submission to the first token) and ``prefill_tok_s`` (prompt tokens computed per
        second), ``decode_s`` (first to last token), ``decode_tokens`` (after the first),
        ``decode_tok_s``, ``prefill_steps`` and ``decode_steps`` (the engine's forward passes),
        ``peak_rss_bytes``, ``peak_mlx_bytes``, ``bytes_read`` and ``decode_bytes_read``
        ({tier: bytes}, each use of a unit counted once), ``io_wait_s``, ``decode_io_wait_s``,
        ``host_copy_s``, ``decode_host_copy_s``, ``read_method`` and ``read_method_detail``
        (how streamed units are read: ``WeightStore.read_method``); for a mixture-of-experts
        model ``experts`` and ``decode_experts`` (the expert cache's counters); with speculative
        decoding ``speculative`` (drafts proposed and accepted, verifications); on a cluster plan
        ``passes_flowed`` (passes sent through the ranks without waiting for them meanwhile:
        ``executor.pipeline``) and ``passes_micro_batched`` (passes that were one micro-batch
        of a cut decode step).

    Raises:
        StrataError: a negative ``max_tokens``; a prompt the plan can never run (empty, ids
            outside the vocabulary, no room in the context or the KV cache); a forward pass
            that failed (its message).
        GenerationInterrupted: Ctrl-C (a ``KeyboardInterrupt`` here, or raised by
            ``on_text``): the request is aborted and the exception carries the partial result.
    """
    req = request_for(prompt_ids, params, max_tokens, stop_at_eog)
    rid = req.request_id
    events: queue.SimpleQueue[tuple[TokenEvent, _Mark | None]] = queue.SimpleQueue()
    first: list[_Mark] = []

    def on_event(ev: TokenEvent) -> None:  # on the engine thread, between its steps
        mark = None
        try:
            if (ev.token_ids and not first) or ev.finish_reason is not None:
                mark = _Mark.now(serving)
                if ev.token_ids and not first:
                    first.append(mark)  # the prompt's counters, before any decode step
        finally:  # the event reaches the caller even if reading the counters failed
            events.put((ev, mark))

    mx.reset_peak_memory()
    start = _Mark.now(serving)
    serving.submit(req, on_event)
    stream = StreamDecoder(serving.tokenizer)
    out: list[int] = []
    cached, last_t = 0, start.t  # from the events received: prefix hits, the latest token's time
    try:
        while True:
            try:  # a timeout lets Ctrl-C in while the engine computes
                ev, end = events.get(timeout=THREAD_CHECK_S)
            except queue.Empty:
                if not serving.running():
                    raise StrataError("the serving engine stopped during the request") from None
                continue
            cached = ev.cached_tokens
            if ev.token_ids:
                last_t = time.perf_counter()
            if on_text is not None:
                kept = ev.token_ids[: max(0, max_tokens - len(out))]
                piece = "".join(stream.push(t) for t in kept)
                if piece:
                    on_text(piece)
            out.extend(ev.token_ids)
            if ev.finish_reason is not None:
                break
    except KeyboardInterrupt:  # Ctrl-C: the engine drops the request; the caller gets the part
        serving.abort(rid)
        del out[max_tokens:]
        stats = interrupted_stats(
            serving, start, first[0] if first else None, last_t, len(prompt_ids), cached, len(out)
        )
        text = serving.tokenizer.decode(out)
        raise GenerationInterrupted(Generation(list(prompt_ids), out, text, stats)) from None
    except BaseException:  # a failing callback: the engine drops the request
        serving.abort(rid)
        raise
    if ev.finish_reason == "error":
        raise StrataError(ev.error or "the request failed")
    if ev.finish_reason == "abort":
        raise StrataError("the request was aborted: the serving engine stopped")
    if on_text is not None:
        tail = stream.flush()
        if tail:
            on_text(tail)
    if end is None or not first:
        raise StrataError(f"the request ended ({ev.finish_reason}) without a token")
    del out[max_tokens:]  # max_tokens 0: the prompt's token is dropped
    finish = ev.finish_reason
    if finish == "length" and len(out) < max_tokens:
        finish = "context"  # the plan's context ended it, not max_tokens
    stats = _stats(start, first[0], end, len(prompt_ids), ev.cached_tokens, len(out), finish)
    stats.update(serving.engine.store.read_method())  # direct or buffered (None: none streams)
    if serving.engine.loaded.desc.architecture.expert_count:
        stats["experts"] = expert_delta(start.experts, end.experts)
        stats["decode_experts"] = expert_delta(first[0].experts, end.experts)
    if serving.engine.pipeline is not None:  # a cluster plan: its chunks that flowed
        for key in ("cluster_passes_flowed", "cluster_passes_micro_batched"):
            stats[key.replace("cluster_", "")] = end.serving[key] - start.serving[key]
    if serving.drafter is not None:
        stats["speculative"] = {
            k: end.serving[k] - start.serving[k]
            for k in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verification_steps")
        }
    return Generation(list(prompt_ids), out, serving.tokenizer.decode(out), stats)


def interrupted_stats(
    serving: ServingEngine,
    start: _Mark,
    first: _Mark | None,
    last_t: float,
    prompt: int,
    cached: int,
    output: int,
) -> dict:
    """The figures of a request Ctrl-C stopped (:class:`GenerationInterrupted`), honest about
    it: ``finish_reason`` ``interrupted``, ``interrupted`` True, ``elapsed_s`` (submission to the
    interrupt); ``prefill_s`` and ``prefill_tok_s`` only once the first token came (else None:
    the prefill did not finish); ``decode_s`` from the first to the latest token received,
    ``decode_tokens`` and ``decode_tok_s`` over those; counters (steps, bytes read, I/O wait,
    host copies) from submission to the interrupt, read on this thread while the engine drops
    the request (the step it stopped in is not counted in ``prefill_steps``/``decode_steps``).
    """
    now = _Mark.now(serving)
    stats = _stats(start, first or now, now, prompt, cached, output, "interrupted")
    stats.update(serving.engine.store.read_method())
    decoded = stats["decode_tokens"]
    decode_s = last_t - first.t if first is not None and decoded else 0.0
    stats.update(
        interrupted=True,
        elapsed_s=round(now.t - start.t, 6),
        decode_s=round(decode_s, 6),
        decode_tok_s=round(decoded / decode_s, 3) if decoded and decode_s > 0 else 0.0,
    )
    if first is None:  # the prefill did not finish
        stats.update(prefill_s=None, prefill_tok_s=None)
    return stats


def _stats(
    start: _Mark, first: _Mark, end: _Mark, prompt: int, cached: int, output: int, finish: str
) -> dict:
    """The figures of :func:`generate` from the counters at submission, first and last token."""
    prefill_s, decode_s = first.t - start.t, end.t - first.t
    computed = prompt - cached
    decoded = max(0, output - 1)

    def read(a: _Mark, b: _Mark) -> dict[str, int]:
        return {t: int(b.read[t] - a.read[t]) for t in TIERS}

    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "finish_reason": finish,
        "prefill_s": round(prefill_s, 6),
        "prefill_tok_s": round(computed / prefill_s, 3) if prefill_s > 0 else 0.0,
        "decode_s": round(decode_s, 6),
        "decode_tokens": decoded,
        "decode_tok_s": round(decoded / decode_s, 3) if decoded and decode_s > 0 else 0.0,
        "prefill_steps": first.serving["steps"] - start.serving["steps"],
        "decode_steps": end.serving["steps"] - first.serving["steps"],
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_mlx_bytes": int(mx.get_peak_memory()),
        "bytes_read": read(start, end),
        "decode_bytes_read": read(first, end),
        "io_wait_s": round(end.read["io_wait_s"] - start.read["io_wait_s"], 6),
        "decode_io_wait_s": round(end.read["io_wait_s"] - first.read["io_wait_s"], 6),
        "host_copy_s": round(end.copy_s - start.copy_s, 6),
        "decode_host_copy_s": round(end.copy_s - first.copy_s, 6),
    }


@dataclass
class Started:
    """A plan's engine, loaded and started (:func:`started_engine`).

    Attributes:
        loaded: the plan, model and description.
        serving: the started serving engine.
        load_s: seconds from ``t0`` to the weights loaded.
        warm_up_s: seconds the engine's warm-up took (kernels built; 0 on the CPU).
        load_peak_mlx_bytes: MLX's peak memory while loading.
    """

    loaded: LoadedPlan
    serving: ServingEngine
    load_s: float
    warm_up_s: float
    load_peak_mlx_bytes: int


def serving_for(
    loaded: LoadedPlan,
    expert_cache_mode: str | None = None,
    tokenizer: GGUFTokenizer | None = None,
) -> ServingEngine:
    """The engine ``serve`` runs for ``loaded`` (warm-up, kernels, paged KV cache, the plan's
    speculative decoding), made and not started (``ServingEngine.start``); ``tokenizer``: the
    one already built for it, else built here.

    Raises:
        StrataError: the weights cannot be loaded or the engine cannot be made.
    """
    from strata.executor.engine import Engine

    engine = Engine(loaded, expert_cache_mode=expert_cache_mode, tokenizer=tokenizer)
    try:
        return ServingEngine(engine)
    except BaseException:
        engine.close()
        raise


@contextlib.contextmanager
def started_engine(
    plan_path: str | Path,
    peeked: PeekedPlan,
    tokenizer: GGUFTokenizer,
    t0: float,
    expert_cache_mode: str | None = None,
) -> Iterator[Started]:
    """Load the plan at ``plan_path`` (already peeked and checked) and start the engine that
    ``serve`` runs (warm-up, kernels, paged KV cache, the plan's speculative decoding); stopped
    on leaving, on success, errors and Ctrl-C alike (the wait bounded: Ctrl-C always ends the
    command). ``t0``: when the command started (``load_s`` counts from it).

    Raises:
        StrataError: the model's bytes are not the planned ones, or the engine cannot start.
    """
    from strata.executor.plan_loader import load_plan
    from strata.executor.serving import STOP_WAIT_S

    loaded = load_plan(plan_path, peeked=peeked)  # the bytes checked (hashed once per file)
    serving = serving_for(loaded, expert_cache_mode, tokenizer)
    serving.log_failures = False  # generate() raises a failed request's error: said once
    try:
        load_s = time.perf_counter() - t0
        peak = int(mx.get_peak_memory())  # generate() resets MLX's peak: loading's own
        if serving.engine.config.warm_up_row_buckets:  # as serve says it (the GPU: up to a minute)
            print("building kernels for every batch size ...", file=sys.stderr, flush=True)
        warm_up_s = serving.start()
        yield Started(loaded, serving, load_s, warm_up_s, peak)
    finally:
        serving.close(timeout=STOP_WAIT_S)
