"""Making a plan: describe the model, read the profile, solve the ILP, attach fingerprints."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from planner import __version__
from planner.describe import describe
from planner.ilp import solve, solver_description
from planner.routing import apply_routing_profile, read_routing_profile
from planner.schemas import (
    Fingerprints,
    HardwareProfile,
    ModelDescription,
    Plan,
    ProfileRef,
    Request,
)
from planner.yamlio import canonical_sha256, read_yaml


def build_plan(
    model: str | None,
    profile_path: Path,
    request: Request,
    plan_path: Path,
    *,
    desc: ModelDescription | None = None,
    routing_profile: Path | None = None,
) -> Plan:
    """Solve the placement ILP and return the plan, fingerprinted for ``plan_path``.

    The model is ``model`` (catalog name or GGUF path, described here) or, when given, the
    already-built description ``desc`` (e.g. from ``plan.py plan --arch``; ``model`` is then
    ignored). ``routing_profile`` (a file of ``execute.py run --save-routing-profile``)
    replaces uniform expert access with the measured one (``planner.routing``).

    The profile is referenced relative to the plan file's folder, so a plan and its profile
    checked in together keep working from any clone. Solve time goes to stderr only: the same
    inputs give a byte-identical plan.

    Raises:
        StrataError: bad model or profile, infeasible request (names the short tier), a solve
            that is not optimal.
    """
    profile = read_yaml(profile_path, HardwareProfile)
    if desc is None:
        if model is None:
            raise ValueError("build_plan needs a model spec or a description")
        desc, _ = describe(model)
    if routing_profile is not None:
        desc = apply_routing_profile(desc, read_routing_profile(routing_profile))
    if request.context > desc.architecture.context_length:
        print(
            f"warning: --context {request.context} exceeds the model's training context "
            f"{desc.architecture.context_length}",
            file=sys.stderr,
        )
    sol = solve(desc, profile, request)
    print(f"solved in {sol.solve_time_s:.3f} s ({sol.solver.name})", file=sys.stderr)
    fingerprints = Fingerprints(
        model=desc.model,
        profile=ProfileRef(
            name=profile.name,
            path=os.path.relpath(profile_path.resolve(), plan_path.resolve().parent),
            sha256=canonical_sha256(profile),
        ),
        request_sha256=canonical_sha256(request),
        routing_profile_sha256=desc.routing.sha256 if desc.routing else None,
        planner_version=__version__,
        solver=solver_description(),
    )
    return sol.to_plan(fingerprints, request)
