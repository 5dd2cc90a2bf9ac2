"""Which tensors each architecture has: GGUF names and shapes from the hyperparameters.

The one inventory that the executor's load check (``executor.engine.check_tensors``, through the
models' ``expected_shapes``), ``strata describe --arch`` (``planner.archdesc``) and ``synth.py``
(``planner.synthetic``) read, so a tensor or a shape rule is written once. It follows gguf-py's
``constants.py`` (``MODEL_TENSORS``: the tensors per ``general.architecture``; ``TENSOR_NAMES``:
their names, used here) and adds what gguf-py does not say: each tensor's shape as a function of
the ``Architecture`` and whether llama.cpp's loader (``src/llama-model.cpp``, ``load_tensors``)
requires it, accepts it or, by its absence here, refuses it.

Shapes are in GGUF order (ne0, the row length, first); ``d`` is the width, ``hd`` the head dim,
``q = heads * hd``, ``kv = kv_heads * hd``, ``ff`` the FFN width, ``E`` the expert count:

- ``token_embd.weight`` [d, vocab]; ``output_norm.weight`` [d]; ``output.weight`` [d, vocab]
  (optional where the head may be tied to the embeddings); ``rope_freqs.weight``
  [rope dims / 2] (llama only, optional: Llama 3 RoPE scaling);
- per block ``blk.N.``: ``attn_norm`` [d], ``attn_q`` [d, q], ``attn_k``/``attn_v`` [d, kv],
  ``attn_output`` [q, d], ``attn_{q,k,v}.bias`` [q]/[kv]; ``attn_{q,k}_norm`` [hd] (per head) or
  [q]/[kv] (olmoe: the whole projection); ``post_attention_norm`` [d] (gemma3); ``ffn_norm`` [d];
- a dense block's FFN: ``ffn_gate``/``ffn_up`` [d, ff], ``ffn_down`` [ff, d]; an MoE block's: the
  router ``ffn_gate_inp`` [d, E], the stacked experts ``ffn_{gate,up}_exps`` [d, ff_e, E] and
  ``ffn_down_exps`` [ff_e, d, E] (the expert dimension last, so an expert's bytes are
  contiguous; ff_e from :func:`expert_width`), and qwen2moe's shared expert
  ``ffn_gate_inp_shexp`` [d], ``ffn_{gate,up}_shexp`` [d, ff_s], ``ffn_down_shexp`` [ff_s, d];
  ``post_ffw_norm`` [d] (gemma3); the DeepSeek-style parts (glm4moe, deepseek2): the router's
  selection bias ``exp_probs_b.bias`` [E], ungated shared experts ``ffn_{gate,up,down}_shexp``
  (no ``ffn_gate_inp_shexp``, ff_s = ``expert_shared_count * ff_e``), and dense FFNs in the
  first ``leading_dense_block_count`` blocks (:func:`moe_block`); glm4moe's FFN input norm is
  ``post_attention_norm`` [d] (no ``ffn_norm``);
- gpt-oss's additions: ``attn_output.bias`` [d], ``attn_sinks.weight`` [heads], the router's
  ``ffn_gate_inp.bias`` [E], the experts' ``ffn_{gate,up}_exps.bias`` [ff_e, E] and
  ``ffn_down_exps.bias`` [d, E] (split per expert like the weights), and
  ``post_attention_norm`` as the FFN's input norm;
- the hybrids (qwen3next, qwen35moe: described and planned, not executed — ``executor_rule``):
  ``attn_q`` [d, 2q] (query and output gate) in the full-attention blocks, the gated delta-net's
  tensors in place of attention in ``Architecture.recurrent_layers`` (:func:`_delta_net`),
  ``post_attention_norm`` as the FFN's input norm, qwen2moe's shared expert in every block.

Tensors are listed in file order, the one ``synth.py`` writes: the embedding (and
``rope_freqs``), the blocks (attention, then FFN), the output norm and head.

A file's shape may differ from the inventory's by trailing one-element dimensions (a
``[d, 1]`` shared-expert gate where ``[d]`` is expected: the converters write qwen2moe's
``ffn_gate_inp_shexp`` so): llama.cpp's loader (``llama_model_loader::check_tensor_dims``)
compares the four ``ne`` of a ggml tensor, unused ones being 1, so it takes such a tensor, and so
does Strata (:func:`same_up_to_trailing_ones`); the description records the inventory's shape
(:func:`loader_shapes`), the one the forward pass uses (the bytes are the same).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from strata.common.errors import StrataError
from strata.common.schemas import Architecture

M = MODEL_TENSOR

Presence = Literal["none", "optional", "required"]


@dataclass(frozen=True)
class ArchRule:
    """Which optional parts of the llama decoder an architecture's GGUF has, as llama.cpp's loader
    takes them (``load_tensors`` in ``src/llama-model.cpp``).

    Attributes:
        rope_freqs: ``rope_freqs.weight`` (Llama 3 RoPE scaling) is accepted when present.
        head_required: ``output.weight`` is required (llama.cpp refuses tied embeddings);
            otherwise it is optional and a file without it ties the head to ``token_embd``.
        qkv_bias: ``attn_{q,k,v}.bias``: absent (a file with them is refused), optional or
            required.
        qk_norm: ``attn_{q,k}_norm``: ``"none"``, ``"head"`` (one RMSNorm per head, [hd]) or
            ``"full"`` (one over the whole projection, [q] and [kv]: olmoe).
        post_norms: ``post_attention_norm`` and ``post_ffw_norm`` (gemma3).
        experts: MoE blocks: ``"none"`` (llama.cpp has no MoE variant), ``"optional"`` (llama:
            Mixtral-style when the GGUF has ``expert_count``) or ``"required"``.
        expert_ffn_key: experts are ``expert_feed_forward_length`` wide when the GGUF has it,
            else ``feed_forward_length / expert_used_count`` (qwen2moe, qwen3moe); otherwise
            ``feed_forward_length`` always (llama, olmoe).
        shared_expert: qwen2moe's sigmoid-gated shared expert (``*_shexp``).
        shared_count: DeepSeek-style ungated shared experts: ``ffn_{gate,up,down}_shexp``
            ``expert_shared_count * expert_width`` wide (llama.cpp's ``n_ff_exp *
            n_expert_shared``), present in every MoE block where ``expert_shared_count > 0``;
            their SwiGLU output is added to the routed experts' sum (glm4moe, deepseek2).
        probs_bias: the router's per-expert selection bias ``exp_probs_b.bias`` [E] (added to
            the gated probabilities for choosing the top-k only: ``build_moe_ffn``).
        leading_dense: the first ``leading_dense_block_count`` blocks have a dense FFN
            (``ffn_{gate,up,down}``), the others are MoE (llama.cpp's ``n_layer_dense_lead``).
        nextn: ``nextn_predict_layers`` multi-token-prediction blocks follow the forward pass's
            blocks in the file; llama.cpp loads them as skipped tensors and never runs them,
            and ``strata.common.describe`` leaves their tensors out (not in this inventory).
        ffn_norm: the FFN's input RMSNorm: ``ffn_norm`` or, for glm4moe,
            ``post_attention_norm`` (llama.cpp's ``attn_post_norm`` normalizes the FFN's input
            there; the description puts it in the ``blk.N.ffn`` unit).
        qk_norm_optional: ``attn_{q,k}_norm`` may be absent (glm4moe: only the 355B has them);
            a block with them norms Q/K per head before RoPE.
        mla: multi-head latent attention (deepseek2) in place of ``attn_{q,k,v}``
            (:func:`_mla_attention`).
        attn_sinks: ``attn_sinks.weight`` [heads], one learned logit per query head in every
            attention softmax's denominator (gpt-oss).
        output_bias: ``attn_output.bias`` [d] (gpt-oss).
        router_bias: ``ffn_gate_inp.bias`` [E], added to the router's logits (gpt-oss).
        expert_bias: ``ffn_{gate,up}_exps.bias`` [ff_e, E] and ``ffn_down_exps.bias`` [d, E],
            each expert's biases (gpt-oss).
        delta_net: hybrid linear attention (llama.cpp's ``llm_build_delta_net_base``): the
            blocks of ``Architecture.recurrent_layers`` are gated delta-net blocks
            (:func:`_delta_net`) in place of attention, the others gated attention (``attn_q``
            twice as wide: each head's query, then its output gate); ``"qwen3next"`` (one
            ``ssm_ba`` for beta and alpha) or ``"qwen35"`` (``ssm_beta`` and ``ssm_alpha``).
        not_executed: why the executor does not run the architecture yet (empty: it does); such
            an architecture is described and planned, and :func:`executor_rule` refuses it.
    """

    rope_freqs: bool = False
    head_required: bool = False
    qkv_bias: Presence = "optional"
    qk_norm: Literal["none", "head", "full"] = "none"
    post_norms: bool = False
    experts: Presence = "none"
    expert_ffn_key: bool = False
    shared_expert: bool = False
    shared_count: bool = False
    probs_bias: Presence = "none"
    leading_dense: bool = False
    nextn: bool = False
    ffn_norm: Literal["ffn_norm", "post_attention_norm"] = "ffn_norm"
    qk_norm_optional: bool = False
    mla: bool = False
    attn_sinks: bool = False
    output_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    delta_net: Literal["none", "qwen3next", "qwen35"] = "none"
    not_executed: str = ""


_DELTA_NET_NOT_EXECUTED = (
    "its gated delta-net (linear-attention) layers and their per-sequence recurrent state are "
    "not executed yet"
)

# llama.cpp's qwen3next (src/models/qwen3next.cpp: Qwen3-Next, Qwen3-Coder-Next): gated delta-net
# blocks except every full_attention_interval-th, gated attention with per-head Q/K norms there,
# post_attention_norm as the FFN's input norm, MoE in every block with qwen2moe's sigmoid-gated
# shared expert.
_QWEN3NEXT = ArchRule(
    qkv_bias="none",
    qk_norm="head",
    experts="required",
    expert_ffn_key=True,
    shared_expert=True,
    ffn_norm="post_attention_norm",
    delta_net="qwen3next",
    not_executed=_DELTA_NET_NOT_EXECUTED,
)

ARCHITECTURES: dict[str, ArchRule] = {
    "llama": ArchRule(rope_freqs=True, experts="optional"),
    "qwen2": ArchRule(qkv_bias="required"),
    "qwen3": ArchRule(qk_norm="head"),
    "gemma3": ArchRule(qk_norm="head", post_norms=True),
    "qwen2moe": ArchRule(
        qkv_bias="required",
        head_required=True,
        experts="required",
        expert_ffn_key=True,
        shared_expert=True,
    ),
    "qwen3moe": ArchRule(qk_norm="head", experts="required", expert_ffn_key=True),
    # llama.cpp's olmoe graph adds no Q/K/V biases: a file with them is refused, not run otherwise.
    "olmoe": ArchRule(qkv_bias="none", qk_norm="full", head_required=True, experts="required"),
    # llama.cpp's glm4moe (src/models/glm4-moe.cpp): optional Q/K/V biases and per-head Q/K norms,
    # post_attention_norm as the FFN's input norm, leading dense blocks, the selection bias,
    # ungated shared experts, nextn blocks kept in the file and skipped.
    "glm4moe": ArchRule(
        qk_norm="head",
        qk_norm_optional=True,
        experts="required",
        expert_ffn_key=True,
        shared_count=True,
        probs_bias="required",
        leading_dense=True,
        nextn=True,
        ffn_norm="post_attention_norm",
    ),
    # llama.cpp's deepseek2 (src/models/deepseek2.cpp): multi-head latent attention, leading
    # dense blocks (all of them where the file has no experts), the optional selection bias,
    # ungated shared experts, experts expert_feed_forward_length wide, nextn blocks skipped.
    "deepseek2": ArchRule(
        qkv_bias="none",
        mla=True,
        experts="optional",
        expert_ffn_key=True,
        shared_count=True,
        probs_bias="optional",
        leading_dense=True,
        nextn=True,
    ),
    # llama.cpp's gpt-oss (LLM_ARCH_OPENAI_MOE, src/models/openai-moe-iswa.cpp): every bias
    # required (Q/K/V/O, router, experts), attention sinks, post_attention_norm as the FFN's
    # input norm, experts expert_feed_forward_length wide, an untied head.
    "gpt-oss": ArchRule(
        qkv_bias="required",
        head_required=True,
        experts="required",
        expert_ffn_key=True,
        ffn_norm="post_attention_norm",
        attn_sinks=True,
        output_bias=True,
        router_bias=True,
        expert_bias=True,
    ),
    "qwen3next": _QWEN3NEXT,
    # Qwen3.5's MoE (src/models/qwen35moe.cpp): qwen3next's blocks with separate ssm_beta and
    # ssm_alpha, always attn_qkv + attn_gate, multi-axis RoPE (rope.dimension_sections).
    "qwen35moe": replace(_QWEN3NEXT, delta_net="qwen35"),
}
"""The rule of every ``general.architecture`` Strata knows, from llama.cpp's loader and graphs
(``src/models/<arch>.cpp``)."""


@dataclass(frozen=True)
class ArchTensor:
    """One tensor of an architecture.

    Attributes:
        name: GGUF name, e.g. ``blk.3.attn_q.weight``.
        key: the name without ``blk.N.``, e.g. ``attn_q.weight`` (what :func:`file_tensors`'s
            ``optional`` selects by).
        kind: gguf-py's ``MODEL_TENSOR`` (a bias shares its weight's).
        layer: block index, None outside the blocks.
        shape: GGUF order (ne0, the row length, first), elements.
        optional: a file may have it or not; required otherwise.
    """

    name: str
    key: str
    kind: MODEL_TENSOR
    layer: int | None
    shape: tuple[int, ...]
    optional: bool


def arch_rule(arch: Architecture) -> ArchRule:
    """The rule of ``arch.name``.

    Raises:
        StrataError: an architecture this inventory does not have, which the executor cannot
            run (names the known ones).
    """
    rule = ARCHITECTURES.get(arch.name)
    if rule is None:
        raise StrataError(
            f"architecture {arch.name!r} is not supported by the executor yet "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return rule


def executor_rule(arch: Architecture | str) -> ArchRule:
    """The rule of an architecture the executor runs (``arch`` or its name): what
    ``executor.models.model_class``, the plan loader and the planner of a draft model ask.

    Raises:
        StrataError: an unknown architecture (:func:`arch_rule`'s message), or one Strata
            describes and plans but does not run yet (``ArchRule.not_executed``: one line naming
            it, what is missing and what works).
    """
    name = arch if isinstance(arch, str) else arch.name
    rule = ARCHITECTURES.get(name)
    if rule is None:
        runs = sorted(n for n, r in ARCHITECTURES.items() if not r.not_executed)
        raise StrataError(
            f"architecture {name!r} is not supported by the executor yet "
            f"(supported: {', '.join(runs)})"
        )
    if rule.not_executed:
        raise StrataError(
            f"architecture {name!r} cannot be run: {rule.not_executed}; `strata describe` "
            "and `strata plan` work for it (its plans are for reading and comparing)"
        )
    return rule


def has_experts(arch: Architecture) -> bool:
    """Whether the blocks are MoE; refuses what llama.cpp refuses (``ArchRule.experts``).

    Raises:
        StrataError: experts where the architecture has none, none where it needs them, or an
            ``expert_used_count`` outside 1..``expert_count``.
    """
    rule = arch_rule(arch)
    if not arch.expert_count:
        if rule.experts == "required":
            raise StrataError(
                f"{arch.name} needs {arch.name}.expert_count > 0 (a mixture-of-experts "
                "architecture); the GGUF has none"
            )
        return False
    if rule.experts == "none":
        raise StrataError(
            f"{arch.name} with experts ({arch.name}.expert_count = {arch.expert_count}) is "
            "not an architecture llama.cpp or Strata runs"
        )
    if not 1 <= arch.expert_used_count <= arch.expert_count:
        raise StrataError(
            f"{arch.name}.expert_used_count is {arch.expert_used_count}; it must be 1.."
            f"{arch.expert_count} (expert_count)"
        )
    return True


def expert_width(arch: Architecture) -> int:
    """One routed expert's FFN width, elements (``ArchRule.expert_ffn_key``; llama.cpp's
    ``n_ff_exp``)."""
    if arch_rule(arch).expert_ffn_key:
        return arch.expert_feed_forward_length or arch.feed_forward_length // arch.expert_used_count
    return arch.feed_forward_length


def shared_width(arch: Architecture) -> int:
    """The shared expert's FFN width, elements: ``expert_shared_count * expert_width`` for the
    architectures with ungated shared experts (``ArchRule.shared_count``: llama.cpp's
    ``n_ff_exp * n_expert_shared``; 0 where the file has no shared expert), else
    ``expert_shared_feed_forward_length`` or ``feed_forward_length`` (llama.cpp's qwen2moe
    rule)."""
    if arch_rule(arch).shared_count:
        return arch.expert_shared_count * expert_width(arch)
    return arch.expert_shared_feed_forward_length or arch.feed_forward_length


def moe_block(arch: Architecture, layer: int) -> bool:
    """Whether block ``layer``'s FFN is a mixture of experts: the model has experts and the
    block is past the ``leading_dense_block_count`` dense ones (llama.cpp: ``il >=
    n_layer_dense_lead``; the key is read only for ``ArchRule.leading_dense`` architectures,
    ``strata.common.describe``)."""
    return bool(arch.expert_count) and layer >= arch.leading_dense_block_count


def mla_dims(arch: Architecture) -> tuple[int, int, int, int]:
    """Multi-head latent attention's widths per head: (no-RoPE Q/K dims, RoPE dims, value
    dims, latent rank), from ``key_length_mla``, ``rope_dimension_count``,
    ``value_length_mla`` and ``kv_lora_rank`` (llama.cpp's ``n_embd_head_qk_nope``,
    ``n_embd_head_qk_rope``, ``n_embd_head_v_mla``, ``n_lora_kv``)."""
    rope = arch.rope_dimension_count
    return arch.key_length_mla - rope, rope, arch.value_length_mla, arch.kv_lora_rank


_GQA = {M.ATTN_Q, M.ATTN_K, M.ATTN_V, M.ATTN_OUT}
"""The grouped-query attention's projections, which latent attention replaces."""


