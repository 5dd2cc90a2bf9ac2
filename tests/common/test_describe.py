"""Model descriptions from GGUF headers, and the bounds checks that guard them."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf_factory import write_tiny_llama
from strata.common.describe import classify, describe
from strata.common.errors import GGUFError
from strata.common.gguf_file import open_gguf


def test_smollm2_description(smollm2_gguf):
    desc, _ = describe(str(smollm2_gguf))
    a = desc.architecture
    assert (a.name, a.block_count, a.embedding_length, a.feed_forward_length) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (a.head_count, a.head_count_kv, a.head_dim, a.vocab_size) == (9, 3, 64, 49152)
    assert a.tied_embeddings
    assert len(desc.tensors) == 272
    types = [t.ggml_type for t in desc.tensors]
    assert (types.count("Q4_1"), types.count("Q8_0"), types.count("F32")) == (210, 1, 61)
    assert desc.kv_elements_per_token == 2 * 30 * 3 * 64
    # 30 attention + 30 FFN units, token_embd (tied: also the head) and output (final norm).
    assert len(desc.units) == 62
    units = {u.name: u for u in desc.units}
    assert units["token_embd"].access_per_token == 1.0  # tied: the head reads the whole table
    assert set(units["blk.0.ffn"].tensors) == {
        "blk.0.ffn_down.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_norm.weight",
    }
    assert all(t.supported for t in desc.tensors)
    assert desc.bytes_gguf == sum(t.bytes_gguf for t in desc.tensors)
    # Tensor data ends exactly at the end of the file: offsets and sizes are right.
    last = max(desc.tensors, key=lambda t: t.offset)
    assert last.offset + last.bytes_gguf == desc.model.size_bytes
    assert desc.model.name is None and desc.model.sha256


def test_untied_embedding_is_read_one_row_per_token(tmp_path):
    desc, _ = describe(str(write_tiny_llama(tmp_path / "m.gguf", tied=False)))
    units = {u.name: u for u in desc.units}
    assert units["token_embd"].access_per_token == pytest.approx(1 / desc.architecture.vocab_size)
    assert units["token_embd"].flops_per_token == 0
    assert units["output"].flops_per_token > 0


def test_classify_names():
    assert classify("blk.7.attn_q.weight") == (7, "attention", "blk.7.attn")
    assert classify("blk.7.attn_norm.weight") == (7, "norm", "blk.7.attn")
    assert classify("blk.7.ffn_up.weight") == (7, "ffn", "blk.7.ffn")
    # Stacked experts are split per expert by assemble(); the router and a shared expert are dense.
    assert classify("blk.7.ffn_up_exps.weight") == (7, "expert", "blk.7.experts")
    assert classify("blk.7.ffn_gate_inp.weight") == (7, "router", "blk.7.ffn")
    assert classify("blk.7.ffn_gate_inp_shexp.weight") == (7, "router", "blk.7.ffn")
    assert classify("blk.7.ffn_up_shexp.weight") == (7, "ffn", "blk.7.ffn")
    assert classify("output.weight") == (None, "output", "output")
    assert classify("output_norm.weight") == (None, "norm", "output")
    assert classify("token_embd.weight") == (None, "embedding", "token_embd")


def test_truncated_file_is_refused(tmp_path):
    good = write_tiny_llama(tmp_path / "m.gguf").read_bytes()
    for cut in (10, 200, len(good) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(good[:cut])
        with pytest.raises(GGUFError, match="truncated|not a GGUF"):
            open_gguf(bad)


def test_hostile_counts_are_bounded(tmp_path):
    # A header claiming 2^60 metadata entries must fail at once, not loop or allocate.
    p = tmp_path / "hostile.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2**60) + b"\0" * 64)
    with pytest.raises(GGUFError, match="truncated"):
        open_gguf(p)
    # A string whose length runs past the end of the file.
    p.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62) + b"abc" + b"\0" * 16)
    with pytest.raises(GGUFError, match="past the end"):
        open_gguf(p)


def test_not_gguf_and_missing(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello, not a model" * 10)
    with pytest.raises(GGUFError, match="not a GGUF"):
        open_gguf(p)
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")


def test_missing_hyperparameter(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "e.gguf"), "llama")
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor(
        "token_embd.weight", gguf.quants.quantize(np.ones((4, 32), "float32"), q8), raw_dtype=q8
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="llama.attention.head_count"):
        describe(str(tmp_path / "e.gguf"))


def test_gemma3_description(gemma3_gguf):
    """Any GGUF can be described, types the executor cannot load yet marked unsupported."""
    desc, _ = describe(str(gemma3_gguf))
    a = desc.architecture
    assert (a.name, a.block_count, a.embedding_length, a.head_dim, a.vocab_size) == (
        "gemma3",
        18,
        640,
        256,
        262144,
    )
    types = {t.ggml_type for t in desc.tensors}
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"} <= types
    unsupported = {t.ggml_type for t in desc.tensors if not t.supported}
    assert unsupported == set()  # Q5_0, Q4_K and Q6_K repack onto MLX (executor/quant.py)
    assert desc.kv_bytes_per_token == 2 * 2 * 18 * 1 * 256
    units = {u.name: u for u in desc.units}
    assert "blk.0.attn_q_norm.weight" in units["blk.0.attn"].tensors
    assert "blk.0.post_ffw_norm.weight" in units["blk.0.ffn"].tensors


def test_tensor_bytes_follow_the_file(tmp_path):
    """Each ``open_gguf`` maps the file as it is: one rewritten with the same header (other
    weights) shows its new bytes, one with another tensor table its new table."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    a = open_gguf(path)
    before = a.tensor_bytes(a.tensor_infos[0]).copy()
    write_tiny_llama(path, seed=1)  # same shapes and header, other weights
    c = open_gguf(path)
    assert not np.array_equal(c.tensor_bytes(c.tensor_infos[0]), before)
    write_tiny_llama(path, tied=False)  # another tensor table
    d = open_gguf(path)
    assert len(d.tensor_infos) != len(a.tensor_infos)
