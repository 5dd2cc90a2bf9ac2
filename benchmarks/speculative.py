#!/usr/bin/env python3
"""Speculative-decoding bench: decode tok/s without speculation and with each drafter.

Per task and placement, in one process, every drafter's ids checked against plain greedy
decoding.

Tasks (greedy, ``ignore_eos``, ``--tokens`` output tokens, raw text prompts, no chat template):

- ``repetitive``: a code edit — a ~10-line Python function and the request to give it back with
  one variable renamed, the code fence already opened, so the model copies (prompt lookup's case);
- ``free``: free text, the opening of a short story (a sentence to continue).

Placements (plans made with ``strata plan``'s code, ``planner.planning.build_plan``, context
1024, concurrency 1, on ``--profile``):

- ``resident``: the plan as solved;
- ``streamed``: a hand-edited copy (as ``tests/test_tiers._moved``: its profile fingerprint set to
  None) with the FFN units of blocks >= ``--stream-from-block`` S (default: half the blocks)
  moved to the nvme tier, and a pool of ``STREAM_DEPTH`` + 1 slots of the largest FFN with
  ``STREAM_DEPTH`` units of prefetch (the resident plan has no pool), so deep FFNs stream from
  NVMe every forward pass.

Drafters (K = ``--num-draft-tokens`` draft tokens per verification):

- ``prompt_lookup``: ``PromptLookupDrafter()`` (n-grams 1..4);
- ``draft_model``: the model cut to its first ``--draft-blocks`` blocks (``scripts/cut_gguf.py``),
  planned resident with the same request, on its own paged KV cache;
- ``self``: ``SelfDrafter`` on the target's own weights. Streamed placement: every block, skipping
  the streamed units (``streamed_units``: the deep FFNs, whose residual passes through), so
  drafting reads nothing from disk. Resident placement: the first L = floor(3/4 * blocks) blocks
  (early exit; nothing to skip).

One Engine per placement (and one for the draft model) serves every run of that placement: each
run is a fresh ``ServingEngine`` (fresh KV pool and prefix cache, so no run reuses another's
prefix) over the same Engine, stopped without closing the Engine. Per run: TTFT = first token
event - submit; decode tok/s = (tokens - 1) / (last event - first event), i.e. decode only (the
serving engine has no per-request decode timer; a verification step's tokens arrive in one event).
Speedup = decode tok/s / the same (task, placement)'s run without speculation, a ratio within one
process minutes apart (the machine may be shared and noisy); with ``--repeats N`` every
configuration runs N times round-robin and the medians are compared (every run's ids checked).
Before measuring, each placement runs a short warm-up of every configuration (``--warmup``
tokens; MLX CUDA compiles kernels on first use). Also per run: acceptance rate and tokens per
verification step (``spec_stats``), forward passes of the target (``steps``), NVMe bytes read per
output token (``metrics()["bytes_read"]`` delta over the run, prefill included) and per decode
token (after the first token).

Writes ``DIR/summary.json`` (machine, model, plans, the table, checks) and prints a compact table.
Exit status 1 when any drafter's ids differ from the reference (listed in ``mismatches``).

Usage (from the project root):
``python benchmarks/speculative.py --profile profiles/dev-linux-cpu.yaml --out /tmp/spec-bench``;
offline (e.g. the H200): ``--model /path/to/model.gguf``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONTEXT = 1024
STREAM_DEPTH = 2
"""Units of prefetch of the streamed placement (pool slots: depth + 1)."""
DRAFTERS = ("prompt_lookup", "draft_model", "self")
CODE = """def summarize_orders(orders, discount):
    total = 0
    count = 0
    for order in orders:
        if order.status != "cancelled":
            total = total + order.price * order.quantity
            count = count + 1
    if count == 0:
        return 0.0, 0
    total = total * (1 - discount)
    return round(total, 2), count
