"""``strata diff``: what differs between two plans (e.g. the same model on two machines).

Shares the grouping and formatting helpers of ``planner.explain``: tier moves are reported per role
over contiguous layer ranges (``ffn blk 10–29: gpu → nvme, 20 units, 32.1 MiB``).
"""

from __future__ import annotations

from strata.common.schemas import TIERS, ModelDescription, Plan, TierMemory
from strata.common.sizes import format_size
from strata.planner.costmodel import batch_size
from strata.planner.explain import (
    batch_label,
    format_rate,
    format_time,
    group_runs,
    model_label,
    pool_label,
    profile_label,
    request_label,
    runtime_label,
    unit_refs,
    weights_per_tier,
)


def _signed_size(n: int) -> str:
    return ("+" if n > 0 else "−" if n < 0 else "±") + format_size(abs(n))


def _signed_time(s: float) -> str:
    return ("+" if s > 0 else "−" if s < 0 else "±") + format_time(abs(s))


def _change(label: str, a: str, b: str) -> list[str]:
    return [] if a == b else [f"{label}: {a} → {b}"]


def _moves(a: Plan, b: Plan, desc: ModelDescription | None) -> list[str]:
    tier_a, tier_b = a.tier_of(), b.tier_of()
    moved = [u for u in unit_refs(a, desc) if u.name in tier_b and tier_a[u.name] != tier_b[u.name]]
    lines = []
    if moved:
        n = len(moved)
        lines.append(f"placement: {n} unit{'s' if n != 1 else ''} moved")
        runs = group_runs(moved, key=lambda u: (tier_a[u.name], tier_b[u.name]))
        for role, rs in runs.items():
            for r in rs:
                src, dst = r.key  # type: ignore[misc]
                count = f"{len(r.units)} unit{'s' if len(r.units) != 1 else ''}"
                lines.append(f"  {role} {r.span}: {src} → {dst}, {count}, {format_size(r.bytes)}")
    only_a = [p.unit for p in a.placement if p.unit not in tier_b]
    only_b = [p.unit for p in b.placement if p.unit not in tier_a]
    for label, names in (("only in a", only_a), ("only in b", only_b)):
        if names:
            shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")
            lines.append(f"  units {label}: {shown}")
    return lines


def _tier_bytes(plan: Plan) -> dict[str, TierMemory]:
    if plan.memory is not None:
        return dict(plan.memory)
    # Hand-written plan without a memory section: weights from the placement, capacity unknown (0).
    return {t: TierMemory(capacity=0, weights=w) for t, w in weights_per_tier(plan).items()}


def _memory(a: Plan, b: Plan) -> list[str]:
    ma, mb = _tier_bytes(a), _tier_bytes(b)
    lines = []
    zero = TierMemory(capacity=0, weights=0)
    for t in TIERS:
        x, y = ma.get(t, zero), mb.get(t, zero)  # type: ignore[call-overload]
        parts = []
        for field in ("weights", "kv_cache", "pool", "activations", "capacity"):
            va, vb = getattr(x, field), getattr(y, field)
            if va != vb:
                name = field.replace("_", " ")
                parts.append(
                    f"{name} {format_size(va)} → {format_size(vb)} ({_signed_size(vb - va)})"
                )
        if parts:
            lines.append(f"  {t}: " + "; ".join(parts))
    return ["memory:", *lines] if lines else []


def _prediction(a: Plan, b: Plan) -> list[str]:
    pa, pb = a.prediction, b.prediction
    if pa is None or pb is None:
        if (pa is None) != (pb is None):
            return [f"prediction: only plan {'b' if pa is None else 'a'} has one"]
        return []
    if pa == pb:
        return []
    ba, bb = batch_size(a.request, a.batch), batch_size(b.request, b.batch)
    lines = ["prediction:" + (f" (a decode step of {ba} → {bb} sequences)" if ba != bb else "")]
    for label, va, vb in (
        ("step", pa.step_s, pb.step_s),
        ("compute", pa.compute_s, pb.compute_s),
        ("host copy", pa.host_copy_s, pb.host_copy_s),
        ("disk", pa.disk_s, pb.disk_s),
        ("I/O stall", pa.io_stall_s, pb.io_stall_s),
    ):
        if va != vb:
            lines.append(
                f"  {label} {format_time(va)} → {format_time(vb)} ({_signed_time(vb - va)})"
            )
    if pa.decode_tok_s != pb.decode_tok_s:
        d = pb.decode_tok_s - pa.decode_tok_s
        lines.append(
            f"  decode {format_rate(pa.decode_tok_s)} → {format_rate(pb.decode_tok_s)} tok/s"
            + (" aggregate" if max(ba, bb) > 1 else "")
            + " "
            f"({'+' if d >= 0 else '−'}{format_rate(abs(d))})"
        )
    lines += [f"  {x}" for x in _change("bottleneck", pa.bottleneck, pb.bottleneck)]
    lines += [
        f"  {x}"
        for x in _change(
            "binding", ", ".join(pa.binding) or "none", ", ".join(pb.binding) or "none"
        )
    ]
    return lines


def diff(a: Plan, b: Plan, desc: ModelDescription | None = None) -> str:
    """What differs between plan ``a`` and plan ``b``.

    Args:
        a, b: two plans (typically the same model planned on two machines or for two requests).
        desc: the model description, for roles and layers of units; inferred from names otherwise.

    Returns:
        Text, one change per line: model and profile fingerprints, request, runtime, tier moves per
        role and layer range, byte deltas per tier, pool / prefetch / batch changes, predicted
        step-time and tok/s deltas; ``plans are identical`` when nothing differs.
    """
    if a == b:
        return "plans are identical\n"
    lines = []
    lines += _change("model", model_label(a), model_label(b))
    lines += _change("profile", profile_label(a), profile_label(b))
    fa, fb = a.fingerprints, b.fingerprints
    lines += _change("planner version", str(fa.planner_version), str(fb.planner_version))
    lines += _change("solver", str(fa.solver), str(fb.solver))
    lines += _change("request", request_label(a), request_label(b))
    lines += _change("runtime", runtime_label(a), runtime_label(b))
    lines += _moves(a, b, desc)
    lines += _memory(a, b)
    lines += _change("pool", pool_label(a), pool_label(b))
    ea, eb = a.expert_cache, b.expert_cache
    lines += _change(
        "expert cache",
        f"{ea.slots} slots, pinned {ea.pinned}",
        f"{eb.slots} slots, pinned {eb.pinned}",
    )
    lines += _change("batch", batch_label(a), batch_label(b))
    lines += _prediction(a, b)
    if not lines:
        # Only fields not summarized above differ (fingerprints' versions, solver details...).
        da, db = a.model_dump(), b.model_dump()
        keys = [k for k in da if da[k] != db[k]]
        lines.append(f"plans differ only in: {', '.join(keys)}")
    return "\n".join(lines) + "\n"
