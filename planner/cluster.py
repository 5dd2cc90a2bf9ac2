"""Planning over several hosts (``strata plan --cluster FILE``): which contiguous blocks each
host runs (the pipeline's stages), then each stage placed on its host's tiers by the one-host
ILP, merged into one plan with a ``cluster`` section.

The split. Hosts run stages in the cluster file's order (rank 0, the first host, also holds the
token embedding and the output head: ``strata.common.cluster``); every host runs at least one
block. Lock-step, a decode step is the sum of the stages' steps and the links' transfers
(``planner.pipeline``), and the transfers are the same for every split (every boundary is
crossed once whatever its place), so the best split is the one whose stages' steps sum lowest:
the one that leaves the least to copy or stream, given each host's budgets. Every candidate split
(``C(blocks - 1, hosts - 1)`` of them, at most ``MAX_SPLITS``) is scored cheaply
(:func:`estimate_stage`: a greedy placement, each stage's own ranges memoized), and the full ILP
solves the stages of the best one. Splits within ``SPLIT_TIE`` of the best sum count as equal;
among them the one with the smallest largest stage wins (what micro-batching would need), then
the earliest cuts: the choice is deterministic. Should a stage's ILP find no placement where the
estimate found one (the estimate leaves out the expert cache's slots), the next candidates are
tried (``FALLBACKS``); where no split fits, the error names the host and memory that are short on
the nearest split (the ILP's own shortfall) and the fix.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from strata.common.cluster import (
    EVERY_STAGE_UNITS,
    HEAD_UNITS,
    link_between,
    read_cluster,
    request_for_host,
    stage_description,
)
from strata.common.errors import PlanError
from strata.common.schemas import (
    Cluster,
    ClusterDescription,
    ClusterHostSpec,
    HardwareProfile,
    LinkPlan,
    ModelDescription,
    Plan,
    Provenance,
    Request,
    SolverResult,
    StagePlan,
)
from strata.common.yamlio import canonical_sha256
from strata.planner.costmodel import (
    PinnedPlacement,
    UnitCost,
    batch_limits,
    capacity_rows,
    expert_slot_bytes,
    host_overlaps,
    objective,
    score,
    step_compute_s,
    unit_costs,
)
from strata.planner.ilp import Solution, solve, solver_description
from strata.planner.pipeline import bytes_per_token, pipeline_prediction
from strata.planner.planning import prepare_description
from strata.planner.rescore import decisions_sha256, model_costs

from strata import __version__

MAX_SPLITS = 200_000
"""Most candidate splits the search scores (``C(blocks - 1, hosts - 1)``): two hosts of any
model, three of up to 600 blocks, four of up to 100 (DeepSeek-V3's 61 over four hosts: 34,220).
Listing a split is cheap; the cost is the distinct stage ranges estimated, about ``hosts x
blocks^2 / 2`` (about 3 ms each for DeepSeek-V3: four hosts plan in about 20 s)."""

SPLIT_TIE = 1e-3
"""Candidate splits whose estimated step sums are within this share of the best are equal."""

FALLBACKS = 3
"""Candidate splits the ILP tries after the best when a stage has no placement."""

BACKEND_HOSTS = {"jaccl": "metal", "nccl": "cuda"}
"""MLX's distributed backends that run on one kind of host only: JACCL is RDMA over Thunderbolt 5
between Macs, NCCL is NVIDIA's; ring (TCP) and MPI run anywhere."""


def check_backend(cluster: ClusterDescription, profiles: dict[str, HardwareProfile]) -> None:
    """Refuse a backend the hosts' MLX backends cannot run (``BACKEND_HOSTS``).

    Raises:
        PlanError: names the host, its backend and the fix.
    """
    need = BACKEND_HOSTS.get(cluster.backend)
    for h in cluster.hosts:
        have = profiles[h.name].backend
        if need is not None and have != need:
            raise PlanError(
                f"cluster {cluster.name}: MLX's {cluster.backend} backend joins {need} hosts, and "
                f"host {h.name}'s profile is for {have}; use backend: ring (TCP, any host) or mpi"
            )


@dataclass(frozen=True)
class _Host:
    """One host as the split search sees it."""

    spec: ClusterHostSpec
    profile: HardwareProfile
    request: Request
    costs: list[UnitCost]
    """``costmodel.unit_costs`` of the whole model on this host (``desc.units`` order)."""
    order: list[int]
    """Unit indices, the dearest to keep off the device per byte first."""


@dataclass(frozen=True)
class StageEstimate:
    """A stage's decode step under a greedy placement (seconds; None where it does not fit)
    and the bytes that found no room (0 where it fits)."""

    step_s: float | None
    short_bytes: int


def _host(desc: ModelDescription, spec, profile, request: Request) -> _Host:
    costs = unit_costs(desc, profile, request, batch_limits(request))

    def penalty(i: int) -> float:  # seconds per byte of keeping unit i off the device
        c = costs[i]
        off = [c.copy_s] if "ram" in request.tiers else []
        off += [c.read_s] if "nvme" in request.tiers else []
        return min(off) / max(1, c.bytes) if off else math.inf

    order = sorted(range(len(desc.units)), key=lambda i: (-penalty(i), i))
    return _Host(spec, profile, request, costs, order)


def _member(desc: ModelDescription) -> Callable[[int, int, int, int], bool]:
    """``member(i, rank, first, end)``: unit i is in stage ``rank`` of blocks ``first..end-1``
    (``strata.common.cluster.stage_of_unit``, without its per-call checks)."""
    layers = [u.layer for u in desc.units]
    head = {i for i, u in enumerate(desc.units) if u.layer is None and u.name in HEAD_UNITS}
    every = {i for i, u in enumerate(desc.units) if u.layer is None and u.name in EVERY_STAGE_UNITS}

    def member(i: int, rank: int, first: int, end: int) -> bool:
        layer = layers[i]
        if layer is None:
            return i in every or (rank == 0 and i in head)
        return first <= layer < end

    return member


def estimate_stage(
    desc: ModelDescription,
    host: _Host,
    ranges: list[tuple[int, int]],
    rank: int,
    member: Callable[[int, int, int, int], bool],
) -> StageEstimate:
    """Stage ``rank``'s decode step on ``host`` under a greedy placement: units in ``host.order``
    go to the device while they fit beside the KV cache and activations of the stage, then to
    RAM, then stream; a stage that streams is placed again with two slots of its largest
    streamed-size dense unit and the expert cache's working slots reserved. The step is the cost
    model's ``max(compute + copies, reads)`` (synchronous ``compute + copies`` where nothing
    streams). Cheap and a little pessimistic (no expert cache beyond its working slots), for
    ranking splits; the ILP places the chosen split."""
    first, end = ranges[rank]
    light = desc.model_copy(
        update={"units": [u for u in desc.units if u.layer is None], "tensors": []}
    )
    rows = capacity_rows(stage_description(light, ranges, rank), host.profile, host.request)
    gpu_cap, other_cap = rows[0].capacity, rows[1].capacity
    fixed = sum(b for _, b in rows[0].fixed)
    unified = host.profile.unified_memory
    tiers = host.request.tiers
    members = [i for i in host.order if member(i, rank, first, end)]
    costs = host.costs
    dense = max((costs[i].bytes for i in members if desc.units[i].expert is None), default=0)
    experts = expert_slot_bytes(desc) * desc.architecture.expert_used_count
    reserves = (0, 2 * dense + experts)
    for reserve in reserves:
        gpu_free = gpu_cap - fixed - reserve if "gpu" in tiers else 0
        other_free = other_cap - (fixed + reserve if unified else reserve)
        short = max(0, fixed + reserve - gpu_cap)
        if unified:
            short = max(short, fixed + reserve - other_cap)
        copy = disk = 0.0
        streamed = False
        for i in members:
            b = costs[i].bytes
            if "gpu" in tiers and b <= gpu_free and (not unified or b <= other_free):
                gpu_free -= b
                other_free -= b if unified else 0
            elif "ram" in tiers and b <= other_free:
                other_free -= b
                copy += costs[i].copy_s
            elif "nvme" in tiers:
                streamed = True
                disk += costs[i].read_s
                copy += 0.0 if unified else costs[i].copy_s
            else:
                short += b
        if not streamed or reserve == reserves[-1]:
            break
    if short:
        return StageEstimate(None, short)
    compute = step_compute_s([costs[i] for i in members], host_overlaps(desc, host.profile))
    return StageEstimate(max(compute + copy, disk) if streamed else compute + copy, 0)


@dataclass(frozen=True)
class Split:
    """A candidate split: the stages' block ranges and their estimates."""

    ranges: list[tuple[int, int]]
    estimates: list[StageEstimate]

    @property
    def fits(self) -> bool:
        return all(e.step_s is not None for e in self.estimates)

    @property
    def step_s(self) -> float:
        return sum(e.step_s or 0.0 for e in self.estimates)

    @property
    def largest_s(self) -> float:
        return max(e.step_s or 0.0 for e in self.estimates)


def candidate_splits(blocks: int, hosts: int) -> list[list[tuple[int, int]]]:
    """Every cut of ``blocks`` blocks into ``hosts`` contiguous non-empty ranges, earliest cuts
    first.

    Raises:
        PlanError: fewer blocks than hosts, or more than ``MAX_SPLITS`` candidates.
    """
    if blocks < hosts:
        raise PlanError(
            f"the model has {blocks} blocks and the cluster {hosts} hosts: every host runs at "
            "least one block; list fewer hosts in the cluster file"
        )
    n = math.comb(blocks - 1, hosts - 1)
    if n > MAX_SPLITS:
        raise PlanError(
            f"{hosts} hosts cut {blocks} blocks in {n:,} ways, more than the split search scores "
            f"({MAX_SPLITS:,}); list fewer hosts in the cluster file"
        )
    out = []
    for cuts in itertools.combinations(range(1, blocks), hosts - 1):
        edges = [0, *cuts, blocks]
        out.append(list(itertools.pairwise(edges)))
    return out


def rank_splits(desc: ModelDescription, hosts: list[_Host]) -> tuple[list[Split], list[Split]]:
    """(splits that fit, best first; splits that do not, nearest first) by :func:`estimate_stage`
    (module docstring: ties within ``SPLIT_TIE``, then the smallest largest stage, then the
    earliest cuts)."""
    member = _member(desc)
    memo: dict[tuple[int, int, int], StageEstimate] = {}

    def est(ranges: list[tuple[int, int]], rank: int) -> StageEstimate:
        key = (rank, *ranges[rank])
        if key not in memo:
            memo[key] = estimate_stage(desc, hosts[rank], ranges, rank, member)
        return memo[key]

    splits = [
        Split(r, [est(r, k) for k in range(len(r))])
        for r in candidate_splits(desc.architecture.block_count, len(hosts))
    ]
    fit = [s for s in splits if s.fits]
    near = sorted(
        (s for s in splits if not s.fits),
        key=lambda s: (
            max(e.short_bytes for e in s.estimates),
            sum(e.short_bytes for e in s.estimates),
        ),
    )
    if not fit:
        return [], near
    best = min(s.step_s for s in fit)
    bound = best * (1 + SPLIT_TIE)
    # One pass (a membership test in a list of splits is quadratic: tens of thousands tie).
    tied = sorted((s for s in fit if s.step_s <= bound), key=lambda s: s.largest_s)
    rest = sorted((s for s in fit if s.step_s > bound), key=lambda s: s.step_s)
    return tied + rest, near


def _span(ranges: list[tuple[int, int]], rank: int) -> str:
    first, end = ranges[rank]
    blocks = f"blocks {first}–{end - 1}" if end - first > 1 else f"block {first}"
    return blocks + (" with the embedding and head" if rank == 0 else "")


def _solve_split(
    desc: ModelDescription, hosts: list[_Host], ranges: list[tuple[int, int]], time_limit_s: float
) -> list[Solution]:
    """The ILP's solution of every stage of ``ranges``.

    Raises:
        PlanError: a stage does not fit its host or its solve failed (prefixed with the host
            and its blocks; ``short_host`` names the host).
    """
    out = []
    for rank, h in enumerate(hosts):
        sdesc = stage_description(desc, ranges, rank)
        try:
            sol = solve(sdesc, h.profile, h.request, time_limit_s=time_limit_s)
        except PlanError as e:
            err = PlanError(f"host {h.spec.name} ({_span(ranges, rank)}) {e}")
            err.short_host = h.spec.name  # type: ignore[attr-defined]
            err.short_bytes = getattr(e, "short_bytes", None)  # type: ignore[attr-defined]
            raise err from None
        print(
            f"stage {rank} on {h.spec.name} ({_span(ranges, rank)}): solved in "
            f"{sol.solve_time_s:.3f} s",
            file=sys.stderr,
        )
        out.append(sol)
    return out


def _no_fit(cluster: ClusterDescription, desc: ModelDescription, err: PlanError) -> PlanError:
    """The error of a cluster on which no split fits: the nearest split's short host (the ILP's
    shortfall, its one-host fix replaced by the cluster's)."""
    names = ", ".join(h.name for h in cluster.hosts)
    text = str(err).split("; lower --context/--concurrency")[0]
    return PlanError(
        f"cluster {cluster.name}: no split of the {desc.architecture.block_count} blocks over "
        f"{names} fits; on the nearest, {text}; raise that host's gpu_budget_bytes / "
        "ram_budget_bytes in the cluster file (or its memory), add a host, or lower "
        "--context/--concurrency"
    )


def build_cluster_plan(
    model: str | None,
    cluster_path: Path,
    request: Request,
    *,
    desc: ModelDescription | None = None,
    routing_profile: Path | None = None,
    time_limit_s: float = 30,
) -> Plan:
    """The plan of ``model`` (or the description ``desc``; a routing profile applied as
    ``planning.build_plan`` does) over the hosts of the cluster file ``cluster_path`` (module
    docstring): stage split, each stage's one-host plan,
    the links of every boundary (the last back to rank 0) and the pipeline's prediction
    (``planner.pipeline``). Top-level machine, runtime, pool, prefetch, expert cache and memory
    are stage 0's; the placement lists every unit with its host.

    Raises:
        SchemaError: a bad cluster file or host profile (``common.cluster.read_cluster``).
        StrataError: a bad model or routing profile (``planning.prepare_description``).
        PlanError: a backend the hosts cannot run (``check_backend``); fewer blocks than hosts; no
            split fits (names the short host, memory and fix); a stage's solve failed.
    """
    cluster, profiles = read_cluster(cluster_path)  # a bad file fails before the model is read
    check_backend(cluster, profiles)
    desc, routing = prepare_description(model, request, desc=desc, routing_profile=routing_profile)
    provenance = Provenance(routing_profile=routing)
    hosts = [
        _host(desc, h, profiles[h.name], request_for_host(request, cluster, h.name))
        for h in cluster.hosts
    ]
    fit, near = rank_splits(desc, hosts)
    sols = None
    first_error: PlanError | None = None
    for split in fit[: 1 + FALLBACKS]:
        try:
            sols = _solve_split(desc, hosts, split.ranges, time_limit_s)
            ranges = split.ranges
            break
        except PlanError as e:
            if getattr(e, "short_host", None) is None or getattr(e, "short_bytes", None) is None:
                raise
            first_error = first_error or e
    if sols is None:
        if not near and first_error is not None:
            raise _no_fit(cluster, desc, first_error)
        # The estimate may be pessimistic: the nearest split's ILP decides, or names the shortfall.
        try:
            ranges = (near or fit)[0].ranges
            sols = _solve_split(desc, hosts, ranges, time_limit_s)
        except PlanError as e:
            if getattr(e, "short_bytes", None) is None:
                raise
            raise _no_fit(cluster, desc, first_error or e) from None
    return _merge(
        desc, cluster, hosts, ranges, sols, request, cluster_path, provenance, time_limit_s
    )


def _merge(
    desc: ModelDescription,
    cluster: ClusterDescription,
    hosts: list[_Host],
    ranges: list[tuple[int, int]],
    sols: list[Solution],
    request: Request,
    cluster_path: Path,
    provenance: Provenance | None,
    time_limit_s: float,
) -> Plan:
    """One plan of the stages' solutions (``build_cluster_plan``)."""
    stages = [
        StagePlan(
            host=h.spec.name,
            address=h.spec.address,
            first_block=first,
            end_block=end,
            machine=h.profile,
            runtime=sol.runtime,
            gpu_budget_bytes=h.request.gpu_budget_bytes,
            ram_budget_bytes=h.request.ram_budget_bytes,
            pool=sol.pool,
            prefetch=sol.prefetch,
            expert_cache=sol.expert_cache,
            memory=sol.memory,  # type: ignore[arg-type]
            prediction=sol.prediction,
        )
        for h, (first, end), sol in zip(hosts, ranges, sols, strict=True)
    ]
    costs = model_costs(desc)
    links = []
    n = len(stages)
    for j in range(n if n > 1 else 0):
        a, b = stages[j], stages[(j + 1) % n]
        link = link_between(cluster, a.host, b.host)
        assert link is not None  # read_cluster requires every boundary's link
        links.append(
            LinkPlan(
                hosts=[a.host, b.host],
                bandwidth_bytes_s=link.bandwidth_bytes_s,
                latency_s=link.latency_s,
                bytes_per_token=bytes_per_token(costs, a),
                predicted_s=0.0,
            )
        )
    batch = sols[0].batch
    priced = [  # each stage as its ILP scored it, to price it at other batches
        (
            stage_description(desc, ranges, rank),
            h,
            PinnedPlacement(
                {p.unit: p.tier for p in sol.placement},
                sol.prefetch.depth,
                sol.pool,
                sol.batch,
                sol.expert_cache,
            ),
        )
        for rank, (h, sol) in enumerate(zip(hosts, sols, strict=True))
    ]

    def step_at(rows: int) -> list[float]:  # micro-batched decode (planner.pipeline)
        return [
            score(d, h.profile, h.request.model_copy(update={"concurrency": rows}), pin).step_s
            for d, h, pin in priced
        ]

    prediction, cpred, links = pipeline_prediction(stages, links, request, batch, step_at)
    placement = [
        p.model_copy(update={"host": h.spec.name})
        for h, sol in zip(hosts, sols, strict=True)
        for p in sol.placement
    ]
    s0 = stages[0]
    prov = (provenance or Provenance()).model_copy(
        update={
            "planner_version": __version__,
            "solver": solver_description(time_limit_s),
            "profile_file": Path(cluster_path).name,
            "request_sha256": canonical_sha256(request),
        }
    )
    plan = Plan(
        model=desc.model,
        machine=s0.machine,
        request=request,
        runtime=s0.runtime,
        placement=placement,
        pool=s0.pool,
        prefetch=s0.prefetch,
        expert_cache=s0.expert_cache,
        batch=batch,
        memory=s0.memory,
        prediction=prediction,
        solver=SolverResult(
            name=sols[0].solver.name,
            status="Optimal",
            objective=objective(prediction, request, batch),
            gap=max(s.solver.gap for s in sols),
        ),
        costs=costs,
        provenance=prov,
        cluster=Cluster(
            name=cluster.name,
            backend=cluster.backend,
            stages=stages,
            links=links,
            prediction=cpred,
        ),
    )
    plan.provenance.decisions_sha256 = decisions_sha256(plan)
    return plan
