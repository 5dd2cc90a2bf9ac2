"""The model description: every tensor's placement facts, from the GGUF header alone.

Tensors are grouped into placement units that always move together: a block's attention
(``blk.N.attn``: norm, Q/K/V/O and their biases and norms), a block's FFN (``blk.N.ffn``), the token
embedding (``token_embd``) and the output head (``output``: final norm and head matrix). With tied
embeddings the head reuses ``token_embd``, so that unit is read whole by every decoded token;
untied, a token reads one row of it (access = 1/vocab).

Mixture-of-experts blocks: ``blk.N.ffn`` holds what every token runs (the FFN norm, the router
``ffn_gate_inp``, and qwen2moe's shared expert ``*_shexp`` with its gate), and each expert is a
unit of its own, ``blk.N.expert.E``: slice E of the stacked ``ffn_{gate,up,down}_exps`` (or fused
``ffn_gate_up_exps``) tensors, whose GGUF shape is ``[cols, rows, n_expert]`` so that an expert's
bytes are contiguous. A decoded token reads an expert with probability ``expert_used_count /
expert_count`` (uniform top-k/n routing) until a measured routing profile replaces it
(``apply_routing_profile``). The router's selection bias ``exp_probs_b`` (DeepSeek-V3, GLM-4.5)
and ungated shared experts are in ``blk.N.ffn`` too; the leading dense blocks of such a model
(``leading_dense_block_count``) have a dense ``blk.N.ffn`` and no expert units; the
multi-token-prediction blocks a file keeps after the others (``nextn_predict_layers``) are left
out (:func:`describe_gguf`).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from pydantic import ValidationError
from strata.common.catalog import ResolvedModel, resolve_model
from strata.common.errors import GGUFError
from strata.common.gguf_file import GGUFFile, open_gguf
from strata.common.gguf_values import (
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_EMBEDDING,
    MAX_EXPERT_UNITS,
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_NORM_EPS,
    MAX_ROPE_BASE,
    MAX_ROPE_FACTOR,
    MAX_SCALE,
    MAX_VOCAB,
    read_bool,
    read_float,
    read_int,
    read_str,
    shown,
)
from strata.common.schemas import Architecture, ModelDescription, ModelSource, TensorInfo, UnitInfo
from strata.common.tensors import ARCHITECTURES as ARCH_RULES
from strata.common.tensors import conformed_shape, loader_shapes

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def classify(name: str) -> tuple[int | None, str, str]:
    """Map a GGUF tensor name to (layer, role, unit).

    Names follow llama.cpp's ``LLM_TENSOR_NAMES`` (gguf-py ``constants.TENSOR_NAMES``).
    """
    m = _BLOCK.match(name)
    if not m:
        if name.startswith("token_embd"):
            return None, "embedding", "token_embd"
        if name.startswith("output_norm"):
            return None, "norm", "output"
        if name.startswith("output"):
            return None, "output", "output"
        return None, "other", "globals"
    layer, rest = int(m.group(1)), m.group(2)
    if "_exps" in rest:
        # Stacked experts: ``assemble`` splits each tensor into one unit per expert.
        return layer, "expert", f"blk.{layer}.experts"
    if rest.startswith(("ffn_gate_inp", "exp_probs_b")):
        # The router (its selection bias exp_probs_b, qwen2moe's shared-expert gate) runs for
        # every token: dense.
        return layer, "router", f"blk.{layer}.ffn"
    if rest.startswith(("ffn", "post_ffw")):
        return layer, ("norm" if "norm" in rest else "ffn"), f"blk.{layer}.ffn"
    if rest.startswith(("attn", "post_attention", "ssm")):
        # ssm_*: a hybrid's gated delta-net, its block's token mixer in place of attention.
        return layer, ("norm" if "norm" in rest else "attention"), f"blk.{layer}.attn"
    return layer, "other", f"blk.{layer}.attn"


def read_architecture(g: GGUFFile) -> Architecture:
    """Hyperparameters from the ``{arch}.*`` metadata keys, each typed and bounded
    (``strata.common.gguf_values``: the limits and why).

    Raises:
        GGUFError: a required key is missing, a value has the wrong type, is not finite or is
            out of its plausible range (names the key and the value).
    """
    arch = g.architecture
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", arch):
        raise GGUFError(f"{g.path}: general.architecture {shown(arch)} is not an architecture name")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    heads = read_int(g, key("attention.head_count"), 1, MAX_HEADS, per_layer=True)
    width = read_int(g, key("embedding_length"), 1, MAX_EMBEDDING)
    key_length = read_int(g, key("attention.key_length"), 0, MAX_HEAD_DIM, 0)
    if width % heads and not key_length:
        raise GGUFError(
            f"{g.path}: {arch}.attention.head_count {heads} does not divide the width {width}"
        )
    head_dim = key_length or width // heads
    if head_dim > MAX_HEAD_DIM:
        raise GGUFError(
            f"{g.path}: head dimension {head_dim} ({arch}.embedding_length / head_count) is above "
            f"{MAX_HEAD_DIM}; the file is damaged or not a model Strata supports"
        )
    vocab = (
        read_int(g, key("vocab_size"), 0, MAX_VOCAB, 0)
        or g.field_count("tokenizer.ggml.tokens")
        or 0
    )
    if not vocab:
        out = next((t for t in g.tensor_infos if t.name == "token_embd.weight"), None)
        vocab = int(out.shape[1]) if out is not None and len(out.shape) > 1 else 1
    if vocab > MAX_VOCAB:
        raise GGUFError(f"{g.path}: a vocabulary of {vocab} tokens is above {MAX_VOCAB}")
    names = {t.name for t in g.tensor_infos}
    blocks = read_int(g, key("block_count"), 1, MAX_BLOCKS)
    rope_dims = read_int(g, key("rope.dimension_count"), 0, MAX_HEAD_DIM, 0) or head_dim
    if rope_dims % 2 or rope_dims > head_dim:
        raise GGUFError(
            f"{g.path}: metadata '{arch}.rope.dimension_count' is {rope_dims}; RoPE rotates pairs "
            f"of an even number of dimensions, at most the head dimension {head_dim}; "
            "re-convert the model"
        )
    experts = read_int(g, key("expert_count"), 0, MAX_EXPERTS, 0)
    if experts * blocks > MAX_EXPERT_UNITS:
        raise GGUFError(
            f"{g.path}: {experts} experts x {blocks} blocks = {experts * blocks} expert units, "
            f"above the limit of {MAX_EXPERT_UNITS}; the file is damaged or not a model Strata "
            "supports"
        )
    used = read_int(g, key("expert_used_count"), 0, max(experts, 0), 0)
    structure = _moe_structure(g, arch, experts, blocks)
    eps_key = key("attention.layer_norm_rms_epsilon")
    if g.field_types(eps_key) is None:
        eps_key = key("attention.layer_norm_epsilon")
    try:
        return Architecture(
            name=arch,
            block_count=blocks - structure.get("nextn_predict_layers", 0),
            context_length=read_int(g, key("context_length"), 1, MAX_CONTEXT, 2048),
            embedding_length=width,
            feed_forward_length=read_int(
                g, key("feed_forward_length"), 0, MAX_FFN, 0, per_layer=True
            ),
            head_count=heads,
            head_count_kv=read_int(g, key("attention.head_count_kv"), 0, heads, 0, per_layer=True)
            or heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rope_freq_base=read_float(g, key("rope.freq_base"), 0.0, MAX_ROPE_BASE, 0.0) or 10000.0,
            rope_dimension_count=rope_dims,
            rms_norm_eps=read_float(g, eps_key, 0.0, MAX_NORM_EPS, 0.0) or 1e-5,
            tied_embeddings="output.weight" not in names,
            expert_count=experts,
            expert_used_count=used,
            **_expert_keys(g, arch),
            **structure,
            **_mla_keys(g, arch, head_dim, rope_dims),
            **_delta_net_keys(g, arch, blocks),
            **_attention_window(g, arch, blocks),
            **_rope_scaling(g, arch),
            final_logit_softcapping=read_float(
                g, key("final_logit_softcapping"), 0.0, MAX_SCALE, 0.0
            ),
        )
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise GGUFError(f"{g.path}: hyperparameter {where}: {err['msg']}") from None


GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
"""llama.cpp's ``llama_expert_gating_func_type`` values of ``{arch}.expert_gating_func``."""


