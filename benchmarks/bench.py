"""``strata bench``: measured throughput of a plan, next to what the plan predicted.

One request through the engine ``serve`` runs (``executor.generate``: its warm-up, kernels and
the plan's speculative decoding), after a warm-up request, measures on this machine:
- prefill and decode tokens/s (greedy, a fixed number of tokens; the prefix cache emptied
  first, so the whole prompt is computed);
- streamed bytes per decoded token, the disk bytes/s the NVMe tier achieved during decode, and, in
  the same run, the raw direct-I/O sequential read bandwidth of the file it streams from;
- I/O wait per token (time the compute thread waited for a prefetch);
- the bounds a streamed plan is judged against, measured in the same run: the disk bound (raw
  direct-I/O bandwidth / streamed bytes per token) and the all-resident decode tok/s (with
  ``--check resident``), each with the fraction of it reached;
- the plan's predicted decode tok/s against the measured one (predicted from the plan's own
  decisions and figures, ``planner.rescore``: a hand-edited plan is predicted as edited);
- with ``baseline``, the same request on the baseline rule's plan for the same model, machine
  and budgets (``planner.baseline``: first blocks resident in order), in the same process,
  plan and baseline alternated, the median of each: the measured ratio of the two;
- peak RSS and MLX peak memory.

A request that produces NaN or infinite logits fails the bench, naming the step and the first
stage of the prompt's pass whose output is not finite with that stage's non-finite weights
(``executor.diagnose``), in its one error line and in the JSON (``non_finite``).

Every bench checks its text: the generated ids must equal those of the same model run with every
unit resident (``--check resident``, the default; numerics do not depend on the tier), or a file
of expected ids (``--check FILE.json``), so that a fast wrong answer never counts.
"""

from __future__ import annotations

import gc
import json
import re
import time
from pathlib import Path

import mlx.core as mx
from strata.common.errors import StrataError
from strata.executor.diagnose import NON_FINITE_MARK, first_non_finite
from strata.executor.generate import Generation, generate, serving_for
from strata.executor.plan_loader import LoadedPlan, load_plan
from strata.executor.profile import read_sequential
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine
from strata.planner.rescore import judge

RAW_READ_MIN_BYTES = 256 << 20
"""Least bytes of the raw direct-I/O read test; it reads one decode step's streamed bytes when
that is more (at most the file's size, whole 4 MiB blocks)."""
RAW_READ_REPEATS = 2
"""Raw read runs; the best is the disk bound (a shared disk's slow moments are not the bound)."""


WARMUP_TOKENS = 4
"""Tokens generated before timing: first-use kernel compilation, allocator caches, the pool."""


def _serving(loaded: LoadedPlan, expert_cache_mode: str | None = None) -> ServingEngine:
    """The engine ``serve`` runs for ``loaded`` (its warm-up, kernels, prefix cache, the plan's
    speculative decoding), started."""
    serving = serving_for(loaded, expert_cache_mode)
    serving.log_failures = False  # generate() raises a failed request's error: said once
    try:
        serving.start()
    except BaseException:
        serving.close()
        raise
    return serving


def _timed_generate(serving: ServingEngine, prompt: list[int], n: int) -> Generation:
    """Warm up, then generate ``n`` greedy tokens; the second generation's result. The prefix
    cache is emptied between the two, so the timed prefill computes the whole prompt.

    Raises:
        StrataError: the prefix cache could not be emptied (a request still running).
    """
    generate(serving, prompt, SamplingParams(), WARMUP_TOKENS, stop_at_eog=False)
    if not serving.reset_prefix_cache():
        raise StrataError("the bench's warm-up request is still running; the prefix cache stays")
    return generate(serving, prompt, SamplingParams(), n, stop_at_eog=False)


