"""``strata explain``: a plan in words — where each unit is, what fills each tier, what binds.

Also home of the grouping and formatting helpers ``planner.diff`` shares: units grouped by role
into runs of contiguous layers (``blk 0–9``), times and rates formatted for people.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

from strata.common.errors import PlanError
from strata.common.schemas import TIERS, ModelDescription, Plan
from strata.common.sizes import format_size
from strata.planner.baseline import RULE, baseline_plan
from strata.planner.costmodel import batch_size, objective, rate_label
from strata.planner.rescore import (
    description_of,
    judge,
    memory_needs,
    request_edited,
    speculative_bytes,
)

# --------------------------------------------------------------------------- shared helpers


@dataclass(frozen=True)
class UnitRef:
    """A placed unit as explain/diff see it: name, role, block index (None outside), bytes."""

    name: str
    role: str
    layer: int | None
    bytes: int


_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def infer_role(name: str) -> tuple[int | None, str]:
    """(layer, role) from a unit name as ``strata.common.describe`` writes them (``blk.3.ffn``,
    ``blk.3.expert.5``, ``token_embd``, ``output``); ``other`` when the name says nothing."""
    m = _BLOCK.match(name)
    if not m:
        return None, {"token_embd": "embedding", "output": "output"}.get(name, "other")
    rest = m.group(2)
    if rest.startswith("expert."):
        role = "expert"
    elif rest.startswith("ffn"):
        role = "ffn"
    elif rest.startswith("attn"):
        role = "attention"
    else:
        role = "other"
    return int(m.group(1)), role


def unit_refs(plan: Plan, desc: ModelDescription | None = None) -> list[UnitRef]:
    """The plan's units in placement order, with role and layer from ``desc`` when given (else
    inferred from the unit names)."""
    info = {u.name: u for u in desc.units} if desc else {}
    out = []
    for p in plan.placement:
        u = info.get(p.unit)
        layer, role = (u.layer, u.role) if u else infer_role(p.unit)
        out.append(UnitRef(p.unit, role, layer, p.bytes))
    return out


@dataclass
class Run:
    """Consecutive units of one role, on contiguous layers, sharing one key (e.g. a tier)."""

    role: str
    key: Hashable
    units: list[UnitRef] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Total bytes of the run's units."""
        return sum(u.bytes for u in self.units)

    @property
    def span(self) -> str:
        """``blk 0–9``, ``blk 5``, or the unit name outside blocks."""
        first, last = self.units[0].layer, self.units[-1].layer
        if first is None or last is None:
            return ", ".join(u.name for u in self.units)
        return f"blk {first}" if first == last else f"blk {first}–{last}"


def group_runs(refs: list[UnitRef], key: Callable[[UnitRef], Hashable]) -> dict[str, list[Run]]:
    """Group units by role (in order of first appearance) into runs of equal ``key`` over
    contiguous layers (a layer may hold several units, e.g. experts). Units outside blocks are
    runs of their own."""
    by_role: dict[str, list[UnitRef]] = {}
    for r in refs:
        by_role.setdefault(r.role, []).append(r)
    out: dict[str, list[Run]] = {}
    for role, units in by_role.items():
        order = sorted(
            range(len(units)), key=lambda i: (units[i].layer is not None, units[i].layer or 0, i)
        )
        runs: list[Run] = []
        for i in order:
            u, k = units[i], key(units[i])
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.key == k
                and u.layer is not None
                and last.units[-1].layer is not None
                and u.layer - last.units[-1].layer in (0, 1)
            ):
                last.units.append(u)
            else:
                runs.append(Run(role, k, [u]))
        out[role] = runs
    return out


def format_time(s: float) -> str:
    """Seconds for people: ``1.234 s``, ``85.30 ms``, ``412.0 µs``."""
    if abs(s) >= 1:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def format_rate(tok_s: float) -> str:
    """Tokens per second with three significant figures (``0.205``, ``21.3``, ``1234``)."""
    return f"{tok_s:.0f}" if tok_s >= 1000 else f"{tok_s:.3g}"


def model_label(plan: Plan) -> str:
    """The plan's model: catalog name or file name, and the start of its file (or header)
    sha256."""
    m = plan.model
    sha = m.sha256 or m.header_sha256
    name = m.name or (Path(m.path).name if m.path else "(unnamed)")
    return f"{name} ({'sha256' if m.sha256 else 'header'} {sha[:12]})"


