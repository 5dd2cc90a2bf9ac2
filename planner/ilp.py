"""The placement ILP: tiers, pool, prefetch depth, decode step and prefill chunk times decided
together, solved by CBC.

The cost model and its formulas are in ``planner.costmodel``; this module turns them into a mixed
integer linear program (PuLP, the CBC bundled with PuLP on one thread, fixed seeds, node limits)
and turns the solver's answer back into plan parts. Variables and rows (``b`` in MiB, times in
units of ``tau = compute_s / 1000`` so that both stay well scaled for the solver's tolerances):

- ``n[c,t]`` integer in [0, N_c]: how many units of class c are stored on tier t. A class is a set
  of units the cost model cannot tell apart (same bytes, access and FLOPs: the 80 FFNs of a dense
  model); ``n[c,t]`` is the per-unit binary ``x[u,t]`` summed over the class, and a class of one
  unit is exactly ``x[u,t]``. Without this aggregation CBC branches through the permutations of
  identical layers and a 70B model takes over 30 s; with it, a tenth of a second.
  Row ``one_tier_c``: ``sum_t n[c,t] = N_c`` (each unit on exactly one tier). Within a class units
  fill gpu, then ram, then nvme in description order (``_decisions``).
- ``y[k]`` binary, k = 0..MAX_DEPTH: prefetch depth is k (one-hot). Row ``one_depth``:
  ``sum_k y[k] = 1``; depth ``d = sum_k k * y[k]``.
- ``q[i]`` binary: the pool slot holds at least ``S_i``, the i-th largest unit size ("slot level").
  Rows ``staircase_i``: ``q_i <= q_{i+1}``; ``slot_def``: ``s = sum_i (S_i - S_{i+1}) q_i`` (the
  slot ``s`` >= 0 is the largest level chosen); ``stream_allowed_c``:
  ``n[c,nvme] <= N_c * q[level(c)]`` (a streamed unit needs a slot that holds it). This is
  ``slot_bytes >= b_u * x[u,nvme]`` written so that branching on one q settles the slot.
  ``z = q_m`` (smallest level): anything streams (io_threads = the profile's disk-test queue
  depth then, else 0). Rows ``stream_le``:
  ``z <= sum_c n[c,nvme]``; ``depth_needs_stream``: ``sum_{k>=1} y[k] <= z``. With more than
  SLOT_LEVELS distinct sizes the levels are the sizes rounded up to 1/256 of the largest
  (``_slot_levels``): the ILP then over-reserves the pool by under 0.4% of a slot.
- ``P`` >= 0: pool bytes ``= (d + 1) * s``, linearized per depth choice with big-M: rows
  ``pool_one``: ``P >= s``; ``pool_k`` (k >= 1): ``P >= (k + 1) s - k max_c b_c (1 - y[k])``;
  and the valid inequality ``pool_two``: ``P >= 2 s - max_c b_c y[0]``.
- capacity rows (``costmodel.capacity_rows``), e.g. ``cap_gpu``:
  ``sum_c b_c * n[c,gpu] + KV + activations + P <= gpu capacity``.
- ``T`` >= 0: step time. Rows ``T_compute``: ``T >= C``, with
  ``C = compute + sum_c sum_t host_copy_c(t) * n[c,t]`` (``compute``: the placement-independent
  ``costmodel.step_compute_s``, the units' compute summed, or for a dense model on CUDA the
  larger of their device and host sums); ``T_disk``: ``T >= D``, with
  ``D = sum_c read_c * n[c,nvme]``; ``T_serial``: ``T >= C + D - M_T * (1 - y[0])`` with
  ``M_T = min(largest C, largest D)`` (>= min(C, D) everywhere): depth 0 makes the reads
  synchronous (``T >= C + D``), depth >= 1 relaxes the row and leaves ``T = max(C, D)``.
- The depth-1 I/O stall (``costmodel.io_stall``), per block type k (blocks whose attention units
  share a class and whose FFN units share a class; one type for a uniform model): integers
  ``a_k``, ``f_k`` (streamed attention / FFN units of those blocks) with rows ``split_attn_c``,
  ``split_ffn_c`` (they add up to ``n[c,nvme]``), ``m_k >= a_k + f_k - L_k`` (``interleave_k``:
  blocks that stream both), and ``T_stall``: ``T >= C + sum_k sigma_k m_k - M (1 - y[1])``.
  ``_decisions`` realises exactly ``m_k`` such blocks by streaming attention where the FFN stays.
- Prefill (``_prefill_rows``, ``costmodel.prefill_chunk``): per distinct chunk length r (the
  full chunk, and the last chunk of the shortest and of the longest prompt) a variable ``X_r`` >= 0
  with rows mirroring ``T``'s: ``X_compute_r`` (compute + copies + expert misses),
  ``X_disk_r``, ``X_serial_r`` (depth 0, the same big-M form); no I/O-stall row (the cost model
  leaves it out of prefill). ``TTFT(P) = F_P X_c + X_{l_P}``: linear, since the chunk counts are
  constants of the request.
- Objective ``O = (B * (TTFT(shortest) + TTFT(longest)) / 2 + (N - 1) T) / (B N)``
  (``costmodel.objective``: seconds per generated token of whole requests of N =
  ``request.output_tokens`` tokens). Every time variable has a positive weight when N > 1, so
  each equals its largest row at the optimum; at N = 1, ``T`` has weight 0 and the prediction's
  step is the cost model's, not T's.

Solving. Stage 1 minimizes ``O`` in two branches on ``y[0]``
(prefetch, then depth 0 with a cutoff at the prefetch branch's objective; ties go to depth 0): CBC
rarely branches on ``y[0]`` itself, and with it fixed the T_serial and pool big-Ms vanish from
the relaxation. Each branch climbs ``RUNGS``: an exact search of 500 nodes (small and uniform
models end here), then one stopping at a proven 0.1% within 10,000 nodes. A node-limited search
is accepted when proven within ``ACCEPT_GAP`` (1%); ``SolverResult.gap`` is the gap proven over
both branches. Stage 2, with ``O <= O*`` added, minimizes a deterministic tie-break: bytes off
the gpu tier (nvme counted twice) plus pool bytes, so equal-cost placements resolve the same way
every time; two stages keep the tie-break from ever trading away the objective, which a single
``O + eps * tiebreak`` objective can do within the solver's tolerances. Node limits, not the clock,
end every search, so a plan does not depend on the machine that made it; the time limit only
turns a search that runs too long into an error.

Batch limits are fixed choices for now (``costmodel.batch_limits``), not variables; the expert cache
is not modelled (empty).

An infeasible request is re-solved as a phase-1 model with a slack variable per capacity row,
minimizing the total slack; the error then names each short row, its shortfall in bytes and what
fills it.
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pulp
from strata.common.children import tied_to_parent
from strata.common.errors import PlanError
from strata.common.schemas import (
    TIERS,
    BatchLimits,
    ExpertCache,
    HardwareProfile,
    ModelDescription,
    Placement,
    Plan,
    Pool,
    Prediction,
    Prefetch,
    Provenance,
    Request,
    Runtime,
    SolverResult,
    TierMemory,
)
from strata.common.sizes import format_size
from strata.planner.costmodel import (
    MAX_DEPTH,
    CapacityRow,
    PinnedPlacement,
    UnitCost,
    batch_limits,
    batch_size,
    capacity_rows,
    capacity_use,
    expert_cache_for,
    expert_slot_bytes,
    host_overlaps,
    objective,
    pool_for,
    prediction_recall,
    prefill_chunks,
    prefill_costs,
    runtime_for,
    score,
    step_compute_s,
    tier_memory,
    unit_costs,
    weights_by_tier,
    working_slots,
)
from strata.planner.rescore import decisions_sha256, model_costs

MIB = 2**20
TIME_UNITS = 1000.0
"""The placement-independent compute time maps to this many solver time units."""

SEED = 20240601
CBC_OPTIONS = [
    f"randomSeed {SEED}",
    f"randomCbcSeed {SEED}",
    "allowableGap 1e-7",
    "increment 1e-7",
]
"""Fixed CBC options: seeds for determinism; an absolute gap and cutoff increment small enough that
an exact rung is exact to ~1e-10 relative, given T >= TIME_UNITS."""

RUNGS: tuple[tuple[float, int], ...] = ((0.0, 500), (1e-3, 10_000))
"""(relative gap, node limit) of the step-time solves, tried in turn: an exact search first, which
settles small and uniform models; then a search that stops at a proven 0.1%. Placements of many
units of distinct sizes are subset-sum problems whose last fraction of a percent CBC proves
slowly; node limits (unlike a time limit) stop the search at the same point on every machine."""

ACCEPT_GAP = 1e-2
"""A search stopped by its node limit is accepted when its incumbent is proven within this
relative gap of the optimum; ``SolverResult.gap`` reports the gap reached."""

TIEBREAK_RUNG = (1e-3, 2_000)
"""(relative gap, node limit) of the tie-break stage, which never changes the objective."""


@dataclass
class Solution:
    """The ILP's decisions and the cost model's prediction for them.

    ``solve_time_s`` (wall seconds of all solver calls) is not part of plans and not compared.
    """

    placement: list[Placement]
    pool: Pool
    prefetch: Prefetch
    expert_cache: ExpertCache
    batch: BatchLimits
    memory: dict[str, TierMemory]
    prediction: Prediction
    solver: SolverResult
    runtime: Runtime
    solve_time_s: float = field(compare=False)

    def to_plan(
        self,
        desc: ModelDescription,
        profile: HardwareProfile,
        request: Request,
        provenance: Provenance | None = None,
    ) -> Plan:
        """The plan document for this solution: self-contained (the model's identity and costs,
        the machine figures), its decisions' digest in ``provenance``."""
        plan = Plan(
            model=desc.model,
            machine=profile,
            request=request,
            runtime=self.runtime,
            placement=self.placement,
            pool=self.pool,
            prefetch=self.prefetch,
            expert_cache=self.expert_cache,
            batch=self.batch,
            memory=self.memory,  # type: ignore[arg-type]
            prediction=self.prediction,
            solver=self.solver,
            costs=model_costs(desc),
            provenance=provenance or Provenance(),
        )
        plan.provenance.decisions_sha256 = decisions_sha256(plan)
        return plan