def _resident_run(loaded: LoadedPlan, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy ids and decode tok/s of the same model with every unit on the device.

    The ids are the check's reference (numerics do not depend on the tier); the tok/s is the
    all-resident speed a streamed plan is judged against when compute is its bottleneck.
    """
    plan = loaded.plan.model_copy(deep=True)
    for p in plan.placement:
        p.tier, p.host = "gpu", None
    plan.cluster = None  # a cluster plan's reference: the whole model on this host
    serving = _serving(LoadedPlan(plan, loaded.path, loaded.gguf, loaded.desc))
    try:
        gen = _timed_generate(serving, prompt, n)
        return gen.output_ids, gen.stats["decode_tok_s"]
    finally:
        serving.close()


def _ffn_streamed_fraction(loaded: LoadedPlan) -> float | None:
    """Fraction of the per-token FFN bytes the plan reads from NVMe (None: no FFN units)."""
    tier = loaded.plan.tier_of()
    ffn = [u for u in loaded.desc.units if u.role in ("ffn", "expert")]
    total = sum(u.bytes_mlx * u.access_per_token for u in ffn)
    if total == 0:
        return None
    return sum(u.bytes_mlx * u.access_per_token for u in ffn if tier[u.name] == "nvme") / total


def _raw_read(path: Path, step_bytes: int, io_threads: int) -> dict:
    """Direct-I/O sequential read bandwidth of ``path``'s disk, measured now.

    Reads ``max(RAW_READ_MIN_BYTES, step_bytes)`` (at most the file) from the file's start in
    4 MiB blocks with ``io_threads`` reads in flight, as the pool does; best of
    ``RAW_READ_REPEATS``.
    """
    block = 4 << 20
    size = path.stat().st_size
    n = min(max(RAW_READ_MIN_BYTES, step_bytes), size) // block * block
    if n == 0:
        return {"bytes_s": None, "method": f"{path} is smaller than one 4 MiB block"}
    runs = [
        read_sequential(path, n, queue_depth=max(1, io_threads)) for _ in range(RAW_READ_REPEATS)
    ]
    r = max(runs, key=lambda x: x.bytes_s)
    return {
        "bytes_s": round(r.bytes_s),
        "runs_bytes_s": [round(x.bytes_s) for x in runs],
        "bytes": n,
        "queue_depth": max(1, io_threads),
        "direct": r.direct,
        "method": r.method,
    }


def _expert_modes(loaded: LoadedPlan, ids: list[int], n: int, modes: list[str]) -> dict:
    """Decode tok/s and expert-cache counters of each expert-cache mode, one fresh engine each
    (a cold cache warmed by the same warm-up), decode steps only."""
    out = {}
    for mode in modes:
        serving = _serving(loaded, mode)
        try:
            gen = _timed_generate(serving, ids, n)
        finally:
            serving.close()
        s = gen.stats
        steps = max(1, s["decode_tokens"])
        ex = s["decode_experts"]
        out[mode] = {
            "decode_tok_s": s["decode_tok_s"],
            "hit_rate": ex.get("hit_rate", 0.0),
            "prefetch_accuracy": ex.get("prefetch_accuracy", 0.0),
            "misses_per_token": round(ex.get("misses", 0) / steps, 3),
            "prefetch_issued_per_token": round(ex.get("prefetch_issued", 0) / steps, 3),
            "streamed_bytes_per_token": round(s["decode_bytes_read"]["nvme"] / steps),
            "io_wait_s_per_token": round(s["decode_io_wait_s"] / steps, 6),
            "experts": ex,
            "output_ids": gen.output_ids,
        }
    return out


def _baseline_run(loaded: LoadedPlan, ids: list[int], n: int) -> tuple[Generation, dict]:
    """One timed generation on the baseline rule's plan for ``loaded``'s model, machine and
    request, and that plan's summary (tiers, its predicted decode tok/s).

    Raises:
        PlanError: the rule finds no placement that fits.
    """
    from strata.planner.baseline import RULE, baseline_plan
    from strata.planner.rescore import description_of

    plan = loaded.plan
    base = baseline_plan(description_of(plan), plan.machine, plan.request)
    twin = LoadedPlan(base, loaded.path, loaded.gguf, loaded.desc, None, loaded.routing)
    serving = _serving(twin)
    try:
        gen = _timed_generate(serving, ids, n)
    finally:
        serving.close()
    summary = {
        "rule": RULE,
        "tiers": {t: sum(1 for p in base.placement if p.tier == t) for t in ("gpu", "ram", "nvme")},
        "predicted_decode_tok_s": base.prediction.decode_tok_s if base.prediction else None,
    }
    return gen, summary


def _versus_baseline(
    loaded: LoadedPlan, ids: list[int], n: int, first: Generation, rounds: int
) -> tuple[dict, dict[str, list[int]]]:
    """Plan and baseline alternated ``rounds`` times (the plan's ``first`` run counts as its
    first): each one's decode and prefill tok/s per run, their medians (a shared machine's slow
    moment moves one run, not the median) and the ratio of the medians; and every run's ids,
    labelled, for the bench's check."""
    from statistics import median

    plan_runs, base_runs = [first], []
    summary: dict = {}
    for r in range(rounds):
        gen, summary = _baseline_run(loaded, ids, n)
        base_runs.append(gen)
        if r + 1 < rounds:
            serving = _serving(loaded)
            try:
                plan_runs.append(_timed_generate(serving, ids, n))
            finally:
                serving.close()

    def med(runs: list[Generation], key: str) -> float:
        return float(median(r.stats[key] for r in runs))

    out = {**summary, "rounds": rounds}
    for key in ("decode_tok_s", "prefill_tok_s"):
        ours, theirs = med(plan_runs, key), med(base_runs, key)
        out[key] = theirs
        out[f"{key}_runs"] = [r.stats[key] for r in base_runs]
        out[f"plan_{key}"] = ours
        out[f"plan_{key}_runs"] = [r.stats[key] for r in plan_runs]
        out[f"plan_over_baseline_{key.removesuffix('_tok_s')}"] = (
            round(ours / theirs, 3) if theirs else None
        )
    texts = {f"baseline run {i + 1}": r.output_ids for i, r in enumerate(base_runs)}
    texts.update({f"plan run {i + 1}": r.output_ids for i, r in enumerate(plan_runs[1:], 2)})
    return out, texts


