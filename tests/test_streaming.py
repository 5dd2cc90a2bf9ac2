"""The NVMe tier: direct-I/O streaming through the pool gives bit-identical numbers."""

from __future__ import annotations

import numpy as np
import pytest
from test_tiers import _moved

from executor import streaming
from executor.engine import Engine
from executor.plan_loader import load_plan
from executor.sampling import SamplingParams
from planner.errors import StrataError


@pytest.mark.parametrize("roles", [(".ffn",), None], ids=["ffn-on-nvme", "all-on-nvme"])
def test_nvme_is_bit_identical(smollm2_plan, smollm2_engine, reference_cases, tmp_path, roles):
    engine = Engine(load_plan(_moved(smollm2_plan, tmp_path / "nvme.yaml", "nvme", roles)))
    try:
        ref = next(r for r in reference_cases if r["model_file"].startswith("SmolLM2"))
        ids = ref["prompt_ids"] + ref["greedy_ids"][:8]
        assert np.array_equal(engine.logits_for(ids), smollm2_engine.logits_for(ids))
        a = engine.generate(ref["prompt_ids"], SamplingParams(), 6)
        b = smollm2_engine.generate(ref["prompt_ids"], SamplingParams(), 6)
        assert a.output_ids == b.output_ids
        assert a.stats["bytes_read"]["nvme"] > 0 and b.stats["bytes_read"]["nvme"] == 0
        if roles is None:
            assert a.stats["bytes_read"]["gpu"] == 0
        # Every streamed unit is read from the pool; bytes are what preadv returned.
        assert engine.store.pool.bytes_read % 4096 == 0
    finally:
        engine.close()


def test_short_read_is_an_error(smollm2_plan, tmp_path, monkeypatch):
    engine = Engine(load_plan(_moved(smollm2_plan, tmp_path / "nvme.yaml", "nvme", (".ffn",))))
    try:
        real = streaming.pread_into
        monkeypatch.setattr(streaming, "pread_into", lambda fd, mv, off: real(fd, mv, off) - 1)
        # Slots already read before the fault still serve; the next read fails loudly.
        with pytest.raises(StrataError, match="short read"):
            for _ in range(3):
                engine.generate([504, 3575], SamplingParams(), 2)
    finally:
        engine.close()
    assert not engine.store.pool  # closed: threads stopped
