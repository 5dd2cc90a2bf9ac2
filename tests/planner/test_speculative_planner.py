"""Speculative decoding in the planner: the choice of K and draft layers, the draft model planned
with the target, the plan's section, explain, and the loader's checks of the draft model file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import DEV_PROFILE
from gguf_factory import write_arch_model, write_tiny_llama
from pydantic import ValidationError
from strata.common.catalog import file_sha256
from strata.common.describe import describe
from strata.common.errors import PlanError, StrataError
from strata.common.schemas import (
    PLAN_VERSION,
    HardwareProfile,
    Plan,
    Request,
    Speculative,
)
from strata.common.yamlio import read_yaml, to_yaml, write_yaml
from strata.executor.plan_loader import load_plan
from strata.planner.explain import explain
from strata.planner.ilp import solve
from strata.planner.planning import build_plan
from strata.planner.speculative import (
    K_CHOICES,
    SELF_ACCEPTANCE_FULL,
    SpeculativeRequest,
    expected_tokens,
    extra_activations,
    k_limit,
    plan_speculative,
    self_draft_seconds,
    self_units,
    verify_seconds,
)
from synthetic_desc import GIB, llama70b_desc, m1max32_profile

from strata.cli import plan_main


@pytest.fixture(scope="module")
def smollm2_desc():
    return describe("smollm2-135m")[0]


@pytest.fixture(scope="module")
def dev_profile() -> HardwareProfile:
    return read_yaml(DEV_PROFILE, HardwareProfile)


@pytest.fixture(scope="module")
def budget(budget_plans) -> dict[str, Plan]:
    return {name: read_yaml(p, Plan) for name, p in budget_plans.items()}


@pytest.fixture(scope="module")
def llama70b() -> tuple:
    """The 70B-size model on the 32 GB M1 Max (its FFNs and head stream; the disk binds) and on
    the same machine with room for every unit (the same rates)."""
    desc = llama70b_desc()
    small = m1max32_profile()
    big = small.model_copy(deep=True)
    big.gpu.working_set_bytes.value = float(200 * GIB)
    big.ram.capacity_bytes.value = float(256 * GIB)
    request = Request(context=4096)
    plans = [solve(desc, p, request).to_plan(desc, p, request) for p in (small, big)]
    return desc, (plans[0], small), (plans[1], big)


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory, smollm2_gguf) -> Path:
    """A tiny random qwen2 model (3 blocks, width 64) with SmolLM2's tokenizer: a draft model of
    the same vocabulary."""
    path = tmp_path_factory.mktemp("draft") / "draft.gguf"
    return write_arch_model(path, "qwen2", smollm2_gguf)


# --------------------------------------------------------------------------- the formulas


def test_expected_tokens() -> None:
    assert expected_tokens(0, 0.7) == 1.0
    assert expected_tokens(4, 0.0) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(3, 0.6) == pytest.approx(sum(0.6**i for i in range(4)))


def test_verification_of_one_token_is_the_plain_step(budget, smollm2_desc, dev_profile) -> None:
    for name in ("resident", "ffn-nvme"):
        plan = budget[name]
        assert verify_seconds(smollm2_desc, dev_profile, plan, 0) == pytest.approx(
            plan.prediction.step_s,
            rel=1e-5,  # the file keeps 6 digits
        )
        steps = [verify_seconds(smollm2_desc, dev_profile, plan, k) for k in range(9)]
        assert steps == sorted(steps)  # more tokens never make the pass shorter


def _k(plan, desc, profile, a: float, method: str = "prompt_lookup") -> int:
    spec = SpeculativeRequest(method, acceptance_rate=a)
    return plan_speculative(plan, desc, profile, spec).num_draft_tokens


def test_k_is_monotone_in_the_acceptance_rate(budget, smollm2_desc, dev_profile, llama70b) -> None:
    desc70, streamed, resident = llama70b
    rates = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
    # (plan, ..., profile, method, the first rate at which K > 1 pays, or None). On the CPU a
    # verification of K + 1 tokens costs about K + 1 decode steps (its quantized matmul costs in
    # proportion to its rows; measured there: prompt lookup 0.69x at 45% acceptance), so only
    # perfect acceptance pays, by the per-step overhead it shares, and a self-drafter, whose
    # drafts cost compute too, never does. Where weights are read once per step, K pays early.
    cases = [
        (budget["resident"], smollm2_desc, dev_profile, "prompt_lookup", 1.0),
        (budget["ffn-nvme"], smollm2_desc, dev_profile, "self", None),
        (*resident, "prompt_lookup", 0.1),
        (*streamed, "prompt_lookup", 0.1),
    ]
    for plan, profile, method, pays in [(c[0], c[-3], c[-2], c[-1]) for c in cases]:
        desc = smollm2_desc if profile is dev_profile else desc70
        ks = [_k(plan, desc, profile, a, method) for a in rates]
        assert ks == sorted(ks), (method, ks)
        assert ks[0] == 1  # a = 0: one draft is as good as any
        first = next((a for a, k in zip(rates, ks, strict=True) if k > 1), None)
        assert first == pays, (method, ks)


def test_streamed_plan_takes_more_draft_tokens(llama70b) -> None:
    """Verification reads the streamed weights once for all K + 1 tokens, so the same model
    streamed (disk-bound) takes a larger K than resident (where the tokens' FLOPs soon bind)."""
    desc, (streamed, small), (resident, big) = llama70b
    assert streamed.prediction.bottleneck == "disk"
    assert all(p.tier == "gpu" for p in resident.placement)
    for a in (0.3, 0.5, 0.7):
        assert _k(streamed, desc, small, a) > _k(resident, desc, big, a)
    # The prediction: E tokens per step of verification (plus no drafting for prompt lookup).
    sp = plan_speculative(streamed, desc, small, SpeculativeRequest("prompt_lookup"))
    assert sp.acceptance_rate == 0.5 and sp.acceptance_source == "assumed"
    assert sp.predicted_tokens_per_step == pytest.approx(expected_tokens(sp.num_draft_tokens, 0.5))
    assert sp.predicted_draft_s == 0.0
    assert sp.predicted_step_s == pytest.approx(sp.predicted_verify_s)
    assert sp.predicted_decode_tok_s == pytest.approx(
        sp.predicted_tokens_per_step / sp.predicted_step_s
    )
    assert sp.predicted_decode_tok_s > 1.9 * streamed.prediction.decode_tok_s


# --------------------------------------------------------------------------- self-drafting


def test_self_on_ffn_streamed_plan_skips_exactly_the_streamed_units(
    budget, smollm2_desc, dev_profile
) -> None:
    plan = budget["ffn-nvme"]
    tiers = plan.tier_of()
    streamed = {u for u, t in tiers.items() if t == "nvme"}
    assert streamed == {f"blk.{i}.ffn" for i in range(30)}  # the fixture's promise
    sp = plan_speculative(plan, smollm2_desc, dev_profile, SpeculativeRequest("self"))
    assert sp.method == "self" and sp.draft_layers == 30
    run, skipped = self_units(smollm2_desc, tiers, sp.draft_layers)
    assert set(skipped) == streamed
    assert {f"blk.{i}.attn" for i in range(30)} | {"token_embd", "output"} == set(run)
    # Half the sublayers run: the assumed acceptance is 0.8 x 0.5.
    assert sp.acceptance_rate == pytest.approx(0.4)
    assert "f = 0.5" in sp.acceptance_how and "30 streamed units skipped" in sp.acceptance_how
    draft = self_draft_seconds(smollm2_desc, dev_profile, plan, 30)
    assert sp.predicted_draft_s == pytest.approx(sp.num_draft_tokens * draft)
    assert draft < plan.prediction.compute_s  # cheaper than a step: no FFN is run

    # The same through plan.py's code path: same budget, --speculative self.
    again = build_plan(
        None,
        DEV_PROFILE,
        plan.request,
        desc=smollm2_desc,
        speculative=SpeculativeRequest("self"),
    )
    assert again.placement == plan.placement and again.speculative == sp


def test_self_on_resident_plan_chooses_layers_by_the_cost_model(
    budget, smollm2_desc, dev_profile
) -> None:
    plan = budget["resident"]
    sp = plan_speculative(plan, smollm2_desc, dev_profile, SpeculativeRequest("self"))
    n = smollm2_desc.architecture.block_count
    assert sp.acceptance_rate == pytest.approx(SELF_ACCEPTANCE_FULL * sp.draft_layers / n)

    def rate(layers: int, k: int) -> float:
        a = SELF_ACCEPTANCE_FULL * layers / n
        step = verify_seconds(smollm2_desc, dev_profile, plan, k)
        step += k * self_draft_seconds(smollm2_desc, dev_profile, plan, layers)
        return expected_tokens(k, a) / step

    best = max(rate(layers, k) for layers in range(1, n + 1) for k in K_CHOICES)
    assert rate(sp.draft_layers, sp.num_draft_tokens) == pytest.approx(best, rel=1e-9)
    assert sp.predicted_decode_tok_s == pytest.approx(best, rel=1e-9)


def test_self_refused_when_the_head_streams(budget, smollm2_desc, dev_profile) -> None:
    plan = budget["all-nvme"]
    with pytest.raises(PlanError, match=r"streams token_embd, output from NVMe.*prompt_lookup"):
        plan_speculative(plan, smollm2_desc, dev_profile, SpeculativeRequest("self"))


def test_measured_acceptance_rate_is_used_and_stated(budget, smollm2_desc, dev_profile) -> None:
    plan = budget["ffn-nvme"]
    sp = plan_speculative(
        plan, smollm2_desc, dev_profile, SpeculativeRequest("self", acceptance_rate=0.9)
    )
    assert sp.acceptance_rate == 0.9 and sp.acceptance_source == "measured"
    assert "--acceptance-rate" in sp.acceptance_how and sp.draft_layers == 30
    fixed = plan_speculative(
        plan, smollm2_desc, dev_profile, SpeculativeRequest("prompt_lookup", num_draft_tokens=12)
    )
    assert fixed.num_draft_tokens == 12


def test_k_limited_by_the_step_token_budget(smollm2_desc, dev_profile) -> None:
    req = Request(context=8)  # a step carries at most 8 tokens: K <= 7
    plan = build_plan(None, DEV_PROFILE, req, desc=smollm2_desc)
    spec = SpeculativeRequest("prompt_lookup", acceptance_rate=1.0)
    sp = plan_speculative(plan, smollm2_desc, dev_profile, spec)
    assert sp.num_draft_tokens == 7
    # 8 rows of float32 logits (49152 each) exceed the reserve of an 8-token chunk + one row.
    assert sp.activation_bytes == extra_activations(smollm2_desc, dev_profile, plan, 7) > 0
    assert "of verification logits beyond the activation reserve" in explain(
        plan.model_copy(update={"speculative": sp})
    )
    too_many = SpeculativeRequest("prompt_lookup", num_draft_tokens=9)
    with pytest.raises(PlanError, match="at most 7 draft tokens fit"):
        plan_speculative(plan, smollm2_desc, dev_profile, too_many)


def test_k_limited_by_the_free_device_memory(smollm2_desc, dev_profile) -> None:
    """With the device budget exactly full, the verification pass's logits must fit in the
    activation reserve of a 32-token chunk: (K + 1) rows of 49152 float32 logits, K <= 4."""
    free = build_plan(None, DEV_PROFILE, Request(context=32), desc=smollm2_desc)
    g = free.memory["gpu"]
    need = g.weights + g.kv_cache + g.activations
    req = Request(context=32, gpu_budget_bytes=need, ram_budget_bytes=need)
    plan = build_plan(None, DEV_PROFILE, req, desc=smollm2_desc)
    assert all(p.tier == "gpu" for p in plan.placement)
    assert k_limit(smollm2_desc, dev_profile, plan) == 4
    assert k_limit(smollm2_desc, dev_profile, free) == 16  # room to spare: the token budget
    spec = SpeculativeRequest("prompt_lookup", acceptance_rate=1.0)
    sp = plan_speculative(plan, smollm2_desc, dev_profile, spec)
    assert sp.num_draft_tokens == 4 and sp.activation_bytes == 0


# --------------------------------------------------------------------------- draft model


def test_draft_model_planned_with_the_target(
    budget, smollm2_desc, dev_profile, draft_gguf, tmp_path
) -> None:
    """At the budget where every unit of the target just fits, the draft model's bytes come off
    first: some of the target streams, and everything together fits the device budget."""
    resident = budget["resident"]
    assert all(p.tier == "gpu" for p in resident.placement)
    out = tmp_path / "plans" / "with-draft.yaml"
    spec = SpeculativeRequest("draft_model", draft_model=str(draft_gguf))
    plan = build_plan(None, DEV_PROFILE, resident.request, desc=smollm2_desc, speculative=spec)
    sp = plan.speculative
    d = sp.draft_model
    draft_desc = describe(str(draft_gguf))[0]
    assert d.bytes_mlx == sum(u.bytes_mlx for u in draft_desc.units)
    assert d.kv_cache_bytes == 3 * 2 * 2 * 16 * 4 * resident.batch.kv_num_blocks * 16
    assert d.name is None and d.path == str(draft_gguf.resolve())  # absolute: a hint
    assert d.sha256 == draft_desc.model.sha256
    assert plan.request == resident.request  # the request as given
    gpu = plan.memory["gpu"]
    assert gpu.capacity == resident.request.gpu_budget_bytes  # the full capacity
    used = gpu.weights + gpu.kv_cache + gpu.pool + gpu.activations
    assert used + d.bytes_mlx + d.kv_cache_bytes + d.activation_bytes <= gpu.capacity
    assert any(p.tier == "nvme" for p in plan.placement)
    assert sp.acceptance_rate == 0.6 and sp.acceptance_source == "assumed"
    assert sp.predicted_draft_s > 0 and sp.num_draft_tokens in K_CHOICES
    # The file reads back, the loader checks the draft and returns its path.
    write_yaml(plan, out)
    assert to_yaml(read_yaml(out, Plan)) == to_yaml(plan)
    text = explain(plan, smollm2_desc)
    assert "(gpu total includes the draft model: weights" in text
    assert "reserved before the target was placed" in text


def test_draft_model_that_does_not_fit(smollm2_desc, draft_gguf) -> None:
    spec = SpeculativeRequest("draft_model", draft_model=str(draft_gguf))
    req = Request(context=256, gpu_budget_bytes=2 << 20)
    with pytest.raises(PlanError, match=r"does not fit in the gpu tier .* smaller draft model"):
        build_plan(None, DEV_PROFILE, req, desc=smollm2_desc, speculative=spec)


def test_draft_model_with_another_vocabulary(smollm2_desc, tmp_path) -> None:
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    req = Request(context=256)
    spec = SpeculativeRequest("draft_model", draft_model=str(tiny))
    with pytest.raises(PlanError, match=r"vocabulary of 261 tokens but smollm2-135m has 49152"):
        build_plan(None, DEV_PROFILE, req, desc=smollm2_desc, speculative=spec)
    # Same size, other tokens: the token lists are compared too.
    same_size = write_tiny_llama(tmp_path / "same-size.gguf", extra_vocab=49152 - 261)
    spec = SpeculativeRequest("draft_model", draft_model=str(same_size))
    with pytest.raises(PlanError, match=r"another vocabulary than smollm2-135m \(token 0 is"):
        build_plan(None, DEV_PROFILE, req, desc=smollm2_desc, speculative=spec)


def test_loader_checks_the_draft_model_file(smollm2_desc, draft_gguf, tmp_path) -> None:
    draft = tmp_path / "models" / "draft.gguf"
    draft.parent.mkdir()
    shutil.copy(draft_gguf, draft)
    out = tmp_path / "plans" / "p.yaml"
    spec = SpeculativeRequest("draft_model", draft_model=str(draft))
    req = Request(context=256)
    write_yaml(build_plan(None, DEV_PROFILE, req, desc=smollm2_desc, speculative=spec), out)
    assert read_yaml(out, Plan).speculative.draft_model.path == str(draft.resolve())
    assert load_plan(out).draft_path == draft

    data = bytearray(draft.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    draft.write_bytes(bytes(data))
    os.utime(draft, ns=(1, 1))
    with pytest.raises(PlanError, match=r"draft model .* sha256 .*re-run strata plan with"):
        load_plan(out)
    # Gone from its path: a file this machine hashed with the planned bytes (the fixture's
    # original, or an earlier session's) is found by its sha256.
    draft.unlink()
    found = load_plan(out).draft_path
    assert (
        found != draft and file_sha256(found) == read_yaml(out, Plan).speculative.draft_model.sha256
    )


# --------------------------------------------------------------------------- schema, CLI, explain


def test_default_section_and_version(budget) -> None:
    plan = budget["resident"]
    assert PLAN_VERSION == "2.2" and plan.format_version == "2.2"
    assert plan.speculative == Speculative()
    assert plan.speculative.method == "none" and plan.speculative.predicted_tokens_per_step == 1
    # A plan without a speculative section reads as none.
    text = to_yaml(plan)
    text = text[: text.index("\nspeculative:")] + text[text.index("\nmemory:") :]
    old = Plan.model_validate(__import__("yaml").safe_load(text))
    assert old.speculative.method == "none"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"method": "none", "num_draft_tokens": 3}, "method none takes no"),
        ({"method": "prompt_lookup"}, "needs num_draft_tokens"),
        ({"method": "self", "num_draft_tokens": 2}, "draft_layers is 1..block_count"),
        ({"method": "draft_model", "num_draft_tokens": 2}, "draft_model is given exactly"),
        ({"method": "self", "num_draft_tokens": 17, "draft_layers": 1}, "less than or equal"),
    ],
)
def test_schema_refuses_inconsistent_sections(fields, words) -> None:
    with pytest.raises(ValidationError, match=words):
        Speculative(**fields)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--draft-model", "x.gguf"], "--draft-model goes with --speculative draft_model"),
        (["--speculative", "draft_model"], "needs --draft-model MODEL"),
        (["--num-draft-tokens", "3"], "go with --speculative"),
        (["--speculative", "self", "--num-draft-tokens", "17"], "outside 1..16"),
        (["--speculative", "self", "--acceptance-rate", "1.5"], "outside 0..1"),
    ],
)
def test_cli_option_errors(args, words, tmp_path, capsys) -> None:
    argv = ["plan", "--model", "smollm2-135m", "--profile", str(DEV_PROFILE)]
    rc = plan_main([*argv, *args, "-o", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


def test_cli_plan_and_explain(tmp_path, capsys) -> None:
    out = tmp_path / "p.yaml"
    argv = ["plan", "--model", "smollm2-135m", "--profile", str(DEV_PROFILE), "--context", "256"]
    assert plan_main([*argv, "--speculative", "prompt_lookup", "-o", str(out)]) == 0
    assert "speculative prompt_lookup, K = " in capsys.readouterr().err
    assert plan_main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Speculative decoding: prompt lookup" in text
    assert "  acceptance rate a = 0.5 (assumed)" in text
    assert "tokens per step E = (1 - a^(K+1)) / (1 - a) = " in text
    assert "Predicted decode with speculation: " in text and " without, ×" in text


def test_explain_self_and_none(budget, smollm2_desc, dev_profile) -> None:
    plan = budget["ffn-nvme"]
    assert "Speculative decoding: none (strata plan --speculative METHOD" in explain(plan)
    plan = plan.model_copy(deep=True)
    plan.speculative = plan_speculative(plan, smollm2_desc, dev_profile, SpeculativeRequest("self"))
    text = explain(plan)  # without the description: roles from the unit names
    k = plan.speculative.num_draft_tokens
    assert (
        f"Speculative decoding: self-drafting (the model's own first blocks, early exit), K = {k}"
        in text
    )
    assert "  runs blk 0–29 (30 of 30 blocks), then the output head" in text
    assert "  skips the units it would read from NVMe: ffn blk 0–29 (30 units)" in text
    assert "  acceptance rate a = 0.4 (assumed)" in text
    assert f"verification of {k + 1} tokens per sequence" in text


def test_build_plan_rejects_unknown_method() -> None:
    with pytest.raises(StrataError, match="unknown --speculative 'eagle'"):
        SpeculativeRequest("eagle")
