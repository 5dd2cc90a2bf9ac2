"""Architectures gemma3, qwen2, qwen3 and llama with Llama 3 RoPE scaling, on tiny synthetic GGUFs
(``gguf_factory.ARCH_MODELS``: random F32/F16 block matrices, Q8_0/F16 embeddings and heads,
SmolLM2's tokenizer).

- The correctness rule (tests/reference_check.py) against llama.cpp's outputs stored in
  tests/fixtures/data/llamacpp_arch.json (made by tests/fixtures/make_arch_references.py; CI has
  no llama.cpp), with
  the synthetic threshold: argmax checked where llama.cpp's top-2 gap is at least 1.0, top-10
  logits after the prompt within 1.0. The GGUFs are regenerated here and must have the sha256 the
  references were made on.
- Every architecture gives bit-identical logits and the same greedy ids on the gpu, ram and nvme
  tiers and a mix of them.
- Descriptions put the new tensors in the right units and read the new hyperparameters; the real
  Gemma-3-270M's tensors are the ones the gemma3 forward pass expects.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, make_plan_file
from gguf_factory import ARCH_MODELS, write_arch_model
from plan_edits import moved_plan as _moved
from reference_check import (
    assert_chunked_prefill,
    assert_correctness_rule,
    assert_prompt_ids,
    assert_references_cover,
    greedy_divergence,
    references_by_model,
    regenerated_models,
    resident_engine,
    started_serving,
)
from strata.common.describe import classify, describe
from strata.executor.engine import Engine, check_tensors
from strata.executor.generate import generate
from strata.executor.models import model_class
from strata.executor.models.gemma3 import Gemma3Model
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

GAP = 1.0
"""llama.cpp's top-2 gap from which our argmax must match: the synthetic threshold (random weights
magnify llama.cpp's 8-bit activation rounding; the real model's is 0.5)."""
TOL = 1.0
"""Largest allowed |ours - llama.cpp| over its top-10 logits after the prompt."""
CONTEXT = 512
REFERENCES = DATA / "llamacpp_arch.json"
NAMES = list(ARCH_MODELS)


@pytest.fixture(scope="session")
def arch_references() -> dict[str, list[dict]]:
    """llama.cpp's outputs per synthetic model (tests/fixtures/make_arch_references.py)."""
    return references_by_model(REFERENCES)


@pytest.fixture(scope="session")
def arch_ggufs(tmp_path_factory, smollm2_gguf, arch_references) -> dict[str, Path]:
    """Each synthetic model, regenerated, checked to be the file llama.cpp's references are of."""
    folder = tmp_path_factory.mktemp("arch-models")
    return regenerated_models(
        NAMES,
        arch_references,
        folder,
        smollm2_gguf,
        "tests/fixtures/make_arch_references.py --llama-python PYTHON",
    )


