"""``benchmarks/kernels/pass_kernels.py --summarize``: Nsight Compute's text report summed by
kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from strata.benchmarks.kernels.pass_kernels import summarize

CONTEXT = ", Context 1, Stream 14, Device 0, CC 9.0"
REPORT = f"""==PROF== Connected to process 707 (/usr/bin/python3.12)
  void rope<__half, 1, 1>(const __half *, __half *, int) (64, 1, 1)x(128, 1, 1){CONTEXT}
    Section: Command line profiler metrics
    ----------------------------------- ----------- ------------
    gpu__time_duration.sum                        us         5.25
  custom_kernel_strata_a_float16_t_4(const __half *, __half *) (896, 2, 1)x(128, 1, 1){CONTEXT}
    gpu__time_duration.sum                        ms         1.50
  void rope<__half, 1, 1>(const __half *, __half *, int) (64, 1, 1)x(128, 1, 1){CONTEXT}
    gpu__time_duration.sum                        ns       750.00
  void (anonymous namespace)::fill<float>(float *, int) (1, 1, 1)x(32, 1, 1){CONTEXT}
    Warning: Data collection happened without fixed GPU frequencies.
    Section: Command line profiler metrics
    ---------------------- ----------- ------------
    Metric Name            Metric Unit Metric Value
    ---------------------- ----------- ------------
    gpu__time_duration.sum          us     2,000.00
    ---------------------- ----------- ------------

  sm90_xmma_gemm_f16f16_f32_tn_n_tilesize128x128x64_cublas (264, 1, 1)x(384, 1, 1){CONTEXT}
    gpu__time_duration.sum                    msecond         0.25
"""


def test_kernels_are_summed_by_name_longest_first():
    res = summarize(REPORT)
    assert res["kernels"] == 5
    assert res["gpu_us"] == pytest.approx(5.25 + 1500 + 0.75 + 2000 + 250)
    assert res["by_kernel"] == [
        ["void (anonymous namespace)::fill<float>", pytest.approx(2000.0), 1],
        ["custom_kernel_strata_a_float16_t_4", pytest.approx(1500.0), 1],
        ["sm90_xmma_gemm_f16f16_f32_tn_n_tilesize128x128x64_cublas", pytest.approx(250.0), 1],
        ["void rope<__half, 1, 1>", pytest.approx(6.0), 2],
    ]


def test_a_report_without_the_metric_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--metrics gpu__time_duration.sum"):
        summarize("==PROF== Connected to process 1\n")
    with pytest.raises(ValueError, match="unknown time unit"):
        summarize(REPORT.replace("ns       750.00", "fortnights 3.00"))
    with pytest.raises(ValueError, match="no kernel line before it"):
        summarize(REPORT.replace(f"x(384, 1, 1){CONTEXT}", "x(384, 1, 1)"))
    empty = tmp_path / "ncu.txt"
    empty.write_text("no kernels here\n")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "pass_kernels.py"
    for arg in (str(empty), str(tmp_path / "missing.txt")):
        out = subprocess.run(
            [sys.executable, str(script), "--summarize", arg], capture_output=True, text=True
        )
        assert out.returncode != 0 and "--summarize" in out.stderr
        assert "Traceback" not in out.stderr
