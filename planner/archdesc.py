"""Model descriptions of GGUF files you don't have: architecture hyperparameters + a file type.

``strata describe --arch FILE.yaml --ftype Q4_K_M`` describes the GGUF that llama.cpp would
make of a model: the tensors its converter writes for the architecture (names and shapes), the
GGML type llama.cpp's quantizer picks for each under the file type, and their bytes. The result is
an ordinary ``ModelDescription`` (units, access, FLOPs built by ``strata.common.describe``'s own
code), so it can be planned, explained and diffed against other machines; it cannot be executed
(its ``model.sha256`` and ``size_bytes`` are None and ``execute.py`` refuses such plans).

The architecture file (``profiles/arch/*.yaml``, schema ``ArchSpec``) holds the hyperparameters of
the model's published ``config.json``. The tensors, as ``convert_hf_to_gguf.py`` writes them, are
the architecture's in ``strata.common.tensors`` (names and GGUF shapes): the required ones,
``output.weight`` unless the embeddings are tied, ``rope_freqs.weight`` for llama3 RoPE scaling,
``attn_{q,k,v}.bias`` where ``attention_bias`` is set (qwen2 always has them) and the router's
selection bias ``exp_probs_b.bias`` where ``expert_selection_bias`` is. 1-D tensors,
biases, the router and ``rope_freqs`` are F32 (the converter keeps them F32 and the quantizer never
touches them); the other 2-D/3-D weights are quantized.

Types follow llama.cpp's ``src/llama-quant.cpp`` at commit
007dbbf3fd17eefe9b47fee45f48f7ba5e62b714 (ggml-org/llama.cpp): ``tensor_allows_quantization``,
``llama_ftype_get_default_type``, ``llama_tensor_get_type_impl`` and ``tensor_type_fallback``,
without an importance matrix, overrides or ``--pure``. The rules of the supported file types:

- base type per file type (Q4_K_M -> Q4_K, Q5_K_M -> Q5_K, ...); F16/BF16/F32 files keep every
  weight at that type with no mix;
- ``output.weight`` (and a tied ``token_embd``, which is also the head): Q8_0 when its row length is
  not a multiple of the base type's block, else Q6_K unless the base is Q8_0; an untied
  ``token_embd`` keeps the base type;
- ``attn_v``: Q6_K where ``use_more_bits(i, n)`` holds for Q4_K_M/Q5_K_M; Q5_K on the first 4
  for Q4_K_S; then Q3_K/Q4_K -> Q5_K on 70B models (llama dense with 80 layers and GQA, qwen2 with
  80 layers: llama.cpp's ``LLM_TYPE_70B``); then Q8_0 on 8-expert models (also ``attn_k``);
- ``ffn_down``: Q6_K where ``use_more_bits`` holds for Q4_K_M and Q5_K_M; Q5_K on the first n/8
  for Q4_K_S; ``attn_output`` Q5_K on 8-expert models for Q4_K_S/Q4_K_M;
- ``attn_v``'s rules hold for every tensor llama.cpp counts as V (``category_is_attn_v``:
  ``attn_qkv``, MLA's legacy ``attn_kv_b``); llama.cpp's ``LLM_TYPE_70B`` is only ever a llama
  or qwen2;
- MXFP4_MOE (gpt-oss's own file type): ``output.weight`` Q8_0, every other quantizable tensor
  MXFP4 where it has a third dimension over 1 (the stacked experts) and Q8_0 otherwise;
- a row length (ne0) that is not a multiple of the type's block falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even that does not fit.

llama.cpp counts attn_v and ffn_down tensors in the order its loader sorts them
(``weight_name_comparer`` in ``src/llama-model-loader.h``: block number, then name), so its
counters ``i_attention_wv`` / ``i_ffn_down`` equal the block index here, and MoE models parse the
block from the name anyway: ``use_more_bits`` is applied to the block index — except qwen3next,
whose delta-net blocks hold no V tensor (their ``ssm_in`` is none), so its ``attn_v`` counts
among the full-attention blocks only (``use_more_bits(j, n_attention)`` for the j-th). The hybrids'
``ssm_conv1d`` is never quantized (``tensor_allows_quantization``); ``ssm_a`` and ``ssm_dt.bias``
are 1-D and ``ssm_norm`` a norm, so F32; ``ssm_in``, ``ssm_out``, ``ssm_ba``/``ssm_beta``/
``ssm_alpha`` and ``attn_gate`` take the base type (llama.cpp's ``OTHER`` category).
(Quantizers from before that comparer sorted names as strings, blk.10 before blk.2: the same
number of bumped layers, so the same total, on other blocks.) Tensors are listed in that order
too, the order ``llama-quantize`` writes, and ``offset`` is the position in the tensor-data
section (aligned to 32 bytes, GGUF's default): the header's size is unknown without the
tokenizer.

Bytes: ``bytes_gguf`` from ``gguf.GGML_QUANT_SIZES``; ``bytes_mlx`` and everything else from
``strata.common.describe`` (``mlx_size``, ``tensor_info``, ``assemble``). The sum of tensor bytes
is the file size less its header (metadata and tokenizer: a few MB).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from pydantic import Field, model_validator
from strata.common.describe import assemble, tensor_info
from strata.common.errors import StrataError
from strata.common.schemas import Architecture, ModelDescription, ModelSource, Strict
from strata.common.tensors import file_tensors
from strata.common.yamlio import canonical_sha256, read_yaml

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

GGUF_ALIGNMENT = 32
"""GGUF's default ``general.alignment``: each tensor's data starts at a multiple of it (gguf.md)."""


# --------------------------------------------------------------------------- architecture file


class RopeScaling(Strict):
    """RoPE frequency scaling as in the model's ``config.json`` ``rope_scaling``.

    ``llama3`` (Llama 3.1+: adds a ``rope_freqs`` tensor) takes ``low_freq_factor`` and
    ``high_freq_factor``; ``yarn`` (gpt-oss, DeepSeek-V3: no tensor, GGUF
    ``rope.scaling.type`` yarn and ``rope.scaling.factor``) takes ``beta_fast``/``beta_slow``
    and DeepSeek's ``mscale``/``mscale_all_dim`` where the config gives them.
    """

    type: Literal["llama3", "yarn"] = Field(
        description="rope_type; llama3 adds a rope_freqs tensor, yarn none"
    )
    factor: float = Field(gt=0)
    low_freq_factor: float | None = Field(default=None, gt=0, description="llama3 only")
    high_freq_factor: float | None = Field(default=None, gt=0, description="llama3 only")
    original_context_length: int = Field(ge=1, description="original_max_position_embeddings")
    beta_fast: float | None = Field(default=None, gt=0, description="yarn only")
    beta_slow: float | None = Field(default=None, gt=0, description="yarn only")
    mscale: float | None = Field(default=None, gt=0, description="yarn (DeepSeek) only")
    mscale_all_dim: float | None = Field(default=None, gt=0, description="yarn (DeepSeek) only")

    @model_validator(mode="after")
    def _kind(self) -> RopeScaling:
        llama3 = (self.low_freq_factor, self.high_freq_factor)
        yarn = (self.beta_fast, self.beta_slow, self.mscale, self.mscale_all_dim)
        if self.type == "llama3" and (None in llama3 or any(v is not None for v in yarn)):
            raise ValueError(
                "llama3 rope_scaling takes low_freq_factor and high_freq_factor (both), no "
                "beta_*/mscale*"
            )
        if self.type == "yarn" and any(v is not None for v in llama3):
            raise ValueError("yarn rope_scaling takes no low_freq_factor/high_freq_factor")
        return self


class ArchSpec(Strict):
    """A model's architecture hyperparameters (from its published ``config.json``)."""

    name: Literal["llama", "qwen2", "gpt-oss", "deepseek2", "qwen3next", "qwen35moe"] = Field(
        description="GGUF general.architecture (Mixtral-style MoE models are llama with experts)"
    )
    display_name: str = Field(min_length=1, description="e.g. Qwen2.5-14B-Instruct")
    source: str = Field(min_length=1, description="where the numbers come from (config.json URL)")
    block_count: int = Field(ge=1, description="num_hidden_layers")
    embedding_length: int = Field(ge=1, description="hidden_size d")
    feed_forward_length: int = Field(ge=1, description="intermediate_size (per expert for MoE)")
    head_count: int = Field(ge=1, description="num_attention_heads")
    head_count_kv: int = Field(ge=1, description="num_key_value_heads")
    head_dim: int = Field(ge=1, description="per-head dimension (hidden_size / heads usually)")
    vocab_size: int = Field(ge=1, description="rows of the embedding (the padded vocabulary)")
    context_length: int = Field(ge=1, description="max_position_embeddings, tokens")
    rope_freq_base: float = Field(gt=0, description="rope_theta")
    rms_norm_eps: float = Field(gt=0)
    tied_embeddings: bool = Field(description="tie_word_embeddings: no output.weight")
    attention_bias: bool = Field(
        default=False, description="Q, K and V projections have biases (qwen2)"
    )
    expert_count: int = Field(default=0, ge=0, description="num_local_experts, 0 for dense")
    expert_used_count: int = Field(default=0, ge=0, description="num_experts_per_tok")
    rope_scaling: RopeScaling | None = None
    # The MoE of DeepSeek-V3-style models (GGUF {arch}.expert_* and leading_dense_block_count).
    expert_feed_forward_length: int = Field(
        default=0,
        ge=0,
        description="moe_intermediate_size: one routed expert's width where the dense blocks' "
        "intermediate_size differs (gpt-oss, deepseek2; 0: feed_forward_length)",
    )
    expert_shared_count: int = Field(
        default=0, ge=0, description="n_shared_experts: ungated shared experts (deepseek2)"
    )
    leading_dense_block_count: int = Field(
        default=0, ge=0, description="first_k_dense_replace: leading blocks with a dense FFN"
    )
    expert_gating_func: Literal["softmax", "sigmoid"] | None = Field(
        default=None, description="scoring_func (None: the architecture's default)"
    )
    expert_weights_norm: bool | None = Field(
        default=None, description="norm_topk_prob (None: the architecture's default)"
    )
    expert_weights_scale: float = Field(
        default=0.0, ge=0, description="routed_scaling_factor (0: none)"
    )
    expert_selection_bias: bool = Field(
        default=False,
        description="topk_method noaux_tc: the router's e_score_correction_bias, added for "
        "choosing the experts only (GGUF exp_probs_b.bias; DeepSeek-V3)",
    )
    expert_group_count: int = Field(default=0, ge=0, description="n_group (grouped top-k)")
    expert_group_used_count: int = Field(default=0, ge=0, description="topk_group")
    # Multi-head latent attention (deepseek2): head_dim is qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: int = Field(default=0, ge=0, description="q_lora_rank (0: one attn_q)")
    kv_lora_rank: int = Field(default=0, ge=0, description="kv_lora_rank (0: not MLA)")
    qk_rope_head_dim: int = Field(default=0, ge=0, description="MLA: RoPE'd dims of a Q/K head")
    v_head_dim: int = Field(default=0, ge=0, description="MLA: one head's value width")
    mla_legacy_kv_b: bool = Field(
        default=False,
        description="MLA as converters before llama.cpp's attn_k_b/attn_v_b split wrote it: "
        "one attn_kv_b per block",
    )
    # Windowed attention (gpt-oss).
    sliding_window: int = Field(default=0, ge=0, description="sliding_window, tokens (0: none)")
    sliding_window_pattern: int = Field(
        default=0,
        ge=0,
        description="llama.cpp's period n (set_swa_pattern): block i is windowed when n == 0 or "
        "i % n < n - 1 (gpt-oss: 2, the even blocks)",
    )
    # Hybrid linear attention (qwen3next, qwen35moe: GGUF {arch}.ssm.* and
    # full_attention_interval), with qwen2moe's gated shared expert.
    expert_shared_feed_forward_length: int = Field(
        default=0, ge=0, description="shared_expert_intermediate_size (qwen3next, qwen35moe)"
    )
    rope_dimension_count: int = Field(
        default=0,
        ge=0,
        description="rotated dims of a head: head_dim x partial_rotary_factor (0: head_dim)",
    )
    rope_sections: list[int] = Field(
        default_factory=list,
        description="mrope_section padded to 4 (qwen35moe's rope.dimension_sections)",
    )
    full_attention_interval: int = Field(
        default=0, ge=0, description="every n-th block is full attention, the others delta-net"
    )
    ssm_conv_kernel: int = Field(default=0, ge=0, description="linear_conv_kernel_dim")
    ssm_state_size: int = Field(
        default=0, ge=0, description="linear_key_head_dim (= linear_value_head_dim)"
    )
    ssm_group_count: int = Field(default=0, ge=0, description="linear_num_key_heads")
    ssm_time_step_rank: int = Field(default=0, ge=0, description="linear_num_value_heads")

    @model_validator(mode="after")
    def _consistent(self) -> ArchSpec:
        if (self.expert_count == 0) != (self.expert_used_count == 0):
            raise ValueError(
                "expert_count and expert_used_count must both be 0 (dense) or both positive"
            )
        if self.expert_used_count > self.expert_count:
            raise ValueError("expert_used_count must not exceed expert_count")
        if self.head_count % self.head_count_kv:
            raise ValueError("head_count must be a multiple of head_count_kv")
        if self.name == "qwen2" and not self.attention_bias:
            raise ValueError(
                "qwen2 has Q, K and V biases (llama.cpp requires them): set attention_bias: true"
            )
        mla = (self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim)
        if (self.name == "deepseek2") != all(mla) or (self.name != "deepseek2" and any(mla)):
            raise ValueError(
                "kv_lora_rank, qk_rope_head_dim and v_head_dim (multi-head latent attention) "
                "are all positive for deepseek2 and absent otherwise"
            )
        if self.qk_rope_head_dim >= self.head_dim:
            raise ValueError(
                "head_dim (qk_nope_head_dim + qk_rope_head_dim) must exceed qk_rope_head_dim"
            )
        if self.leading_dense_block_count >= self.block_count:
            raise ValueError("leading_dense_block_count must leave at least one MoE block")
        ssm = (
            self.full_attention_interval,
            self.ssm_conv_kernel,
            self.ssm_state_size,
            self.ssm_group_count,
            self.ssm_time_step_rank,
        )
        hybrid = self.name in ("qwen3next", "qwen35moe")
        if (hybrid and not all(ssm)) or (not hybrid and any(ssm)):
            raise ValueError(
                "full_attention_interval and ssm_conv_kernel, ssm_state_size, ssm_group_count, "
                "ssm_time_step_rank (gated delta-net) are all positive for qwen3next and "
                "qwen35moe and absent otherwise"
            )
        if hybrid and self.ssm_time_step_rank % self.ssm_group_count:
            raise ValueError("ssm_time_step_rank must be a multiple of ssm_group_count")
        if (self.name == "qwen35moe") != bool(self.rope_sections):
            raise ValueError("rope_sections are given for qwen35moe, and only for it")
        if self.rope_dimension_count > self.head_dim or self.rope_dimension_count % 2:
            raise ValueError("rope_dimension_count must be even and at most head_dim")
        return self


