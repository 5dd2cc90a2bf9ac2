#!/usr/bin/env python3
"""The warm pass after a prefix-cache hit, variant against variant, in one process.

A serving engine of a plan (``executor.serving.ServingEngine``) is driven from this thread. A
document of ``--document-tokens`` tokens is cached by a cold request (each round, after a
prefix-cache reset); then each variant sends one warm request (the document and a new 16-token
suffix, one output token), variants interleaved round by round. Per request: ``ttft`` (submission
to the token event), ``fwd`` (the forward pass and sampling, ``ServingEngine._forward``),
``build`` (``LlamaModel.forward_batch``: Python's building of the graph and, eager, its
``mx.async_eval`` calls; compiled, the replay of every segment and its ``mx.async_eval``) and
``replay`` (``pass_graph.PassGraphs.run``), in ms. The first ``--skip`` rounds are not counted
(kernel builds, compiled traces); compiled rows count only where the pass replayed.

Variants (``--variants``, comma-separated):

- ``eagerN`` / ``eagerN-rope-off``: eager, ``mx.async_eval`` every N blocks (0: never,
  ``executor.models.llama.ASYNC_EVAL_BLOCKS``), RoPE in the Q/K/V product's store or by
  ``mx.fast.rope`` (``FUSED_ROPE``);
- ``compiledN``: ``executor.pass_graph``'s compiled pass in segments of N blocks
  (``SEGMENT_BLOCKS``; 0: one graph).

usage: python bench/warm_pass.py PLAN [--rounds 12] [--skip 3]
       [--variants eager2,eager2-rope-off,compiled0,compiled4] [-o FILE.json]

Measured on the lent H200 with a scratch version of this script (2026-12-02, synthetic
Llama-3-8B shape Q4_0; ``bench/results/2026-12-02.warm-pass-*.h200.llama3-8b-shape.json``):
eager every 1 / 2 / 4 / never 9.85 / 8.01 / 8.36 / 10.92 ms; RoPE in the store off / on 11.74 /
10.38; compiled in one graph / segments of 8 / of 4 9.23 / 8.55 / 8.33.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import prefix_inprocess as pi  # noqa: E402

import executor.models.llama as llama  # noqa: E402
from executor import pass_graph  # noqa: E402
from executor.engine import Engine  # noqa: E402
from executor.plan_loader import load_plan  # noqa: E402
from executor.serving import ServingEngine  # noqa: E402


def use(variant: str) -> None:
    """Set the model module and ``pass_graph`` as ``variant`` says (see the module docstring).

    Raises:
        SystemExit: an unknown variant.
    """
    rope = not variant.endswith("-rope-off")
    name = variant.removesuffix("-rope-off")
    for kind, compiled in (("eager", False), ("compiled", True)):
        if name.startswith(kind) and name[len(kind) :].isdigit():
            n = int(name[len(kind) :])
            llama.ASYNC_EVAL_BLOCKS = pi._ASYNC if compiled else n
            pass_graph.COMPILED_PASSES = compiled
            if compiled:
                pass_graph.SEGMENT_BLOCKS = n
            llama.FUSED_ROPE = rope
            return
    raise SystemExit(f"unknown variant {variant!r}: eagerN[-rope-off] or compiledN[-rope-off]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="first rounds not counted (3)")
    ap.add_argument("--variants", default="eager2,eager2-rope-off,compiled0,compiled4")
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    names = args.variants.split(",")
    defaults = (llama.ASYNC_EVAL_BLOCKS, llama.FUSED_ROPE, pass_graph.COMPILED_PASSES)
    segments = pass_graph.SEGMENT_BLOCKS
    for v in names:
        use(v)  # refuses an unknown one before the engine loads
    if args.rounds <= args.skip:
        ap.error("--rounds must exceed --skip")
    serving = ServingEngine(Engine(load_plan(args.plan)))
    t0 = time.perf_counter()
    serving.start(None)
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    vocab = serving.vocab_size
    doc = rng.integers(0, vocab, args.document_tokens).tolist()
    totals: dict[str, list] = {}
    model = serving.engine.model
    restore = [
        pi._timed(serving, "_forward", "fwd", totals),
        pi._timed(model, "forward_batch", "build", totals),
        pi._timed(pass_graph.PassGraphs, "run", "replay", totals),
    ]
    rows: dict[str, list[dict]] = {v: [] for v in names}
    cold = []
    try:
        for rnd in range(args.rounds):
            llama.ASYNC_EVAL_BLOCKS, llama.FUSED_ROPE, pass_graph.COMPILED_PASSES = defaults
            serving.reset_prefix_cache()
            t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
            cold.append(next(iter(ev.values()))[0] - t)
            for v in names:
                use(v)
                totals.clear()
                c0 = pass_graph.counters(serving.kv)
                t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
                ttft = next(iter(ev.values()))[0] - t
                c1 = pass_graph.counters(serving.kv)

                def ms(label: str) -> float:
                    return round(totals.get(label, [0, 0.0])[1] * 1e3, 3)

                rows[v].append(
                    {"ttft": round(ttft * 1e3, 3), "fwd": ms("fwd"), "build": ms("build")}
                    | {"replay": ms("replay"), "traced": c1[0] - c0[0]}
                    | {"replayed": c1[1] - c0[1]}
                )
            print(
                f"round {rnd}: cold {cold[-1] * 1e3:.1f} ms; "
                + ", ".join(f"{v} {rows[v][-1]['ttft']:.2f}" for v in names)
            )
    finally:
        for undo in reversed(restore):
            undo()
        llama.ASYNC_EVAL_BLOCKS, llama.FUSED_ROPE, pass_graph.COMPILED_PASSES = defaults
        pass_graph.SEGMENT_BLOCKS = segments
        serving.close()
    out = {
        "plan": args.plan,
        "cold_median_ms": round(statistics.median(cold[args.skip :]) * 1e3, 2),
    }
    out |= {"median_ms": {}, "rows": rows}
    for v in names:
        counted = [r for r in rows[v][args.skip :] if not v.startswith("compiled") or r["replayed"]]
        if not counted:  # a compiled variant whose passes never replayed (not eligible here)
            out["median_ms"][v] = {"n": 0}
            print(f"{v:20s} no pass replayed")
            continue
        keys = ("ttft", "fwd", "build", "replay")
        med = {k: statistics.median(r[k] for r in counted) for k in keys}
        out["median_ms"][v] = med | {"n": len(counted)}
        line = ", ".join(f"{k} {x:.2f}" for k, x in med.items())
        print(f"{v:20s} {line} (n={len(counted)})")
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
