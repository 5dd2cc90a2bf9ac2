#!/usr/bin/env python3
"""The warm pass after a prefix-cache hit, variant against variant, in one process.

Each variant is a runtime config (``executor.config.RuntimeConfig``) and has its own serving
engine of the plan (``executor.serving.ServingEngine``: its own weights and KV cache, so N
variants need N times the memory), all driven from this thread, variants interleaved round by
round. Each round, in each variant's engine, a document of ``--document-tokens`` tokens is
cached by a cold request (after a prefix-cache reset), then one warm request follows (the
document and a new 16-token suffix, one output token). Per warm request: ``ttft`` (submission
to the token event), ``fwd`` (the forward pass and sampling, ``ModelRunner.execute``),
``build`` (``executor.runner.forward``: Python's building of the graph and, eager, its
``mx.async_eval`` calls; compiled, the replay of every segment and its ``mx.async_eval``) and
``replay`` (``pass_graph.PassGraphs.run``), in ms. The first ``--skip`` rounds are not counted
(kernel builds, compiled traces); compiled rows count only where the pass replayed.

With ``--step16 N`` each variant then also decodes 16 sequences together (8-token prompts, ``N``
tokens each, ``N`` >= 8): ``step16`` is the median over the sequences of the median time between
a sequence's token events after its first 4 (a 16-row decode step), ``peak_mb`` MLX's peak
memory during those decodes above the memory in use before them (their prefill's transient
arrays included: compare variants; one layer's K+V pools copied whole would add their size,
268 MB for Llama-3-8B's heads and 4,096 KV blocks of 16 tokens, but single rounds of one variant
varied by more than that on the H200), and ``step16_replayed`` the compiled passes replayed in
them. The next variant's warm pass then follows these decodes. Medians are taken column by
column.

Variants (``--variants``, comma-separated):

- ``eagerN``: eager, ``mx.async_eval`` every N blocks (0: never; the config's
  ``compiled_passes`` off, ``async_eval_blocks`` N);
- ``compiledN``: ``executor.pass_graph``'s compiled pass in segments of N blocks
  (``segment_blocks``; 0: one graph), passes of any number of sequences compiled
  (``max_sequences`` 0: the 16-sequence steps too, where a server compiles only passes of one);
- either with ``-rope-off``: RoPE by ``mx.fast.rope`` rather than in the Q/K/V product's store
  (``fused_rope`` off);
- then with ``-nocache``: MLX's buffer cache off (``mx.set_cache_limit(0)`` around the variant's
  requests), so that a freed buffer is never handed to a later array (on MLX's CUDA backend one
  cache serves host-built arrays in managed memory and GPU outputs alike);
- and with ``-fresh``: each pass's integer inputs as new arrays rather than written into the
  engine's kept buffers (``stage_inputs`` off, ``executor.host_inputs``);
- last, with ``-whole``: prefix-cache hits of whole blocks only (``lend_partial_blocks`` off),
  so the warm pass computes the document's tokens after its last whole block again (24 tokens
  instead of 16 for a 1,000-token document in blocks of 16).

usage: python benchmarks/warm_pass.py PLAN [--rounds 12] [--skip 3]
       [--variants eager2,eager2-rope-off,compiled0,compiled4] [--step16 N] [-o FILE.json]

Figures: ``docs/kernels.md`` (Scheduling blocks as they are built; Where a warm pass's time
goes) and ``docs/benchmarks.md`` (In-process probes).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import strata.executor.runner as runner_module
from strata.benchmarks import prefix_inprocess as pi
from strata.executor import pass_graph
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.plan_loader import load_plan
from strata.executor.serving import ServingEngine


@dataclass(frozen=True)
class Variant:
    """One variant: its name, the runtime config its engine runs, and whether MLX's buffer cache
    is off around its requests (``-nocache``: MLX's process-wide setting, not Strata's)."""

    name: str
    config: RuntimeConfig
    nocache: bool


def variant(name: str, base: RuntimeConfig) -> Variant:
    """The variant ``name`` (module docstring) over the runtime config ``base``.

    Raises:
        SystemExit: an unknown variant.
    """
    m = re.fullmatch(r"(eager|compiled)([0-9]+)(-rope-off)?(-nocache)?(-fresh)?(-whole)?", name)
    if not m:
        raise SystemExit(
            f"unknown variant {name!r}: eagerN or compiledN, then -rope-off, -nocache, -fresh "
            "and -whole, each optional, in that order"
        )
    kind, n, rope_off, nocache, fresh, whole = m.groups()
    changes: dict = {"compiled_passes": kind == "compiled"}
    if kind == "compiled":
        changes |= {"segment_blocks": int(n), "max_sequences": 0}
    else:
        changes["async_eval_blocks"] = int(n)
    changes |= {"fused_rope": rope_off is None, "stage_inputs": fresh is None}
    changes["lend_partial_blocks"] = whole is None
    return Variant(name, base.replace(**changes), nocache is not None)


_CACHE_LIMIT = mx.set_cache_limit(0)
"""MLX's buffer-cache limit at import (bytes), which the variants without ``-nocache`` keep."""
mx.set_cache_limit(_CACHE_LIMIT)  # MLX reports the limit only by setting another: read it once


def cache_off(off: bool) -> None:
    """MLX's buffer cache off (limit 0) or back at its limit at import."""
    mx.set_cache_limit(0 if off else _CACHE_LIMIT)


