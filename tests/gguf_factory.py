"""Tiny GGUF files for tests, written with ``gguf.GGUFWriter`` (random, non-zero weights)."""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


def byte_level_vocab() -> list[str]:
    """The 256 GPT-2 byte-level symbols (each byte maps to one printable character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """GGUF bytes of ``values`` ([rows, cols] float32) in ``qtype`` (gguf.quants' reference)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return values.astype(np.float32)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_tiny_llama(
    path: Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    d: int = 64,
    ffn: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_0,
    tied: bool = True,
    seed: int = 0,
    extra_vocab: int = 0,
    chat_template: str | None = None,
    skip: frozenset[str] = frozenset(),
) -> Path:
    """Write a small llama-shaped GGUF with a byte-level BPE vocabulary.

    The vocabulary: 256 byte symbols, 3 control tokens (BOS 256, EOS 258), 2 merged tokens.

    Args:
        path: file to write.
        arch: ``general.architecture`` (use another name to test refusal of unknown ones).
        qtype: type of the 2-D weights (norms stay F32).
        tied: no ``output.weight`` (the head reuses ``token_embd``).
        extra_vocab: extra dummy tokens so the vocabulary is a multiple of a block size.
        skip: tensor names to leave out (an incomplete model).
    """
    rng = np.random.default_rng(seed)
    tokens = byte_level_vocab() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "he", "ll"]
    tokens += [f"<extra_{i}>" for i in range(extra_vocab)]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(512)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    types = (
        [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 2
    )
    types += [gguf.TokenType.NORMAL] * extra_vocab
    w.add_token_types(types)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    def mat(name: str, rows: int, cols: int, t: gguf.GGMLQuantizationType = qtype) -> None:
        data = quantize(rng.normal(0, 0.5, (rows, cols)).astype(np.float32), t)
        if name in skip:
            return
        w.add_tensor(name, data, raw_dtype=None if t == gguf.GGMLQuantizationType.F32 else t)

    def vec(name: str, n: int) -> None:
        if name in skip:
            return
        w.add_tensor(name, (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32))

    hd = d // heads
    mat("token_embd.weight", vocab, d, gguf.GGMLQuantizationType.Q8_0)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", d, d)
        mat(p + "attn_k.weight", kv_heads * hd, d)
        mat(p + "attn_v.weight", kv_heads * hd, d)
        mat(p + "attn_output.weight", d, d)
        vec(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", ffn, d)
        mat(p + "ffn_up.weight", ffn, d)
        mat(p + "ffn_down.weight", d, ffn)
    vec("output_norm.weight", d)
    if not tied:
        mat("output.weight", vocab, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------- one model per architecture

_T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class ArchModel:
    """A tiny random-weight model of one architecture, for the comparison with llama.cpp.

    Shapes are tiny (width 64) so CI runs them in seconds; block matrices are F32 or F16 and the
    embeddings and heads Q8_0 or F16, so that quantization is not what differs from llama.cpp
    (Q8_0 block matrices would: llama.cpp rounds activations to 8 bits before each of them,
    which moved a qwen3 model's top-10 logits by up to 0.84 where F32 ones moved 0.05).

    Scales: matrices have std 1/sqrt(fan-in) (activations keep a unit scale), norms
    1 + N(0, 0.1²), biases N(0, 0.5²), and the head gives logits of std about ``logit_std`` over
    the vocabulary, so that llama.cpp's top-2 gap is mostly above 1.0 (the gap between the two
    largest of 49152 normal samples has a mean of about std / 4.6).

    Attributes:
        arch: ``general.architecture``.
        layers, width, ffn, heads, kv_heads, head_dim: the shape (``head_dim`` is written as
            ``attention.key_length``/``value_length``, so ``heads * head_dim`` may differ from
            the width).
        matrix_type: GGML type of the block matrices.
        embd_type: type of ``token_embd``.
        head_type: type of an untied ``output.weight``; None ties the head to the embedding.
        rope_base: ``rope.freq_base``.
        qkv_bias: ``attn_{q,k,v}.bias`` (qwen2).
        qk_norm: ``attn_{q,k}_norm`` per head (qwen3, gemma3).
        post_norms: ``post_attention_norm`` and ``post_ffw_norm`` (gemma3).
        rope_freqs: a Llama-3 ``rope_freqs.weight`` (factors from the llama3 rule with the
            given original context, so they matter at the test's positions).
        metadata: extra ``{arch}.<key>`` values (sliding window, rope scaling, ...).
        logit_std: target std of the logits.
        experts, experts_used: ``expert_count`` and ``expert_used_count`` (0: a dense model).
            An MoE block has the router ``ffn_gate_inp`` (F32, [n_expert, d]) and stacked
            ``ffn_{gate,up,down}_exps`` ([n_expert, rows, cols] numpy arrays, GGUF shape
            [cols, rows, n_expert]) instead of ``ffn_{gate,up,down}``.
        expert_ffn: one expert's FFN width, written as ``expert_feed_forward_length`` (0: no key,
            the experts are ``ffn`` wide).
        shared_ffn: qwen2moe's shared expert: ``ffn_{gate,up,down}_shexp`` this wide (written as
            ``expert_shared_feed_forward_length``) and its gate ``ffn_gate_inp_shexp`` ([d]).
        expert_type: GGML type of the expert matrices (None: ``matrix_type``); F32 or F16.
        fused_gate_up: one ``ffn_gate_up_exps`` ([n_expert, 2 * ff, d]: gate rows, then up
            rows) instead of ``ffn_gate_exps`` and ``ffn_up_exps``.
        qk_norm_full: ``attn_{q,k}_norm`` over the whole projection (``heads * head_dim`` and
            ``kv_heads * head_dim`` wide: olmoe) rather than per head.
    """

    arch: str
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    matrix_type: gguf.GGMLQuantizationType
    embd_type: gguf.GGMLQuantizationType
    head_type: gguf.GGMLQuantizationType | None
    rope_base: float
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    rope_freqs: int = 0
    metadata: tuple[tuple[str, object], ...] = ()
    logit_std: float = 20.0
    rms_eps: float = 1e-6
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    expert_type: gguf.GGMLQuantizationType | None = None
    fused_gate_up: bool = False
    qk_norm_full: bool = False


ARCH_MODELS: dict[str, ArchModel] = {
    # Llama 3 RoPE scaling: rope_freqs.weight as llama.cpp's frequency factors; untied head.
    "llama3": ArchModel(
        "llama", 3, 64, 128, 4, 2, 16, _T.F16, _T.Q8_0, _T.Q8_0, 500000.0, rope_freqs=16
    ),
    # Qwen2: Q/K/V biases, NeoX RoPE, tied embeddings (as Qwen2.5-0.5B).
    "qwen2": ArchModel("qwen2", 3, 64, 160, 4, 2, 16, _T.F32, _T.Q8_0, None, 1000000.0, True),
    # Qwen3: per-head Q/K RMSNorm, no biases, head dim 32 with 4 heads (q is 128 wide, d 64).
    "qwen3": ArchModel(
        "qwen3", 3, 64, 128, 4, 2, 32, _T.F16, _T.Q8_0, _T.F16, 1000000.0, qk_norm=True
    ),
    # Gemma 3: six blocks so llama.cpp's default pattern (every 6th block global) has one global
    # block; sliding window of 8 tokens on the others (RoPE base 10000), linear RoPE scaling on
    # the global block (as Gemma-3-4B and larger), tied embeddings, one KV head (as 270M), and a
    # final logit soft-cap (real Gemma 3 files have none; llama.cpp applies it when present).
    "gemma3": ArchModel(
        "gemma3",
        6,
        64,
        128,
        4,
        1,
        32,
        _T.F16,
        _T.Q8_0,
        None,
        1000000.0,
        qk_norm=True,
        post_norms=True,
        metadata=(
            ("attention.sliding_window", 8),
            ("rope.scaling.type", "linear"),
            ("rope.scaling.factor", 8.0),
            ("final_logit_softcapping", 60.0),
        ),
    ),
}
"""The synthetic models compared with llama.cpp (tests/data/llamacpp_arch.json)."""


def llama3_rope_factors(
    head_dim: int,
    base: float,
    original_context: int,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> np.ndarray:
    """Llama 3's RoPE frequency factors, as llama.cpp's converter writes ``rope_freqs.weight``."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_arch_model(
    path: Path, name: str, tokenizer: Path, seed: int = 0, model: ArchModel | None = None
) -> Path:
    """Write ``ARCH_MODELS[name]`` or ``MOE_MODELS[name]`` (or ``model``, a variant, seeded by
    ``name``) with SmolLM2's tokenizer (every ``tokenizer.*`` key of ``tokenizer``, a GGUF). The
    bytes are a function of (name, model, seed, tokenizer, gguf-py)."""
    from planner.synthetic import _tokenizer_fields

    m = {**ARCH_MODELS, **MOE_MODELS}[name] if model is None else model
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    tok = _tokenizer_fields(str(tokenizer))
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    d, hd = m.width, m.head_dim
    w = gguf.GGUFWriter(str(path), m.arch)
    w.add_type("model")
    w.add_name(f"Strata synthetic {name} (random weights, seed {seed})")
    w.add_block_count(m.layers)
    w.add_context_length(2048)
    w.add_embedding_length(d)
    w.add_feed_forward_length(m.ffn)
    w.add_head_count(m.heads)
    w.add_head_count_kv(m.kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(m.rope_base)
    w.add_layer_norm_rms_eps(m.rms_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(vocab)
    if m.experts:
        w.add_expert_count(m.experts)
        w.add_expert_used_count(m.experts_used)
        if m.expert_ffn:
            w.add_expert_feed_forward_length(m.expert_ffn)
        if m.shared_ffn:
            w.add_expert_shared_feed_forward_length(m.shared_ffn)
    for key, value in m.metadata:
        full = f"{m.arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_array(full, list(value))
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)

    def add(name: str, values: np.ndarray, qtype: gguf.GGMLQuantizationType = _T.F32) -> None:
        if qtype == _T.F32:
            w.add_tensor(name, values.astype(np.float32))
        elif qtype == _T.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    def mat(name: str, rows: int, cols: int, qtype=m.matrix_type, std=None) -> None:
        std = 1 / math.sqrt(cols) if std is None else std
        add(name, rng.normal(0, std, (rows, cols)), qtype)

    def norm(name: str, n: int, scale: float = 1.0) -> None:
        add(name, scale * (1.0 + 0.1 * rng.normal(size=n)))

    tied = m.head_type is None
    # Tied, the head is the embedding: a small embedding (std 1/sqrt(d)) keeps a token's own row
    # from dominating the residual stream, and hence its own logit, and the final norm's weights
    # (about logit_std) set the logits' scale. Untied: embedding std 1, the head sets the scale.
    mat("token_embd.weight", vocab, d, m.embd_type, 1 / math.sqrt(d) if tied else 1.0)
    if m.rope_freqs:
        add("rope_freqs.weight", llama3_rope_factors(hd, m.rope_base, m.rope_freqs))
    q, kv = m.heads * hd, m.kv_heads * hd
    for i in range(m.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", q, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d)
        if m.qkv_bias:
            add(p + "attn_q.bias", rng.normal(0, 0.5, q))
            add(p + "attn_k.bias", rng.normal(0, 0.5, kv))
            add(p + "attn_v.bias", rng.normal(0, 0.5, kv))
        if m.qk_norm:
            norm(p + "attn_q_norm.weight", q if m.qk_norm_full else hd)
            norm(p + "attn_k_norm.weight", kv if m.qk_norm_full else hd)
        mat(p + "attn_output.weight", d, q)
        if m.post_norms:
            norm(p + "post_attention_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        if m.experts:
            _moe_tensors(m, p, add, rng)
        else:
            mat(p + "ffn_gate.weight", m.ffn, d)
            mat(p + "ffn_up.weight", m.ffn, d)
            mat(p + "ffn_down.weight", d, m.ffn)
        if m.post_norms:
            norm(p + "post_ffw_norm.weight", d)
    norm("output_norm.weight", d, m.logit_std if tied else 1.0)
    if not tied:
        mat("output.weight", vocab, d, m.head_type, m.logit_std / math.sqrt(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _moe_tensors(m: ArchModel, p: str, add, rng: np.random.Generator) -> None:
    """One MoE block's FFN tensors (see :class:`ArchModel`): the router (F32, std 1/sqrt(d), so
    the router logits have about unit scale and the top-k choice varies from token to token),
    the stacked experts, and qwen2moe's shared expert and its gate."""
    d, e = m.width, m.experts
    ff = m.expert_ffn or m.ffn
    qtype = m.expert_type or m.matrix_type

    def stack(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 1 / math.sqrt(cols), (e, rows, cols))

    add(p + "ffn_gate_inp.weight", rng.normal(0, 1 / math.sqrt(d), (e, d)))
    if m.fused_gate_up:
        add(p + "ffn_gate_up_exps.weight", stack(2 * ff, d), qtype)
    else:
        add(p + "ffn_gate_exps.weight", stack(ff, d), qtype)
        add(p + "ffn_up_exps.weight", stack(ff, d), qtype)
    add(p + "ffn_down_exps.weight", stack(d, ff), qtype)
    if m.shared_ffn:
        sh = m.shared_ffn
        add(p + "ffn_gate_inp_shexp.weight", rng.normal(0, 1 / math.sqrt(d), d))
        add(p + "ffn_gate_shexp.weight", rng.normal(0, 1 / math.sqrt(d), (sh, d)), qtype)
        add(p + "ffn_up_shexp.weight", rng.normal(0, 1 / math.sqrt(d), (sh, d)), qtype)
        add(p + "ffn_down_shexp.weight", rng.normal(0, 1 / math.sqrt(sh), (d, sh)), qtype)


MOE_MODELS: dict[str, ArchModel] = {
    # Mixtral-style llama: 8 experts, top-2, experts as wide as feed_forward_length (llama.cpp
    # reads no expert_feed_forward_length for llama), F16 experts, untied Q8_0 head.
    "mixtral": ArchModel(
        "llama", 3, 64, 96, 4, 2, 16, _T.F32, _T.Q8_0, _T.Q8_0, 1000000.0,
        experts=8, experts_used=2, expert_type=_T.F16,
    ),
    # Qwen2-MoE (Qwen1.5-MoE): Q/K/V biases, top-4 of 8 narrow experts
    # (expert_feed_forward_length) plus a sigmoid-gated shared expert; the head is required.
    "qwen2moe": ArchModel(
        "qwen2moe", 3, 64, 128, 4, 2, 16, _T.F32, _T.Q8_0, _T.F16, 1000000.0, qkv_bias=True,
        experts=8, experts_used=4, expert_ffn=32, shared_ffn=96,
    ),
    # Qwen3-MoE: per-head Q/K norms, head dim 32 (q 128 wide, d 64), top-2 of 8, F16 experts,
    # tied embeddings.
    "qwen3moe": ArchModel(
        "qwen3moe", 3, 64, 128, 4, 2, 32, _T.F32, _T.Q8_0, None, 1000000.0, qk_norm=True,
        experts=8, experts_used=2, expert_ffn=48, expert_type=_T.F16,
    ),
    # OLMoE: Q/K RMSNorm over the whole projection (llama.cpp's attn_{q,k}_norm are n_embd wide,
    # so K heads = Q heads), NeoX RoPE, top-2 of 8 experts ffn wide, head required.
    "olmoe": ArchModel(
        "olmoe", 3, 64, 64, 4, 4, 16, _T.F32, _T.Q8_0, _T.Q8_0, 10000.0, qk_norm=True,
        qk_norm_full=True, experts=8, experts_used=2,
    ),
}  # fmt: skip
"""The synthetic MoE models compared with llama.cpp (tests/data/llamacpp_moe.json). Block
matrices and routers are F32 (experts F32 or F16): a router's top-k choice is a discontinuity,
and llama.cpp's rounding of activations before F16 or quantized matrices would move router
logits enough to flip near-tied choices (a flipped expert moves that token's logits by whole
units)."""


def moe_key_variant(name: str) -> ArchModel:
    """``MOE_MODELS[name]`` with the GGUF routing keys set against its architecture's rule:
    ``expert_weights_norm`` the opposite of llama.cpp's (true for qwen2moe and olmoe, false for
    llama and qwen3moe), ``expert_gating_func`` 2 (sigmoid), ``expert_weights_scale`` 2.5.
    llama.cpp reads none of them for these architectures (its outputs equal the plain file's:
    ``make_arch_references.py --moe`` checks it), so neither does Strata. Written with the same
    name, its weights are the plain file's."""
    m = MOE_MODELS[name]
    keys = (
        ("expert_weights_norm", m.arch in ("qwen2moe", "olmoe")),
        ("expert_gating_func", 2),
        ("expert_weights_scale", 2.5),
    )
    return dataclasses.replace(m, metadata=m.metadata + keys)