def profile_label(plan: Plan) -> str:
    """The machine the plan was solved for: its profile's name and backend."""
    m = plan.machine
    return f"{m.name} ({m.backend})"


def request_label(plan: Plan) -> str:
    """``context 4096, concurrency 1, objective latency[, gpu budget …][, ram budget …]``."""
    r = plan.request
    text = f"context {r.context} tokens, concurrency {r.concurrency}, objective {r.objective}"
    text += f", prompts {r.prompt_tokens[0]}–{r.prompt_tokens[1]} tokens, {r.output_tokens} out"
    if r.gpu_budget_bytes is not None:
        text += f", gpu budget {format_size(r.gpu_budget_bytes)}"
    if r.ram_budget_bytes is not None:
        text += f", ram budget {format_size(r.ram_budget_bytes)}"
    return text


def pool_label(plan: Plan) -> str:
    """``2 slots × 564 MiB = 1.10 GiB, prefetch depth 1, 1 I/O thread`` or ``none``."""
    p, f = plan.pool, plan.prefetch
    pool = (
        f"{p.slots} slot{'s' * (p.slots != 1)} × {format_size(p.slot_bytes)} = "
        f"{format_size(p.slots * p.slot_bytes)}"
        if p.slots
        else "none (nothing streams)"
    )
    threads = f"{f.io_threads} I/O thread{'s' if f.io_threads != 1 else ''}"
    return f"{pool}; prefetch depth {f.depth}, {threads}"


def runtime_label(plan: Plan) -> str:
    """``backend cuda, compute dtype float16; 4-bit products: tensor-core kernel for 2-32 rows,
    dequantize + matmul from 128 rows, MLX's quantized matmul otherwise``."""
    r = plan.runtime
    paths = []
    if r.mma_matmul_min_rows:
        paths.append(f"tensor-core kernel for {r.mma_matmul_min_rows}-{r.mma_matmul_max_rows} rows")
    if r.dequant_matmul_min_rows:
        paths.append(f"dequantize + matmul from {r.dequant_matmul_min_rows} rows")
    kernels = ", ".join([*paths, "MLX's quantized matmul otherwise"]) if paths else "MLX's"
    return f"backend {r.backend}, compute dtype {r.compute_dtype}; quantized products: {kernels}"


def batch_label(plan: Plan) -> str:
    """The batch limits in one line."""
    b = plan.batch
    return (
        f"up to {b.max_num_seqs} sequences, {b.max_num_batched_tokens} tokens per step, "
        f"prefill chunk {b.prefill_chunk}, KV cache {b.kv_num_blocks} blocks × {b.kv_block_size} "
        f"tokens"
    )


def weights_per_tier(plan: Plan) -> dict[str, int]:
    """Bytes of weights per tier, summed from the placement."""
    out = dict.fromkeys(TIERS, 0)
    for p in plan.placement:
        out[p.tier] += p.bytes
    return out


# --------------------------------------------------------------------------- explain


