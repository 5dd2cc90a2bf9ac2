"""Cluster plans: which units each host of a pipeline holds, a host's one-host view of a cluster
plan, and the cluster description read from its file.

A cluster plan (``Plan.cluster``) cuts the blocks into contiguous stages, stage ``i`` on rank
``i``. The residual stream goes from stage to stage and, after the last, back to rank 0, which
holds the token embedding and the output head (where the tokenizer, the scheduler and the API
are): an activation crosses every boundary once per pass row, and a one-host plan is the same
thing with one stage. Every stage holds the model's ``globals`` unit (RoPE frequency factors)
its attention needs. The planner solves each stage as a one-host plan of the description
:func:`stage_description` gives; the executor of rank ``i`` loads :func:`stage_view`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from strata.common.errors import SchemaError
from strata.common.schemas import (
    Architecture,
    ClusterDescription,
    ClusterLink,
    HardwareProfile,
    ModelCosts,
    ModelDescription,
    Plan,
    Request,
    StagePlan,
    UnitInfo,
)
from strata.common.yamlio import read_yaml

HEAD_UNITS = frozenset({"token_embd", "output"})
"""Units rank 0 holds whatever its blocks: the token embedding (also the head where tied) and the
output unit (final norm and head)."""

EVERY_STAGE_UNITS = frozenset({"globals"})
"""Units every stage holds: Llama 3's RoPE frequency factors, a few KiB, read by every block."""


def stage_of_unit(layer: int | None, name: str, stages: list[tuple[int, int]]) -> list[int]:
    """The stages (indices into ``stages``, each ``(first_block, end_block)``) that hold a unit
    of block ``layer`` (None: not a block unit) named ``name``.

    Raises:
        SchemaError: a block unit no stage covers, or a non-block unit that is neither a head
            unit nor an every-stage unit (named, with the fix).
    """
    if layer is None:
        if name in HEAD_UNITS:
            return [0]
        if name in EVERY_STAGE_UNITS:
            return list(range(len(stages)))
        raise SchemaError(
            f"unit {name} belongs to no block and no pipeline stage takes it; "
            "strata.common.cluster knows token_embd, output and globals"
        )
    for i, (first, end) in enumerate(stages):
        if first <= layer < end:
            return [i]
    raise SchemaError(f"block {layer} is in no stage of the cluster plan; re-run strata plan")


def _ranges(plan_or_stages: Plan | list[StagePlan]) -> list[tuple[int, int]]:
    stages = plan_or_stages.cluster.stages if isinstance(plan_or_stages, Plan) else plan_or_stages
    return [(s.first_block, s.end_block) for s in stages]  # type: ignore[union-attr]


def stage_units(units: Iterable[UnitInfo], ranges: list[tuple[int, int]], rank: int) -> list[str]:
    """Names of the units (in the given order) that stage ``rank`` of a pipeline cut at
    ``ranges`` holds (:func:`stage_of_unit`)."""
    return [u.name for u in units if rank in stage_of_unit(u.layer, u.name, ranges)]


def _kv_blocks(recurrent_layers: Iterable[int], first: int, end: int) -> tuple[int, int]:
    """(KV-cache blocks, recurrent blocks) among blocks ``first .. end - 1``."""
    recurrent = set(recurrent_layers)
    kv = sum(1 for i in range(first, end) if i not in recurrent)
    return kv, (end - first) - kv


def _shares(
    arch: Architecture, first: int, end: int
) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """Functions taking a whole-model figure to blocks ``first .. end - 1``'s share: one for a
    per-attention-block figure (KV elements), one for a per-recurrent-block one (state)."""
    kv_total, rec_total = _kv_blocks(arch.recurrent_layers, 0, arch.block_count)
    kv_here, rec_here = _kv_blocks(arch.recurrent_layers, first, end)
    return (
        lambda x: x * kv_here // kv_total if kv_total else 0,
        lambda x: x * rec_here // rec_total if rec_total else 0,
    )


