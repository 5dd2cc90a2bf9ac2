"""Where a unit lives never changes the numbers: gpu, ram and nvme give identical logits.

The plans are the planner's own (``budget_plans`` in conftest.py), and each test first asserts
the placement it relies on, so it fails if the planner stops choosing it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from strata.executor.engine import Engine
from strata.executor.generate import Generation, generate
from strata.executor.pack import PackStore
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

GPU_RAM = {"gpu", "ram"}
PLACEMENTS = {
    # budget_plans name: (tiers a unit may be on, by its name; tiers the plan must use)
    "ffn-nvme": (lambda unit: {"nvme"} if unit.endswith(".ffn") else GPU_RAM, {"nvme"}),
    "all-nvme": (lambda unit: {"nvme"}, {"nvme"}),
    "gpu-ram": (lambda unit: GPU_RAM, GPU_RAM),
    "all-ram": (lambda unit: {"ram"}, {"ram"}),
}
TOKENS = 8
"""Greedy tokens per reference case: few, as every token of a streamed plan reads its units."""


def _nvme_bytes(engine: Engine, passes: int, tokens: int) -> int:
    """What the NVMe tier must read for ``passes`` forward passes over ``tokens`` tokens: each
    streamed unit once per pass, as the whole aligned unit of the packed store, and a streamed
    embedding's looked-up rows."""
    loaded = engine.loaded
    if "nvme" not in loaded.plan.tier_of().values():
        return 0
    pack = PackStore.open_or_build(loaded.gguf, loaded.desc, loaded.desc.model.sha256)
    streamed = [u for u in engine.model.unit_order() if engine.store.tier(u) == "nvme"]
    total = passes * sum(pack.units[u].nbytes for u in streamed)
    if engine.store.tier("token_embd") == "nvme":
        parts = pack.units["token_embd"].parts
        row = sum(p.nbytes // p.shape[0] for p in parts if p.tensor == "token_embd.weight")
        total += tokens * row
    return total


@pytest.fixture(scope="module")
def resident_runs(
    smollm2_engine, smollm2_serving, reference_cases
) -> list[tuple[dict, np.ndarray, Generation]]:
    """Per SmolLM2 reference case: the all-resident plan's teacher-forced logits (prompt and
    ``TOKENS`` greedy ids) and its greedy generation of ``TOKENS`` tokens."""
    runs = []
    for ref in reference_cases:
        if ref["model_file"].startswith("SmolLM2"):
            logits = smollm2_engine.logits_for(ref["prompt_ids"] + ref["greedy_ids"][:TOKENS])
            gen = generate(smollm2_serving, ref["prompt_ids"], SamplingParams(), TOKENS)
            runs.append((ref, logits, gen))
    return runs


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_planned_tiers_are_bit_identical(budget_plans, resident_runs, name):
    """Plans the planner made under budgets (``--gpu-budget``/``--ram-budget``/``--tiers``): logits
    bit-identical and greedy ids identical to the all-resident plan on the reference cases, and
    the NVMe counter exactly the streamed units' bytes times their uses."""
    loaded = load_plan(budget_plans[name])
    tiers = loaded.plan.tier_of()
    allowed, used = PLACEMENTS[name]
    moved = {u: t for u, t in tiers.items() if t not in allowed(u)}
    assert not moved, f"the planner no longer places {name} as this test expects: {moved}"
    assert used <= set(tiers.values()), f"{name} uses only {set(tiers.values())}"
    serving = ServingEngine(Engine(loaded))
    serving.start()
    engine = serving.engine
    try:
        for ref, logits, b in resident_runs:
            prompt, case = ref["prompt_ids"], ref["case"]
            ids = prompt + ref["greedy_ids"][:TOKENS]
            assert np.array_equal(engine.logits_for(ids), logits), case
            a = generate(serving, prompt, SamplingParams(), TOKENS)
            assert a.output_ids == b.output_ids, case
            decoded = len(a.output_ids) - 1  # the last token is sampled, never run
            computed = len(prompt) - a.stats["cached_tokens"]  # a shared prefix is cached
            passes = -(-computed // engine.prefill_chunk) + decoded
            # Counted per use, when the compute thread takes a unit: exact per call.
            want = _nvme_bytes(engine, passes, computed + decoded)
            assert a.stats["bytes_read"]["nvme"] == want, case
            # Honest counters: bytes are counted on the tier they came from, and only there.
            for t in ("gpu", "ram", "nvme"):
                assert (a.stats["bytes_read"][t] > 0) == (t in tiers.values()), (case, t)
                assert (b.stats["bytes_read"][t] > 0) == (t == "gpu"), (case, t)
            pool = engine.store.pool
            if pool is not None:
                assert pool.bytes_read % 4096 == 0  # whole aligned units, as preadv returned them
    finally:
        serving.close()


def test_loaded_smollm2_stays_packed(smollm2_engine):
    """Quantized tensors are held as packed uint32 arrays on MLX's kernels, never inflated."""
    from strata.executor.ops import QuantLinear

    store, desc = smollm2_engine.store, smollm2_engine.loaded.desc
    quantized = [t for t in desc.tensors if t.ggml_type in ("Q4_1", "Q8_0")]
    total = 0
    for t in quantized:
        w = store.unit(t.unit)[t.name]
        assert isinstance(w, QuantLinear) and w.weight.dtype == mx.uint32, t.name
        total += w.nbytes
    gguf_bytes = sum(t.bytes_gguf for t in quantized)
    assert total <= 1.25 * gguf_bytes
    print(f"quantized tensors: {total / gguf_bytes:.3f}x their GGUF bytes")


def test_gpu_tier_weights_are_faulted_in_on_cuda_only(monkeypatch):
    """At load, every array of a GPU-tier weight (a quantized one's packed words, scales and
    biases; a plain one) is read once on MLX's CUDA backend, whose managed memory keeps arrays
    built from host data in host pages until the GPU touches them; elsewhere nothing is read."""
    from strata.executor import weights
    from strata.executor.ops import QuantLinear

    quant = QuantLinear(
        weight=mx.zeros((16, 4), mx.uint32),
        scales=mx.ones((16, 1), mx.float16),
        biases=mx.zeros((16, 1), mx.float16),
        bits=4,
        group_size=32,
    )
    plain = mx.ones((8,), mx.float16)
    read: list[mx.array] = []
    monkeypatch.setattr(weights.mx, "sum", lambda a: read.append(a) or mx.array(0))
    monkeypatch.setattr(weights.mx.cuda, "is_available", lambda: False)
    weights.fault_in([quant, plain])
    assert read == []
    monkeypatch.setattr(weights.mx.cuda, "is_available", lambda: True)
    weights.fault_in([quant, plain])
    assert [id(a) for a in read] == [id(a) for a in (*quant.parts, plain)]


def test_the_store_faults_in_exactly_its_gpu_tier_weights_at_load(monkeypatch, budget_plans):
    """``WeightStore`` hands ``fault_in`` its GPU-tier weights once, at load, and no RAM-tier
    one (a plan with units on both tiers)."""
    from strata.executor import weights
    from strata.executor.plan_loader import load_plan

    handed: list[list] = []
    monkeypatch.setattr(weights, "fault_in", lambda ws: handed.append(list(ws)))
    loaded = load_plan(budget_plans["gpu-ram"])
    tiers = loaded.plan.tier_of()
    assert {"gpu", "ram"} <= set(tiers.values())
    store = weights.WeightStore(loaded.gguf, loaded.desc, tiers, mx.float32)
    assert len(handed) == 1
    assert {id(w) for w in handed[0]} == {id(w) for w in store._gpu.values()}
    assert store._gpu and store._ram
