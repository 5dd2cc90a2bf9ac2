"""``strata describe --arch`` for the big MoE architectures: gpt-oss (MXFP4 experts), deepseek2
(multi-head latent attention, shared experts, leading dense blocks) and the hybrids qwen3next and
qwen35moe.

Checked against llama.cpp's own quantizer (tests/fixtures/data/llamacpp_archdesc_types.json, made
by tests/fixtures/make_archdesc_references.py with the bundled llama.cpp: every tensor's type in
small synthetic models quantized to each file type), against what llama.cpp prints for the
published gpt-oss-120b GGUF and the published DeepSeek-V3 Q4_K_M size, and for the errors of an
architecture file that mixes the families' fields.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from conftest import ROOT
from strata.common.errors import SchemaError
from strata.planner.archdesc import (
    ArchSpec,
    architecture,
    describe_arch,
    describe_spec,
    parse_ftype,
    read_arch,
)

ARCH = ROOT / "profiles" / "arch"
REFS = json.loads(
    (ROOT / "tests" / "fixtures" / "data" / "llamacpp_archdesc_types.json").read_text()
)
GiB = 1 << 30


@pytest.mark.parametrize("key", sorted(REFS["files"]))
def test_type_mix_is_llamacpps(key):
    """Every tensor of the description has the type llama.cpp's quantizer gave it; a tensor the
    quantizer never converts (norms, biases, the router) keeps the type it was written in, which
    the description gives as F32, the converter's type for them."""
    ref = REFS["files"][key]
    desc = describe_spec(ArchSpec(**ref["spec"]), parse_ftype(ref["ftype"]))
    mine = {t.name: t.ggml_type for t in desc.tensors}
    assert set(mine) == set(ref["types"])
    for name, qtype in mine.items():
        if qtype == "F32":
            assert ref["types"][name] == ref["source_types"][name], name
        else:
            assert qtype == ref["types"][name], name
    # The cases that make the comparison bite: K-quant bumps and fallbacks, MXFP4 experts.
    types = set(ref["types"].values())
    if ref["ftype"] in ("Q4_K_M", "Q5_K_M"):
        assert "Q6_K" in types
    if ref["ftype"] == "MXFP4_MOE":
        assert {"MXFP4", "Q8_0"} <= types


def test_gpt_oss_120b_is_the_published_file():
    """llama.cpp on ggml-org's gpt-oss-120b GGUF: "type f32: 433, q8_0: 146, mxfp4: 108 tensors",
    "file size = 59.02 GiB" (the size counts the header too: a few MB)."""
    desc = describe_arch(ARCH / "gpt-oss-120b.yaml", "MXFP4_MOE")
    assert Counter(t.ggml_type for t in desc.tensors) == {"F32": 433, "Q8_0": 146, "MXFP4": 108}
    assert desc.bytes_gguf / GiB == pytest.approx(59.02, abs=0.01)
    experts = [t for t in desc.tensors if "_exps.weight" in t.name]
    assert len(experts) == 108 and {t.ggml_type for t in experts} == {"MXFP4"}
    assert desc.architecture.sliding_window_layers == list(range(0, 36, 2))
    assert desc.architecture.rope_scaling_type == "yarn"
    assert desc.architecture.rope_freq_scale == 1 / 32


def test_deepseek_v3_q4_k_m_is_the_published_size():
    """bartowski's DeepSeek-V3-0324 Q4_K_M (same architecture as V3) is listed at 404.43 GB; the
    description (today's converter: attn_k_b/attn_v_b) is within 0.1% of it."""
    desc = describe_arch(ARCH / "deepseek-v3.yaml", "Q4_K_M")
    assert desc.bytes_gguf == pytest.approx(404.43e9, rel=1e-3)
    arch = desc.architecture
    # MLA as the converter writes it: MQA of one KV head of kv_lora_rank + rope dims.
    assert (arch.head_count_kv, arch.head_dim, arch.rope_dimension_count) == (1, 576, 64)
    assert (arch.key_length_mla, arch.value_length_mla, arch.kv_lora_rank) == (192, 128, 512)
    # The KV cache holds the latent and the RoPE'd key part: 61 * 576 values per token.
    assert desc.kv_elements_per_token == 61 * 576
    names = {t.name for t in desc.tensors}
    assert "blk.2.ffn_down.weight" in names and "blk.2.ffn_down_exps.weight" not in names
    assert {"blk.3.ffn_down_exps.weight", "blk.3.ffn_down_shexp.weight"} <= names
    assert "blk.3.exp_probs_b.bias" in names


def test_deepseek_v3_legacy_layout_has_the_published_tensor_count():
    """The published Q4_K_M files of early 2025 hold one attn_kv_b per block: 1025 tensors, 361
    of them F32 (llama.cpp's loader). Their quantizer kept attn_kv_b at Q4_K (606 Q4_K, 58 Q6_K);
    today's treats it as V (bumped on use_more_bits blocks: 30 of 61), as the oracle test checks."""
    spec = read_arch(ARCH / "deepseek-v3.yaml").model_copy(update={"mla_legacy_kv_b": True})
    types = Counter(t.ggml_type for t in describe_spec(spec, parse_ftype("Q4_K_M")).tensors)
    assert sum(types.values()) == 1025 and types["F32"] == 361
    assert types["Q4_K"] + types["Q6_K"] == 606 + 58
    assert types["Q6_K"] == 58 + 30


def test_yarn_description_carries_no_rope_freqs():
    names = {t.name for t in describe_arch(ARCH / "gpt-oss-120b.yaml", "Q8_0").tensors}
    assert "rope_freqs.weight" not in names


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_lora_rank": 512}, "multi-head latent attention"),
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 2.0,
                    "original_context_length": 8,
                    "low_freq_factor": 1.0,
                }
            },
            "no low_freq_factor",
        ),
        (
            {
                "rope_scaling": {
                    "type": "llama3",
                    "factor": 8.0,
                    "original_context_length": 8,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "beta_fast": 32.0,
                }
            },
            "no beta",
        ),
        ({"leading_dense_block_count": 36}, "at least one MoE block"),
    ],
)
def test_inconsistent_arch_file_is_refused(tmp_path, change, message):
    base = read_arch(ARCH / "gpt-oss-120b.yaml").model_dump(exclude_defaults=True)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**base, **change}))
    with pytest.raises(SchemaError, match=message):
        read_arch(path)


def test_deepseek2_needs_its_mla_widths(tmp_path):
    base = read_arch(ARCH / "deepseek-v3.yaml").model_dump(exclude_defaults=True)
    base.pop("v_head_dim")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        ArchSpec(**base)


def test_mxfp4_moe_is_a_named_file_type():
    assert parse_ftype("mxfp4_moe") == parse_ftype("MOSTLY_MXFP4_MOE")
    arch = architecture(read_arch(ARCH / "mixtral-8x7b.yaml"))
    assert arch.rope_scaling_type == "none"  # llama files are described as before
