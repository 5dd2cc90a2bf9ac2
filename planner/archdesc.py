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
``output.weight`` unless the embeddings are tied, ``rope_freqs.weight`` for llama3 RoPE scaling
and ``attn_{q,k,v}.bias`` where ``attention_bias`` is set (qwen2 always has them). 1-D tensors,
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
- a row length (ne0) that is not a multiple of the type's block falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even that does not fit.

llama.cpp counts attn_v and ffn_down tensors in the order its loader sorts them
(``weight_name_comparer`` in ``src/llama-model-loader.h``: block number, then name), so its
counters ``i_attention_wv`` / ``i_ffn_down`` equal the block index here, and MoE models parse the
block from the name anyway: ``use_more_bits`` is applied to the block index. (Quantizers from
before that comparer sorted names as strings, blk.10 before blk.2: the same number of bumped layers,
so the same total, on other blocks.) Tensors are listed in that order too, the order
``llama-quantize`` writes, and ``offset`` is the position in the tensor-data section (aligned to
32 bytes, GGUF's default): the header's size is unknown without the tokenizer.

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
    """RoPE frequency scaling as in the model's ``config.json`` ``rope_scaling``."""

    type: Literal["llama3"] = Field(description="rope_type; llama3 adds a rope_freqs tensor")
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_context_length: int = Field(ge=1, description="original_max_position_embeddings")


class ArchSpec(Strict):
    """A model's architecture hyperparameters (from its published ``config.json``)."""

    name: Literal["llama", "qwen2"] = Field(
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
    """The ``Architecture`` a GGUF of this model would carry in its metadata."""
    return Architecture(
        name=spec.name,
        block_count=spec.block_count,
        context_length=spec.context_length,
        embedding_length=spec.embedding_length,
        feed_forward_length=spec.feed_forward_length,
        head_count=spec.head_count,
        head_count_kv=spec.head_count_kv,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        rope_freq_base=_f32(spec.rope_freq_base),
        rope_dimension_count=spec.head_dim,
        rms_norm_eps=_f32(spec.rms_norm_eps),
        tied_embeddings=spec.tied_embeddings,
        expert_count=spec.expert_count,
        expert_used_count=spec.expert_used_count,
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

    @classmethod
    def of(cls, spec: ArchSpec) -> _Model:
        # llama.cpp's load_hparams: LLM_TYPE_70B is a dense llama of 80 layers with GQA (an
        # 8-expert llama is typed 8x7B/8x22B instead), or a qwen2 of 80 layers.
        if spec.name == "llama":
            is_70b = (
                spec.expert_count != 8
                and spec.block_count == 80
                and spec.head_count != spec.head_count_kv
            )
        else:
            is_70b = spec.block_count == 80
        return cls(spec.block_count, spec.expert_count, spec.tied_embeddings, is_70b)


def _quantizable(name: str, shape: list[int]) -> bool:
    # tensor_allows_quantization: 2-D and 3-D weights only, never norms or the MoE router.
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
    )


def _mix(
    name: str,
    layer: int | None,
    ne0: int,
    new: gguf.GGMLQuantizationType,
    ftype: gguf.LlamaFileType,
    m: _Model,
) -> gguf.GGMLQuantizationType:
    """``llama_tensor_get_type_impl`` for the supported file types (no imatrix)."""
    i = layer if layer is not None else 0
    if name == "output.weight" or (m.tied and name == "token_embd.weight"):
        if ne0 % gguf.GGML_QUANT_SIZES[new][0]:
            return T.Q8_0
        return new if new == T.Q8_0 else T.Q6_K
    if name == "token_embd.weight":
        return new
    if "attn_v.weight" in name:
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, m.n_layer):
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
    new = _mix(name, layer, shape[0], base, ftype, _Model.of(spec))
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
    if spec.rope_scaling is not None:
        optional.append("rope_freqs.weight")
    if spec.attention_bias:
        optional += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
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