def _mla_attention(arch: Architecture) -> list[_Entry]:
    """One block's multi-head latent attention tensors, as llama.cpp's deepseek2 loader creates
    them (``load_arch_tensors``): Q through ``attn_q_a`` [d, q_rank], ``attn_q_a_norm``
    [q_rank] and ``attn_q_b`` [q_rank, heads * (nope + rope)] where ``q_lora_rank`` > 0, else
    ``attn_q`` [d, heads * (nope + rope)]; ``attn_kv_a_mqa`` [d, rank + rope] (the latent and
    the shared RoPE'd key part), ``attn_kv_a_norm`` [rank]; the latent's per-head expansion
    ``attn_k_b`` [nope, rank, heads] and ``attn_v_b`` [rank, v, heads], or in the legacy
    layout one ``attn_kv_b`` [rank, heads * (nope + v)]; ``attn_output`` [heads * v, d]."""
    d, h, qr = arch.embedding_length, arch.head_count, arch.q_lora_rank
    nope, rope, v, rank = mla_dims(arch)
    qk = nope + rope
    out: list[_Entry] = []
    if qr:
        out += [
            (M.ATTN_Q_A, "weight", (d, qr), "required"),
            (M.ATTN_Q_A_NORM, "weight", (qr,), "required"),
            (M.ATTN_Q_B, "weight", (qr, h * qk), "required"),
        ]
    else:
        out.append((M.ATTN_Q, "weight", (d, h * qk), "required"))
    out += [
        (M.ATTN_KV_A_MQA, "weight", (d, rank + rope), "required"),
        (M.ATTN_KV_A_NORM, "weight", (rank,), "required"),
    ]
    if arch.mla_legacy_kv_b:
        out.append((M.ATTN_KV_B, "weight", (rank, h * (nope + v)), "required"))
    else:
        out += [
            (M.ATTN_K_B, "weight", (nope, rank, h), "required"),
            (M.ATTN_V_B, "weight", (rank, v, h), "required"),
        ]
    out.append((M.ATTN_OUT, "weight", (h * v, d), "required"))
    return out


