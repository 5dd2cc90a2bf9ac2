"""Mixture-of-experts architectures (Mixtral-style llama, qwen2moe, qwen3moe, olmoe) on tiny
synthetic GGUFs (``gguf_factory.MOE_MODELS``: 8 experts, F32 routers and attention, F32/F16
experts, Q8_0/F16 embeddings and heads, SmolLM2's tokenizer).

- The correctness rule (tests/reference_check.py) against llama.cpp's outputs stored in
  tests/fixtures/data/llamacpp_moe.json (``tests/fixtures/make_arch_references.py --moe``; CI has
  no llama.cpp),
  with the synthetic threshold: argmax checked where llama.cpp's top-2 gap is at least 1.0,
  top-10 logits after the prompt within 1.0. The GGUFs are regenerated here and must have the
  sha256 the references were made on. A wrong router rule fails it by far (measured when the
  rule was written: renormalizing where llama.cpp does not, or the reverse, moved the top-10
  logits by 7.5 to 32 and broke 6 to 49 checked steps per model).
- The routing function, and one whole MoE block, against a plain numpy statement of llama.cpp's
  rule (``build_moe_ffn``); the per-architecture table against llama.cpp's graph code.
- GGUF routing keys llama.cpp ignores for these architectures are ignored here too
  (``make_arch_references.py --moe`` checks llama.cpp ignores them on every model).
- Only the chosen experts are fetched; the result does not change a bit with how the weight
  store groups them, nor with the tier (ram, or nvme through a 2-slot expert cache).
- Descriptions and the tensors each architecture expects; what llama.cpp refuses is refused
  (no experts for qwen3moe, experts for qwen2, a fused ``ffn_gate_up_exps``).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import DATA
from gguf_factory import MOE_MODELS, moe_key_variant, write_arch_model
from plan_edits import experts_moved
from reference_check import (
    assert_correctness_rule,
    assert_prompt_ids,
    assert_references_cover,
    assert_tier_matches,
    greedy_divergence,
    references_by_model,
    regenerated_models,
    resident_engine,
    started_serving,
)
from strata.common.describe import describe
from strata.common.errors import StrataError
from strata.common.schemas import Architecture
from strata.executor.config import RuntimeConfig
from strata.executor.engine import check_tensors
from strata.executor.experts import split_gate_up
from strata.executor.models import ARCHITECTURES, MOE_ROUTING, model_class
from strata.executor.models.llama import NORM_SUM_MIN, LlamaModel, MoeRouting, route

GAP = 1.0
"""llama.cpp's top-2 gap from which our argmax must match (the synthetic threshold, as
tests/test_architectures.py)."""
TOL = 1.0
"""Largest allowed |ours - llama.cpp| over its top-10 logits after the prompt."""
CONTEXT = 512
REFERENCES = DATA / "llamacpp_moe.json"
NAMES = list(MOE_MODELS)


@pytest.fixture(scope="session")
def moe_references() -> dict[str, list[dict]]:
    """llama.cpp's outputs per synthetic MoE model (make_arch_references.py --moe)."""
    return references_by_model(REFERENCES)


@pytest.fixture(scope="session")
def moe_ggufs(tmp_path_factory, smollm2_gguf, moe_references) -> dict[str, Path]:
    """Each synthetic MoE model, regenerated, checked to be the file the references are of."""
    folder = tmp_path_factory.mktemp("moe-models")
    return regenerated_models(
        NAMES,
        moe_references,
        folder,
        smollm2_gguf,
        "tests/fixtures/make_arch_references.py --moe --llama-python PYTHON",
    )


