"""Tiny GGUF files for tests, written with ``gguf.GGUFWriter`` (random, non-zero weights)."""

from __future__ import annotations

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
