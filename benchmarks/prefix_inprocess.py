#!/usr/bin/env python3
"""Prefix-cache TTFT and decode steps, in-process (no HTTP), variants of the forward pass
against each other in one process, and where a warm pass spends its host time.

Serving engines of a plan (``executor.serving.ServingEngine``), one per variant, each with the
variant's runtime config (``executor.config.RuntimeConfig``: its own weights and KV cache, so N
variants need N times the memory), are driven from this thread:

- ``cold``: a prompt of a 1,000-token document (``--document-tokens``) and a 16-token suffix,
  after a prefix-cache reset;
- ``warm``: the same document with another suffix (the document's whole KV blocks hit);
- ``step16``: 16 sequences of 8-token prompts decoding 48 tokens each, the median time between
  a sequence's token events after its first 8.

Each is the time from submission to the event on the engine thread. Variants (``--variants``),
interleaved round by round: ``fused`` (as shipped: on MLX's CUDA backend a block's Q/K/V and
gate/up take ``executor.ops.fused_qkv`` / ``fused_swiglu`` for 2-32 rows), ``unfused``
(``fused_projections`` off, so the model makes its seven projection calls), and
``async1`` / ``async2`` / ``async4`` (fused, the residual stream scheduled with
``mx.async_eval`` every 1, 2 or 4 blocks: ``async_eval_blocks``), and
``eager`` / ``compiled`` (fused, with ``executor.pass_graph``'s compiled passes off or on;
``fused`` keeps the environment's setting, ``STRATA_COMPILED_PASSES``, and the others are
eager). A
compiled layout is traced on its second pass: give ``--rounds`` of 4 or more to see replays in
the medians.
``--breakdown`` then times four warm passes of the first variant part by part (each function
wrapped with a timer: the engine step, the forward pass's build, ``mx.async_eval``, the
projections, attention, RoPE, norms, the KV write, the store's unit lookups). Round 0 builds
kernels and is not counted; the medians of the rest are reported, and every variant's greedy
tokens of the 16 sequences are checked equal to the first variant's or reported as differing
(the fused SwiGLU rounds once where the unfused path rounds each product).

usage: python benchmarks/prefix_inprocess.py PLAN [--rounds 4] [--variants fused,unfused]
       [--document-tokens 1000] [--breakdown] [--no-warm-up] [-o FILE]

Each round line also gives the compiled passes traced and replayed in it
(``pass_graph.counters``); ``--no-warm-up`` skips the engine's warm-up, so that round 0 (not
counted) builds the kernels.

Figures: ``docs/kernels.md`` (Compiled passes; Where a warm pass's time goes) and
``docs/benchmarks.md`` (In-process probes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import strata.executor.models.llama as llama
import strata.executor.runner as runner_module
from strata.executor import attention, pass_graph
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.paged_kv import ForwardBatch
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import GenerationRequest, ServingEngine

VARIANTS: dict[str, dict] = {
    "fused": {},
    "eager": {"compiled_passes": False},
    # Passes of any number of sequences (the 16-sequence decode steps too, where a server, and
    # ``fused``, compile only passes of one).
    "compiled": {"compiled_passes": True, "max_sequences": 0},
    "unfused": {"fused_projections": False, "compiled_passes": False},
    "async1": {"async_eval_blocks": 1, "compiled_passes": False},
    "async2": {"async_eval_blocks": 2, "compiled_passes": False},
    "async4": {"async_eval_blocks": 4, "compiled_passes": False},
}
"""Variant -> its changes to the plan's runtime config (``RuntimeConfig.replace``)."""


def serving_engines(plan: str, names: list[str]) -> dict[str, ServingEngine]:
    """A serving engine of ``plan`` per variant of ``names`` (not started), each with the
    plan's runtime config changed as :data:`VARIANTS` says: the plan is loaded once, the
    weights once per engine."""
    loaded = load_plan(plan)
    base = RuntimeConfig.build(loaded.plan.runtime)
    return {v: ServingEngine(Engine(loaded, config=base.replace(**VARIANTS[v]))) for v in names}


WAIT_S = 300.0
"""Seconds a group of requests may take before the bench gives up."""


def run(serving: ServingEngine, prompts: list[list[int]], max_tokens: int):
    """Submit ``prompts`` together and wait for all; (submission time, {id: [event times]},
    {id: [token ids]})."""
    done, lock, left = threading.Event(), threading.Lock(), [len(prompts)]
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}

    def handler(rid: str):
        def on_event(ev) -> None:
            times[rid].append(time.perf_counter())
            tokens[rid].extend(ev.token_ids)
            if ev.finish_reason:
                if ev.finish_reason not in ("length", "stop"):
                    print(f"request {rid} ended with {ev.finish_reason}: {ev.error}")
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return on_event

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        rid = f"bench-{time.time_ns()}-{i}"
        times[rid], tokens[rid] = [], []
        req = GenerationRequest(rid, ids, max_tokens, SamplingParams(temperature=0), True)
        serving.submit(req, handler(rid))
    if not done.wait(WAIT_S):
        raise SystemExit(f"requests did not finish within {WAIT_S:.0f} s")
    return t0, times, [tokens[r] for r in times]


