#!/usr/bin/env python3
"""MoE expert-streaming bench: synthetic MoE models at least 4x the device budget, experts
streamed from NVMe through the expert cache, on a skewed-routing and a uniform-routing model.

For each routing (``strata synth --routing skewed|uniform``, the same shape and weights otherwise):

1. plan the model with a device budget a quarter of its MLX size (uniform expert access: no
   routing profile), and bench it with the three expert-cache modes in one run — (a) ``none``
   (every expert use reads), (b) ``cache`` (the cache alone), (c) ``prefetch`` (cache +
   co-activation prefetch) — reporting hit rate, prefetch accuracy, tok/s, misses and bytes per
   token, each run's ids checked against the all-resident run;
2. skewed model only, twice: measure a routing profile (``strata run
   --save-routing-profile``, ``--profile-tokens`` generated tokens) on (i) a *different* text and
   (ii) the workload itself (the bench's prompt: profile-guided optimization's usual setting, a
   recorded run of the traffic), re-plan with ``strata plan --routing-profile``, bench that plan
   (its own mode, and ``cache`` and ``prefetch``), and set its predicted and measured per-token
   time beside the uniform plan's (and the uniform plan scored under the measured routing, so
   both predictions use the same routing). A synthetic model's routing is a function of the
   token ids, and random weights decode into a loop over a few tokens, so (i) shares little
   with the benched text; (ii) is the profile a user would record.

Writes ``summary.json`` in ``--out``. Usage (from the project root):
``python benchmarks/moe_streaming.py --profile profiles/dev-linux-cpu.yaml --out /tmp/moe-bench``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from strata.benchmarks.streamed_plans import (
    CONTEXT,
    model_mlx_bytes,
    quarter_budget,
    run_strata,
    streaming_parser,
)

BENCH_PROMPT = "The history of the city begins in the early middle ages, when"
PROFILE_TEXT = (
    "Mixture-of-experts language models route every token to a few experts per layer. "
    "A router scores the experts, the top ones run, and their outputs are mixed by the "
    "router's weights. Which experts fire depends on the text, and it repeats across layers."
)


_MODE_KEYS = (
    "decode_tok_s", "hit_rate", "prefetch_accuracy", "misses_per_token",
    "prefetch_issued_per_token", "streamed_bytes_per_token", "io_wait_s_per_token",
)  # fmt: skip
"""Per expert-cache mode figures kept in the summary."""


def _bench(plan: Path, out: Path, tokens: int, modes: str | None) -> dict:
    result = out / f"{plan.stem}.bench.json"
    extra = ["--expert-cache-modes", modes] if modes else []
    run_strata(
        "bench", str(plan), "--max-tokens", str(tokens), "--prompt", BENCH_PROMPT,
        *extra, "-o", str(result),
    )  # fmt: skip
    return json.loads(result.read_text())


def _pinned_share(ex: dict) -> float | None:
    """Share of expert uses served by pinned experts."""
    uses = ex.get("uses_gpu", 0) + ex.get("hits", 0) + ex.get("misses", 0)
    return round(ex.get("uses_gpu", 0) / uses, 4) if uses else None


def _rescored(plan_path: Path, profile_path: Path, routing: Path) -> float:
    """The step time the cost model predicts for ``plan_path`` under the measured routing."""
    from strata.common.describe import describe
    from strata.common.schemas import HardwareProfile, Plan
    from strata.common.yamlio import read_yaml
    from strata.planner.costmodel import score_plan
    from strata.planner.routing import apply_routing_profile, read_routing_profile

    plan = read_yaml(plan_path, Plan)
    desc, _ = describe(plan.model.path or "")
    desc = apply_routing_profile(desc, read_routing_profile(routing))
    return score_plan(plan, desc, read_yaml(profile_path, HardwareProfile)).step_s


def _replan(
    out: Path,
    plan: list[str],
    budgets: list[str],
    model: Path,
    uniform_plan: Path,
    r: dict,
    profile: Path,
    prompt: str,
    tokens: int,
    profile_tokens: int,
    source: str,
) -> dict:
    """Measure a routing profile on ``prompt`` with the uniform plan, re-plan with it, bench the
    re-planned plan (its own mode, then ``cache`` and ``prefetch``), and set its predicted and
    measured per-token time beside the uniform plan's (``r``, benched in the same run)."""
    rp = out / f"skewed.{source}.routing.json"
    run_strata(
        "run", str(uniform_plan), "--prompt", prompt,
        "--max-tokens", str(profile_tokens), "--save-routing-profile", str(rp), "--json",
    )  # fmt: skip
    profiled = out / f"skewed-{source}-profiled-plan.yaml"
    run_strata(
        *plan, "--model", str(model), *budgets, "--routing-profile", str(rp), "-o", str(profiled)
    )
    r2 = _bench(profiled, out, tokens, "cache,prefetch")
    ec = yaml.safe_load(profiled.read_text())["expert_cache"]
    keys = _MODE_KEYS
    return {
        "profile_prompt": prompt,
        "profile_tokens": profile_tokens,
        "uniform_plan_predicted_s_per_token": round(1 / r["predicted_decode_tok_s"], 6),
        "uniform_plan_predicted_under_profile_s_per_token": round(
            _rescored(uniform_plan, profile, rp), 6
        ),
        "profiled_plan_predicted_s_per_token": round(1 / r2["predicted_decode_tok_s"], 6),
        "uniform_plan_measured_s_per_token": round(1 / r["decode_tok_s"], 6),
        "profiled_plan_measured_s_per_token": round(1 / r2["decode_tok_s"], 6),
        "measured_speedup": round(r2["decode_tok_s"] / r["decode_tok_s"], 4),
        "profiled_plan_hit_rate": r2.get("experts", {}).get("hit_rate"),
        "profiled_plan_pinned_use_share": _pinned_share(r2.get("experts", {})),
        "uniform_plan_hit_rate": r.get("experts", {}).get("hit_rate"),
        "profiled_plan_modes": {
            m: {k: v[k] for k in keys} for m, v in r2["expert_cache_modes"].items()
        },
        "profiled_plan_pinned_experts": len(ec["pinned"]),
        "profiled_plan_preloaded_experts": len(ec["preload"]),
        "profiled_plan_cache_slots": ec["slots"],
        "check_passed": r2["check_passed"],
    }


