#!/usr/bin/env python3
"""The plan against the obvious rule: for each bench model, ``strata bench PLAN --baseline``
measures the ILP's plan and the baseline rule's plan (first blocks resident in order, the rest
on the next tier: llama.cpp's -ngl/--fit) for the same model, machine and budgets, alternated
in one process, each text checked against the all-resident run.

Models, each planned with gpu and ram budgets of a share of its MLX bytes, so that it streams:
the real SmolLM2-135M at 60% (a quarter leaves no room for its 30 MiB embedding beside the KV
cache); a synthetic Llama-3.2-1B shape (Q4_0) and the synthetic Mixtral-shaped MoE of
``moe_streaming.py`` (skewed routing) at a quarter. Prints and writes one JSON summary: per model
the measured decode and prefill tok/s of both plans, their ratio, and both predictions.

Usage (from the project root):
``python -m strata.benchmarks.versus_baseline --profile profiles/dev-linux-cpu.yaml
--out /tmp/versus``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from strata.benchmarks.streamed_plans import (
    CONTEXT,
    model_mlx_bytes,
    run_strata,
    streaming_parser,
)

MODELS = {
    "smollm2-135m": (None, 0.6),
    "llama3-1b-shape": (["--shape", "llama3-1b", "--ftype", "Q4_0"], 0.25),
    "mixtral-bench-shape": (["--shape", "mixtral-bench", "--routing", "skewed"], 0.25),
}
"""Bench model -> (``strata synth`` options, None for the catalog model of that name; the share
of its MLX bytes given to each of the gpu and ram tiers)."""

KEYS = ("decode_tok_s", "prefill_tok_s", "predicted_decode_tok_s", "check_passed", "tiers")


def main(argv: list[str] | None = None) -> int:
    p = streaming_parser(__doc__.splitlines()[0], tokens=16)
    p.add_argument("--models", default=",".join(MODELS), help="which bench models")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    plan = ["plan", "--profile", args.profile, "--context", CONTEXT]
    summary: dict = {"profile": args.profile, "tokens": args.tokens}
    for name in args.models.split(","):
        synth, share = MODELS[name]
        model = name if synth is None else str(out / f"{name}.gguf")
        if synth is not None and not Path(model).exists():
            run_strata("synth", *synth, *tok, "-o", model)
        resident = out / f"{name}-resident.yaml"
        run_strata(*plan, "--model", model, "-o", str(resident))
        model_bytes = model_mlx_bytes(resident)
        budget = int(model_bytes * share)
        budgets = ["--gpu-budget", str(budget), "--ram-budget", str(budget), "--tiers", args.tiers]
        streamed = out / f"{name}-streamed.yaml"
        run_strata(*plan, "--model", model, *budgets, "-o", str(streamed))
        result = out / f"{name}.bench.json"
        run_strata(
            "bench", str(streamed), "--baseline", "--max-tokens", str(args.tokens),
            "-o", str(result),
        )  # fmt: skip
        r = json.loads(result.read_text())
        b = r["baseline"]
        summary[name] = {
            "model_mlx_bytes": model_bytes,
            "device_budget": budget,
            "plan": {k: r.get(k) for k in KEYS},
            "baseline": {k: b.get(k) for k in KEYS if k != "check_passed"},
            "texts_checked": r["check_passed"],  # every run of both plans (bench's check)
            "plan_decode_tok_s_runs": b["plan_decode_tok_s_runs"],
            "baseline_decode_tok_s_runs": b["decode_tok_s_runs"],
            "median_plan_decode_tok_s": b["plan_decode_tok_s"],
            "median_baseline_decode_tok_s": b["decode_tok_s"],
            "plan_over_baseline_decode": b["plan_over_baseline_decode"],
            "plan_over_baseline_prefill": b["plan_over_baseline_prefill"],
            "predicted_plan_over_baseline": round(
                r["predicted_decode_tok_s"] / b["predicted_decode_tok_s"], 3
            ),
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