"""
PROMPTS = {
    "repetitive": (
        "Rename the variable `total` to `amount` in this function and return the whole "
        f"function.\n```python\n{CODE}```\n"
        "Here is the function with `total` renamed to `amount`:\n```python\n"
    ),
    "free": "Once upon a time, in a small village by the sea, there lived",
}


# ---------------------------------------------------------------------- plans and models


def _cut_gguf(model: Path, blocks: int, out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("cut_gguf", ROOT / "scripts" / "cut_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.cut_gguf(str(model), blocks, out)


def _make_plan(model: Path, profile: Path, path: Path) -> Path:
    """``strata plan --model MODEL --profile PROFILE --context 1024 --concurrency 1``."""
    from strata.common.schemas import Request
    from strata.common.yamlio import write_yaml
    from strata.planner.planning import build_plan

    req = Request(context=CONTEXT, concurrency=1)
    write_yaml(build_plan(str(model), profile, req), path)
    return path


def _streamed_copy(resident: Path, out: Path, first_block: int) -> tuple[Path, list[str]]:
    """The resident plan with the FFN units of blocks >= ``first_block`` on the nvme tier."""
    import yaml

    data = yaml.safe_load(resident.read_text())
    moved = []
    for p in data["placement"]:
        m = re.fullmatch(r"blk\.(\d+)\.ffn", p["unit"])
        if m and int(m.group(1)) >= first_block:
            p["tier"] = "nvme"
            moved.append(p)
    if not moved:
        raise SystemExit(f"error: no FFN unit of a block >= {first_block} to stream")
    # The solved resident plan has no pool; give the streamed units a prefetching one.
    data["pool"] = {"slots": STREAM_DEPTH + 1, "slot_bytes": max(p["bytes"] for p in moved)}
    io = max(int(data["prefetch"].get("io_threads") or 0), 2)
    data["prefetch"] = {"depth": STREAM_DEPTH, "io_threads": io}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out, [p["unit"] for p in moved]


def _plan_summary(path: Path) -> dict:
    import yaml

    d = yaml.safe_load(path.read_text())
    tiers: dict[str, int] = {}
    for p in d["placement"]:
        tiers[p["tier"]] = tiers.get(p["tier"], 0) + p["bytes"]
    return {
        "path": str(path),
        "bytes_by_tier": tiers,
        "pool": d["pool"],
        "prefetch": d["prefetch"],
        "batch": d["batch"],
        "runtime": d.get("runtime"),
        "predicted_decode_tok_s": d.get("prediction", {}).get("decode_tok_s"),
    }


# ---------------------------------------------------------------------- runs


def _stop(se) -> None:
    """Stop a ServingEngine's thread without closing its Engine (``ServingEngine.close`` closes
    the Engine too, and the next run of the placement reuses it)."""
    if se._thread is not None and se._thread.is_alive():
        se._inbox.put(("stop", None, None))
        se._thread.join()


def _run(engine, prompt_ids: list[int], tokens: int, drafter_of, k: int, rid: str) -> dict:
    """One request alone on a fresh ServingEngine over ``engine``; its ids and figures."""
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import GenerationRequest, ServingEngine

    holder: list = []
    drafter = drafter_of(holder) if drafter_of else None
    se = ServingEngine(engine, drafter, k if drafter else 0, speculative=False)
    holder.append(se)
    ids: list[int] = []
    times: list[float] = []
    nvme_at_first: list[int] = []
    end: list = []
    done = threading.Event()

    def on_event(ev) -> None:  # on the engine thread: metrics() is safe to read here
        now = time.perf_counter()
        if ev.token_ids:
            if not times:
                nvme_at_first.append(se.metrics()["bytes_read"]["nvme"])
            times.append(now)
            ids.extend(ev.token_ids)
        if ev.finish_reason is not None:
            end.append(ev)
            done.set()

    se.start()
    try:
        m0 = se.metrics()
        t0 = time.perf_counter()
        se.submit(GenerationRequest(rid, prompt_ids, tokens, SamplingParams(), True), on_event)
        if not done.wait(3600):
            raise SystemExit(f"error: request {rid} did not finish within an hour")
        m1 = se.metrics()
        stats = se.spec_stats()
    finally:
        _stop(se)
    ev = end[0]
    if ev.finish_reason not in ("length", "stop"):
        raise SystemExit(f"error: request {rid} ended with {ev.finish_reason}: {ev.error}")
    n = len(ids)
    decode_s = times[-1] - times[0]
    nvme = m1["bytes_read"]["nvme"] - m0["bytes_read"]["nvme"]
    nvme_decode = m1["bytes_read"]["nvme"] - nvme_at_first[0]
    return {
        "ids": ids,
        "output_tokens": n,
        "ttft_s": round(times[0] - t0, 4),
        "decode_s": round(decode_s, 4),
        "decode_tok_s": round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else None,
        "events": len(times),
        "steps": m1["steps"] - m0["steps"],
        "proposed": stats["proposed"],
        "accepted": stats["accepted"],
        "acceptance_rate": stats["acceptance_rate"],
        "tokens_per_verification_step": stats["tokens_per_verification_step"],
        "nvme_bytes_per_output_token": round(nvme / n) if n else 0,
        "nvme_bytes_per_decode_token": round(nvme_decode / (n - 1)) if n > 1 else 0,
    }


def _drafter_factories(engine, draft_engine, self_layers: int):
    """name -> (holder -> drafter) for ``engine``; ``holder[0]`` is the run's ServingEngine."""
    from strata.executor.drafters import DraftModelDrafter, PromptLookupDrafter
    from strata.executor.self_drafter import SelfDrafter, streamed_units

    model = engine.model
    b = engine.loaded.plan.batch
    skip = streamed_units(model.store, self_layers, model.arch.expert_count)
    return {
        "prompt_lookup": lambda h: PromptLookupDrafter(),
        "draft_model": lambda h: DraftModelDrafter(
            draft_engine, b.kv_num_blocks, b.kv_block_size, target=engine
        ),
        "self": lambda h: SelfDrafter(model, lambda: h[0].kv, self_layers, skip),
    }, sorted(skip)