def _memory_lines(plan: Plan) -> list[str]:
    lines = ["Memory per tier:"]
    experts = plan.expert_cache.slots > 0
    head = f"  {'tier':<5} {'weights':>10} {'KV cache':>10} {'pool':>10} "
    head += f"{'expert cache':>12} " if experts else ""
    head += f"{'activations':>12} "
    lines.append(head + f"{'total':>10} {'capacity':>10}  used")
    if plan.memory is None:
        for t, w in weights_per_tier(plan).items():
            lines.append(f"  {t:<5} {format_size(w):>10}   (no memory section: capacities unknown)")
        return lines
    draft = speculative_bytes(plan)
    for t in TIERS:
        m = plan.memory.get(t)  # type: ignore[call-overload]
        if m is None:
            continue
        total = m.weights + m.kv_cache + m.recurrent_state + m.pool + m.expert_cache + m.activations
        total += draft if t == "gpu" else 0
        cap = format_size(m.capacity) if m.capacity else "unbounded"
        used = f"{100 * total / m.capacity:.1f}%" if m.capacity else "-"
        cache = f"{format_size(m.expert_cache):>12} " if experts else ""
        lines.append(
            f"  {t:<5} {format_size(m.weights):>10} {format_size(m.kv_cache):>10} "
            f"{format_size(m.pool):>10} {cache}{format_size(m.activations):>12} "
            f"{format_size(total):>10} {cap:>10}  {used}"
        )
    gpu = plan.memory.get("gpu")  # type: ignore[call-overload]
    if gpu is not None and gpu.recurrent_state:
        a, n = plan.costs.architecture, plan.batch.max_num_seqs
        # The blocks this plan holds: all of them, or a pipeline stage's (its stage_view).
        held = {u.layer for u in plan.costs.units if u.layer is not None}
        recurrent = len(held & set(a.recurrent_layers))
        lines.append(
            f"  (gpu total includes the recurrent state of the {recurrent} gated "
            f"delta-net blocks, {format_size(gpu.recurrent_state)} for {n} "
            f"sequence{'s' if n != 1 else ''} whatever the context; the KV cache is the "
            f"{len(held) - recurrent} attention blocks')"
        )
    over = [
        f"{row.tier_label} by {format_size(used - row.capacity)}"
        for row, used in memory_needs(plan)
        if used > row.capacity
    ]
    if over:
        lines.append(
            f"  OVER CAPACITY: {', '.join(over)}; these decisions do not fit the plan's budgets "
            "(strata check refuses them where the machine is smaller too)"
        )
    sp = plan.speculative
    d = sp.draft_model
    if d is not None:
        act = f" + activations {format_size(d.activation_bytes)}" if d.activation_bytes else ""
        lines.append(
            f"  (gpu total includes the draft model: weights {format_size(d.bytes_mlx)} + KV "
            f"cache {format_size(d.kv_cache_bytes)}{act})"
        )
    if sp.activation_bytes:
        lines.append(
            f"  (gpu total includes {format_size(sp.activation_bytes)} of verification logits "
            "beyond the activation reserve)"
        )
    return lines


def _placement_lines(plan: Plan, desc: ModelDescription | None) -> list[str]:
    lines = ["Placement (by role, contiguous layers):"]
    tiers = plan.tier_of()
    groups = group_runs(unit_refs(plan, desc), key=lambda u: tiers[u.name])
    for role, runs in groups.items():
        if role == "expert" and len(runs) > 4:
            lines.append(f"  {role:<10} " + _expert_summary(runs))
            continue
        parts = [
            f"{r.span}  {r.key} ({format_size(r.bytes)}"
            + (f", {len(r.units)} units)" if len(r.units) > 1 else ")")
            for r in runs
        ]
        lines.append(f"  {role:<10} " + ";  ".join(parts))
    return lines


def _expert_summary(runs: list) -> str:
    """Experts per tier in one line (a per-run list would name hundreds of scattered runs):
    ``gpu 45 experts in 30 blocks (295.31 MiB); nvme 211 experts (1.35 GiB)``."""
    out = []
    for tier in TIERS:
        mine = [r for r in runs if r.key == tier]
        if not mine:
            continue
        n = sum(len(r.units) for r in mine)
        blocks = {u.layer for r in mine for u in r.units}
        size = format_size(sum(r.bytes for r in mine))
        out.append(f"{tier} {n} experts in {len(blocks)} blocks ({size})")
    return ";  ".join(out)


def _no_room(plan: Plan) -> str | None:
    """Why nothing more moves to the device although no capacity row binds: the free bytes are
    fewer than the smallest unit off the device (None when that is not the reason)."""
    if plan.memory is None:
        return None
    gpu, ram = plan.memory.get("gpu"), plan.memory.get("ram")  # type: ignore[call-overload]
    if gpu is None or not gpu.capacity:
        return None
    gpu_total = gpu.weights + gpu.kv_cache + gpu.recurrent_state + gpu.pool + gpu.expert_cache
    gpu_total += gpu.activations
    gpu_total += speculative_bytes(plan)
    free = gpu.capacity - gpu_total
    if plan.runtime.backend != "cuda" and ram is not None and ram.capacity:
        free = min(free, ram.capacity - gpu_total - ram.weights)  # unified: one memory
    off = [p.bytes for p in plan.placement if p.tier != "gpu"]
    if not off or min(off) <= free:
        return None
    return (
        f"the device memory is full ({format_size(max(free, 0))} free, less than the smallest "
        f"unit off the device, {format_size(min(off))})"
    )


