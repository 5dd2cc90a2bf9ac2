"""glm4moe (GLM-4.5/4.6) and the DeepSeek-style MoE extensions it brings (selection bias, grouped
top-k, weight norm and scale from the GGUF, leading dense blocks, ungated shared experts, nextn
blocks skipped), on tiny synthetic GGUFs (tests/fixtures/gguf_glm4moe.py).

- ``route`` against a plain numpy statement of llama.cpp's ``build_moe_ffn`` rule, with the
  selection bias and expert groups.
- The correctness rule against llama.cpp's outputs (tests/fixtures/data/llamacpp_glm4moe.json,
  ``tests/fixtures/make_glm4moe_references.py``; CI has no llama.cpp), resident, at the
  synthetic threshold (argmax where llama.cpp's top-2 gap >= 1.0, top-10 logits after the
  prompt within 1.0). Each extension is load-bearing on these models (measured when they were
  made: routing without the selection bias broke 77 of 80 checked steps; taking the weights
  from the biased scores 31; no renormalization 33; no scale 61; ignoring the groups 64 of 80
  on ``glm4moe-groups``; scoring a group by its largest score alone, 64 too). qwen3moe with
  expert groups meets it as well: llama.cpp groups every architecture's top-k.
- Experts on ram and streamed from NVMe through a 2-slot expert cache: logits bit-identical to
  all-resident.
- Descriptions: block 0 dense (no expert units), ``post_attention_norm`` and ``exp_probs_b`` in
  the FFN unit, the nextn block's tensors left out; the planner plans block 0 as a dense FFN
  unit and a routing profile with no tokens in it applies.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import DATA, make_plan_file
from gguf_factory import leave_out_uint32, write_arch_model
from gguf_glm4moe import GLM_MODELS, OTHER_GROUPED, qwen3moe_groups, write_glm_model
from plan_edits import experts_moved
from reference_check import (
    assert_correctness_rule,
    assert_prompt_ids,
    assert_references_cover,
    references_by_model,
    regenerated_models,
    resident_engine,
)
from strata.common.describe import describe
from strata.common.errors import GGUFError, StrataError
from strata.common.schemas import Plan, RoutingProfile
from strata.common.yamlio import read_yaml
from strata.executor.engine import Engine, check_tensors
from strata.executor.models import MOE_ROUTING, model_class
from strata.executor.models.glm4moe import Glm4MoeModel
from strata.executor.models.llama import MOE_GGUF_KEYS_ALL, MoeRouting, group_mask, route
from strata.executor.plan_loader import load_plan
from strata.planner.routing import apply_routing_profile

GAP = 1.0
TOL = 1.0
CONTEXT = 512
REFERENCES = DATA / "llamacpp_glm4moe.json"
NAMES = list(GLM_MODELS)
REMAKE = "tests/fixtures/make_glm4moe_references.py --llama-python PYTHON"


@pytest.fixture(scope="session")
def glm_references() -> dict[str, list[dict]]:
    return references_by_model(REFERENCES)


@pytest.fixture(scope="session")
def glm_ggufs(tmp_path_factory, smollm2_gguf, glm_references) -> dict[str, Path]:
    """Each synthetic glm4moe model, regenerated, checked to be the file of the references."""
    folder = tmp_path_factory.mktemp("glm-models")
    return regenerated_models(
        NAMES, glm_references, folder, smollm2_gguf, REMAKE, write=write_glm_model
    )


@pytest.fixture(scope="module", params=NAMES)
def glm(request, glm_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one synthetic glm4moe model."""
    yield from resident_engine(request.param, glm_ggufs[request.param], tmp_path_factory, CONTEXT)


# --------------------------------------------------------------------------- the router rule


