"""The profile-steadiness bench's summary: values per run, spread between runs, busy runs marked."""

from __future__ import annotations

import pytest
from strata.benchmarks import profile_steadiness as ps
from strata.common.errors import StrataError


def _run(op_s: float, copy: float, busy: bool = False) -> dict:
    figs = {
        "gpu.op_overhead_s": {"value": op_s, "samples": 11, "spread": 0.1},
        "ram.host_to_device_bytes_s": {"value": copy, "samples": 7, "spread": 0.05},
    }
    return {"wall_s": 15.0, "others_cpu_s": 3.0 if busy else 0.1, "busy": busy, "figures": figs}


def test_summary_gives_each_figures_values_and_spread_between_runs():
    runs = [_run(7e-6, 2.4e9), _run(8e-6, 2.5e9), _run(6e-6, 2.6e9, busy=True)]
    s = ps.summarize(runs)
    assert s["gpu.op_overhead_s"]["values"] == [7e-6, 8e-6, 6e-6]
    assert s["gpu.op_overhead_s"]["median"] == 7e-6
    assert s["gpu.op_overhead_s"]["between_runs_spread"] == pytest.approx(2 / 7, abs=1e-4)
    assert s["ram.host_to_device_bytes_s"]["between_runs_spread"] == pytest.approx(0.08)
    assert s["ram.host_to_device_bytes_s"]["samples"] == 7
    text = ps.table(s, runs)
    assert "| per-op overhead (us) | 7 | 8 | 6 | 28.6% |" in text
    assert "run 3 (busy)" in text and "| other programs' CPU s | 0.1 | 0.1 | 3.0 |" in text


def test_zero_runs_are_refused(tmp_path):
    with pytest.raises(StrataError, match="--runs 0: pass at least 1"):
        ps.profile_runs(0, tmp_path)