@pytest.fixture(scope="module", params=NAMES)
def arch(request, arch_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one synthetic model."""
    yield from resident_engine(request.param, arch_ggufs[request.param], tmp_path_factory, CONTEXT)


@pytest.fixture(scope="module")
def arch_serving(arch):
    """The serving engine over ``arch``'s engine (``strata run``'s), started."""
    yield from started_serving(arch[2])


def test_references_cover_every_architecture_and_case(arch_references):
    assert_references_cover(arch_references, NAMES)


def test_prompt_ids_exact(arch, arch_references):
    name, _, engine = arch
    assert_prompt_ids(name, engine, arch_references[name])


def test_correctness_rule_against_llamacpp(arch, arch_references, record_property):
    """Teacher-forced argmax where llama.cpp's gap >= 1.0; top-10 logits after the prompt within
    1.0."""
    name, _, engine = arch
    assert_correctness_rule(name, engine, arch_references[name], GAP, TOL, record_property)


def test_greedy_decode_follows_llamacpp_until_a_near_tie(arch, arch_serving, arch_references):
    """Free-running greedy decode (``strata run``'s serving engine, one token at a time)."""
    name = arch[0]
    for ref in arch_references[name]:
        assert greedy_divergence(arch_serving, ref, GAP) is None, name


def test_chunked_prefill_matches_one_pass(arch, arch_references):
    """Prefill in chunks (attention across chunk boundaries, windows reaching into the cache)
    gives the logits of one pass."""
    name, _, engine = arch
    ref = arch_references[name][-1]
    ids, whole = assert_chunked_prefill(engine, ref)
    # Logits from a position on (what teacher-forced checks ask for): the same rows.
    n = len(ref["prompt_ids"])
    np.testing.assert_allclose(engine.logits_for(ids, first=n - 1), whole[n - 1 :], atol=2e-3)
    with pytest.raises(ValueError, match="not a position"):
        engine.logits_for(ids, first=len(ids))


PLACEMENTS = ("ram", "nvme", "mixed")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_tier_is_bit_identical(arch, arch_serving, arch_references, placement, tmp_path):
    """All units on ram, all on nvme, or mixed (attention on ram; FFN, output and globals
    streamed from nvme; embedding on gpu): logits bit-identical to all-resident, same greedy ids."""
    name, plan, engine = arch
    if placement == "mixed":
        moved = _moved(plan, tmp_path / "a.yaml", "ram", roles=[".attn"])
        moved = _moved(moved, tmp_path / "b.yaml", "nvme", roles=[".ffn", "output", "globals"])
    else:
        moved = _moved(plan, tmp_path / "p.yaml", placement)
    loaded = load_plan(moved)
    tiers = set(loaded.plan.tier_of().values())
    assert tiers == ({"gpu", "ram", "nvme"} if placement == "mixed" else {placement})
    serving = ServingEngine(Engine(loaded))
    serving.start()
    other = serving.engine
    try:
        for ref in arch_references[name]:
            ids = ref["prompt_ids"] + ref["greedy_ids"][:8]
            assert np.array_equal(other.logits_for(ids), engine.logits_for(ids)), ref["case"]
            a = generate(serving, ref["prompt_ids"], SamplingParams(), 4).output_ids
            b = generate(arch_serving, ref["prompt_ids"], SamplingParams(), 4).output_ids
            assert a == b, ref["case"]
    finally:
        serving.close()


# --------------------------------------------------------------------------- descriptions


def test_classify_the_new_tensor_names():
    assert classify("blk.2.attn_q_norm.weight") == (2, "norm", "blk.2.attn")
    assert classify("blk.2.attn_k_norm.weight") == (2, "norm", "blk.2.attn")
    assert classify("blk.2.post_attention_norm.weight") == (2, "norm", "blk.2.attn")
    assert classify("blk.2.attn_k.bias") == (2, "attention", "blk.2.attn")
    assert classify("blk.2.post_ffw_norm.weight") == (2, "norm", "blk.2.ffn")
    assert classify("rope_freqs.weight") == (None, "other", "globals")


def test_descriptions_classify_the_new_tensors(arch_ggufs):
    for name, path in arch_ggufs.items():
        desc, _ = describe(str(path))
        units = {u.name: set(u.tensors) for u in desc.units}
        attn, ffn = units["blk.0.attn"], units["blk.0.ffn"]
        m = ARCH_MODELS[name]
        if m.qk_norm:
            assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= attn, name
        if m.post_norms:
            assert "blk.0.post_attention_norm.weight" in attn, name
            assert "blk.0.post_ffw_norm.weight" in ffn, name
        if m.qkv_bias:
            assert {f"blk.0.attn_{x}.bias" for x in "qkv"} <= attn, name
        if m.rope_freqs:
            assert units["globals"] == {"rope_freqs.weight"}, name
        assert not any("ffn" in t for t in attn) and not any("attn" in t for t in ffn), name
        a = desc.architecture
        check_tensors(desc, model_class(a).expected_shapes(a))  # no missing or unused tensor
        assert a.head_dim == m.head_dim, name


def test_gemma3_hyperparameters(arch_ggufs):
    a = describe(str(arch_ggufs["gemma3"]))[0].architecture
    # llama.cpp's default pattern: every 6th block global; windowed blocks RoPE base 10000.
    assert (a.sliding_window, a.sliding_window_layers) == (8, [0, 1, 2, 3, 4])
    assert a.rope_freq_base_swa == 10000.0 and a.rope_freq_base == 1000000.0
    assert (a.rope_scaling_type, a.rope_freq_scale) == ("linear", 0.125)
    assert a.final_logit_softcapping == 60.0
    for name in ("llama3", "qwen2", "qwen3"):
        b = describe(str(arch_ggufs[name]))[0].architecture
        assert (b.sliding_window, b.sliding_window_layers, b.rope_freq_scale) == (0, [], 1.0)


def _variant(tmp_path, smollm2_gguf, name, **changes):
    m = dataclasses.replace(ARCH_MODELS[name], **changes)
    return write_arch_model(tmp_path / f"{name}-variant.gguf", name, smollm2_gguf, model=m)


def test_sliding_window_pattern_and_rope_base_from_the_gguf(tmp_path, smollm2_gguf):
    meta = tuple(kv for kv in ARCH_MODELS["gemma3"].metadata if kv[0] != "final_logit_softcapping")
    period = _variant(
        tmp_path,
        smollm2_gguf,
        "gemma3",
        metadata=(
            *meta,
            ("attention.sliding_window_pattern", 3),
            ("rope.freq_base_swa", 50000.0),
            ("final_logit_softcapping", 30.0),
        ),
    )
    a = describe(str(period))[0].architecture
    assert a.sliding_window_layers == [0, 1, 3, 4]  # i % 3 < 2
    assert (a.rope_freq_base_swa, a.final_logit_softcapping) == (50000.0, 30.0)
    flags = (True, False, False, True, True, False)
    array = _variant(
        tmp_path,
        smollm2_gguf,
        "gemma3",
        metadata=(*meta, ("attention.sliding_window_pattern", flags)),
    )
    assert describe(str(array))[0].architecture.sliding_window_layers == [0, 3, 4]


def test_mistral_style_window_on_llama(tmp_path, smollm2_gguf, arch_ggufs):
    """``llama.attention.sliding_window`` windows every block (llama.cpp ignores the key for
    llama, so there is no llama.cpp reference: the window is checked against the same model
    without it, which must agree until the window is full, and against chunked prefill)."""
    path = _variant(tmp_path, smollm2_gguf, "llama3", metadata=(("attention.sliding_window", 6),))
    desc, _ = describe(str(path))
    assert desc.architecture.sliding_window_layers == [0, 1, 2]
    engines = []
    for i, model in enumerate((path, arch_ggufs["llama3"])):
        plan = make_plan_file(str(model), tmp_path / f"p{i}.yaml", context=CONTEXT)
        engines.append(Engine(load_plan(plan)))
    ids = list(range(1000, 1024))
    windowed, full = (e.logits_for(ids) for e in engines)
    np.testing.assert_allclose(windowed[:6], full[:6], atol=1e-4, rtol=0)
    assert np.abs(windowed[6:] - full[6:]).max(axis=1).min() > 0.1
    engines[0].prefill_chunk = 4
    np.testing.assert_allclose(engines[0].logits_for(ids), windowed, atol=2e-3, rtol=0)
    for e in engines:
        e.close()


def test_real_gemma3_270m_matches_the_forward_pass(gemma3_gguf):
    """Google's Gemma-3-270M: every tensor is one the gemma3 forward pass expects, in the unit it
    expects, and the hyperparameters follow llama.cpp's rules (18 blocks: 5, 11, 17 global)."""
    desc, _ = describe(str(gemma3_gguf))
    a = desc.architecture
    check_tensors(desc, Gemma3Model.expected_shapes(a))
    assert (a.head_dim, a.sliding_window, a.rope_freq_base_swa) == (256, 512, 10000.0)
    assert [i for i in range(18) if i not in a.sliding_window_layers] == [5, 11, 17]
    units = {u.name: set(u.tensors) for u in desc.units}
    assert units["blk.3.attn"] == {
        f"blk.3.{t}.weight"
        for t in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "post_attention_norm",
        )
    }
    assert units["blk.3.ffn"] == {
        f"blk.3.{t}.weight" for t in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    }
