"""Hybrid linear-attention models (qwen3next, qwen35moe) described as llama.cpp's loader reads
them: the tiny synthetic files of tests/fixtures/gguf_qwen3next.py (llama.cpp loaded and ran each:
tests/fixtures/data/llamacpp_qwen3next.json), their tensor inventory, units, bytes, KV cache and
recurrent state; ``strata describe --arch`` of the published anchors against their published
file sizes; the executor's refusal."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import DATA, ROOT
from gguf_qwen3next import HYBRID_MODELS, write_hybrid_model
from reference_check import references_by_model, regenerated_models
from strata.common.describe import describe, recurrent_state_elements
from strata.common.errors import GGUFError, StrataError
from strata.common.schemas import Architecture
from strata.common.tensors import executor_rule, inventory
from strata.executor.models import model_class
from strata.planner.archdesc import describe_arch

NAMES = list(HYBRID_MODELS)
REFERENCES = DATA / "llamacpp_qwen3next.json"
REMAKE = "tests/fixtures/gguf_qwen3next.py --llama-python PYTHON"


@pytest.fixture(scope="module")
def references() -> dict[str, list[dict]]:
    return references_by_model(REFERENCES)


@pytest.fixture(scope="module")
def hybrid_ggufs(tmp_path_factory, smollm2_gguf, references) -> dict[str, Path]:
    """Each synthetic hybrid model written anew: the very file llama.cpp loaded and ran."""
    folder = tmp_path_factory.mktemp("hybrid")
    return regenerated_models(
        NAMES, references, folder, smollm2_gguf, REMAKE, write=write_hybrid_model
    )


def test_llamacpp_ran_every_model(references):
    """llama.cpp loaded each file (its loader refuses a missing, unknown or misshapen tensor)
    and decoded 32 greedy tokens after each case's prompt: the oracle a future executor meets."""
    assert sorted(references) == sorted(NAMES)
    for name, refs in references.items():
        assert {r["case"] for r in refs} == {"capital", "chat-arith", "long"}, name
        for r in refs:
            assert len(r["greedy_ids"]) == 32 and len(set(r["greedy_ids"])) > 8, (name, r["case"])
            assert len(r["top10_after_prompt"]) == 10


@pytest.mark.parametrize("name", NAMES)
def test_the_inventory_is_the_file_llamacpp_loaded(hybrid_ggufs, name):
    desc, _ = describe(str(hybrid_ggufs[name]))
    want = {t.name: t for t in inventory(desc.architecture)}
    have = {t.name: tuple(t.shape) for t in desc.tensors}
    assert set(have) <= set(want), sorted(set(have) - set(want))
    assert {n for n, t in want.items() if not t.optional} <= set(have)
    assert all(have[n] == want[n].shape for n in have)
    m = HYBRID_MODELS[name]
    # The delta-net blocks have no attention projections, the attention blocks no ssm_*.
    for i in range(m.layers):
        block = {n.split(".", 2)[2] for n in have if n.startswith(f"blk.{i}.")}
        if i in m.recurrent_layers:
            assert (
                "ssm_conv1d.weight" in block and "ssm_a" in block and "attn_q.weight" not in block
            )
            assert ("ssm_in.weight" in block) == m.ssm_in
            assert ("attn_qkv.weight" in block) == (not m.ssm_in)
        else:
            assert not any(b.startswith("ssm") for b in block)
            assert have[f"blk.{i}.attn_q.weight"] == (m.width, 2 * m.heads * m.head_dim)


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameters_kv_cache_and_recurrent_state(hybrid_ggufs, name):
    desc, _ = describe(str(hybrid_ggufs[name]))
    a, m = desc.architecture, HYBRID_MODELS[name]
    assert a.name == m.arch
    assert a.recurrent_layers == [0, 2]  # interval 2: blocks 1 and 3 attend
    assert (a.ssm_conv_kernel, a.ssm_state_size, a.ssm_group_count, a.ssm_time_step_rank) == (
        4,
        16,
        2,
        4,
    )
    assert a.ssm_inner_size == 64
    assert a.rope_sections == list(m.rope_sections)
    assert (a.expert_count, a.expert_used_count, a.expert_shared_feed_forward_length) == (8, 2, 48)
    # K and V of 2 KV heads x 16 dims in the 2 attention blocks only.
    assert desc.kv_elements_per_token == 2 * 2 * 2 * 16 == 128
    # Per delta-net block: conv (4 - 1) x (v 64 + 2 x k 32) = 384, state 16 x 64 = 1024.
    assert desc.recurrent_state_elements_per_sequence == 2 * (384 + 1024) == 2816