def read_arch(path: str | Path) -> ArchSpec:
    """Read and validate an architecture file.

    Raises:
        SchemaError: missing file, bad YAML, a typo (names the key) or an inconsistent value.
    """
    return read_yaml(path, ArchSpec)


def _f32(x: float) -> float:
    # GGUF stores these hyperparameters as float32; round the same way so that a description made
    # from an arch file equals one read from the real GGUF.
    return float(np.float32(x))


def architecture(spec: ArchSpec) -> Architecture:
    """The ``Architecture`` a GGUF of this model would carry in its metadata, as
    ``strata.common.describe.read_architecture`` reads it from the file ``convert_hf_to_gguf.py``
    writes.

    Beyond the llama fields (the optional ones are passed only where the file sets them, so a
    llama or qwen2 description is unchanged):

    - YaRN RoPE scaling: ``rope_scaling_type`` yarn and ``rope_freq_scale`` = 1 / factor (the
      factor a float32, as GGUF stores it); llama3 scaling is the ``rope_freqs`` tensor instead;
    - the DeepSeek-style MoE keys (expert width, shared experts, leading dense blocks, gating,
      weight norm and scale, grouped top-k) as given;
    - multi-head latent attention (deepseek2): the converter writes it as MQA
      (``DeepseekV2Model.set_gguf_parameters``: ``num_key_value_heads`` = 1) with
      ``key_length`` = kv_lora_rank + qk_rope_head_dim, ``key_length_mla`` = head_dim and
      ``value_length_mla`` = v_head_dim, and ``rope.dimension_count`` = qk_rope_head_dim; the
      legacy layout (``mla_legacy_kv_b``) kept the config's KV heads and ``key_length`` =
      head_dim;
    - windowed attention: ``sliding_window`` and the windowed blocks from the period
      (llama.cpp's ``set_swa_pattern``).
    """
    extra: dict = {}
    head_count_kv, head_dim, rope_dims = spec.head_count_kv, spec.head_dim, spec.head_dim
    if spec.rope_scaling is not None and spec.rope_scaling.type == "yarn":
        extra["rope_scaling_type"] = "yarn"
        extra["rope_freq_scale"] = 1.0 / _f32(spec.rope_scaling.factor)
    for key in (
        "expert_feed_forward_length",
        "expert_shared_count",
        "leading_dense_block_count",
        "expert_gating_func",
        "expert_weights_norm",
        "expert_group_count",
        "expert_group_used_count",
    ):
        value = getattr(spec, key)
        if value or (key == "expert_weights_norm" and value is not None):
            extra[key] = value
    if spec.expert_weights_scale:
        extra["expert_weights_scale"] = _f32(spec.expert_weights_scale)
    if spec.kv_lora_rank:
        rope_dims = spec.qk_rope_head_dim
        extra |= {
            "q_lora_rank": spec.q_lora_rank,
            "kv_lora_rank": spec.kv_lora_rank,
            "key_length_mla": spec.head_dim,
            "value_length_mla": spec.v_head_dim,
        }
        if spec.mla_legacy_kv_b:
            extra["mla_legacy_kv_b"] = True
        else:
            head_count_kv, head_dim = 1, spec.kv_lora_rank + spec.qk_rope_head_dim
    if spec.sliding_window:
        n = spec.sliding_window_pattern
        extra["sliding_window"] = spec.sliding_window
        extra["sliding_window_layers"] = [
            i for i in range(spec.block_count) if n == 0 or i % n < n - 1
        ]
    if spec.expert_shared_feed_forward_length:
        extra["expert_shared_feed_forward_length"] = spec.expert_shared_feed_forward_length
    if spec.rope_dimension_count:
        rope_dims = spec.rope_dimension_count
    if spec.rope_sections:
        extra["rope_sections"] = spec.rope_sections
    if spec.full_attention_interval:  # Qwen3NextModel.set_gguf_parameters: ssm.* and the interval
        n = spec.full_attention_interval
        extra |= {
            "ssm_conv_kernel": spec.ssm_conv_kernel,
            "ssm_state_size": spec.ssm_state_size,
            "ssm_group_count": spec.ssm_group_count,
            "ssm_time_step_rank": spec.ssm_time_step_rank,
            "ssm_inner_size": spec.ssm_state_size * spec.ssm_time_step_rank,
            "recurrent_layers": [i for i in range(spec.block_count) if (i + 1) % n],
        }
    return Architecture(
        name=spec.name,
        block_count=spec.block_count,
        context_length=spec.context_length,
        embedding_length=spec.embedding_length,
        feed_forward_length=spec.feed_forward_length,
        head_count=spec.head_count,
        head_count_kv=head_count_kv,
        head_dim=head_dim,
        vocab_size=spec.vocab_size,
        rope_freq_base=_f32(spec.rope_freq_base),
        rope_dimension_count=rope_dims,
        rms_norm_eps=_f32(spec.rms_norm_eps),
        tied_embeddings=spec.tied_embeddings,
        expert_count=spec.expert_count,
        expert_used_count=spec.expert_used_count,
        **extra,
    )