def _expert_keys(g: GGUFFile, arch: str) -> dict:
    """The MoE keys llama.cpp reads when present (its per-architecture defaults apply when not:
    ``executor/models``), typed and bounded.

    Raises:
        GGUFError: a value of the wrong type or out of range (names the key and the value).
    """
    out: dict = {}
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        v = read_int(g, f"{arch}.{key}", 0, MAX_FFN, 0, per_layer=True)
        if v:
            out[key] = v
    norm = read_bool(g, f"{arch}.expert_weights_norm")
    if norm is not None:
        out["expert_weights_norm"] = norm
    func = read_int(g, f"{arch}.expert_gating_func", 0, 2**32, 0)
    if func:
        if func not in GATING_FUNCS:
            raise GGUFError(f"{g.path}: {arch}.expert_gating_func {func} is not 1 or 2")
        out["expert_gating_func"] = GATING_FUNCS[func]
    scale = read_float(g, f"{arch}.expert_weights_scale", 0.0, MAX_SCALE, 0.0)
    if scale:
        out["expert_weights_scale"] = scale
    return out


def _moe_structure(g: GGUFFile, arch: str, experts: int, blocks: int) -> dict:
    """The keys that shape the blocks of a DeepSeek-style MoE (read as llama.cpp reads them):

    - ``expert_group_count`` / ``expert_group_used_count``: llama.cpp reads them for every
      architecture (``llama_model::load_hparams``) and ``build_moe_ffn`` applies them to any MoE
      block; it asserts ``groups < expert_count``, ``expert_count % groups == 0`` and
      ``0 < used < groups`` where groups > 1, refused here the same way;
    - ``expert_shared_count``, ``leading_dense_block_count``, ``nextn_predict_layers``: read
      only where the architecture's rule uses them (``strata.common.tensors.ArchRule``:
      ``shared_count``, ``leading_dense``, ``nextn``; an architecture the inventory does not
      know: read as the file says), as llama.cpp reads them only in those architectures'
      hyperparameter code. ``nextn_predict_layers`` must leave at least one block.

    Raises:
        GGUFError: a value of the wrong type or out of range (names the key, the value and the
            rule).
    """
    out: dict = {}
    rule = ARCH_RULES.get(arch)
    groups = read_int(g, f"{arch}.expert_group_count", 0, MAX_EXPERTS, 0)
    used = read_int(g, f"{arch}.expert_group_used_count", 0, MAX_EXPERTS, 0)
    if groups > 1:
        if not experts or groups >= experts or experts % groups:
            raise GGUFError(
                f"{g.path}: {arch}.expert_group_count is {groups}; it must divide "
                f"expert_count ({experts}) and be smaller (llama.cpp refuses it too); "
                "re-convert the model"
            )
        if not 0 < used < groups:
            raise GGUFError(
                f"{g.path}: {arch}.expert_group_used_count is {used}; with {groups} expert "
                f"groups it must be 1..{groups - 1} (llama.cpp refuses it too); re-convert "
                "the model"
            )
        out["expert_group_count"], out["expert_group_used_count"] = groups, used
    if rule is None or rule.shared_count:
        # Required where llama.cpp's loader requires it (glm4moe: a file without it is refused
        # there), so that its absence is named rather than reported as unused _shexp tensors.
        default = () if arch in SHARED_COUNT_REQUIRED else (0,)
        shared = read_int(g, f"{arch}.expert_shared_count", 0, MAX_EXPERTS, *default)
        if shared:
            out["expert_shared_count"] = shared
    if rule is None or rule.leading_dense:
        dense = read_int(g, f"{arch}.leading_dense_block_count", 0, MAX_BLOCKS, 0)
        if dense:
            out["leading_dense_block_count"] = dense
    if rule is None or rule.nextn:
        nextn = read_int(g, f"{arch}.nextn_predict_layers", 0, MAX_BLOCKS, 0)
        if nextn >= blocks:
            raise GGUFError(
                f"{g.path}: {arch}.nextn_predict_layers is {nextn} but the file has {blocks} "
                "blocks in all (block_count); at least one must be an ordinary block; "
                "re-convert the model"
            )
        if nextn:
            out["nextn_predict_layers"] = nextn
    return out


