"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE) on tiny synthetic GGUFs (``gguf_gptoss.GPTOSS_MODELS``:
width 64, 4 blocks alternating a sliding window of 8 tokens and global attention, attention sinks,
Q/K/V/O biases, 8 biased experts top-4 with the clamped SwiGLU; F16 experts, YaRN, MXFP4 experts).

- The correctness rule (tests/fixtures/reference_check.py) against llama.cpp's outputs in
  tests/fixtures/data/llamacpp_gptoss.json (``tests/fixtures/make_gptoss_references.py``), at the
  synthetic threshold: argmax where llama.cpp's top-2 gap >= 1.0, top-10 logits after the prompt
  within 1.0. The regenerated GGUFs must have the sha256 the references were made on.
- Its parts against plain numpy statements of llama.cpp's: the router (top-k by logit, softmax
  over the k), the clamped SwiGLU, attention with sinks on every attention path.
- Bit-identical logits with the experts on ram or streamed from nvme (the MXFP4 experts through
  the packed store too).
- The description: the windowed blocks, YaRN's keys, post_attention_norm in the FFN unit, the
  expert biases in the expert units.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import DATA
from gguf_factory import leave_out_uint32
from gguf_gptoss import GPTOSS_MODELS, write_gptoss
from plan_edits import experts_moved
from reference_check import (
    assert_chunked_prefill,
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
from strata.executor.attention import _explicit_attention
from strata.executor.engine import Engine, check_tensors
from strata.executor.models import MOE_ROUTING, model_class
from strata.executor.models.gpt_oss import swiglu_oai
from strata.executor.models.llama import route
from strata.executor.plan_loader import load_plan

GAP = 1.0
TOL = 1.0
CONTEXT = 512
REFERENCES = DATA / "llamacpp_gptoss.json"
NAMES = list(GPTOSS_MODELS)
REMAKE = "tests/fixtures/make_gptoss_references.py --llama-python PYTHON"


@pytest.fixture(scope="session")
def gptoss_references() -> dict[str, list[dict]]:
    return references_by_model(REFERENCES)


@pytest.fixture(scope="session")
def gptoss_ggufs(tmp_path_factory, smollm2_gguf, gptoss_references) -> dict[str, Path]:
    """Each synthetic gpt-oss model, regenerated, checked to be the file of the references."""
    folder = tmp_path_factory.mktemp("gptoss-models")
    return regenerated_models(
        NAMES, gptoss_references, folder, smollm2_gguf, REMAKE, write=write_gptoss
    )


@pytest.fixture(scope="module", params=NAMES)
def gptoss(request, gptoss_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one synthetic gpt-oss model."""
    yield from resident_engine(
        request.param, gptoss_ggufs[request.param], tmp_path_factory, CONTEXT
    )


# --------------------------------------------------------------------------- against llama.cpp


def test_references_cover_every_model_and_case(gptoss_references):
    assert_references_cover(gptoss_references, NAMES)


def test_yarn_and_mxfp4_change_llamacpps_logits(gptoss_references):
    """The variants differ where llama.cpp computes them differently (so the rule on each
    checks YaRN and the MXFP4 repack, not the plain model again)."""
    tops = {n: gptoss_references[n][0]["top10_after_prompt"] for n in NAMES}
    assert tops["gpt-oss"] != tops["gpt-oss-yarn"] != tops["gpt-oss-mxfp4"]
    diff = max(abs(a[1] - b[1]) for a, b in zip(tops["gpt-oss"], tops["gpt-oss-yarn"], strict=True))
    assert diff > 1.0


@pytest.mark.slow
def test_prompt_ids_and_correctness_rule(gptoss, gptoss_references, record_property):
    """Prompt ids exact; teacher-forced argmax where llama.cpp's gap >= 1.0; top-10 logits after
    the prompt within 1.0."""
    name, _, engine = gptoss
    assert_prompt_ids(name, engine, gptoss_references[name])
    assert_correctness_rule(name, engine, gptoss_references[name], GAP, TOL, record_property)


@pytest.mark.slow
def test_greedy_decode_and_chunked_prefill(gptoss, gptoss_references):
    """Free-running greedy decode through the serving engine follows llama.cpp (until a near
    tie); prefill in chunks of 5 (windows and sinks across chunk borders) equals one pass."""
    name, _, engine = gptoss
    ref = gptoss_references[name][-1]
    assert_chunked_prefill(engine, ref)
    for serving in started_serving(engine):
        assert greedy_divergence(serving, ref, GAP) is None, name


# --------------------------------------------------------------------------- tiers


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["ram", "nvme"])
def test_tiers_are_bit_identical(gptoss, gptoss_references, placement, tmp_path):
    """Every expert (and the dense FFN units) on ram, or every expert streamed from nvme through
    an expert cache of 2 slots (a block's top-4 in groups of 2; MXFP4 experts through the packed
    store's mxfp4 parts): logits bit-identical to all-resident, greedy ids llama.cpp's."""
    name, plan, engine = gptoss
    if placement == "ram":
        moved = experts_moved(plan, tmp_path / "p.yaml", "ram", slots=0, ffn=True)
    else:
        moved = experts_moved(plan, tmp_path / "p.yaml", "nvme", slots=2)
    stats = assert_tier_matches(engine, moved, gptoss_references[name][0])
    if placement == "nvme":
        assert stats["experts"]["misses"] > 0


# --------------------------------------------------------------------------- the parts


def test_router_is_top_k_by_logit_then_softmax_over_the_k():
    """llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT (``build_moe_ffn``)."""
    rule = MOE_ROUTING["gpt-oss"]
    assert (rule.gating, rule.norm, rule.scale) == ("softmax_weight", False, 0.0)
    logits = np.random.default_rng(5).normal(0, 2.0, (21, 8)).astype(np.float32)
    weights, chosen = route(mx.array(logits), 4, rule)
    want_c = np.argsort(-logits, axis=-1, kind="stable")[:, :4]
    top = np.take_along_axis(logits.astype(np.float64), want_c, axis=-1)
    want_w = np.exp(top - top.max(-1, keepdims=True))
    want_w /= want_w.sum(-1, keepdims=True)
    assert np.array_equal(np.array(chosen), want_c)
    np.testing.assert_allclose(np.array(weights), want_w, rtol=2e-6, atol=1e-7)


def test_swiglu_oai_is_ggmls():
    """x = min(gate, 7), y = clamp(up, -7, 7), x * sigmoid(1.702 x) * (y + 1)."""
    rng = np.random.default_rng(6)
    gate, up = (rng.normal(0, 6.0, 1000).astype(np.float32) for _ in range(2))
    x = np.minimum(gate.astype(np.float64), 7.0)
    y = np.clip(up.astype(np.float64), -7.0, 7.0)
    want = x / (1 + np.exp(-1.702 * x)) * (y + 1)
    got = np.array(swiglu_oai(mx.array(gate), mx.array(up)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (gate > 7).any() and (np.abs(up) > 7).any()  # the clamps were exercised


def _attention_with_sinks(q, k, v, scale, mask, sinks):
    """Softmax over [scores, sink] per head (the sink has no value), in float64."""
    b, h, t, d = q.shape
    k, v = (np.repeat(a, h // a.shape[1], axis=1) for a in (k, v))
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s = np.where(mask, s, -np.inf)
    full = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[..., :-1] @ v


def test_every_attention_path_takes_the_sinks():
    """MLX's SDPA (the decode group and prefill chunks) and the explicit path equal llama.cpp's
    softmax with a sink term; without sinks they differ (the sinks matter)."""
    rng = np.random.default_rng(7)
    q = rng.normal(0, 1, (1, 4, 5, 16)).astype(np.float32)
    k, v = (rng.normal(0, 1, (1, 2, 9, 16)).astype(np.float32) for _ in range(2))
    sinks = rng.normal(0, 2, 4).astype(np.float32)
    mask = np.arange(9)[None, :] <= np.arange(4, 9)[:, None]
    want = _attention_with_sinks(*(a.astype(np.float64) for a in (q, k, v)), 0.25, mask, sinks)
    args = [mx.array(a) for a in (q, k, v)]
    explicit = _explicit_attention(*args, 0.25, mx.array(mask), mx.array(sinks))
    sdpa = mx.fast.scaled_dot_product_attention(
        *args, scale=0.25, mask=mx.array(mask), sinks=mx.array(sinks)
    )
    for got in (explicit, sdpa):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    plain = _explicit_attention(*args, 0.25, mx.array(mask))
    assert np.abs(np.array(plain) - want).max() > 1e-2


def test_half_precision_compute_takes_the_float32_sinks(gptoss, gptoss_ggufs, tmp_path):
    """A float16 plan (as on a GPU) runs: MLX's SDPA refuses float32 sinks beside float16
    queries, so ``attend`` hands them over in the compute dtype; its logits stay near the
    float32 engine's, prefilled whole or in chunks of 5 (MLX's SDPA and the explicit path)."""
    from conftest import DEV_PROFILE, make_plan_file

    name, _, engine = gptoss
    profile = tmp_path / "f16.yaml"
    text = DEV_PROFILE.read_text()
    assert "compute_dtype: float32" in text
    profile.write_text(text.replace("compute_dtype: float32", "compute_dtype: float16"))
    plan = make_plan_file(str(gptoss_ggufs[name]), tmp_path / "p.yaml", profile, context=256)
    half = Engine(load_plan(plan))
    try:
        ids = list(range(100, 130))
        want = engine.logits_for(ids)
        got = half.logits_for(ids)
        half.prefill_chunk = 5
        chunked = half.logits_for(ids)
    finally:
        half.close()
    for half_logits in (got, chunked):
        assert np.isfinite(half_logits).all(), name
        # Per row, the largest difference from float32: about 0.1-0.4 on these models; half
        # precision may flip a near-tied router choice, a whole-logit jump in that row alone
        # (one of the 30 rows of gpt-oss: 7.4), so up to two rows may exceed 0.5.
        diff = np.abs(half_logits - want).max(axis=-1)
        assert np.count_nonzero(diff > 0.5) <= 2, (name, np.round(diff, 2).tolist())


# --------------------------------------------------------------------------- description


def test_description_and_tensors(gptoss):
    name, _, engine = gptoss
    desc = engine.loaded.desc
    a, m = desc.architecture, GPTOSS_MODELS[name]
    check_tensors(desc, model_class(a).expected_shapes(a))
    assert a.sliding_window == m.window and a.sliding_window_layers == [0, 2]
    assert [la.window for la in engine.model.layers] == [m.window, 0, m.window, 0]
    if m.yarn:
        # llama.cpp's gpt-oss reads rope.scaling.attn_factor and ignores the yarn_* keys.
        assert a.rope_scaling_type == "yarn" and a.rope_freq_scale == 1 / 32
        assert a.rope_scaling_original_context == 4096 and a.rope_yarn_ext_factor is None
        assert (a.rope_yarn_beta_fast, a.rope_yarn_beta_slow, a.rope_yarn_attn_factor) == (
            32.0,
            1.0,
            1.0,
        )
        attn = dict(m.metadata).get("rope.scaling.attn_factor", 1.0)
        assert a.rope_attn_factor == attn
        _, mscale = engine.model._yarn(a.rope_freq_base, a.rope_freq_scale)
        assert mscale == pytest.approx(attn * (1 + 0.1 * math.log(32)), rel=1e-6)
    else:
        assert a.rope_scaling_type == "none"
    units = {u.name: u for u in desc.units}
    assert "blk.1.post_attention_norm.weight" in units["blk.1.ffn"].tensors
    assert "blk.1.attn_sinks.weight" in units["blk.1.attn"].tensors
    expert = units["blk.1.expert.3"]
    assert {"blk.1.ffn_gate_exps.bias", "blk.1.ffn_down_exps.bias"} <= set(expert.tensors)
    tensors = {t.name: t for t in desc.tensors}
    want = sum(tensors[n].bytes_mlx for n in expert.tensors) // m.experts
    assert expert.bytes_mlx == want and all(u.supported for u in desc.units)
    if m.expert_type.name == "MXFP4":
        gate = tensors["blk.0.ffn_gate_exps.weight"]
        assert gate.bytes_mlx == gate.bytes_gguf  # MLX's mxfp4 holds the file's bytes


def test_a_file_without_its_window_is_refused(tmp_path, smollm2_gguf, monkeypatch):
    """llama.cpp's gpt-oss loader requires ``attention.sliding_window`` (llama-cpp-python 0.3.36
    refuses such a file); without it Strata would run every block globally. Missing or 0: a
    one-line GGUFError naming the key."""
    import dataclasses

    from strata.common.describe import describe
    from strata.common.errors import GGUFError

    zero = dataclasses.replace(GPTOSS_MODELS["gpt-oss"], window=0)
    path = write_gptoss(tmp_path / "zero.gguf", "gpt-oss", smollm2_gguf, model=zero)
    with pytest.raises(GGUFError, match="gpt-oss.attention.sliding_window' is 0"):
        describe(str(path))
    leave_out_uint32(monkeypatch, "gpt-oss.attention.sliding_window")
    path = write_gptoss(tmp_path / "none.gguf", "gpt-oss", smollm2_gguf)
    with pytest.raises(GGUFError, match="gpt-oss.attention.sliding_window' is missing"):
        describe(str(path))


# --------------------------------------------------------------------------- harmony chat format

HARMONY = (DATA / "gpt_oss_chat_template.jinja").read_text()
"""gpt-oss's chat template (the harmony format) as llama.cpp keeps it in
``models/templates/openai-gpt-oss-120b.jinja``, taken from a fork's copy of that file
(angerybob/S2-MoE) whose generation prompt had been edited to open the final channel: restored
here to ``<|start|>assistant``, as in llama.cpp's (the rest matched llama.cpp's text wherever
compared; the copy is 2 characters shorter than a llama.cpp fork's, somewhere in the tool
rendering macros, which this test does not render)."""


def test_harmony_template_renders_from_the_gguf(tmp_path, smollm2_gguf):
    """The real template, written into a synthetic gpt-oss GGUF, rendered by Strata's sandbox
    (``strftime_now``, ``raise_exception``, ``namespace``, ``tojson``), equals harmony's format:
    the system header with today's date, the developer message's instructions, the assistant's
    earlier reply on the final channel, the generation prompt ``<|start|>assistant``."""
    import dataclasses
    import time

    from strata.executor.chat import ChatError, render_chat
    from strata.executor.tokenizer import GGUFTokenizer

    model = dataclasses.replace(GPTOSS_MODELS["gpt-oss"], chat_template=HARMONY)
    path = write_gptoss(tmp_path / "harmony.gguf", "gpt-oss", smollm2_gguf, model=model)
    template = GGUFTokenizer.from_gguf(path, cache=False).chat_template
    assert template == HARMONY
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    text = render_chat(template, messages, "", "", True)
    today = time.strftime("%Y-%m-%d")
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
        "<|start|>user<|message|>What is 2+2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>user<|message|>And 3+3?<|end|>"
        "<|start|>assistant"
    )
    # Jinja2's own sandbox, given the globals the template uses, renders the same text.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=refuse, strftime_now=time.strftime)
    assert env.from_string(template).render(messages=messages, add_generation_prompt=True) == text
    # The template's own refusal reaches the caller as a ChatError naming its text.
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatError, match="no previous assistant message with a tool call"):
        render_chat(template, bad, "", "", True)