def _measure(engine, ids, tokens, factories, drafters, k, repeats, key) -> tuple:
    """Every configuration (no speculation, then each drafter) ``repeats`` times, round-robin
    (so slow drift of a shared machine hits all alike); rows with the median decode tok/s,
    mismatches against the first run without speculation, and its ids (the reference)."""
    names = ["none", *drafters]
    runs: dict[str, list[dict]] = {d: [] for d in names}
    tag = f"{key['task']}-{key['placement']}"
    for rep in range(repeats):
        for d in names:
            f = None if d == "none" else factories[d]
            runs[d].append(_run(engine, ids, tokens, f, k if f else 0, f"{tag}-{d}-{rep}"))
    ref = runs["none"][0]["ids"]
    base_tok_s = statistics.median(r["decode_tok_s"] or 0 for r in runs["none"])
    rows, bad = [], []
    for d in names:
        first = runs[d][0]
        row = {**key, "drafter": d}
        row |= {name: v for name, v in first.items() if name != "ids"}
        tok_s = [r["decode_tok_s"] or 0 for r in runs[d]]
        row["decode_tok_s"] = round(statistics.median(tok_s), 3)
        row["decode_tok_s_runs"] = tok_s
        row["ttft_s"] = round(statistics.median(r["ttft_s"] for r in runs[d]), 4)
        row["speedup"] = round(row["decode_tok_s"] / base_tok_s, 3) if base_tok_s else None
        differ = [i for i, r in enumerate(runs[d]) if r["ids"] != ref]
        row["ids_equal_reference"] = not differ
        rows.append(row)
        print(_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
        for i in differ:
            ids_i = runs[d][i]["ids"]
            bad.append(
                {
                    **key,
                    "drafter": d,
                    "repeat": i,
                    "first_differing_token": _first_diff(ids_i, ref),
                    "ids": ids_i,
                    "reference_ids": ref,
                }
            )
    return rows, bad, ref


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _machine() -> dict:
    import mlx.core as mx

    dev = mx.default_device()
    info: dict = {}
    try:
        info = {k: v for k, v in mx.device_info(dev).items() if isinstance(v, (str, int, float))}
    except Exception:  # older MLX, or a backend without device_info
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_device": str(dev),
        "mlx_device_info": info,
    }


