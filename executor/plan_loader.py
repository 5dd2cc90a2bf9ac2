"""Loading a plan and checking that its inputs still match (Terraform's plan/apply habit).

A plan names its model by catalog name or path with the file's size and sha256, and its profile by
path and canonical sha256. ``load_plan`` refuses a plan whose model file or profile changed since
planning, and one whose units do not match the model (a hand-written plan with a typo, or a plan of
another model), each with a message that says to re-run ``strata plan``. A speculative plan's
draft model (``speculative.draft_model``: catalog name, or a path relative to the plan's folder) is
checked the same way: present, same size, sha256 and header.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from strata.common.catalog import CATALOG, ResolvedModel, file_sha256, resolve_model
from strata.common.describe import describe_gguf, source_for
from strata.common.errors import PlanError
from strata.common.gguf_file import GGUFFile, open_gguf
from strata.common.schemas import (
    DraftModelRef,
    HardwareProfile,
    ModelDescription,
    Plan,
    RoutingProfile,
)
from strata.common.yamlio import canonical_sha256, read_yaml


@dataclass
class LoadedPlan:
    """A plan whose inputs were checked, with its model opened and described.

    Attributes:
        plan: the plan document.
        path: the plan file.
        gguf: the opened model file.
        desc: the model's description (units and tensors), made from the file now on disk.
        draft_path: the checked draft model file (``speculative.method: draft_model``), else None.
    """

    plan: Plan
    path: Path
    gguf: GGUFFile
    desc: ModelDescription
    draft_path: Path | None = None
    routing: RoutingProfile | None = None
    """The routing profile the plan was made with (``fingerprints.routing_profile_path``), checked
    against its sha256; the executor seeds its routing tracker from it."""


def _draft_model_path(path: Path, ref: DraftModelRef) -> Path:
    """The plan's draft model file, checked against its size, sha256 and header sha256.

    Raises:
        PlanError: unknown catalog name, missing file, or a file that changed since planning.
    """
    again = "re-run strata plan with --speculative draft_model --draft-model MODEL"
    if ref.name:
        if ref.name not in CATALOG:
            raise PlanError(f"{path}: plan names unknown catalog draft model {ref.name!r}; {again}")
        draft = resolve_model(ref.name).path
    else:
        p = Path(ref.path or "").expanduser()
        # Relative to the plan's folder (an absolute p stays as it is).
        draft = Path(os.path.normpath(path.parent / p))
        if not ref.path or not draft.is_file():
            raise PlanError(
                f"{path}: the plan's draft model {ref.path} is not found (relative to the plan's "
                f"folder: {draft}); put the GGUF there, or {again} pointing at it"
            )
    size = draft.stat().st_size
    if size != ref.size_bytes:
        raise PlanError(
            f"{path}: draft model file {draft} is {size} bytes but the plan was made for "
            f"{ref.size_bytes} bytes; the draft model changed — {again}"
        )
    digest = file_sha256(draft)
    if digest != ref.sha256:
        raise PlanError(
            f"{path}: draft model file {draft} has sha256 {digest[:12]}… but the plan was made "
            f"for {ref.sha256[:12]}…; the draft model changed — {again}"
        )
    if open_gguf(draft).header_sha256 != ref.header_sha256:
        raise PlanError(f"{path}: draft model header changed since planning; {again}")
    return draft


def _routing_profile(path: Path, plan: Plan) -> RoutingProfile | None:
    """The plan's routing profile (None when it was planned without one), checked.

    Raises:
        PlanError: the plan names a profile that is missing or changed since planning.
    """
    fp = plan.fingerprints
    if fp.routing_profile_sha256 is None or fp.routing_profile_path is None:
        return None  # no profile, or a 1.3 plan that recorded only its hash
    again = "re-run strata plan --routing-profile FILE (or plan without one)"
    where = Path(os.path.normpath(path.parent / Path(fp.routing_profile_path).expanduser()))
    if not where.is_file():
        raise PlanError(
            f"{path}: the plan's routing profile {fp.routing_profile_path} is not found "
            f"(relative to the plan's folder: {where}); put it there, or {again}"
        )
    doc = read_yaml(where, RoutingProfile)
    if canonical_sha256(doc) != fp.routing_profile_sha256:
        raise PlanError(f"{path}: routing profile {where} changed since planning; {again}")
    return doc


def _check_self(path: Path, plan: Plan, desc: ModelDescription) -> None:
    """A self-drafting plan runs blocks the model has, and reads no head unit from NVMe."""
    sp = plan.speculative
    n = desc.architecture.block_count
    if sp.draft_layers > n:
        raise PlanError(
            f"{path}: speculative.draft_layers is {sp.draft_layers} but the model has {n} "
            f"blocks; give 1..{n} or re-run strata plan --speculative self"
        )
    tiers = plan.tier_of()
    streamed = [u.name for u in desc.units if u.layer is None and tiers[u.name] == "nvme"]
    if streamed:
        raise PlanError(
            f"{path}: speculative method self needs {', '.join(streamed)} in memory but the "
            "placement streams it from NVMe; place it on gpu or ram, or re-run strata plan "
            "--speculative self (or --speculative prompt_lookup)"
        )


def _model_path(plan: Plan, plan_dir: Path) -> Path:
    src = plan.fingerprints.model
    if src.sha256 is None and src.path is None:
        raise PlanError(
            f"plan is for {src.name or 'a described model'}, made from an architecture description "
            "(--arch): it has no weights and can only be compared, not executed; plan a GGUF file"
        )
    if src.name:
        if src.name not in CATALOG:
            raise PlanError(f"plan names unknown catalog model {src.name!r}; re-run strata plan")
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
        PlanError: the model or profile changed since planning, the request section was edited,
            or units do not match.
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
            f"{src.size_bytes} bytes; the model changed — re-run strata plan"
        )
    digest = file_sha256(model_path)  # remembered in the cache: hashed once per file version
    if src.sha256 is not None:
        if digest != src.sha256:
            raise PlanError(
                f"{path}: model file {model_path} has sha256 {digest[:12]}… but the plan was made "
                f"for {src.sha256[:12]}…; the model changed — re-run strata plan"
            )
    want = plan.fingerprints.request_sha256
    if want is not None and canonical_sha256(plan.request) != want:
        # The placement, KV cache and batch limits were solved for the request as it was: a
        # hand-raised context would size a KV cache the budgets never allowed for.
        raise PlanError(
            f"{path}: its request section (context, concurrency, objective, budgets) is not the "
            "request it was planned for: edited after planning (or planned by a Strata with "
            f"another request format; this plan is format {plan.format_version}), so its "
            "placement and KV cache no longer follow from it; re-run strata plan"
        )
    ref = plan.fingerprints.profile
    if ref is not None:
        prof_path = path.parent / ref.path
        if not prof_path.is_file():
            raise PlanError(f"{path}: its profile {prof_path} is missing; re-run strata plan")
        profile = read_yaml(prof_path, HardwareProfile)
        if canonical_sha256(profile) != ref.sha256:
            raise PlanError(
                f"{path}: profile {prof_path} changed since this plan was made (its figures, or "
                "the fields this version of Strata reads from profiles); re-run strata plan"
            )
    draft_ref = plan.speculative.draft_model
    draft_path = _draft_model_path(path, draft_ref) if draft_ref is not None else None
    g = open_gguf(model_path)
    if src.header_sha256 and g.header_sha256 != src.header_sha256:
        raise PlanError(f"{path}: model header changed since planning; re-run strata plan")
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
            "re-run strata plan"
        )
    tiers = plan.tier_of()
    on_gpu = [u.name for u in desc.units if u.expert is not None and tiers[u.name] == "gpu"]
    if sorted(plan.expert_cache.pinned) != sorted(on_gpu):
        raise PlanError(
            f"{path}: expert_cache.pinned lists {len(plan.expert_cache.pinned)} experts but the "
            f"placement keeps {len(on_gpu)} on gpu; make them agree (pinned = the expert units "
            "placed on gpu) or re-run strata plan"
        )
    streamed = {u.name for u in desc.units if u.expert is not None and tiers[u.name] == "nvme"}
    stray = [u for u in plan.expert_cache.preload if u not in streamed]
    if stray:
        raise PlanError(
            f"{path}: expert_cache.preload lists {stray[0]}, which is not an expert the "
            "placement streams from nvme; list streamed experts only or re-run strata plan"
        )
    if plan.speculative.method == "self":
        _check_self(path, plan, desc)
    return LoadedPlan(plan, path, g, desc, draft_path, _routing_profile(path, plan))


def load_draft(loaded: LoadedPlan) -> LoadedPlan:
    """The plan's draft model (``speculative.method: draft_model``) as a plan of its own: every
    unit resident on the device, the target's runtime and batch limits (its KV cache follows the
    target's sequences), no streaming, no speculation — what the planner budgeted for it.

    Raises:
        PlanError: the plan has no draft model.
    """
    from strata.common.schemas import ExpertCache, Placement, Pool, Prefetch, Speculative

    if loaded.draft_path is None:
        raise PlanError(
            f"{loaded.path}: the plan has no draft model; re-run strata plan with "
            "--speculative draft_model --draft-model MODEL"
        )
    g = open_gguf(loaded.draft_path)
    ref = loaded.plan.speculative.draft_model
    assert ref is not None  # draft_path is set only with a draft model
    resolved = ResolvedModel(loaded.draft_path, None, ref.size_bytes, ref.sha256)
    desc = describe_gguf(g, source_for(resolved, g.header_sha256))
    plan = loaded.plan.model_copy(
        update={
            "placement": [
                Placement(unit=u.name, tier="gpu", bytes=u.bytes_mlx) for u in desc.units
            ],
            "pool": Pool(slots=0, slot_bytes=0),
            "prefetch": Prefetch(depth=0, io_threads=0),
            "expert_cache": ExpertCache(),
            "speculative": Speculative(),
        }
    )
    return LoadedPlan(plan, loaded.draft_path, g, desc, None)
