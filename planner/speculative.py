"""Speculative decoding in the plan: the drafter, K draft tokens per step, and what they buy.

Each decode step verifies, per sequence, the pending token plus up to K draft tokens in one batched
forward pass and keeps the accepted prefix plus one token (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023): the output distribution is the
target's exactly, and the plan only decides how fast it comes. With an i.i.d. acceptance rate
``a``, one step yields ``E(K, a) = (1 - a^(K+1)) / (1 - a)`` tokens per sequence (Leviathan et al.
2023, eq. 1; ``K + 1`` at ``a = 1``).

Step time, from the cost model's own functions (``planner.costmodel``), at the plan's batch B:

- verification: ``costmodel.score`` of the plan's placement, pool and expert cache at a batch of
  ``B (K + 1)`` tokens: every unit is read once per pass (streamed bytes too), while the per-token
  terms (the roofline's ``B f / bt_flops``, expert access ``1 - (1 - a_u)^(B (K + 1))``) grow with
  the tokens. At ``K = 0`` this is exactly ``plan.prediction.step_s``.
- K draft passes of B tokens each, after one another on the compute thread:
  prompt lookup: 0 (an n-gram search over the sequence on the host; Saxena 2023, vLLM "ngram");
  draft model: ``costmodel.score`` of the draft model with every unit on the gpu tier;
  self: the ``costmodel.unit_costs`` terms (compute, and host copy for ram units) of the units the
  self-drafter runs: the first ``draft_layers`` blocks' units that are not on nvme (layer skip,
  Draft & Verify, Zhang et al. 2023), the embedding and the output head (early exit, LayerSkip).
- ``step = verify + K draft``; tokens/s ``= B E / step``. K (1..8, or ``--num-draft-tokens``)
  maximises it (ties to the smaller K). The verification pass costs little more than a plain step
  while it is bound by reads (weights from disk, host copies, device memory) and grows once its
  tokens' FLOPs bind, so a plan that streams more takes a larger K; ``E / step`` has increasing
  differences in (K, a), so the chosen K never falls as ``a`` rises (Topkis).

Not modelled: the I/O threads reading the next pass's first streamed units during the draft passes
(at most ``depth`` units: conservative), the draft model's catch-up pass carrying the accepted
tokens (about E tokens per sequence instead of one: small next to its weight reads), the
KV-cache reads of the longer chunk, and sequences whose drafter proposes fewer than K tokens.

Acceptance rates, until the bench measures them (``--acceptance-rate``, source ``measured``):
``ASSUMED_ACCEPTANCE`` and ``SELF_ACCEPTANCE_FULL`` below, each with its reason.

Memory: prompt lookup and the self-drafter hold nothing (the self-drafter writes into the target's
KV-cache slots, which verification overwrites). A verification pass's activations (``B (K + 1)``
tokens, each with a float32 vocabulary row of logits, since every position is verified) may
exceed the plan's activation reserve (sized for a prefill chunk with one logits row per
sequence); the excess (``Speculative.activation_bytes``) must fit in the device memory the
placement leaves free, which caps K. A draft model is planned together with the target: its
weights, all on the gpu tier, its paged KV cache at the target's batch limits, and whatever its
activations need beyond the target's (the two never run at once) come off the gpu budget (and, on
unified memory, the RAM budget) before the target is placed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from strata.common.catalog import CATALOG, resolve_model
from strata.common.errors import PlanError, StrataError
from strata.common.gguf_file import open_gguf
from strata.common.schemas import (
    DraftModelRef,
    HardwareProfile,
    ModelDescription,
    Plan,
    Request,
    Speculative,
)
from strata.common.sizes import format_size
from strata.common.tensors import executor_rule
from strata.planner.costmodel import (
    PinnedPlacement,
    activation_bytes,
    batch_size,
    capacities,
    capacity_use,
    host_overlaps,
    kv_cache_bytes,
    score,
    step_compute_s,
    unit_costs,
)

METHODS: tuple[str, ...] = ("none", "prompt_lookup", "draft_model", "self")

K_CHOICES = range(1, 9)
"""Draft tokens the cost model chooses among: beyond 8 even ``a = 0.9`` adds under 0.4 tokens
per step (``a^9``), while every draft token lengthens the verification pass."""

K_LIMIT = 16
"""Most draft tokens ``--num-draft-tokens`` may ask for (``Speculative.num_draft_tokens``)."""

ASSUMED_ACCEPTANCE: dict[str, tuple[float, str]] = {
    "prompt_lookup": (
        0.5,
        "assumed 0.5 for prompt lookup: how many n-gram drafts are accepted depends on how much "
        "of the output repeats the prompt (most for summarization, retrieval QA and code "
        "editing, least for open chat; Saxena 2023), so a middle figure until strata bench "
        "measures it",
    ),
    "draft_model": (
        0.6,
        "assumed 0.6 for a draft model of the same vocabulary: Leviathan et al. 2023 (table 3) "
        "measured 0.5-0.9 for drafts 10-100x smaller than their targets; the low end of that, "
        "until strata bench measures it",
    ),
}
"""Method -> (assumed acceptance rate, the reason stated in the plan)."""

SELF_ACCEPTANCE_FULL = 0.8
"""The self-drafter's assumed acceptance is ``0.8 f``, ``f`` the share of the target's ``2 N``
sublayers (attention, feed-forward) it runs. Draft & Verify (Zhang et al. 2023) measured about
0.8-0.9 when skipping about half of LLaMA-2's layers chosen by a search; this drafter's layers are
chosen by what is in memory and the model was not trained to exit early (which LayerSkip shows
matters), so the figure is scaled down linearly with what it skips: 0.4 for half the sublayers
(every FFN streamed), 0.8 for all of them (never worth it: such drafts cost a whole step)."""


def expected_tokens(k: int, a: float) -> float:
    """Tokens one verification step yields per sequence: ``E = (1 - a^(K+1)) / (1 - a)``.

    Leviathan et al. 2023, eq. 1: draft j is accepted with probability ``a^j`` (i.i.d.
    acceptance), and the step always adds one token of its own (the correction or the bonus).

    Args:
        k: draft tokens K (>= 0).
        a: acceptance rate in [0, 1].

    Returns:
        E in [1, K + 1] (``K + 1`` at ``a = 1``).
    """
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class SpeculativeRequest:
    """What ``strata plan --speculative ...`` asked for (not stored: the plan records the result).

    Attributes:
        method: ``none``, ``prompt_lookup``, ``draft_model`` or ``self``.
        draft_model: catalog name or GGUF path of the draft model (method draft_model only).
        num_draft_tokens: K given by the user (1..16), or None for the cost model's choice (1..8).
        acceptance_rate: a measured acceptance rate in [0, 1], or None for the assumed one.
    """

    method: str = "none"
    draft_model: str | None = None
    num_draft_tokens: int | None = None
    acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise StrataError(
                f"unknown --speculative {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise StrataError(
                "--speculative draft_model needs --draft-model MODEL, and --draft-model goes with "
                "--speculative draft_model"
            )
        if self.method == "none" and (
            self.num_draft_tokens is not None or self.acceptance_rate is not None
        ):
            raise StrataError(
                "--num-draft-tokens and --acceptance-rate go with --speculative "
                "prompt_lookup, draft_model or self"
            )
        k = self.num_draft_tokens
        if k is not None and not 1 <= k <= K_LIMIT:
            raise StrataError(f"--num-draft-tokens {k} is outside 1..{K_LIMIT}; give 1..{K_LIMIT}")
        a = self.acceptance_rate
        if a is not None and not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise StrataError(f"--acceptance-rate {a} is outside 0..1; give a fraction, e.g. 0.62")


# --------------------------------------------------------------------------- pass times


def _batch_request(request: Request, tokens: int) -> Request:
    """The plan's request with ``tokens`` tokens decoded per forward pass (``batch_size`` of the
    result is ``tokens``), budgets and tiers unchanged."""
    return Request(**{**request.model_dump(), "concurrency": tokens, "objective": "throughput"})


def verify_seconds(desc: ModelDescription, profile: HardwareProfile, plan: Plan, k: int) -> float:
    """Seconds of one verification pass: B sequences of ``k + 1`` tokens through the placement.

    ``costmodel.score`` of the plan's tiers, depth, pool and expert cache at a batch of
    ``B (k + 1)`` tokens (module docstring); ``k = 0`` gives the plan's plain decode step.

    Raises:
        PlanError: the placement does not match ``desc``; a zero rate in the profile.
    """
    b = batch_size(plan.request, plan.batch)
    req = _batch_request(plan.request, b * (k + 1))
    # Not the plan's batch limits: their max_num_seqs would cap the pass's B (k + 1) tokens.
    verified = replace(PinnedPlacement.of(plan), batch=None)
    return score(desc, profile, req, verified).step_s


def draft_model_seconds(
    draft: ModelDescription, profile: HardwareProfile, request: Request, b: int
) -> float:
    """Seconds of one draft-model pass of ``b`` tokens (one per sequence), every unit on gpu."""
    tiers = {u.name: "gpu" for u in draft.units}
    return score(draft, profile, _batch_request(request, b), PinnedPlacement(tiers, 0)).step_s


def self_units(
    desc: ModelDescription, tiers: Mapping[str, str], layers: int
) -> tuple[list[str], list[str]]:
    """The units the self-drafter runs and those it skips, in description order.

    It runs every unit outside the blocks (embedding, output head) and the units of blocks
    ``0..layers-1`` that are not on nvme; it skips those blocks' nvme units (their residual
    passes through). Later blocks are neither run nor listed.

    Returns:
        (run, skipped): unit names.
    """
    run: list[str] = []
    skipped: list[str] = []
    for u in desc.units:
        if u.layer is None:
            run.append(u.name)
        elif u.layer < layers:
            (skipped if tiers[u.name] == "nvme" else run).append(u.name)
    return run, skipped


def check_self_head(desc: ModelDescription, tiers: Mapping[str, str]) -> None:
    """Refuse self-drafting when a unit outside the blocks (the embedding, the output head) is
    streamed: every draft token would read it from disk.

    Raises:
        PlanError: naming the streamed unit and the fix.
    """
    streamed = [u.name for u in desc.units if u.layer is None and tiers[u.name] == "nvme"]
    if streamed:
        them = "them" if len(streamed) > 1 else "it"
        raise PlanError(
            f"--speculative self needs the embedding and the output head in memory, but the plan "
            f"streams {', '.join(streamed)} from NVMe (every draft token would read {them} from "
            "disk); raise --gpu-budget/--ram-budget so that they stay, or use --speculative "
            "prompt_lookup"
        )


def self_fraction(desc: ModelDescription, tiers: Mapping[str, str], layers: int) -> float:
    """``f``: the share of the target's ``2 N`` sublayers the self-drafter runs.

    A block has an attention sublayer (unit ``blk.i.attn``) and a feed-forward one (``blk.i.ffn``
    and, in MoE blocks, its experts ``blk.i.expert.e``); a sublayer counts by the share of its
    units' per-token reads (``access_per_token x bytes``) that the drafter runs, so a dense
    sublayer counts 1 or 0 and an MoE one the share of its experts' expected reads kept.
    """
    n = desc.architecture.block_count
    total: dict[tuple[int, str], float] = {}
    kept: dict[tuple[int, str], float] = {}
    for u in desc.units:
        if u.layer is None:
            continue
        key = (u.layer, "attn" if u.name.endswith(".attn") else "ffn")
        w = u.access_per_token * u.bytes_mlx
        total[key] = total.get(key, 0.0) + w
        if u.layer < layers and tiers[u.name] != "nvme":
            kept[key] = kept.get(key, 0.0) + w
    share = sum(kept.get(key, 0.0) / w for key, w in total.items() if w > 0)
    return share / (2 * n)


def self_draft_seconds(
    desc: ModelDescription, profile: HardwareProfile, plan: Plan, layers: int
) -> float:
    """Seconds of one self-drafter pass of B tokens: the ``costmodel.unit_costs`` compute and host
    copy terms of ``self_units``' run list (nothing is read from disk)."""
    b = batch_size(plan.request, plan.batch)
    costs = {c.name: c for c in unit_costs(desc, profile, _batch_request(plan.request, b))}
    tiers = plan.tier_of()
    run, _ = self_units(desc, tiers, layers)
    unified = profile.unified_memory
    compute = step_compute_s([costs[u] for u in run], host_overlaps(desc, profile))
    return compute + sum(costs[u].host_copy_s(tiers[u], unified) for u in run)


