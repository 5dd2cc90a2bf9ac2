#!/usr/bin/env python3
"""The GPU kernels of one warm pass (a prompt whose 1,000-token document hits the prefix cache),
profiled alone by Nsight Compute, and their times summed by kernel.

The serving engine of a plan is driven in-process (``benchmarks/prefix_inprocess.py``'s ``run``):
after a prefix-cache reset, ``document + suffix A`` fills the cache; then ``document + suffix
B``, a suffix of 16 new random ids, is answered warm: the document's whole KV blocks hit and the
pass computes the rest (24 tokens at 1,000 + 16). Only that request runs between
``cuProfilerStart`` and ``cuProfilerStop`` (the CUDA driver API), so that ``ncu
--profile-from-start off`` profiles its kernels alone. Then, after another reset, ``document +
suffix B`` is answered cold, and the two first tokens are compared and the result printed
(greedy; the cold pass runs other kernels, so a near-tie of the random-weight models may differ).
Two such rounds run first, unprofiled, so that kernels are built.

usage (MLX's CUDA backend, ``ncu`` on the PATH):
    ncu --clock-control none --cache-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum python3 benchmarks/kernels/pass_kernels.py PLAN > pass.txt
    python3 benchmarks/kernels/pass_kernels.py --summarize pass.txt [-o FILE.json]

ncu runs the kernels one at a time; with ``--cache-control all`` (its default) it also empties
the caches before each, so the sum is then an upper estimate of the GPU's busy time.
``--summarize`` reads ncu's text report: the number of kernels, their summed GPU time, and per
kernel name (template arguments included) the time and the count, longest first.

Figures: ``docs/kernels.md`` (Where a warm pass's time goes; Attention).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import re
from pathlib import Path

_KERNEL = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context \d+")
_TIME = re.compile(r"gpu__time_duration\.sum\s+(\S+)\s+([\d.,]+)")
_UNITS = {
    "s": 1e6,
    "second": 1e6,
    "ms": 1e3,
    "msecond": 1e3,
    "us": 1.0,
    "usecond": 1.0,
    "ns": 1e-3,
    "nsecond": 1e-3,
}


def _name(signature: str) -> str:
    """A kernel's name from its signature ``name<template args>(parameters)``: the text before
    the parenthesis that opens the parameter list (names may hold parentheses of their own, as
    in ``(anonymous namespace)::``); a name without a parameter list (cuBLAS's, cuDNN's) as it
    is."""
    if not signature.endswith(")"):
        return signature
    depth = 0
    for i in range(len(signature) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(signature[i], 0)
        if depth == 0:
            return signature[:i].strip()
    return signature


def summarize(text: str) -> dict:
    """Kernels of an ncu text report with ``gpu__time_duration.sum``: ``{"kernels": n,
    "gpu_us": total, "by_kernel": [[name, us, count], ...]}``, longest first.

    Raises:
        ValueError: the report holds no such metric (not an ncu report of it), a time in a unit
            not known here, or a time with no kernel line before it.
    """
    name, total, count = None, collections.Counter(), collections.Counter()
    for line in text.splitlines():
        m = _KERNEL.match(line)
        if m:
            name = _name(m.group(1))
        m = _TIME.search(line)
        if m and name is None:
            raise ValueError(f"a time with no kernel line before it: {line.strip()}")
        if m:
            unit = m.group(1)
            if unit not in _UNITS:
                raise ValueError(f"unknown time unit {unit!r} in: {line.strip()}")
            total[name] += float(m.group(2).replace(",", "")) * _UNITS[unit]
            count[name] += 1
            name = None
    if not total:
        raise ValueError(
            "no gpu__time_duration.sum figures: give the text that ncu printed with "
            "--metrics gpu__time_duration.sum"
        )
    return {
        "kernels": sum(count.values()),
        "gpu_us": sum(total.values()),
        "by_kernel": [[k, v, count[k]] for k, v in total.most_common()],
    }


def profile(plan: str, document_tokens: int) -> None:
    """Answer the cold, filling and warm requests; profile the warm one (see the module)."""
    import numpy as np
    from strata.benchmarks.prefix_inprocess import run
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan
    from strata.executor.serving import ServingEngine

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SystemExit(
            f"benchmarks/kernels/pass_kernels.py needs NVIDIA's driver (libcuda.so.1): {e}"
        ) from e
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()

    def reset() -> None:
        if not serving.reset_prefix_cache():
            raise SystemExit("the prefix cache could not be reset: a request is still running")

    def profiler(call: str) -> None:
        status = getattr(cuda, call)()
        if status != 0:
            raise SystemExit(f"{call} failed with CUresult {status}: is ncu attached?")

    try:
        rng = np.random.default_rng(0)
        vocab = serving.vocab_size
        doc = rng.integers(0, vocab, document_tokens).tolist()
        for i in range(3):  # two unprofiled rounds build the kernels; the third is profiled
            a, b = (doc + rng.integers(0, vocab, 16).tolist() for _ in range(2))
            reset()
            run(serving, [a], 1)  # the document's blocks cached
            if i == 2:
                profiler("cuProfilerStart")
            warm = run(serving, [b], 1)[2][0]  # suffix B's ids never read before
            if i == 2:
                profiler("cuProfilerStop")
            reset()
            cold = run(serving, [b], 1)[2][0]
        same = "equal" if warm == cold else f"DIFFERENT (cold {cold}, warm {warm})"
        print(f"warm request's first token {same} to the cold answer's", flush=True)
    finally:
        serving.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", nargs="?")
    ap.add_argument("--document-tokens", type=int, default=1000)
    ap.add_argument("--summarize", metavar="NCU_TEXT", help="sum an ncu report by kernel")
    ap.add_argument("-o", "--output", help="with --summarize: write the summary as JSON")
    args = ap.parse_args()
    if args.summarize and args.plan:
        ap.error("give a PLAN to profile or --summarize NCU_TEXT, not both")
    if args.output and not args.summarize:
        ap.error("-o writes --summarize's figures: give --summarize NCU_TEXT")
    if args.summarize:
        try:
            res = summarize(Path(args.summarize).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--summarize {args.summarize}: {e}") from e
        if args.output:
            Path(args.output).write_text(json.dumps(res, indent=1))
        print(f"{res['kernels']} kernels, {res['gpu_us'] / 1e3:.2f} ms of GPU time")
        for name, us, n in res["by_kernel"][:25]:
            print(f"{us:10.1f} us {n:5d} x  {name}")
        return
    if not args.plan:
        ap.error("give a PLAN to profile, or --summarize NCU_TEXT")
    profile(args.plan, args.document_tokens)


if __name__ == "__main__":
    main()