SHARED_COUNT_REQUIRED = frozenset({"glm4moe"})
"""Architectures whose llama.cpp loader requires ``{arch}.expert_shared_count``
(``ml.get_key(LLM_KV_EXPERT_SHARED_COUNT, hparams.n_expert_shared)``; llama-cpp-python 0.3.36
refuses a glm4moe file without it)."""

FULL_ATTENTION_INTERVAL_DEFAULT = 4
"""llama.cpp's ``full_attention_interval`` when a hybrid's GGUF has none (qwen3next, qwen35moe)."""


def _delta_net_keys(g: GGUFFile, arch: str, blocks: int) -> dict:
    """A hybrid linear-attention model's gated delta-net keys, as llama.cpp's qwen3next and
    qwen35moe hyperparameter code reads them (``load_hparams``): ``ssm.conv_kernel``,
    ``ssm.inner_size``, ``ssm.state_size``, ``ssm.time_step_rank`` (value heads) and
    ``ssm.group_count`` (key heads), all required; the recurrent blocks from
    ``full_attention_interval`` (default 4): block ``i`` is a delta-net block unless
    ``(i + 1) % interval == 0``; qwen35moe's ``rope.dimension_sections`` (required there).
    Read only for the architectures whose rule has ``delta_net``.

    Raises:
        GGUFError: a key missing, of the wrong type or out of range; an ``ssm.inner_size``
            other than ``state_size * time_step_rank`` (llama.cpp sizes the value projections
            from the latter and splits heads by the former) or value heads not a multiple of
            the key heads (each key head serves a whole group of value heads).
    """
    rule = ARCH_RULES.get(arch)
    if rule is None or rule.delta_net == "none":
        return {}
    key = f"{arch}.ssm."
    out = {
        "ssm_conv_kernel": read_int(g, key + "conv_kernel", 1, MAX_HEAD_DIM),
        "ssm_inner_size": read_int(g, key + "inner_size", 1, MAX_FFN),
        "ssm_state_size": read_int(g, key + "state_size", 1, MAX_HEAD_DIM),
        "ssm_time_step_rank": read_int(g, key + "time_step_rank", 1, MAX_HEADS),
        "ssm_group_count": read_int(g, key + "group_count", 1, MAX_HEADS),
    }
    heads_v, heads_k = out["ssm_time_step_rank"], out["ssm_group_count"]
    if out["ssm_inner_size"] != out["ssm_state_size"] * heads_v:
        raise GGUFError(
            f"{g.path}: {key}inner_size is {out['ssm_inner_size']}; it must be state_size x "
            f"time_step_rank = {out['ssm_state_size'] * heads_v} (value heads of the state "
            "size, as llama.cpp sizes them); re-convert the model"
        )
    if heads_v % heads_k:
        raise GGUFError(
            f"{g.path}: {key}time_step_rank (value heads) {heads_v} is not a multiple of "
            f"{key}group_count (key heads) {heads_k}; re-convert the model"
        )
    n = read_int(
        g, f"{arch}.full_attention_interval", 1, MAX_BLOCKS, FULL_ATTENTION_INTERVAL_DEFAULT
    )
    out["recurrent_layers"] = [i for i in range(blocks) if (i + 1) % n]
    if rule.delta_net == "qwen35":
        sections = f"{arch}.rope.dimension_sections"
        values = g.field(sections)
        if not (
            isinstance(values, list)
            and 1 <= len(values) <= 4
            and all(type(v) is int and 0 <= v <= MAX_HEAD_DIM for v in values)
        ):
            raise GGUFError(
                f"{g.path}: {sections} is {shown(str(values))}; {arch} needs up to 4 section "
                "sizes (integers) of its multi-axis RoPE; re-convert the model"
            )
        out["rope_sections"] = list(values)
    return out


