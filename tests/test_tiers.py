"""Where a unit lives never changes the numbers: gpu, ram and nvme give identical logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import yaml

from executor.engine import Engine
from executor.plan_loader import load_plan
from executor.sampling import SamplingParams


def _moved(plan_path, out_path, tier, roles=None):
    """A hand-edited copy of a plan with units of ``roles`` (all when None) moved to ``tier``."""
    data = yaml.safe_load(plan_path.read_text())
    data["fingerprints"]["profile"] = None  # a hand-written plan need not name a profile
    for p in data["placement"]:
        if roles is None or any(p["unit"].endswith(r) for r in roles):
            p["tier"] = tier
    out_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return out_path


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("roles", [(".ffn",), None], ids=["ffn", "all"])
def test_tier_is_bit_identical(
    smollm2_plan, smollm2_engine, reference_cases, tmp_path, tier, roles
):
    """FFN units, or every unit, on ``tier``: logits bit-identical to the all-resident plan."""
    engine = Engine(load_plan(_moved(smollm2_plan, tmp_path / "moved.yaml", tier, roles)))
    try:
        ref = next(r for r in reference_cases if r["model_file"].startswith("SmolLM2"))
        ids = ref["prompt_ids"] + ref["greedy_ids"][:8]
        assert np.array_equal(engine.logits_for(ids), smollm2_engine.logits_for(ids))
        a = engine.generate(ref["prompt_ids"], SamplingParams(), 6)
        b = smollm2_engine.generate(ref["prompt_ids"], SamplingParams(), 6)
        assert a.output_ids == b.output_ids
        # Honest counters: bytes are counted on the tier they came from, and only there.
        assert a.stats["bytes_read"][tier] > 0 and b.stats["bytes_read"][tier] == 0
        if roles is None:
            assert a.stats["bytes_read"]["gpu"] == 0
        if tier == "nvme":  # whole aligned units, as preadv returned them
            assert engine.store.pool.bytes_read % 4096 == 0
    finally:
        engine.close()


def test_loaded_smollm2_stays_packed(smollm2_engine):
    """Quantized tensors are held as packed uint32 arrays on MLX's kernels, never inflated."""
    from executor.ops import QuantLinear

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