@pytest.fixture(scope="module", params=NAMES)
def moe(request, moe_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one synthetic MoE model."""
    yield from resident_engine(request.param, moe_ggufs[request.param], tmp_path_factory, CONTEXT)


@pytest.fixture(scope="module")
def moe_serving(moe):
    """The serving engine over ``moe``'s engine (``strata run``'s), started."""
    yield from started_serving(moe[2])


# --------------------------------------------------------------------------- against llama.cpp


def test_references_cover_every_model_and_case(moe_references):
    assert_references_cover(moe_references, NAMES)


def test_prompt_ids_exact(moe, moe_references):
    name, _, engine = moe
    assert_prompt_ids(name, engine, moe_references[name])


def test_correctness_rule_against_llamacpp(moe, moe_references, record_property):
    """Teacher-forced argmax where llama.cpp's gap >= 1.0; top-10 logits after the prompt within
    1.0."""
    name, _, engine = moe
    assert_correctness_rule(name, engine, moe_references[name], GAP, TOL, record_property)


def test_greedy_decode_follows_llamacpp_until_a_near_tie(moe, moe_serving, moe_references):
    """Free-running greedy decode (``strata run``'s serving engine, one token and one routing at
    a time)."""
    name = moe[0]
    for ref in moe_references[name]:
        assert greedy_divergence(moe_serving, ref, GAP) is None, name


def test_chunked_prefill_matches_one_pass(moe, moe_references):
    name, _, engine = moe
    ref = moe_references[name][-1]
    ids = ref["prompt_ids"] + ref["greedy_ids"][:-1]
    whole = engine.logits_for(ids)
    chunk = engine.prefill_chunk
    try:
        engine.prefill_chunk = 5
        chunked = engine.logits_for(ids)
    finally:
        engine.prefill_chunk = chunk
    np.testing.assert_allclose(chunked, whole, atol=2e-3, rtol=0)


# --------------------------------------------------------------------------- router rules


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _llamacpp_rule(logits: np.ndarray, k: int, gating: str, norm: bool, scale: float):
    """llama.cpp's ``build_moe_ffn`` routing in plain numpy (float64): probabilities over all
    experts (softmax or sigmoid), the k largest (largest first), their probabilities divided by
    their sum clamped at 2^-14 when ``norm``, times ``scale`` unless it is 0 or 1."""
    probs = _softmax(logits) if gating == "softmax" else 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, chosen, axis=-1)
    if norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), 2.0**-14)
    if scale not in (0.0, 1.0):
        w = w * scale
    return w, chosen


RULES = {
    # llama.cpp's graph code passes (gating, norm_w) to build_moe_ffn, and w_scale =
    # hparams.expert_weights_scale, which none of these architectures' hparams read (0).
    "llama": ("softmax", True),  # src/models/llama.cpp
    "qwen2moe": ("softmax", False),  # src/models/qwen2moe.cpp (+ sigmoid-gated shared expert)
    "qwen3moe": ("softmax", True),  # src/models/qwen3moe.cpp
    "olmoe": ("softmax", False),  # src/models/olmoe.cpp
}


def test_per_architecture_table_is_llamacpps():
    """The four families here (the newer ones have their own test files)."""
    assert {a: (r.gating, r.norm, r.scale) for a, r in MOE_ROUTING.items() if a in RULES} == {
        a: (*rule, 0.0) for a, rule in RULES.items()
    }
    assert all(not MOE_ROUTING[a].gguf_keys for a in RULES)
    assert NORM_SUM_MIN == 2.0**-14
    assert ARCHITECTURES["qwen2moe"].shared_expert
    assert not any(ARCHITECTURES[a].shared_expert for a in ("llama", "qwen3moe", "olmoe"))


@pytest.mark.parametrize("arch", list(RULES))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_route_matches_llamacpps_rule(arch, k):
    rng = np.random.default_rng([k, len(arch)])
    logits = rng.normal(0, 2.0, (33, 8)).astype(np.float32)
    weights, chosen = route(mx.array(logits), k, MOE_ROUTING[arch])
    want_w, want_c = _llamacpp_rule(logits.astype(np.float64), k, *RULES[arch], 0.0)
    assert chosen.dtype == mx.int32 and weights.dtype == mx.float32
    assert np.array_equal(np.array(chosen), want_c)
    np.testing.assert_allclose(np.array(weights), want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "rule",
    [
        MoeRouting("sigmoid", norm=False),
        MoeRouting("sigmoid", norm=True, scale=2.5),
        MoeRouting("softmax", norm=False, scale=16.0),
        MoeRouting("softmax", norm=True, scale=1.0),
    ],
)
def test_route_other_rules(rule):
    """The gating functions and scaling a future architecture's row may name."""
    logits = np.random.default_rng(7).normal(0, 3.0, (17, 16)).astype(np.float32)
    weights, chosen = route(mx.array(logits), 6, rule)
    want_w, want_c = _llamacpp_rule(
        logits.astype(np.float64), 6, rule.gating, rule.norm, rule.scale
    )
    assert np.array_equal(np.array(chosen), want_c)
    np.testing.assert_allclose(np.array(weights), want_w, rtol=2e-6, atol=1e-7)


