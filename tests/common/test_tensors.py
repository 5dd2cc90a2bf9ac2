"""The per-architecture tensor inventory: names from gguf-py, the shapes real files have, which
tensors are optional, and the refusals llama.cpp makes."""

from __future__ import annotations

import pytest
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES
from strata.common import tensors
from strata.common.describe import describe
from strata.common.errors import StrataError
from strata.common.schemas import Architecture


def _arch(name: str, **fields) -> Architecture:
    """A small record of ``name``: width 32, 4 heads of 8 (2 KV), FFN 48, 2 blocks, untied."""
    rule = tensors.ARCHITECTURES[name]
    moe = {"expert_count": 4, "expert_used_count": 2} if rule.experts == "required" else {}
    values = dict(
        name=name,
        block_count=2,
        context_length=64,
        embedding_length=32,
        feed_forward_length=48,
        head_count=4,
        head_count_kv=2,
        head_dim=8,
        vocab_size=10,
        rope_freq_base=10000.0,
        rope_dimension_count=8,
        rms_norm_eps=1e-6,
        tied_embeddings=False,
    )
    return Architecture(**(values | moe | fields))


@pytest.mark.parametrize("name", sorted(tensors.ARCHITECTURES))
def test_names_are_gguf_pys_for_the_architecture(name):
    """Every tensor is one gguf-py's MODEL_TENSORS lists for the architecture, named as its
    TENSOR_NAMES names it (the stem; biases share their weight's)."""
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == name)
    allowed = {TENSOR_NAMES[k] for k in MODEL_TENSORS[arch_id]}
    moe = {"expert_count": 4, "expert_used_count": 2}
    both = [_arch(name), _arch(name, **moe)] if name == "llama" else [_arch(name)]
    for t in (t for a in both for t in tensors.inventory(a)):
        stem = t.name.rsplit(".", 1)[0]
        bid = "blk.{bid}." if t.layer is not None else ""
        assert bid + stem.removeprefix(f"blk.{t.layer}.") in allowed, (name, t.name)
        assert t.name == f"{'' if t.layer is None else f'blk.{t.layer}.'}{t.key}"


def test_real_files_have_exactly_the_inventorys_tensors(smollm2_gguf, gemma3_gguf):
    """SmolLM2 (llama, tied head) and Gemma-3-270M (gemma3: Q/K norms, post norms, tied head) as
    llama.cpp's converter wrote them: the same names and GGUF shapes."""
    for path in (smollm2_gguf, gemma3_gguf):
        desc, _ = describe(str(path))
        have = {t.name: t.shape for t in desc.tensors}
        want = {t.name: list(t.shape) for t in tensors.file_tensors(desc.architecture)}
        assert have == want, path.name


def test_optional_tensors_are_not_shape_checked_and_absent_ones_are_refused():
    llama = tensors.expected_shapes(_arch("llama"))
    assert llama["output.weight"] is None and llama["rope_freqs.weight"] is None
    assert llama["blk.1.attn_q.bias"] is None
    assert llama["blk.1.attn_q.weight"] == [32, 32] and llama["blk.1.attn_k.weight"] == [32, 16]
    qwen2 = tensors.expected_shapes(_arch("qwen2"))
    assert (qwen2["blk.0.attn_q.bias"], qwen2["blk.0.attn_v.bias"]) == ([32], [16])
    assert "rope_freqs.weight" not in qwen2
    olmoe = tensors.expected_shapes(_arch("olmoe", tied_embeddings=True))
    assert "blk.0.attn_q.bias" not in olmoe  # llama.cpp's olmoe has no biases: refused
    assert olmoe["output.weight"] == [32, 10]  # required even where the file ties it
    assert (olmoe["blk.0.attn_q_norm.weight"], olmoe["blk.0.attn_k_norm.weight"]) == ([32], [16])
    gemma3 = tensors.expected_shapes(_arch("gemma3"))
    assert gemma3["blk.1.attn_q_norm.weight"] == [8]
    assert gemma3["blk.1.post_attention_norm.weight"] == gemma3["blk.1.post_ffw_norm.weight"]


def test_moe_shapes_and_expert_widths():
    q3 = _arch("qwen3moe")
    shapes = tensors.expected_shapes(q3)
    # qwen3moe without expert_feed_forward_length: feed_forward_length / expert_used_count.
    assert shapes["blk.0.ffn_gate_exps.weight"] == [32, 24, 4]
    assert shapes["blk.0.ffn_down_exps.weight"] == [24, 32, 4]
    assert shapes["blk.0.ffn_gate_inp.weight"] == [32, 4]
    assert "blk.0.ffn_gate.weight" not in shapes and "blk.0.ffn_gate_up_exps.weight" not in shapes
    assert tensors.expert_width(_arch("qwen3moe", expert_feed_forward_length=12)) == 12
    mixtral = _arch("llama", expert_count=4, expert_used_count=2, expert_feed_forward_length=12)
    assert tensors.expert_width(mixtral) == 48  # llama.cpp reads no expert width for llama
    q2 = tensors.expected_shapes(_arch("qwen2moe", expert_shared_feed_forward_length=20))
    assert q2["blk.1.ffn_gate_inp_shexp.weight"] == [32]
    assert q2["blk.1.ffn_down_shexp.weight"] == [20, 32]


def test_file_tensors_writes_the_head_unless_tied_and_the_optional_ones_asked_for():
    names = {t.name for t in tensors.file_tensors(_arch("llama"))}
    assert "output.weight" in names and "rope_freqs.weight" not in names
    assert not any(n.endswith(".bias") for n in names)
    tied = _arch("llama", tied_embeddings=True)
    asked = tensors.file_tensors(tied, ["rope_freqs.weight", "attn_v.bias"])
    rope = next(t for t in asked if t.name == "rope_freqs.weight")
    assert rope.shape == (4,) and rope.optional  # one factor per rotated pair
    assert "output.weight" not in {t.name for t in asked}
    assert {t.name for t in asked if t.key == "attn_v.bias"} == {
        "blk.0.attn_v.bias",
        "blk.1.attn_v.bias",
    }
    with pytest.raises(StrataError, match="qwen2 has no tensor rope_freqs.weight"):
        tensors.file_tensors(_arch("qwen2"), ["rope_freqs.weight"])


def test_refusals_as_llamacpp():
    with pytest.raises(StrataError, match="needs qwen2moe.expert_count"):
        tensors.inventory(_arch("qwen2moe", expert_count=0, expert_used_count=0))
    with pytest.raises(StrataError, match="gemma3 with experts"):
        tensors.inventory(_arch("gemma3", expert_count=4, expert_used_count=2))
    with pytest.raises(StrataError, match="expert_used_count is 5"):
        tensors.inventory(_arch("olmoe", expert_used_count=5))
    with pytest.raises(StrataError, match="architecture 'bert' is not supported"):
        tensors.inventory(_arch("llama").model_copy(update={"name": "bert"}))
