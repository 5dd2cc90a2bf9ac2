#!/usr/bin/env python3
"""Strata against llama.cpp on one GGUF, one machine, one process tree: decode tok/s at
concurrency 1 and N, and the ratios (issue 36's acceptance table).

llama.cpp (given its build folder, ``--llama-bin``: ``../shared/tools/llamacpp-cuda-carry.sh``
says how to build it on the lent GPU machine): ``llama-bench -p 0 -n G`` (its ``tg`` tok/s, one
sequence) and ``llama-batched-bench -npp P -ntg G -npl 1,N`` (``S_TG``, the aggregate decode
tok/s of N sequences), both with ``-ngl`` as given (99: every layer on the GPU) and flash
attention on.

Strata, in this process, on a plan of the same GGUF (``--plan``): one engine (weights loaded once),
then for each variant (``pipelined``: as shipped, each greedy step launched while the one before
computes; ``sync``: ``pipelined_steps`` off, every step's tokens read before the next is built;
``lone-kernel``: pipelined, and a lone decode attends with the paged kernel, so that its pass is
compiled (the default since 2026-12-08); ``sdpa``: pipelined, a lone decode through MLX's SDPA,
eager; ``compiled-all``: the paged kernel, and passes of any number of sequences compiled;
``mlx-matvec`` and ``mlx-matvec-sync``: a lone decode's products through MLX's quantized matvec,
not Strata's one-row kernel; ``mapped``: pipelined, the staged inputs kept in host memory mapped
for the GPU, ``mapped_inputs``) a serving engine
with its warm-up, a short warm round, then for each concurrency c: c requests of P random prompt
tokens (seeded) and G greedy tokens each, submitted at once. Its ``decode_tok_s`` is llama-batched-
bench's ``S_TG`` measured the same way: the tokens the requests emit after the last of them has its
first token, over the time from then to the last token. Also the TPOT (median over requests of
(last - first token time) / (tokens - 1)).

Checks: each variant's greedy ids equal the first variant's at the same concurrency (pipelining
changes when the host reads tokens, not what the device computes; a compiled pass replays the eager
pass's operations; the paged kernel and SDPA may round differently, so the kernel variants' ids may
part at a near-tie); the result says which differ (``check_passed``). Predicted tok/s: the cost
model's, from the plan's own decisions and machine figures at each concurrency
(``planner.rescore``).

usage: python -m strata.benchmarks.gpu_vs_llamacpp MODEL.gguf --plan PLAN
       [--llama-bin DIR] [--ngl 99] [--concurrency 1,16] [--prompt-tokens 128]
       [--gen-tokens 128] [--variants pipelined,sync] -o FILE.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from strata.benchmarks.bench import write_result
from strata.benchmarks.http_bench import machine_info
from strata.common.errors import StrataError
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import GenerationRequest, ServingEngine, TokenEvent
from strata.planner.rescore import judge


def _no_one_row_kernel(config: RuntimeConfig) -> tuple[int, int]:
    """The plan's range of Strata's own kernels without one row: MLX's matvec takes it."""
    return max(2, config.mma_rows[0]), config.mma_rows[1]


VARIANTS = {
    "pipelined": {"pipelined_steps": True},
    "sync": {"pipelined_steps": False},
    "lone-kernel": {"pipelined_steps": True, "lone_decode_kernel": True},
    "compiled-all": {"pipelined_steps": True, "lone_decode_kernel": True, "max_sequences": 0},
    "mlx-matvec": {"pipelined_steps": True, "mma_rows": _no_one_row_kernel},
    "mlx-matvec-sync": {"pipelined_steps": False, "mma_rows": _no_one_row_kernel},
    "sdpa": {"pipelined_steps": True, "lone_decode_kernel": False},
    "mapped": {"pipelined_steps": True, "mapped_inputs": True},
}
"""Runtime-config overrides of each Strata variant (``executor.config.RuntimeConfig``; a
callable value is worked out from the plan's config); each variant's serving engine (its KV
cache, its compiled passes) is made afresh over the one loaded model. ``mlx-matvec``: a lone
decode's products through MLX's quantized matvec instead of Strata's one-row kernel
(``executor.cuda_qmv``)."""


