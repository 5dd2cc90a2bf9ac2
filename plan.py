#!/usr/bin/env python3
"""Strata's planner command line: describe, profile, plan, diff, explain (argument parsing only)."""

from __future__ import annotations

import argparse
import sys

from planner.cli import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plan.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "describe", help="model description (YAML) from a GGUF header or an architecture file"
    )
    d.add_argument("model", nargs="?", help="catalog name (smollm2-135m, gemma3-270m) or GGUF path")
    d.add_argument("--arch", help="instead of MODEL: architecture file (profiles/arch/*.yaml)")
    d.add_argument("--ftype", help="with --arch: llama.cpp file type, e.g. Q4_K_M")
    d.add_argument("-o", "--output", help="write here instead of stdout")

    pr = sub.add_parser("profile", help="measure this machine's hardware profile")
    pr.add_argument("-o", "--output", help="write here instead of stdout")
    pr.add_argument(
        "--name",
        default=None,
        help="profile name (default: the output file's stem, else the host name)",
    )
    pr.add_argument("--disk-dir", default=None, help="folder on the disk to test (default: cache)")
    pr.add_argument("--quick", action="store_true", help="short tests (less accurate)")

    pl = sub.add_parser("plan", help="solve the placement ILP and write a plan")
    pl.add_argument("--model", help="catalog name or GGUF path")
    pl.add_argument("--arch", help="instead of --model: architecture file (profiles/arch/*.yaml)")
    pl.add_argument("--ftype", help="with --arch: llama.cpp file type, e.g. Q4_K_M")
    pl.add_argument(
        "--routing-profile",
        metavar="FILE",
        help="MoE: measured routing (execute.py run --save-routing-profile) in place of uniform "
        "top-k/n expert access",
    )
    pl.add_argument("--profile", required=True, help="hardware profile YAML")
    pl.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    pl.add_argument("--concurrency", type=int, default=1, help="sequences at once (default 1)")
    pl.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    pl.add_argument("--gpu-budget", help="override the device working set, e.g. 512MiB, 8GiB")
    pl.add_argument("--ram-budget", help="override host RAM available, e.g. 8GB")
    pl.add_argument(
        "--tiers", default="gpu,ram,nvme", help="tiers the plan may use (default gpu,ram,nvme)"
    )
    pl.add_argument(
        "--speculative",
        choices=("none", "prompt_lookup", "draft_model", "self"),
        default="none",
        help="speculative decoding: draft tokens from n-grams of the sequence (prompt_lookup), a "
        "smaller model of the same vocabulary (draft_model), or the model's own resident layers "
        "(self); the cost model chooses K (default none)",
    )
    pl.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="with --speculative draft_model: catalog name or GGUF path, planned together with "
        "the target (its weights and KV cache on the device first)",
    )
    pl.add_argument(
        "--num-draft-tokens",
        type=int,
        metavar="K",
        help="draft tokens per step, 1..16 (default: the cost model's choice, 1..8)",
    )
    pl.add_argument(
        "--acceptance-rate",
        type=float,
        metavar="A",
        help="measured share of draft tokens accepted, 0..1 (default: an assumed figure per "
        "method, stated in the plan)",
    )
    pl.add_argument("-o", "--output", required=True, help="plan file to write")

    df = sub.add_parser("diff", help="what differs between two plans")
    df.add_argument("a")
    df.add_argument("b")

    ex = sub.add_parser("explain", help="why each unit is where it is; the bottleneck")
    ex.add_argument("plan")

    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
