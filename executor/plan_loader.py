"""Loading a plan and checking that its model is the one it was made for (Terraform's
plan/apply habit).

A plan is self-contained: it names its model by identity (size, sha256, header; catalog name and
an absolute path as hints), so ``load_plan`` finds the file wherever the plan was copied
(``catalog.locate_model``: ``--model``, the hint, the catalog, the files this machine hashed
before) and refuses a file whose bytes are not the planned ones, or a plan whose units do not
match the model (a hand-written plan with a typo, or a plan of another model), each with a message
that names the fix. A speculative plan's draft model is found and checked the same way. Whether
the machine can hold the plan is ``strata.check``'s question, asked before this.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from strata.common.catalog import (
    ResolvedModel,
    locate_model,
    model_sha256,
    routing_cache_path,
)
from strata.common.describe import describe_gguf, source_for
from strata.common.errors import PlanError, StrataError
from strata.common.gguf_file import GGUFFile, open_gguf, split_paths
from strata.common.schemas import (
    DraftModelRef,
    ModelDescription,
    Plan,
    RoutingProfile,
)
from strata.common.tensors import executor_rule
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
    """The routing profile the plan was made with (``provenance.routing_profile``), checked
    against its sha256; the executor seeds its routing tracker from it."""


def _checked_file(
    path: Path, found: Path, how: str, size: int | None, sha256: str | None, what: str, again: str
) -> str:
    """``found``'s sha256, checked against the planned size and sha256 (a split model's: all its
    shards', ``catalog.model_sha256``).

    Raises:
        PlanError: the file is not the one the plan was made for (names how it was found).
        GGUFError: a shard of a split model is missing.
    """
    paths = split_paths(found)
    got = sum(p.stat().st_size for p in paths)
    if size is not None and got != size:
        raise PlanError(
            f"{path}: {what} {found} (found by {how}) is {got} bytes but the plan was made for "
            f"{size} bytes: not the planned file; {again}"
        )
    digest = model_sha256(paths)  # remembered in the cache: hashed once per file version
    if sha256 is not None and digest != sha256:
        raise PlanError(
            f"{path}: {what} {found} (found by {how}) has sha256 {digest[:12]}… but the plan was "
            f"made for {sha256[:12]}…: the model's bytes changed; {again}"
        )
    return digest


def _draft_model_path(path: Path, ref: DraftModelRef) -> Path:
    """The plan's draft model file, found as the target is and checked against its size,
    sha256 and header sha256.

    Raises:
        PlanError: the file changed since planning.
        StrataError: it is nowhere on this machine.
    """
    again = "re-run strata plan with --speculative draft_model --draft-model MODEL"
    draft, how = locate_model(name=ref.name, path=ref.path, sha256=ref.sha256, base=path.parent)
    _checked_file(path, draft, how, ref.size_bytes, ref.sha256, "draft model", again)
    if open_gguf(draft).header_sha256 != ref.header_sha256:
        raise PlanError(f"{path}: draft model header changed since planning; {again}")
    return draft


def _routing_profile(path: Path, plan: Plan) -> RoutingProfile | None:
    """The plan's routing profile, found by its path hint or in the cache by sha256 (None when
    it was planned without one, or, with a one-line warning, when neither has it: the executor
    then learns the routing from the first tokens, as without a profile).

    Raises:
        PlanError: the file found is not the planned routing profile.
    """
    ref = plan.provenance.routing_profile
    if ref is None:
        return None
    for where in [Path(ref.path).expanduser()] if ref.path else []:
        if where.is_file():
            doc = read_yaml(where, RoutingProfile)
            if canonical_sha256(doc) == ref.sha256:
                return doc
    kept = routing_cache_path(ref.sha256)
    if kept.is_file():
        doc = read_yaml(kept, RoutingProfile)
        if canonical_sha256(doc) == ref.sha256:
            return doc
    print(
        f"warning: {path}: its routing profile (sha256 {ref.sha256[:12]}…) is neither at "
        f"{ref.path} nor in the cache; the expert cache learns the routing from the first tokens",
        file=sys.stderr,
    )
    return None


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


def _check_costs(path: Path, plan: Plan, desc: ModelDescription) -> None:
    """The plan's ``costs`` describe this model as this Strata reads it (bytes, role, layer,
    expert of every unit; access and FLOPs per token may differ: a routing profile's measured
    frequencies scale them): ``check`` and the views size the plan from them.

    Raises:
        PlanError: a unit whose costs differ (an edited costs section, or a plan made by a
            Strata that repacks the model differently).
    """
    where = "costs.architecture and costs.kv_elements_per_token"
    # Compared as written: a plan's floats are rounded to 6 significant digits (yamlio).
    if (canonical_sha256(plan.costs.architecture), plan.costs.kv_elements_per_token) != (
        canonical_sha256(desc.architecture),
        desc.kv_elements_per_token,
    ):
        raise PlanError(
            f"{path}: {where} are not this model's: the costs section was edited, or another "
            "Strata version planned it; re-run strata plan"
        )
    real = {u.name: u for u in desc.units}
    listed = [c.name for c in plan.costs.units]
    if sorted(listed) != sorted(real):
        raise PlanError(
            f"{path}: costs.units does not list each of the model's units once; re-run strata plan"
        )
    for c in plan.costs.units:
        u = real.get(c.name)
        if u is None:
            raise PlanError(
                f"{path}: costs.units lists {c.name}, which the model does not have; "
                "re-run strata plan"
            )
        mine = (c.bytes, c.role, c.layer, c.expert)
        theirs = (u.bytes_mlx, u.role, u.layer, u.expert)
        if mine != theirs:
            raise PlanError(
                f"{path}: costs of unit {c.name} (bytes, role, layer, expert) are "
                f"{mine}, but this model reads as {theirs}: the costs section was edited, or "
                "another Strata version planned it; re-run strata plan"
            )


def check_executable(path: Path, plan: Plan) -> None:
    """Refuse a plan of a model described from an architecture file (no weights to run), or of
    an architecture the executor does not run (``strata.common.tensors.executor_rule``: the
    hybrids Strata plans but cannot execute yet), before its model file is found or hashed.

    Raises:
        PlanError: ``plan.model`` names no file (``strata plan --arch``); the architecture is
            not one the executor runs (names it, what is missing and what works).
    """
    src = plan.model
    if src.sha256 is None and src.path is None:
        raise PlanError(
            f"{path}: the plan is for a model described from an architecture file (--arch): it "
            "has no weights and can only be compared, not executed; plan a GGUF file"
        )
    try:
        executor_rule(plan.costs.architecture)
    except StrataError as e:
        raise PlanError(f"{path}: {e}") from None


def _find(path: Path, model: str | Path | None) -> tuple[Plan, Path, str]:
    """The plan at ``path``, its model file and how it was found (``catalog.locate_model``)."""
    plan = read_yaml(path, Plan)
    check_executable(path, plan)
    src = plan.model
    found, how = locate_model(
        name=src.name, path=src.path, sha256=src.sha256, given=model, base=path.parent
    )
    return plan, found, how


@dataclass
class PeekedPlan:
    """A plan with its model file found and its header opened, the bytes not yet hashed."""

    plan: Plan
    model_path: Path
    how: str
    """How the model file was found (``catalog.locate_model``), for messages."""
    gguf: GGUFFile


def peek_plan(path: str | Path, model: str | Path | None = None) -> PeekedPlan:
    """The plan and its model's header, found as ``load_plan`` finds them but without hashing
    the file (minutes for a large model the cache has not hashed yet): what a command checks its
    inputs against (tokenizer, context) before ``load_plan`` verifies the bytes.

    Raises:
        SchemaError, PlanError, StrataError, GGUFError: as ``load_plan``; a header that is not
            the planned one.
    """
    plan, found, how = _find(Path(path), model)
    g = open_gguf(found)
    want = plan.model.header_sha256
    if want and g.header_sha256 != want:
        raise PlanError(
            f"{path}: model file {found} (found by {how}) has another header than the planned "
            "model: not the planned file; pass --model PATH to it, or re-run strata plan"
        )
    return PeekedPlan(plan, found, how, g)


def load_plan(
    path: str | Path, model: str | Path | None = None, peeked: PeekedPlan | None = None
) -> LoadedPlan:
    """Read a plan, find its model (``model``, i.e. ``--model PATH``, first) and check that the
    file is the planned one, open it (``peeked``: the same plan already found and opened by
    ``peek_plan``, not read again).

    Raises:
        SchemaError: not a plan, a typo, or an unknown major format version.
        PlanError: no model file, or one whose bytes are not the planned ones; the request
            section was edited; units do not match.
        StrataError: the model is nowhere on this machine (the message lists where it looked).
        GGUFError: the model file is malformed.
    """
    path = Path(path)
    peeked = peeked or peek_plan(path, model)
    plan, model_path, how, g = peeked.plan, peeked.model_path, peeked.how, peeked.gguf
    src = plan.model
    again = "pass --model PATH to the planned file, or re-run strata plan for this one"
    digest = _checked_file(path, model_path, how, src.size_bytes, src.sha256, "model file", again)
    want = plan.provenance.request_sha256
    if want is not None and canonical_sha256(plan.request) != want:
        # The placement, KV cache and batch limits were solved for the request as it was: a
        # hand-raised context would size a KV cache the budgets never allowed for.
        raise PlanError(
            f"{path}: its request section (context, concurrency, objective, budgets, prompt "
            "lengths) is not the request it was planned for: edited after planning, so its "
            "placement and KV cache no longer follow from it; re-run strata plan"
        )
    draft_ref = plan.speculative.draft_model
    draft_path = _draft_model_path(path, draft_ref) if draft_ref is not None else None
    resolved = ResolvedModel(g.path, None, g.size_bytes, digest)
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
    _check_costs(path, plan, desc)
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