def _timed(owner, name: str, label: str, totals: dict[str, list[float]]):
    """Replace ``owner.name`` with a wrapper adding each call's time to ``totals[label]``
    ([calls, seconds]); returns a function that puts the original back."""
    original = getattr(owner, name)
    had_own = name in vars(owner) if hasattr(owner, "__dict__") else True

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original) if had_own else delattr(owner, name)


def breakdown(serving: ServingEngine, prompts: list[list[int]]) -> dict[str, dict]:
    """Time the parts of the warm passes of ``prompts`` (each a cached document and a new
    suffix): per part, calls and total/per-call time (nested parts count in their callers too)."""
    model, totals = serving.engine.model, {}
    parts = [
        (serving, "step", "serving step"),
        (serving.runner, "execute", "forward + sampling"),
        (runner_module, "forward", "runner.forward (build)"),
        (mx, "async_eval", "mx.async_eval"),
        (llama, "fused_qkv", "fused_qkv"),
        (llama, "fused_swiglu", "fused_swiglu"),
        (llama, "linear", "linear"),
        (llama, "linear_add", "linear_add"),
        (attention.cuda_attention, "attention", "cuda_attention.attention"),
        (attention, "kernel_attention", "kernel_attention (check)"),
        (mx.fast, "rope", "mx.fast.rope"),
        (mx.fast, "rms_norm", "mx.fast.rms_norm"),
        (serving.kv, "write", "kv.write"),
        (model.store, "unit", "store.unit"),
        (model.store, "release", "store.release"),
        (ForwardBatch, "positions", "batch.positions"),
        (attention, "kernel_layout", "attention.kernel_layout"),
    ]
    restore = [_timed(owner, name, label, totals) for owner, name, label in parts]
    try:
        for ids in prompts:
            run(serving, [ids], 1)
    finally:
        for undo in reversed(restore):
            undo()
    return {
        label: {"calls": n, "total_ms": round(t * 1e3, 3), "per_call_us": round(t / n * 1e6, 2)}
        for label, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default="fused,unfused")
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("--breakdown", action="store_true", help="time a warm pass part by part")
    ap.add_argument(
        "--no-warm-up", action="store_true", help="skip the engine's warm-up (round 0 builds)"
    )
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or args.rounds < 2:
        ap.error(f"variants are {sorted(VARIANTS)}; --rounds is at least 2 (round 0 builds)")
    engines = serving_engines(args.plan, names)
    t0 = time.perf_counter()
    for serving in engines.values():
        serving.start(False if args.no_warm_up else None)
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    vocab = engines[names[0]].vocab_size
    doc = rng.integers(0, vocab, args.document_tokens).tolist()
    short = [rng.integers(0, vocab, 8).tolist() for _ in range(16)]
    res = {v: {"cold": [], "warm": [], "step16": [], "compiled": []} for v in names}
    texts: dict[str, list[list[int]]] = {}
    try:
        for rnd in range(args.rounds):
            for v in names:
                serving = engines[v]
                compiled0 = pass_graph.counters(serving.kv)
                serving.reset_prefix_cache()
                t, ev, _ = run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
                cold = next(iter(ev.values()))[0] - t
                t, ev, _ = run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
                warm = next(iter(ev.values()))[0] - t
                _, ev, toks = run(serving, short, 48)
                step = statistics.median(statistics.median(np.diff(e[8:])) for e in ev.values())
                texts.setdefault(v, toks)
                traces, replays = (
                    b - a for a, b in zip(compiled0, pass_graph.counters(serving.kv), strict=True)
                )
                if rnd:  # round 0 builds kernels: not counted
                    res[v]["cold"].append(cold)
                    res[v]["warm"].append(warm)
                    res[v]["step16"].append(step)
                    res[v]["compiled"].append([traces, replays])
                print(
                    f"round {rnd} {v:8s}: cold {cold * 1e3:6.1f} ms, warm {warm * 1e3:5.1f} ms "
                    f"(x{cold / warm:.2f}), 16-sequence step {step * 1e3:5.2f} ms; "
                    f"compiled passes: {traces} traced, {replays} replayed"
                )
        parts = None
        if args.breakdown:
            warm = [doc + rng.integers(0, vocab, 16).tolist() for _ in range(4)]
            parts = breakdown(engines[names[0]], warm)
            print(f"four warm passes of {names[0]}, part by part:")
            for label, p in parts.items():
                print(
                    f"  {label:28s} {p['calls']:6d} calls {p['total_ms']:9.2f} ms "
                    f"{p['per_call_us']:9.2f} us/call"
                )
    finally:
        for serving in engines.values():
            serving.close()
    out = {"plan": args.plan, "rounds": res, "medians_ms": {}, "tokens_equal": {}}
    if parts is not None:
        out["breakdown_warm_x4"] = parts
    for v in names:
        med = {
            k: round(statistics.median(x) * 1e3, 2) for k, x in res[v].items() if k != "compiled"
        }
        out["medians_ms"][v] = med
        same = sum(a == b for a, b in zip(texts[v], texts[names[0]], strict=True))
        out["tokens_equal"][v] = f"{same}/{len(texts[v])}"
        print(
            f"{v:8s}: cold {med['cold']} ms, warm {med['warm']} ms "
            f"(x{med['cold'] / med['warm']:.2f}), 16-sequence step {med['step16']} ms; "
            f"greedy tokens equal to {names[0]}'s for {same} of {len(texts[v])} sequences"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