# --------------------------------------------------------------------------- file types

#: File types whose llama.cpp type mix this module reproduces, by their short name.
FTYPES: dict[str, gguf.LlamaFileType] = {
    "F32": F.ALL_F32,
    "F16": F.MOSTLY_F16,
    "BF16": F.MOSTLY_BF16,
    "Q4_0": F.MOSTLY_Q4_0,
    "Q4_1": F.MOSTLY_Q4_1,
    "Q5_0": F.MOSTLY_Q5_0,
    "Q5_1": F.MOSTLY_Q5_1,
    "Q8_0": F.MOSTLY_Q8_0,
    "Q4_K_S": F.MOSTLY_Q4_K_S,
    "Q4_K_M": F.MOSTLY_Q4_K_M,
    "Q5_K_S": F.MOSTLY_Q5_K_S,
    "Q5_K_M": F.MOSTLY_Q5_K_M,
    "Q6_K": F.MOSTLY_Q6_K,
    "MXFP4_MOE": F.MOSTLY_MXFP4_MOE,
}

#: ``llama_ftype_get_default_type``: the base tensor type of each supported file type.
BASE_TYPE: dict[gguf.LlamaFileType, gguf.GGMLQuantizationType] = {
    F.ALL_F32: T.F32,
    F.MOSTLY_F16: T.F16,
    F.MOSTLY_BF16: T.BF16,
    F.MOSTLY_Q4_0: T.Q4_0,
    F.MOSTLY_Q4_1: T.Q4_1,
    F.MOSTLY_Q5_0: T.Q5_0,
    F.MOSTLY_Q5_1: T.Q5_1,
    F.MOSTLY_Q8_0: T.Q8_0,
    F.MOSTLY_Q4_K_S: T.Q4_K,
    F.MOSTLY_Q4_K_M: T.Q4_K,
    F.MOSTLY_Q5_K_S: T.Q5_K,
    F.MOSTLY_Q5_K_M: T.Q5_K,
    F.MOSTLY_Q6_K: T.Q6_K,
    F.MOSTLY_MXFP4_MOE: T.MXFP4,
}