def llama_bench(bin_dir: Path, model: Path, ngl: int, gen: int) -> dict:
    """``llama-bench`` text generation of ``gen`` tokens, one sequence: its mean tok/s."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", str(ngl), "-fa", "1"]
    cmd += ["-p", "0", "-n", str(gen), "-r", "3", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    rows = json.loads(done.stdout)
    tg = [r for r in rows if r.get("n_gen") == gen and r.get("n_prompt") == 0]
    return {"command": " ".join(cmd), "tg_tok_s": tg[0]["avg_ts"], "tg_stddev": tg[0]["stddev_ts"]}


def llama_batched_bench(
    bin_dir: Path, model: Path, ngl: int, prompt: int, gen: int, levels: list[int]
) -> dict:
    """``llama-batched-bench``: ``S_TG`` (aggregate decode tok/s) per number of sequences."""
    ctx = max(levels) * (prompt + gen) + 256
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-ngl", str(ngl)]
    cmd += ["-fa", "on", "-c", str(ctx), "-npp", str(prompt), "-ntg", str(gen)]
    cmd += ["-npl", ",".join(map(str, levels)), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    by_level = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            by_level[int(row["pl"])] = {"s_tg": row["speed_tg"], "s_pp": row["speed_pp"]}
    return {"command": " ".join(cmd), "levels": by_level}


def run_level(se: ServingEngine, reqs: list[GenerationRequest]) -> dict:
    """Submit ``reqs`` at once; their ids, decode tok/s (``S_TG``'s way) and TPOT."""
    times: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    left, done = [len(reqs)], threading.Event()
    errors: list[str] = []

    def on_event(ev: TokenEvent) -> None:
        now = time.perf_counter()
        times[ev.request_id].extend([now] * len(ev.token_ids))
        ids[ev.request_id] += ev.token_ids
        if ev.finish_reason is not None:
            if ev.error:
                errors.append(ev.error)
            left[0] -= 1
            if not left[0]:
                done.set()

    t0 = time.perf_counter()
    for r in reqs:
        se.submit(r, on_event)
    if not done.wait(1800):
        raise StrataError("the requests did not finish within 30 minutes")
    if errors:
        raise StrataError(f"a request failed: {errors[0]}")
    start = max(t[0] for t in times.values())  # every request has its first token
    end = max(t[-1] for t in times.values())
    after = sum(1 for t in times.values() for x in t if x > start)
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "ids": [ids[r.request_id] for r in reqs],
        "decode_tok_s": round(after / (end - start), 2) if end > start else None,
        "tpot_s": round(statistics.median(tpot), 6) if tpot else None,
        "ttft_max_s": round(start - t0, 4),
        "wall_s": round(end - t0, 3),
    }


def strata_levels(
    plan: Path, variants: list[str], levels: list[int], prompt: int, gen: int
) -> tuple[dict, dict]:
    """Every variant at every concurrency (module docstring); the engine's load figures."""
    loaded = load_plan(plan)
    base = RuntimeConfig.build(loaded.plan.runtime)
    t = time.perf_counter()
    engine = Engine(loaded, config=base)
    load = {"load_s": round(time.perf_counter() - t, 2)}
    vocab = loaded.desc.architecture.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=prompt).tolist() for _ in range(max(levels))]
    out: dict = {}
    try:
        for name in variants:
            # The serving engine reads the engine's config, the forward pass the model's.
            overrides = {k: v(base) if callable(v) else v for k, v in VARIANTS[name].items()}
            engine.config = engine.model.config = base.replace(**overrides)
            se = ServingEngine(engine)
            load[f"{name}_warm_up_s"] = round(se.start(), 2)
            try:
                warm = [GenerationRequest("w", prompts[0][:16], 8, SamplingParams(), True)]
                run_level(se, warm)
                out[name] = {}
                for c in levels:
                    reqs = [
                        GenerationRequest(
                            f"{name}-{c}-{i}", prompts[i], gen, SamplingParams(), True
                        )
                        for i in range(c)
                    ]
                    before = se.metrics()
                    res = run_level(se, reqs)
                    after = se.metrics()
                    res["steps"] = after["steps"] - before["steps"]
                    res["pipelined_steps"] = after["pipelined_steps"] - before["pipelined_steps"]
                    out[name][c] = res
                    print(
                        f"strata {name} c={c}: {res['decode_tok_s']} tok/s, TPOT "
                        f"{res['tpot_s']} s, {res['pipelined_steps']}/{res['steps']} pipelined",
                        file=sys.stderr,
                    )
            finally:
                se.close()
    finally:
        engine.close()
    return out, load


