"""``benchmarks/pass_timeline.py``: a warm request's kernels on the GPU's clock, from a Chrome
trace."""

from __future__ import annotations

from strata.benchmarks.pass_timeline import summarize


def _gpu(ts: float, dur: float, name: str, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


EVENTS = [
    _gpu(50.0, 5.0, "before"),  # outside the span: not counted
    {"ph": "X", "cat": "cuda_runtime", "ts": 90.0, "dur": 2.0, "name": "cudaMalloc"},  # before it
    {"ph": "X", "cat": "cuda_runtime", "ts": 104.0, "dur": 4.0, "name": "cudaGraphLaunch"},
    _gpu(106.0, 1.0, "Memcpy HtoD", "gpu_memcpy"),  # before the first kernel: in the lead
    _gpu(110.0, 10.0, "embed"),  # lead: 110 - 100 us
    _gpu(121.0, 2.0, "Memcpy DtoD", "gpu_memcpy"),  # busy; the 1 us gap before it is idle
    _gpu(125.0, 5.0, "norm"),  # a gap of exactly GAP_US (2 us) before it: listed
    _gpu(128.0, 11.0, "mma"),  # overlaps norm by 2 us: busy adds 9
    _gpu(129.0, 2.0, "inner"),  # inside mma: adds no busy time
    _gpu(139.0, 1.0, "Memset", "gpu_memset"),  # right after mma
    _gpu(150.0, 2.0, "argmax"),  # idle 10 us after the memset
    _gpu(153.0, 1.0, "norm"),  # the same name again: by_kernel adds it up
    _gpu(158.0, 5.0, "late"),  # runs past the span's end (160): cut there
    _gpu(160.0, 1.0, "at-end"),  # starts at the span's end: not in it
    _gpu(300.0, 5.0, "after"),  # outside the span
]


def test_busy_idle_lead_and_tail_on_the_gpu_clock():
    (row,) = summarize(EVENTS, [("eager2", 100.0, 160.0)])
    assert row["variant"] == "eager2"
    assert row["kernels"] == 7  # embed, norm, mma, inner, argmax, norm, late
    assert row["span_ms"] == 0.06
    assert row["first_call_ms"] == 0.004  # the call before the span is not its first
    assert row["lead_ms"] == 0.01
    # the lead's calls: cudaGraphLaunch only (the cudaMalloc is before the span)
    assert row["lead_calls"] == 1 and row["lead_api_ms"] == 0.004
    assert row["longest_lead_calls"] == [["cudaGraphLaunch", 0.004, 4.0]]
    # embed 10 + copy 2 + norm 5 + mma 9 + inner 0 + memset 1 + argmax 2 + norm 1 + late 2 us
    assert row["busy_ms"] == 0.032
    assert row["idle_ms"] == 0.018  # gaps 1 + 2 + 10 + 1 + 4 us
    assert row["tail_ms"] == 0.0
    assert row["gaps"] == 3  # 10, 4 and 2 us; the 1 us gaps are under GAP_US
    assert row["largest_gaps"] == [
        {"us": 10.0, "after": "Memset", "before": "argmax"},
        {"us": 4.0, "after": "norm", "before": "late"},
        {"us": 2.0, "after": "Memcpy DtoD", "before": "norm"},
    ]
    assert row["by_kernel"][:3] == [["mma", 1, 11.0], ["embed", 1, 10.0], ["norm", 2, 6.0]]
    assert all(name not in ("Memset", "Memcpy DtoD") for name, *_ in row["by_kernel"])


def test_the_gap_after_a_nested_kernel_names_the_one_that_ended_last():
    events = [_gpu(0.0, 20.0, "outer"), _gpu(2.0, 3.0, "inner"), _gpu(30.0, 1.0, "next")]
    (row,) = summarize(events, [("v", 0.0, 40.0)])
    assert row["largest_gaps"] == [{"us": 10.0, "after": "outer", "before": "next"}]
    assert row["busy_ms"] == 0.021 and row["idle_ms"] == 0.01 and row["tail_ms"] == 0.009


def test_a_span_without_kernels_reports_its_host_time_only():
    (row,) = summarize(EVENTS, [("compiled4", 200.0, 250.0)])
    assert row == {"variant": "compiled4", "span_ms": 0.05, "kernels": 0}
