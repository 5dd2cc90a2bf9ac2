#!/usr/bin/env python3
"""Decode of several concurrent greedy requests over a cluster plan, its steps whole (lock-step)
against cut into micro-batches flowing through the ranks, in one process tree (the same ranks,
the same loaded weights).

Rank 0's pipeline is switched between rounds (``Pipeline.micro_batches``, what
``STRATA_DECODE_MICRO_BATCHES`` sets at start), the prefix cache reset before each, the ways
interleaved round by round (their order reversed every other round) after one short warm-up
round each. Each round submits ``--requests`` prompts at once (one thread each: the engine
batches them) and times them from the first submit to the last token; its decode rate is every
request's tokens after its first over the time from the last request's first token to the end.
The prompts are consecutive ``--tokens``-token pieces of a text file (this repository's
docs/clusters.md by default), or ``--prompt-ids``. Checks: every request's ids are the same
whatever the micro-batches (rows of different sequences are independent), micro-batched passes
ran for every way but 1 and none for 1.

usage: python benchmarks/cluster_decode.py PLAN [--micro-batches 1,2,4] [--requests 4]
       [--tokens 32] [--max-tokens 32] [--rounds 3] [--prompt-ids 1,2;3,4] [-o FILE.json]

Figures: docs/clusters.md (Running it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from strata.benchmarks.bench import write_result
from strata.benchmarks.http_bench import machine_info
from strata.executor.generate import Generation, generate, started_engine
from strata.executor.plan_loader import peek_plan
from strata.executor.sampling import SamplingParams
from strata.executor.tokenizer import GGUFTokenizer

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "docs" / "clusters.md"


def _round(
    serving, prompts: list[list[int]], max_tokens: int
) -> tuple[list[Generation], float, float]:
    """Every prompt submitted at once, greedy: (the generations in prompt order, seconds from
    the first submit to the last token, aggregate decode tokens/s after the last first token)."""
    greedy = SamplingParams(0.0, 0, 1.0, 0)
    out: list[Generation | BaseException | None] = [None] * len(prompts)
    submitted = [0.0] * len(prompts)

    def one(i: int) -> None:
        submitted[i] = time.perf_counter()
        try:
            out[i] = generate(serving, prompts[i], greedy, max_tokens)
        except BaseException as e:  # said by the caller, with the request's index
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gens: list[Generation] = []
    for i, g in enumerate(out):
        if not isinstance(g, Generation):
            raise SystemExit(f"error: request {i} failed: {g}")
        gens.append(g)
    # Each request's decode ran from its first token to its end; the batch decodes together
    # from the last first token on.
    firsts = [t + g.stats["prefill_s"] for t, g in zip(submitted, gens, strict=True)]
    ends = [f + g.stats["decode_s"] for f, g in zip(firsts, gens, strict=True)]
    decode_s = max(ends) - max(firsts)
    tokens = sum(len(g.output_ids) - 1 for g in gens)
    return gens, wall, tokens / decode_s if decode_s > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", help="a cluster plan (strata plan --cluster)")
    ap.add_argument("--micro-batches", default="1,2,4", help="the ways compared, e.g. 1,2,4")
    ap.add_argument("--requests", type=int, default=4, help="concurrent requests")
    ap.add_argument("--tokens", type=int, default=32, help="prompt tokens of each request")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="where the prompts come from")
    ap.add_argument("--prompt-ids", help="the prompts instead: ids, prompts separated by ';'")
    ap.add_argument("-o", "--output", help="result JSON (default: stdout)")
    args = ap.parse_args(argv)
    try:
        ways = [int(w) for w in args.micro_batches.split(",")]
    except ValueError:
        ap.error(f"--micro-batches {args.micro_batches!r}: give whole numbers, e.g. 1,2,4")
    if not ways or min(ways) < 1 or args.rounds < 1 or args.max_tokens < 2 or args.requests < 1:
        ap.error("--micro-batches >= 1, --rounds, --requests >= 1 and --max-tokens >= 2")
    t0 = time.perf_counter()
    peeked = peek_plan(args.plan)
    tok = GGUFTokenizer.from_gguf(peeked.gguf)
    if args.prompt_ids:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids.split(";")]
    else:
        ids = tok.encode(args.text.read_text())
        n = args.tokens
        prompts = [ids[i * n : (i + 1) * n] for i in range(args.requests)]
        if len(prompts[-1]) < n:
            ap.error(f"{args.text} has only {len(ids)} tokens; give a longer --text")
    walls: dict[int, list[float]] = {m: [] for m in ways}
    rates: dict[int, list[float]] = {m: [] for m in ways}
    passes: dict[int, list[int]] = {m: [] for m in ways}
    outputs: dict[int, set[tuple[tuple[int, ...], ...]]] = {m: set() for m in ways}
    with started_engine(args.plan, peeked, tok, t0) as st:
        serving = st.serving
        pipe = serving.engine.pipeline
        if pipe is None:
            ap.error(f"{args.plan} is not a cluster plan")
        started = pipe.micro_batches  # the plan's, or STRATA_DECODE_MICRO_BATCHES
        for m in ways:  # warm-up: a short round each
            pipe.micro_batches = m
            _round(serving, [p[:8] for p in prompts], 2)
        for r in range(args.rounds):
            for m in ways if r % 2 == 0 else ways[::-1]:
                pipe.micro_batches = m
                serving.reset_prefix_cache()
                before = pipe.micro_batched
                gens, wall, rate = _round(serving, prompts, args.max_tokens)
                walls[m].append(wall)
                rates[m].append(rate)
                passes[m].append(pipe.micro_batched - before)
                outputs[m].add(tuple(tuple(g.output_ids) for g in gens))
                print(
                    f"micro-batches {m}: {wall:.2f} s, decode {rate:.2f} tok/s, "
                    f"{passes[m][-1]} micro-batched passes",
                    file=sys.stderr,
                )
    every = set().union(*outputs.values())
    result = {
        "kind": "cluster-decode-microbatch",
        "plan": str(args.plan),
        "machine": machine_info(),
        "settings": {
            "requests": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "micro_batches": ways,
        },
        "request": st.loaded.plan.request.model_dump(mode="json"),
        "planned_micro_batches": _planned(st.loaded.plan),
        "started_micro_batches": started,
        "wall_s": {str(m): walls[m] for m in ways},
        "decode_tok_s": {str(m): rates[m] for m in ways},
        "decode_tok_s_median": {str(m): statistics.median(rates[m]) for m in ways},
        "wall_s_median": {str(m): statistics.median(walls[m]) for m in ways},
        "micro_batched_passes": {str(m): passes[m] for m in ways},
        "output_ids": [list(o) for o in next(iter(every))] if len(every) == 1 else None,
        "texts": sorted({tok.decode(list(o)) for run in every for o in run}),
        "check_passed": len(every) == 1
        and all((n > 0) == (m > 1) for m in ways for n in passes[m]),
    }
    write_result(result, args.output, None, None)
    return 0 if result["check_passed"] else 1


def _planned(plan) -> int:
    """The plan's own choice of micro-batches (1 where it has no cluster prediction)."""
    c = plan.cluster
    return c.prediction.micro_batches if c is not None and c.prediction is not None else 1


if __name__ == "__main__":
    sys.exit(main())
