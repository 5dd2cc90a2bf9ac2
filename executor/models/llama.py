"""Architecture ``llama`` (Llama 1-3, SmolLM, Mistral-style dense models) as llama.cpp runs it, and
the decoder the other architectures' files build on.

Per block: RMSNorm -> grouped-query attention with RoPE -> residual; RMSNorm -> SwiGLU FFN ->
residual. GGUF's llama Q/K weights are permuted by the converter so that RoPE rotates adjacent
pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``), which is MLX's ``traditional=True``.

- Llama 3 RoPE scaling: ``rope_freqs.weight`` (one factor per rotated pair, in the ``globals``
  unit) divides each pair's frequency, as llama.cpp's ``ggml_rope_ext`` frequency factors do;
  ``rope.scaling.type`` ``linear`` scales positions by ``1 / rope.scaling.factor``; ``yarn``
  mixes interpolated and extrapolated angles per rotated pair and scales the rotated dims
  (``LlamaModel._yarn``, as ggml's ``rope_yarn``); ``rope.scaling.attn_factor`` scales the
  rotated dims of any RoPE, as llama.cpp reads it for every architecture.
- Mistral-style sliding windows: where the GGUF has ``llama.attention.sliding_window``, every
  block (or those of ``attention.sliding_window_pattern``) attends only to the last that many
  tokens, including its own. llama.cpp ignores that key for ``llama`` (its logits are the same
  with and without it), so such a file differs from llama.cpp past the window, by design.

- Mixtral-style experts: where the GGUF has ``llama.expert_count``, every block's FFN is a
  mixture of experts (:meth:`LlamaModel.moe_ffn`), routed by :func:`route` with llama's rule
  (``MOE_ROUTING``).

The forward pass runs unit by unit, asking the weight store for each unit as it is needed, so a
unit on any tier is used the moment it arrives and the numbers never depend on the tier. The
other architectures (``qwen2.py``, ``qwen3.py``, ``gemma3.py``, and the MoE ones ``qwen2moe.py``,
``qwen3moe.py``, ``olmoe.py``) subclass :class:`LlamaModel` and switch its parts on or off through
class attributes and small hooks.

Mixture of experts, as llama.cpp's ``llm_graph_context::build_moe_ffn`` (``src/llama-graph.cpp``)
computes it: the router ``ffn_gate_inp`` gives one logit per expert; a gating function (softmax
or sigmoid) over *all* experts gives probabilities; the top ``expert_used_count`` are chosen;
their probabilities, optionally renormalized to sum to 1 and scaled, weight the chosen experts'
SwiGLU outputs, which are summed. The per-architecture choices are each model class's
``moe_routing`` (llama.cpp hard-codes them in each architecture's graph code). Experts are
fetched from the weight store only after the router's choice is known (``store.route``), group
by group, and their contributions are accumulated in ascending expert id, so the result does
not depend on how the store grouped them.

The DeepSeek-style extensions (glm4moe, deepseek2), each switched on by the file, not a flag:

- a per-expert selection bias ``blk.N.exp_probs_b.bias`` [E] in the FFN unit: added to the
  probabilities for choosing the top-k only, the weights taken from the unbiased probabilities
  (:func:`route`'s ``bias``);
- grouped top-k (``expert_group_count`` > 1, which llama.cpp reads for every architecture): only
  the ``expert_group_used_count`` groups of largest top-2 sum compete (:func:`group_mask`);
- leading dense blocks (``leading_dense_block_count``): those blocks run :meth:`LlamaModel.ffn`,
  the others :meth:`LlamaModel.moe_ffn` (:meth:`LlamaModel.moe_block`);
- shared experts without a gate (``ffn_{gate,up,down}_shexp`` and no ``ffn_gate_inp_shexp``):
  their SwiGLU is added to the routed sum as it is (:meth:`LlamaModel.shared_ffn`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from strata.common import tensors
from strata.common.errors import StrataError
from strata.common.schemas import Architecture
from strata.executor.attention import attend
from strata.executor.config import RuntimeConfig
from strata.executor.cuda_mma import Rope
from strata.executor.ops import (
    QuantLinear,
    bucket_rows,
    fused_qkv,
    fused_swiglu,
    linear,
    linear_add,
    row_tile,
)
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SequenceCache
from strata.executor.weights import Weight, WeightStore

ROPE_SCALING_SUPPORTED = ("none", "linear", "yarn")
"""``rope.scaling.type`` values the forward pass implements (LongRoPE is not yet)."""


NORM_SUM_MIN = 6.103515625e-5
"""Lower bound of the chosen weights' sum before renormalizing: llama.cpp clamps it to the
smallest normal float16 so that a sum of zero (all chosen probabilities underflowed) does not
divide by zero (``build_moe_ffn``, ``ffn_moe_weights_sum_clamped``)."""

MOE_GGUF_KEYS = {
    "expert_gating_func": "gating",
    "expert_weights_norm": "norm",
    "expert_weights_scale": "scale",
}
"""The routing keys a GGUF may carry (``{arch}.<key>``, read into the ``strata.common.schemas.
Architecture`` fields of the same names: None or 0 when absent) -> the :class:`MoeRouting`
field each sets."""


@dataclass(frozen=True)
class MoeRouting:
    """How an architecture's router turns logits into expert weights (llama.cpp's arguments to
    ``build_moe_ffn``, which each architecture's graph code fixes).

    Attributes:
        gating: ``"softmax"`` or ``"sigmoid"``, applied to all experts' logits *before* top-k,
            or ``"softmax_weight"`` (gpt-oss): top-k of the logits, then a softmax over the k.
        norm: renormalize the k chosen probabilities to sum to 1 (``norm_w``).
        scale: multiply the chosen weights by this (``w_scale``; 0 or 1: no scaling).
        gguf_keys: which keys of ``MOE_GGUF_KEYS`` llama.cpp reads from the GGUF for this
            architecture; those override the fields above, the others are ignored as llama.cpp
            ignores them (for llama, qwen2moe, qwen3moe and olmoe it reads none: seen on
            llama-cpp-python 0.3.36, whose logits are identical with and without each key;
            glm4moe and deepseek2 read all three: ``MOE_GGUF_KEYS_ALL``).
        groups: expert groups of the grouped top-k (``expert_group_count``; 0 or 1: none).
        groups_used: groups the grouped top-k keeps (``expert_group_used_count``).

    ``groups`` and ``groups_used`` always come from the GGUF (:meth:`for_model`): llama.cpp
    reads ``expert_group_count`` and ``expert_group_used_count`` for every architecture
    (``llama_model::load_hparams``) and ``build_moe_ffn`` applies them to any MoE block.
    """

    gating: str = "softmax"
    norm: bool = False
    scale: float = 0.0
    gguf_keys: frozenset[str] = frozenset()
    groups: int = 0
    groups_used: int = 0

    def for_model(self, arch: Architecture) -> MoeRouting:
        """This rule with the GGUF's values of the keys llama.cpp reads for the architecture
        (``gguf_keys``) and its expert groups; a key it ignores is reported on stderr when it
        contradicts the rule."""
        rule = replace(
            self, groups=arch.expert_group_count, groups_used=arch.expert_group_used_count
        )
        for key, field in MOE_GGUF_KEYS.items():
            value = getattr(arch, key)
            if value is None or (field == "scale" and value == 0.0):
                continue  # not in the GGUF
            if key in self.gguf_keys:
                rule = replace(rule, **{field: value})
            elif _effective(field, value) != _effective(field, getattr(self, field)):
                print(
                    f"note: {arch.name}.{key} = {value} is ignored: llama.cpp ignores it for "
                    f"{arch.name} and uses {getattr(self, field)}, and so does Strata",
                    file=sys.stderr,
                )
        return rule


MOE_GGUF_KEYS_ALL = frozenset(MOE_GGUF_KEYS)
"""``MoeRouting.gguf_keys`` of an architecture whose llama.cpp hyperparameter code reads all three
routing keys (glm4moe, deepseek2: ``ml.get_key(..., false)``, the defaults applying when a key is
absent)."""


def _effective(field: str, value: object) -> object:
    """A routing field's value as it acts (a scale of 0 and of 1 both leave weights alone)."""
    return 1.0 if field == "scale" and value in (0.0, 1.0) else value