# One entry of a tensor list: (kind, suffix, shape, presence); "none" entries are left out.
_Entry = tuple[MODEL_TENSOR, str, tuple[int, ...], Presence]

_ATTENTION = {M.ATTN_Q, M.ATTN_K, M.ATTN_V, M.ATTN_OUT, M.ATTN_Q_NORM, M.ATTN_K_NORM}
"""An attention block's tensors that a gated delta-net block has none of."""


def delta_net_dims(arch: Architecture) -> tuple[int, int, int]:
    """A gated delta-net block's widths: (key width, value width, conv channels) = (``k``,
    ``v``, ``2k + v``) with ``k = ssm_state_size * ssm_group_count`` (key heads of the state
    size) and ``v = ssm_state_size * ssm_time_step_rank`` (value heads of the same size), as
    llama.cpp's qwen3next/qwen35 loaders size them (``key_dim``, ``value_dim``, ``conv_dim``;
    ``strata.common.describe`` checks that ``ssm_inner_size`` is this ``v``)."""
    k = arch.ssm_state_size * arch.ssm_group_count
    v = arch.ssm_state_size * arch.ssm_time_step_rank
    return k, v, 2 * k + v


def _delta_net(arch: Architecture, rule: ArchRule) -> list[_Entry]:
    """One gated delta-net block's tensors in place of attention, as llama.cpp's loader creates
    them (``load_tensors``, qwen3next and qwen35moe; ``nv`` value heads, ``ds`` the state size,
    ``k``/``v``/``c`` from :func:`delta_net_dims`):

    - the input projections: qwen3next either ``ssm_in`` [d, 2k + 2v] (Q, K, V and the output
      gate Z interleaved per key head: the converter's older layout) or ``attn_qkv``
      [d, 2k + v] and ``attn_gate`` [d, v] — all three optional to the loader, which takes
      either set; qwen35 always ``attn_qkv`` and ``attn_gate``;
    - ``ssm_conv1d`` [conv_kernel, c]: the causal depthwise convolution over Q, K and V;
    - ``ssm_dt.bias`` [nv] and ``ssm_a`` [nv] (no ``.weight``: ``-exp(A_log)``): the decay
      gate's bias and rate per value head;
    - qwen3next ``ssm_ba`` [d, 2 nv] (beta and alpha per value head), qwen35 ``ssm_beta`` and
      ``ssm_alpha`` [d, nv] each;
    - ``ssm_norm`` [ds]: the gated RMSNorm of each head's output; ``ssm_out`` [v, d].
    """
    d, nv, ds = arch.embedding_length, arch.ssm_time_step_rank, arch.ssm_state_size
    k, v, c = delta_net_dims(arch)
    either: Presence = "optional" if rule.delta_net == "qwen3next" else "required"
    out: list[_Entry] = [
        (M.SSM_IN, "weight", (d, 2 * k + 2 * v), "optional" if either == "optional" else "none"),
        (M.ATTN_QKV, "weight", (d, c), either),
        (M.ATTN_GATE, "weight", (d, v), either),
        (M.SSM_CONV1D, "weight", (arch.ssm_conv_kernel, c), "required"),
        (M.SSM_DT, "bias", (nv,), "required"),
        (M.SSM_A, "", (nv,), "required"),
    ]
    if rule.delta_net == "qwen3next":
        out.append((M.SSM_BETA_ALPHA, "weight", (d, 2 * nv), "required"))
    else:
        out += [
            (M.SSM_BETA, "weight", (d, nv), "required"),
            (M.SSM_ALPHA, "weight", (d, nv), "required"),
        ]
    out += [
        (M.SSM_NORM, "weight", (ds,), "required"),
        (M.SSM_OUT, "weight", (v, d), "required"),
    ]
    return out