def _table(rows: list[dict]) -> str:
    head = (
        f"{'task':<11}{'placement':<10}{'drafter':<14}{'tok/s':>8}{'speedup':>8}{'accept':>8}"
        f"{'tok/step':>9}{'steps':>6}{'nvme B/tok':>12}{'ttft s':>8}  ok"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}"
        spec = r["drafter"] != "none"
        acc = f"{r['acceptance_rate']:.2f}" if spec else ""
        tps = f"{r['tokens_per_verification_step']:.2f}" if spec else ""
        lines.append(
            f"{r['task']:<11}{r['placement']:<10}{r['drafter']:<14}"
            f"{r['decode_tok_s'] or 0:>8.2f}{sp:>8}"
            f"{acc:>8}{tps:>9}"
            f"{r['steps']:>6}{r['nvme_bytes_per_output_token']:>12}{r['ttft_s']:>8.2f}  "
            f"{'yes' if r['ids_equal_reference'] else 'NO'}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="hardware profile YAML")
    p.add_argument("--out", required=True, help="folder for the cut model, plans and summary")
    p.add_argument("--model", default="smollm2-135m", help="catalog name or GGUF path")
    p.add_argument("--draft-blocks", type=int, default=16, help="blocks of the draft model (16)")
    p.add_argument("--tokens", type=int, default=48, help="output tokens per run (48)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K, drafts per step (4)")
    p.add_argument(
        "--stream-from-block", type=int, default=None, help="S: FFNs of blocks >= S stream (n/2)"
    )
    p.add_argument("--warmup", type=int, default=4, help="tokens of each warm-up run (0: none)")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each configuration, round-robin (1)"
    )
    p.add_argument("--tasks", default="repetitive,free", help="comma-separated tasks")
    p.add_argument("--placements", default="resident,streamed", help="comma-separated")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated")
    args = p.parse_args(argv)

    from strata.common.catalog import resolve_model
    from strata.common.errors import StrataError
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan

    tasks = args.tasks.split(",")
    placements = args.placements.split(",")
    drafters = args.drafters.split(",") if args.drafters else []
    for name, got, known in (
        ("task", tasks, PROMPTS),
        ("placement", placements, ("resident", "streamed")),
        ("drafter", drafters, DRAFTERS),
    ):
        bad = [x for x in got if x not in known]
        if bad:
            p.error(f"unknown {name} {bad[0]!r}; choose from {', '.join(known)}")
    if args.tokens < 2 or args.num_draft_tokens < 1 or args.repeats < 1:
        p.error("give --tokens >= 2, --num-draft-tokens >= 1 and --repeats >= 1")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile).resolve()
    t_start = time.perf_counter()
    try:
        model = resolve_model(args.model).path
        print(f"planning {model.name} on {profile.name}", file=sys.stderr, flush=True)
        resident_plan = _make_plan(model, profile, out / "resident.yaml")
        import yaml

        n_blocks = sum(
            1
            for u in yaml.safe_load(resident_plan.read_text())["placement"]
            if re.fullmatch(r"blk\.\d+\.attn", u["unit"])
        )
        s = n_blocks // 2 if args.stream_from_block is None else args.stream_from_block
        if not 1 <= s < n_blocks:
            p.error(f"--stream-from-block {s} must be within 1..{n_blocks - 1}")
        if not 1 <= args.draft_blocks < n_blocks:
            p.error(f"--draft-blocks {args.draft_blocks} must be within 1..{n_blocks - 1}")
        self_layers_resident = max(1, (3 * n_blocks) // 4)
        plans = {"resident": resident_plan}
        streamed_units_moved: list[str] = []
        if "streamed" in placements:
            plans["streamed"], streamed_units_moved = _streamed_copy(
                resident_plan, out / "streamed.yaml", s
            )
        draft_engine = None
        draft_plan = None
        if "draft_model" in drafters:
            cut = _cut_gguf(model, args.draft_blocks, out / f"draft-{args.draft_blocks}.gguf")
            draft_plan = _make_plan(cut, profile, out / f"draft-{args.draft_blocks}.yaml")
            draft_engine = Engine(load_plan(draft_plan))
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    k = args.num_draft_tokens
    rows: list[dict] = []
    mismatches: list[dict] = []
    skipped_units: dict[str, list[str]] = {}
    texts: dict[str, dict[str, str]] = {}
    try:
        for placement in placements:
            engine = Engine(load_plan(plans[placement]))
            try:
                layers = self_layers_resident if placement == "resident" else n_blocks
                factories, skipped_units[placement] = _drafter_factories(
                    engine, draft_engine, layers
                )
                prompts = {t: engine.tokenizer.encode(PROMPTS[t]) for t in tasks}
                if args.warmup:
                    short = prompts[tasks[0]][:32]
                    for d in [None, *drafters]:
                        _run(engine, short, args.warmup, d and factories[d], k, f"warm-{d}")
                for task in tasks:
                    ids = prompts[task]
                    print(
                        f"{placement} / {task}: {len(ids)} prompt tokens", file=sys.stderr,
                        flush=True,
                    )  # fmt: skip
                    key = {"task": task, "placement": placement}
                    got, bad, ref = _measure(
                        engine, ids, args.tokens, factories, drafters, k, args.repeats, key
                    )
                    rows += got
                    mismatches += bad
                    texts.setdefault(task, {})[placement] = engine.tokenizer.decode(ref)
            finally:
                engine.close()
    finally:
        if draft_engine is not None:
            draft_engine.close()

    summary = {
        "bench": "speculative",
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "profile": args.profile,
        "model": {"spec": args.model, "path": str(model), "blocks": n_blocks},
        "settings": {
            "context": CONTEXT,
            "concurrency": 1,
            "tokens": args.tokens,
            "num_draft_tokens": k,
            "warmup_tokens": args.warmup,
            "repeats": args.repeats,
            "greedy": True,
            "ignore_eos": True,
            "draft_blocks": args.draft_blocks,
            "stream_from_block": s,
            "self_layers": {"resident": self_layers_resident, "streamed": n_blocks},
            "self_skipped_units": skipped_units,
            "prompts": PROMPTS,
        },
        "plans": {
            **{name: _plan_summary(path) for name, path in plans.items() if name in placements},
            **({"draft_model": _plan_summary(draft_plan)} if draft_plan else {}),
        },
        "streamed_units": streamed_units_moved,
        "method": (
            "decode_tok_s = (output tokens - 1) / (last token event - first token event) on the "
            "engine thread; ttft_s = first token event - submit; speedup = decode_tok_s / the "
            "same task and placement's run without speculation, in this process; nvme bytes "
            "from ServingEngine.metrics() bytes_read deltas (per output token: the whole run, "
            "prefill included; per decode token: after the first token event)"
        ),
        "rows": rows,
        "reference_text": texts,
        "check_passed": not mismatches,
        "mismatches": mismatches,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(_table(rows))
    print(f"check_passed: {summary['check_passed']}  ({out / 'summary.json'})")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