def self_layer_choices(desc: ModelDescription, tiers: Mapping[str, str]) -> list[int]:
    """``draft_layers`` candidates. When some block unit streams: only the largest L worth
    running, one past the last block with a unit not on nvme (the drafter skips the streamed
    units; a block entirely on nvme adds nothing). When every block unit is in memory: 1..N, for
    the cost model to choose (fewer layers: cheaper drafts, a lower assumed acceptance)."""
    blocks = [u for u in desc.units if u.layer is not None]
    if any(tiers[u.name] == "nvme" for u in blocks):
        kept = [u.layer for u in blocks if tiers[u.name] != "nvme" and u.layer is not None]
        if not kept:
            raise PlanError(
                "--speculative self has nothing to run: every block unit streams from NVMe; "
                "raise --gpu-budget/--ram-budget or use --speculative prompt_lookup"
            )
        return [max(kept) + 1]
    return list(range(1, desc.architecture.block_count + 1))


# --------------------------------------------------------------------------- draft model


@dataclass(frozen=True)
class DraftModel:
    """A described draft model and its device footprint at the target's batch limits (bytes).

    Attributes:
        spec: what the user gave (catalog name or path).
        path: the GGUF file.
        desc: its description.
        weights: its weights in MLX form (all on gpu).
        kv_cache: its paged KV cache, the target's blocks x block size.
        activations: what its largest pass needs beyond the target's activation reserve.
    """

    spec: str
    path: Path
    desc: ModelDescription
    weights: int
    kv_cache: int
    activations: int

    @property
    def reserve(self) -> int:
        """Bytes taken off the gpu budget before the target is placed."""
        return self.weights + self.kv_cache + self.activations

    def label(self) -> str:
        """``NAME (weights W + KV cache K[ + activations A] = T)`` for messages."""
        act = f" + activations {format_size(self.activations)}" if self.activations else ""
        return (
            f"draft model {self.spec} (weights {format_size(self.weights)} + KV cache "
            f"{format_size(self.kv_cache)}{act} = {format_size(self.reserve)})"
        )

    def ref(self) -> DraftModelRef:
        """The plan's reference to this draft model: its identity, and its absolute path as a
        hint (None for a catalog model)."""
        src = self.desc.model
        path = None if src.name is not None else str(self.path.resolve())
        return DraftModelRef(
            name=src.name,
            path=path,
            size_bytes=src.size_bytes or 0,
            sha256=src.sha256 or "",
            header_sha256=src.header_sha256,
            bytes_mlx=self.weights,
            kv_cache_bytes=self.kv_cache,
            activation_bytes=self.activations,
        )