def stage_description(
    desc: ModelDescription, ranges: list[tuple[int, int]], rank: int
) -> ModelDescription:
    """``desc`` restricted to stage ``rank``'s units and tensors, its KV-cache elements per token
    and recurrent state those of its own blocks only (every attention block stores the same per
    token, every recurrent block the same per sequence: ``common.describe``); sizes re-summed.
    The architecture is kept whole: the stage's blocks keep their indices."""
    keep = set(stage_units(desc.units, ranges, rank))
    kv_share, rec_share = _shares(desc.architecture, *ranges[rank])
    kv = kv_share(desc.kv_elements_per_token)
    rec = rec_share(desc.recurrent_state_elements_per_sequence)
    units = [u for u in desc.units if u.name in keep]
    tensors = [t for t in desc.tensors if t.unit in keep]
    return desc.model_copy(
        update={
            "units": units,
            "tensors": tensors,
            "kv_elements_per_token": kv,
            "kv_bytes_per_token": desc.kv_bytes_per_token * kv // desc.kv_elements_per_token
            if desc.kv_elements_per_token
            else 0,
            "recurrent_state_elements_per_sequence": rec,
            "bytes_gguf": sum(t.bytes_gguf for t in tensors),
            "bytes_mlx": sum(t.bytes_mlx for t in tensors),
        }
    )


def stage_costs(costs: ModelCosts, ranges: list[tuple[int, int]], rank: int) -> ModelCosts:
    """``costs`` restricted to stage ``rank``'s units (as :func:`stage_description`)."""
    keep = {u.name for u in costs.units if rank in stage_of_unit(u.layer, u.name, ranges)}
    kv_share, _ = _shares(costs.architecture, *ranges[rank])
    return costs.model_copy(
        update={
            "units": [u for u in costs.units if u.name in keep],
            "kv_elements_per_token": kv_share(costs.kv_elements_per_token),
        }
    )


def stage_view(plan: Plan, rank: int) -> Plan:
    """Stage ``rank`` of a cluster plan as a one-host plan of its own units: its host's machine,
    runtime, budgets, pool, prefetch, expert cache, memory and prediction, the placement of its
    units (no host key), the costs of its units; ``cluster`` None. A one-host plan is its own
    rank 0.

    Raises:
        SchemaError: ``rank`` is not a stage of the plan.
    """
    if plan.cluster is None:
        if rank != 0:
            raise SchemaError(f"rank {rank}: this plan is for one host (rank 0 only)")
        return plan
    stages = plan.cluster.stages
    if not 0 <= rank < len(stages):
        raise SchemaError(
            f"rank {rank}: the cluster plan has {len(stages)} stages (ranks 0..{len(stages) - 1})"
        )
    s = stages[rank]
    ranges = _ranges(plan)
    placement = [p.model_copy(update={"host": None}) for p in plan.placement if p.host == s.host]
    request = plan.request.model_copy(
        update={"gpu_budget_bytes": s.gpu_budget_bytes, "ram_budget_bytes": s.ram_budget_bytes}
    )
    return plan.model_copy(
        update={
            "machine": s.machine,
            "runtime": s.runtime,
            "request": request,
            "placement": placement,
            "pool": s.pool,
            "prefetch": s.prefetch,
            "expert_cache": s.expert_cache,
            "memory": s.memory,
            "prediction": s.prediction,
            "costs": stage_costs(plan.costs, ranges, rank),
            "cluster": None,
        }
    )