def serving_engines(plan: str, variants: list[Variant]) -> dict[str, ServingEngine]:
    """A serving engine of ``plan`` per variant, each with the variant's runtime config (not
    started): the plan is loaded once, the weights once per engine."""
    loaded = load_plan(plan)
    return {v.name: ServingEngine(Engine(loaded, config=v.config)) for v in variants}


def step16(serving: ServingEngine, rng: np.random.Generator, tokens: int) -> dict:
    """16 sequences of random 8-token prompts decoding ``tokens`` tokens together: the median
    over them of the median gap between a sequence's token events after its first 4 (ms), the
    peak memory above what was in use before (MB), and the compiled passes replayed."""
    vocab = serving.vocab_size
    prompts = [rng.integers(0, vocab, 8).tolist() for _ in range(16)]
    c0 = pass_graph.counters(serving.kv)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    _, times, _ = pi.run(serving, prompts, tokens)
    peak = mx.get_peak_memory() - before
    gaps = [statistics.median(np.diff(t[4:])) for t in times.values() if len(t) > 5]
    return {
        "step16": round(statistics.median(gaps) * 1e3, 3),
        "peak_mb": round(peak / 1e6, 1),
        "step16_replayed": pass_graph.counters(serving.kv)[1] - c0[1],
    }


def _line(row: dict) -> str:
    extra = f" / step16 {row['step16']:.2f} ({row['peak_mb']:.0f} MB)" if "step16" in row else ""
    return f"{row['ttft']:.2f}{extra}"


def add_arguments(ap: argparse.ArgumentParser, rounds: int, skip: int, variants: str) -> None:
    """The arguments this script shares with ``benchmarks/pass_timeline.py``: the plan,
    ``--rounds``, ``--skip``, ``--variants``, ``--document-tokens`` and ``-o``."""
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--skip", type=int, default=skip, help=f"first rounds not counted ({skip})")
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("-o", "--output")


def checked_variants(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[Variant]:
    """``--variants`` as variants over the plan's runtime config (:func:`variant`: an unknown
    one ends the program, before any engine loads); ``--skip`` and ``--rounds`` refused out of
    range."""
    if args.skip < 0 or args.rounds <= args.skip:
        ap.error("--skip must be 0 or more and --rounds above it")
    base = RuntimeConfig.build(load_plan(args.plan).plan.runtime)
    return [variant(v, base) for v in args.variants.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, 12, 3, "eager2,eager2-rope-off,compiled0,compiled4")
    ap.add_argument("--step16", type=int, default=0, help="tokens of the 16-sequence decodes")
    args = ap.parse_args()
    if args.step16 and args.step16 < 8:
        ap.error("--step16 must be 0 (off) or at least 8")
    variants = checked_variants(ap, args)
    names = [v.name for v in variants]
    engines = serving_engines(args.plan, variants)
    t0 = time.perf_counter()
    for serving in engines.values():
        serving.start(None)
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).vocab_size
    doc = rng.integers(0, vocab, args.document_tokens).tolist()
    totals: dict[str, list] = {}
    timers = [pi._timed(s.runner, "execute", "fwd", totals) for s in engines.values()]
    timers += [
        pi._timed(runner_module, "forward", "build", totals),
        pi._timed(pass_graph.PassGraphs, "run", "replay", totals),
    ]
    rows: dict[str, list[dict]] = {v: [] for v in names}
    cold: dict[str, list[float]] = {v: [] for v in names}
    try:
        for rnd in range(args.rounds):
            for v in variants:
                serving = engines[v.name]
                cache_off(v.nocache)
                serving.reset_prefix_cache()
                t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
                cold[v.name].append(next(iter(ev.values()))[0] - t)
                totals.clear()
                c0 = pass_graph.counters(serving.kv)
                t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
                ttft = next(iter(ev.values()))[0] - t
                c1 = pass_graph.counters(serving.kv)

                def ms(label: str) -> float:
                    return round(totals.get(label, [0, 0.0])[1] * 1e3, 3)

                rows[v.name].append(
                    {"ttft": round(ttft * 1e3, 3), "fwd": ms("fwd"), "build": ms("build")}
                    | {"replay": ms("replay"), "traced": c1[0] - c0[0]}
                    | {"replayed": c1[1] - c0[1]}
                    | (step16(serving, rng, args.step16) if args.step16 else {})
                )
            print(
                f"round {rnd}: "
                + ", ".join(
                    f"{v} cold {cold[v][-1] * 1e3:.1f} warm {_line(rows[v][-1])}" for v in names
                )
            )
    finally:
        for undo in reversed(timers):
            undo()
        cache_off(False)
        for serving in engines.values():
            serving.close()
    out = {
        "plan": args.plan,
        "cold_median_ms": {
            v: round(statistics.median(cold[v][args.skip :]) * 1e3, 2) for v in names
        },
    }
    out |= {"median_ms": {}, "rows": rows}
    for v in names:
        counted = [r for r in rows[v][args.skip :] if not v.startswith("compiled") or r["replayed"]]
        if not counted:  # a compiled variant whose passes never replayed (not eligible here)
            out["median_ms"][v] = {"n": 0}
            print(f"{v:20s} no pass replayed")
            continue
        keys = ("ttft", "fwd", "build", "replay", "step16", "peak_mb")
        med = {k: statistics.median(r[k] for r in counted) for k in keys if k in counted[0]}
        out["median_ms"][v] = med | {"n": len(counted)}
        line = ", ".join(f"{k} {x:.2f}" for k, x in med.items())
        print(f"{v:20s} {line} (n={len(counted)})")
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
