"""The planner counts multi-head latent attention's real KV bytes (deepseek2): one row of
kv_lora_rank + rope dims per token and block, what ``executor/models/deepseek2.py``'s cache
stores, not per-head keys and values."""

from __future__ import annotations

from conftest import make_plan_file
from gguf_deepseek2 import DEEPSEEK2_MODELS, write_deepseek2_model
from strata.common.describe import describe
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml

FLOAT32 = 4
"""Bytes of the dev profile's compute dtype (profiles/dev-linux-cpu.yaml: float32)."""


def test_plan_counts_the_latent_row_per_token(tmp_path, smollm2_gguf):
    m = DEEPSEEK2_MODELS["ds2-dense"]
    gguf = write_deepseek2_model(tmp_path / "ds2.gguf", "ds2-dense", smollm2_gguf)
    plan = read_yaml(make_plan_file(str(gguf), tmp_path / "p.yaml", context=256), Plan)
    per_token = m.layers * (m.kv_lora_rank + m.rope_dims)  # 3 * (32 + 16)
    assert plan.costs.kv_elements_per_token == per_token
    tokens = plan.batch.kv_num_blocks * plan.batch.kv_block_size
    assert tokens >= 256
    kv = sum(t.kv_cache for t in plan.memory.values())
    assert kv == tokens * per_token * FLOAT32
    # The file says one KV head of key_length 48 (kv_lora_rank + rope): counted as a key and a
    # value of that width, as for other architectures, the plan would reserve twice as much.
    a = describe(str(gguf))[0].architecture
    assert (a.head_count_kv, a.head_dim) == (1, m.kv_lora_rank + m.rope_dims)
    assert 2 * a.block_count * a.head_count_kv * a.head_dim == 2 * per_token


def test_legacy_layout_counts_the_latent_too(tmp_path, smollm2_gguf):
    """A file with one ``attn_kv_b`` (llama.cpp expands it into per-head K/V: head_count_kv =
    heads, key_length nope + rope) runs on the same latent cache in Strata, and is counted so."""
    m = DEEPSEEK2_MODELS["ds2-dense-kvb"]
    gguf = write_deepseek2_model(tmp_path / "kvb.gguf", "ds2-dense-kvb", smollm2_gguf)
    desc = describe(str(gguf))[0]
    a = desc.architecture
    assert a.mla_legacy_kv_b and (a.head_count_kv, a.head_dim) == (m.heads, 40)
    assert desc.kv_elements_per_token == m.layers * (m.kv_lora_rank + m.rope_dims)
    assert desc.kv_bytes_per_token == 2 * desc.kv_elements_per_token
