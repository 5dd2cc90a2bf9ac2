"""Descriptions of models we don't have: architecture files + llama.cpp's quantization type mix.

Checked three ways: against real GGUFs (SmolLM2 Q4_1 exactly; every tensor type of Gemma-3 Q4_K_M),
against the published file sizes of the anchor models, and through the command line.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT
from strata.common.describe import describe
from strata.common.errors import SchemaError
from strata.common.schemas import ModelDescription
from strata.common.yamlio import read_yaml, to_yaml
from strata.planner.archdesc import (
    ArchSpec,
    describe_arch,
    parse_ftype,
    read_arch,
    tensor_type,
    use_more_bits,
)

ARCH = ROOT / "profiles" / "arch"


@pytest.fixture(scope="module")
def qwen14b() -> ModelDescription:
    return describe_arch(ARCH / "qwen2.5-14b.yaml", "Q4_K_M")


@pytest.fixture(scope="module")
def llama70b() -> ModelDescription:
    return describe_arch(ARCH / "llama-3.3-70b.yaml", "Q4_K_M")


@pytest.fixture(scope="module")
def mixtral() -> ModelDescription:
    return describe_arch(ARCH / "mixtral-8x7b.yaml", "Q5_K_M")


# What is compared: the description's tensor bytes (``bytes_gguf``, the tensor-data section)
# against the published file size, which adds the header (metadata and tokenizer: 1.8 MB for
# SmolLM2's 49k-token vocabulary, a few MB for 128k-152k vocabularies), under 0.1% of these files.


def test_qwen2_5_14b_q4_k_m_size(qwen14b):
    # Published: 8.99 GB (8.4 GiB).
    assert qwen14b.bytes_gguf == pytest.approx(8.99e9, rel=0.02)
    types = Counter(t.ggml_type for t in qwen14b.tensors)
    # 24 of 48 blocks bump attn_v and ffn_down to Q6_K, plus the output head.
    assert types == {"Q4_K": 289, "Q6_K": 49, "F32": 241}


def test_llama_3_3_70b_q4_k_m_size(llama70b):
    # Published: 42.5 GB (39.6 GiB).
    assert llama70b.bytes_gguf == pytest.approx(42.5e9, rel=0.02)
    by_name = {t.name: t for t in llama70b.tensors}
    # LLM_TYPE_70B: attn_v that use_more_bits leaves at Q4_K goes to Q5_K.
    assert by_name["blk.0.attn_v.weight"].ggml_type == "Q6_K"
    assert by_name["blk.10.attn_v.weight"].ggml_type == "Q5_K"
    assert by_name["blk.10.ffn_down.weight"].ggml_type == "Q4_K"
    assert by_name["rope_freqs.weight"].shape == [64]  # llama3 RoPE scaling: one per pair
    assert by_name["output.weight"].ggml_type == "Q6_K"


def test_mixtral_8x7b_q5_k_m_size(mixtral):
    # Published: 32.2-33.2 GB depending on the llama.cpp version (sizes rounded to 0.1 GB, so up
    # to 33.25e9); the tier-streaming project reported 30.9 (GiB).
    assert 32.15e9 <= mixtral.bytes_gguf < 33.25e9
    assert 30.85 <= mixtral.bytes_gguf / 2**30 < 30.95
    by_name = {t.name: t for t in mixtral.tensors}
    assert by_name["blk.0.ffn_gate_exps.weight"].shape == [4096, 14336, 8]
    assert by_name["blk.0.ffn_down_exps.weight"].shape == [14336, 4096, 8]
    assert by_name["blk.0.ffn_gate_inp.weight"].ggml_type == "F32"
    # 8 experts: attention K and V at Q8_0 whatever the file type.
    assert by_name["blk.5.attn_k.weight"].ggml_type == "Q8_0"
    assert by_name["blk.5.attn_v.weight"].ggml_type == "Q8_0"
    units = {u.name: u for u in mixtral.units}
    # One unit per expert, each an eighth of the stacked tensors, read by 2 of 8 tokens' choices.
    experts = [u for u in mixtral.units if u.layer == 0 and u.role == "expert"]
    assert [u.expert for u in experts] == list(range(8))
    stacked = sum(t.bytes_mlx for t in mixtral.tensors if t.layer == 0 and t.role == "expert")
    assert sum(u.bytes_mlx for u in experts) == stacked
    assert units["blk.0.expert.3"].access_per_token == pytest.approx(2 / 8)
    assert units["blk.0.expert.3"].flops_per_token == 2 * 3 * 4096 * 14336 // 4
    assert units["blk.0.ffn"].role == "router"  # ffn_norm and the router: every token's


def test_smollm2_arch_file_reproduces_the_real_gguf(smollm2_gguf):
    real, _ = describe(str(smollm2_gguf))
    mine = describe_arch(ARCH / "smollm2-135m.yaml", "Q4_1")

    def facts(d: ModelDescription) -> dict:
        return {
            t.name: (t.layer, t.role, t.unit, t.shape, t.ggml_type, t.bytes_gguf, t.bytes_mlx)
            for t in d.tensors
        }

    def units(d: ModelDescription) -> list[dict]:
        # The real file lists tensors in an older quantizer's order: compare unit members as sets.
        return [{**u.model_dump(), "tensors": sorted(u.tensors)} for u in d.units]

    assert facts(mine) == facts(real)
    assert mine.architecture == real.architecture
    assert units(mine) == units(real)
    assert (mine.file_type, mine.kv_elements_per_token, mine.bytes_gguf, mine.bytes_mlx) == (
        real.file_type,
        real.kv_elements_per_token,
        real.bytes_gguf,
        real.bytes_mlx,
    )
    assert mine.model.sha256 is None and mine.model.size_bytes is None and mine.model.path is None
    assert mine.model.name == "SmolLM2-135M-Instruct Q4_1"


def test_type_mix_matches_a_real_q4_k_m_file(gemma3_gguf):
    """Every tensor of Google's Gemma-3-270M Q4_K_M gets the type llama.cpp gave it.

    Its 18 blocks exercise use_more_bits (attn_v, ffn_down), the tied head rule and the K-quant
    fallbacks (row length 640 is not a multiple of 256). The rules do not depend on the
    architecture's name apart from the 70B rule, so a llama spec with its sizes stands in.
    """
    real, _ = describe(str(gemma3_gguf))
    a = real.architecture
    spec = ArchSpec(
        name="llama",
        display_name="gemma-3-270m sizes",
        source="tests",
        **a.model_dump(
            include={
                "block_count",
                "embedding_length",
                "feed_forward_length",
                "head_count",
                "head_count_kv",
                "head_dim",
                "vocab_size",
                "context_length",
                "rope_freq_base",
                "rms_norm_eps",
                "tied_embeddings",
            }
        ),
    )
    ftype = parse_ftype("Q4_K_M")
    got = {t.name: tensor_type(t.name, t.layer, t.shape, ftype, spec).name for t in real.tensors}
    assert got == {t.name: t.ggml_type for t in real.tensors}
    assert {t.layer for t in real.tensors if "ffn_down" in t.name and t.ggml_type == "Q6_K"} == {
        i for i in range(18) if use_more_bits(i, 18)
    }


def test_use_more_bits_layers():
    # i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, with C's integer division.
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(18) if use_more_bits(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    assert sum(use_more_bits(i, 80) for i in range(80)) == 40


def test_header_fingerprint_follows_arch_and_ftype(qwen14b, tmp_path):
    other = describe_arch(ARCH / "qwen2.5-14b.yaml", "Q5_K_M")
    assert other.model.header_sha256 != qwen14b.model.header_sha256
    # Comments and formatting do not change it: the canonical content does.
    reformatted = tmp_path / "q.yaml"
    reformatted.write_text("# a comment\n" + (ARCH / "qwen2.5-14b.yaml").read_text())
    assert describe_arch(reformatted, "q4_k_m").model.header_sha256 == qwen14b.model.header_sha256


def test_arch_typo_names_the_key(tmp_path):
    text = (ARCH / "qwen2.5-14b.yaml").read_text().replace("block_count:", "block_cout:")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(SchemaError) as e:
        read_arch(tmp_path / "typo.yaml")
    msg = str(e.value)
    assert "\n" not in msg and "block_cout" in msg and "block_count" in msg


def _plan_py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "plan.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_unknown_ftype_is_one_line():
    done = _plan_py("describe", "--arch", str(ARCH / "qwen2.5-14b.yaml"), "--ftype", "NOPE")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "NOPE" in errors[0]
    assert all(ft in errors[0] for ft in ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"))


def test_cli_describe_arch_writes_the_description(tmp_path, qwen14b):
    out = tmp_path / "d.yaml"
    done = _plan_py(
        "describe", "--arch", str(ARCH / "qwen2.5-14b.yaml"), "--ftype", "Q4_K_M", "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == to_yaml(qwen14b)  # YAML rounds floats: compare the text
    assert read_yaml(out, ModelDescription).model.sha256 is None
