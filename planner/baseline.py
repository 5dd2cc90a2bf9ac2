"""The obvious rule a plan must beat: the first blocks resident in order, the rest on the next
tier — llama.cpp's ``-ngl N`` with ``--fit`` choosing the largest N that fits, and Hypura's
rule-based modes.

Units are taken in forward-pass order (the token embedding, then each block with its attention,
FFN and experts as one piece, then the output head). The rule gives the device as many leading
pieces as fit beside the KV cache, the activations and the streaming buffers, then host RAM as
many of the following pieces as fit, and streams the rest from NVMe, each piece on one tier and
no piece after a later one's tier; it reads one unit ahead (prefetch depth 1) when anything
streams and two pool slots fit, else reads synchronously from one slot (depth 0, as llama.cpp
reads an mmapped file), and keeps the expert cache at its working slots. Its decisions are
scored with the same cost model as the ILP's (``costmodel.score``), so ``explain`` can put the
two side by side, and ``strata plan --baseline`` writes it as a plan that runs like any other.
"""

from __future__ import annotations

from strata.common.errors import PlanError
from strata.common.schemas import (
    TIERS,
    HardwareProfile,
    ModelDescription,
    Placement,
    Plan,
    Prefetch,
    Provenance,
    Request,
)
from strata.planner.costmodel import (
    PinnedPlacement,
    capacity_use,
    runtime_for,
    score,
    tier_memory,
)
from strata.planner.rescore import decisions_sha256, model_costs

RULE = "first blocks resident in order, the rest on the next tier (llama.cpp's -ngl/--fit)"


def _pieces(desc: ModelDescription) -> list[list[str]]:
    """Units in forward-pass order, a block's units together: the embedding first, then the
    blocks, then every other non-block unit (the output head)."""
    blocks: dict[int, list[str]] = {}
    first, last = [], []
    for u in desc.units:
        if u.layer is not None:
            blocks.setdefault(u.layer, []).append(u.name)
        elif u.role == "embedding":
            first.append(u.name)
        else:
            last.append(u.name)
    return [[n] for n in first] + [blocks[i] for i in sorted(blocks)] + [[n] for n in last]


def _fits_at(desc, profile, request, tiers: dict[str, str], depth: int) -> bool:
    depth = depth if "nvme" in tiers.values() else 0
    rows = capacity_use(desc, profile, request, PinnedPlacement(tiers, depth))
    return all(used <= row.capacity for row, used in rows)


def _arrange(desc, profile, request, allowed: list[str], depth: int) -> dict[str, str] | None:
    """The rule's tiers when streamed units are read ``depth`` ahead, or None where nothing
    fits so: each tier takes as many of the next pieces as fit (the rest on the last tier),
    then each tier takes the next pieces while they fit (a count chosen with the rest streamed
    paid for pool slots the final placement may not need)."""
    pieces = _pieces(desc)
    last = allowed[-1]
    tiers: dict[str, str] = {}
    start = 0
    for tier in allowed[:-1]:
        count = 0
        for k in range(len(pieces) - start, -1, -1):
            trial = dict(tiers)
            for j, piece in enumerate(pieces[start:]):
                trial.update(dict.fromkeys(piece, tier if j < k else last))
            if _fits_at(desc, profile, request, trial, depth):
                count = k
                break
        for piece in pieces[start : start + count]:
            tiers.update(dict.fromkeys(piece, tier))
        start += count
    for piece in pieces[start:]:
        tiers.update(dict.fromkeys(piece, last))
    grown = True
    while grown:
        grown = False
        for rank, tier in enumerate(allowed[:-1]):
            nxt = next((p for p in pieces if allowed.index(tiers[p[0]]) > rank), None)
            if nxt is None:
                continue
            trial = dict(tiers, **dict.fromkeys(nxt, tier))
            if _fits_at(desc, profile, request, trial, depth):
                tiers, grown = trial, True
    return tiers if _fits_at(desc, profile, request, tiers, depth) else None


def baseline_placement(
    desc: ModelDescription, profile: HardwareProfile, request: Request
) -> PinnedPlacement:
    """The rule's tier for every unit and its prefetch depth (module docstring), on the
    request's allowed tiers: depth 1 where any arrangement fits so, else synchronous reads.

    Raises:
        PlanError: not even the all-streamed placement fits (the KV cache and activations alone
            overflow the device).
    """
    allowed = [t for t in TIERS if t in request.tiers]
    for depth in (1, 0):
        tiers = _arrange(desc, profile, request, allowed, depth)
        if tiers is not None:
            return PinnedPlacement(tiers, depth if "nvme" in tiers.values() else 0)
    raise PlanError(
        f"the baseline rule finds no placement that fits on tiers {', '.join(allowed)}: the "
        "KV cache and activations alone overflow the device; give a smaller --context or "
        "--concurrency"
    )


def baseline_plan(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    provenance: Provenance | None = None,
) -> Plan:
    """The rule's plan (``baseline_placement``), complete and runnable, marked ``method:
    baseline``.

    Raises:
        PlanError: as ``baseline_placement``.
    """
    placement = baseline_placement(desc, profile, request)
    tiers = placement.tiers
    streams = "nvme" in tiers.values()
    pool, batch, cache = placement.resolve(desc, request)
    plan = Plan(
        model=desc.model,
        machine=profile,
        request=request,
        runtime=runtime_for(profile),
        placement=[
            Placement(unit=u.name, tier=tiers[u.name], bytes=u.bytes_mlx)  # type: ignore[arg-type]
            for u in desc.units
        ],
        pool=pool,
        prefetch=Prefetch(
            depth=placement.depth, io_threads=profile.nvme.queue_depth if streams else 0
        ),
        expert_cache=cache,
        batch=batch,
        memory=tier_memory(desc, profile, request, placement),  # type: ignore[arg-type]
        prediction=score(desc, profile, request, placement),
        costs=model_costs(desc),
        provenance=(provenance or Provenance()).model_copy(
            update={"method": "baseline", "solver": None}
        ),
    )
    plan.provenance.decisions_sha256 = decisions_sha256(plan)
    return plan
