#!/usr/bin/env python
"""The GGUF fuzz campaign of issue 35: N mutated headers of seed models, each opened, described
and given a tokenizer in a worker process; counts of outcomes and every failure.

A failure is a traceback (any exception but a one-line ``StrataError``), a mutant over the CPU
bound (``--cpu-s``, default 10) or one whose worker's peak memory passes ``--max-rss-gib``
(default 2). Seeds: two tiny synthetic Llamas (tied Q4_0, untied F32) and, when the catalog has
SmolLM2-135M (fetched once), it and tiny gemma3 and qwen3moe models with its tokenizer; more with
``--seed FILE``. Exit status 1 when anything failed.

    .venv/bin/python scripts/fuzz_gguf.py --mutants 10000 --jobs 2
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fixtures")]


def _seeds(extra: list[Path], folder: Path) -> list[Path]:
    from gguf_factory import write_arch_model, write_tiny_llama

    seeds = [
        write_tiny_llama(folder / "tied.gguf"),
        write_tiny_llama(folder / "untied.gguf", tied=False, seed=1),
    ]
    try:
        from strata.common.catalog import resolve_model

        cached = Path(resolve_model("smollm2-135m", progress=False).path)
        seeds.append(cached)
        # With SmolLM2's tokenizer: a windowed model and a mixture of experts.
        seeds.append(write_arch_model(folder / "gemma3.gguf", "gemma3", cached))
        seeds.append(write_arch_model(folder / "moe.gguf", "qwen3moe", cached))
    except Exception as e:  # noqa: BLE001 - offline: the synthetic seeds still run
        print(f"smollm2-135m not used as a seed: {e}", file=sys.stderr)
    return seeds + extra


def _work(job: tuple[int, int, list[str], float, float]) -> list[tuple[str, str, str, float]]:
    """Worker: mutants [first, first + count) (the seed of mutant i is i), one file at a time;
    (kind, what, detail, cpu_s) of each that failed, and ("ok", kind, "", cpu_s) of the others."""
    from gguf_bytes import read_parts
    from gguf_fuzz import mutant, try_file
    from strata.common.gguf_file import open_gguf

    first, count, seeds, cpu_bound, max_rss = job
    logging.disable(logging.WARNING)  # the tokenizer's warnings about odd ids: not outcomes
    loaded = []
    for s in seeds:
        g = open_gguf(s)
        loaded.append((read_parts(Path(s)), Path(s).read_bytes(), g.data_offset))
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        for i in range(first, first + count):
            rng = random.Random(i)
            parts, raw, header_end = loaded[i % len(loaded)]
            what = f"#{i} seed {i % len(loaded)}: " + mutant(parts, raw, header_end, rng, path)
            r = try_file(path)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if r.kind == "traceback":
                out.append(("traceback", what, r.detail[:300], r.cpu_s))
            elif r.cpu_s > cpu_bound:
                out.append(("slow", what, r.detail[:300], r.cpu_s))
            elif rss > max_rss:
                out.append(("memory", what, f"peak RSS {rss / 2**30:.2f} GiB", r.cpu_s))
                break  # the worker's peak stays high: the rest of its share cannot be judged
            else:
                out.append(("ok", r.kind, "", r.cpu_s))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=int, default=10000)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--cpu-s", type=float, default=10.0, help="CPU seconds allowed per mutant")
    ap.add_argument("--max-rss-gib", type=float, default=2.0)
    ap.add_argument("--seed", type=Path, action="append", default=[], help="another seed GGUF")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        seeds = [str(s) for s in _seeds(args.seed, Path(d))]
        chunk = 250  # a fresh worker per chunk: one mutant's peak memory does not hide others'
        jobs = [
            (i, min(chunk, args.mutants - i), seeds, args.cpu_s, args.max_rss_gib * 2**30)
            for i in range(0, args.mutants, chunk)
        ]
        start = time.monotonic()
        counts: dict[str, int] = {}
        failures = []
        slowest = 0.0
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
            for res in pool.imap_unordered(_work, jobs):
                for kind, what, detail, cpu in res:
                    slowest = max(slowest, cpu)
                    key = what if kind == "ok" else kind
                    counts[key] = counts.get(key, 0) + 1
                    if kind != "ok":
                        failures.append(f"{kind}: {what}: {detail} ({cpu:.2f} CPU-s)")
    total = sum(counts.values())
    print(f"{total} mutants of {len(seeds)} seeds in {time.monotonic() - start:.0f} s")
    for k in ("accepted", "clean", "traceback", "slow", "memory"):
        print(f"  {k}: {counts.get(k, 0)}")
    print(f"  slowest mutant: {slowest:.2f} CPU-s")
    for f in failures[:50]:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