def test_recurrent_state_is_llamacpps_buffer():
    """llama.cpp's log on a file of these delta-net sizes (conv 4, state 64, 4 key and 16 value
    heads, 2 delta-net blocks of 4, one sequence): ``llama_memory_recurrent: ... R (f32): 0.04
    MiB, S (f32): 0.50 MiB`` (RS buffer 0.54 MiB)."""
    a = Architecture(
        name="qwen3next",
        block_count=4,
        context_length=2048,
        embedding_length=64,
        feed_forward_length=64,
        head_count=4,
        head_count_kv=2,
        head_dim=16,
        vocab_size=100,
        rope_freq_base=1e7,
        rope_dimension_count=8,
        rms_norm_eps=1e-6,
        tied_embeddings=False,
        recurrent_layers=[0, 2],
        ssm_conv_kernel=4,
        ssm_state_size=64,
        ssm_group_count=4,
        ssm_time_step_rank=16,
        ssm_inner_size=1024,
    )
    r = 2 * 3 * (1024 + 2 * 4 * 64) * 4
    s = 2 * 64 * 1024 * 4
    assert round(r / 2**20, 2) == 0.04 and round(s / 2**20, 2) == 0.50
    assert recurrent_state_elements(a) * 4 == r + s
    assert round((r + s) / 2**20, 2) == 0.54


@pytest.mark.parametrize("name", NAMES)
def test_units_and_bytes(hybrid_ggufs, name):
    path = hybrid_ggufs[name]
    desc, _ = describe(str(path))
    reader = gguf.GGUFReader(path)
    data = os.path.getsize(path) - reader.data_offset
    # Every tensor's bytes, as the file has them; the data section adds only alignment padding.
    assert desc.bytes_gguf == sum(int(t.n_bytes) for t in reader.tensors)
    assert 0 <= data - desc.bytes_gguf < 32 * len(reader.tensors)
    assert sum(u.bytes_gguf for u in desc.units) == desc.bytes_gguf
    units = {u.name: u for u in desc.units}
    m = HYBRID_MODELS[name]
    for i in range(m.layers):
        attn, ffn = units[f"blk.{i}.attn"], units[f"blk.{i}.ffn"]
        assert attn.role == "attention"
        # post_attention_norm is the FFN's input norm: it moves with the FFN.
        assert f"blk.{i}.post_attention_norm.weight" in ffn.tensors
        if i in m.recurrent_layers:
            assert f"blk.{i}.ssm_out.weight" in attn.tensors
        assert sum(1 for u in desc.units if u.layer == i and u.expert is not None) == 8
    roles = {t.name: t.role for t in desc.tensors}
    assert roles["blk.0.ssm_norm.weight"] == "norm"
    assert roles["blk.0.ssm_conv1d.weight"] == "attention"