def _why(plan: Plan, edited: bool = False) -> str:
    w = weights_per_tier(plan)
    pred = plan.prediction
    binding = pred.binding if pred else []
    if w["ram"] == 0 and w["nvme"] == 0:
        return "Every weight is on the device: nothing is copied or streamed per token."
    full = [b for b in binding if "capacity" in b]
    if "gpu" not in plan.request.tiers:
        allowed = ", ".join(plan.request.tiers)
        reason = f"the request keeps weights off the device (--tiers {allowed})"
    elif full:
        reason = f"the device memory is full (binding: {', '.join(full)})"
    elif edited or plan.provenance.method != "ilp":
        reason = _no_room(plan) or "the plan's decisions put them there (not the solver's)"
    else:
        reason = _no_room(plan) or "the cost model gains nothing from moving more to the device"
    moved = []
    if w["ram"]:
        moved.append(f"{format_size(w['ram'])} sit in RAM and are copied to the device when used")
    if w["nvme"]:
        experts = sum(p.bytes for p in plan.placement if p.tier == "nvme" and _is_expert(p.unit))
        dense = w["nvme"] - experts
        if dense:
            moved.append(f"{format_size(dense)} stream from NVMe through the pool")
        if experts:
            moved.append(
                f"{format_size(experts)} of experts stream from NVMe through the expert cache"
            )
    return f"Because {reason}, " + " and ".join(moved) + "."


def _is_expert(unit: str) -> bool:
    return infer_role(unit)[1] == "expert"


def expert_cache_label(plan: Plan) -> str:
    """The expert cache in one line: slots, prefetch, pinned experts (counted per block)."""
    ec = plan.expert_cache
    if not ec.slots and not ec.pinned:
        return "none (no experts stream)"
    parts = []
    if ec.slots:
        parts.append(
            f"{ec.slots} slots × {format_size(ec.slot_bytes)} = "
            f"{format_size(ec.slots * ec.slot_bytes)} (LFU), prefetch "
            + (f"{ec.prefetch} experts per block" if ec.prefetch else "off")
        )
    if ec.pinned:
        blocks = sorted({infer_role(u)[0] or 0 for u in ec.pinned})
        n, nb = len(ec.pinned), len(blocks)
        parts.append(
            f"{n} expert{'s' * (n != 1)} pinned on the device in {nb} block{'s' * (nb != 1)}"
        )
    hit = plan.prediction.expert_hit_rate if plan.prediction else None
    if hit is not None:
        parts.append(f"predicted hit rate {hit:.1%}")
    return "; ".join(parts)


def _prediction_lines(plan: Plan) -> list[str]:
    """The predicted decode step and its terms; time to first token at the request's shortest
    and longest prompt with the prefill chunk's terms (recomputed from the plan's own costs and
    machine); the objective they make."""
    # Imported here: the prefill terms are used by this section alone.
    from strata.planner.costmodel import objective, prefill_chunk

    p = plan.prediction
    if p is None:
        return ["Prediction: none (hand-written plan; run strata plan to score it)"]
    b = batch_size(plan.request, plan.batch)
    # The cost model's step: I/O threads overlap the compute thread only with prefetch depth >= 1.
    overlap = plan.prefetch.depth >= 1
    form = "max(compute + host copy + I/O stall, disk)" if overlap else "compute + host copy + disk"
    stall = [f"  I/O stall  {format_time(p.io_stall_s)}"] if overlap else []
    lines = [
        f"Predicted decode step at batch {b}: {format_time(p.step_s)} = {form}",
        f"  compute    {format_time(p.compute_s)}",
        f"  host copy  {format_time(p.host_copy_s)}",
        f"  disk       {format_time(p.disk_s)}",
        *stall,
        f"  bottleneck: {p.bottleneck}",
        f"  binding: {', '.join(p.binding) if p.binding else 'none'}",
        f"Predicted decode: {format_rate(p.decode_tok_s)} tok/s"
        + rate_label(plan.request, plan.batch),
    ]
    if p.prefill_chunk_s is None or len(p.ttft_s) != 2:
        return [*lines, "Predicted TTFT: none (a plan made before prefill was priced; re-plan)"]
    c = max(1, plan.batch.prefill_chunk)
    ch = prefill_chunk(
        description_of(plan), plan.machine, plan.tier_of(), plan.prefetch.depth,
        plan.expert_cache, c,
    )  # fmt: skip
    miss = f" + expert misses {format_time(ch.expert_s)}" if ch.expert_s > 0 else ""
    copy = f"host copy {format_time(ch.host_copy_s)}"
    if overlap:
        chunk = (
            f"max(compute {format_time(ch.compute_s)} + {copy}{miss}, "
            f"disk {format_time(ch.disk_s)}{miss})"
        )
    else:
        chunk = (
            f"compute {format_time(ch.compute_s)} + {copy} + disk {format_time(ch.disk_s)}"
            f"{miss} (no prefetch)"
        )
    (p1, p2), (t1, t2) = plan.request.prompt_tokens, p.ttft_s
    n = plan.request.output_tokens
    mean, step = format_time((t1 + t2) / 2), format_time(p.step_s)
    per_req = (
        f"({b} × {mean} + {n - 1} × {step}) / ({b} × {n})"
        if b > 1
        else f"({mean} + {n - 1} × {step}) / {n}"
    )
    return [
        *lines,
        f"Predicted TTFT: {format_time(t1)} at {p1} tokens, {format_time(t2)} at {p2} tokens "
        f"(prefill chunk of {c} tokens: {format_time(p.prefill_chunk_s)} = {chunk}; every "
        "streamed unit is read and every ram unit copied again for each chunk)",
        f"Objective: {format_time(objective(p, plan.request, plan.batch))} per generated token "
        f"over requests of {p1}–{p2} prompt + {n} output tokens = (B × mean TTFT + "
        f"(N − 1) × step) / (B × N) = {per_req}",
    ]


