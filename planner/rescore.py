"""A plan judged from its own contents: its decisions re-scored with its embedded machine figures
and model costs, whoever wrote it (the solver, a person, another machine's Strata).

``explain``, ``diff``, ``check`` and ``bench`` show what this module computes, never the plan's
stored ``memory`` and ``prediction`` sections, which describe the decisions as the solver wrote
them and go stale when a person edits the placement. The plan's ``provenance.decisions_sha256``
tells the two cases apart (``edited``).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.common.cluster import check_cluster_placement, stage_view
from strata.common.describe import recurrent_state_elements
from strata.common.errors import PlanError, SchemaError
from strata.common.schemas import (
    HardwareProfile,
    ModelCosts,
    ModelDescription,
    Plan,
    Pool,
    Prefetch,
    UnitCosts,
    UnitInfo,
)
from strata.common.yamlio import canonical_sha256, sha256_of
from strata.planner.costmodel import (
    CapacityRow,
    PinnedPlacement,
    capacity_use,
    score,
    tier_memory,
)
from strata.planner.pipeline import pipeline_prediction

DECISIONS = ("runtime", "placement", "pool", "prefetch", "expert_cache", "batch")
"""The plan sections that decide how it runs (besides the speculative settings below)."""

SPECULATIVE_DECISIONS = ("method", "num_draft_tokens", "draft_layers")
"""The speculative section's decisions; its other fields are predictions and their inputs."""


def model_costs(desc: ModelDescription) -> ModelCosts:
    """What the cost model reads of ``desc``, for embedding in a plan (``Plan.costs``)."""
    return ModelCosts(
        architecture=desc.architecture,
        kv_elements_per_token=desc.kv_elements_per_token,
        routing=desc.routing,
        units=[
            UnitCosts(
                name=u.name,
                role=u.role,
                layer=u.layer,
                expert=u.expert,
                bytes=u.bytes_mlx,
                access=u.access_per_token,
                flops=u.flops_per_token,
            )
            for u in desc.units
        ],
    )


def description_of(plan: Plan) -> ModelDescription:
    """The model description the cost model needs, rebuilt from ``plan.costs`` (no tensors: the
    cost model reads units only)."""
    c = plan.costs
    units = [
        UnitInfo(
            name=u.name,
            layer=u.layer,
            role=u.role,
            tensors=[],
            bytes_gguf=0,
            bytes_mlx=u.bytes,
            access_per_token=u.access,
            flops_per_token=u.flops,
            supported=True,
            expert=u.expert,
        )
        for u in c.units
    ]
    total = sum(u.bytes for u in c.units)
    # A pipeline stage's view (``common.cluster.stage_view``) holds some of the recurrent
    # blocks: its state is theirs (every recurrent block keeps the same per sequence).
    recurrent = set(c.architecture.recurrent_layers)
    held = len(recurrent & {u.layer for u in c.units if u.layer is not None})
    state = recurrent_state_elements(c.architecture) * held // len(recurrent) if recurrent else 0
    return ModelDescription(
        model=plan.model,
        architecture=c.architecture,
        file_type="unknown",
        kv_elements_per_token=c.kv_elements_per_token,
        kv_bytes_per_token=c.kv_elements_per_token * 2,
        recurrent_state_elements_per_sequence=state,
        bytes_gguf=0,
        bytes_mlx=total,
        units=units,
        tensors=[],
        routing=c.routing,
    )


