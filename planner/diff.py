"""``strata diff``: what differs between two plans (e.g. the same model on two machines).

Every figure is recomputed from each plan's own decisions and embedded figures
(``planner.rescore``), so a plan edited by hand shows what its edit costs. Shares the grouping and
formatting helpers of ``planner.explain``: tier moves are reported per role
over contiguous layer ranges (``ffn blk 10–29: gpu → nvme, 20 units, 32.1 MiB``).
"""

from __future__ import annotations

from strata.common.errors import PlanError
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
)
from strata.planner.rescore import Judged, description_of, judge, request_edited

METHODS = {"ilp": "the ILP", "baseline": "the baseline rule"}


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


def _memory(a: Plan, b: Plan) -> list[str]:
    ma, mb = dict(a.memory or {}), dict(b.memory or {})
    lines = []
    zero = TierMemory(capacity=0, weights=0)
    for t in TIERS:
        x, y = ma.get(t, zero), mb.get(t, zero)  # type: ignore[call-overload]
        parts = []
        for field in (
            "weights",
            "kv_cache",
            "recurrent_state",
            "pool",
            "expert_cache",
            "activations",
            "capacity",
        ):
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
    prefill = [("prefill chunk", pa.prefill_chunk_s, pb.prefill_chunk_s)]
    if len(pa.ttft_s) == len(pb.ttft_s) == 2:
        for end, ta, tb, na, nb in zip(
            ("shortest", "longest"),
            pa.ttft_s,
            pb.ttft_s,
            a.request.prompt_tokens,
            b.request.prompt_tokens,
            strict=True,
        ):
            at = f"{na}" if na == nb else f"{na} → {nb}"
            prefill.append((f"TTFT ({end} prompt, {at} tokens)", ta, tb))
    elif pa.ttft_s != pb.ttft_s:
        lines.append(f"  TTFT: only plan {'b' if not pa.ttft_s else 'a'} predicts it")
    for label, fa, fb in prefill:
        if fa is not None and fb is not None and fa != fb:
            lines.append(
                f"  {label} {format_time(fa)} → {format_time(fb)} ({_signed_time(fb - fa)})"
            )
    lines += [f"  {x}" for x in _change("bottleneck", pa.bottleneck, pb.bottleneck)]
    lines += [
        f"  {x}"
        for x in _change(
            "binding", ", ".join(pa.binding) or "none", ", ".join(pb.binding) or "none"
        )
    ]
    return lines


def _machine(a: Plan, b: Plan) -> list[str]:
    """The machine figures that differ, each as ``name a → b`` (the plans' embedded profiles)."""
    fa, fb = _figures(a.machine.model_dump()), _figures(b.machine.model_dump())
    out = []
    for key in fa.keys() | fb.keys():
        va, vb = fa.get(key), fb.get(key)
        if va != vb:
            out.append(f"  {key}: {_figure(key, va)} → {_figure(key, vb)}")
    return ["machine figures:", *sorted(out)] if out else []