def check_cluster_placement(plan: Plan) -> None:
    """Every stage of a cluster plan holds a block and the last ends at the model's last, its
    links are the stage boundaries in order (the last back to rank 0), and every placed unit
    names a stage's host, the host its blocks say.

    Raises:
        SchemaError: an empty stage, blocks no stage covers, links that are not the boundaries,
            a unit without a host, on an unknown host or on another stage's host.
    """
    if plan.cluster is None:
        return
    ranges = _ranges(plan)
    names = [s.host for s in plan.cluster.stages]
    for s in plan.cluster.stages:
        if s.end_block <= s.first_block:
            raise SchemaError(
                f"stage {s.host} holds no block (first_block {s.first_block}, end_block "
                f"{s.end_block}); every host runs at least one: re-run strata plan --cluster"
            )
    blocks = plan.costs.architecture.block_count
    if ranges[-1][1] != blocks:
        raise SchemaError(
            f"the stages end at block {ranges[-1][1]} and the model has {blocks}; "
            "re-run strata plan --cluster"
        )
    n = len(names)
    want_links = [[names[j], names[(j + 1) % n]] for j in range(n if n > 1 else 0)]
    if [lk.hosts for lk in plan.cluster.links] != want_links:
        raise SchemaError(
            "the cluster plan's links are not its stage boundaries in order ("
            + (", ".join(f"{a} → {b}" for a, b in want_links) or "none on one host")
            + "); re-run strata plan --cluster"
        )
    layer_of = {u.name: u.layer for u in plan.costs.units}
    for p in plan.placement:
        if p.host is None or p.host not in names:
            raise SchemaError(
                f"placement of {p.unit}: host {p.host} is not a stage of the cluster plan "
                f"({', '.join(names)}); re-run strata plan --cluster"
            )
        want = stage_of_unit(layer_of.get(p.unit), p.unit, ranges)
        if names.index(p.host) not in want and p.unit not in EVERY_STAGE_UNITS:
            raise SchemaError(
                f"placement of {p.unit} is on {p.host}, but its block is in stage "
                f"{names[want[0]]}; re-run strata plan --cluster"
            )


def read_cluster(path: str | Path) -> tuple[ClusterDescription, dict[str, HardwareProfile]]:
    """Read a cluster description and each host's profile (paths relative to the file).

    Raises:
        SchemaError: a bad file, a host named twice, a profile that cannot be read (named), a
            link naming an unknown host, or two hosts with no link between adjacent stages.
    """
    p = Path(path)
    cluster = read_yaml(p, ClusterDescription)
    names = [h.name for h in cluster.hosts]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SchemaError(f"{p}: host {dup} is named twice; give each host its own name")
    profiles: dict[str, HardwareProfile] = {}
    for h in cluster.hosts:
        profile_path = Path(h.profile)
        if not profile_path.is_absolute():
            profile_path = p.parent / profile_path
        try:
            profiles[h.name] = read_yaml(profile_path, HardwareProfile)
        except SchemaError as e:
            raise SchemaError(f"{p}: host {h.name}'s profile: {e}") from None
    for link in cluster.links:
        for n in link.hosts:
            if n not in names:
                raise SchemaError(
                    f"{p}: a link names host {n}, which is not in hosts ({', '.join(names)})"
                )
    for a, b in zip(names, names[1:] + names[:1], strict=True):
        if len(names) > 1 and link_between(cluster, a, b) is None:
            raise SchemaError(
                f"{p}: no link between {a} and {b}, which the pipeline's activations cross "
                f"(add links: - hosts: [{a}, {b}] with bandwidth_bytes_s and latency_s; strata "
                "profile --link measures one)"
            )
    return cluster, profiles


def link_between(cluster: ClusterDescription, a: str, b: str) -> ClusterLink | None:
    """The link joining hosts ``a`` and ``b`` (either direction), or None."""
    for link in cluster.links:
        if set(link.hosts) == {a, b}:
            return link
    return None


def request_for_host(request: Request, cluster: ClusterDescription, host: str) -> Request:
    """``request`` with host ``host``'s budget overrides (the cluster file's, else the
    request's)."""
    h = next(x for x in cluster.hosts if x.name == host)
    return request.model_copy(
        update={
            "gpu_budget_bytes": h.gpu_budget_bytes
            if h.gpu_budget_bytes is not None
            else request.gpu_budget_bytes,
            "ram_budget_bytes": h.ram_budget_bytes
            if h.ram_budget_bytes is not None
            else request.ram_budget_bytes,
        }
    )