#: ``tensor_type_fallback``: the type used when a row length is not a multiple of the block.
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


def parse_ftype(name: str) -> gguf.LlamaFileType:
    """The file type named ``name`` (``Q4_K_M``, ``q4_k_m`` or ``MOSTLY_Q4_K_M``).

    Raises:
        StrataError: not one of ``FTYPES`` (the message lists them).
    """
    key = name.strip().upper().removeprefix("MOSTLY_").removeprefix("ALL_")
    if key not in FTYPES:
        raise StrataError(
            f"unknown or unsupported --ftype {name!r}; supported: {', '.join(FTYPES)}"
        )
    return FTYPES[key]


def short_name(ftype: gguf.LlamaFileType) -> str:
    """``MOSTLY_Q4_K_M`` -> ``Q4_K_M`` (the name ``--ftype`` takes)."""
    return next(k for k, v in FTYPES.items() if v == ftype)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the blocks whose attn_v / ffn_down get a larger type.

    The first and last eighth of the blocks, and every third block in between:
    ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division, as in C).
    """
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


@dataclass(frozen=True)
class _Model:
    """The model facts ``llama_tensor_get_type_impl`` looks at."""

    n_layer: int
    n_expert: int
    tied: bool
    is_70b: bool
    v_blocks: tuple[int, ...] = ()
    """The blocks with a tensor llama.cpp counts as V (``i_attention_wv``), where not every block
    has one: qwen3next's full-attention blocks (its delta-net blocks' ``ssm_in`` is not V).
    Empty: one per block, the counter is the block index."""

    @classmethod
    def of(cls, spec: ArchSpec) -> _Model:
        # llama.cpp's load_hparams: LLM_TYPE_70B is a dense llama of 80 layers with GQA (an
        # 8-expert llama is typed 8x7B/8x22B instead), or a qwen2 of 80 layers; no other
        # architecture here is ever typed 70B.
        if spec.name == "llama":
            is_70b = (
                spec.expert_count != 8
                and spec.block_count == 80
                and spec.head_count != spec.head_count_kv
            )
        else:
            is_70b = spec.name == "qwen2" and spec.block_count == 80
        v_blocks: tuple[int, ...] = ()
        if spec.name == "qwen3next":
            n = spec.full_attention_interval
            v_blocks = tuple(i for i in range(spec.block_count) if (i + 1) % n == 0)
        return cls(spec.block_count, spec.expert_count, spec.tied_embeddings, is_70b, v_blocks)


def _quantizable(name: str, shape: list[int]) -> bool:
    # tensor_allows_quantization: 2-D and 3-D weights only, never norms, the MoE router or a
    # delta-net's small conv1d.
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


def _mix(
    name: str,
    layer: int | None,
    ne0: int,
    new: gguf.GGMLQuantizationType,
    ftype: gguf.LlamaFileType,
    m: _Model,
    stacked: bool = False,
) -> gguf.GGMLQuantizationType:
    """``llama_tensor_get_type_impl`` for the supported file types (no imatrix); ``stacked``:
    the tensor has a third dimension over 1 (``ne[2] > 1``, the stacked experts)."""
    i = layer if layer is not None else 0
    if name == "output.weight" or (m.tied and name == "token_embd.weight"):
        if ftype == F.MOSTLY_MXFP4_MOE or ne0 % gguf.GGML_QUANT_SIZES[new][0]:
            return T.Q8_0
        return new if new == T.Q8_0 else T.Q6_K
    if ftype == F.MOSTLY_MXFP4_MOE:
        # MoE tensors (a third dimension over 1: the stacked experts) MXFP4, the others Q8_0.
        return T.MXFP4 if stacked else T.Q8_0
    if name == "token_embd.weight":
        return new
    if any(k in name for k in ("attn_v.weight", "attn_kv_b.weight", "attn_qkv.weight")):
        # category_is_attn_v: attn_v and the tensors that hold V (MLA's legacy attn_kv_b).
        # llama.cpp counts them (i_attention_wv of n_attention_wv) in loader order.
        i, n = (m.v_blocks.index(i), len(m.v_blocks)) if m.v_blocks else (i, m.n_layer)
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, n):
            new = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and i < 4:
            new = T.Q5_K
        if m.is_70b and new in (T.Q3_K, T.Q4_K):
            # llama.cpp: 8 heads share each attn_v, so it is 8x smaller than attn_q: more bits
            # cost little.
            new = T.Q5_K
        if m.n_expert == 8:
            new = T.Q8_0
    elif "attn_k.weight" in name:
        if m.n_expert == 8:
            new = T.Q8_0
    elif "attn_output.weight" in name:
        if m.n_expert == 8 and ftype in (F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M):
            new = T.Q5_K
    elif "ffn_down" in name:
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M):
            if use_more_bits(i, m.n_layer):
                new = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and i < m.n_layer // 8:
            new = T.Q5_K
    return new


def _fallback(name: str, ne0: int, qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """``tensor_type_fallback``: a type whose block divides the row length ``ne0``."""
    if ne0 % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    if qtype not in _FALLBACK:
        raise StrataError(
            f"{name}: row length {ne0} is not a multiple of {qtype.name}'s block of "
            f"{gguf.GGML_QUANT_SIZES[qtype][0]} and llama.cpp has no fallback for it; "
            "check the architecture file's sizes"
        )
    alt = _FALLBACK[qtype]
    return alt if ne0 % gguf.GGML_QUANT_SIZES[alt][0] == 0 else T.F16


def tensor_type(
    name: str,
    layer: int | None,
    shape: list[int],
    ftype: gguf.LlamaFileType,
    spec: ArchSpec,
) -> gguf.GGMLQuantizationType:
    """The GGML type llama.cpp's quantizer gives tensor ``name`` in a file of type ``ftype``.

    Args:
        name: GGUF tensor name.
        layer: its block index (None outside the blocks).
        shape: GGUF order (ne0, the row length, first).
        ftype: the file type.
        spec: the architecture (layer count, experts, tied embeddings, the 70B rule).

    Raises:
        StrataError: a row length no type of the mix can hold.
    """
    if not _quantizable(name, shape):
        return T.F32  # as the converter wrote it: 1-D, biases, router, rope_freqs
    base = BASE_TYPE[ftype]
    if base in _FLOAT_TYPES:
        return base  # not a quantized file type: no mix, no fallback
    stacked = len(shape) > 2 and shape[2] > 1
    new = _mix(name, layer, shape[0], base, ftype, _Model.of(spec), stacked)
    return _fallback(name, shape[0], new)


# --------------------------------------------------------------------------- tensors


def tensor_shapes(spec: ArchSpec) -> list[tuple[str, list[int]]]:
    """(name, GGUF shape) of every tensor the converter writes, in ``llama-quantize``'s order.

    The tensors are the architecture's (``strata.common.tensors.file_tensors``) with the optional
    ones the file says it has. The order is llama.cpp's ``weight_name_comparer``: tensors outside
    the blocks first, then block by block, by name within each.

    Raises:
        StrataError: experts or llama3 RoPE scaling on qwen2 (llama.cpp's qwen2 has neither).
    """
    optional = []
    if spec.rope_scaling is not None and spec.rope_scaling.type == "llama3":
        optional.append("rope_freqs.weight")
    if spec.attention_bias:
        optional += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if spec.expert_selection_bias:
        optional.append("exp_probs_b.bias")
    if spec.name == "qwen3next":
        # Qwen3NextModel maps in_proj_qkvz to one ssm_in (gguf-py's tensor_mapping); the loader
        # also takes attn_qkv + attn_gate, which only Qwen3.5's converter writes.
        optional.append("ssm_in.weight")
    tensors = file_tensors(architecture(spec), optional)
    return sorted(((t.name, list(t.shape)) for t in tensors), key=_loader_order)


def _loader_order(item: tuple[str, list[int]]) -> tuple[int, str]:
    # weight_name_comparer: sscanf("blk.%d.") or -1, then the name.
    name = item[0]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return layer, name


def _gguf_bytes(qtype: gguf.GGMLQuantizationType, shape: list[int]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    return n // block * size


# --------------------------------------------------------------------------- descriptions


def describe_spec(spec: ArchSpec, ftype: gguf.LlamaFileType) -> ModelDescription:
    """The model description of ``spec`` quantized as ``ftype`` by llama.cpp.

    ``model``: name = display name and file type, no path, size or sha256 (not executable);
    ``header_sha256`` = sha256 of the architecture's canonical sha256 and the file type, so that
    plans fingerprint both.

    Raises:
        StrataError: a tensor row length that no type of the mix can hold.
    """
    arch = architecture(spec)
    tensors = []
    offset = 0
    for name, shape in tensor_shapes(spec):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        qtype = tensor_type(name, layer, shape, ftype, spec)
        nbytes = _gguf_bytes(qtype, shape)
        tensors.append(tensor_info(name, shape, qtype, offset, nbytes, arch))
        offset += -(-nbytes // GGUF_ALIGNMENT) * GGUF_ALIGNMENT
    fingerprint = f"{canonical_sha256(spec)}:{ftype.name}".encode()
    source = ModelSource(
        name=f"{spec.display_name} {short_name(ftype)}",
        path=None,
        size_bytes=None,
        sha256=None,
        header_sha256=hashlib.sha256(fingerprint).hexdigest(),
    )
    return assemble(source, arch, ftype.name, tensors)


def describe_arch(path: str | Path, ftype: str) -> ModelDescription:
    """``strata describe --arch FILE --ftype NAME``: the description of a model you don't have.

    Raises:
        StrataError: unknown file type (lists the supported ones), an architecture file that is
            missing or does not match ``ArchSpec`` (names the key).
    """
    ft = parse_ftype(ftype)
    return describe_spec(read_arch(path), ft)