def _llamacpp_rule(logits, k, gating, norm, scale, bias=None, groups=0, used=0):
    """llama.cpp's ``build_moe_ffn`` routing in plain numpy (float64): probabilities (softmax or
    sigmoid) over all experts; selection = probabilities + bias; with groups > 1, each group of
    E / groups consecutive experts scored by its two largest selection values summed, all but
    the ``used`` best groups set to -inf; the k largest selections chosen; their *unbiased*
    probabilities, divided by their sum clamped at 2^-14 when ``norm``, times ``scale`` unless
    0 or 1."""
    if gating == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    else:
        probs = 1 / (1 + np.exp(-logits))
    select = probs + (0 if bias is None else bias)
    if groups > 1:
        t, n = select.shape
        g = select.reshape(t, groups, n // groups)
        score = np.sort(g, axis=-1)[..., -2:].sum(axis=-1)
        best = np.argsort(-score, axis=-1, kind="stable")[:, :used]
        keep = np.zeros((t, groups), bool)
        np.put_along_axis(keep, best, True, axis=-1)
        select = np.where(keep[..., None], g, -np.inf).reshape(t, n)
    chosen = np.argsort(-select, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, chosen, axis=-1)
    if norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), 2.0**-14)
    if scale not in (0.0, 1.0):
        w = w * scale
    return w, chosen


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
@pytest.mark.parametrize(("groups", "used"), [(0, 0), (4, 2), (8, 3), (2, 1)])
@pytest.mark.parametrize(("norm", "scale"), [(True, 2.5), (False, 0.0)])
def test_route_with_bias_and_groups_matches_llamacpps_rule(gating, groups, used, norm, scale):
    rng = np.random.default_rng([groups, used, int(norm)])
    logits = rng.normal(0, 2.0, (41, 16)).astype(np.float32)
    bias = rng.normal(0, 0.5, 16).astype(np.float32)
    rule = MoeRouting(gating, norm=norm, scale=scale, groups=groups, groups_used=used)
    for k in (1, 2, 4):
        weights, chosen = route(mx.array(logits), k, rule, mx.array(bias))
        want_w, want_c = _llamacpp_rule(
            logits.astype(np.float64), k, gating, norm, scale, bias, groups, used
        )
        assert chosen.dtype == mx.int32 and weights.dtype == mx.float32
        assert np.array_equal(np.array(chosen), want_c), (k, groups)
        np.testing.assert_allclose(np.array(weights), want_w, rtol=2e-6, atol=1e-7)


def test_bias_chooses_but_does_not_weigh():
    """A large bias on expert 3 makes every token choose it, at its own unbiased weight."""
    logits = mx.array(np.random.default_rng(1).normal(0, 1, (6, 8)).astype(np.float32))
    bias = mx.zeros(8).at[3].add(10.0)
    weights, chosen = route(logits, 2, MoeRouting("sigmoid"), bias)
    assert (np.array(chosen)[:, 0] == 3).all()
    want = 1 / (1 + np.exp(-np.array(logits)[:, 3]))
    np.testing.assert_allclose(np.array(weights)[:, 0], want, rtol=1e-6)


def test_group_mask_keeps_the_best_groups_by_top2_sum():
    """Group scores are the sum of the two largest (not the largest alone): group 1 wins with
    0.5 + 0.5 over group 0's 0.9 + 0.0."""
    select = mx.array([[0.9, 0.0, 0.5, 0.5, 0.1, 0.2]])
    masked = np.array(group_mask(select, 3, 1))
    assert np.isneginf(masked[0, [0, 1, 4, 5]]).all()
    assert masked[0, 2:4].tolist() == [0.5, 0.5]
    with pytest.raises(StrataError, match="expert_group_count must divide"):
        group_mask(select, 4, 1)


def test_glm4moe_routing_row_reads_the_gguf_keys():
    """llama.cpp's glm4moe: sigmoid by default, norm and scale from the GGUF (default false, 0),
    and the expert groups from the GGUF, as for every architecture."""
    assert MOE_ROUTING["glm4moe"] == MoeRouting("sigmoid", False, 0.0, MOE_GGUF_KEYS_ALL)
    a = _arch()
    a = a.model_copy(
        update={
            "expert_weights_norm": True,
            "expert_weights_scale": 2.5,
            "expert_group_count": 4,
            "expert_group_used_count": 2,
        }
    )
    assert Glm4MoeModel.moe_routing.for_model(a) == MoeRouting(
        "sigmoid", True, 2.5, MOE_GGUF_KEYS_ALL, 4, 2
    )
    # The other families take the groups too (llama.cpp reads the keys for all of them).
    q = a.model_copy(update={"name": "qwen3moe"})
    assert MOE_ROUTING["qwen3moe"].for_model(q).groups == 4


def _arch(**update):
    from strata.common.schemas import Architecture

    return Architecture(
        name="glm4moe",
        block_count=3,
        context_length=64,
        embedding_length=8,
        feed_forward_length=16,
        head_count=2,
        head_count_kv=2,
        head_dim=4,
        vocab_size=10,
        rope_freq_base=10000.0,
        rope_dimension_count=2,
        rms_norm_eps=1e-6,
        tied_embeddings=True,
        expert_count=8,
        expert_used_count=2,
        expert_feed_forward_length=4,
        expert_shared_count=2,
        leading_dense_block_count=1,
        **update,
    )