MLA_ARCHITECTURES = ("deepseek2",)
"""Architectures with multi-head latent attention, whose ``attention.*_lora_rank`` keys are read
(``_mla_keys``)."""


def _mla_keys(g: GGUFFile, arch: str, head_dim: int, rope_dims: int) -> dict:
    """Multi-head latent attention's widths, as llama.cpp's deepseek2 hyperparameter code reads
    them (``src/models/deepseek2.cpp``, ``load_arch_hparams``; ``llama_hparams::is_mla``):
    ``attention.kv_lora_rank`` (required), ``attention.q_lora_rank`` (0 or absent: one
    ``attn_q``), and one head's decompressed Q/K and V widths: ``attention.key_length_mla`` and
    ``value_length_mla`` where the file has them (its ``attn_k_b``/``attn_v_b`` layout, whose
    ``key_length`` must then be kv_lora_rank + rope dims: llama.cpp's KV cache row), else
    ``key_length`` and ``value_length`` (the legacy ``attn_kv_b`` layout); and YaRN's
    ``rope.scaling.yarn_log_multiplier`` (the attention scale's mscale, 0 where absent).

    Raises:
        GGUFError: a missing kv_lora_rank; widths that contradict each other (names the keys);
            a nonzero ``attention.temperature_scale`` (Mistral-Large-3's per-position query
            temperature, which llama.cpp applies and Strata does not: refused rather than run
            with other logits).
    """
    if arch not in MLA_ARCHITECTURES:
        return {}
    rank = read_int(g, f"{arch}.attention.kv_lora_rank", 1, MAX_FFN)
    q_rank = read_int(g, f"{arch}.attention.q_lora_rank", 0, MAX_FFN, 0)
    k_mla = read_int(g, f"{arch}.attention.key_length_mla", 0, MAX_HEAD_DIM, 0)
    v_mla = read_int(g, f"{arch}.attention.value_length_mla", 0, MAX_HEAD_DIM, 0)
    if bool(k_mla) != bool(v_mla):
        raise GGUFError(
            f"{g.path}: {arch}.attention.key_length_mla and value_length_mla must be given "
            "together (llama.cpp asserts it); re-convert the model"
        )
    temperature = read_float(g, f"{arch}.attention.temperature_scale", 0.0, MAX_SCALE, 0.0)
    if temperature:
        raise GGUFError(
            f"{g.path}: {arch}.attention.temperature_scale is {temperature:g}: llama.cpp scales "
            "each query by a factor of its position there (Mistral-Large-3), which Strata does "
            "not do yet; this model cannot be described or run"
        )
    legacy = not k_mla
    if k_mla:
        if head_dim != rank + rope_dims:
            raise GGUFError(
                f"{g.path}: {arch}.attention.key_length is {head_dim}; with key_length_mla it "
                f"must be kv_lora_rank + rope.dimension_count = {rank + rope_dims} (the "
                "latent and RoPE part the KV cache stores); re-convert the model"
            )
    else:
        k_mla = head_dim
        v_mla = read_int(g, f"{arch}.attention.value_length", 1, MAX_HEAD_DIM, head_dim)
    if k_mla <= rope_dims:
        raise GGUFError(
            f"{g.path}: one head's key width {k_mla} leaves no dimension without RoPE beside "
            f"{arch}.rope.dimension_count {rope_dims} (llama.cpp asserts at least one); "
            "re-convert the model"
        )
    return {
        "q_lora_rank": q_rank,
        "kv_lora_rank": rank,
        "key_length_mla": k_mla,
        "value_length_mla": v_mla,
        "mla_legacy_kv_b": legacy,
        # YaRN's attention-scale multiplier: the converter writes 0.1 * mscale_all_dim and
        # llama.cpp divides the 0.1 back out in float32 ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]).
        "rope_yarn_log_mul": float(
            np.float32(
                read_float(g, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0, MAX_SCALE, 0.0)
            )
            / np.float32(0.1)
        ),
    }