def test_renormalized_softmax_is_a_softmax_over_the_chosen():
    """Softmax over all then renormalizing the chosen equals top-k then softmax (Mixtral's
    reference code), to float rounding."""
    logits = np.random.default_rng(3).normal(0, 2.0, (9, 8)).astype(np.float32)
    weights, chosen = route(mx.array(logits), 2, MOE_ROUTING["llama"])
    topk = np.take_along_axis(logits.astype(np.float64), np.array(chosen), axis=-1)
    np.testing.assert_allclose(np.array(weights), _softmax(topk), rtol=1e-6)


def test_weight_sum_clamp():
    """All chosen probabilities underflow to 0 -> weights 0, not NaN (llama.cpp's clamp)."""
    logits = mx.array([[0.0, -200.0, -200.0, -200.0]])
    weights, chosen = route(logits, 2, MoeRouting("softmax", norm=True))
    assert np.array(chosen).tolist() == [[0, 1]]
    assert np.array(weights)[0, 1] == 0.0 and np.isfinite(np.array(weights)).all()


def test_gguf_routing_keys_follow_the_architectures_row(capsys):
    base = _arch("qwen3moe", expert_weights_norm=False, expert_gating_func="sigmoid")
    base = base.model_copy(update={"expert_weights_scale": 2.0})
    # llama.cpp reads none of the keys for qwen3moe: the row stands, and the user is told.
    assert MOE_ROUTING["qwen3moe"].for_model(base) == MOE_ROUTING["qwen3moe"]
    err = capsys.readouterr().err
    assert err.count("is ignored") == 3 and "qwen3moe.expert_weights_norm" in err
    # A row that names a key takes the GGUF's value (as llama.cpp's deepseek2 or glm4moe do).
    keys = frozenset({"expert_weights_norm", "expert_gating_func", "expert_weights_scale"})
    honours = MoeRouting("softmax", norm=True, gguf_keys=keys)
    assert honours.for_model(base) == MoeRouting("sigmoid", False, 2.0, keys)
    assert honours.for_model(_arch("qwen3moe")) == honours
    # A scale of 1 acts as none: nothing to report.
    olmoe = _arch("olmoe", expert_weights_scale=1.0)
    assert MOE_ROUTING["olmoe"].for_model(olmoe) == MOE_ROUTING["olmoe"]
    assert "is ignored" not in capsys.readouterr().err


def _arch(name: str, **fields) -> Architecture:
    """A small MoE architecture record (4 experts, top-2, FFN 16) of ``name``."""
    return Architecture(
        name=name,
        block_count=1,
        context_length=64,
        embedding_length=8,
        feed_forward_length=16,
        head_count=2,
        head_count_kv=2,
        head_dim=4,
        vocab_size=10,
        rope_freq_base=10000.0,
        rope_dimension_count=4,
        rms_norm_eps=1e-6,
        tied_embeddings=True,
        expert_count=4,
        expert_used_count=2,
        **fields,
    )