def test_inventory_leading_dense_and_shared_experts():
    """Block 0 dense (``ffn_{gate,up,down}`` ``feed_forward_length`` wide), blocks 1.. MoE with
    the selection bias and ungated shared experts ``expert_shared_count * expert width`` wide;
    ``post_attention_norm`` in place of ``ffn_norm``; Q/K norms and Q/K/V biases optional."""
    shapes = Glm4MoeModel.expected_shapes(_arch())
    assert shapes["blk.0.ffn_gate.weight"] == [8, 16]
    assert "blk.0.ffn_gate_inp.weight" not in shapes and "blk.1.ffn_gate.weight" not in shapes
    assert shapes["blk.1.exp_probs_b.bias"] == [8]
    assert shapes["blk.2.ffn_up_shexp.weight"] == [8, 8]
    assert "blk.1.ffn_gate_inp_shexp.weight" not in shapes
    assert (
        shapes["blk.1.post_attention_norm.weight"] == [8] and "blk.1.ffn_norm.weight" not in shapes
    )
    assert shapes["blk.0.attn_q_norm.weight"] is None and shapes["blk.0.attn_q.bias"] is None
    none = Glm4MoeModel.expected_shapes(_arch().model_copy(update={"expert_shared_count": 0}))
    assert not any("shexp" in name for name in none)


# --------------------------------------------------------------------------- against llama.cpp


def test_references_cover_every_model(glm_references):
    assert_references_cover(glm_references, [*NAMES, OTHER_GROUPED])


def test_correctness_rule_against_llamacpp(glm, glm_references, record_property):
    name, _, engine = glm
    assert_prompt_ids(name, engine, glm_references[name])
    assert_correctness_rule(name, engine, glm_references[name], GAP, TOL, record_property)


def test_description(glm):
    """What the file has, as described: blocks that run (the nextn block's tensors left out),
    block 0 dense, the FFN's norm and the selection bias in the FFN unit."""
    name, _, engine = glm
    m, desc = GLM_MODELS[name], engine.loaded.desc
    a = desc.architecture
    assert (a.block_count, a.nextn_predict_layers) == (m.layers, m.nextn)
    assert (a.leading_dense_block_count, a.expert_shared_count) == (1, 1)
    assert (a.expert_group_count, a.expert_group_used_count) == (m.groups, m.groups_used)
    assert (a.expert_weights_norm, a.expert_weights_scale, a.expert_gating_func) == (
        True,
        2.5,
        "sigmoid",
    )
    check_tensors(desc, model_class(a).expected_shapes(a))
    assert not any(t.layer is not None and t.layer >= m.layers for t in desc.tensors)
    units = {u.name: u for u in desc.units}
    assert not any(n.startswith("blk.0.expert.") for n in units)
    assert units["blk.0.ffn"].role == "ffn"
    assert set(units["blk.0.ffn"].tensors) == {
        "blk.0.post_attention_norm.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_down.weight",
    }
    assert {"blk.1.exp_probs_b.bias", "blk.1.post_attention_norm.weight"} <= set(
        units["blk.1.ffn"].tensors
    )
    assert {f"blk.1.expert.{e}" for e in range(8)} <= set(units)


def test_other_architectures_group_as_llamacpp(glm_references, smollm2_gguf, tmp_path_factory):
    """qwen3moe with ``expert_group_count``: llama.cpp groups its top-k too (its outputs differ
    from the plain file's, checked when the references were made), and so does Strata."""
    refs = glm_references[OTHER_GROUPED]
    path = regenerated_models(
        [OTHER_GROUPED],
        glm_references,
        tmp_path_factory.mktemp("qwen3moe-groups"),
        smollm2_gguf,
        REMAKE,
        write=lambda p, n, t: write_arch_model(p, n, t, model=qwen3moe_groups()),
    )[OTHER_GROUPED]
    for name, _, engine in resident_engine(OTHER_GROUPED, path, tmp_path_factory, CONTEXT):
        assert (engine.model.routing.groups, engine.model.routing.groups_used) == (4, 2)
        assert_correctness_rule(name, engine, refs, GAP, TOL, lambda *_: None)


# --------------------------------------------------------------------------- tiers


