"""Making a plan: describe the model, read the profile, solve the ILP, embed its inputs, and
choose speculative decoding for the placement (``planner.speculative``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from strata.common.catalog import routing_cache_path
from strata.common.describe import describe
from strata.common.errors import PlanError
from strata.common.schemas import (
    HardwareProfile,
    ModelDescription,
    Plan,
    Provenance,
    Request,
    RoutingRef,
)
from strata.common.sizes import format_size
from strata.common.tensors import arch_rule
from strata.common.yamlio import canonical_sha256, read_yaml
from strata.planner.baseline import baseline_plan
from strata.planner.costmodel import PinnedPlacement, tier_memory
from strata.planner.ilp import solve, solver_description
from strata.planner.rescore import decisions_sha256
from strata.planner.routing import apply_routing_profile, read_routing_profile
from strata.planner.speculative import (
    SpeculativeRequest,
    load_draft_model,
    plan_speculative,
    target_request,
)

from strata import __version__


def prepare_description(
    model: str | None,
    request: Request,
    *,
    desc: ModelDescription | None = None,
    routing_profile: Path | None = None,
) -> tuple[ModelDescription, RoutingRef | None]:
    """The description a plan is solved with, and its routing profile's reference: ``model``
    described (or ``desc`` as given), checked to be an architecture Strata plans (a note where
    the executor cannot run it yet), the routing profile applied and kept in the cache, the
    model's path made absolute (a hint from any folder). ``build_plan`` and
    ``planner.cluster.build_cluster_plan`` share it.

    Raises:
        StrataError: a bad model, an architecture Strata does not describe, a bad routing profile.
    """
    if desc is None:
        if model is None:
            raise ValueError("build_plan needs a model spec or a description")
        desc, _ = describe(model)
    # The executor runs only the architectures of strata.common.tensors: refuse others here,
    # not after a plan (and a packed store) was made for them. Those it describes but does not
    # run yet (ArchRule.not_executed: the hybrids) are planned, with a note that says so.
    rule = arch_rule(desc.architecture)
    if rule.not_executed:
        print(
            f"note: {desc.architecture.name} is planned but strata run cannot execute it yet: "
            f"{rule.not_executed}",
            file=sys.stderr,
        )
    if routing_profile is not None:
        desc = apply_routing_profile(desc, read_routing_profile(routing_profile))
    if request.context > desc.architecture.context_length:
        print(
            f"warning: --context {request.context} exceeds the model's training context "
            f"{desc.architecture.context_length}",
            file=sys.stderr,
        )
    routing = None
    if desc.routing is not None and routing_profile is not None:
        kept = routing_cache_path(desc.routing.sha256)
        if not kept.is_file():
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(routing_profile, kept)
        routing = RoutingRef(sha256=desc.routing.sha256, path=str(routing_profile.resolve()))
    if desc.model.path is not None:  # the path as given: keep it absolute, a hint from anywhere
        # Absolute without following links: a split model's shards are found by their names,
        # which a link (the Hugging Face cache's snapshots) keeps and its target does not.
        hint = str(Path(desc.model.path).absolute())
        desc = desc.model_copy(update={"model": desc.model.model_copy(update={"path": hint})})
    return desc, routing


def build_plan(
    model: str | None,
    profile_path: Path,
    request: Request,
    *,
    desc: ModelDescription | None = None,
    routing_profile: Path | None = None,
    speculative: SpeculativeRequest | None = None,
    baseline: bool = False,
    time_limit_s: float = 30,
) -> Plan:
    """Solve the placement ILP and return the plan: self-contained, runnable from any folder.

    The model is ``model`` (catalog name or GGUF path, described here) or, when given, the
    already-built description ``desc`` (e.g. from ``strata plan --arch``; ``model`` is then
    ignored). ``routing_profile`` (a file of ``strata run --save-routing-profile``)
    replaces uniform expert access with the measured one (``planner.routing``).

    ``speculative`` (default: none) chooses the drafter's K for the placement. A draft model is
    planned together with the target: its weights, KV cache and extra activations come off the
    gpu budget (and the RAM budget on unified memory) before the target is placed; the plan keeps
    the request as given and its memory section the full capacities, with the draft's bytes in
    ``speculative.draft_model``.

    ``baseline`` writes the rule's plan instead of the ILP's (``planner.baseline``: the first
    blocks resident in order), for comparison; it takes no speculative decoding.

    ``time_limit_s`` bounds the wall clock of the ILP's solves (``planner.ilp.solve``); the
    search itself is bounded by node counts, so a solve that ends within it gives the same plan
    on any machine. ``scripts/make_plans.py`` raises it for the anchor plans of tens of
    thousands of experts, which a busy machine may not solve in the default 30 s.

    The plan embeds the profile's figures (not its path), the model's identity with its absolute
    path as a hint, and the model's cost inputs, so it needs nothing beside the model to be
    judged or run. A routing profile is copied into the cache under its sha256, where the
    executor finds it on this machine wherever the file goes. Solve time goes to stderr only: the
    same inputs give a byte-identical plan.

    Raises:
        StrataError: bad model or profile, an architecture the executor cannot run (names the
            supported ones), infeasible request (names the short tier), a solve
            that is not optimal; a draft model that does not fit or has another vocabulary,
            self-drafting with a streamed head (``planner.speculative``).
    """
    spec = speculative or SpeculativeRequest()
    profile = read_yaml(profile_path, HardwareProfile)
    desc, routing = prepare_description(model, request, desc=desc, routing_profile=routing_profile)
    provenance = Provenance(
        planner_version=__version__,
        solver=solver_description(time_limit_s),
        profile_file=profile_path.name,
        routing_profile=routing,
        request_sha256=canonical_sha256(request),
    )
    if baseline:
        if spec.method != "none":
            raise PlanError("--baseline plans take no --speculative; drop one of them")
        return baseline_plan(desc, profile, request, provenance)
    draft = None
    placed_request = request
    if spec.method == "draft_model":
        assert spec.draft_model is not None  # SpeculativeRequest checks it
        draft = load_draft_model(spec.draft_model, desc, profile, request)
        placed_request = target_request(draft, profile, request)
        print(f"reserved {format_size(draft.reserve)} for the {draft.label()}", file=sys.stderr)
    try:
        sol = solve(desc, profile, placed_request, time_limit_s=time_limit_s)
    except PlanError as e:
        if draft is None:
            raise
        raise PlanError(
            f"{e} (capacities after the {draft.label()}; a smaller draft model also helps)"
        ) from None
    print(f"solved in {sol.solve_time_s:.3f} s ({sol.solver.name})", file=sys.stderr)
    plan = sol.to_plan(desc, profile, request, provenance)
    if draft is not None:
        # The memory section shows the tiers' full capacities; the draft's bytes are listed in
        # the speculative section (explain adds them to the gpu total).
        plan.memory = tier_memory(  # type: ignore[assignment]
            desc, profile, request, PinnedPlacement.of(plan)
        )
    plan.speculative = plan_speculative(plan, desc, profile, spec, draft=draft)
    plan.provenance.decisions_sha256 = decisions_sha256(plan)
    sp = plan.speculative
    base = plan.prediction.decode_tok_s if plan.prediction else 0.0
    if sp.method != "none" and (sp.predicted_decode_tok_s or 0.0) < base:
        print(
            f"warning: --speculative {sp.method} is predicted slower than plain decoding "
            f"({sp.predicted_decode_tok_s:.3g} vs {base:.3g} tok/s at its best K = "
            f"{sp.num_draft_tokens}); consider --speculative none",
            file=sys.stderr,
        )
    return plan