def decisions_sha256(plan: Plan) -> str:
    """Canonical sha256 of the plan's decisions (``DECISIONS`` and the speculative settings) and
    of what they were judged with (``machine``, ``costs``): an edit of either makes every view
    of the plan differ from what the solver wrote."""
    doc = {k: getattr(plan, k).model_dump(mode="json") for k in DECISIONS if k != "placement"}
    doc["machine"] = plan.machine.model_dump(mode="json")
    doc["costs"] = plan.costs.model_dump(mode="json")
    doc["placement"] = sorted((p.unit, p.tier) for p in plan.placement)
    sp = plan.speculative
    doc["speculative"] = {k: getattr(sp, k) for k in SPECULATIVE_DECISIONS}
    doc["draft_model"] = sp.draft_model.sha256 if sp.draft_model else None
    if plan.cluster is not None:  # one-host plans' digests stay as they were
        doc["placement"] = sorted((p.unit, p.tier, p.host or "") for p in plan.placement)
        doc["cluster"] = {
            "backend": plan.cluster.backend,
            "stages": [
                s.model_dump(mode="json", exclude={"memory", "prediction"})
                for s in plan.cluster.stages
            ],
            "links": [
                lk.model_dump(mode="json", exclude={"predicted_s"}) for lk in plan.cluster.links
            ],
        }
    return sha256_of(doc)


def edited(plan: Plan) -> bool:
    """Whether the plan's decisions differ from the ones its planner wrote (no digest: a plan
    written by hand from the start, which counts as edited)."""
    want = plan.provenance.decisions_sha256
    return want is None or want != decisions_sha256(plan)


def executed_pool(plan: Plan) -> tuple[Pool, Prefetch]:
    """The pool and prefetch depth the executor runs the plan with: ``max(pool.slots, 1)``
    slots of the largest streamed dense unit when one streams (``WeightStore.start_streaming``),
    reading ``slots - 1`` units ahead; no pool otherwise. The same as the plan's own for a plan
    the solver wrote; for a hand-edited one, what its placement actually costs."""
    costs = {u.name: u for u in plan.costs.units}
    streamed = [
        costs[p.unit].bytes
        for p in plan.placement
        if p.tier == "nvme" and p.unit in costs and costs[p.unit].expert is None
    ]
    if not streamed:
        return Pool(slots=0, slot_bytes=0), plan.prefetch.model_copy(update={"depth": 0})
    slots = max(plan.pool.slots, 1)
    return (
        Pool(slots=slots, slot_bytes=max(streamed)),
        Prefetch(depth=slots - 1, io_threads=max(plan.prefetch.io_threads, 1)),
    )


def executed_placement(plan: Plan) -> PinnedPlacement:
    """The plan's decisions as the executor runs them (``executed_pool``), for the cost model.

    Raises:
        PlanError: a unit placed twice, or placed with other bytes than its costs say (a
            placement's bytes are the unit's size, not a decision).
    """
    costs = {u.name: u.bytes for u in plan.costs.units}
    seen: set[str] = set()
    for p in plan.placement:
        if p.unit in seen:
            raise PlanError(f"unit {p.unit} is placed twice; give each unit one tier")
        seen.add(p.unit)
        if p.unit in costs and p.bytes != costs[p.unit]:
            raise PlanError(
                f"placement of {p.unit} says {p.bytes} bytes but the unit has {costs[p.unit]} "
                "(costs.units): a unit's bytes are its size, not a decision; restore them"
            )
    pool, prefetch = executed_pool(plan)
    return PinnedPlacement(plan.tier_of(), prefetch.depth, pool, plan.batch, plan.expert_cache)


def request_edited(plan: Plan) -> bool:
    """Whether the request section differs from the one planned (``strata run`` refuses it)."""
    want = plan.provenance.request_sha256
    return want is not None and want != canonical_sha256(plan.request)


def speculative_bytes(plan: Plan) -> int:
    """Device bytes speculative decoding adds to what the placement needs: the draft model's
    weights, KV cache and extra activations, and the verification pass's extra logits."""
    sp = plan.speculative
    d = sp.draft_model
    own = d.bytes_mlx + d.kv_cache_bytes + d.activation_bytes if d is not None else 0
    return own + sp.activation_bytes


