#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU's own clock: the GPU's busy time per step against
the step's wall time (is decode bound by the device or by the host building the steps?), and the
kernels that fill it, from CUPTI through PyTorch's profiler (an NVIDIA machine with PyTorch).

Per variant (a runtime config over the plan's, :func:`parse_variant`) a serving engine of the plan
is driven from this thread. Each round, per concurrency ``c`` in ``--concurrency``, ``c`` random
``--prompt``-token prompts are decoded twice, greedy, inside a recorded span each: once for
``SHORT`` tokens and once for ``SHORT + --tokens``. The two spans share the prefill and the first
steps, so their difference is ``--tokens`` decode steps of ``c`` sequences as the server runs
them (pipelined steps and all): per step, ``step_ms`` (wall), ``busy_ms`` (the union of the GPU's
kernels, copies and fills), ``idle_ms`` (their difference: the GPU waiting for the host),
``kernels``, and the costliest kernels by name and grid (``by_kernel``: ``[name, per step, us
per step]``).
``busy_ms`` near ``step_ms``: device-bound; well below: host-bound. The two runs' first ``SHORT``
tokens are checked equal (greedy), and each variant's texts against the first variant's.

usage: python benchmarks/decode_timeline.py PLAN [--concurrency 1,16] [--tokens 64]
       [--prompt 32] [--rounds 3] [--skip 1] [--variants 'base|mma_rows=2:16'] [-o FILE.json]

Figures: ``docs/kernels.md`` (Where a lone decode step's time goes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from strata.benchmarks import prefix_inprocess as pi
from strata.benchmarks.pass_timeline import summarize
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.plan_loader import load_plan
from strata.executor.serving import ServingEngine

SHORT = 4
"""Tokens of the short run: its steps (prefill, warm-up of the step pipeline) are subtracted."""


def parse_variant(text: str, base: RuntimeConfig) -> RuntimeConfig:
    """``base`` with the changes ``text`` names: ``base`` (none) or ``field=value`` pairs joined
    by ``+`` (``mma_rows=2:16+async_eval_blocks=4``); a value takes its field's type (bool 0/1,
    int, ``a:b`` for a pair).

    Raises:
        SystemExit: an unknown field or a value that does not parse, with the fields listed.
    """
    if text == "base":
        return base
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    changes = {}
    for pair in text.split("+"):
        name, _, value = pair.partition("=")
        if name not in fields or not value:
            raise SystemExit(
                f"variant {text!r}: {pair!r} is not field=value of a runtime setting; the "
                f"settings are {', '.join(sorted(fields))}"
            )
        old = fields[name]
        try:
            if isinstance(old, bool):
                changes[name] = bool(int(value))
            elif isinstance(old, tuple):
                parts = value.split(":")
                changes[name] = tuple(type(o)(v) for o, v in zip(old, parts, strict=True))
            else:
                changes[name] = type(old)(value)
        except ValueError:
            raise SystemExit(f"variant {text!r}: {value!r} is not a {type(old).__name__}") from None
    return base.replace(**changes)


def per_step(short: dict, long: dict, steps: int) -> dict:
    """The difference of a long and a short run's :func:`pass_timeline.summarize` rows (those of
    ``summarize(..., top=...)`` with every kernel name), per decode step: ms, kernel counts and
    us per kernel name, costliest first."""
    kern = {n: (c, us) for n, c, us in short["by_kernel"]}
    names = []
    for n, c, us in long["by_kernel"]:
        c0, us0 = kern.get(n, (0, 0.0))
        names.append([n, round((c - c0) / steps, 2), round((us - us0) / steps, 2)])
    names.sort(key=lambda r: -r[2])
    out = {k: round((long[k] - short[k]) / steps, 4) for k in ("span_ms", "busy_ms", "idle_ms")}
    return {
        "step_ms": out["span_ms"],
        "busy_ms": out["busy_ms"],
        "idle_ms": round(out["span_ms"] - out["busy_ms"], 4),
        "kernels": round((long["kernels"] - short["kernels"]) / steps, 2),
        "by_kernel": names,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps measured (64)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", type=int, default=1, help="first rounds not recorded (1)")
    ap.add_argument("--variants", default="base", help="'|'-separated (parse_variant)")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    if args.tokens < 8 or args.skip < 0 or args.rounds <= args.skip:
        ap.error("--tokens must be 8 or more, --skip 0 or more and --rounds above it")
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        raise SystemExit("decode_timeline.py needs PyTorch (its profiler reads CUPTI)") from None
    loaded = load_plan(args.plan)
    base = RuntimeConfig.build(loaded.plan.runtime)
    names = args.variants.split("|")
    configs = {n: parse_variant(n, base) for n in names}
    engines = {n: ServingEngine(Engine(loaded, config=c)) for n, c in configs.items()}
    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = next(iter(engines.values())).vocab_size
    rng = np.random.default_rng(0)
    prompts = {c: [rng.integers(0, vocab, args.prompt).tolist() for _ in range(c)] for c in levels}
    texts: dict[tuple, list] = {}
    problems: list[str] = []

    def round_(record: bool) -> None:
        for n, serving in engines.items():
            for c in levels:
                runs = {}
                for kind, count in (("short", SHORT), ("long", SHORT + args.tokens)):
                    serving.reset_prefix_cache()  # each run prefills its prompts the same way
                    with record_function(f"{kind}:{n}:{c}") if record else nullcontext():
                        runs[kind] = pi.run(serving, prompts[c], count)[2]
                    if texts.setdefault((kind, c), runs[kind]) != runs[kind]:
                        problems.append(f"{n} c={c} {kind}: ids differ from {names[0]}'s")
                if [t[:SHORT] for t in runs["long"]] != runs["short"]:
                    problems.append(f"{n} c={c}: the long run's first tokens differ")

    try:
        for serving in engines.values():
            serving.start(None)
        for _ in range(args.skip):
            round_(False)
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.rounds - args.skip):
                round_(True)
        trace = Path(f"/tmp/decode_timeline.{int(time.time())}.json")
        prof.export_chrome_trace(str(trace))
    finally:
        for serving in engines.values():
            serving.close()
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    spans = sorted(
        (e["name"], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(("short:", "long:"))
    )
    rows = summarize(events, sorted(spans, key=lambda s: s[1]), top=1000, by_grid=True)
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["variant"].split(":", 1)[1], []).append(r)
    out = {"plan": args.plan, "tokens": args.tokens, "problems": problems, "rows": {}}
    for key in (f"{n}:{c}" for n in names for c in levels):
        shorts = [r for r in by.get(key, []) if r["variant"] == f"short:{key}"]
        longs = [r for r in by.get(key, []) if r["variant"] == f"long:{key}"]
        steps = [per_step(s, t, args.tokens) for s, t in zip(shorts, longs, strict=True)]
        if not steps:
            continue
        med = {k: statistics.median(s[k] for s in steps) for k in ("step_ms", "busy_ms", "kernels")}
        med["idle_ms"] = round(med["step_ms"] - med["busy_ms"], 4)
        c = int(key.rsplit(":", 1)[1])
        med["tok_s"] = round(c * 1e3 / med["step_ms"], 1)
        out["rows"][key] = {"median": med, "steps": steps}
        print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in med.items()), flush=True)
        print(f"{key} kernels per step: {steps[0]['by_kernel'][:12]}", flush=True)
    for p in problems:
        print("PROBLEM:", p)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
