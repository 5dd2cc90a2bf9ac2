#!/usr/bin/env python3
"""Time to first token of one long prompt over a cluster plan, its prefill chunks flowing through
the ranks against lock-step, in one process tree (the same ranks, the same loaded weights).

Rank 0's pipeline is switched between requests (``Pipeline.flow``, what ``STRATA_PIPELINE_FLOW``
sets at start), the prefix cache reset before each, the two ways interleaved round by round after
one short warm-up request each. The prompt is the first ``--tokens`` tokens of a text file (this
repository's docs/clusters.md by default); ``--max-tokens`` greedy tokens follow. Checks: every
request's text is the same (flowing changes when rank 0 waits, not what any rank computes), and a
flowing request flowed ``chunks - 1`` passes.

usage: python benchmarks/cluster_ttft.py PLAN [--rounds 3] [--tokens 1000] [--max-tokens 8]
       [--text FILE] [-o FILE.json]

Figures: docs/clusters.md (Running it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from strata.benchmarks.bench import write_result
from strata.benchmarks.http_bench import machine_info
from strata.executor.generate import generate, started_engine
from strata.executor.plan_loader import peek_plan
from strata.executor.sampling import SamplingParams
from strata.executor.tokenizer import GGUFTokenizer

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "docs" / "clusters.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", help="a cluster plan (strata plan --cluster)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="where the prompt comes from")
    ap.add_argument("-o", "--output", help="result JSON (default: stdout)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2 or args.max_tokens < 1:
        ap.error("--rounds, --max-tokens >= 1 and --tokens >= 2")
    t0 = time.perf_counter()
    peeked = peek_plan(args.plan)
    tok = GGUFTokenizer.from_gguf(peeked.gguf)
    ids = tok.encode(args.text.read_text())[: args.tokens]
    if len(ids) < args.tokens:
        ap.error(f"{args.text} has only {len(ids)} tokens; give a longer --text")
    greedy = SamplingParams(0.0, 0, 1.0, 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    texts: set[str] = set()
    flowed: list[int] = []
    with started_engine(args.plan, peeked, tok, t0) as st:
        serving = st.serving
        pipe = serving.engine.pipeline
        if pipe is None:
            ap.error(f"{args.plan} is not a cluster plan")
        chunks = -(-len(ids) // serving.prefill_chunk)
        for flow in (True, False):
            pipe.flow = flow
            generate(serving, ids[:128], greedy, 2)
        for r in range(args.rounds):
            for flow in (True, False) if r % 2 else (False, True):
                pipe.flow = flow
                serving.reset_prefix_cache()
                before = pipe.flowed
                g = generate(serving, ids, greedy, args.max_tokens)
                times[flow].append(g.stats["prefill_s"])
                texts.add(tok.decode(g.output_ids))
                if flow:
                    flowed.append(pipe.flowed - before)
                print(f"flow={flow}: prefill {g.stats['prefill_s']:.2f} s", file=sys.stderr)
    result = {
        "kind": "cluster-ttft-flow",
        "plan": str(args.plan),
        "machine": machine_info(),
        "settings": {"rounds": args.rounds, "tokens": len(ids), "max_tokens": args.max_tokens},
        "prefill_chunk": serving.prefill_chunk,
        "chunks": chunks,
        "flow_s": times[True],
        "lockstep_s": times[False],
        "flow_median_s": statistics.median(times[True]),
        "lockstep_median_s": statistics.median(times[False]),
        "flowed_per_request": flowed,
        "texts": sorted(texts),
        "check_passed": len(texts) == 1 and all(n == chunks - 1 for n in flowed),
    }
    write_result(result, args.output, None, None)
    return 0 if result["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