def _header(path: Path, arch: str, drop: str = "", **values) -> Path:
    """A header-only GGUF of the tiny hybrid's keys (``values`` override them, ``drop`` leaves
    one out) and one tensor: what ``read_architecture`` reads."""
    keys = {
        "ssm.conv_kernel": 4,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
        "ssm.time_step_rank": 4,
        "ssm.inner_size": 64,
        "full_attention_interval": 2,
        **values,
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_vocab_size(100)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    for key, value in keys.items():
        if key == drop:
            continue
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))  # a model has tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_default_interval_and_bad_keys(tmp_path):
    desc, _ = describe(
        str(_header(tmp_path / "a.gguf", "qwen3next", drop="full_attention_interval"))
    )
    assert desc.architecture.recurrent_layers == [0, 1, 2]  # llama.cpp's default interval 4
    bad = [
        ("qwen3next", {"ssm.inner_size": 48}, "inner_size is 48; it must be state_size x"),
        ("qwen3next", {"ssm.group_count": 3}, "not a multiple of"),
        ("qwen3next", {"drop": "ssm.state_size"}, "ssm.state_size"),
        ("qwen35moe", {}, "rope.dimension_sections"),
        ("qwen35moe", {"rope.dimension_sections": [1, 2, 3, 4, 5]}, "up to 4 section sizes"),
    ]
    for i, (arch, values, message) in enumerate(bad):
        with pytest.raises(GGUFError, match=message) as e:
            describe(str(_header(tmp_path / f"bad{i}.gguf", arch, **values)))
        assert "\n" not in str(e.value)
    ok = _header(tmp_path / "q35.gguf", "qwen35moe", **{"rope.dimension_sections": [2, 1, 1, 0]})
    assert describe(str(ok))[0].architecture.rope_sections == [2, 1, 1, 0]


def test_the_executor_refuses_it_in_one_line(hybrid_ggufs):
    for name in ("qwen3next", "qwen35moe"):
        desc, _ = describe(str(hybrid_ggufs[name]))
        with pytest.raises(StrataError) as e:
            model_class(desc.architecture)
        text = str(e.value)
        assert f"'{name}'" in text and "gated delta-net" in text and "not executed yet" in text
        assert "`strata plan`" in text and "\n" not in text
    # An architecture Strata does not know keeps its own refusal.
    with pytest.raises(StrataError, match="'mamba2' is not supported by the executor yet"):
        executor_rule("mamba2")
    assert executor_rule("qwen3moe").experts == "required"


def test_qwen3_coder_next_described_from_its_config():
    """Q4_K_M as llama.cpp's quantizer types it: 48.41 GB of tensors, against 48.5e9 bytes
    published for llama.cpp's default Q4_K_M of Qwen3-Coder-Next (steampunque/
    Qwen3-Coder-Next-Hybrid-GGUF's comparison table; the file adds its header)."""
    desc = describe_arch(ROOT / "profiles/arch/qwen3-coder-next-80b-a3b.yaml", "Q4_K_M")
    assert abs(desc.bytes_gguf / 48.5e9 - 1) < 0.01
    a = desc.architecture
    assert len(a.recurrent_layers) == 36 and a.rope_dimension_count == 64
    assert desc.kv_elements_per_token == 2 * 12 * 2 * 256
    # 36 delta-net blocks x (3 x (4096 + 2 x 16 x 128) + 128 x 4096) elements.
    assert desc.recurrent_state_elements_per_sequence == 36 * (3 * 8192 + 128 * 4096)
    types = {t.name: t.ggml_type for t in desc.tensors}
    assert types["blk.0.ssm_in.weight"] == "Q4_K" and types["blk.0.ssm_conv1d.weight"] == "F32"
    # attn_v is counted among the 12 attention blocks' V tensors (use_more_bits(j, 12)).
    assert [b for b in range(3, 48, 4) if types[f"blk.{b}.attn_v.weight"] == "Q6_K"] == [
        3,
        15,
        27,
        39,
        43,
        47,
    ]
    assert sum(u.expert is not None for u in desc.units) == 48 * 512


def test_qwen35_397b_described_from_its_config():
    """Q8_0 (no type mix: every quantizable tensor Q8_0) totals 421.50 GB of tensors, against
    bartowski's Qwen3.5-397B-A17B-Q8_0.gguf of 421.58 GB (its header and text-only files)."""
    desc = describe_arch(ROOT / "profiles/arch/qwen3.5-397b-a17b.yaml", "Q8_0")
    assert abs(desc.bytes_gguf / 421.58e9 - 1) < 0.005
    a = desc.architecture
    assert a.name == "qwen35moe" and a.rope_sections == [11, 11, 10, 0]
    assert len(a.recurrent_layers) == 45
    names = {t.name for t in desc.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ssm_beta.weight", "blk.3.attn_q_norm.weight"} <= names