def _baseline_lines(plan: Plan, view: Plan, edited: bool) -> list[str]:
    """The baseline rule's prediction for the same model, machine and request beside the plan's
    (``planner.baseline``), and whether the plan beats it."""
    if plan.provenance.method == "baseline" and not edited:
        return [f"Baseline: this plan is the baseline rule's ({RULE})"]
    try:
        rule_plan = baseline_plan(description_of(plan), plan.machine, plan.request)
    except PlanError:
        return [f"Baseline ({RULE}): finds no placement that fits"]
    ours, base = view.prediction, rule_plan.prediction
    assert ours is not None and base is not None  # judged and baseline plans always have one
    weights = weights_per_tier(rule_plan)
    where = ", ".join(f"{t} {format_size(b)}" for t, b in weights.items() if b)
    ttft = " and ".join(format_time(t) for t in base.ttft_s)
    lines = [
        f"Baseline ({RULE}): {where}; predicted decode {format_rate(base.decode_tok_s)} tok/s"
        + (f", TTFT {ttft}" if ttft else "")
    ]
    # Judged by what the ILP minimizes: the time of whole requests, TTFT included.
    mine = objective(ours, plan.request, plan.batch)
    rule = objective(base, plan.request)  # the rule's own batch limits
    ratio = rule / mine if mine > 0 else 1.0
    if ratio > 1.0005:
        lines.append(f"  this plan is ×{ratio:.2f} faster per request than the baseline")
    elif ratio < 0.9995:
        lines.append(f"  this plan is ×{1 / ratio:.2f} slower per request than the baseline")
    else:
        who = "this plan does" if edited else "the ILP can do"
        lines.append(f"  {who} no better than the rule here: the same predicted request time")
    return lines


METHOD_LABELS = {
    "prompt_lookup": "prompt lookup (drafts: the n-gram continuations found earlier in the "
    "sequence; no weights, no memory)",
    "draft_model": "draft model",
    "self": "self-drafting (the model's own first blocks, early exit)",
}