def _model_file(desc: ModelDescription) -> Path | None:
    """The GGUF a description was made from (None for an ``--arch`` description)."""
    src = desc.model
    if src.name and src.name in CATALOG:
        return resolve_model(src.name).path
    if src.path and src.sha256 and Path(src.path).expanduser().is_file():
        return Path(src.path).expanduser()
    return None


def _tokens(path: Path) -> list | None:
    """The GGUF's token list (``tokenizer.ggml.tokens``), None when it has none."""
    st = path.stat()
    return _tokens_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tokens_of(path: str, size: int, mtime_ns: int) -> list | None:
    # Opening a GGUF parses its whole tokenizer (seconds for a 49k-token BPE): once per file.
    return _token_list(open_gguf(path))


def _token_list(g) -> list | None:
    """``tokenizer.ggml.tokens`` of an open GGUF when it is an array (None otherwise: no list
    to compare, the sizes alone are checked).

    Raises:
        GGUFError: a token that is not UTF-8.
    """
    tokens = g.field("tokenizer.ggml.tokens")
    return tokens if isinstance(tokens, list) else None


def _check_vocabulary(
    spec: str, draft: ModelDescription, mine: list | None, target: ModelDescription
) -> None:
    """Refuse a draft model whose vocabulary differs from the target's (its token ids would
    mean other text). Sizes always; token lists when the target's GGUF is at hand."""
    fix = (
        "a draft model must share the target's tokenizer: choose a smaller model of the same "
        "family, or cut the target's first blocks (scripts/cut_gguf.py TARGET --blocks K -o FILE)"
    )
    nd, nt = draft.architecture.vocab_size, target.architecture.vocab_size
    name = target.model.name or target.model.path or "the target"
    if nd != nt:
        raise PlanError(
            f"draft model {spec} has a vocabulary of {nd} tokens but {name} has {nt}; {fix}"
        )
    target_file = _model_file(target)
    if target_file is None:
        return  # an --arch target: its token list is not known, the sizes agree
    theirs = _tokens(target_file)
    if mine is None or theirs is None or mine == theirs:
        return
    first = next(
        (i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
        min(len(mine), len(theirs)),
    )
    raise PlanError(
        f"draft model {spec} has another vocabulary than {name} (token {first} is "
        f"{_tok(mine, first)} there and {_tok(theirs, first)} in the target); {fix}"
    )


def _tok(tokens: list, i: int) -> str:
    return repr(tokens[i]) if i < len(tokens) else "absent"


def load_draft_model(
    spec: str, target: ModelDescription, profile: HardwareProfile, request: Request
) -> DraftModel:
    """Describe the draft model ``spec``, check its vocabulary, size its device footprint.

    Args:
        spec: catalog name or GGUF path.
        target: the target's description (its vocabulary, activation reserve).
        profile: the machine (compute dtype of the KV cache and activations).
        request: the target's request (its batch limits size the draft's KV cache).

    Raises:
        StrataError: unknown model or malformed GGUF; an architecture the executor cannot run; a
            vocabulary other than the target's.
    """
    from strata.common.describe import describe
    from strata.planner.costmodel import batch_limits

    desc, g = describe(spec)
    executor_rule(desc.architecture)  # the draft model runs on the executor too
    _check_vocabulary(spec, desc, _token_list(g), target)
    batch = batch_limits(request)
    return DraftModel(
        spec=spec,
        path=Path(g.path),
        desc=desc,
        weights=sum(u.bytes_mlx for u in desc.units),
        kv_cache=kv_cache_bytes(desc, profile, batch),
        activations=max(
            0, activation_bytes(desc, profile, batch) - activation_bytes(target, profile, batch)
        ),
    )


def target_request(draft: DraftModel, profile: HardwareProfile, request: Request) -> Request:
    """The request the target is placed under: the draft's bytes off the gpu budget (and off the
    RAM budget on unified memory, where both tiers are one memory).

    Raises:
        PlanError: the draft model alone does not fit (names the short memory and the fix).
    """
    cap = capacities(profile, request)
    rows = [("gpu", "gpu tier", "--gpu-budget")]
    if profile.unified_memory:
        rows.append(("ram", "unified memory", "--ram-budget"))
    for key, label, flag in rows:
        if draft.reserve > cap[key]:
            raise PlanError(
                f"{draft.label()} does not fit in the {label} ({format_size(cap[key])}) before "
                f"the target is placed; choose a smaller draft model, lower --context/"
                f"--concurrency (its KV cache) or raise {flag}"
            )
    update: dict[str, int | None] = {"gpu_budget_bytes": cap["gpu"] - draft.reserve}
    if profile.unified_memory:
        update["ram_budget_bytes"] = cap["ram"] - draft.reserve
    return Request(**{**request.model_dump(), **update})


# --------------------------------------------------------------------------- the choice


def extra_activations(desc: ModelDescription, profile: HardwareProfile, plan: Plan, k: int) -> int:
    """Bytes a verification pass of K draft tokens needs beyond the plan's activation reserve.

    ``costmodel.activation_bytes`` of a pass of ``B (K + 1)`` tokens that each keep a float32
    logits row (the sampler verifies every position), less the reserve of the plan's batch limits
    (its largest prefill chunk with one logits row per sequence); 0 when the reserve covers it.
    """
    t = batch_size(plan.request, plan.batch) * (k + 1)
    verify = plan.batch.model_copy(update={"max_num_seqs": t, "max_num_batched_tokens": t})
    reserve = activation_bytes(desc, profile, plan.batch)
    return max(0, activation_bytes(desc, profile, verify) - reserve)


def free_device_bytes(
    desc: ModelDescription, profile: HardwareProfile, plan: Plan, draft: DraftModel | None
) -> int:
    """Device bytes the plan leaves free: the least slack of the capacity rows that hold the
    device's contents (gpu; gpu + ram on unified memory), less the draft model's bytes."""
    use = capacity_use(desc, profile, plan.request, PinnedPlacement.of(plan))
    free = min(r.capacity - used for r, used in use if "gpu" in r.weight_tiers)
    return free - (draft.reserve if draft is not None else 0)


def k_limit(
    desc: ModelDescription, profile: HardwareProfile, plan: Plan, draft: DraftModel | None = None
) -> int:
    """The largest K (0..16) the plan's batch limits and memory allow.

    The step's token budget: ``B (K + 1) <= max_num_batched_tokens`` (the scheduler would cut the
    chunks anyway). Memory: ``extra_activations`` must fit in the device memory the plan leaves
    free (``free_device_bytes``).
    """
    b = batch_size(plan.request, plan.batch)
    free = free_device_bytes(desc, profile, plan, draft)
    best = 0
    for k in range(1, K_LIMIT + 1):
        if b * (k + 1) > plan.batch.max_num_batched_tokens:
            break
        if extra_activations(desc, profile, plan, k) > free:
            break
        best = k
    return best


@dataclass(frozen=True)
class _Choice:
    k: int
    layers: int
    a: float
    verify_s: float
    draft_s: float

    @property
    def e(self) -> float:
        return expected_tokens(self.k, self.a)

    @property
    def step_s(self) -> float:
        return self.verify_s + self.k * self.draft_s

    def rate(self, b: int) -> float:
        return b * self.e / self.step_s if self.step_s > 0 else 0.0


def _best(choices: list[_Choice], b: int) -> _Choice:
    # Highest tokens/s; ties (within 1e-12 relative) to the first, i.e. the smaller K.
    best = choices[0]
    for c in choices[1:]:
        if c.rate(b) > best.rate(b) * (1 + 1e-12):
            best = c
    return best


def plan_speculative(
    plan: Plan,
    desc: ModelDescription,
    profile: HardwareProfile,
    spec: SpeculativeRequest,
    *,
    draft: DraftModel | None = None,
) -> Speculative:
    """Choose K (and the self-drafter's ``draft_layers``) for a placed plan (module docstring).

    Args:
        plan: the target's plan (placement, pool, prefetch, expert cache, batch limits).
        desc: the target's description.
        profile: the machine.
        spec: the method and any user-given K or acceptance rate.
        draft: the draft model (method draft_model), as ``load_draft_model`` made it.

    Returns:
        The plan's speculative section: method, K, draft layers, draft model reference, the
        acceptance rate used and its source, the predicted tokens per step, pass times and
        tokens/s.

    Raises:
        PlanError: self with the embedding or output head streamed, or with every block
            streamed; a batch whose token budget or activation reserve leaves no room for one
            draft token; a given K above what they allow; a draft model missing for its method.
    """
    if spec.method == "none":
        return Speculative()
    tiers = plan.tier_of()
    b = batch_size(plan.request, plan.batch)
    limit = k_limit(desc, profile, plan, draft)
    if limit < 1:
        raise PlanError(
            f"no room for draft tokens: a verification pass of {b} sequences x 2 tokens exceeds "
            f"the step's token budget ({plan.batch.max_num_batched_tokens}) or the device memory "
            "left for its logits; lower --concurrency, raise --gpu-budget or plan without "
            "--speculative"
        )
    if spec.num_draft_tokens is not None:
        if spec.num_draft_tokens > limit:
            raise PlanError(
                f"--num-draft-tokens {spec.num_draft_tokens}: a verification pass of {b} x "
                f"{spec.num_draft_tokens + 1} tokens exceeds the step's token budget or the "
                f"device memory left for its logits (at most {limit} draft tokens fit); give "
                f"--num-draft-tokens {limit} or less"
            )
        ks = [spec.num_draft_tokens]
    else:
        ks = [k for k in K_CHOICES if k <= limit]
    verify = {k: verify_seconds(desc, profile, plan, k) for k in ks}

    ref = None
    if spec.method == "prompt_lookup":
        a, how = ASSUMED_ACCEPTANCE["prompt_lookup"]
        best = _best([_Choice(k, 0, a, verify[k], 0.0) for k in ks], b)
    elif spec.method == "draft_model":
        if draft is None:
            raise PlanError("--speculative draft_model needs --draft-model MODEL")
        a, how = ASSUMED_ACCEPTANCE["draft_model"]
        d = draft_model_seconds(draft.desc, profile, plan.request, b)
        best = _best([_Choice(k, 0, a, verify[k], d) for k in ks], b)
        ref = draft.ref()
    else:  # self
        check_self_head(desc, tiers)
        choices = []
        for layers in sorted(self_layer_choices(desc, tiers), reverse=True):  # ties: more layers
            a = SELF_ACCEPTANCE_FULL * self_fraction(desc, tiers, layers)
            d = self_draft_seconds(desc, profile, plan, layers)
            choices += [_Choice(k, layers, a, verify[k], d) for k in ks]
        best = _best(choices, b)
        f = self_fraction(desc, tiers, best.layers)
        n = desc.architecture.block_count
        _, skipped = self_units(desc, tiers, best.layers)
        how = (
            f"assumed {SELF_ACCEPTANCE_FULL:g} x f = {best.a:.3g} for the self-drafter, f = "
            f"{f:.3g} the share of the target's {2 * n} sublayers (attention, feed-forward) it "
            f"runs ({best.layers} of {n} blocks, {len(skipped)} streamed units skipped): "
            f"Draft & Verify (Zhang et al. 2023) measured about 0.8 when skipping half the "
            "layers, scaled down linearly with what is skipped, until strata bench "
            "measures it"
        )
    source = "assumed"
    if spec.acceptance_rate is not None:
        # A measured rate replaces the assumption; the self-drafter keeps the layers the assumed
        # curve chose (the rate was measured at them), and K is chosen again for it.
        a, source = spec.acceptance_rate, "measured"
        how = "given with --acceptance-rate (measured, e.g. by strata bench)"
        best = _best([_Choice(k, best.layers, a, verify[k], best.draft_s) for k in ks], b)
    return Speculative(
        method=spec.method,  # type: ignore[arg-type]
        num_draft_tokens=best.k,
        draft_layers=best.layers,
        draft_model=ref,
        activation_bytes=extra_activations(desc, profile, plan, best.k),
        acceptance_rate=best.a,
        acceptance_source=source,  # type: ignore[arg-type]
        acceptance_how=how,
        predicted_tokens_per_step=best.e,
        predicted_verify_s=best.verify_s,
        predicted_draft_s=best.k * best.draft_s,
        predicted_step_s=best.step_s,
        predicted_decode_tok_s=best.rate(b),
    )
