"""MoE experts on every tier give the same numbers: all-resident, experts streamed through the
expert cache (every cache mode, cache sizes that force several load groups per block), and
everything streamed; the expert counters add up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import DEV_PROFILE, make_plan_file
from gguf_factory import write_arch_model
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml, write_yaml
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

PROMPT = [1, 17, 400, 2048, 77, 9001, 31, 5, 600, 12000, 42, 7, 88, 1234, 3, 999]
CONTEXT = 64
DECODE = 10


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe"])
def moe_plans(request, smollm2_gguf, tmp_path_factory, monkeypatch_module):
    """(resident plan, plan dir) of a tiny MoE model (qwen2moe: with a shared expert)."""
    d = tmp_path_factory.mktemp(f"moe-tiers-{request.param}")
    monkeypatch_module.setenv("STRATA_CACHE", str(d / "cache"))
    gguf = write_arch_model(d / f"{request.param}.gguf", request.param, smollm2_gguf)
    resident = make_plan_file(str(gguf), d / "resident.yaml", context=CONTEXT)
    make_plan_file(str(gguf), d / "all-nvme.yaml", context=CONTEXT, tiers=["nvme"])
    return resident, d


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _experts_on_nvme(resident: Path, out: Path, slots: int, prefetch: int) -> Path:
    plan = read_yaml(resident, Plan)
    for p in plan.placement:
        if ".expert." in p.unit:
            p.tier = "nvme"
    plan.expert_cache.slots, plan.expert_cache.prefetch = slots, prefetch
    plan.expert_cache.pinned = []
    write_yaml(plan, out)
    return out


def _run(plan: Path, mode: str | None = None):
    serving = ServingEngine(Engine(load_plan(plan), expert_cache_mode=mode))
    serving.start()
    engine = serving.engine
    try:
        logits = engine.logits_for(PROMPT)
        gen = generate(serving, PROMPT, SamplingParams(), DECODE, stop_at_eog=False)
        expert_bytes = {
            name: u.nbytes
            for name, u in (engine.store._pack.units.items() if engine.store._pack else [])
            if ".expert." in name
        }
        return logits, gen, expert_bytes
    finally:
        serving.close()


def test_placements_and_cache_modes_are_bit_identical(moe_plans):
    resident, d = moe_plans
    want_logits, want, _ = _run(resident)
    assert read_yaml(resident, Plan).expert_cache.slots == 0  # it fits: nothing streams
    assert want.stats["experts"]["uses_gpu"] > 0
    runs = {"all-nvme": (d / "all-nvme.yaml", None)}
    # 1 and 3 slots: fewer than a prompt's experts, so a block loads in several groups.
    for slots, modes in (
        (1, ("cache",)),
        (3, ("prefetch",)),
        (4, ("prefetch",)),  # exactly the working slots: top-2 and 2 prefetched
        (12, ("none", "cache", "prefetch")),
    ):
        path = _experts_on_nvme(resident, d / f"experts-{slots}.yaml", slots, prefetch=2)
        for mode in modes:
            runs[f"experts-{slots}-{mode}"] = (path, mode)
    for label, (path, mode) in runs.items():
        logits, gen, expert_bytes = _run(path, mode)
        assert np.array_equal(logits, want_logits), label
        assert gen.output_ids == want.output_ids, label
        ex = gen.stats["experts"]
        uses = ex["hits"] + ex["misses"]
        assert uses > 0 and ex["uses_gpu"] == 0, label
        # Every expert read is a miss or a prefetch, and is counted in the nvme bytes.
        size = set(expert_bytes.values())
        assert len(size) == 1, label
        reads = ex["misses"] + ex["prefetch_issued"]
        assert ex["bytes_read"] == reads * size.pop(), label
        done = ex["prefetch_used"] + ex["prefetch_wasted"] + ex["prefetch_pending"]
        assert done <= ex["prefetch_issued"], label
        if mode == "none":
            assert ex["hits"] == 0 and ex["prefetch_issued"] == 0, label
        if mode == "cache":
            assert ex["prefetch_issued"] == 0, label
        if mode == "cache" and label.startswith("experts-12"):
            assert ex["hits"] > 0, label  # 12 slots keep experts between tokens
        if mode == "prefetch" and label.startswith("experts-12"):
            assert ex["prefetch_issued"] > 0, label


def test_prefetch_reads_only_streamed_experts(moe_plans, monkeypatch):
    """With half of each block's experts pinned, prefetch guesses of pinned experts are not read
    (they would never be used: the pinned copy serves them); outputs stay identical."""
    from strata.executor.experts import ExpertCache

    resident, d = moe_plans
    want_logits, want, _ = _run(resident)
    plan = read_yaml(resident, Plan)
    for p in plan.placement:
        if ".expert." in p.unit and int(p.unit.rsplit(".", 1)[1]) >= 4:
            p.tier = "nvme"
    plan.expert_cache.slots, plan.expert_cache.prefetch = 6, 2
    plan.expert_cache.pinned = [
        p.unit for p in plan.placement if ".expert." in p.unit and p.tier == "gpu"
    ]
    path = d / "half-pinned.yaml"
    write_yaml(plan, path)
    loaded: list[str] = []
    real = ExpertCache._load

    def spy(self, slot, unit):
        loaded.append(unit)
        return real(self, slot, unit)

    monkeypatch.setattr(ExpertCache, "_load", spy)
    logits, gen, _ = _run(path, "prefetch")
    assert np.array_equal(logits, want_logits) and gen.output_ids == want.output_ids
    assert loaded and all(int(u.rsplit(".", 1)[1]) >= 4 for u in loaded)
    ex = gen.stats["experts"]
    assert ex["uses_gpu"] > 0 and ex["hits"] + ex["misses"] > 0


def test_routing_profile_round_trip_through_the_command_lines(moe_plans, tmp_path):
    """``execute.py run --save-routing-profile`` writes what ``plan.py plan --routing-profile``
    reads (the plan names the profile), and a dense model's run refuses to save one."""
    from test_cli import assert_one_line_error, cli

    resident, d = moe_plans
    profile = tmp_path / "routing.json"
    run = cli(
        "execute.py", "run", str(resident), "--prompt", "Once upon a time there was",
        "--max-tokens", "12", "--save-routing-profile", str(profile),
    )  # fmt: skip
    assert "wrote routing profile" in run.stderr
    doc = json.loads(profile.read_text())
    # Every block saw every token, each choosing the same k experts.
    used = {sum(row) / doc["tokens"][i] for i, row in enumerate(doc["counts"])}
    assert len(used) == 1 and used.pop() in (2.0, 4.0)
    assert doc["predicted"] > 0  # decode steps measured the successor prediction
    plan_doc = read_yaml(resident, Plan)
    gguf = plan_doc.model.path
    out = tmp_path / "profiled.yaml"
    # Room for everything but half the experts: experts stream through the cache.
    g = plan_doc.memory["gpu"]
    experts = sum(p.bytes for p in plan_doc.placement if ".expert." in p.unit)
    budget = str(g.weights + g.kv_cache + g.activations - experts // 2)
    cli(
        "plan.py", "plan", "--model", gguf, "--profile", str(DEV_PROFILE), "--context", "64",
        "--gpu-budget", budget, "--ram-budget", budget, "--routing-profile", str(profile),
        "-o", str(out),
    )  # fmt: skip
    planned = read_yaml(out, Plan)
    assert planned.provenance.routing_profile is not None
    assert planned.provenance.routing_profile.path == str(profile.resolve())
    # The profiled plan's cache starts with the profile's hot set, and its tracker with the
    # profile's counts: same ids as the resident run, the preload counted apart from misses.
    ec = planned.expert_cache
    k = sum(doc["counts"][0]) // doc["tokens"][0]
    assert ec.preload and len(ec.preload) == ec.slots - k - ec.prefetch
    loaded = load_plan(out)
    assert loaded.routing is not None and loaded.routing.counts == doc["counts"]
    serving = ServingEngine(Engine(loaded))
    serving.start()
    engine = serving.engine
    try:
        assert engine.store.experts_cache.preloaded == len(ec.preload)
        from strata.executor.experts import PRIOR_TOKENS

        tokens = np.asarray(doc["tokens"], float)[:, None]
        want = np.asarray(doc["counts"]) * PRIOR_TOKENS / tokens
        assert np.allclose(engine.store.routing.rank, want)
        assert engine.store.routing.counts.sum() == 0  # this run's own counts start empty
        gen = generate(serving, PROMPT, SamplingParams(), DECODE, stop_at_eog=False)
        first = engine.store.experts_cache.counters()
    finally:
        serving.close()
    assert gen.output_ids == _run(resident)[1].output_ids
    assert first["hits"] > 0 and first["preloaded"] == len(ec.preload)
    # diff against the uniform plan of the same budget names what explains the change.
    uniform = tmp_path / "uniform.yaml"
    cli(
        "plan.py", "plan", "--model", gguf, "--profile", str(DEV_PROFILE), "--context", "64",
        "--gpu-budget", budget, "--ram-budget", budget, "-o", str(uniform),
    )  # fmt: skip
    text = cli("plan.py", "diff", str(uniform), str(out)).stdout
    assert "routing profile: none (uniform top-k/n) → sha256 " in text
    assert f"preload: 0 → {len(ec.preload)} experts" in text
    assert re.search(r"^expected expert hit rate: 0\.\d\d → 0\.\d\d$", text, re.M), text
    # The plan keeps its routing profile in the cache: moved or edited, the plan still has it.
    profile.rename(tmp_path / "moved.json")
    assert load_plan(out).routing.counts == doc["counts"]
    (tmp_path / "moved.json").write_text(json.dumps({**doc, "tokens": [1] * len(doc["tokens"])}))
    (tmp_path / "moved.json").rename(profile)
    assert load_plan(out).routing.counts == doc["counts"]
    from gguf_factory import write_tiny_llama

    dense = make_plan_file(str(write_tiny_llama(tmp_path / "d.gguf")), tmp_path / "d.yaml")
    bad = cli(
        "execute.py", "run", str(dense), "--prompt", "Hi",
        "--max-tokens", "1", "--save-routing-profile", str(tmp_path / "x.json"), ok=False,
    )  # fmt: skip
    assert_one_line_error(bad, "mixture-of-experts")