def route(
    logits: mx.array, k: int, rule: MoeRouting, bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """The router's choice for T tokens, as llama.cpp's ``build_moe_ffn`` makes it.

    1. probabilities = gating(logits) over all E experts (softmax along E, or sigmoid; for
       ``softmax_weight`` the logits themselves);
    2. selection scores = the probabilities plus ``bias`` where given (DeepSeek-V3's
       ``exp_probs_b``: it steers which experts are chosen, never their weights);
    3. grouped top-k where ``rule.groups`` > 1 (DeepSeek-V3's ``n_group`` / ``topk_group``):
       the E experts are ``rule.groups`` consecutive groups of E / groups; a group's score is
       the sum of its two largest selection scores; all but the ``rule.groups_used`` groups of
       largest score are masked to -inf (:func:`group_mask`);
    4. chosen = the k experts of largest selection score, largest first
       (``ggml_argsort_top_k``);
    5. weights = their *unbiased* probabilities (``softmax_weight``: the softmax of their k
       logits); if ``rule.norm``, divided by their sum (clamped below at ``NORM_SUM_MIN``); if
       ``rule.scale`` is neither 0 nor 1, multiplied by it.

    Softmax over all experts then renormalizing the chosen k equals a softmax over the k chosen
    logits in exact arithmetic; llama.cpp computes the former, and so does this.

    Args:
        logits: router logits, float32 [T, E].
        k: experts per token (``expert_used_count``).
        rule: the architecture's routing rule (:meth:`MoeRouting.for_model`).
        bias: the selection bias, [E] (any float dtype; added in float32), or None.

    Returns:
        (weights float32 [T, k], chosen int32 [T, k]), row t's weights in the order of its
        chosen ids.

    Raises:
        StrataError: an unknown gating function; expert groups that do not divide E.
    """
    logits = logits.astype(mx.float32)
    if rule.gating == "softmax":
        probs = mx.softmax(logits, axis=-1, precise=True)
    elif rule.gating == "sigmoid":
        probs = mx.sigmoid(logits)
    elif rule.gating == "softmax_weight":
        probs = logits  # chosen by logit, then a softmax over the k chosen (below)
    else:
        raise StrataError(f"expert gating function {rule.gating!r} is not supported")
    select = probs if bias is None else probs + bias.astype(mx.float32)
    if rule.groups > 1:
        select = group_mask(select, rule.groups, rule.groups_used)
    chosen = mx.argsort(-select, axis=-1)[:, :k].astype(mx.int32)
    weights = mx.take_along_axis(probs, chosen, axis=-1)
    if rule.gating == "softmax_weight":
        # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT (gpt-oss): the softmax of the
        # k chosen logits, after the choice.
        weights = mx.softmax(weights, axis=-1, precise=True)
    if rule.norm:
        total = mx.maximum(weights.sum(axis=-1, keepdims=True), NORM_SUM_MIN)
        weights = weights / total
    if rule.scale not in (0.0, 1.0):
        weights = weights * rule.scale
    return weights, chosen


def group_mask(select: mx.array, groups: int, used: int) -> mx.array:
    """The selection scores ``select`` (float32 [T, E]) with every expert outside each token's
    ``used`` best groups set to -inf: llama.cpp's grouped top-k (``build_moe_ffn``, after
    DeepSeek-V3's ``MoEGate``). The E experts form ``groups`` consecutive groups of E / groups
    (expert e in group e // (E / groups)); a group scores the sum of its two largest selection
    scores (``ggml_argsort_top_k(.., 2)`` then ``ggml_sum_rows``); the ``used`` groups of largest
    score are kept.

    Raises:
        StrataError: ``groups`` does not divide E into groups of at least two experts, or
            ``used`` is not 1..``groups`` (``strata.common.describe`` refuses such files first).
    """
    t, e = select.shape
    if e % groups or e // groups < 2 or not 0 < used <= groups:
        raise StrataError(
            f"{groups} expert groups ({used} used) do not fit {e} experts: expert_group_count "
            "must divide expert_count into groups of two or more"
        )
    grouped = select.reshape(t, groups, e // groups)
    top2 = mx.sort(grouped, axis=-1)[..., -2:]
    score = top2[..., 1] + top2[..., 0]  # [T, groups]: the largest plus the second
    rank = mx.argsort(mx.argsort(-score, axis=-1), axis=-1)  # 0 for the best group
    keep = (rank < used)[..., None]
    return mx.where(keep, grouped, mx.array(-mx.inf, dtype=select.dtype)).reshape(t, e)


@dataclass(frozen=True)
class LayerAttention:
    """How one block attends: RoPE parameters and the window.

    Attributes:
        rope_base: RoPE base (theta).
        rope_scale: position scale (llama.cpp's ``freq_scale``).
        use_rope_freqs: divide frequencies by ``rope_freqs.weight`` (Llama 3 scaling).
        window: attend to the last ``window`` tokens only (0: all of them).
    """

    rope_base: float
    rope_scale: float
    use_rope_freqs: bool
    window: int


class LlamaModel:
    """A llama-architecture model over a weight store.

    Args:
        arch: hyperparameters from the GGUF.
        store: the weights, on the tiers the plan chose.
        dtype: compute dtype of activations and the KV cache.

    Raises:
        StrataError: a RoPE scaling type the forward pass does not implement.
    """

    rope_traditional = True
    """Adjacent-pair rotation (llama.cpp's NORM RoPE); False rotates halves (NEOX)."""
    qk_norm = False
    """Per-head RMSNorm of Q and K before RoPE (``attn_q_norm``/``attn_k_norm``)."""
    post_norms = False
    """RMSNorm of the attention and FFN outputs before each residual add (``post_attention_norm``,
    ``post_ffw_norm``)."""
    rope_freqs_tensor = True
    """The architecture reads Llama 3's ``rope_freqs.weight`` when present."""
    qk_norm_full = False
    """With ``qk_norm``: one RMSNorm over the whole Q (and K) projection, before the split into
    heads (olmoe: ``attn_{q,k}_norm`` as wide as the projection), not one per head."""
    moe_routing = MoeRouting(gating="softmax", norm=True)
    """The router rule: llama.cpp's llama graph (``src/models/llama.cpp``) passes softmax gating,
    ``norm_w = true`` and ``hparams.expert_weights_scale``, a key its llama hyperparameters never
    read (so 0: no scaling)."""
    shared_expert = False
    """A shared expert (``ffn_{gate,up,down}_shexp``) that every token runs, its output gated by
    sigmoid(``ffn_gate_inp_shexp`` . h) (qwen2moe), or ungated where the block has no
    ``ffn_gate_inp_shexp`` (glm4moe, deepseek2: ``strata.common.tensors.ArchRule.shared_count``).
    With this flag a block runs :meth:`shared_ffn` where its FFN unit has ``ffn_up_shexp``
    (an ``expert_shared_count`` of 0 leaves it out)."""
    ffn_norm_name = "ffn_norm"
    """The FFN's input norm (``blk.N.<name>.weight``, dense and MoE blocks): gpt-oss and glm4moe
    normalize with ``post_attention_norm``, the only norm between their attention and FFN
    (``strata.common.tensors.ArchRule.ffn_norm``: the description puts it in the FFN unit)."""

    def __init__(
        self, arch: Architecture, store: WeightStore, dtype: mx.Dtype, config: RuntimeConfig
    ):
        self.arch, self.store, self.dtype, self.config = arch, store, dtype, config
        if arch.rope_scaling_type not in ROPE_SCALING_SUPPORTED:
            raise StrataError(
                f"RoPE scaling {arch.rope_scaling_type!r} is not supported yet "
                f"(supported: {', '.join(ROPE_SCALING_SUPPORTED)})"
            )
        self.scale = self.query_scale()
        self.has_globals = self.rope_freqs_tensor and _has_unit(store, "globals")
        self.layers = [self.layer_attention(i) for i in range(arch.block_count)]
        self.routing = self.moe_routing.for_model(arch) if arch.expert_count else None
        self._inv_freqs: tuple[mx.array, float, mx.array] | None = None
        self._rope_params: dict[tuple[float, float], mx.array] = {}
        self._yarn_params: dict[tuple[float, float], tuple[mx.array, float]] = {}
        # A pipeline stage of a cluster plan runs blocks [first, end) only and, past rank 0,
        # holds no head (``executor.pipeline``); ``pipeline`` is rank 0's link to the others.
        self.stage = (0, arch.block_count)
        self.pipeline = None

    # ----------------------------------------------------------------- architecture hooks

    def query_scale(self) -> float:
        """Scale of the attention scores, 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.arch.head_dim)

    def layer_attention(self, layer: int) -> LayerAttention:
        """RoPE and window of block ``layer``: one RoPE for all blocks; the windowed blocks of
        the description (Mistral-style) attend to ``sliding_window`` tokens."""
        a = self.arch
        window = a.sliding_window if layer in a.sliding_window_layers else 0
        return LayerAttention(a.rope_freq_base, a.rope_freq_scale, self.has_globals, window)

    def embed(self, ids: list[int], device_ids: mx.array | None = None) -> mx.array:
        """The token embeddings of ``ids``, [1, T, d] in the compute dtype (``device_ids``: the
        same ids as an int32 array, used where the table is on the device tier)."""
        rows = self.store.rows("token_embd.weight", "token_embd", ids, device_ids)
        return rows[None].astype(self.dtype)

    @property
    def swiglu(self) -> bool:
        """Whether the FFN is SwiGLU (this class's SiLU, not overridden): its gate, up and SiLU
        may then be one tensor-core call (``executor.ops.fused_swiglu``), which computes SiLU
        itself."""
        return type(self).activation is LlamaModel.activation

    def activation(self, gate: mx.array) -> mx.array:
        """The FFN's gate activation: SiLU (SwiGLU)."""
        return nn_silu(gate)

    def final_logits(self, logits: mx.array) -> mx.array:
        """The head's output as returned (float32)."""
        return logits

    def attention_sinks(self, w: dict[str, Weight], layer: int) -> mx.array | None:
        """Block ``layer``'s attention sinks, one logit per query head added to every softmax
        denominator (``executor.attention.attend``), or None: none here (gpt-oss has them)."""
        return None

    @classmethod
    def expert_width(cls, arch: Architecture) -> int:
        """One routed expert's FFN width (``strata.common.tensors.expert_width``)."""
        return tensors.expert_width(arch)

    @classmethod
    def shared_width(cls, arch: Architecture) -> int:
        """The shared expert's FFN width (``strata.common.tensors.shared_width``)."""
        return tensors.shared_width(arch)

    # ----------------------------------------------------------------- tensors and cache

    @classmethod
    def expected_shapes(cls, arch: Architecture) -> dict[str, list[int] | None]:
        """Tensor name -> GGUF shape (ne0 first) this forward pass needs; None = optional
        (``strata.common.tensors``, the one inventory of every architecture's tensors).

        Raises:
            StrataError: experts where the architecture has none, none where it needs them, or
                an ``expert_used_count`` outside 1..``expert_count``.
        """
        return tensors.expected_shapes(arch)

    def make_cache(self, max_tokens: int) -> SequenceCache:
        """An empty KV cache for one sequence of at most ``max_tokens`` tokens."""
        a = self.arch
        return SequenceCache(a.block_count, a.head_count_kv, a.head_dim, max_tokens, self.dtype)

    def make_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The KV block pool of the serving path: ``num_blocks`` blocks of ``block_size`` tokens."""
        a = self.arch
        return PagedKVCache(
            a.block_count, a.head_count_kv, a.head_dim, num_blocks, block_size, self.dtype
        )

    # ----------------------------------------------------------------- the shared parts

    def _norm(self, x: mx.array, w: Weight) -> mx.array:
        return mx.fast.rms_norm(x, w, self.arch.rms_norm_eps)

    def _proj(self, w: dict[str, Weight], name: str, x: mx.array) -> mx.array:
        y = linear(x, w[name + ".weight"], self.config)
        bias = w.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(
        self, x: mx.array, la: LayerAttention, offset: int | mx.array, freqs: mx.array | None
    ) -> mx.array:
        dims = self.arch.rope_dimension_count
        if self.arch.rope_scaling_type == "yarn":
            periods, mscale = self._yarn(la.rope_base, la.rope_scale)
            if la.use_rope_freqs and freqs is not None:  # llama.cpp divides both by the factors
                periods = periods * freqs
            y = mx.fast.rope(
                x,
                dims,
                traditional=self.rope_traditional,
                base=None,
                scale=1.0,
                offset=offset,
                freqs=periods,
            )
            return _scaled_rotated(y, dims, mscale)
        if self.arch.rope_attn_factor != 1.0:  # rope.scaling.attn_factor: ggml's mscale
            y = self._rope_plain(x, la, offset, freqs)
            return _scaled_rotated(y, dims, float(np.float32(self.arch.rope_attn_factor)))
        return self._rope_plain(x, la, offset, freqs)

    def _rope_plain(
        self, x: mx.array, la: LayerAttention, offset: int | mx.array, freqs: mx.array | None
    ) -> mx.array:
        """RoPE without YaRN or a magnitude factor (``_rope``)."""
        dims = self.arch.rope_dimension_count
        if la.use_rope_freqs and freqs is not None:
            inv = self._inverse_freqs(freqs, la.rope_base)
            return mx.fast.rope(
                x,
                dims,
                traditional=self.rope_traditional,
                base=None,
                scale=la.rope_scale,
                offset=offset,
                freqs=inv,
            )
        return mx.fast.rope(
            x,
            dims,
            traditional=self.rope_traditional,
            base=la.rope_base,
            scale=la.rope_scale,
            offset=offset,
        )

    def _yarn(self, base: float, freq_scale: float) -> tuple[mx.array, float]:
        """YaRN's RoPE for RoPE ``base`` and position scale ``freq_scale`` (1 / factor), as
        ggml's ``ggml_rope_yarn_corr_dims`` and ``rope_yarn`` (``ggml-cpu/ops.cpp``) compute it:

        - correction dims: ``corr(b) = dims * ln(n_ctx_orig / (2 pi b)) / (2 ln base)``;
          low = max(0, floor(corr(beta_fast))), high = min(dims - 1, ceil(corr(beta_slow)));
        - pair i (rotating dims 2i and 2i + 1, or i and i + dims/2 for NeoX) mixes the
          interpolated and the extrapolated angle: theta = theta_extrap * (freq_scale * (1 -
          r_i) + r_i), r_i = ext_factor * (1 - clamp((i - low) / max(0.001, high - low), 0, 1))
          (the fast-rotating pairs extrapolate, the slow ones interpolate);
        - the rotated dims are scaled by mscale = (1 + 0.1 ln factor) * ``rope_attn_factor``
          where ext_factor != 0 (factor = 1 / freq_scale > 1), else ``rope_yarn_attn_factor *
          rope_attn_factor``.

        ``n_ctx_orig`` is ``rope.scaling.original_context_length`` (else the training context);
        ext_factor 1, beta_fast 32 and beta_slow 1 unless the description has others
        (``strata.common.describe`` reads the keys only where llama.cpp does; llama.cpp's
        defaults, ``llama_context`` and ``llama_hparams``).

        Returns:
            (MLX's ``freqs`` for ``mx.fast.rope``: each pair's period base^(2i/dims) / (its
            angle's factor), float32 [dims / 2]; mscale). Kept per (base, freq_scale).
        """
        got = self._yarn_params.get((base, freq_scale))
        if got is not None:
            return got
        a = self.arch
        dims = a.rope_dimension_count
        n_ctx_orig = a.rope_scaling_original_context or a.context_length
        ext = 1.0 if a.rope_yarn_ext_factor is None else a.rope_yarn_ext_factor

        def corr(beta: float) -> float:
            return dims * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        low = max(0.0, math.floor(corr(a.rope_yarn_beta_fast)))
        high = min(dims - 1.0, math.ceil(corr(a.rope_yarn_beta_slow)))
        i = np.arange(dims // 2, dtype=np.float64)
        ramp = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * ext
        angle = freq_scale * (1 - ramp) + ramp  # each pair's factor on its angle
        periods = base ** (2 * i / dims) / angle
        # llama.cpp's context replaces attn_factor by get_mscale(factor) / (1 + 0.1 ln factor)
        # where ext_factor != 0 and ggml's rope multiplies it by 1 + 0.1 ln factor: net
        # get_mscale(factor) = 1 + 0.1 ln factor (factor > 1, else 1); times
        # rope.scaling.attn_factor either way (``llama_context``'s constructor).
        factor = 1.0 / freq_scale
        if ext != 0:
            mscale = 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0
        else:
            mscale = a.rope_yarn_attn_factor
        mscale *= a.rope_attn_factor
        got = (mx.array(periods.astype(np.float32)), float(np.float32(mscale)))
        self._yarn_params[(base, freq_scale)] = got
        return got

    def _inverse_freqs(self, freqs: mx.array, base: float) -> mx.array:
        """MLX's RoPE frequencies for llama.cpp's frequency factors ``freqs``: inverse
        frequencies base^(2i/dims) times the factors, float32 [dims / 2]. Kept for the last
        ``freqs`` array (one per pass) and base, where every block's Q and K would otherwise
        recompute them (four operations each)."""
        last = self._inv_freqs
        if last is not None and last[0] is freqs and last[1] == base:
            return last[2]
        dims = self.arch.rope_dimension_count
        inv = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * freqs
        self._inv_freqs = (freqs, base, inv)
        return inv

    def _fused_rope(
        self, la: LayerAttention, positions: mx.array, freqs: mx.array | None
    ) -> Rope | None:
        """The RoPE of Q and K for the Q/K/V product's store (``executor.cuda_mma.Rope``: the
        arithmetic of ``mx.fast.rope``, two operations of the graph fewer per block), or None
        where the block RoPEs them itself: the config's ``fused_rope`` off, rotation of halves
        (NEOX), Q/K norms between the product and RoPE, a rotated width that is not even and
        within the head, or a subclass with its own ``_rope`` or ``_inverse_freqs``."""
        dims, d = self.arch.rope_dimension_count, self.arch.head_dim
        if not self.config.fused_rope or not self.rope_traditional or self.qk_norm:
            return None
        if self.arch.rope_scaling_type == "yarn" or self.arch.rope_attn_factor != 1.0:
            return None  # YaRN's per-pair mix, a magnitude factor: ``_rope``
        if dims <= 0 or dims % 2 or dims > d or not self._own_rope:
            return None
        params = self._rope_params.get((la.rope_scale, la.rope_base))
        if params is None:
            params = self._rope_params[(la.rope_scale, la.rope_base)] = mx.array(
                [la.rope_scale, _log2f(la.rope_base)], dtype=mx.float32
            )
        inv = None
        if la.use_rope_freqs and freqs is not None:
            inv = self._inverse_freqs(freqs, la.rope_base)
        return Rope(positions, params, inv, d, dims)

    @property
    def _own_rope(self) -> bool:
        """Whether the architecture RoPEs as this class does (``_rope`` and ``_inverse_freqs``
        not overridden), which the Q/K/V product's store reproduces."""
        cls = type(self)
        return cls._rope is LlamaModel._rope and cls._inverse_freqs is LlamaModel._inverse_freqs

    def attention(
        self,
        w: dict[str, Weight],
        layer: int,
        x: mx.array,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope_freqs: mx.array | None = None,
    ) -> mx.array:
        """The residual stream ``x`` [1, R, d] after block ``layer``'s self-attention (``x``
        plus its output), R the pass's rows (its N tokens, or more: zero rows that pad it to a
        row bucket, ``pass_rows``).

        Q/K/V are projected for all R rows at once and RoPE'd once, each row at its own position,
        and written to the cache; ``executor.attention.attend`` chooses how they attend.
        ``rope_freqs``: Llama 3's frequency factors (the ``globals`` unit), if the model has them.
        """
        a, p, la = self.arch, f"blk.{layer}.", self.layers[layer]
        rows, n = x.shape[1], batch.num_tokens
        heads, kv_heads, d = a.head_count, a.head_count_kv, a.head_dim
        h = self._norm(x, w[p + "attn_norm.weight"])
        projs = [p + name for name in ("attn_q", "attn_k", "attn_v")]
        ws = [w[name + ".weight"] for name in projs]
        positions = batch.positions(rows)
        qkv, rope = None, None
        if (
            self.config.fused_projections
            and all(isinstance(wt, QuantLinear) for wt in ws)
            and not any(name + ".bias" in w for name in projs)
        ):
            # One tensor-core call where it applies, writing Q and K as RoPE takes them (or
            # RoPE'd already, as the cache stores K) and V as the cache stores it (no reshape in
            # the graph: each costs the host a few us).
            shapes = None
            if not self.qk_norm_full:
                rope = self._fused_rope(la, positions, rope_freqs)
                k_shape = (rows, kv_heads, d) if rope else (rows, kv_heads, 1, d)
                shapes = [(rows, heads, 1, d), k_shape, (rows, kv_heads, d)]
            qkv = fused_qkv(h, ws, self.config, shapes, rope)
        if qkv is None:
            qkv, rope = [self._proj(w, name, h) for name in projs], None
        q, k, v = qkv
        if self.qk_norm_full:
            q = self._norm(q, w[p + "attn_q_norm.weight"])
            k = self._norm(k, w[p + "attn_k_norm.weight"])
        # [R, heads, 1, head_dim]: each row its own batch entry at its own offset, so a token's
        # RoPE is the same call whatever else is in the pass and whichever path attends it.
        q = _shaped(q, (rows, heads, 1, d))
        v = _shaped(v, (rows, kv_heads, d))
        if rope is None:  # not RoPE'd in the product's store
            k = _shaped(k, (rows, kv_heads, 1, d))
            if self.qk_norm and not self.qk_norm_full:  # per head: the last axis
                # Required where the architecture has them (the inventory); glm4moe's are
                # optional (``ArchRule.qk_norm_optional``): a block without them skips them.
                if (q_norm := w.get(p + "attn_q_norm.weight")) is not None:
                    q = self._norm(q, q_norm)
                if (k_norm := w.get(p + "attn_k_norm.weight")) is not None:
                    k = self._norm(k, k_norm)
            q = self._rope(q, la, positions, rope_freqs)
            k = self._rope(k, la, positions, rope_freqs).reshape(rows, kv_heads, d)
        # Every token's K/V goes in before anyone attends: a chunk sees its own tokens. The
        # padding rows write nothing (no-copy row views).
        kv.write(layer, batch.write_slots, k[:n] if rows > n else k, v[:n] if rows > n else v)
        sinks = self.attention_sinks(w, layer)
        o = attend(q, kv, layer, batch, la.window, self.scale, self.config, sinks)
        return self._output(w, p + "attn_output", o, x, p + "post_attention_norm.weight")

    def ffn(self, w: dict[str, Weight], layer: int, x: mx.array) -> mx.array:
        """The residual stream ``x`` [1, T, d] after block ``layer``'s gated FFN (SwiGLU, or
        the subclass's activation): ``x`` plus its output."""
        p = f"blk.{layer}."
        h = self._norm(x, w[p + self.ffn_norm_name + ".weight"])
        gate, up = w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]
        gated = None
        if (
            self.config.fused_projections
            and self.swiglu
            and isinstance(gate, QuantLinear)
            and isinstance(up, QuantLinear)
        ):
            gated = fused_swiglu(h, gate, up, self.config)  # one tensor-core call where it applies
        if gated is None:
            gated = self.activation(linear(h, gate, self.config)) * linear(h, up, self.config)
        return self._output(w, p + "ffn_down", gated, x, p + "post_ffw_norm.weight")

    def _output(
        self, w: dict[str, Weight], name: str, h: mx.array, x: mx.array, post_norm: str
    ) -> mx.array:
        """The residual stream ``x`` [1, R, d] plus a block's output projection ``name`` of
        ``h`` ([R, in] or [1, R, in]), normed first where the architecture norms it
        (``post_norms``, the weight ``post_norm``); the sum in the projection's kernel call
        where it can be (``executor.ops.linear_add``)."""
        if self.post_norms:
            return x + self._norm(linear(h, w[name + ".weight"], self.config), w[post_norm])
        # No bias: engine.check_tensors refuses one on these projections.
        return linear_add(h, w[name + ".weight"], x, self.config)

    def moe_ffn(self, w: dict[str, Weight], layer: int, x: mx.array) -> mx.array:
        """Mixture-of-experts FFN of block ``layer``: x [1, T, d] -> [1, T, d].

        ``w`` is the dense unit ``blk.N.ffn`` (``ffn_norm``, the router ``ffn_gate_inp`` in MLX
        order [E, d], its selection bias ``exp_probs_b.bias`` [E] where the file has one, any
        shared expert). The router's choice is brought to the host (the one
        sync of the block) and handed to ``store.route``, which answers with groups of expert
        ids (ascending overall) that fit the store's slots; each group's weights come from
        ``store.experts`` and are freed by ``store.release_experts`` once used.

        Each expert e runs only on the tokens that chose it, and its weighted output is added
        to those tokens' rows, experts in ascending id whatever the grouping, so the sum (and
        its rounding) never depends on the tiers or the store's slots. llama.cpp adds a
        token's experts in its top-k order instead: a difference of float rounding only.
        """
        a, p, s, rule = self.arch, f"blk.{layer}.", self.store, self.routing
        assert rule is not None  # blocks() calls this for MoE models only
        h = self._norm(x, w[p + self.ffn_norm_name + ".weight"])[0]  # [T, d]
        # The router in float32 whatever the compute dtype, as llama.cpp computes it: a choice
        # between near-equal logits must not hinge on half-precision rounding. Its bias
        # (``ffn_gate_inp.bias``, gpt-oss) is added where the model has one.
        logits = self._proj(w, p + "ffn_gate_inp", h.astype(mx.float32))  # [T, E]
        bias = w.get(p + "exp_probs_b.bias")
        weights, chosen = route(logits, a.expert_used_count, rule, bias)
        # The router interception: the choice on the host, so that only chosen experts load.
        ids = np.array(chosen, dtype=np.int32)  # [T, k]
        out = mx.zeros(h.shape, dtype=h.dtype)
        for group in s.route(layer, ids):
            ws = s.experts(layer, group)
            for e in group:
                rows, slots = np.nonzero(ids == e)
                if not len(rows):
                    continue
                r = mx.array(rows.astype(np.int32))
                g = weights[r, mx.array(slots.astype(np.int32))].astype(h.dtype)  # [n]
                picked = h[_padded_rows(rows, self.config.pad_expert_rows)]
                out = out.at[r].add(self.expert(ws[e], picked)[: len(rows)] * g[:, None])
            out = s.release_experts(layer, out)
        if self.shared_expert and p + "ffn_up_shexp.weight" in w:
            out = out + self.shared_ffn(w, layer, h)
        return out[None]

    def expert(self, ws: dict[str, Weight], h: mx.array) -> mx.array:
        """One expert's gated FFN on the rows that chose it: h [n, d] -> [n, d].

        ``ws``: ``gate`` and ``up`` ([ff, d]) and ``down`` ([d, ff]), MLX order, quantized or
        not. A fused ``ffn_gate_up_exps`` arrives split by the store
        (``executor.experts.split_gate_up``: gate = the first ff rows, as llama.cpp's
        ``build_moe_ffn`` views it).
        """
        c = self.config
        gate, up = linear(h, ws["gate"], c), linear(h, ws["up"], c)
        return linear(self.activation(gate) * up, ws["down"], c)

    def shared_ffn(self, w: dict[str, Weight], layer: int, h: mx.array) -> mx.array:
        """The shared expert of block ``layer``: h [T, d] (the FFN-normed input) -> [T, d], the
        SwiGLU of ``ffn_{gate,up,down}_shexp``; times sigmoid(h . ``ffn_gate_inp_shexp``) per
        token where the unit has that gate (qwen2moe; llama.cpp computes the sigmoid as
        silu(z) / z: the same function), as it is otherwise (glm4moe, deepseek2: llama.cpp's
        ``build_ffn`` of the ``_shexp`` tensors, ``expert_shared_count`` experts wide, added to
        the routed sum)."""
        p = f"blk.{layer}."
        c = self.config
        g = linear(h, w[p + "ffn_gate_shexp.weight"], c)
        u = linear(h, w[p + "ffn_up_shexp.weight"], c)
        out = linear(self.activation(g) * u, w[p + "ffn_down_shexp.weight"], c)
        gate_inp = w.get(p + "ffn_gate_inp_shexp.weight")  # [d]
        if gate_inp is None:
            return out
        assert isinstance(gate_inp, mx.array)  # a vector is never stored quantized
        z = linear(h, gate_inp.reshape(1, -1), c)  # [T, 1]
        return out * mx.sigmoid(z)

    def embed_pass(self, batch: ForwardBatch) -> mx.array:
        """The pass's rows, [1, rows, d] in the compute dtype: its tokens' embeddings, then zero
        rows up to ``pass_rows`` (no row-wise operation mixes rows, attention gives them zeros,
        they write no KV slot, and their logits are never asked for)."""
        n = batch.num_tokens
        rows = self.pass_rows(n)
        x = self.embed(batch.ids, batch.id_array)
        if rows > n:
            # Not embedded: a streamed table would read rows for the padding.
            x = mx.concatenate([x, mx.zeros((1, rows - n, x.shape[2]), dtype=x.dtype)], axis=1)
        return x

    def forward_batch(
        self,
        batch: ForwardBatch,
        kv: PagedKVCache,
        layers: int | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> mx.array:
        """One eager forward pass over the tokens of several sequences (``executor.paged_kv``):
        :meth:`embed_pass`, then :meth:`forward_rows`. ``executor.runner.forward`` replays a
        compiled graph instead where one takes the pass.

        Returns:
            float32 logits [S, vocab] of the batch's ``logit_rows``, in their order.
        """
        return self.forward_rows(self.embed_pass(batch), batch, kv, layers, skip)

    def forward_rows(
        self,
        x: mx.array,
        batch: ForwardBatch,
        kv: PagedKVCache,
        layers: int | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> mx.array:
        """The pass from its embedded rows ``x`` [1, rows, d] (:meth:`embed_pass`) on: the
        blocks and the output head, every unit asked of the store once for the whole batch (a
        streamed unit is read once per pass whatever the batch size), the residual stream
        handed to ``mx.async_eval`` every ``config.async_eval_blocks`` blocks.

        Args:
            x: the embedded rows.
            batch: the tokens and their KV slots.
            kv: the paged KV cache.
            layers: run only the first ``layers`` blocks, then the output head (the
                self-drafter's early exit; None: every block).
            skip: block units (``blk.N.attn``/``blk.N.ffn``) left out, their residual passing
                through (the self-drafter's layer skip of units that stream from disk).

        Returns:
            float32 logits [S, vocab] of the batch's ``logit_rows``, in their order.
        """
        end = self.arch.block_count if layers is None else layers
        x = self.blocks(x, batch, kv, self.rope_factors(), 0, end, skip, schedule=True)
        return self.head(x, batch)

    def rope_factors(self) -> mx.array | None:
        """Llama 3's RoPE frequency factors (the ``globals`` unit), float32, or None where the
        model has none: asked of the store once per pass. Read and released at once: a new
        array (``* 1.0``), as a streamed unit's slot is reused once released."""
        if not self.has_globals:
            return None
        s = self.store
        factors = s.unit("globals")["rope_freqs.weight"]
        return s.release("globals", factors.astype(mx.float32) * 1.0)

    def blocks(
        self,
        x: mx.array,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope_freqs: mx.array | None,
        first: int,
        end: int,
        skip: frozenset[str] = frozenset(),
        schedule: bool = False,
    ) -> mx.array:
        """The residual stream ``x`` [1, rows, d] through blocks ``first .. end - 1``, each unit
        asked of the store as it is needed (``skip``: units left out, their residual passing
        through). ``schedule``: hand the stream to ``mx.async_eval`` every
        ``config.async_eval_blocks`` blocks (not while ``executor.pass_graph`` traces, when
        nothing may be evaluated)."""
        s, every = self.store, self.config.async_eval_blocks
        for i in range(first, end):
            attn, ffn = f"blk.{i}.attn", f"blk.{i}.ffn"
            if attn not in skip:
                x = s.release(attn, self.attention(s.unit(attn), i, x, batch, kv, rope_freqs))
            if ffn not in skip:
                if not self.moe_block(i):
                    x = s.release(ffn, self.ffn(s.unit(ffn), i, x))
                else:
                    x = s.release(ffn, x + self.moe_ffn(s.unit(ffn), i, x))
            if schedule and every and (i + 1) % every == 0:
                mx.async_eval(x)
        return x

    def moe_block(self, layer: int) -> bool:
        """Whether block ``layer``'s FFN is a mixture of experts (:meth:`moe_ffn`) rather than
        dense (:meth:`ffn`): the model has experts and the block is past the
        ``leading_dense_block_count`` dense ones (``strata.common.tensors.moe_block``)."""
        return self.routing is not None and tensors.moe_block(self.arch, layer)

    def head(self, x: mx.array, batch: ForwardBatch) -> mx.array:
        """float32 logits [S, vocab] of ``batch.logit_rows`` of the residual stream ``x``
        [1, rows, d]: the final norm and the output head (the token embedding where tied)."""
        s = self.store
        out = s.unit("output")
        x = self._norm(x[:, batch.logit_rows], out["output_norm.weight"])
        head = out.get("output.weight")
        if head is None:
            # Tied embeddings: the head is the token embedding table. The output unit (the final
            # norm) is released before the table is asked for, so that a pool of one slot can
            # stream both.
            x = s.release("output", x)
            table = s.unit("token_embd")["token_embd.weight"]
            logits = linear(x[0], table, self.config).astype(mx.float32)
            return s.release("token_embd", self.final_logits(logits))
        logits = self.final_logits(linear(x[0], head, self.config).astype(mx.float32))
        return s.release("output", logits)

    def pass_rows(self, tokens: int) -> int:
        """Rows of a forward pass of ``tokens`` tokens: ``executor.ops.bucket_rows(tokens)``
        where the config's ``pad_pass_rows`` and the calling thread has no row tile (``executor.ops.
        set_row_tile``), for dense models (a MoE block's router would route the padding rows
        to experts); else ``tokens``. Padded once here, every projection of the pass already
        has its bucket's rows, where ``executor.ops.linear`` would otherwise pad and slice
        each product (two operations of its own, hundreds per pass)."""
        if not self.config.pad_pass_rows or self.routing is not None or row_tile():
            return tokens
        return bucket_rows(tokens)

    def unit_order(self) -> list[str]:
        """Units in the order ``forward`` asks the store for them (the streaming schedule): a
        pipeline stage's own blocks (``stage``), and the head where the store holds it."""
        first, end = self.stage
        order = ["globals"] if self.has_globals else []
        order += [f"blk.{i}.{k}" for i in range(first, end) for k in ("attn", "ffn")]
        if not _has_unit(self.store, "output"):  # a stage past rank 0
            return order
        return order + ["output"] + (["token_embd"] if self.arch.tied_embeddings else [])


def _log2f(x: float) -> float:
    """``log2`` of ``x`` as float32, as MLX's RoPE computes it on the host (C's ``log2f`` of the
    float32 ``x``: ``std::log2`` of its float ``base``), so that a RoPE applied in a product's
    store uses MLX's exact constant; Python's double ``log2`` rounded where the C library is
    not found."""
    x32 = float(np.float32(x))
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        lib.log2f.restype, lib.log2f.argtypes = ctypes.c_float, [ctypes.c_float]
        return float(lib.log2f(x32))
    except (OSError, AttributeError):
        return float(np.float32(math.log2(x32)))


def _scaled_rotated(y: mx.array, dims: int, mscale: float) -> mx.array:
    """``y`` (RoPE'd, [..., head_dim]) with its first ``dims`` (rotated) elements times
    ``mscale``: ggml's rope multiplies cos and sin by it and copies the other dims as they are."""
    if mscale == 1.0:
        return y
    if dims == y.shape[-1]:
        return y * mscale
    return mx.concatenate([y[..., :dims] * mscale, y[..., dims:]], axis=-1)


def _has_unit(store: WeightStore, unit: str) -> bool:
    try:
        store.tier(unit)
    except KeyError:
        return False
    return True


def _padded_rows(rows: np.ndarray, pad: bool) -> mx.array:
    """``rows`` (int [n]) as an index array, padded to a power of two with copies of its first
    row where ``pad`` (the config's ``pad_expert_rows``; the extra results are sliced off)."""
    n = len(rows)
    if pad and n & (n - 1):
        rows = np.concatenate([rows, np.full((1 << n.bit_length()) - n, rows[0])])
    return mx.array(rows.astype(np.int32))


def _shaped(a: mx.array, shape: tuple[int, ...]) -> mx.array:
    """``a`` reshaped to ``shape``, or ``a`` itself where it has that shape already (a reshape
    is an operation of the graph even then)."""
    return a if a.shape == shape else a.reshape(shape)


def nn_silu(x: mx.array) -> mx.array:
    """SiLU, x * sigmoid(x)."""
    return x * mx.sigmoid(x)