def test_routing_keys_ignored_as_llamacpp_does(tmp_path, smollm2_gguf, capsys):
    """A GGUF that sets ``expert_weights_norm``, ``expert_gating_func`` and
    ``expert_weights_scale`` against the rule (``gguf_factory.moe_key_variant``) is described
    with those keys, and routed by the architecture's row all the same, as llama.cpp routes it
    (``make_arch_references.py --moe`` checks, for every model, that llama.cpp's outputs on the
    variant equal those on the plain file). The forward pass reads the rule from nowhere else.
    One model: describing a file costs seconds of tokenizer parsing."""
    name = "qwen3moe"
    path = write_arch_model(tmp_path / "keys.gguf", name, smollm2_gguf, model=moe_key_variant(name))
    a = describe(str(path))[0].architecture
    assert (a.expert_weights_norm, a.expert_gating_func, a.expert_weights_scale) == (
        False,
        "sigmoid",
        2.5,
    )
    assert model_class(a).moe_routing.for_model(a) == MOE_ROUTING[name]
    assert capsys.readouterr().err.count("is ignored: llama.cpp ignores it for qwen3moe") == 3


class _Experts:
    """A weight store of one MoE block, for ``LlamaModel.moe_ffn`` alone: dense tensors by
    name, experts in groups of ``group`` (the store's contract of ``route``, ``experts`` and
    ``release_experts``)."""

    def __init__(self, experts: dict[int, dict[str, mx.array]], group: int):
        self.e, self.group, self.released = experts, group, 0

    def route(self, layer: int, chosen: np.ndarray) -> list[list[int]]:
        ids = sorted(set(chosen.ravel().tolist()))
        return [ids[i : i + self.group] for i in range(0, len(ids), self.group)]

    def experts(self, layer: int, group: list[int]) -> dict[int, dict[str, mx.array]]:
        return {e: self.e[e] for e in group}

    def release_experts(self, layer: int, result: mx.array) -> mx.array:
        self.released += 1
        return result