def main(argv: list[str] | None = None) -> int:
    p = streaming_parser(__doc__.splitlines()[0], tokens=32)
    p.add_argument("--shape", default="mixtral-bench", help="synth.py MoE preset")
    p.add_argument(
        "--routings", default="skewed,uniform", help="models to bench: skewed, uniform or both"
    )
    p.add_argument(
        "--profile-tokens", type=int, default=256, help="tokens of each routing-profile run (256)"
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    plan = ["plan", "--profile", args.profile, "--context", CONTEXT]
    summary: dict = {"profile": args.profile, "shape": args.shape}
    modes_keys = _MODE_KEYS
    for routing in args.routings.split(","):
        model = out / f"moe-{routing}.gguf"
        if not model.exists():
            run_strata("synth", "--shape", args.shape, "--routing", routing, *tok, "-o", str(model))
        resident = out / f"{routing}-resident.yaml"
        run_strata(*plan, "--model", str(model), "-o", str(resident))
        model_bytes = model_mlx_bytes(resident)
        budget, budgets = quarter_budget(model_bytes, args.tiers)
        uniform_plan = out / f"{routing}-uniform-plan.yaml"
        run_strata(*plan, "--model", str(model), *budgets, "-o", str(uniform_plan))
        r = _bench(uniform_plan, out, args.tokens, "none,cache,prefetch")
        s = {
            "model_mlx_bytes": model_bytes,
            "device_budget": budget,
            "budget_ratio": round(model_bytes / budget, 2),
            "plan_expert_cache": yaml.safe_load(uniform_plan.read_text())["expert_cache"]["slots"],
            "predicted_decode_tok_s": r["predicted_decode_tok_s"],
            "predicted_expert_hit_rate": r.get("predicted_expert_hit_rate"),
            "plan_decode_tok_s": r["decode_tok_s"],
            "resident_decode_tok_s": r["resident_decode_tok_s"],
            "check_passed": r["check_passed"],
            "read_method": r["read_method"],
            "modes": {m: {k: v[k] for k in modes_keys} for m, v in r["expert_cache_modes"].items()},
        }
        if routing == "skewed":
            s["replanned"] = {
                source: _replan(
                    out, plan, budgets, model, uniform_plan, r, Path(args.profile), prompt,
                    args.tokens, args.profile_tokens, source,
                )
                for source, prompt in (("other_text", PROFILE_TEXT), ("workload", BENCH_PROMPT))
            }  # fmt: skip
        summary[routing] = s
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