def _figures(doc: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value of a profile's numbers and settings (a figure's value only)."""
    out: dict[str, object] = {}
    for k, v in doc.items():
        if k in ("format_version", "name", "description"):
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "value" in v:
            out[key] = v["value"]
        elif isinstance(v, dict):
            out.update(_figures(v, key + "."))
        else:
            out[key] = v
    return out


def _figure(key: str, v: object) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool | str):
        return str(v)
    assert isinstance(v, int | float)
    if key.endswith("flops_s"):
        return f"{v / 1e9:.4g} GFLOP/s"
    if key.endswith("_bytes_s"):
        return f"{format_size(int(v))}/s"
    if key.endswith("_bytes"):
        return format_size(int(v))
    if key.endswith("_s"):
        return format_time(float(v))
    return f"{v:.4g}"


def _experts(a: Plan, b: Plan) -> list[str]:
    """The expert cache, its pins and preload, and the routing profile behind them."""
    ea, eb = a.expert_cache, b.expert_cache
    lines = _change("expert cache", _cache_label(a), _cache_label(b))
    pa, pb = set(ea.pinned), set(eb.pinned)
    if pa != pb:
        lines.append(f"  pinned: +{len(pb - pa)} −{len(pa - pb)} experts ({len(pb)} in all)")
    la, lb = set(ea.preload), set(eb.preload)
    if la != lb:
        lines.append(
            f"  preload: {len(ea.preload)} → {len(eb.preload)} experts "
            f"(+{len(lb - la)} −{len(la - lb)})"
        )
    elif ea.preload != eb.preload:
        lines.append("  preload: the same experts in another order (hottest first)")
    ra, rb = a.provenance.routing_profile, b.provenance.routing_profile
    if (ra and ra.sha256) != (rb and rb.sha256):
        lines.append(f"routing profile: {_routing_label(a)} → {_routing_label(b)}")
    ha = a.prediction.expert_hit_rate if a.prediction else None
    hb = b.prediction.expert_hit_rate if b.prediction else None
    if ha != hb:
        fa = "none" if ha is None else f"{ha:.2f}"
        fb = "none" if hb is None else f"{hb:.2f}"
        lines.append(f"expected expert hit rate: {fa} → {fb}")
    return lines


def _cache_label(p: Plan) -> str:
    e = p.expert_cache
    return f"{e.slots} slots × {format_size(e.slot_bytes)}, prefetch {e.prefetch}"


def _routing_label(p: Plan) -> str:
    r = p.provenance.routing_profile
    if r is None:
        return "none (uniform top-k/n)"
    where = f" from {r.path}" if r.path else ""
    tokens = p.costs.routing.tokens if p.costs.routing else 0
    return f"sha256 {r.sha256[:12]}{where} ({tokens} tokens measured)"


def _speculative(a: Plan, b: Plan) -> list[str]:
    def label(p: Plan) -> str:
        sp = p.speculative
        if sp.method == "none":
            return "none"
        extra = f", {sp.draft_layers} draft layers" if sp.draft_layers else ""
        model = ""
        if sp.draft_model is not None:
            model = f", draft {sp.draft_model.name or sp.draft_model.path}"
        return f"{sp.method}, K = {sp.num_draft_tokens}{extra}{model}, a = {sp.acceptance_rate:.3g}"

    return _change("speculative", label(a), label(b))


def _judged(plan: Plan, name: str) -> Judged:
    try:
        return judge(plan)
    except PlanError as e:
        raise PlanError(f"plan {name}: {e}") from None


def diff(a: Plan, b: Plan, desc: ModelDescription | None = None) -> str:
    """What differs between plan ``a`` and plan ``b``, each judged from its own decisions.

    Args:
        a, b: two plans (typically the same model planned on two machines or for two requests,
            or a plan and its hand-edited copy).
        desc: the model description, for roles and layers of units; default ``a``'s costs.

    Returns:
        Text, one change per line: which plan is edited by hand, model, machine and its figures,
        request, runtime (kernel choices), tier moves per role and layer range, bytes per tier,
        pool and prefetch, expert cache, pins and preload, routing profile and expected hit rate,
        speculative settings, batch limits, predicted time split, decode tok/s and TTFT;
        ``plans are identical`` when nothing differs.
    """
    if a == b:
        return "plans are identical\n"
    ja, jb = _judged(a, "a"), _judged(b, "b")
    va, vb = ja.view, jb.view
    lines = []
    for name, p, j in (("a", a, ja), ("b", b, jb)):
        if j.edited:
            lines.append(f"plan {name} is edited by hand (its figures are recomputed)")
        if request_edited(p):
            lines.append(f"plan {name}'s request was edited since planning (strata run refuses it)")
    lines += _change("model", model_label(a), model_label(b))
    lines += _change("machine", profile_label(a), profile_label(b))
    lines += _machine(a, b)
    pa, pb = a.provenance, b.provenance
    lines += _change("decided by", METHODS[pa.method], METHODS[pb.method])
    lines += _change("planner version", str(pa.planner_version), str(pb.planner_version))
    lines += _change("solver", pa.solver or "none", pb.solver or "none")
    lines += _change("request", request_label(a), request_label(b))
    lines += _change("runtime", runtime_label(a), runtime_label(b))
    lines += _moves(a, b, desc or description_of(a))
    if a.cluster is not None or b.cluster is not None:
        from strata.planner.cluster_views import cluster_diff  # it builds on planner.explain

        # Per-tier memory of one host against another's stage 0 says nothing: per host instead.
        lines += cluster_diff(a, b, va, vb, desc or description_of(a))
    else:
        lines += _memory(va, vb)
    streaming = _change("pool", pool_label(va), pool_label(vb)) + _experts(va, vb)
    if streaming and (a.cluster is not None or b.cluster is not None):
        streaming.insert(0, "rank 0's streaming (a cluster plan's other hosts: strata explain):")
    lines += streaming
    lines += _speculative(a, b)
    lines += _change("batch", batch_label(a), batch_label(b))
    lines += _prediction(va, vb)
    if not lines:
        # Only fields not summarized above differ (provenance details, stored sections...).
        da, db = a.model_dump(), b.model_dump()
        keys = []
        for k in da:
            if da[k] != db[k]:
                sub = da[k] if isinstance(da[k], dict) else {}
                inner = [f"{k}.{x}" for x in sub if sub[x] != (db[k] or {}).get(x)]
                keys += inner or [k]
        lines.append(f"plans differ only in: {', '.join(keys)} (nothing that changes behaviour)")
    return "\n".join(lines) + "\n"
