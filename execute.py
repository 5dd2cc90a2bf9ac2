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

    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
