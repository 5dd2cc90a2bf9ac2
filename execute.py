#!/usr/bin/env python3
"""Strata's executor command line: run a plan (argument parsing only)."""

from __future__ import annotations

import argparse
import sys

from executor.cli import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="execute.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text from a prompt with a plan")
    r.add_argument("plan", help="plan file written by plan.py plan (or by hand)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text, tokenized with the GGUF's own BOS rule")
    src.add_argument("--messages", help='JSON file: [{"role": ..., "content": ...}, ...]')
    src.add_argument("--prompt-ids", help="token ids as they are, e.g. 1,2,3")
    r.add_argument("--chat-template", help="Jinja chat template file (default: the GGUF's)")
    r.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (256)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    r.add_argument(
        "--expert-cache",
        choices=("none", "cache", "prefetch"),
        help="MoE expert cache mode for streamed experts: none (every use reads), cache (the cache "
        "alone), prefetch (cache + co-activation prefetch); default: the plan's",
    )
    r.add_argument(
        "--save-routing-profile",
        metavar="FILE",
        help="MoE: write the measured routing (JSON) for plan.py plan --routing-profile",
    )

    b = sub.add_parser("bench", help="measure a plan: tok/s, disk bytes/s, I/O wait, memory")
    b.add_argument("plan")
    b.add_argument("--prompt", default="The capital of France is", help="prompt text")
    b.add_argument("--max-tokens", type=int, default=64, help="decode steps measured (64)")
    b.add_argument(
        "--check",
        default="resident",
        help="resident (default: ids must equal the all-resident run), none, or a --json file",
    )
    b.add_argument("-o", "--output", help="write the JSON here (default: stdout)")
    b.add_argument("--plot", help="write a PNG plot here")
    b.add_argument(
        "--expert-cache-modes",
        help="MoE: also measure these expert-cache modes in this run, e.g. none,cache,prefetch",
    )
    b.add_argument(
        "--concurrency",
        help="serving bench: start `serve` and measure these concurrency levels over HTTP, e.g. "
        "1,2,4,8 (TTFT, TPOT, aggregate tok/s; --prompt and --check do not apply)",
    )
    b.add_argument(
        "--requests",
        type=int,
        help="serving bench: requests per level (default max(2c, 8) at level c; level 1, the "
        "text reference, runs as many as the largest level)",
    )
    b.add_argument(
        "--prefix-tokens",
        type=int,
        help="serving bench: shared-prefix tokens of the prefix-cache TTFT test (1000; 0 skips it)",
    )
    b.add_argument(
        "--prefix-trials",
        type=int,
        help="serving bench: cold/warm pairs of the prefix-cache test, medians reported "
        "(3 on a GPU, 1 on the CPU)",
    )
    b.add_argument(
        "--prompt-tokens",
        help="serving bench: prompt lengths in tokens, cycled over the requests "
        "(default 48,96,160,256,64,128,200,32)",
    )
    b.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serving bench: start `serve --batch-invariant`",
    )
    b.add_argument(
        "--near-tie-gap",
        type=float,
        help="serving bench: a text that leaves its concurrency-1 text by taking the runner-up "
        "where the top-2 logit gap is below this passes as a near-tie flip (default 0.5, or 1.0 "
        "for a random-weight synthetic model; 0 makes every difference an error)",
    )

    s = sub.add_parser("serve", help="serve a plan over an OpenAI-compatible HTTP API")
    s.add_argument("plan", help="plan file written by plan.py plan (or by hand)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (8000; 0 = any free port)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache (default: no "
        "key; /health and /metrics are open)",
    )
    s.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model's name in requests and /v1/models (default: the catalog name, else the "
        "GGUF file's stem)",
    )
    s.add_argument(
        "--batch-invariant",
        action="store_true",
        help="greedy outputs identical alone and in any batch, with or without a prefix-cache "
        "hit, on every backend (prefill and decodes in 16-row tiles, attention per KV block); "
        "no speculative decoding",
    )

    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
