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
from strata.common.schemas import Architecture, ModelDescription, ModelSource, TensorInfo, UnitInfo

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


def _arch_field(g: GGUFFile, arch: str, key: str, default: object = None) -> object:
    v = g.field(f"{arch}.{key}", default)
    if v is None:
        raise GGUFError(
            f"{g.path}: architecture {arch!r} has no {arch}.{key} in its metadata; "
            "this GGUF is not a text-generation model Strata can describe"
        )
    return v


def read_architecture(g: GGUFFile) -> Architecture:
    """Hyperparameters from the ``{arch}.*`` metadata keys.

    Raises:
        GGUFError: a required key is missing or a value is out of range.
    """
    arch = g.architecture
    heads = int(_arch_field(g, arch, "attention.head_count"))
    width = int(_arch_field(g, arch, "embedding_length"))
    if heads <= 0 or width % heads and not g.field(f"{arch}.attention.key_length"):
        raise GGUFError(
            f"{g.path}: {arch}.attention.head_count {heads} does not divide the width {width}"
        )
    head_dim = int(g.field(f"{arch}.attention.key_length") or width // heads)
    vocab = g.field(f"{arch}.vocab_size") or g.field_count("tokenizer.ggml.tokens") or 0
    if not vocab:
        out = next((t for t in g.tensor_infos if t.name == "token_embd.weight"), None)
        vocab = int(out.shape[1]) if out is not None else 1
    names = {t.name for t in g.tensor_infos}
    blocks = int(_arch_field(g, arch, "block_count"))
    try:
        return Architecture(
            name=arch,
            block_count=blocks,
            context_length=int(_arch_field(g, arch, "context_length", 2048)),
            embedding_length=width,
            feed_forward_length=int(g.field(f"{arch}.feed_forward_length") or 0),
            head_count=heads,
            head_count_kv=int(g.field(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            vocab_size=int(vocab),
            rope_freq_base=float(g.field(f"{arch}.rope.freq_base") or 10000.0),
            rope_dimension_count=int(g.field(f"{arch}.rope.dimension_count") or head_dim),
            rms_norm_eps=float(
                g.field(f"{arch}.attention.layer_norm_rms_epsilon")
                or g.field(f"{arch}.attention.layer_norm_epsilon")
                or 1e-5
            ),
            tied_embeddings="output.weight" not in names,
            expert_count=int(g.field(f"{arch}.expert_count") or 0),
            expert_used_count=int(g.field(f"{arch}.expert_used_count") or 0),
            **_expert_keys(g, arch),
            **_attention_window(g, arch, blocks),
            **_rope_scaling(g, arch),
            final_logit_softcapping=float(g.field(f"{arch}.final_logit_softcapping") or 0.0),
        )
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise GGUFError(f"{g.path}: hyperparameter {where}: {err['msg']}") from None


GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
"""llama.cpp's ``llama_expert_gating_func_type`` values of ``{arch}.expert_gating_func``."""


def _expert_keys(g: GGUFFile, arch: str) -> dict:
    """The MoE keys llama.cpp reads when present (its per-architecture defaults apply when not:
    ``executor/models``)."""
    out: dict = {}
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        v = g.field(f"{arch}.{key}")
        if v:
            out[key] = int(v)
    norm = g.field(f"{arch}.expert_weights_norm")
    if norm is not None:
        out["expert_weights_norm"] = bool(norm)
    func = g.field(f"{arch}.expert_gating_func")
    if func:
        if int(func) not in GATING_FUNCS:
            raise GGUFError(f"{g.path}: {arch}.expert_gating_func {func} is not 1 or 2")
        out["expert_gating_func"] = GATING_FUNCS[int(func)]
    scale = g.field(f"{arch}.expert_weights_scale")
    if scale:
        out["expert_weights_scale"] = float(scale)
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
        GGUFError: a pattern array of the wrong length.
    """
    window = int(g.field(f"{arch}.attention.sliding_window") or 0)
    if window <= 0 or arch not in SWA_DEFAULT_PATTERN:
        return {}
    pattern = g.field(f"{arch}.attention.sliding_window_pattern", SWA_DEFAULT_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != blocks:
            raise GGUFError(
                f"{g.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                f"for {blocks} blocks"
            )
        layers = [i for i, windowed in enumerate(pattern) if windowed]
    else:
        n = int(pattern)
        layers = [i for i in range(blocks) if n == 0 or i % n < n - 1]
    base = g.field(f"{arch}.rope.freq_base_swa") or SWA_ROPE_BASE_DEFAULT.get(arch)
    return {
        "sliding_window": window,
        "sliding_window_layers": layers,
        "rope_freq_base_swa": None if base is None else float(base),
    }


def _rope_scaling(g: GGUFFile, arch: str) -> dict:
    """``rope_scaling_type`` and ``rope_freq_scale`` as llama.cpp reads them: the factor from
    ``rope.scale_linear`` or ``rope.scaling.factor``, the position scale its inverse."""
    kind = g.field(f"{arch}.rope.scaling.type")
    factor = g.field(f"{arch}.rope.scale_linear") or g.field(f"{arch}.rope.scaling.factor") or 0.0
    if not factor and kind in (None, "none", "linear"):
        return {}
    return {
        "rope_scaling_type": str(kind or "linear"),
        "rope_freq_scale": 1.0 / float(factor) if factor else 1.0,
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
    """
    from strata.common.quant import SUPPORTED_TYPES, mlx_nbytes

    n = 1
    for d in shape:
        n *= d
    if qtype in SUPPORTED_TYPES:
        cols = shape[0] if shape else 1
        rows_first = (n // cols, cols) if len(shape) > 2 else tuple(reversed(shape))
        return mlx_nbytes(qtype, rows_first), True
    block, size = gguf.GGML_QUANT_SIZES[qtype]
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
    mlx_bytes, supported = mlx_size(qtype, shape)
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

    Raises:
        GGUFError: missing hyperparameters.
    """
    arch = read_architecture(g)
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
    return assemble(source, arch, _file_type(g), tensors)


def _file_type(g: GGUFFile) -> str:
    ft = g.field("general.file_type")
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
                f"tensor {t.name} has shape {t.shape}; stacked experts need 3 dimensions, the "
                f"last equal to expert_count ({n})"
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
        path=None if resolved.name else str(Path(resolved.path).resolve()),
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