def _cbc_path() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD().path


@functools.cache
def cbc_version() -> str:
    """The bundled CBC's version string (e.g. ``2.10.3``), or ``unknown``."""
    try:
        out = subprocess.run(
            [_cbc_path(), "-quit"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.strip().startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


class _TiedCBC(pulp.PULP_CBC_CMD):
    """PuLP's bundled CBC, run as a child that dies with the planner.

    PuLP's ``solve_CBC`` starts CBC with a bare ``subprocess.Popen``: a planner killed outright
    (SIGKILL, the OOM killer, a caller's timeout) left CBC searching, a CPU busy until its time
    limit with nobody to read the answer. This runs the command line PuLP builds on its MPS path
    (:meth:`command`) under :func:`strata.common.children.tied_to_parent` (SIGKILL when the
    planner dies, Linux) and reads the solution with PuLP's own reader, so a solve is otherwise
    PuLP's. Only what ``_cbc`` passes is supported: LP files, ``presolve`` and ``cuts`` are not.
    """

    def command(self, lp: pulp.LpProblem, mps: str, sol: str, mst: str | None) -> list[str]:
        """CBC's arguments, as PuLP's ``COIN_CMD.solve_CBC`` builds them from the model file
        ``mps``, the warm start ``mst`` (None: none), the time limit and the options."""
        args = [self.path, mps]
        if lp.sense == pulp.LpMaximize:
            args.append("-max")
        if mst is not None:
            args += ["-mips", mst]
        if self.timeLimit is not None:
            args += ["-sec", str(self.timeLimit)]
        for option in self.options + self.getOptions():
            args += f"-{option}".split()
        args += ["-solve" if self.mip else "-initialSolve", "-printingOptions", "all"]
        return [*args, "-solution", sol]

    def solve_CBC(self, lp: pulp.LpProblem, use_mps: bool = True) -> int:
        """Solve ``lp`` with CBC and assign its values and status to ``lp`` (PuLP's contract).

        Raises:
            PlanError: CBC exited with an error or wrote no solution (its log's last line).
        """
        if (
            not use_mps
            or self.optionsDict.get("presolve") is not None
            or self.optionsDict.get("cuts") is not None
        ):
            raise PlanError("the planner's CBC runner takes MPS files without presolve or cuts")
        mps, sol, mst = self.create_tmp_files(lp.name, "mps", "sol", "mst")
        try:
            vs, variables, constraints, _ = lp.writeMPS(mps, rename=1)
            warm = bool(self.optionsDict.get("warmStart", False))
            if warm:
                self.writesol(mst, lp, vs, variables, constraints)
            log_path = self.optionsDict.get("logPath") or os.devnull
            with open(log_path, "w") as log:
                try:
                    done = subprocess.run(
                        self.command(lp, mps, sol, mst if warm else None),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        preexec_fn=tied_to_parent(signal.SIGKILL),
                        check=False,
                    )
                except OSError as e:  # missing, or not executable
                    raise PlanError(
                        f"CBC ({self.path}) could not be started: {e.strerror or e}; reinstall "
                        "PuLP (bash scripts/setup.sh)"
                    ) from None
            if done.returncode != 0 or not os.path.exists(sol):
                tail = ""
                if log_path != os.devnull:
                    lines = Path(log_path).read_text(errors="replace").strip().splitlines()
                    tail = f": {lines[-1].strip()}" if lines else ""
                raise PlanError(
                    f"CBC ({self.path}) exited with status {done.returncode} and no solution"
                    f"{tail}; re-run, or reinstall PuLP (bash scripts/setup.sh)"
                )
            status, values, reduced, prices, slacks, sol_status = self.readsol_MPS(
                sol, lp, vs, variables, constraints
            )
        finally:
            self.delete_tmp_files(mps, sol, mst)
        lp.assignVarsVals(values)
        lp.assignVarsDj(reduced)
        lp.assignConsPi(prices)
        lp.assignConsSlack(slacks, activity=True)
        lp.assignStatus(status, sol_status)
        return status


def solver_description(time_limit_s: float = 30) -> str:
    """Solver name, version and options, for ``Provenance.solver``."""
    return (
        f"CBC {cbc_version()} (PuLP {pulp.__version__}), one thread, {' '.join(CBC_OPTIONS)}, "
        f"rungs (ratioGap, maxNodes) {list(RUNGS)}, accept gap {ACCEPT_GAP:g}, "
        f"tie-break {TIEBREAK_RUNG}, timeLimit {time_limit_s:g}s"
    )


# --------------------------------------------------------------------------- model building


@dataclass(frozen=True)
class _Class:
    """Units the cost model cannot tell apart: same bytes, access, FLOPs and role (desc indices)."""

    members: tuple[int, ...]
    bytes: int


def _classes(desc: ModelDescription) -> list[_Class]:
    groups: dict[tuple[int, float, int, str], list[int]] = {}
    for i, u in enumerate(desc.units):
        key = (u.bytes_mlx, u.access_per_token, u.flops_per_token, u.role)
        groups.setdefault(key, []).append(i)
    return [_Class(tuple(m), desc.units[m[0]].bytes_mlx) for m in groups.values()]


SLOT_LEVELS = 32
"""Most distinct slot sizes the ILP distinguishes exactly (see ``_slot_levels``)."""


def _slot_levels(b: list[float]) -> list[float]:
    """The slot level (MiB) each class needs when it streams: its own size when the model has at
    most SLOT_LEVELS distinct sizes; otherwise its size rounded up to 1/256 of the largest.

    Many nearly equal sizes (a per-layer mix of quant types) give many slot levels that each
    change the pool by a few MiB; CBC then cannot raise its bound by branching on them. Rounding
    up only over-reserves the pool (by under 0.4% of the largest unit per slot): every placement
    the ILP accepts fits, and the plan's pool is computed exactly from the placement.
    """
    if len(set(b)) <= SLOT_LEVELS:
        return list(b)
    grid = max(b) / 256
    return [math.ceil(v / grid - 1e-9) * grid for v in b]


@dataclass
class _Model:
    prob: pulp.LpProblem
    classes: list[_Class]
    n: list[dict[str, pulp.LpVariable]]
    y: list[pulp.LpVariable]
    T: pulp.LpVariable
    cache_slots: pulp.LpVariable | None
    """Expert-cache slots K (None for a dense model or without nvme)."""
    prefetch: int
    """Experts prefetched per block in this model (fixed per solve)."""
    tau: float
    """Seconds per solver time unit."""
    tiebreak: pulp.LpAffineExpression
    objective: pulp.LpAffineExpression
    """Seconds per generated token of whole requests (``costmodel.objective``), time units."""
    stall: _Stall | None
    """The interleave variables, when the model has attention/FFN block pairs."""


def _build(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    rows: list[CapacityRow],
    *,
    phase1: bool,
    prefetch: int = 0,
) -> _Model:
    costs = unit_costs(desc, profile, request)
    classes = _classes(desc)
    # Per class: bytes (MiB) and the unit's cost coefficients (identical for all members).
    b = [c.bytes / MIB for c in classes]
    cc = [costs[c.members[0]] for c in classes]
    size = [len(c.members) for c in classes]
    expert = [desc.units[c.members[0]].expert is not None for c in classes]
    compute_total = step_compute_s(costs, host_overlaps(desc, profile))
    tau = compute_total / TIME_UNITS if compute_total > 0 else 1e-3
    unified = profile.unified_memory
    J = range(len(classes))
    JD = [j for j in J if not expert[j]]  # dense classes: streamed through the pool
    JE = [j for j in J if expert[j]]  # expert classes: streamed through the expert cache
    bmax = max((b[j] for j in JD), default=0.0)

    prob = pulp.LpProblem("strata_phase1" if phase1 else "strata_placement", pulp.LpMinimize)
    n = [
        {
            # A tier the request excludes (--tiers) gets no units.
            t: prob.add_variable(
                f"n_{j}_{t}",
                lowBound=0,
                upBound=size[j] if t in request.tiers else 0,
                cat="Integer",
            )
            for t in TIERS
        }
        for j in J
    ]
    # Slot levels: the distinct dense unit sizes, largest first (S_1 > ... > S_m, S_{m+1} = 0).
    level = dict(zip(JD, _slot_levels([b[j] for j in JD]), strict=True))
    sizes = sorted(set(level.values()), reverse=True)
    rank = {v: i for i, v in enumerate(sizes)}
    q = [prob.add_variable(f"q_{i}", cat="Binary") for i in range(len(sizes))]
    y = [prob.add_variable(f"y_{k}", cat="Binary") for k in range(MAX_DEPTH + 1)]
    s = prob.add_variable("slot_mib", lowBound=0)
    P = prob.add_variable("pool_mib", lowBound=0)
    T = prob.add_variable("T", lowBound=0)

    for j in J:
        # one_tier_c: sum_t n[c,t] = N_c  (each unit of the class on exactly one tier)
        prob += pulp.lpSum(n[j].values()) == size[j], f"one_tier_{j}"
    for j in JD:
        # stream_allowed_c: n[c,nvme] <= N_c * q[i(c)]  (a streamed unit needs a slot >= b_c)
        prob += n[j]["nvme"] <= size[j] * q[rank[level[j]]], f"stream_allowed_{j}"
    # staircase_i: q_i <= q_{i+1}  (a slot >= S_i is also >= every smaller S)
    for i in range(len(sizes) - 1):
        prob += q[i] <= q[i + 1], f"staircase_{i}"
    # slot_def: s = sum_i (S_i - S_{i+1}) q_i  (the slot is the largest S_i with q_i = 1)
    steps = [sizes[i] - (sizes[i + 1] if i + 1 < len(sizes) else 0.0) for i in range(len(sizes))]
    prob += s == pulp.lpSum(d * qi for d, qi in zip(steps, q, strict=True)), "slot_def"
    # z = q_m: anything streams. stream_le: z <= sum_c n[c,nvme]  (no pool when
    # nothing streams)
    z = q[-1] if q else 0
    prob += z <= pulp.lpSum(n[j]["nvme"] for j in JD), "stream_le"
    # one_depth: sum_k y[k] = 1
    prob += pulp.lpSum(y) == 1, "one_depth"
    # depth_needs_stream: sum_{k>=1} y[k] <= z  (no prefetch depth without streaming)
    prob += pulp.lpSum(y[1:]) <= z, "depth_needs_stream"
    # pool_one: P >= s  (a streaming plan has at least one slot; s = 0 otherwise)
    prob += P >= s, "pool_one"
    # pool_k: P >= (k+1) * s - k * max_c b_c * (1 - y[k])  (depth k: k+1 slots). M = k * max b is
    # the least valid big-M given pool_one, since (k+1) s - k max b <= s.
    for k in range(1, MAX_DEPTH + 1):
        prob += P >= (k + 1) * s - k * bmax * (1 - y[k]), f"pool_{k}"
    # pool_two: P >= 2 s - max_c b_c * y[0]  (any depth >= 1 means two slots or more; a valid
    # inequality that is tighter than the pool_k rows when y is fractional)
    prob += P >= 2 * s - bmax * y[0], "pool_two"

    ex = _expert_rows(prob, desc, cc, b, size, JE, n, tau, unified, prefetch)
    # cap_r: sum_{c, t in row} b_c n[c,t] + fixed + [P + K slot_e] <= capacity  [+ slack_r in
    # phase 1]
    slacks = []
    for r_i, r in enumerate(rows):
        lhs = pulp.lpSum(b[j] * n[j][t] for j in J for t in r.weight_tiers)
        lhs += sum(v for _, v in r.fixed) / MIB
        if r.counts_pool:
            lhs += P + ex.cache_mib
        rhs: pulp.LpAffineExpression | float = r.capacity / MIB
        if phase1:
            slacks.append(prob.add_variable(f"slack_{r_i}", lowBound=0))
            rhs = rhs + slacks[-1]
        prob += lhs <= rhs, f"cap_{r_i}"

    # C = sum_u compute_u + sum_{c,t} host_copy_c(t) n[c,t] + (1 - alpha) M + expert copies
    # (compute thread, time units; streamed experts' copies are per read, in ex.copy)
    C = (
        compute_total / tau
        + pulp.lpSum(
            cc[j].host_copy_s(t, unified) / tau * n[j][t]
            for j in J
            for t in TIERS
            if cc[j].host_copy_s(t, unified) > 0 and not (expert[j] and t == "nvme")
        )
        + ex.sync
        + ex.copy
    )
    # D = sum_{dense c} read_c n[c,nvme]   (I/O threads: the pool), and the experts' reads
    D = pulp.lpSum(cc[j].read_s / tau * n[j]["nvme"] for j in JD)
    # M_T >= min(C, D) at every point: the least of the largest C (every unit's host copy and
    # every expert missed) and the largest dense D (every dense unit streamed). A small M keeps
    # the LP relaxation tight.
    c_max = (
        compute_total / tau
        + sum(max(c.host_copy_s(t, unified) for t in TIERS) / tau for c in costs)
        + ex.sync_max
    )
    big_t = min(c_max, sum(cc[j].read_s * size[j] for j in JD) / tau)
    prob += T >= C, "T_compute"  # T >= compute + host copy + synchronous expert misses
    prob += T >= D + ex.disk, "T_disk"  # T >= disk (dense + experts with prefetches)
    # depth 0: T >= compute + host copy + expert misses + dense disk
    prob += T >= C + D - big_t * (1 - y[0]), "T_serial"
    stall = _stall_rows(prob, desc, costs, classes, n, y, T, C, tau)
    ttft = _prefill_rows(prob, desc, profile, request, classes, n, y, ex, tau)
    # objective = (B * TTFT + (N - 1) * T) / (B * N), TTFT the mean over the prompt range's ends
    bsz, n_out = batch_size(request), request.output_tokens
    obj = (bsz * ttft + (n_out - 1) * T) / (bsz * n_out)

    # Tie-break (MiB): bytes off the gpu tier (nvme counted twice, cached experts not at all)
    # plus pool bytes, plus ex.tiebreak (pinning against caching, see _expert_rows).
    tiebreak = pulp.lpSum(b[j] * (n[j]["ram"] + 2 * n[j]["nvme"]) for j in JD) + P
    tiebreak += ex.tiebreak
    prob.setObjective(pulp.lpSum(slacks) if phase1 else obj)
    return _Model(
        prob=prob,
        classes=classes,
        n=n,
        y=y,
        T=T,
        cache_slots=ex.slots,
        prefetch=prefetch,
        tau=tau,
        tiebreak=tiebreak,
        objective=obj,
        stall=stall,
    )


@dataclass
class _ExpertRows:
    """The expert cache's variables and the expressions the other rows use (time units, MiB)."""

    slots: pulp.LpVariable | None
    cache_mib: pulp.LpAffineExpression | float
    sync: pulp.LpAffineExpression | float
    disk: pulp.LpAffineExpression | float
    copy: pulp.LpAffineExpression | float
    sync_max: float
    tiebreak: pulp.LpAffineExpression | float
    held: dict[int, pulp.LpVariable] = field(default_factory=dict)
    """``h_c``: streamed experts of class c the cache holds."""


def _expert_rows(
    prob: pulp.LpProblem,
    desc: ModelDescription,
    cc: list[UnitCost],
    b: list[float],
    size: list[int],
    JE: list[int],
    n: list[dict[str, pulp.LpVariable]],
    tau: float,
    unified: bool,
    prefetch: int,
) -> _ExpertRows:
    """Rows of the expert cache (``costmodel.expert_streaming``), for expert classes ``JE``.

    Variables: ``K`` integer, the cache slots; ``h_c`` integer in [0, n[c,nvme]], streamed
    experts of class c the cache holds; ``e`` binary, any expert streams. Rows:
    ``experts_stream``: ``sum_c n[c,nvme] <= N_e e``; ``cache_min``: ``K >= (k + m) e`` (the
    working slots); ``cache_max``: ``K <= sum_c n[c,nvme] + (k + m) e``; ``cache_holds``:
    ``sum_c h_c <= K - (k + m) e``; ``held_c``: ``h_c <= n[c,nvme]``. Expressions:
    ``M = sum_c read_c (n[c,nvme] - h_c)`` (misses), ``sync = (1 - alpha) M``, ``disk = (1 -
    alpha + m / k) M``, ``copy`` likewise for host copies when memory is not unified, and the
    cache's bytes ``K slot_e``. The solver puts the most-read classes in the cache, as the cost
    model's static count does.

    Tie-break: pinning an expert and caching it cost the same in the model. When nothing needs
    to stream, nothing does (``e`` costs more than any placement's bytes). Otherwise the cache
    is preferred (pinned experts count their bytes): without a routing profile nothing says
    which experts are hot and the cache learns them from the routing counts; with one, the
    plan's ``preload`` puts the measured hot set in the cache at start and the executor seeds
    its counts from the profile, so the cache starts where pinning would and still follows the
    text, and its prefetch area serves the experts outside the hot set. (Pinning the profile's
    hot set instead was measured slower on the skewed bench model, dev CPU: 0.785 against 0.723
    s/token, its prefetches finding fewer experts to read.) Memory still decides where it
    binds: on machines whose memory is not unified a cache slot costs host staging bytes too.
    """
    none = _ExpertRows(None, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if not JE:
        return none
    tiebreak: pulp.LpAffineExpression | float = pulp.lpSum(b[j] * n[j]["ram"] for j in JE)
    tiebreak += pulp.lpSum(b[j] * n[j]["gpu"] for j in JE)
    if all(n[j]["nvme"].upBound == 0 for j in JE):
        return _ExpertRows(None, 0.0, 0.0, 0.0, 0.0, 0.0, tiebreak)
    k = max(1, desc.architecture.expert_used_count)
    work = working_slots(desc, prefetch)
    slot = expert_slot_bytes(desc) / MIB
    total = sum(size[j] for j in JE)
    alpha = prediction_recall(desc, prefetch)
    reads = 1.0 - alpha + prefetch / k
    K = prob.add_variable("expert_cache_slots", 0, total + work, cat="Integer")
    e = prob.add_variable("experts_stream", cat="Binary")
    h = {j: prob.add_variable(f"cached_{j}", 0, size[j], cat="Integer") for j in JE}
    streamed = pulp.lpSum(n[j]["nvme"] for j in JE)
    prob += streamed <= total * e, "experts_stream"
    prob += K >= work * e, "cache_min"
    prob += K <= streamed + work * e, "cache_max"
    prob += pulp.lpSum(h.values()) <= K - work * e, "cache_holds"
    for j in JE:
        prob += h[j] <= n[j]["nvme"], f"held_{j}"
    miss = pulp.lpSum(cc[j].read_s / tau * (n[j]["nvme"] - h[j]) for j in JE)
    copy = 0.0
    if not unified:
        copy = reads * pulp.lpSum(cc[j].copy_s / tau * (n[j]["nvme"] - h[j]) for j in JE)
    tiebreak += pulp.lpSum(2 * b[j] * (n[j]["nvme"] - h[j]) for j in JE)
    # Streaming any expert at all costs more than any way of keeping them (a model that fits
    # is never streamed, even when a cache would predict as fast).
    tiebreak += 4 * sum(b[j] * size[j] for j in JE) * e
    return _ExpertRows(
        slots=K,
        cache_mib=slot * K,
        sync=(1.0 - alpha) * miss,
        disk=reads * miss,
        copy=copy,
        sync_max=sum(cc[j].read_s * size[j] for j in JE) / tau,
        tiebreak=tiebreak,
        held=h,
    )


def _prefill_rows(
    prob: pulp.LpProblem,
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    classes: list[_Class],
    n: list[dict[str, pulp.LpVariable]],
    y: list[pulp.LpVariable],
    ex: _ExpertRows,
    tau: float,
) -> pulp.LpAffineExpression:
    """Rows of the prefill chunks (``costmodel.prefill_chunk``); returns the mean TTFT over the
    shortest and longest prompt (time units), linear in the variables.

    Per distinct chunk length r (the full chunk c where a prompt needs more than one, and each
    end's last chunk ``l``: ``costmodel.prefill_chunks``), a variable ``X_r`` >= 0 with rows
    mirroring the decode step's: ``X_compute_r``: ``X_r >= C_r`` (compute + host copies +
    expert misses, ``C_r = compute_r + sum_{c,t} copy_r(c,t) n[c,t] + sum_{c expert}
    (read_r + copy_r)(n[c,nvme] - h_c)``); ``X_disk_r``: ``X_r >= D_r + miss_r``;
    ``X_serial_r``: ``X_r >= C_r + D_r - M_r (1 - y[0])`` with ``M_r = min(largest C_r, largest
    D_r)``. The objective weighs every ``X_r`` positively, so each equals its largest row: the
    chunk's time. ``TTFT(P) = F_P X_c + X_{l_P}``.
    """
    chunk = max(1, batch_limits(request).prefill_chunk)
    ends = [prefill_chunks(p, chunk) for p in request.prompt_tokens]
    lengths = sorted({last for _, last in ends} | ({chunk} if any(f for f, _ in ends) else set()))
    unified = profile.unified_memory
    x: dict[int, pulp.LpVariable] = {}
    for r in lengths:
        costs = prefill_costs(desc, profile, r)
        cc = [costs[c.members[0]] for c in classes]
        size = [len(c.members) for c in classes]
        expert = [desc.units[c.members[0]].expert is not None for c in classes]
        compute = step_compute_s(costs, host_overlaps(desc, profile)) / tau
        copies = pulp.lpSum(
            cc[j].host_copy_s(t, unified) / tau * n[j][t]
            for j in range(len(classes))
            for t in TIERS
            if cc[j].host_copy_s(t, unified) > 0 and not (expert[j] and t == "nvme")
        )
        per_miss = {j: cc[j].read_s + (0.0 if unified else cc[j].copy_s) for j in ex.held}
        miss = pulp.lpSum(cc[j].read_s / tau * (n[j]["nvme"] - h) for j, h in ex.held.items())
        miss_c = pulp.lpSum(per_miss[j] / tau * (n[j]["nvme"] - h) for j, h in ex.held.items())
        dense = [j for j in range(len(classes)) if not expert[j]]
        C = compute + copies + miss_c
        D = pulp.lpSum(cc[j].read_s / tau * n[j]["nvme"] for j in dense)
        c_max = compute + sum(max(c.host_copy_s(t, unified) for t in TIERS) for c in costs) / tau
        c_max += sum(per_miss[j] * size[j] for j in ex.held) / tau
        big = min(c_max, sum(cc[j].read_s * size[j] for j in dense) / tau)
        x[r] = prob.add_variable(f"prefill_{r}", lowBound=0)
        prob += x[r] >= C, f"X_compute_{r}"
        prob += x[r] >= D + miss, f"X_disk_{r}"
        prob += x[r] >= C + D - big * (1 - y[0]), f"X_serial_{r}"
    per_end = [full * x[chunk] + x[last] if full else x[last] + 0 for full, last in ends]
    return pulp.lpSum(per_end) / len(per_end)


@dataclass(frozen=True)
class _BlockType:
    """Blocks whose attention units share one class and whose FFN units share one class: the
    cost model cannot tell them apart, so they stall alike (``costmodel.io_stall``)."""

    blocks: tuple[int, ...]
    attn_class: int
    ffn_class: int
    sigma: float
    """Seconds the compute thread waits per block of this type that streams both, at depth 1."""


@dataclass
class _Stall:
    """The interleave decisions: per block type, streamed attention and FFN units (``a``, ``f``)."""

    types: list[_BlockType]
    a: list[pulp.LpVariable]
    f: list[pulp.LpVariable]


def _block_types(
    desc: ModelDescription, costs: list[UnitCost], classes: list[_Class]
) -> list[_BlockType] | None:
    """Blocks grouped by (attention class, FFN class); None when some attention or FFN unit is
    not part of such a pair (then nothing interleaves in the executor's sense)."""
    cls_of = {desc.units[i].name: j for j, c in enumerate(classes) for i in c.members}
    cost = {c.name: c for c in costs}
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(desc.architecture.block_count):
        a, f = f"blk.{i}.attn", f"blk.{i}.ffn"
        if a in cls_of and f in cls_of:
            groups.setdefault((cls_of[a], cls_of[f]), []).append(i)
    in_pairs = {f"blk.{i}.{k}" for bl in groups.values() for i in bl for k in ("attn", "ffn")}
    for j in {j for k in groups for j in k}:  # a class in a pair must hold paired units only
        if any(desc.units[i].name not in in_pairs for i in classes[j].members):
            return None
    return [
        _BlockType(
            blocks=tuple(bl),
            attn_class=ca,
            ffn_class=cf,
            sigma=max(0.0, cost[f"blk.{bl[0]}.ffn"].read_s - cost[f"blk.{bl[0]}.attn"].compute_s),
        )
        for (ca, cf), bl in groups.items()
    ]


def _stall_rows(
    prob: pulp.LpProblem,
    desc: ModelDescription,
    costs: list[UnitCost],
    classes: list[_Class],
    n: list[dict[str, pulp.LpVariable]],
    y: list[pulp.LpVariable],
    T: pulp.LpVariable,
    C: pulp.LpAffineExpression,
    tau: float,
) -> _Stall | None:
    """Rows for the depth-1 I/O stall (``costmodel.io_stall``) of blocks whose attention and FFN
    both stream.

    Per block type k (``_block_types``, L_k blocks): integers ``a_k``, ``f_k`` in [0, L_k], the
    streamed attention and FFN units of those blocks, with rows ``split_attn_c`` /
    ``split_ffn_c``: ``sum_{k of class c} a_k = n[c,nvme]`` (likewise f); ``m_k`` >= 0 with row
    ``interleave_k``: ``m_k >= a_k + f_k - L_k``, the blocks that stream both (``_decisions``
    streams a type's attention in its blocks whose FFN stays first, so that many and no more);
    and ``T_stall``: ``T >= C + sum_k sigma_k m_k - (sum_k sigma_k L_k) (1 - y[1])``: at depth 1
    the compute thread also waits ``sigma_k`` per such block; at any other depth the row is slack.
    A uniform model has one block type, so this is a handful of rows.
    """
    types = _block_types(desc, costs, classes)
    if not types or len(y) < 2:
        return None
    a = [
        prob.add_variable(f"stream_attn_{k}", 0, len(t.blocks), cat="Integer")
        for k, t in enumerate(types)
    ]
    f = [
        prob.add_variable(f"stream_ffn_{k}", 0, len(t.blocks), cat="Integer")
        for k, t in enumerate(types)
    ]
    for j in {t.attn_class for t in types}:
        ks = [k for k, t in enumerate(types) if t.attn_class == j]
        prob += pulp.lpSum(a[k] for k in ks) == n[j]["nvme"], f"split_attn_{j}"
    for j in {t.ffn_class for t in types}:
        ks = [k for k, t in enumerate(types) if t.ffn_class == j]
        prob += pulp.lpSum(f[k] for k in ks) == n[j]["nvme"], f"split_ffn_{j}"
    stall, most = 0, 0.0
    for k, t in enumerate(types):
        if t.sigma <= 0:
            continue
        m = prob.add_variable(f"interleaved_{k}", lowBound=0)
        prob += m >= a[k] + f[k] - len(t.blocks), f"interleave_{k}"
        stall += t.sigma / tau * m
        most += t.sigma / tau * len(t.blocks)
    if most > 0:
        prob += T >= C + stall - most * (1 - y[1]), "T_stall"
    return _Stall(types, a, f)


@dataclass(frozen=True)
class _Outcome:
    status: str
    """PuLP status name."""
    optimal: bool
    """CBC proved its incumbent optimal within the rung's gap."""
    incumbent: bool
    """There is an integer solution (proven or not)."""
    bound: float
    """CBC's lower bound on the objective (inf when proven infeasible, the cutoff when proven to
    have nothing below it, -inf when unknown)."""
    out_of_time: bool
    """The wall-clock deadline passed (an answer that depends on the machine: never used)."""

    @property
    def proven(self) -> bool:
        """CBC finished: optimal within its gap, or infeasible (below the cutoff, if any)."""
        return self.optimal or self.status == "Infeasible"


def _cbc(
    m: _Model,
    rung: tuple[float, int],
    deadline: float,
    *,
    warm: bool = False,
    cutoff: float | None = None,
) -> _Outcome:
    """One CBC run with a relative gap and node limit (and optionally an objective cutoff: only
    solutions below it count), within the wall-clock deadline."""
    ratio_gap, nodes = rung
    options = [*CBC_OPTIONS, f"ratioGap {ratio_gap:g}", f"maxNodes {nodes}"]
    if cutoff is not None:
        options.append(f"cutoff {cutoff!r}")
    with tempfile.TemporaryDirectory(prefix="strata-cbc-") as tmp:
        log = Path(tmp) / "cbc.log"
        with warnings.catch_warnings():
            # PuLP 3.3 flags PULP_CBC_CMD for removal in 4.0; it is the CBC this project pins.
            warnings.simplefilter("ignore", DeprecationWarning)
            # No ``threads`` option: CBC's default (0) searches on the calling thread. With
            # ``-threads 1`` CBC 2.10.3 starts one worker thread that, when the search ends at
            # the root, sometimes waits 10 s to start ("waiting to start 10.000" in its log).
            cmd = _TiedCBC(
                msg=False,
                timeLimit=max(1.0, deadline - time.perf_counter()),
                options=options,
                warmStart=warm,
                logPath=str(log),
            )
        m.prob.solve(cmd)
        text = log.read_text() if log.is_file() else ""
    status = pulp.LpStatus[m.prob.status]
    # An "Optimal" status with an integer-feasible (unproven) solution means a limit was hit.
    optimal = status == "Optimal" and m.prob.sol_status == pulp.LpSolutionOptimal
    incumbent = m.prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if status == "Infeasible":
        bound = math.inf if cutoff is None else cutoff
    else:
        bound = _log_bound(text, exact=optimal)
    return _Outcome(status, optimal, incumbent, bound, time.perf_counter() >= deadline)


def _log_bound(text: str, *, exact: bool) -> float:
    """CBC's lower bound from its summary: ``Lower bound:``, else (a proven run) the objective."""
    found = dict(re.findall(r"^(Objective value|Lower bound):\s+(\S+)", text, re.M))
    for key in ("Lower bound", "Objective value") if exact else ("Lower bound",):
        try:
            return float(found[key])
        except (KeyError, ValueError):
            continue
    return -math.inf


def _run(m: _Model, deadline: float, cutoff: float | None = None) -> _Outcome:
    """Minimize the model's objective up the ``RUNGS``; the first proven outcome, or the last."""
    out = _Outcome("Not Solved", False, False, -math.inf, False)
    for rung in RUNGS:
        out = _cbc(m, rung, deadline, cutoff=cutoff)
        if out.proven or out.out_of_time:
            break
    return out


def _decisions(desc: ModelDescription, m: _Model) -> tuple[dict[str, str], int]:
    """Unit tiers and depth from the solved counts: within a class, units in description order
    fill gpu, then ram, then nvme (early layers stay on the device, the last ones stream).

    With attention/FFN block pairs, which units stream follows the per-block-type counts
    instead: a type's last ``f_k`` FFNs stream, and its ``a_k`` streamed attention units go first
    to its blocks whose FFN stays (the ``interleave`` rows' promise); the class's other units
    then fill gpu and ram in description order.
    """
    counts = [{t: round(c[t].value() or 0) for t in TIERS} for c in m.n]
    for cls, cnt in zip(m.classes, counts, strict=True):
        if sum(cnt.values()) != len(cls.members):
            raise PlanError("the solver returned unit counts that do not add up; this is a bug")
    streamed: set[str] = set()  # the streamed units of classes in attention/FFN pairs
    paired: set[int] = set()
    if m.stall is not None:
        for t, a, f in zip(m.stall.types, m.stall.a, m.stall.f, strict=True):
            paired |= {t.attn_class, t.ffn_class}
            ffn = [f"blk.{i}.ffn" for i in t.blocks][::-1][: round(f.value() or 0)]
            streamed.update(ffn)
            keep = [i for i in t.blocks if f"blk.{i}.ffn" not in streamed]
            both = [i for i in reversed(t.blocks) if f"blk.{i}.ffn" in streamed]
            streamed.update(f"blk.{i}.attn" for i in (keep + both)[: round(a.value() or 0)])
    tiers: dict[str, str] = {}
    for j, (cls, cnt) in enumerate(zip(m.classes, counts, strict=True)):
        names = [desc.units[i].name for i in cls.members]
        if j in paired:
            chosen = [nm for nm in names if nm in streamed]
        else:
            chosen = names[len(names) - cnt["nvme"] :] if cnt["nvme"] else []
        if len(chosen) != cnt["nvme"]:
            raise PlanError("the solver's streamed units do not add up; this is a bug")
        rest = [nm for nm in names if nm not in chosen]
        tiers.update(zip(rest, [t for t in ("gpu", "ram") for _ in range(cnt[t])], strict=True))
        tiers.update(dict.fromkeys(chosen, "nvme"))
    depth = next(k for k, v in enumerate(m.y) if (v.value() or 0) > 0.5)
    return tiers, depth


# --------------------------------------------------------------------------- infeasibility


def _shortfall_message(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    tiers: dict[str, str],
    depth: int,
) -> tuple[str, dict[str, int]]:
    pool = pool_for(desc, tiers, depth)
    weights = weights_by_tier(desc, tiers)
    parts, flags, short = [], [], {}
    for row, used in capacity_use(desc, profile, request, PinnedPlacement(tiers, depth)):
        if used <= row.capacity:
            continue
        short[row.name] = used - row.capacity
        items = list(row.fixed)
        if row.counts_pool:
            items.append(("pool", pool.slots * pool.slot_bytes))
        items += [(f"{t} weights", weights[t]) for t in row.weight_tiers]
        shown = " + ".join(f"{label} {format_size(v)}" for label, v in items if v > 0) or "nothing"
        if "gpu" in row.weight_tiers and weights["gpu"] == 0:
            shown += ", with every weight off the device"
        parts.append(
            f"{row.tier_label} is short by {format_size(used - row.capacity)} "
            f"({used - row.capacity} bytes): needs {format_size(used)} ({shown}), "
            f"capacity {format_size(row.capacity)}"
        )
        if row.budget_flag not in flags:
            flags.append(row.budget_flag)
    fix = f"lower --context/--concurrency or raise {' / '.join(flags)}"
    return f"does not fit: {'; '.join(parts)}; {fix}", short


def _infeasible(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    rows: list[CapacityRow],
    deadline: float,
) -> PlanError:
    m = _build(desc, profile, request, rows, phase1=True)
    out = _run(m, deadline)
    if not out.optimal:
        return PlanError(
            f"the placement ILP found no feasible placement and its phase-1 model ended "
            f"{out.status}; raise the time limit"
        )
    tiers, depth = _decisions(desc, m)
    msg, short = _shortfall_message(desc, profile, request, tiers, depth)
    if not short:
        return PlanError(
            "the solver found no feasible placement within its limits, yet one exists "
            "(every tier fits in phase 1); raise the time limit"
        )
    err = PlanError(msg)
    err.short_bytes = short  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------- solve

TIE_UNITS = 1e-6
"""Objectives within this many solver time units (~1000 per decode step) are equal."""


def _branch(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    rows: list[CapacityRow],
    *,
    y0: int,
    prefetch: int,
) -> _Model:
    """The stage-1 model with y[0] fixed: 1 = depth 0 (synchronous reads or no streaming),
    0 = prefetch depth >= 1; ``prefetch`` experts read ahead per block."""
    m = _build(desc, profile, request, rows, phase1=False, prefetch=prefetch)
    m.prob += m.y[0] == y0, "branch_y0"
    return m


def _expert_cache(desc: ModelDescription, m: _Model, tiers: dict[str, str]) -> ExpertCache:
    """The expert cache of the model's current (integral) decisions."""
    slots = round(m.cache_slots.value() or 0) if m.cache_slots is not None else 0
    return expert_cache_for(desc, tiers, slots, m.prefetch)


def _objective_units(
    desc: ModelDescription, profile: HardwareProfile, request: Request, m: _Model
) -> float:
    """The exact objective (``costmodel.objective``) of the model's current (integral)
    decisions, in solver time units."""
    tiers, depth = _decisions(desc, m)
    cache = _expert_cache(desc, m, tiers)
    pinned = PinnedPlacement(tiers, depth, experts=cache)
    return objective(score(desc, profile, request, pinned), request) / m.tau


class _Infeasible(Exception):
    """Both depth branches proved infeasible (the request does not fit)."""


def _stage1(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    rows: list[CapacityRow],
    deadline: float,
    start: float,
    prefetch: int,
) -> tuple[float, _Model, float]:
    """Stage 1 for one expert-prefetch choice: (exact objective in time units (the same tau
    for every choice: it depends on compute alone), the solved
    model, the proven relative gap).

    Split on y[0] (CBC's own branching rarely picks it, and each side's relaxation is far
    tighter: the T_serial and pool big-Ms vanish). Prefetching first (usually the faster side),
    then depth 0 with a cutoff just above it, so it only searches for placements at least as
    fast; on a tie depth 0 wins (fewer pool slots).

    Raises:
        _Infeasible: both branches are infeasible.
        PlanError: no placement found or proven within ``ACCEPT_GAP``.
    """
    overlap = _branch(desc, profile, request, rows, y0=0, prefetch=prefetch)
    out_a = _run(overlap, deadline)
    t_a = _objective_units(desc, profile, request, overlap) if out_a.incumbent else None
    serial = _branch(desc, profile, request, rows, y0=1, prefetch=prefetch)
    cutoff = None if t_a is None else t_a + TIE_UNITS
    out_b = _run(serial, deadline, cutoff=cutoff)
    t_b = _objective_units(desc, profile, request, serial) if out_b.incumbent else None
    if t_a is None and t_b is None:
        if out_a.status == "Infeasible" and out_b.status == "Infeasible":
            raise _Infeasible()
        raise PlanError(
            f"the placement ILP found no placement in {time.perf_counter() - start:.1f} s "
            f"(ended {out_a.status} / {out_b.status}); raise the time limit"
        )
    t_star: float | None
    if t_b is not None and (t_a is None or t_b <= t_a + TIE_UNITS):
        m, t_star = serial, t_b
    else:
        m, t_star = overlap, t_a
    assert t_star is not None  # at least one side found an incumbent (checked above)
    # Proven gap of the whole model: the best step against the lower of the two sides' bounds.
    gap = max(0.0, (t_star - min(out_a.bound, out_b.bound)) / t_star)
    if out_a.out_of_time or out_b.out_of_time:
        raise PlanError(
            f"the placement ILP ran out of time after {time.perf_counter() - start:.1f} s "
            f"(best found within {gap:.2%} of optimal, its search unfinished; a routing profile "
            "gives every expert its own class); raise the time limit"
        )
    if gap > ACCEPT_GAP:
        raise PlanError(
            f"the placement ILP proved no placement within {ACCEPT_GAP:.0%} of optimal in "
            f"{time.perf_counter() - start:.1f} s (gap {gap:.2%}); raise the time limit"
        )
    return t_star, m, gap


def solve(
    desc: ModelDescription, profile: HardwareProfile, request: Request, *, time_limit_s: float = 30
) -> Solution:
    """Place every unit on a tier and choose pool and prefetch depth to minimize
    ``costmodel.objective``: seconds per generated token of whole requests (prefill and decode).

    Args:
        desc: the model description (units with bytes, access, FLOPs).
        profile: the machine (capacities in bytes, bandwidths in bytes/s, FLOP/s).
        request: context and concurrency (sizing KV cache and batch limits), objective (B = 1 for
            latency, concurrency for throughput), optional gpu/ram budgets in bytes.
        time_limit_s: wall-clock limit of all CBC calls together, seconds. Normally unused: node
            limits (``RUNGS``, ``TIEBREAK_RUNG``) bound the work, the same on every machine.

    Returns:
        The Solution: placement, pool, prefetch, batch limits, memory per tier, the cost model's
        prediction of the chosen placement (``costmodel.score``), solver result (status Optimal
        and the relative gap proven) and runtime.

    Raises:
        PlanError: the request does not fit (the message names each short tier, the shortfall in
            bytes and the fix), or CBC proved no placement within 1% of optimal (time limit,
            numerical trouble).
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    rows = capacity_rows(desc, profile, request)
    # Expert prefetch is a fixed choice per solve (it scales the expert rows' coefficients):
    # none, or the block's top-k, when experts may stream; the faster plan wins, ties to none.
    k = desc.architecture.expert_used_count
    choices = [0, k] if k and "nvme" in request.tiers else [0]
    best: tuple[float, _Model, float] | None = None
    infeasible = None
    for prefetch in choices:
        try:
            t_star, m, gap = _stage1(desc, profile, request, rows, deadline, start, prefetch)
        except _Infeasible as e:
            infeasible = e
            continue
        if best is None or t_star < best[0] - TIE_UNITS:
            best = (t_star, m, gap)
    if best is None:
        assert infeasible is not None
        raise _infeasible(desc, profile, request, rows, deadline)
    t_star, m, gap = best

    # Stage 2: keep the objective, minimize the tie-break. The bound is the exact objective of
    # stage 1's (integral) decisions, not CBC's value, which its solution file rounds to 8
    # significant digits; TIE_UNITS is 1e-9 of a step or less.
    m.prob += m.objective <= t_star + TIE_UNITS, "objective_at_optimum"
    m.prob.setObjective(m.tiebreak)
    # Warm-started from stage 1, so there is always an incumbent; any incumbent is as fast as
    # stage 1's placement and breaks ties at least as well, proven or stopped by the node limit.
    out2 = _cbc(m, TIEBREAK_RUNG, deadline, warm=True)
    if out2.out_of_time:
        raise PlanError(
            f"the placement ILP's tie-break stage ran out of time ({time_limit_s:g} s); "
            "raise the time limit"
        )
    tiers, depth = _decisions(desc, m)
    solve_time = time.perf_counter() - start

    pool = pool_for(desc, tiers, depth)
    cache = _expert_cache(desc, m, tiers)
    pinned = PinnedPlacement(tiers, depth, experts=cache)
    prediction = score(desc, profile, request, pinned)
    streams = bool(pool.slots or cache.slots)
    return Solution(
        placement=[
            Placement(unit=u.name, tier=tiers[u.name], bytes=u.bytes_mlx)  # type: ignore[arg-type]
            for u in desc.units
        ],
        pool=pool,
        # As many reads in flight as the profile's disk test had: its bandwidth is the prediction's.
        prefetch=Prefetch(depth=depth, io_threads=profile.nvme.queue_depth if streams else 0),
        expert_cache=cache,
        batch=batch_limits(request),
        memory=tier_memory(desc, profile, request, pinned),
        prediction=prediction,
        solver=SolverResult(
            name=f"CBC {cbc_version()} (PuLP {pulp.__version__})",
            status="Optimal",
            objective=objective(prediction, request),
            gap=round(gap, 6),
        ),
        runtime=runtime_for(profile),
        solve_time_s=solve_time,
    )