def memory_needs(plan: Plan) -> list[tuple[CapacityRow, int]]:
    """Each memory the plan's decisions use (the cost model's capacity rows: on unified memory
    the shared gpu + ram row binds) with the bytes they need there, speculative decoding's
    device bytes included; ``row.capacity`` is the plan's own budget.

    Raises:
        PlanError: as ``executed_placement``; a cluster plan (its memory is per host: ask of
            ``common.cluster.stage_view(plan, rank)``).
    """
    if plan.cluster is not None:
        raise PlanError(
            "a cluster plan's memory is per host: judge one stage (strata.common.cluster."
            "stage_view(plan, rank))"
        )
    rows = capacity_use(description_of(plan), plan.machine, plan.request, executed_placement(plan))
    extra = speculative_bytes(plan)
    return [(row, used + (extra if "gpu" in row.weight_tiers else 0)) for row, used in rows]


@dataclass(frozen=True)
class Judged:
    """A plan's decisions re-scored with its own figures."""

    view: Plan
    """The plan with its memory, prediction, pool and prefetch as computed here: what every
    view of the plan prints."""
    edited: bool
    """Its decisions are not the ones its planner wrote."""


def judge(plan: Plan, machine: HardwareProfile | None = None) -> Judged:
    """Re-score ``plan``'s decisions with its model costs and its embedded machine figures (or
    ``machine``'s: another machine's profile, for ``strata check``; a cluster plan's rank 0).

    A cluster plan is judged stage by stage (``common.cluster.stage_view``: each stage a
    one-host plan of its own units on its host), its links' transfers and the pipeline's step
    recomputed from them (``planner.pipeline``); the view's cluster section holds the judged
    stages, its top-level memory, pool and prefetch are stage 0's, its prediction the
    pipeline's.

    Raises:
        PlanError: the placement does not cover exactly the units in ``plan.costs``.
    """
    if plan.cluster is not None:
        return _judge_cluster(plan, machine)
    desc = description_of(plan)
    profile = machine or plan.machine
    placement = executed_placement(plan)
    pool, prefetch = executed_pool(plan)
    view = plan.model_copy(
        update={
            "memory": tier_memory(desc, profile, plan.request, placement),
            "prediction": score(desc, profile, plan.request, placement),
            "pool": pool,
            "prefetch": prefetch,
        }
    )
    return Judged(view, edited(plan))


def _judge_cluster(plan: Plan, machine: HardwareProfile | None) -> Judged:
    """``judge`` of a cluster plan (its docstring)."""
    assert plan.cluster is not None
    try:
        check_cluster_placement(plan)  # a unit moved to another host names itself, not a gap
    except SchemaError as e:
        raise PlanError(str(e)) from None
    stages = []
    priced = []  # each stage's (description, machine, view): its step at other batches
    for rank, stage in enumerate(plan.cluster.stages):
        try:
            sv = stage_view(plan, rank)
            view = judge(sv, machine if rank == 0 else None).view
        except PlanError as e:
            raise PlanError(f"host {stage.host}'s stage: {e}") from None
        priced.append((description_of(sv), (machine if rank == 0 else None) or sv.machine, sv))
        stages.append(
            stage.model_copy(
                update={
                    "memory": view.memory,
                    "prediction": view.prediction,
                    "pool": view.pool,
                    "prefetch": view.prefetch,
                }
            )
        )

    def step_at(rows: int) -> list[float]:  # micro-batched decode (planner.pipeline)
        return [
            score(
                d, m, sv.request.model_copy(update={"concurrency": rows}), executed_placement(sv)
            ).step_s
            for d, m, sv in priced
        ]

    prediction, cluster_prediction, links = pipeline_prediction(
        stages, plan.cluster.links, plan.request, plan.batch, step_at
    )
    cluster = plan.cluster.model_copy(
        update={"stages": stages, "links": links, "prediction": cluster_prediction}
    )
    s0 = stages[0]
    view = plan.model_copy(
        update={
            "memory": s0.memory,
            "prediction": prediction,
            "pool": s0.pool,
            "prefetch": s0.prefetch,
            "cluster": cluster,
        }
    )
    return Judged(view, edited(plan))
