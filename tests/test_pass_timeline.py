"""``bench/pass_timeline.py``: a warm request's kernels on the GPU's clock, from a Chrome trace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from pass_timeline import summarize  # noqa: E402


def _kernel(ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}


EVENTS = [
    _kernel(50.0, 5.0, "before"),  # outside the span: not counted
    {"ph": "X", "cat": "cuda_runtime", "ts": 101.0, "dur": 4.0, "name": "cudaGraphLaunch"},
    _kernel(110.0, 10.0, "embed"),  # lead: 110 - 100 us
    _kernel(125.0, 5.0, "norm"),  # idle 5 us after embed
    _kernel(128.0, 10.0, "mma"),  # overlaps norm by 2 us: busy adds 8
    _kernel(148.0, 2.0, "argmax"),  # idle 10 us after mma
    _kernel(300.0, 5.0, "after"),  # outside the span
]


def test_busy_idle_lead_and_tail_on_the_gpu_clock():
    (row,) = summarize(EVENTS, [("eager2", 100.0, 160.0)])
    assert row["variant"] == "eager2"
    assert row["kernels"] == 4
    assert row["host_ms"] == 0.06
    assert row["lead_ms"] == 0.01
    assert row["busy_ms"] == 0.025  # 10 + 5 + 8 + 2 us: an overlap counted once
    assert row["idle_ms"] == 0.015
    assert row["tail_ms"] == 0.01  # the span's end less the last kernel's end
    assert row["gaps_over_2us"] == 2
    assert [g["us"] for g in row["largest_gaps"]] == [10.0, 5.0]
    assert row["largest_gaps"][0] == {"us": 10.0, "after": "mma", "before": "argmax"}


def test_a_span_without_kernels_reports_its_host_time_only():
    (row,) = summarize(EVENTS, [("compiled4", 200.0, 250.0)])
    assert row == {"variant": "compiled4", "kernels": 0, "host_ms": 0.05}