SWA_DEFAULT_PATTERN = {"gemma3": 6, "llama": 0, "gpt-oss": 2}
"""Architectures whose blocks use ``{arch}.attention.sliding_window``, and the period llama.cpp
assumes when the GGUF has no ``attention.sliding_window_pattern`` (gemma3: every 6th block is
global; llama: 0, every block windowed, as Mistral 7B was trained; gpt-oss: 2, the even blocks
windowed and the odd ones global, llama.cpp's ``set_swa_pattern(2)`` for LLM_ARCH_OPENAI_MOE).
llama.cpp ignores the key for the other architectures here (qwen2, qwen3: logits measured
identical with and without it), and so does Strata. llama.cpp ignores it for llama too; Strata
honours it there (see ``executor/models/llama.py``)."""

SWA_REQUIRED = frozenset({"gpt-oss"})
"""Architectures whose llama.cpp loader requires ``{arch}.attention.sliding_window`` (gpt-oss:
``ml.get_key(LLM_KV_ATTENTION_SLIDING_WINDOW, hparams.n_swa)``; llama-cpp-python 0.3.36 refuses
a gpt-oss file without it): a missing key is an error naming it, not a model without windows."""

SWA_ROPE_BASE_DEFAULT = {"gemma3": 10000.0}
"""RoPE base of the windowed blocks when the GGUF has no ``rope.freq_base_swa`` (llama.cpp's
gemma3 rule; elsewhere the windowed blocks use ``rope.freq_base``)."""


def _attention_window(g: GGUFFile, arch: str, blocks: int) -> dict:
    """``sliding_window``, ``sliding_window_layers`` and ``rope_freq_base_swa``.

    The windowed blocks follow llama.cpp (``llama_hparams::set_swa_pattern``): a per-block bool
    array ``{arch}.attention.sliding_window_pattern`` as given, or a period ``n``: block ``i`` is
    windowed when ``n == 0`` or ``i % n < n - 1`` (the last of every ``n`` is global).

    Raises:
        GGUFError: a pattern array of the wrong length or element type; a window, period or
            base of the wrong type or out of range.
    """
    window_key = f"{arch}.attention.sliding_window"
    if arch in SWA_REQUIRED:  # llama.cpp's loader refuses the file without it
        window = read_int(g, window_key, 1, MAX_CONTEXT, per_layer=True)
    else:
        window = read_int(g, window_key, 0, MAX_CONTEXT, 0, per_layer=True)
    if window <= 0 or arch not in SWA_DEFAULT_PATTERN:
        return {}
    key = f"{arch}.attention.sliding_window_pattern"
    types = g.field_types(key)
    if types is not None and types[0] == gguf.GGUFValueType.ARRAY:
        count = g.field_count(key)
        if count != blocks or types[1:] not in ((gguf.GGUFValueType.BOOL,), ()):
            raise GGUFError(
                f"{g.path}: {key} is an array of {count} "
                f"{types[1].name if len(types) > 1 else 'values'}; it needs one BOOL per block "
                f"({blocks}); re-convert the model"
            )
        layers = [i for i, windowed in enumerate(g.field(key)) if windowed]
    else:
        n = read_int(g, key, 0, MAX_BLOCKS, SWA_DEFAULT_PATTERN[arch])
        layers = [i for i in range(blocks) if n == 0 or i % n < n - 1]
    base = read_float(g, f"{arch}.rope.freq_base_swa", 0.0, MAX_ROPE_BASE, 0.0)
    base = base or SWA_ROPE_BASE_DEFAULT.get(arch)
    return {
        "sliding_window": window,
        "sliding_window_layers": layers,
        "rope_freq_base_swa": base,
    }