def _speculative_lines(plan: Plan, desc: ModelDescription | None) -> list[str]:
    """The speculative section: drafter, K, acceptance and its source, the step it predicts."""
    sp = plan.speculative
    if sp.method == "none":
        return ["Speculative decoding: none (strata plan --speculative METHOD to enable)"]
    k = sp.num_draft_tokens
    lines = [
        f"Speculative decoding: {METHOD_LABELS[sp.method]}, K = {k} draft token"
        + ("s" if k != 1 else "")
        + " verified per sequence and step"
    ]
    if sp.draft_model is not None:
        d = sp.draft_model
        name = d.name or d.path or "(unnamed)"
        lines.append(
            f"  draft model {name} (sha256 {d.sha256[:12]}): weights "
            f"{format_size(d.bytes_mlx)} + KV cache {format_size(d.kv_cache_bytes)} on the gpu "
            "tier, reserved before the target was placed"
        )
    if sp.method == "self":
        n = 1 + max((r.layer for r in unit_refs(plan, desc) if r.layer is not None), default=-1)
        tiers = plan.tier_of()
        skipped = [
            r
            for r in unit_refs(plan, desc)
            if r.layer is not None and r.layer < sp.draft_layers and tiers[r.name] == "nvme"
        ]
        span = f"blk 0–{sp.draft_layers - 1}" if sp.draft_layers > 1 else "blk 0"
        lines.append(f"  runs {span} ({sp.draft_layers} of {n} blocks), then the output head")
        if skipped:
            runs = group_runs(skipped, key=lambda u: "nvme")
            what = ";  ".join(
                f"{role} {r.span} ({len(r.units)} unit{'s' * (len(r.units) != 1)})"
                for role, rs in runs.items()
                for r in rs
            )
            lines.append(f"  skips the units it would read from NVMe: {what}")
        else:
            lines.append("  skips nothing: every unit it runs is in memory")
    src = sp.acceptance_source or "given"
    lines.append(f"  acceptance rate a = {sp.acceptance_rate:.3g} ({src})")
    if sp.acceptance_how:
        lines.append(f"    {sp.acceptance_how}")
    lines.append(
        f"  tokens per step E = (1 - a^(K+1)) / (1 - a) = {sp.predicted_tokens_per_step:.3f}"
        " (Leviathan et al. 2023)"
    )
    if sp.predicted_step_s is not None and sp.predicted_verify_s is not None:
        lines.append(
            f"  step {format_time(sp.predicted_step_s)} = verification of {k + 1} tokens per "
            f"sequence {format_time(sp.predicted_verify_s)} + {k} draft pass"
            + ("es" if k != 1 else "")
            + f" {format_time(sp.predicted_draft_s or 0.0)}"
        )
    if sp.predicted_decode_tok_s is not None:
        text = (
            f"  Predicted decode with speculation: {format_rate(sp.predicted_decode_tok_s)} tok/s"
        )
        base = plan.prediction.decode_tok_s if plan.prediction else 0.0
        if base > 0:
            ratio = sp.predicted_decode_tok_s / base
            text += f" ({format_rate(base)} without, ×{ratio:.2f})"
        lines.append(text)
    return lines


def explain(plan: Plan, desc: ModelDescription | None = None) -> str:
    """A readable summary of a plan, computed from its own decisions (``planner.rescore``): a
    plan edited by hand is marked so, and its memory, pool and prediction are its own, not the
    stale sections the solver wrote.

    Args:
        plan: the plan.
        desc: the model description, for units' roles and layers; default the plan's own
            ``costs``.

    Returns:
        Text: whether it was edited by hand; the request; bytes per tier (weights, KV cache, pool,
        activations) against capacity;
        placement grouped by role and contiguous layer ranges; pool and prefetch; batch limits;
        the predicted step split into compute / host copy / disk with the bottleneck and binding
        constraints; predicted tokens/s; speculative decoding (drafter, K, what the self-drafter
        skips, the acceptance rate and its source, the speculative step and tokens/s); the
        solver's result.
    """
    if plan.cluster is not None:
        from strata.planner.cluster_views import explain_cluster  # it builds on this module

        return explain_cluster(plan, desc)
    judged = judge(plan)
    view = judged.view
    desc = desc or description_of(plan)
    lines = [f"Plan for {model_label(plan)} on {profile_label(plan)}"]
    if judged.edited:
        lines.append(
            "Edited by hand: its decisions are not the ones strata plan wrote; memory, pool and "
            "prediction below are recomputed from them with the plan's own figures"
        )
    if request_edited(plan):
        lines.append(
            "Request edited since planning: strata run refuses this plan (its placement and KV "
            "cache were sized for the request as planned); re-run strata plan"
        )
    lines += [
        f"Request: {request_label(plan)}",
        f"Runtime: {runtime_label(plan)}",
        "",
        *_memory_lines(view),
        "",
        *_placement_lines(plan, desc),
        _why(view, judged.edited),
        "",
        f"Pool: {pool_label(view)}",
        f"Expert cache: {expert_cache_label(view)}",
        f"Batch: {batch_label(plan)}",
        "",
        *_prediction_lines(view),
        *_baseline_lines(plan, view, judged.edited),
        "",
        *_speculative_lines(view, desc),
        *(
            ["  (the speculative figures are as planned, before the edit)"]
            if judged.edited and plan.speculative.method != "none"
            else []
        ),
    ]
    if plan.solver:
        s = plan.solver
        lines.append(
            f"Solver: {s.name}, {s.status}, objective {format_time(s.objective)} per token, "
            f"gap {s.gap:g}" + (" (as solved, before the edit)" if judged.edited else "")
        )
    return "\n".join(lines) + "\n"
