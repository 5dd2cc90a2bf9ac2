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
(``apply_routing_profile``).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
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
    if rest.startswith("ffn_gate_inp"):
        # The router (and qwen2moe's shared-expert gate) runs for every token: dense.
        return layer, "router", f"blk.{layer}.ffn"
    if rest.startswith(("ffn", "post_ffw")):
        return layer, ("norm" if "norm" in rest else "ffn"), f"blk.{layer}.ffn"
    if rest.startswith(("attn", "post_attention")):
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
    eps_key = key("attention.layer_norm_rms_epsilon")
    if g.field_types(eps_key) is None:
        eps_key = key("attention.layer_norm_epsilon")
    try:
        return Architecture(
            name=arch,
            block_count=blocks,
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


SWA_DEFAULT_PATTERN = {"gemma3": 6, "llama": 0}
"""Architectures whose blocks use ``{arch}.attention.sliding_window``, and the period llama.cpp
assumes when the GGUF has no ``attention.sliding_window_pattern`` (gemma3: every 6th block is
global; llama: 0, every block windowed, as Mistral 7B was trained). llama.cpp ignores the key for
the other architectures here (qwen2, qwen3: logits measured identical with and without it), and so
does Strata. llama.cpp ignores it for llama too; Strata honours it there (see
``executor/models/llama.py``)."""

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
    window = read_int(g, f"{arch}.attention.sliding_window", 0, MAX_CONTEXT, 0, per_layer=True)
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
    ``rope.scale_linear`` or ``rope.scaling.factor``, the position scale its inverse.

    Raises:
        GGUFError: a type or factor out of range (``MAX_ROPE_FACTOR``).
    """
    kind = read_str(g, f"{arch}.rope.scaling.type", max_chars=32)
    factor = read_float(g, f"{arch}.rope.scale_linear", 0.0, MAX_ROPE_FACTOR, 0.0) or read_float(
        g, f"{arch}.rope.scaling.factor", 0.0, MAX_ROPE_FACTOR, 0.0
    )
    if not factor and kind in (None, "none", "linear"):
        return {}
    return {
        "rope_scaling_type": kind or "linear",
        "rope_freq_scale": 1.0 / factor if factor else 1.0,
    }


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
    """
    layer, role, unit = classify(name)
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
    kv_elements = 2 * arch.block_count * arch.head_count_kv * arch.head_dim  # K and V per layer
    return ModelDescription(
        model=source,
        architecture=arch,
        file_type=file_type,
        kv_elements_per_token=kv_elements,
        kv_bytes_per_token=2 * kv_elements,
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
            block past ``block_count``; a quantized 1-D tensor; stacked experts of another count.
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
    for t in tensors:
        if t.layer is not None and t.layer >= arch.block_count:
            raise GGUFError(
                f"{g.path}: tensor {shown(t.name)} belongs to block {t.layer}, but the model has "
                f"{arch.block_count} blocks ({arch.name}.block_count); the file is damaged — "
                "re-download or re-convert it"
            )
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
    one expert are the same size for all of them) and, per use, 2 FLOPs per weight.
    """
    n = arch.expert_count
    for t in members:
        if len(t.shape) != 3 or t.shape[2] != n or n == 0:
            raise GGUFError(
                f"tensor {shown(t.name)} has shape {t.shape}; stacked experts need 3 "
                f"dimensions, the last equal to expert_count ({n})"
            )
    layer = members[0].layer
    access = members[0].access_per_token
    flops = sum(2 * t.shape[0] * t.shape[1] for t in members)
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