def _rope_scaling(g: GGUFFile, arch: str) -> dict:
    """``rope_scaling_type`` and ``rope_freq_scale`` as llama.cpp reads them: the factor from
    ``rope.scale_linear`` or ``rope.scaling.factor``, the position scale its inverse; for YaRN
    ``rope.scaling.original_context_length``; ``rope.scaling.attn_factor`` for every
    architecture (``llama_model::load_hparams``), and the ``rope.scaling.yarn_*`` keys only for
    the architectures whose loader reads them (``YARN_KEY_ARCHITECTURES``; llama-cpp-python
    0.3.36's gpt-oss ignores them: its logits are the same with and without each).

    Raises:
        GGUFError: a type or factor out of range (``MAX_ROPE_FACTOR``).
    """
    kind = read_str(g, f"{arch}.rope.scaling.type", max_chars=32)
    factor = read_float(g, f"{arch}.rope.scale_linear", 0.0, MAX_ROPE_FACTOR, 0.0) or read_float(
        g, f"{arch}.rope.scaling.factor", 0.0, MAX_ROPE_FACTOR, 0.0
    )
    out: dict = {}
    attn = read_float(g, f"{arch}.rope.scaling.attn_factor", 0.0, MAX_SCALE, 0.0)
    if attn and attn != 1.0:
        out["rope_attn_factor"] = attn
    if not factor and kind in (None, "none", "linear"):
        return out
    out["rope_scaling_type"] = kind or "linear"
    out["rope_freq_scale"] = 1.0 / factor if factor else 1.0
    if kind == "yarn":
        out["rope_scaling_original_context"] = read_int(
            g, f"{arch}.rope.scaling.original_context_length", 0, MAX_CONTEXT, 0
        )
    if kind == "yarn" and arch in YARN_KEY_ARCHITECTURES:
        ext = read_float(g, f"{arch}.rope.scaling.yarn_ext_factor", -1.0, MAX_SCALE, -1.0)
        if ext >= 0:  # llama.cpp: negative is "not set"
            out["rope_yarn_ext_factor"] = ext
        for key, default in (("attn_factor", 1.0), ("beta_fast", 32.0), ("beta_slow", 1.0)):
            out[f"rope_yarn_{key}"] = (
                read_float(g, f"{arch}.rope.scaling.yarn_{key}", 0.0, MAX_SCALE, 0.0) or default
            )
    return out


YARN_KEY_ARCHITECTURES = frozenset({"grok", "mistral3"})
"""The architectures whose llama.cpp loader reads ``rope.scaling.yarn_{ext_factor,attn_factor,
beta_fast,beta_slow}`` (``src/models/grok.cpp``, ``mistral3.cpp``); the others use llama.cpp's
defaults (ext_factor 1 for YaRN, beta_fast 32, beta_slow 1) whatever the file says."""


