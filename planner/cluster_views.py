"""``strata explain`` and ``strata diff`` of cluster plans: the hosts, the stage split, the links
and what binds the pipeline, each stage shown as the one-host plan of its own units
(``common.cluster.stage_view``), every figure recomputed from the plan's decisions
(``planner.rescore.judge``)."""

from __future__ import annotations

from strata.common.cluster import EVERY_STAGE_UNITS, stage_view
from strata.common.schemas import TIERS, ModelDescription, Plan, StagePlan
from strata.common.sizes import format_size
from strata.planner.costmodel import batch_size, objective, rate_label
from strata.planner.diff import _change
from strata.planner.explain import (
    _memory_lines,
    _placement_lines,
    _prediction_lines,
    _why,
    expert_cache_label,
    format_rate,
    format_time,
    model_label,
    pool_label,
    request_label,
    unit_refs,
)
from strata.planner.pipeline import transfer_s
from strata.planner.rescore import description_of, judge, request_edited

ONE_HOST = "the one host"


def _blocks(s: StagePlan, rank: int) -> str:
    """``blk 0–9 + token_embd, output`` (rank 0 holds the embedding and the head)."""
    span = f"blk {s.first_block}" if s.end_block - s.first_block == 1 else ""
    span = span or f"blk {s.first_block}–{s.end_block - 1}"
    return span + (" + embedding and head" if rank == 0 else "")


def _weights(plan: Plan, host: str | None) -> dict[str, int]:
    out = dict.fromkeys(TIERS, 0)
    for p in plan.placement:
        if p.host == host:
            out[p.tier] += p.bytes
    return out


def _tiers(w: dict[str, int]) -> str:
    return ", ".join(f"{t} {format_size(b)}" for t, b in w.items() if b) or "none"


def hosts_lines(view: Plan) -> list[str]:
    """The hosts section of a judged cluster plan: per stage its host, blocks, weights per tier,
    KV cache and own decode step; per link its bytes per token, figures and transfer per step;
    the pipeline's step as their sum and what binds it."""
    c = view.cluster
    assert c is not None and c.prediction is not None
    b = batch_size(view.request, view.batch)
    lines = ["Hosts (rank: host, its blocks, weights per tier, KV cache, its own decode step):"]
    for rank, s in enumerate(c.stages):
        kv = s.memory["gpu"].kv_cache if s.memory else 0  # type: ignore[index]
        p = s.prediction
        assert p is not None
        lines.append(
            f"  {rank} {s.host} ({s.address}, {s.machine.name}, {s.machine.backend}): "
            f"{_blocks(s, rank)}; weights {_tiers(_weights(view, s.host))}; KV cache "
            f"{format_size(kv)}; step {format_time(p.step_s)} ({p.bottleneck}-bound)"
        )
    lines.append(
        f"Links (the residual rows of every token cross each boundary; one decode step sends "
        f"{b} row{'s' * (b != 1)}):"
    )
    for lk in c.links:
        lines.append(
            f"  {lk.hosts[0]} → {lk.hosts[1]}: {format_size(lk.bytes_per_token)} per token over "
            f"{format_size(int(lk.bandwidth_bytes_s.value))}/s + "
            f"{format_time(lk.latency_s.value)} latency ({lk.bandwidth_bytes_s.source}): "
            f"{format_time(lk.predicted_s)} per step"
        )
    if not c.links:
        lines.append("  none (one host)")
    m = c.prediction.micro_batches
    if m == 1:
        parts = [f"{s.host} {format_time(s.prediction.step_s)}" for s in c.stages]  # type: ignore[union-attr]
        parts += [f"{lk.hosts[0]}→{lk.hosts[1]} {format_time(lk.predicted_s)}" for lk in c.links]
        lines += [
            f"Predicted pipeline decode step at batch {b}: {format_time(c.prediction.step_s)} = "
            + " + ".join(parts),
            "  lock-step, 1 micro-batch: no stage works while another does (planner/pipeline.py)",
            f"  binding: {c.prediction.binding} (the largest term of the step)",
        ]
        return lines
    rows = -(-b // m)
    lock = sum(s.prediction.step_s for s in c.stages)  # type: ignore[union-attr]
    lock += sum(transfer_s(lk, b) for lk in c.links)
    lines += [
        f"Predicted pipeline decode step at batch {b}: {format_time(c.prediction.step_s)} in "
        f"{m} micro-batches of {rows} sequence{'s' * (rows != 1)} flowing through the stages "
        "(each stage's time for one with its send, summed, + "
        f"{m - 1} x the slowest: planner/pipeline.py); lock-step "
        f"{format_time(lock)}",
        f"  binding: {c.prediction.binding} (the largest term of a micro-batch)",
    ]
    return lines


def explain_cluster(plan: Plan, desc: ModelDescription | None = None) -> str:
    """``planner.explain.explain`` of a cluster plan: the hosts section (:func:`hosts_lines`),
    the pipeline's decode rate and TTFT, then each stage as explain shows a one-host plan
    (memory, placement, pool, expert cache, its own step)."""
    judged = judge(plan)
    view = judged.view
    c = view.cluster
    assert c is not None and view.prediction is not None
    p = view.prediction
    lines = [
        f"Plan for {model_label(plan)} over cluster {c.name}: {len(c.stages)} host"
        f"{'s' * (len(c.stages) != 1)}, MLX's {c.backend} backend, a pipeline of contiguous "
        "blocks (rank 0 holds the embedding and the head, and serves)"
    ]
    if judged.edited:
        lines.append(
            "Edited by hand: its decisions are not the ones strata plan wrote; memory, pool and "
            "prediction below are recomputed from them with the plan's own figures"
        )
    if request_edited(plan):
        lines.append("Request edited since planning: strata run refuses this plan; re-plan")
    lines += [f"Request: {request_label(plan)}", "", *hosts_lines(view)]
    lines.append(
        f"Predicted decode: {format_rate(p.decode_tok_s)} tok/s"
        + rate_label(plan.request, plan.batch)
    )
    if len(p.ttft_s) == 2:
        (p1, p2), (t1, t2) = plan.request.prompt_tokens, p.ttft_s
        lines.append(
            f"Predicted TTFT: {format_time(t1)} at {p1} tokens, {format_time(t2)} at {p2} tokens "
            "(each stage's prefill, and every chunk's rows over every link)"
        )
        lines.append(
            f"Objective: {format_time(objective(p, plan.request, plan.batch))} per generated "
            "token of whole requests"
        )
    for rank, s in enumerate(c.stages):
        sv = stage_view(view, rank)
        sdesc = description_of(sv)
        lines += [
            "",
            f"== host {s.host} (rank {rank}: {_blocks(s, rank)}) ==",
            *_memory_lines(sv),
            *_placement_lines(sv, sdesc),
            _why(sv, judged.edited),
            f"Pool: {pool_label(sv)}",
            f"Expert cache: {expert_cache_label(sv)}",
            *_step_lines(sv),
        ]
    if plan.solver:
        lines += [
            "",
            f"Solver: {plan.solver.name}, {plan.solver.status} on every stage, objective "
            f"{format_time(plan.solver.objective)} per token, largest gap {plan.solver.gap:g}",
        ]
    return "\n".join(lines) + "\n"


def _step_lines(sv: Plan) -> list[str]:
    """A stage's own decode step and its terms (explain's prediction lines up to the rate, which
    for a stage alone would mislead)."""
    lines = _prediction_lines(sv)
    end = next((i for i, x in enumerate(lines) if x.startswith("Predicted decode:")), len(lines))
    return [x.replace("Predicted decode step", "Its decode step", 1) for x in lines[:end]]


def _hosts_label(plan: Plan) -> str:
    c = plan.cluster
    if c is None:
        return f"one host ({plan.machine.name})"
    stages = ", ".join(f"{s.host} {_blocks(s, r)}" for r, s in enumerate(c.stages))
    return f"{len(c.stages)} hosts over {c.backend}: {stages}"


def _memory_label(view: Plan) -> str:
    """Each host's device use against its capacity (the gpu tier's row)."""
    stages = (
        [(s.host, s.memory) for s in view.cluster.stages]
        if view.cluster
        else [(ONE_HOST, view.memory)]
    )
    out = []
    for host, mem in stages:
        if not mem:
            continue
        g = mem["gpu"]  # type: ignore[index]
        used = g.weights + g.kv_cache + g.pool + g.expert_cache + g.activations + g.recurrent_state
        out.append(f"{host} gpu {format_size(used)} of {format_size(g.capacity)}")
    return "; ".join(out)


def _links_label(view: Plan) -> str:
    """Each boundary's link (a judged plan's): its figures, bytes per token and transfer per
    decode step."""
    if view.cluster is None or not view.cluster.links:
        return "none (one host)"
    return "; ".join(
        f"{lk.hosts[0]} → {lk.hosts[1]} {format_size(lk.bytes_per_token)}/token over "
        f"{format_size(int(lk.bandwidth_bytes_s.value))}/s + {format_time(lk.latency_s.value)}: "
        f"{format_time(lk.predicted_s)} per step"
        for lk in view.cluster.links
    )


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"blk {start}" if start == x else f"blk {start}–{x}")
            start = None
    return ", ".join(out)


