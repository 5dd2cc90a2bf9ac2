#!/usr/bin/env python3
"""Where a warm pass's time goes on the GPU's own clock: its kernels, and the GPU's idle time
between them, from CUPTI through PyTorch's profiler (an NVIDIA machine with PyTorch installed).

A serving engine of a plan (``executor.serving.ServingEngine``) is driven from this thread, as in
``bench/warm_pass.py``: per round, a prefix-cache reset, a cold request (a ``--document-tokens``
document and a 16-token suffix) and a warm one (the document, another suffix: its whole KV blocks
hit). CUPTI records every kernel of the process, MLX's included, whatever library launched
it. The first ``--skip`` rounds run unrecorded (kernel builds). For each recorded warm request
(submission to its token event, host clock) the script reports:

- ``host_ms``: the request's time (submission to the token event);
- ``lead_ms``: submission to its first kernel's start (the host's work before the GPU has any);
- ``busy_ms``: the union of its kernels' execution intervals;
- ``idle_ms``: the GPU idle between its first kernel's start and its last kernel's end;
- ``tail_ms``: its last kernel's end to the token event (the logits' transfer, sampling, events);
- ``kernels``: how many ran, and the largest idle gaps with the kernels either side.

Variants as in ``bench/warm_pass.py`` (``eagerN``, ``compiledN``...), interleaved round by round.

usage: python bench/pass_timeline.py PLAN [--rounds 6] [--skip 2] [--variants eager2]
       [--trace DIR] [-o FILE.json]

Measured on the lent H200 (2026-12-02, synthetic Llama-3-8B shape Q4_0, medians of 5;
``bench/results/2026-12-02.pass-timeline.h200.llama3-8b-shape.json``): compiled in segments of 4
host 8.85 ms, lead 2.07, GPU busy 6.04, idle 0.25, tail 0.40; on another start 8.36 / 1.74 /
5.87 / 0.26 / 0.40, and eager (every 2 blocks) 8.91 / 1.78 / 6.06 / 0.60 / 0.38. The first
kernels of a warm pass are the embedding lookup's gathers, 80-160 us for 24 rows.
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
import warm_pass as wp  # noqa: E402

from executor.engine import Engine  # noqa: E402
from executor.plan_loader import load_plan  # noqa: E402
from executor.serving import ServingEngine  # noqa: E402

GAP_US = 2.0
"""Idle gaps shorter than this (microseconds) are not listed among the largest."""


def summarize(events: list[dict], spans: list[tuple[str, float, float]], top: int = 8) -> list:
    """Per warm request span ``(variant, start_us, end_us)`` of the trace's clock: its kernels'
    busy and idle time, lead and tail (ms), and its ``top`` largest idle gaps."""
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "kernel"
    )
    out = []
    for variant, s, t in spans:
        ks = [k for k in kernels if s <= k[0] <= t]
        if not ks:
            out.append({"variant": variant, "kernels": 0, "host_ms": (t - s) / 1e3})
            continue
        busy, gaps, end = 0.0, [], ks[0][0]
        for i, (a, b, name) in enumerate(ks):
            if a > end:
                gaps.append((a - end, ks[i - 1][2] if i else "", name))
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        gaps.sort(reverse=True)
        out.append(
            {
                "variant": variant,
                "host_ms": round((t - s) / 1e3, 3),
                "lead_ms": round((ks[0][0] - s) / 1e3, 3),
                "busy_ms": round(busy / 1e3, 3),
                "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
                "tail_ms": round((t - end) / 1e3, 3),
                "kernels": len(ks),
                "gaps_over_2us": sum(1 for g in gaps if g[0] >= GAP_US),
                "largest_gaps": [
                    {"us": round(g, 1), "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top]
                ],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first rounds not recorded (2)")
    ap.add_argument("--variants", default="eager2")
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("--trace", help="write the profiler's Chrome trace into this folder")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        raise SystemExit("pass_timeline.py needs PyTorch (its profiler reads CUPTI)") from None
    names = args.variants.split(",")
    for v in names:
        wp.use(v)  # refuses an unknown one before the engine loads
    if args.rounds <= args.skip:
        ap.error("--rounds must exceed --skip")
    serving = ServingEngine(Engine(load_plan(args.plan)))
    serving.start(None)
    rng = np.random.default_rng(0)
    vocab = serving.vocab_size
    doc = rng.integers(0, vocab, args.document_tokens).tolist()

    def round_(recorded: list | None) -> None:
        for v in names:
            wp.use(v)
            serving.reset_prefix_cache()
            pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
            with record_function(f"warm:{v}"):
                t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
            if recorded is not None:
                recorded.append((v, (next(iter(ev.values()))[0] - t) * 1e3))

    try:
        for _ in range(args.skip):
            round_(None)
        torch.cuda.init()
        host: list = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.rounds - args.skip):
                round_(host)
    finally:
        serving.close()
    folder = Path(args.trace) if args.trace else Path("/tmp")
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"pass_timeline.{int(time.time())}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    if not args.trace:
        trace.unlink()
    spans = [
        (e["name"].split(":", 1)[1], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("warm:")
    ]
    spans.sort(key=lambda span: span[1])  # in the order they ran, as ``host`` is
    rows = summarize(events, spans)
    for r, (_, ms) in zip(rows, host, strict=False):
        r["ttft_ms"] = round(ms, 3)  # submission to the event, this script's own clock
    out = {"plan": args.plan, "rows": rows, "median": {}}
    for v in names:
        mine = [r for r in rows if r["variant"] == v and r.get("kernels")]
        keys = ("host_ms", "lead_ms", "busy_ms", "idle_ms", "tail_ms", "kernels")
        out["median"][v] = {k: statistics.median(r[k] for r in mine) for k in keys} if mine else {}
        print(f"{v}: " + ", ".join(f"{k} {x}" for k, x in out["median"][v].items()))
    for r in rows[: len(names)]:
        print(f"{r['variant']} largest gaps: {r.get('largest_gaps')}")
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