def _globals(arch: Architecture, rule: ArchRule) -> tuple[list[_Entry], list[_Entry]]:
    """The tensors before the blocks and after them."""
    d, v = arch.embedding_length, arch.vocab_size
    head: Presence = "required" if rule.head_required else "optional"
    before: list[_Entry] = [(M.TOKEN_EMBD, "weight", (d, v), "required")]
    if rule.rope_freqs:  # one frequency factor per rotated pair
        before.append((M.ROPE_FREQS, "weight", (arch.rope_dimension_count // 2,), "optional"))
    after: list[_Entry] = [
        (M.OUTPUT_NORM, "weight", (d,), "required"),
        (M.OUTPUT, "weight", (d, v), head),
    ]
    return before, after


def _block(arch: Architecture, rule: ArchRule, moe: bool) -> list[_Entry]:
    """One block's tensors (the same in every MoE block, and in every dense one)."""
    d, hd, ff = arch.embedding_length, arch.head_dim, arch.feed_forward_length
    q, kv = arch.head_count * hd, arch.head_count_kv * hd
    full = rule.qk_norm == "full"
    qk_norm: Presence = "none" if rule.qk_norm == "none" else "required"
    if rule.qk_norm_optional and qk_norm == "required":
        qk_norm = "optional"
    post: Presence = "required" if rule.post_norms else "none"
    ffn_norm = M.FFN_NORM if rule.ffn_norm == "ffn_norm" else M.ATTN_POST_NORM
    out: list[_Entry] = [
        (M.ATTN_NORM, "weight", (d,), "required"),
        # Gated attention (delta_net hybrids): each head's query, then its output gate.
        (M.ATTN_Q, "weight", (d, 2 * q if rule.delta_net != "none" else q), "required"),
        (M.ATTN_K, "weight", (d, kv), "required"),
        (M.ATTN_V, "weight", (d, kv), "required"),
        (M.ATTN_OUT, "weight", (q, d), "required"),
        (M.ATTN_Q, "bias", (q,), rule.qkv_bias),
        (M.ATTN_K, "bias", (kv,), rule.qkv_bias),
        (M.ATTN_V, "bias", (kv,), rule.qkv_bias),
        (M.ATTN_OUT, "bias", (d,), "required" if rule.output_bias else "none"),
        (M.ATTN_SINKS, "weight", (arch.head_count,), "required" if rule.attn_sinks else "none"),
        (M.ATTN_Q_NORM, "weight", (q,) if full else (hd,), qk_norm),
        (M.ATTN_K_NORM, "weight", (kv,) if full else (hd,), qk_norm),
        (M.ATTN_POST_NORM, "weight", (d,), post),
        (ffn_norm, "weight", (d,), "required"),
    ]
    if rule.mla:  # latent attention's tensors in place of Q/K/V/O (the biases and norms: none)
        out = [out[0], *_mla_attention(arch), *(e for e in out[1:] if e[0] not in _GQA)]
    if moe:
        # No fused ffn_gate_up_exps: llama.cpp loads it for none of these architectures (it fails
        # on the missing ffn_gate_exps), so a file with it is refused as having an unused tensor.
        e, fe = arch.expert_count, expert_width(arch)
        shexp: Presence = "required" if rule.shared_expert else "none"
        shared: Presence = "required" if rule.shared_count and arch.expert_shared_count else "none"
        sh = shared_width(arch)
        out += [
            (M.FFN_GATE_INP, "weight", (d, e), "required"),
            (M.FFN_GATE_INP, "bias", (e,), "required" if rule.router_bias else "none"),
            (M.FFN_EXP_PROBS_B, "bias", (e,), rule.probs_bias),
            (M.FFN_GATE_EXP, "weight", (d, fe, e), "required"),
            (M.FFN_UP_EXP, "weight", (d, fe, e), "required"),
            (M.FFN_DOWN_EXP, "weight", (fe, d, e), "required"),
            (M.FFN_GATE_EXP, "bias", (fe, e), "required" if rule.expert_bias else "none"),
            (M.FFN_UP_EXP, "bias", (fe, e), "required" if rule.expert_bias else "none"),
            (M.FFN_DOWN_EXP, "bias", (d, e), "required" if rule.expert_bias else "none"),
            (M.FFN_GATE_INP_SHEXP, "weight", (d,), shexp),
            (M.FFN_GATE_SHEXP, "weight", (d, sh), shexp if rule.shared_expert else shared),
            (M.FFN_UP_SHEXP, "weight", (d, sh), shexp if rule.shared_expert else shared),
            (M.FFN_DOWN_SHEXP, "weight", (sh, d), shexp if rule.shared_expert else shared),
        ]
    else:
        out += [
            (M.FFN_GATE, "weight", (d, ff), "required"),
            (M.FFN_UP, "weight", (d, ff), "required"),
            (M.FFN_DOWN, "weight", (ff, d), "required"),
        ]
    out.append((M.FFN_POST_NORM, "weight", (d,), post))
    return out


def inventory(arch: Architecture) -> list[ArchTensor]:
    """Every tensor a GGUF of ``arch`` may have, with its shape, in the converter's order.

    Raises:
        StrataError: an unknown architecture, or experts llama.cpp would refuse
            (:func:`has_experts`).
    """
    rule = arch_rule(arch)
    moe = has_experts(arch)
    before, after = _globals(arch, rule)
    blocks = {m: _block(arch, rule, m) for m in {False, moe}}
    # Hybrids: a gated delta-net block is an attention block with the delta-net's tensors in
    # place of the attention's (the norms and the FFN are the same).
    linear = {
        m: [b[0], *_delta_net(arch, rule), *(e for e in b[1:] if e[0] not in _ATTENTION)]
        for m, b in blocks.items()
    }
    recurrent = set(arch.recurrent_layers) if rule.delta_net != "none" else set()

    def tensors(entries: list[_Entry], layer: int | None) -> Iterator[ArchTensor]:
        for kind, suffix, shape, presence in entries:
            if presence == "none":
                continue
            stem = TENSOR_NAMES[kind]
            dot = f".{suffix}" if suffix else ""  # ssm_a has no .weight
            name = f"{stem.format(bid=layer)}{dot}"
            key = f"{stem.removeprefix('blk.{bid}.')}{dot}"
            yield ArchTensor(name, key, kind, layer, shape, presence == "optional")

    out = list(tensors(before, None))
    for i in range(arch.block_count):
        out += tensors((linear if i in recurrent else blocks)[moe and moe_block(arch, i)], i)
    out += tensors(after, None)
    return out


def expected_shapes(arch: Architecture) -> dict[str, list[int] | None]:
    """Tensor name -> GGUF shape the forward pass needs, None for an optional tensor (taken when
    present, whatever its shape, as before the inventory existed); a name not here is a tensor
    the forward pass does not use (``executor.engine.check_tensors``).

    Raises:
        StrataError: as :func:`inventory`.
    """
    return {t.name: None if t.optional else list(t.shape) for t in inventory(arch)}


def file_tensors(arch: Architecture, optional: Collection[str] = ()) -> list[ArchTensor]:
    """The tensors llama.cpp's converter writes for ``arch``: the required ones, the head unless
    the embeddings are tied, and the optional ones whose ``key`` is in ``optional`` (e.g.
    ``rope_freqs.weight``, ``attn_q.bias``; a required one there is written anyway).

    Raises:
        StrataError: as :func:`inventory`, or a key in ``optional`` that is no tensor of the
            architecture (llama.cpp's loader would not take it).
    """
    tensors = inventory(arch)
    if unknown := set(optional) - {t.key for t in tensors}:
        raise StrataError(
            f"{arch.name} has no tensor {sorted(unknown)[0]} (llama.cpp's {arch.name} does not "
            "load it); check the architecture's settings"
        )
    wanted = set(optional)
    if not arch.tied_embeddings:
        wanted.add(TENSOR_NAMES[M.OUTPUT] + ".weight")
    return [t for t in tensors if not t.optional or t.key in wanted]


def same_up_to_trailing_ones(have: Sequence[int], want: Sequence[int]) -> bool:
    """Whether a tensor of GGUF shape ``have`` is one of shape ``want`` as llama.cpp's loader
    sees it: equal once both are padded with one-element dimensions to the same rank
    (``check_tensor_dims`` compares all four ``ne`` of the ggml tensor, the unused ones 1), e.g.
    ``[64, 1]`` is ``[64]``, ``[64, 2]`` is not ``[64]``."""
    n = max(len(have), len(want))
    return [*have, *[1] * (n - len(have))] == [*want, *[1] * (n - len(want))]


def loader_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Tensor name -> the GGUF shape the inventory gives it (optional tensors included), for
    reading a file's shapes as llama.cpp does (:func:`conformed_shape`); empty for an
    architecture the inventory does not have or refuses (the executor refuses those itself, with
    :func:`arch_rule`'s and :func:`has_experts`' messages; a description still lists the file's
    shapes)."""
    try:
        return {t.name: t.shape for t in inventory(arch)}
    except StrataError:
        return {}


def conformed_shape(shape: list[int], want: Sequence[int] | None) -> list[int]:
    """``shape`` (GGUF order) as the forward pass takes it: ``want`` where the two are equal up
    to trailing one-element dimensions (:func:`same_up_to_trailing_ones`: the same bytes, e.g. a
    ``[d, 1]`` gate read as ``[d]``), else ``shape`` itself (a real mismatch, refused by
    ``executor.engine.check_tensors``)."""
    if want is None or list(want) == shape or not same_up_to_trailing_ones(shape, want):
        return shape
    return list(want)