def cluster_diff(a: Plan, b: Plan, va: Plan, vb: Plan, desc: ModelDescription | None) -> list[str]:
    """The hosts' part of ``strata diff`` where either plan is a cluster plan: the stage split,
    which blocks moved to which host (as block ranges), the links' transfers, each host's device
    memory and the binding part (``va``, ``vb``: the judged plans)."""
    lines = _change("hosts", _hosts_label(a), _hosts_label(b))
    host_a = {p.unit: p.host or ONE_HOST for p in a.placement}
    host_b = {p.unit: p.host or ONE_HOST for p in b.placement}
    moves: dict[tuple[str, str], tuple[set[int], list[str], int, int]] = {}
    for u in unit_refs(b, desc):
        src, dst = host_a.get(u.name), host_b[u.name]
        if src is None or src == dst or u.name in EVERY_STAGE_UNITS:  # on every host
            continue
        layers, others, n, size = moves.get((src, dst), (set(), [], 0, 0))
        if u.layer is None:
            others.append(u.name)
        else:
            layers.add(u.layer)
        moves[(src, dst)] = (layers, others, n + 1, size + u.bytes)
    if moves:
        lines.append("stage split: blocks moved between hosts")
        for (src, dst), (layers, others, n, size) in moves.items():
            what = ", ".join(x for x in (_ranges(sorted(layers)), ", ".join(others)) if x)
            lines.append(f"  {what}: {src} → {dst} ({n} unit{'s' * (n != 1)}, {format_size(size)})")
    lines += _change("links", _links_label(va), _links_label(vb))
    lines += _change("device memory", _memory_label(va), _memory_label(vb))

    def binding(v: Plan) -> str:
        if v.cluster and v.cluster.prediction:
            return v.cluster.prediction.binding
        return f"{ONE_HOST} ({v.prediction.bottleneck}-bound)" if v.prediction else "none"

    if binding(va) != binding(vb):
        lines.append(f"binding: {binding(va)} → {binding(vb)}")
    return lines
