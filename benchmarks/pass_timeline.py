#!/usr/bin/env python3
"""Where a warm pass's time goes on the GPU's own clock: its kernels, and the GPU's idle time
between them, from CUPTI through PyTorch's profiler (an NVIDIA machine with PyTorch installed).

Serving engines of a plan (``executor.serving.ServingEngine``), one per variant with the
variant's runtime config, are driven from this thread, as in ``benchmarks/warm_pass.py``: per
round and variant, in the variant's engine, a prefix-cache reset, a cold request (a
``--document-tokens`` document and a 16-token suffix) and a warm one (the document, another
suffix: its whole KV blocks hit). CUPTI records
every kernel, copy and fill of the process, MLX's included, whatever library launched it. The
first ``--skip`` rounds run unrecorded (kernel builds; a compiled layout is traced on its second
pass). Each recorded warm request is a span on the trace's clock, from just before its
submission to this thread's return from waiting for its token; per span (ms):

- ``ttft_ms``: submission to the token event (the engine thread's clock, not the trace's);
- ``span_ms``: the span (about 0.25 ms longer: the waiting thread's wake-up);
- ``first_call_ms``: the span's start to its first CUDA API call (the host's work before
  anything reaches CUDA: scheduling, the batch's arrays, the graph of the first blocks);
- ``lead_ms``: the span's start to the first kernel (before it the GPU has nothing to compute);
- ``lead_api_ms``, ``lead_calls`` and ``longest_lead_calls``: the CUDA API calls in the lead
  (summed time, number, and the longest with their start in the span);
- ``busy_ms``: the union of the GPU's work (kernels, copies, fills) from the first kernel on;
- ``idle_ms``: the GPU idle between the first kernel's start and the last work's end;
- ``tail_ms``: the last work's end to the span's end (the logits' transfer, sampling, the event,
  the waiting thread's wake-up);
- ``kernels``, ``gaps`` (idle gaps of ``GAP_US`` or more), the largest gaps with the work either
  side, and the costliest kernel names (``by_kernel``);
- ``replayed``: compiled passes replayed (compiled variants' medians count only those rows).

The medians are taken column by column, so a variant's median lead, busy, idle and tail need
not add up to its median span.

Variants as in ``benchmarks/warm_pass.py`` (``eagerN``, ``compiledN``, ``-rope-off``, ``-nocache``,
``-fresh``), interleaved.

usage: python benchmarks/pass_timeline.py PLAN [--rounds 6] [--skip 2] [--variants eager2]
       [--trace DIR] [-o FILE.json]

Figures: ``docs/kernels.md`` (Where a warm pass's time goes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from strata.benchmarks import prefix_inprocess as pi
from strata.benchmarks import warm_pass as wp
from strata.executor import pass_graph

GAP_US = 2.0
"""Idle gaps of at least this many microseconds are counted and listed (shorter ones are the
GPU's own spacing between back-to-back kernels)."""

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace categories of GPU work: kernels, copies and fills all count as busy."""

API_CATEGORIES = ("cuda_runtime", "cuda_driver")
"""Trace categories of the host's CUDA API calls."""


def summarize(
    events: list[dict], spans: list[tuple[str, float, float]], top: int = 8, by_grid: bool = False
) -> list:
    """The GPU's work within each warm request's span, from a Chrome trace's events.

    Args:
        events: the trace's ``traceEvents`` (complete events, ``"ph": "X"``, with ``ts`` and
            ``dur`` in microseconds on one clock for host and GPU, as PyTorch's profiler
            exports them).
        spans: ``(variant, start_us, end_us)`` of each warm request on that clock.
        top: how many gaps and kernel names to list per span.
        by_grid: name each kernel with its grid's block count too (``by_kernel`` then tells a
            kernel's calls of different shapes apart).

    Returns:
        one dict per span, in ms: ``span_ms`` (the span), ``first_call_ms`` (its start to the
        first CUDA API call in it: the host's work before anything reaches CUDA; None without
        one), ``lead_api_ms`` and ``lead_calls`` (the summed duration and the number of the
        CUDA API calls from its start to the first kernel's start), ``longest_lead_calls``
        (``[name, ms from the span's start, us]`` of the longest of them), ``lead_ms`` (its
        start to the first kernel's start), ``busy_ms`` (the union of
        the GPU work's intervals from the first kernel on), ``idle_ms`` (the GPU idle between
        the first kernel's start and the last work's end), ``tail_ms`` (the last work's end to
        the span's end), ``kernels``,
        ``gaps`` (idle gaps of at least ``GAP_US``), ``largest_gaps`` (``us``, and the work that
        ended last before the gap and the work after it) and ``by_kernel`` (``[name, count, us]``
        of the costliest kernel names); GPU work is cut at the span's end. A span with no kernel
        gets ``variant``, ``span_ms`` and ``kernels`` (0) only.
    """

    def label(e: dict) -> str:
        grid = e.get("args", {}).get("grid")
        return f"{e['name'][:60]} grid {grid}" if by_grid and grid else e["name"]

    work = sorted(
        (e["ts"], e["ts"] + e["dur"], label(e), e.get("cat"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    )
    calls = sorted(
        (e["ts"], e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in API_CATEGORIES
    )
    out = []
    for variant, s, t in spans:
        ws = [(a, min(b, t), n, c) for a, b, n, c in work if s <= a < t]
        row: dict = {"variant": variant, "span_ms": round((t - s) / 1e3, 3)}
        k0 = next((w[0] for w in ws if w[3] == "kernel"), None)
        if k0 is None:
            out.append(row | {"kernels": 0})
            continue
        ws = [w for w in ws if w[0] >= k0]  # a copy before the first kernel is in the lead
        busy, gaps, end, last = 0.0, [], ws[0][0], ws[0][2]
        by_name: dict[str, list] = {}
        for a, b, name, cat in ws:
            if a - end >= GAP_US:
                gaps.append((a - end, last, name))
            busy += max(0.0, b - max(a, end))
            if b > end:
                end, last = b, name
            if cat == "kernel":
                entry = by_name.setdefault(name[:100], [0, 0.0])
                entry[0] += 1
                entry[1] += b - a
        first_call = next((c for c, _, _ in calls if s <= c < t), None)
        lead_calls = [(c, d, n) for c, d, n in calls if s <= c < k0]
        gaps.sort(key=lambda g: -g[0])
        row |= {
            "first_call_ms": None if first_call is None else round((first_call - s) / 1e3, 3),
            "lead_api_ms": round(sum(d for _, d, _ in lead_calls) / 1e3, 3),
            "lead_calls": len(lead_calls),
            "longest_lead_calls": [
                [n[:60], round((c - s) / 1e3, 3), round(d, 1)]
                for c, d, n in sorted(lead_calls, key=lambda x: -x[1])[:top]
            ],
            "lead_ms": round((k0 - s) / 1e3, 3),
            "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round((end - ws[0][0] - busy) / 1e3, 3),
            "tail_ms": round((t - end) / 1e3, 3),
            "kernels": sum(1 for w in ws if w[3] == "kernel"),
            "gaps": len(gaps),
            "largest_gaps": [
                {"us": round(g, 1), "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top]
            ],
            "by_kernel": [
                [n, c, round(us, 1)]
                for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
            ],
        }
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    wp.add_arguments(ap, 6, 2, "eager2")
    ap.add_argument("--trace", help="write the profiler's Chrome trace into this folder")
    args = ap.parse_args()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        raise SystemExit("pass_timeline.py needs PyTorch (its profiler reads CUPTI)") from None
    variants = wp.checked_variants(ap, args)
    names = [v.name for v in variants]
    engines = wp.serving_engines(args.plan, variants)
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).vocab_size
    doc = rng.integers(0, vocab, args.document_tokens).tolist()

    def round_(recorded: list | None) -> None:
        for v in variants:
            serving = engines[v.name]
            wp.cache_off(v.nocache)
            serving.reset_prefix_cache()
            pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
            c0 = pass_graph.counters(serving.kv)
            with record_function(f"warm:{v.name}"):
                t, ev, _ = pi.run(serving, [doc + rng.integers(0, vocab, 16).tolist()], 1)
            replayed = pass_graph.counters(serving.kv)[1] - c0[1]
            if recorded is not None:
                recorded.append((v.name, (next(iter(ev.values()))[0] - t) * 1e3, replayed))

    try:
        for serving in engines.values():
            serving.start(None)
        for _ in range(args.skip):
            round_(None)
        torch.cuda.init()
        host: list = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.rounds - args.skip):
                round_(host)
        folder = Path(args.trace) if args.trace else Path(tempfile.mkdtemp())
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"pass_timeline.{int(time.time())}.json"
        prof.export_chrome_trace(str(trace))
    finally:
        wp.cache_off(False)
        for serving in engines.values():
            serving.close()
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [
        (e["name"].split(":", 1)[1], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("warm:")
    ]
    spans.sort(key=lambda span: span[1])  # in the order they ran, as ``host`` is
    rows = summarize(events, spans)
    for r, (_, ms, replayed) in zip(rows, host, strict=True):
        r["ttft_ms"] = round(ms, 3)  # submission to the token event (the engine thread's clock)
        r["replayed"] = replayed
    if not args.trace:  # kept until the spans matched the requests
        shutil.rmtree(folder)
    out = {"plan": args.plan, "rows": rows, "median": {}}
    keys = ("ttft_ms", "span_ms", "first_call_ms", "lead_ms", "busy_ms", "idle_ms", "tail_ms")
    for v in names:
        compiled = v.startswith("compiled")
        mine = [r for r in rows if r["variant"] == v and r["kernels"]]
        mine = [r for r in mine if r["replayed"] or not compiled]  # a trace is not a replay
        med = {
            k: statistics.median(r[k] for r in mine)
            for k in (*keys, "kernels")
            if mine and all(r.get(k) is not None for r in mine)
        }
        out["median"][v] = med | {"n": len(mine)}
        print(f"{v}: " + ", ".join(f"{k} {x}" for k, x in out["median"][v].items()))
    for v in names:
        first = next((r for r in rows if r["variant"] == v and r["kernels"]), None)
        if first is not None:
            print(f"{v} largest gaps: {first['largest_gaps']}")
            print(f"{v} kernels by time: {first['by_kernel']}")
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
