"""Does a plan hold on this machine, and why (``strata check PLAN``; ``run``, ``serve`` and
``bench`` ask it too, before they read a weight).

Terraform's plan/apply habit: a plan applies wherever its inputs still hold. Its inputs are the
model, which must be the planned file byte for byte (sha256; ``executor.plan_loader``), and the
machine: the MLX backend the plan was solved for, and tiers at least as large as the plan's own
decisions need (recomputed by ``planner.rescore``, so a hand edit is judged as it is). Bandwidths
are measurements, not inputs: a machine whose last profile predicts the plan more than
``WARN_CHANGE`` faster or slower gets one warning line, never a refusal.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from strata.common.cluster import check_cluster_placement, stage_view
from strata.common.errors import PlanError, SchemaError, StrataError
from strata.common.schemas import HardwareProfile, Plan
from strata.common.sizes import format_size
from strata.common.yamlio import read_yaml
from strata.executor.cli import add_plan_arguments
from strata.executor.machine import MachineNow, last_profile, machine_now
from strata.executor.plan_loader import check_executable
from strata.planner.explain import format_rate
from strata.planner.rescore import judge, memory_needs

NOISE = 0.02
"""A memory short by at most this share of its capacity is a warning, not a refusal: a CUDA
device's working set is its free memory at the moment (``executor.profile.working_set``), which
other processes and the driver move by a few MiB, and a plan may fill its tier to the byte."""

WARN_CHANGE = 0.25
"""Relative change of the predicted decode rate or TTFT, under this machine's measured figures
instead of the plan's, from which a run warns that the plan may not suit this machine."""


@dataclass
class Verdict:
    """The answer of ``check``: refusals (the plan does not hold), warnings, and what was
    checked."""

    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return not self.refusals


def needs(plan: Plan) -> list[tuple[str, int, str]]:
    """The bytes the plan's decisions need of each memory: ``(memory, bytes, which capacity of
    MachineNow bounds it)`` (``planner.rescore.memory_needs``)."""
    return [
        (row.tier_label, used, "gpu_bytes" if row.weight_tiers == ("gpu",) else "ram_bytes")
        for row, used in memory_needs(plan)
    ]


def verdict(plan: Plan, here: MachineNow, local: HardwareProfile | None) -> Verdict:
    """Judge ``plan`` against the running machine ``here`` and, when given, this machine's
    measured profile ``local`` (bandwidths)."""
    v = Verdict()
    want = plan.machine.backend
    if here.backend != want:
        v.refusals.append(
            f"the plan is for MLX's {want} backend and this machine runs {here.backend}"
        )
        return v  # capacities of another kind of memory say nothing more
    v.checked.append(f"backend {want}: as planned")
    for label, need, attr in needs(plan):
        have = getattr(here, attr)
        line = (
            f"{label}: the plan needs {format_size(need)}, this machine has "
            f"{format_size(have)} ({format_size(need - have)} short)"
        )
        moves = here.backend == "cuda" and attr == "gpu_bytes"  # free memory, read just now
        if need > have * (1 + (NOISE if moves else 0.0)):
            v.refusals.append(line)
        elif need > have:  # within what the free memory of a GPU moves by between two reads
            v.warnings.append(line + "; within the noise of free memory, so it may still run")
        else:
            v.checked.append(f"{label}: needs {format_size(need)} of {format_size(have)}")
    if local is None:
        v.checked.append(
            "bandwidths: not compared (no profile of this machine: run strata profile)"
        )
        return v
    if local.backend != want:
        v.checked.append(f"bandwidths: not compared (this host's profile is for {local.backend})")
        return v
    ours, theirs = judge(plan).view.prediction, judge(plan, local).view.prediction
    assert ours is not None and theirs is not None
    pairs = [("decode", ours.decode_tok_s, theirs.decode_tok_s, "tok/s")]
    if ours.ttft_s and theirs.ttft_s:
        pairs.append(("TTFT", ours.ttft_s[-1], theirs.ttft_s[-1], "s"))
    lines, off = [], False
    for what, a, b, unit in pairs:
        change = b / a - 1 if a > 0 else 0.0
        off = off or abs(change) > WARN_CHANGE
        lines.append(f"{what} {format_rate(b)} {unit} against {format_rate(a)} ({change:+.0%})")
    text = (
        f"with this machine's figures ({local.name}) rather than the plan's "
        f"({plan.machine.name}): {'; '.join(lines)}"
    )
    if off:
        v.warnings.append(
            f"{text}; the plan may not be the best here: re-plan with strata plan --profile "
            "PROFILE of this machine"
        )
    else:
        v.checked.append(text)
    return v


