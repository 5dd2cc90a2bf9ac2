"""Loading a plan and checking that its inputs still match (Terraform's plan/apply habit).

A plan names its model by catalog name or path with the file's size and sha256, and its profile by
path and canonical sha256. ``load_plan`` refuses a plan whose model file or profile changed since
planning, and one whose units do not match the model (a hand-written plan with a typo, or a plan of
another model), each with a message that says to re-run ``plan.py plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.catalog import CATALOG, ResolvedModel, file_sha256, resolve_model
from planner.describe import describe_gguf, source_for
from planner.errors import PlanError
from planner.gguf_file import GGUFFile, open_gguf
from planner.schemas import HardwareProfile, ModelDescription, Plan
from planner.yamlio import canonical_sha256, read_yaml


@dataclass
class LoadedPlan:
    """A plan whose inputs were checked, with its model opened and described.

    Attributes:
        plan: the plan document.
        path: the plan file.
        gguf: the opened model file.
        desc: the model's description (units and tensors), made from the file now on disk.
    """

    plan: Plan
    path: Path
    gguf: GGUFFile
    desc: ModelDescription


def _model_path(plan: Plan, plan_dir: Path) -> Path:
    src = plan.fingerprints.model
    if src.sha256 is None and src.path is None:
        raise PlanError(
            f"plan is for {src.name or 'a described model'}, made from an architecture description "
            "(--arch): it has no weights and can only be compared, not executed; plan a GGUF file"
        )
    if src.name:
        if src.name not in CATALOG:
            raise PlanError(f"plan names unknown catalog model {src.name!r}; re-run plan.py plan")
        return resolve_model(src.name).path
    p = Path(src.path or "").expanduser()
    for candidate in (p, plan_dir / p):
        if candidate.is_file():
            return candidate
    where = "" if p.is_absolute() else f" (nor relative to the plan's folder {plan_dir})"
    raise PlanError(
        f"plan's model file {src.path} is not found{where}; put the GGUF there, or re-plan with "
        "--model pointing at it"
    )


def load_plan(path: str | Path) -> LoadedPlan:
    """Read a plan, check its fingerprints against the files on disk, open its model.

    Raises:
        SchemaError: not a plan, a typo, or an unknown major format version.
        PlanError: the model or profile changed since planning, or units do not match.
        GGUFError: the model file is malformed.
    """
    path = Path(path)
    plan = read_yaml(path, Plan)
    src = plan.fingerprints.model
    model_path = _model_path(plan, path.parent)
    size = model_path.stat().st_size
    if src.size_bytes is not None and size != src.size_bytes:
        raise PlanError(
            f"{path}: model file {model_path} is {size} bytes but the plan was made for "
            f"{src.size_bytes} bytes; the model changed — re-run plan.py plan"
        )
    digest = file_sha256(model_path)  # remembered in the cache: hashed once per file version
    if src.sha256 is not None:
        if digest != src.sha256:
            raise PlanError(
                f"{path}: model file {model_path} has sha256 {digest[:12]}… but the plan was made "
                f"for {src.sha256[:12]}…; the model changed — re-run plan.py plan"
            )
    ref = plan.fingerprints.profile
    if ref is not None:
        prof_path = path.parent / ref.path
        if not prof_path.is_file():
            raise PlanError(f"{path}: its profile {prof_path} is missing; re-run plan.py plan")
        profile = read_yaml(prof_path, HardwareProfile)
        if canonical_sha256(profile) != ref.sha256:
            raise PlanError(
                f"{path}: profile {prof_path} changed since this plan was made; re-run plan.py plan"
            )
    g = open_gguf(model_path)
    if src.header_sha256 and g.header_sha256 != src.header_sha256:
        raise PlanError(f"{path}: model header changed since planning; re-run plan.py plan")
    resolved = ResolvedModel(model_path, None, size, digest)
    desc = describe_gguf(g, source_for(resolved, g.header_sha256))
    seen: set[str] = set()
    for p in plan.placement:
        if p.unit in seen:
            raise PlanError(f"{path}: unit {p.unit} is placed twice; give each unit one tier")
        seen.add(p.unit)
    planned = seen
    actual = {u.name for u in desc.units}
    if planned != actual:
        missing = sorted(actual - planned)[:3]
        extra = sorted(planned - actual)[:3]
        raise PlanError(
            f"{path}: the plan's units do not match the model "
            f"(missing {missing}, unknown {extra}); "
            "re-run plan.py plan"
        )
    tiers = plan.tier_of()
    on_gpu = [u.name for u in desc.units if u.expert is not None and tiers[u.name] == "gpu"]
    if sorted(plan.expert_cache.pinned) != sorted(on_gpu):
        raise PlanError(
            f"{path}: expert_cache.pinned lists {len(plan.expert_cache.pinned)} experts but the "
            f"placement keeps {len(on_gpu)} on gpu; make them agree (pinned = the expert units "
            "placed on gpu) or re-run plan.py plan"
        )
    return LoadedPlan(plan, path, g, desc)