class NonFiniteBench(StrataError):
    """The bench's request produced NaN or infinite logits; the message names the step and the
    first stage that produced them (``executor.diagnose``).

    Attributes:
        result: the bench's JSON-ready result: plan, model, prompt, ``check_passed`` False and
            ``non_finite`` (``step``, ``first_stage``, ``block``, ``tensors``).
    """

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _non_finite(
    loaded: LoadedPlan, plan_path: str, ids: list[int], check: str, error: StrataError
) -> NonFiniteBench:
    """The bench's failure for ``error`` (a request ended by non-finite logits), with the
    first stage of the prompt's pass whose output is not finite and that stage's non-finite
    weights (``executor.diagnose.first_non_finite``: the weights loaded once more)."""
    m = re.search(r"logits at (.+?\(position \d+\))", str(error))
    step = m.group(1) if m else str(error)
    try:
        found = first_non_finite(loaded, ids)
    except Exception as e:  # the diagnosis is extra: its failure must not hide the error
        return NonFiniteBench(
            f"{error} (diagnosing the first layer failed: {e})",
            {
                "plan": str(plan_path),
                "check": check,
                "check_passed": False,
                "non_finite": {"step": step, "first_stage": None, "diagnosis_error": str(e)},
            },
        )
    info = {
        "step": step,
        "first_stage": found.stage if found else None,
        "block": found.block if found else None,
        "tensors": found.tensors if found else [],
    }
    if found is None:
        where = "every stage of the prompt's pass is finite (a later step's tokens break it)"
    else:
        weights = ", ".join(found.tensors) or "none (an overflow in the computation)"
        where = f"first produced by {found.stage}; non-finite weights: {weights}"
    result = {
        "plan": str(plan_path),
        "model": loaded.plan.model.name or loaded.plan.model.path,
        "prompt_tokens": len(ids),
        "check": check,
        "check_passed": False,
        "non_finite": info,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if m is None:  # worded otherwise: the request's own error, then the diagnosis
        return NonFiniteBench(f"{error}; {where}", result)
    return NonFiniteBench(
        f"the model produced NaN or infinite logits at {step}, {where}; re-download or "
        "re-convert the model",
        result,
    )


def bench(
    plan_path: str,
    prompt: str,
    max_tokens: int,
    check: str,
    expert_modes: list[str] | None = None,
    *,
    baseline: int = 0,
    model: str | None = None,
) -> dict:
    """Run the bench and return its JSON-ready result (see the module docstring).

    Args:
        expert_modes: expert-cache modes (``executor.experts.CACHE_MODES``) to measure one after
            the other in this run, besides the plan's own (MoE plans that stream experts).
        baseline: also measure the baseline rule's plan, alternated with this one this many
            times (0: not).
        model: the GGUF file, where it is not where the plan says (``--model``).

    Raises:
        NonFiniteBench: the request produced NaN or infinite logits (the first stage that
            did, and its non-finite weights, in the message and the result it carries).
        StrataError: a bad plan or prompt, or generated ids that fail the check.
    """
    loaded = load_plan(plan_path, model)
    if expert_modes and not loaded.desc.architecture.expert_count:
        raise StrataError(
            f"--expert-cache-modes: {plan_path}'s model has no experts (not a mixture-of-experts "
            "model); leave the option out"
        )
    serving = _serving(loaded)
    engine = serving.engine
    failed: StrataError | None = None
    try:
        ids = engine.tokenizer.encode(prompt)
        gen = _timed_generate(serving, ids, max_tokens)
        pool = engine.store.pool or engine.store.experts_cache
        step_bytes = gen.stats["decode_bytes_read"]["nvme"] // max(1, gen.stats["decode_steps"])
        threads = loaded.plan.prefetch.io_threads
        raw = _raw_read(engine.store.pack_path, step_bytes, threads) if pool is not None else None
    except StrataError as e:
        if NON_FINITE_MARK not in str(e):
            raise
        failed = e  # diagnosed once this engine is closed: the diagnosis loads the weights anew
    finally:
        serving.close()
    if failed is not None:
        # Closing stops the engine's threads; its weights and KV pool go only with the last
        # reference, before the diagnosis loads the weights anew.
        del serving, engine
        gc.collect()
        mx.clear_cache()
        raise _non_finite(loaded, plan_path, ids, check, failed)
    resident_tok_s = None
    if check == "resident":
        want, resident_tok_s = _resident_run(loaded, ids, max_tokens)
    elif check == "none":
        want = None
    else:
        try:
            ref = json.loads(Path(check).read_text())
            want = ref["output_ids"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StrataError(f"--check {check}: cannot read expected output_ids ({e})") from None
        if ref.get("prompt_ids", ids) != ids:
            raise StrataError(
                f"--check {check} was made for another prompt (its prompt_ids differ from this "
                "bench's); bench the same --prompt, or make the reference with it"
            )
    s = gen.stats
    steps = max(1, s["decode_tokens"])  # per decoded token (speculation: several per step)
    decode_s = s["decode_s"]
    nvme = s["decode_bytes_read"]["nvme"]  # decode steps only: prefill streams every unit too
    judged = judge(loaded.plan).view.prediction  # from the plan's decisions, edited or not
    predicted = judged.decode_tok_s if judged else None
    per_token = nvme / steps
    disk_bound = raw["bytes_s"] / per_token if raw and raw["bytes_s"] and per_token else None
    result = {
        "plan": str(plan_path),
        "model": loaded.plan.model.name or loaded.plan.model.path,
        "tiers": {
            t: sum(1 for p in loaded.plan.placement if p.tier == t) for t in ("gpu", "ram", "nvme")
        },
        "prompt_tokens": len(ids),
        "decode_tokens": len(gen.output_ids),
        "prefill_tok_s": s["prefill_tok_s"],
        "decode_tok_s": s["decode_tok_s"],
        "predicted_decode_tok_s": predicted,
        "measured_over_predicted": round(s["decode_tok_s"] / predicted, 3) if predicted else None,
        "resident_decode_tok_s": resident_tok_s,
        "of_resident": round(s["decode_tok_s"] / resident_tok_s, 3) if resident_tok_s else None,
        "disk_bound_tok_s": round(disk_bound, 4) if disk_bound else None,
        "of_disk_bound": round(s["decode_tok_s"] / disk_bound, 3) if disk_bound else None,
        "ffn_bytes_streamed_fraction": _ffn_streamed_fraction(loaded),
        "read_method": s["read_method"],  # direct or buffered (None: nothing streams)
        "read_method_detail": s["read_method_detail"],
        "streamed_bytes_per_token": round(per_token),
        "disk_bytes_s": round(nvme / decode_s) if decode_s > 0 else 0,
        "raw_direct_io_bytes_s": raw["bytes_s"] if raw else None,
        "raw_read": raw,
        "io_wait_s_per_token": round(s["decode_io_wait_s"] / steps, 6),
        "host_copy_s_per_token": round(s["decode_host_copy_s"] / steps, 6),
        "bytes_read": s["bytes_read"],
        "peak_rss_bytes": s["peak_rss_bytes"],
        "peak_mlx_bytes": s["peak_mlx_bytes"],
        "text": gen.text,
        "check": check,
        "check_passed": None if want is None else gen.output_ids == want,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if "decode_experts" in s:
        result["experts"] = s["decode_experts"]
        if judged is not None:
            result["predicted_expert_hit_rate"] = judged.expert_hit_rate
    runs = {"plan": gen.output_ids}
    if baseline:
        result["baseline"], texts = _versus_baseline(loaded, ids, max_tokens, gen, baseline)
        runs.update(texts)
    if expert_modes:
        result["expert_cache_modes"] = _expert_modes(loaded, ids, max_tokens, expert_modes)
        runs.update({m: r.pop("output_ids") for m, r in result["expert_cache_modes"].items()})
    for label, got in runs.items():
        if want is not None and got != want:
            pairs = zip(got, want, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(want), steps + 1))
            raise StrataError(
                f"bench check failed: generated ids ({label}) differ from the {check} reference "
                f"at position {at}"
            )
    return result


def plot(result: dict, path: Path) -> None:
    """A PNG with predicted vs measured decode tok/s and achieved vs raw disk bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels, values = ["measured"], [result["decode_tok_s"]]
    if result["predicted_decode_tok_s"]:
        labels.insert(0, "predicted")
        values.insert(0, result["predicted_decode_tok_s"])
    a.bar(labels, values, color=["#999", "#2a7"][-len(values) :])
    a.set_title("decode tok/s")
    disk = [result["disk_bytes_s"] / 1e9]
    dl = ["achieved (decode)"]
    if result["raw_direct_io_bytes_s"]:
        disk.append(result["raw_direct_io_bytes_s"] / 1e9)
        dl.append("raw direct I/O")
    b.bar(dl, disk, color=["#27a", "#999"][: len(disk)])
    b.set_title("NVMe GB/s")
    fig.suptitle(f"{result['model']} — {Path(result['plan']).name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_result(result: dict, output: str | None, plot_path: str | None, plot_fn) -> None:
    """Write a bench's JSON to ``output`` (stdout when None) and, with ``plot_path``, its plot
    through ``plot_fn(result, path)``; says where on stderr."""
    import sys

    from strata.common.atomic import replaced

    text = json.dumps(result, indent=1, ensure_ascii=False)
    if output:
        with replaced(Path(output), "w") as f:  # whole or not at all: Ctrl-C leaves the old one
            f.write(text + "\n")
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(text)
    if plot_path:
        plot_fn(result, Path(plot_path))
        print(f"wrote {plot_path}", file=sys.stderr)