def predicted(plan: Path, levels: list[int]) -> dict[int, float | None]:
    """The cost model's decode tok/s of the plan's decisions at each concurrency."""
    p = load_plan(plan).plan
    got = {}
    for c in levels:
        req = p.request.model_copy(update={"concurrency": c})
        pred = judge(p.model_copy(update={"request": req})).view.prediction
        got[c] = round(pred.decode_tok_s, 2) if pred else None
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="the GGUF both run")
    ap.add_argument("--plan", type=Path, required=True, help="Strata's plan of that GGUF")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's bin folder (none: Strata only)")
    ap.add_argument("--ngl", type=int, default=99, help="llama.cpp's GPU layers (default 99)")
    ap.add_argument("--concurrency", default="1,16", help="sequences at once (default 1,16)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--variants", default="pipelined,sync", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("-o", "--output", help="result JSON (default: stdout)")
    args = ap.parse_args(argv)
    levels = sorted({int(x) for x in args.concurrency.split(",")})
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or min(levels) < 1:
        ap.error(f"--variants takes {', '.join(VARIANTS)}; --concurrency positive integers")
    result: dict = {
        "kind": "gpu-vs-llamacpp",
        "model": str(args.model),
        "plan": str(args.plan),
        "machine": machine_info(),
        "settings": {
            "concurrency": levels,
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "ngl": args.ngl,
            "variants": variants,
        },
    }
    if args.llama_bin:
        if not shutil.which(str(args.llama_bin / "llama-bench")):
            ap.error(f"no llama-bench in {args.llama_bin}")
        result["llama_bench"] = llama_bench(args.llama_bin, args.model, args.ngl, args.gen_tokens)
        result["llama_batched_bench"] = llama_batched_bench(
            args.llama_bin, args.model, args.ngl, args.prompt_tokens, args.gen_tokens, levels
        )
    strata, load = strata_levels(args.plan, variants, levels, args.prompt_tokens, args.gen_tokens)
    result["strata_load"] = load
    result["predicted_decode_tok_s"] = predicted(args.plan, levels)
    first = variants[0]
    mismatches = [
        f"{v} c={c} request {i}"
        for v in variants[1:]
        for c in levels
        for i, (a, b) in enumerate(zip(strata[first][c]["ids"], strata[v][c]["ids"], strict=True))
        if a != b
    ]
    result["check_passed"] = not mismatches
    result["mismatches"] = mismatches
    table = []
    for c in levels:
        row: dict = {"concurrency": c}
        ref = None
        if "llama_bench" in result:
            lb = result["llama_batched_bench"]["levels"].get(c, {})
            row["llama_batched_s_tg"] = lb.get("s_tg")
            ref = result["llama_bench"]["tg_tok_s"] if c == 1 else lb.get("s_tg")
            row["llama_reference_tok_s"] = ref
        row["predicted_tok_s"] = result["predicted_decode_tok_s"][c]
        for v in variants:
            got = strata[v][c]["decode_tok_s"]
            row[f"strata_{v}_tok_s"] = got
            if ref and got:
                row[f"strata_{v}_vs_llamacpp"] = round(got / ref, 3)
            if row["predicted_tok_s"] and got:
                row[f"strata_{v}_measured_over_predicted"] = round(got / row["predicted_tok_s"], 3)
        table.append(row)
    result["table"] = table
    result["strata"] = {v: {str(c): r for c, r in lv.items()} for v, lv in strata.items()}
    write_result(result, args.output, None, None)
    for row in table:
        print(json.dumps(row), file=sys.stderr)
    return 0 if result["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