@pytest.mark.parametrize(
    ("tier", "slots", "mode"),
    [("ram", 0, None), ("nvme", 2, "none"), ("nvme", 2, "cache"), ("nvme", 5, "prefetch")],
)
def test_tiers_are_bit_identical(glm, glm_references, tier, slots, mode, tmp_path, monkeypatch):
    """Experts (and, on ram, the FFN units with block 0's dense FFN) off the device: the same
    logits, bit for bit; on nvme through a small expert cache in each mode (2 slots: a block's
    experts come in several groups; 5 with top-2 prefetch)."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    name, plan, engine = glm
    ref = glm_references[name][0]
    ids = ref["prompt_ids"] + ref["greedy_ids"][:8]
    moved = experts_moved(plan, tmp_path / "p.yaml", tier, slots, ffn=tier == "ram")
    other = Engine(load_plan(moved), expert_cache_mode=mode)
    try:
        assert np.array_equal(other.logits_for(ids), engine.logits_for(ids))
        if tier == "nvme":
            counters = other.store.experts_cache.counters()
            assert counters["misses"] > 0
            if mode == "none":
                assert counters["hits"] == 0 and counters["prefetch_issued"] == 0
    finally:
        other.close()


def test_everything_streamed_decodes_as_resident(glm_ggufs, glm_references, tmp_path, monkeypatch):
    """A plan of the planner with every unit on nvme (block 0's dense FFN streamed through the
    pool, experts through the expert cache with prefetch), decoded one token at a time by the
    serving engine: the resident run's logits and greedy tokens, which are llama.cpp's."""
    from strata.executor.generate import generate
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import ServingEngine

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    name = "glm4moe-groups"
    path = str(glm_ggufs[name])
    ref = glm_references[name][0]
    runs = []
    for label, tiers in (("resident", None), ("all-nvme", ["nvme"])):
        extra = {"tiers": tiers} if tiers else {}
        plan = make_plan_file(path, tmp_path / f"{label}.yaml", context=64, **extra)
        serving = ServingEngine(Engine(load_plan(plan)))
        serving.start()
        try:
            logits = serving.engine.logits_for(ref["prompt_ids"])
            gen = generate(serving, ref["prompt_ids"], SamplingParams(), 6, stop_at_eog=False)
            runs.append((logits, gen.output_ids, gen.stats["experts"]))
        finally:
            serving.close()
    (want, want_ids, _), (got, got_ids, experts) = runs
    assert np.array_equal(got, want) and got_ids == want_ids == ref["greedy_ids"][:6]
    assert experts["bytes_read"] > 0 and experts["uses_gpu"] == 0


# --------------------------------------------------------------------------- planning


def test_leading_dense_block_is_planned_dense(glm_ggufs, tmp_path):
    """Block 0's FFN is one dense unit read whole by every token; the expert cache and a routing
    profile count MoE blocks only (a profile whose block 0 routed nothing applies)."""
    path = str(glm_ggufs["glm4moe"])
    desc = describe(path)[0]
    u = next(u for u in desc.units if u.name == "blk.0.ffn")
    assert u.access_per_token == 1.0 and u.expert is None
    experts = [u for u in desc.units if u.expert is not None]
    assert {u.layer for u in experts} == {1, 2, 3}
    plan = read_yaml(make_plan_file(path, tmp_path / "p.yaml", context=64, desc=desc), Plan)
    assert plan.tier_of()["blk.0.ffn"] == "gpu"
    assert not any(p.startswith("blk.0.") for p in plan.expert_cache.pinned)
    m = GLM_MODELS["glm4moe"]
    counts = [[0] * 8] + [[4, 0, 1, 1, 0, 0, 2, 0]] * (m.layers - 1)
    doc = RoutingProfile(
        model_sha256=desc.model.sha256,
        header_sha256=desc.model.header_sha256,
        layers=m.layers,
        expert_count=8,
        tokens=[0] + [4] * (m.layers - 1),
        counts=counts,
        successor=[[[0] * 8] * 8] * (m.layers - 1),
    )
    profiled = apply_routing_profile(desc, doc)
    assert profiled.routing.tokens == 4
    hot = next(u for u in profiled.units if u.name == "blk.1.expert.0")
    assert (
        hot.access_per_token
        > next(u for u in profiled.units if u.name == "blk.1.expert.1").access_per_token
    )


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"groups": 3, "groups_used": 1}, "expert_group_count is 3"),
        ({"groups": 4, "groups_used": 4}, "expert_group_used_count is 4"),
        ({"nextn": 4, "layers": 0}, "nextn_predict_layers is 4"),
    ],
)
def test_bad_structure_keys_are_refused(update, match, tmp_path, smollm2_gguf):
    """What llama.cpp asserts on is a one-line error naming the key (described from a file)."""
    m = dataclasses.replace(GLM_MODELS["glm4moe"], **update)
    path = write_glm_model(tmp_path / "bad.gguf", "bad", smollm2_gguf, model=m)
    with pytest.raises(GGUFError, match=match):
        describe(str(path))


def test_a_file_without_expert_shared_count_is_refused(tmp_path, smollm2_gguf, monkeypatch):
    """llama.cpp's glm4moe loader requires ``expert_shared_count`` (llama-cpp-python 0.3.36
    refuses such a file): the missing key is named, not reported as unused ``_shexp`` tensors."""
    leave_out_uint32(monkeypatch, "glm4moe.expert_shared_count")
    path = write_glm_model(tmp_path / "none.gguf", "glm4moe", smollm2_gguf)
    with pytest.raises(GGUFError, match="glm4moe.expert_shared_count' is missing"):
        describe(str(path))