@pytest.mark.parametrize("arch", list(RULES))
def test_moe_block_matches_a_numpy_statement(arch):
    """One MoE block (``moe_ffn``) against numpy, float64: RMSNorm, router, llama.cpp's rule,
    each token's k experts' SwiGLU outputs weighted and summed, plus qwen2moe's shared expert
    times sigmoid(h . ffn_gate_inp_shexp); the same bits whether the experts come in groups of
    1, 3 or 8, each group released once."""
    rng = np.random.default_rng(len(arch))
    t, d, ff, n, k = 5, 16, 12, 8, 3
    a = _arch(arch, expert_feed_forward_length=ff, expert_shared_feed_forward_length=ff)
    a = a.model_copy(update={"embedding_length": d, "expert_count": n, "expert_used_count": k})

    def mat(*shape):
        return rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)

    def swiglu(h, gate, up, down):
        g = h @ gate.T
        return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T

    x, norm, router = rng.normal(size=(t, d)).astype(np.float32), 1 + mat(d) / 4, mat(n, d)
    ex = {e: (mat(ff, d), mat(ff, d), mat(d, ff)) for e in range(n)}
    shared = (mat(ff, d), mat(ff, d), mat(d, ff))
    shared_gate = mat(d)
    tensors = {"ffn_norm": norm, "ffn_gate_inp": router, "ffn_gate_inp_shexp": shared_gate}
    names = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    tensors |= dict(zip(names, shared, strict=True))

    h = x.astype(np.float64)
    h = h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + a.rms_norm_eps) * norm
    weights, chosen = _llamacpp_rule(h @ router.T, k, *RULES[arch], 0.0)
    want = np.zeros((t, d))
    for i in range(t):
        for j, e in enumerate(chosen[i]):
            want[i] += weights[i, j] * swiglu(h[i], *ex[e])
    if arch == "qwen2moe":
        want += swiglu(h, *shared) / (1 + np.exp(-(h @ shared_gate)))[:, None]

    outs = []
    for group in (1, 3, 8):
        cls = model_class(a)
        model = cls.__new__(cls)  # the MoE block needs only these attributes
        model.arch, model.routing, model.config = a, MOE_ROUTING[arch], RuntimeConfig.build()
        experts = {
            e: dict(zip(("gate", "up", "down"), map(mx.array, m), strict=True))
            for e, m in ex.items()
        }
        model.store = _Experts(experts, group)
        w = {f"blk.0.{name}.weight": mx.array(v) for name, v in tensors.items()}
        outs.append(np.array(model.moe_ffn(w, 0, mx.array(x)[None]))[0])
        assert model.store.released == -(-len(np.unique(chosen)) // group)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- grouping and tiers


def _regrouped(store, how: str):
    """Wrap ``store.route`` so that it hands the chosen experts over in other groups."""
    inner = store.route

    def route_(layer, chosen):
        ids = sorted(e for g in inner(layer, chosen) for e in g)
        if how == "single":
            return [[e] for e in ids]
        if how == "pairs":
            return [ids[i : i + 2] for i in range(0, len(ids), 2)]
        return [ids]

    return route_


@pytest.mark.parametrize("how", ["single", "pairs"])
def test_grouping_does_not_change_a_bit(moe, moe_references, how, monkeypatch):
    """One expert per group, or two, gives the logits of one group, bit for bit."""
    name, _, engine = moe
    ref = moe_references[name][1]
    ids = ref["prompt_ids"] + ref["greedy_ids"][:6]
    whole = engine.logits_for(ids)
    monkeypatch.setattr(engine.store, "route", _regrouped(engine.store, how))
    assert np.array_equal(engine.logits_for(ids), whole)


def test_only_chosen_experts_are_fetched(moe, monkeypatch):
    """The store is asked for exactly the experts the router chose, each once per block."""
    name, _, engine = moe
    asked: list[tuple[int, list[int], list[int]]] = []
    inner_route, inner_experts = engine.store.route, engine.store.experts
    last: dict[int, list[int]] = {}

    def route_(layer, chosen):
        assert isinstance(chosen, np.ndarray) and chosen.dtype == np.int32
        assert chosen.shape[1] == MOE_MODELS[name].experts_used
        last[layer] = sorted(set(chosen.ravel().tolist()))
        return inner_route(layer, chosen)

    def experts_(layer, group):
        asked.append((layer, list(group), last[layer]))
        return inner_experts(layer, group)

    monkeypatch.setattr(engine.store, "route", route_)
    monkeypatch.setattr(engine.store, "experts", experts_)
    engine.logits_for([504, 3575, 282, 4649, 314])
    layers = MOE_MODELS[name].layers
    assert sorted(a[0] for a in asked) == list(range(layers))
    assert all(group == chosen for _, group, chosen in asked)


@pytest.mark.parametrize("placement", ["ram", "nvme"])
def test_tiers_are_bit_identical(moe, moe_references, placement, tmp_path):
    """The dense FFN units (norm, router, shared expert) and every expert on ram, copied to the
    device at each use; or every expert streamed from nvme through an expert cache of 2 slots
    (so a block's chosen experts come in groups of at most 2): logits bit-identical to
    all-resident, greedy ids the same."""
    name, plan, engine = moe
    if placement == "ram":
        moved = experts_moved(plan, tmp_path / "p.yaml", "ram", slots=0, ffn=True)
    else:
        moved = experts_moved(plan, tmp_path / "p.yaml", "nvme", slots=2)
    assert_tier_matches(engine, moved, moe_references[name][0])


# --------------------------------------------------------------------------- tensors and refusals


def test_descriptions_match_the_forward_pass(moe):
    """Every tensor is one the forward pass expects (shapes from the hyperparameters and each
    architecture's expert-width rule); router and shared expert in the dense FFN unit."""
    name, _, engine = moe
    desc = engine.loaded.desc
    a, m = desc.architecture, MOE_MODELS[name]
    check_tensors(desc, model_class(a).expected_shapes(a))
    assert (a.expert_count, a.expert_used_count) == (m.experts, m.experts_used)
    assert model_class(a).expert_width(a) == (m.expert_ffn or m.ffn), name
    units = {u.name: set(u.tensors) for u in desc.units}
    ffn = {"blk.0.ffn_norm.weight", "blk.0.ffn_gate_inp.weight"}
    if m.shared_ffn:
        ffn |= {f"blk.0.ffn_{t}_shexp.weight" for t in ("gate_inp", "gate", "up", "down")}
    assert units["blk.0.ffn"] == ffn, name
    assert {f"blk.0.expert.{e}" for e in range(m.experts)} <= set(units), name


def test_expert_width_defaults():
    """qwen2moe/qwen3moe without ``expert_feed_forward_length``: ``feed_forward_length /
    expert_used_count`` (llama.cpp's rule); llama and olmoe: ``feed_forward_length`` always."""
    a = _arch("qwen3moe")
    assert model_class(a).expert_width(a) == 8
    assert model_class(_arch("qwen2moe")).expert_width(a) == 8
    b = _arch("olmoe", expert_feed_forward_length=4)
    assert model_class(b).expert_width(b) == 16 == LlamaModel.expert_width(b)
    c = _arch("qwen2moe", expert_feed_forward_length=4, expert_shared_feed_forward_length=12)
    cls = model_class(c)
    assert (cls.expert_width(c), cls.shared_width(c)) == (4, 12)


def test_refusals_as_llamacpp():
    """No experts where llama.cpp needs them; experts where it has none; bad top-k."""
    dense = _arch("qwen3moe").model_copy(update={"expert_count": 0, "expert_used_count": 0})
    with pytest.raises(StrataError, match="needs qwen3moe.expert_count"):
        model_class(dense).expected_shapes(dense)
    with pytest.raises(StrataError, match="qwen2 with experts"):
        model_class(_arch("qwen2")).expected_shapes(_arch("qwen2"))
    bad = _arch("olmoe").model_copy(update={"expert_used_count": 5})
    with pytest.raises(StrataError, match="expert_used_count is 5"):
        model_class(bad).expected_shapes(bad)


def test_fused_gate_up_is_refused_as_llamacpp_does(moe):
    """llama.cpp loads ``ffn_gate_up_exps`` for none of these architectures: a file with it in
    place of ``ffn_{gate,up}_exps`` (``gguf_factory``'s ``fused_gate_up``) fails to load there on
    the missing ``ffn_gate_exps`` (seen on llama-cpp-python 0.3.36), and Strata refuses it
    before loading, for the same reason. (The description is the plain file's with block 0's
    tensors swapped: describing a fused file costs seconds of tokenizer parsing.)"""
    name, _, engine = moe
    desc = engine.loaded.desc
    a = desc.architecture
    gate = next(t for t in desc.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    fused = gate.model_copy(
        update={
            "name": "blk.0.ffn_gate_up_exps.weight",
            "shape": [a.embedding_length, 2 * gate.shape[1], a.expert_count],
        }
    )
    drop = {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"}
    tensors = [t for t in desc.tensors if t.name not in drop] + [fused]
    with pytest.raises(StrataError, match="no tensor blk.0.ffn_gate_exps.weight"):
        check_tensors(
            desc.model_copy(update={"tensors": tensors}), model_class(a).expected_shapes(a)
        )


def test_fused_gate_up_expert_is_gate_then_up():
    """An expert stored fused (``gate_up`` [2 ff, d]) is split by the store as llama.cpp's
    build_moe_ffn views it: gate = the first ff rows, up = the rest; the expert then computes
    what the separate tensors give."""
    rng = np.random.default_rng(5)
    gate, up = (mx.array(rng.normal(size=(6, 4)).astype(np.float32)) for _ in range(2))
    down = mx.array(rng.normal(size=(4, 6)).astype(np.float32))
    h = mx.array(rng.normal(size=(3, 4)).astype(np.float32))
    model = LlamaModel.__new__(LlamaModel)
    model.config = RuntimeConfig.build()
    split = split_gate_up({"gate_up": mx.concatenate([gate, up]), "down": down})
    assert set(split) == {"gate", "up", "down"}
    assert np.array_equal(np.array(split["gate"]), np.array(gate))
    want = model.expert({"gate": gate, "up": up, "down": down}, h)
    assert np.array_equal(np.array(model.expert(split, h)), np.array(want))
