"""Measured MoE routing in the model description: ``strata plan --routing-profile FILE``.

Without a profile every expert of a block is read by a decoded token with probability ``k / n``
(uniform top-k of n). ``strata run --save-routing-profile FILE`` records how often each
expert was chosen, and which experts followed which in the next block; ``apply_routing_profile``
puts the measured frequencies into the description's expert units, so the planner pins the
experts that are actually hot, and the measured recall of the successor prediction becomes the
cost model's prefetch ``alpha`` (``planner.costmodel``).

Frequencies are smoothed toward uniform by one token (Laplace): ``p_e = (c_e + k/n) / (T + 1)``
for an expert chosen ``c_e`` times in ``T`` tokens, so an expert never seen keeps a small
probability and each block's probabilities still add up to ``k``.
"""

from __future__ import annotations

from pathlib import Path

from strata.common.errors import PlanError
from strata.common.schemas import ModelDescription, RoutingProfile, RoutingSummary
from strata.common.yamlio import canonical_sha256, read_yaml


def read_routing_profile(path: str | Path) -> RoutingProfile:
    """Read and validate a routing profile (JSON, as ``execute.py`` writes it).

    Raises:
        SchemaError: missing file, invalid JSON, or a document that is not a routing profile.
    """
    return read_yaml(path, RoutingProfile)


def apply_routing_profile(desc: ModelDescription, doc: RoutingProfile) -> ModelDescription:
    """A copy of ``desc`` whose expert units carry the measured access frequencies.

    Args:
        desc: the model's description (uniform expert access).
        doc: a routing profile measured on the same model.

    Returns:
        The description with ``access_per_token`` and ``flops_per_token`` of every expert unit
        from the profile and ``routing`` summarizing it.

    Raises:
        PlanError: a dense model, a profile of another model (header hash, block or expert
            count), or a profile with no tokens.
    """
    a = desc.architecture
    if not a.expert_count:
        raise PlanError("--routing-profile is for mixture-of-experts models; this one is dense")
    if doc.header_sha256 != desc.model.header_sha256:
        raise PlanError(
            "the routing profile was measured on another model (its header sha256 "
            f"{doc.header_sha256[:12]} is not this model's {desc.model.header_sha256[:12]}); "
            "measure it with strata run --save-routing-profile on a plan of this model"
        )
    if (doc.layers, doc.expert_count) != (a.block_count, a.expert_count):
        raise PlanError(
            f"the routing profile has {doc.layers} blocks of {doc.expert_count} experts; the "
            f"model has {a.block_count} of {a.expert_count}"
        )
    shapes_ok = len(doc.tokens) == doc.layers and len(doc.counts) == doc.layers
    if not shapes_ok or any(len(row) != doc.expert_count for row in doc.counts):
        raise PlanError("the routing profile's counts do not match its block and expert counts")
    # Leading dense blocks (leading_dense_block_count) route nothing: their rows stay zero.
    moe_layers = range(a.leading_dense_block_count, doc.layers)
    if not moe_layers or min(doc.tokens[i] for i in moe_layers) <= 0:
        raise PlanError("the routing profile has no routed tokens; measure a longer run")
    k, n = a.expert_used_count, a.expert_count
    units = []
    for u in desc.units:
        if u.expert is None or u.layer is None:
            units.append(u)
            continue
        p = (doc.counts[u.layer][u.expert] + k / n) / (doc.tokens[u.layer] + 1)
        p = min(1.0, p)
        flops = u.flops_per_token / u.access_per_token * p if u.access_per_token else 0
        units.append(u.model_copy(update={"access_per_token": p, "flops_per_token": int(flops)}))
    recall = doc.predicted_hits / doc.predicted if doc.predicted else min(1.0, k / n)
    summary = RoutingSummary(
        sha256=canonical_sha256(doc),
        tokens=min(doc.tokens[i] for i in moe_layers),
        prediction_recall=recall,
    )
    return desc.model_copy(update={"units": units, "routing": summary})