def _verdict(path: Path, local: HardwareProfile | None, rank: int = 0) -> Verdict:
    """``verdict`` of the plan file ``path`` on the running machine; of a cluster plan, the
    stage of rank ``rank`` (``common.cluster.stage_view``: its units, its host's figures and
    budgets), which the output says.

    Raises:
        StrataError: not a plan; a plan of a described model (no weights); decisions that
            cannot be judged (a unit placed twice...), named by the file; a rank the plan does
            not have.
    """
    plan = read_yaml(path, Plan)
    check_executable(path, plan)
    try:
        check_cluster_placement(plan)
        v = verdict(stage_view(plan, rank), machine_now(), local)
    except (PlanError, SchemaError) as e:
        raise PlanError(f"{path}: {e}") from None
    if plan.cluster is not None:
        stages = plan.cluster.stages
        s = stages[rank]
        others = ", ".join(x.host for i, x in enumerate(stages) if i != rank) or "none"
        head = ", the embedding and the head" if rank == 0 else ""
        # The bandwidth comparison is of this stage alone, not of the pipeline's rate.
        alone = f"rank {rank}'s stage alone, with this machine's figures"
        v.checked = [x.replace("with this machine's figures", alone, 1) for x in v.checked]
        v.warnings = [x.replace("with this machine's figures", alone, 1) for x in v.warnings]
        v.checked.insert(
            0,
            f"cluster plan {plan.cluster.name}: rank {rank}'s stage (host {s.host}, blocks "
            f"{s.first_block}–{s.end_block - 1}{head}) checked against this machine; the other "
            f"hosts' stages ({others}) are not checked here",
        )
    return v


def check(path: str | Path, model: str | None = None, profile: str | None = None) -> Verdict:
    """``strata check``: the machine (``verdict``) and the model: found and the planned bytes.

    Raises:
        StrataError: the plan or the profile cannot be read.
    """
    from strata.executor.plan_loader import load_plan

    path = Path(path)
    local = read_yaml(profile, HardwareProfile) if profile else last_profile()
    v = _verdict(path, local)
    try:
        loaded = load_plan(path, model)
    except StrataError as e:  # not found, or not the planned bytes
        v.refusals.append(str(e).removeprefix(f"{path}: "))
    else:
        v.checked.insert(0, f"model: {loaded.gguf.path} has the planned sha256")
    return v


def require(path: str | Path, rank: int = 0) -> None:
    """What ``run``, ``serve`` and ``bench`` ask before loading: the plan is executable and the
    machine holds it (of a cluster plan, the stage of rank ``rank``); warnings go to stderr as
    one line each.

    Raises:
        PlanError: the plan does not hold on this machine (one line naming each reason and the
            fix).
    """
    path = Path(path)
    v = _verdict(path, last_profile(), rank)
    for w in v.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not v.holds:
        raise PlanError(
            f"{path} does not hold on this machine: {'; '.join(v.refusals)}; plan for this "
            "machine (strata profile -o PROFILE, then strata plan --profile PROFILE)"
        )


def cmd_check(args: argparse.Namespace) -> None:
    """Print the verdict; exit status 2 when the plan does not hold."""
    v = check(args.plan, args.model, args.profile)
    print(f"{args.plan}: {'holds' if v.holds else 'does NOT hold'} on this machine")
    for r in v.refusals:
        print(f"  refused: {r}")
    for w in v.warnings:
        print(f"  warning: {w}")
    for c in v.checked:
        print(f"  ok: {c}")
    if not v.holds:
        raise SystemExit(2)


def add_command(sub) -> None:
    """Add ``check`` to ``sub``."""
    c = sub.add_parser(
        "check",
        help="does this plan hold on this machine, and why (exit status 0 or 2)",
        description="Check a plan against this machine: the backend, the bytes each memory "
        "needs, the model file (found and its sha256), and the predicted speed under this "
        "machine's last profile.",
    )
    add_plan_arguments(c)
    c.add_argument(
        "--profile",
        help="this machine's profile to compare bandwidths with (default: the last one "
        "strata profile measured on this host)",
    )