def mlx_size(qtype: gguf.GGMLQuantizationType, shape: list[int]) -> tuple[int, bool]:
    """(bytes once in MLX form, whether the executor supports the type today).

    Args:
        qtype: the tensor's GGML type.
        shape: GGUF order (ne0 first). Leading dimensions beyond the first two (stacked experts)
            count as more rows: MLX stores ``[n_expert, rows, cols]`` in the bytes of
            ``[n_expert * rows, cols]``.

    Unsupported types are counted at their file size (``GGML_QUANT_SIZES``) until a repacking
    exists for them.

    Raises:
        GGUFError: a quantized type on a 1-D tensor.
    """
    from strata.common.quant import SUPPORTED_TYPES, mlx_nbytes

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if block > 1 and len(shape) < 2:
        raise GGUFError(
            f"a 1-D tensor of shape {shape} has the quantized type {qtype.name}; quantized "
            "tensors are matrices (norms and biases are F32): re-convert the model"
        )
    n = 1
    for d in shape:
        n *= d
    if qtype in SUPPORTED_TYPES:
        cols = shape[0] if shape else 1
        rows_first = (n // cols, cols) if len(shape) > 2 else tuple(reversed(shape))
        return mlx_nbytes(qtype, rows_first), True
    return n // block * size, False


def tensor_info(
    name: str,
    shape: list[int],
    qtype: gguf.GGMLQuantizationType,
    offset: int,
    bytes_gguf: int,
    arch: Architecture,
) -> TensorInfo:
    """The placement facts of one tensor: layer, role and unit (``classify``), MLX bytes, access.

    A decoded token reads all of a dense tensor, one row of an untied embedding (1/vocab) and
    ``expert_used_count / expert_count`` of an expert tensor (uniform routing, until a measured
    routing profile replaces it).

    Where the architecture's FFN input norm is ``post_attention_norm`` (glm4moe:
    ``strata.common.tensors.ArchRule.ffn_norm``), that norm is in the ``blk.N.ffn`` unit, the
    one that uses it.
    """
    layer, role, unit = classify(name)
    if layer is not None and name == f"blk.{layer}.post_attention_norm.weight":
        rule = ARCH_RULES.get(arch.name)
        if rule is not None and rule.ffn_norm == "post_attention_norm":
            unit = f"blk.{layer}.ffn"
    try:
        mlx_bytes, supported = mlx_size(qtype, shape)
    except GGUFError as e:
        raise GGUFError(f"tensor {shown(name)}: {e}") from None
    access = 1.0
    if role == "embedding" and not arch.tied_embeddings:
        access = 1.0 / arch.vocab_size  # a token reads one row of an untied embedding
    elif role == "expert" and arch.expert_count:
        access = arch.expert_used_count / arch.expert_count
    return TensorInfo(
        name=name,
        layer=layer,
        role=role,
        unit=unit,
        shape=shape,
        ggml_type=qtype.name,
        offset=offset,
        bytes_gguf=bytes_gguf,
        bytes_mlx=mlx_bytes,
        supported=supported,
        access_per_token=access,
    )


def kv_elements_per_token(arch: Architecture) -> int:
    """KV-cache elements one token adds over all blocks, as Strata's paged cache stores them:
    a key and a value of ``head_count_kv * head_dim`` per block; with multi-head latent
    attention (``kv_lora_rank`` > 0, deepseek2) one row of the compressed latent and the RoPE'd
    part, ``kv_lora_rank + rope_dimension_count`` per block, the values being the latent part of
    the same row (``executor/models/deepseek2.py``; llama.cpp's MLA cache holds the same, its V
    a view of K). A hybrid's gated delta-net blocks (``recurrent_layers``) add none: their
    state is fixed per sequence (:func:`recurrent_state_elements`)."""
    if arch.kv_lora_rank:
        return arch.block_count * (arch.kv_lora_rank + arch.rope_dimension_count)
    attention_blocks = arch.block_count - len(arch.recurrent_layers)
    return 2 * attention_blocks * arch.head_count_kv * arch.head_dim  # K and V per layer


def recurrent_state_elements(arch: Architecture) -> int:
    """The recurrent state one sequence keeps over all gated delta-net blocks, elements, whatever
    its length (llama.cpp's ``llama_memory_recurrent``: ``n_embd_r() + n_embd_s()`` per block,
    ``src/llama-hparams.cpp``):

    - conv state ``(ssm_conv_kernel - 1) * (ssm_inner_size + 2 * ssm_group_count *
      ssm_state_size)``: the last kernel - 1 inputs of the causal convolution over Q, K and V;
    - delta-net state ``ssm_state_size * ssm_inner_size``: one key-dim x value-dim matrix per
      value head.

    llama.cpp keeps both at float32 (``type_r``/``type_s``). 0 for a model without such blocks.
    """
    if not arch.recurrent_layers:
        return 0
    conv = max(arch.ssm_conv_kernel - 1, 0) * (
        arch.ssm_inner_size + 2 * arch.ssm_group_count * arch.ssm_state_size
    )
    return len(arch.recurrent_layers) * (conv + arch.ssm_state_size * arch.ssm_inner_size)


def assemble(
    source: ModelSource, arch: Architecture, file_type: str, tensors: list[TensorInfo]
) -> ModelDescription:
    """The model description of ``tensors``: units (``_unit``), KV-cache size and totals.

    Raises:
        GGUFError: stacked expert tensors whose last dimension is not ``expert_count``.
    """
    units: dict[str, list[TensorInfo]] = {}
    for ti in tensors:
        units.setdefault(ti.unit, []).append(ti)
    unit_infos = []
    for name, members in units.items():
        if members[0].role == "expert":
            unit_infos += _expert_units(name, members, arch)
        else:
            unit_infos.append(_unit(name, members, arch))
    unit_infos.sort(key=lambda u: (_unit_order(u), u.name))
    kv_elements = kv_elements_per_token(arch)
    return ModelDescription(
        model=source,
        architecture=arch,
        file_type=file_type,
        kv_elements_per_token=kv_elements,
        kv_bytes_per_token=2 * kv_elements,
        recurrent_state_elements_per_sequence=recurrent_state_elements(arch),
        bytes_gguf=sum(t.bytes_gguf for t in tensors),
        bytes_mlx=sum(t.bytes_mlx for t in tensors),
        units=unit_infos,
        tensors=tensors,
    )


def describe_gguf(g: GGUFFile, source: ModelSource) -> ModelDescription:
    """Build the model description of an opened GGUF.

    A tensor whose shape equals the inventory's up to trailing one-element dimensions (a
    ``[d, 1]`` gate for ``[d]``) is read with the inventory's shape, as llama.cpp's loader takes
    it (``strata.common.tensors.conformed_shape``): in the description and in ``g``'s tensor
    table (``g.tensor_infos``, what the executor loads and packs by), so every reader of ``g``
    shapes it alike; the bytes are the same.

    Raises:
        GGUFError: missing or invalid hyperparameters (``read_architecture``); a tensor of a
            block past the file's ``{arch}.block_count``; a quantized 1-D tensor; stacked
            experts of another count.

    The tensors of the multi-token-prediction blocks (``Architecture.nextn_predict_layers``,
    the file's last blocks) are left out of the description: not planned, not loaded.
    """
    arch = read_architecture(g)
    expected = loader_shapes(arch)
    g.tensor_infos[:] = [
        t._replace(shape=tuple(conformed_shape([int(d) for d in t.shape], expected.get(t.name))))
        for t in g.tensor_infos
    ]
    tensors = [
        tensor_info(
            t.name,
            [int(d) for d in t.shape],
            gguf.GGMLQuantizationType(t.tensor_type),
            int(t.data_offset),
            int(t.n_bytes),
            arch,
        )
        for t in g.tensor_infos
    ]
    in_file = arch.block_count + arch.nextn_predict_layers
    for t in tensors:
        if t.layer is not None and t.layer >= in_file:
            raise GGUFError(
                f"{g.path}: tensor {shown(t.name)} belongs to block {t.layer}, but the model has "
                f"{in_file} blocks ({arch.name}.block_count); the file is damaged — "
                "re-download or re-convert it"
            )
    # The multi-token-prediction blocks (nextn_predict_layers, after the forward pass's blocks):
    # llama.cpp keeps them in the file and skips them in the forward pass; left out here, they are
    # neither planned nor loaded (the file's sha256 still covers them).
    tensors = [t for t in tensors if t.layer is None or t.layer < arch.block_count]
    return assemble(source, arch, _file_type(g), tensors)


def _file_type(g: GGUFFile) -> str:
    """``general.file_type`` by name (its number when llama.cpp has no name for it).

    Raises:
        GGUFError: not an integer.
    """
    ft = read_int(g, "general.file_type", 0, 2**32 - 1, None)
    try:
        return gguf.LlamaFileType(ft).name
    except (ValueError, TypeError):
        return str(ft)


def _unit_order(u: UnitInfo) -> tuple[int, int, int]:
    kind = {"token_embd": 0, "globals": 1}.get(u.name, 3 if u.name == "output" else 2)
    # Within a block: attention, FFN, then the experts in index order.
    within = -1 if u.expert is None else u.expert
    return (kind, -1 if u.layer is None else u.layer, within)


def _unit(name: str, members: list[TensorInfo], arch: Architecture) -> UnitInfo:
    roles = [t.role for t in members if t.role != "norm"] or ["norm"]
    role = max(set(roles), key=roles.count)
    heaviest = max(members, key=lambda t: t.bytes_gguf)
    # A 2-D weight costs 2 FLOPs per element per use (one multiply-add); a tied embedding is also
    # the output head, so every token multiplies with all of it.
    flops = 0
    for t in members:
        if len(t.shape) >= 2 and not (t.role == "embedding" and not arch.tied_embeddings):
            n = 1
            for d in t.shape:
                n *= d
            flops += int(2 * n * t.access_per_token)
    if name == "token_embd" and arch.tied_embeddings:
        role = "embedding"
    return UnitInfo(
        name=name,
        layer=members[0].layer,
        role=role,
        tensors=[t.name for t in members],
        bytes_gguf=sum(t.bytes_gguf for t in members),
        bytes_mlx=sum(t.bytes_mlx for t in members),
        access_per_token=heaviest.access_per_token,
        flops_per_token=flops,
        supported=all(t.supported for t in members),
    )


def _expert_units(group: str, members: list[TensorInfo], arch: Architecture) -> list[UnitInfo]:
    """One unit per expert of a block's stacked expert tensors (``blk.N.expert.E``).

    Each expert holds ``1 / expert_count`` of every stacked tensor's bytes (the repacked rows of
    one expert are the same size for all of them) and, per use, 2 FLOPs per weight. A stacked
    expert bias (``ffn_*_exps.bias``, gpt-oss: GGUF [rows, n_expert]) is split the same way and
    counts no FLOPs.
    """
    n = arch.expert_count
    for t in members:
        rank = 2 if t.name.endswith(".bias") else 3
        if len(t.shape) != rank or t.shape[-1] != n or n == 0:
            raise GGUFError(
                f"tensor {shown(t.name)} has shape {t.shape}; stacked experts need {rank} "
                f"dimensions, the last equal to expert_count ({n})"
            )
    layer = members[0].layer
    access = members[0].access_per_token
    flops = sum(2 * t.shape[0] * t.shape[1] for t in members if len(t.shape) == 3)
    return [
        UnitInfo(
            name=f"blk.{layer}.expert.{e}",
            layer=layer,
            role="expert",
            tensors=[t.name for t in members],
            bytes_gguf=sum(t.bytes_gguf // n for t in members),
            bytes_mlx=sum(t.bytes_mlx // n for t in members),
            access_per_token=access,
            flops_per_token=int(flops * access),
            supported=all(t.supported for t in members),
            expert=e,
        )
        for e in range(n)
    ]


def expert_unit_name(layer: int, expert: int) -> str:
    """The placement unit of expert ``expert`` of block ``layer``."""
    return f"blk.{layer}.expert.{expert}"


def source_for(resolved: ResolvedModel, header_sha256: str) -> ModelSource:
    """The ModelSource of a resolved model (catalog name, or path)."""
    return ModelSource(
        name=resolved.name,
        # Absolute: a plan may be run from any folder.
        # (not following links: a split model's shards are found by their names).
        path=None if resolved.name else str(Path(resolved.path).absolute()),
        size_bytes=resolved.size_bytes,
        sha256=resolved.sha256,
        header_sha256=header_sha256,
    )


def describe(spec: str) -> tuple[ModelDescription, GGUFFile]:
    """Resolve ``spec`` (catalog name or path), open and describe it.

    Raises:
        StrataError: unknown catalog name, fetch failure, malformed GGUF, missing hyperparameters.
    """
    resolved = resolve_model(spec, progress=True)
    g = open_gguf(resolved.path)
    return describe_gguf(g, source_for(resolved, g.header_sha256)), g
