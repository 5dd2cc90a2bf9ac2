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
  ``post_ffw_norm`` [d] (gemma3).

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
from dataclasses import dataclass
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
    """

    rope_freqs: bool = False
    head_required: bool = False
    qkv_bias: Presence = "optional"
    qk_norm: Literal["none", "head", "full"] = "none"
    post_norms: bool = False
    experts: Presence = "none"
    expert_ffn_key: bool = False
    shared_expert: bool = False


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
    """The shared expert's FFN width, elements: ``expert_shared_feed_forward_length``, else
    ``feed_forward_length`` (llama.cpp's qwen2moe rule)."""
    return arch.expert_shared_feed_forward_length or arch.feed_forward_length


# One entry of a tensor list: (kind, suffix, shape, presence); "none" entries are left out.
_Entry = tuple[MODEL_TENSOR, str, tuple[int, ...], Presence]


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
    """One block's tensors (the same in every block)."""
    d, hd, ff = arch.embedding_length, arch.head_dim, arch.feed_forward_length
    q, kv = arch.head_count * hd, arch.head_count_kv * hd
    full = rule.qk_norm == "full"
    qk_norm: Presence = "none" if rule.qk_norm == "none" else "required"
    post: Presence = "required" if rule.post_norms else "none"
    out: list[_Entry] = [
        (M.ATTN_NORM, "weight", (d,), "required"),
        (M.ATTN_Q, "weight", (d, q), "required"),
        (M.ATTN_K, "weight", (d, kv), "required"),
        (M.ATTN_V, "weight", (d, kv), "required"),
        (M.ATTN_OUT, "weight", (q, d), "required"),
        (M.ATTN_Q, "bias", (q,), rule.qkv_bias),
        (M.ATTN_K, "bias", (kv,), rule.qkv_bias),
        (M.ATTN_V, "bias", (kv,), rule.qkv_bias),
        (M.ATTN_Q_NORM, "weight", (q,) if full else (hd,), qk_norm),
        (M.ATTN_K_NORM, "weight", (kv,) if full else (hd,), qk_norm),
        (M.ATTN_POST_NORM, "weight", (d,), post),
        (M.FFN_NORM, "weight", (d,), "required"),
    ]
    if moe:
        # No fused ffn_gate_up_exps: llama.cpp loads it for none of these architectures (it fails
        # on the missing ffn_gate_exps), so a file with it is refused as having an unused tensor.
        e, fe = arch.expert_count, expert_width(arch)
        shexp: Presence = "required" if rule.shared_expert else "none"
        sh = shared_width(arch)
        out += [
            (M.FFN_GATE_INP, "weight", (d, e), "required"),
            (M.FFN_GATE_EXP, "weight", (d, fe, e), "required"),
            (M.FFN_UP_EXP, "weight", (d, fe, e), "required"),
            (M.FFN_DOWN_EXP, "weight", (fe, d, e), "required"),
            (M.FFN_GATE_INP_SHEXP, "weight", (d,), shexp),
            (M.FFN_GATE_SHEXP, "weight", (d, sh), shexp),
            (M.FFN_UP_SHEXP, "weight", (d, sh), shexp),
            (M.FFN_DOWN_SHEXP, "weight", (sh, d), shexp),
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
    block = _block(arch, rule, moe)

    def tensors(entries: list[_Entry], layer: int | None) -> Iterator[ArchTensor]:
        for kind, suffix, shape, presence in entries:
            if presence == "none":
                continue
            stem = TENSOR_NAMES[kind]
            name = f"{stem.format(bid=layer)}.{suffix}"
            key = f"{stem.removeprefix('blk.{bid}.')}.{suffix}"
            yield ArchTensor(name, key, kind, layer, shape, presence == "optional")

    out = list(tensors(before, None))
    for i in range(arch.block_count):
        out += tensors(block, i)
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
