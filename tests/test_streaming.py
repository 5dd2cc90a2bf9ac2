"""The NVMe tier's failure paths (its numbers are checked in test_tiers.py)."""

from __future__ import annotations

import pytest
from test_tiers import _moved

from executor import streaming
from executor.engine import Engine
from executor.plan_loader import load_plan
from executor.sampling import SamplingParams
from planner.errors import StrataError


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
