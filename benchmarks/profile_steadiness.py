#!/usr/bin/env python3
"""How steady ``strata profile`` is: the same profile measured several times, run after run.

Runs ``strata profile`` (:func:`strata.executor.profile.measure_profile`) ``--runs`` times in
fresh processes one after another, as a user re-running the command would, and reports for each
measured figure its value in every run, the median, and the spread between runs
(``(max - min) / median``), next to each run's own in-run spread (``Figure.spread``: of the
samples that one run's median came from). Prints a table and writes a JSON result file.

The profile is meant to be steady on an idle machine; on a shared one (other programs running)
its timings are not. So before each run it waits (up to ``--idle-wait`` seconds) until the
machine's CPU use over one second is below ``IDLE_CPU_PERCENT``, and it records for each run the
CPU seconds other programs used meanwhile (``others_cpu_s``: the machine's busy CPU time less the
profile process's), which tells a busy run from an unsteady method. A busy run (others used more
than ``BUSY_FRACTION`` of a core) is set aside, kept in the result file, and measured again, up
to ``--retries`` times.

Usage (from the project root, on an otherwise idle machine):
``python -m strata.benchmarks.profile_steadiness --runs 5 --disk-dir /tmp/prof``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from strata.common.errors import StrataError
from strata.common.schemas import Figure, HardwareProfile
from strata.common.yamlio import read_yaml

RESULTS = Path(__file__).resolve().parent / "results"

FIGURES = {
    "nvme.read_bytes_s": ("disk read", 1e9, "GB/s"),
    "gpu.memory_bandwidth_bytes_s": ("memory bandwidth", 1e9, "GB/s"),
    "gpu.compute_flops_s": ("matmul", 1e9, "GFLOP/s"),
    "gpu.decode_matvec_flops_s": ("decode matvec", 1e9, "GFLOP/s"),
    "gpu.decode_batch_flops_s": ("decode batch", 1e9, "GFLOP/s"),
    "gpu.op_overhead_s": ("per-op overhead", 1e-6, "us"),
    "ram.host_to_device_bytes_s": ("host->device copy", 1e9, "GB/s"),
}
"""Dotted profile field -> (label, unit divisor, unit) of the figures compared between runs."""

BUSY_FRACTION = 0.1
"""A run is busy when other programs used more CPU seconds during it than this fraction of its
wall time (a tenth of one core on average)."""

IDLE_CPU_PERCENT = 10.0
"""Machine-wide CPU use, percent of all cores over one second, below which the machine counts as
idle before a run (a 2-core machine's background daemons use a few percent)."""


def wait_idle(timeout_s: float) -> float:
    """Wait until the machine's CPU use over one second is below ``IDLE_CPU_PERCENT``, at most
    ``timeout_s`` seconds; return the last CPU use measured (percent of all cores)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = psutil.cpu_percent(interval=1.0)
        if busy < IDLE_CPU_PERCENT or time.monotonic() >= deadline:
            return busy


def _busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _figure(profile: HardwareProfile, dotted: str) -> Figure | None:
    obj = profile
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def spread(values: list[float]) -> float:
    """``(max - min) / median`` of ``values``: how far apart repeated runs landed."""
    return (max(values) - min(values)) / statistics.median(values)


def _one_run(path: Path, disk_dir: Path, quick: bool, idle_wait_s: float) -> dict:
    cmd = [sys.executable, "-m", "strata", "profile", "--name", "steadiness"]
    cmd += ["--disk-dir", str(disk_dir), "-o", str(path), "--no-keep"]
    cmd += ["--quick"] if quick else []
    before = wait_idle(idle_wait_s) if idle_wait_s > 0 else None
    busy0, own0 = _busy_cpu_s(), _children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    others = max(0.0, (_busy_cpu_s() - busy0) - (_children_cpu_s() - own0))
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StrataError(f"a profile run failed: {last}")
    prof = read_yaml(path, HardwareProfile)
    figs = {}
    for key in FIGURES:
        f = _figure(prof, key)
        if f is not None:
            figs[key] = {"value": f.value, "samples": f.samples, "spread": f.spread}
    return {
        "wall_s": round(wall, 2),
        "cpu_percent_before": before,
        "others_cpu_s": round(others, 2),
        "busy": others > BUSY_FRACTION * wall,
        "figures": figs,
    }


def profile_runs(
    runs: int,
    disk_dir: Path,
    *,
    quick: bool = False,
    idle_wait_s: float = 0.0,
    retries: int = 0,
) -> tuple[list[dict], list[dict]]:
    """Measure ``runs`` profiles, each by ``strata profile`` in a fresh Python process, each
    after waiting up to ``idle_wait_s`` seconds for an idle machine (:func:`wait_idle`).

    A run during which other programs used more than ``BUSY_FRACTION`` of a core is busy: it is
    set aside and measured again, at most ``retries`` times in all; when the retries run out,
    the busy runs fill the missing places (marked ``busy``).

    Returns:
        (the runs, the busy runs set aside); each run: its wall seconds, the CPU use before it
        (percent of all cores), the CPU seconds other programs used during it, whether it was
        busy, and per field of ``FIGURES`` the figure's value, samples and in-run spread.

    Raises:
        StrataError: ``runs`` < 1, or a profile run fails (its stderr's last line is given).
    """
    if runs < 1:
        raise StrataError(f"--runs {runs}: pass at least 1")
    kept: list[dict] = []
    busy: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(runs + max(0, retries)):
            if len(kept) == runs:
                break
            r = _one_run(Path(tmp) / f"run{attempt}.yaml", disk_dir, quick, idle_wait_s)
            (busy if r["busy"] else kept).append(r)
            print(
                f"run {attempt + 1}: {r['wall_s']:.1f} s, other programs used "
                f"{r['others_cpu_s']:.1f} CPU s{' (busy, set aside)' if r['busy'] else ''}; "
                f"{len(kept)}/{runs} kept",
                file=sys.stderr,
                flush=True,
            )
    missing = runs - len(kept)
    if missing:
        kept += busy[-missing:]
        busy = busy[:-missing]
    return kept, busy


def summarize(runs: list[dict]) -> dict:
    """Per field: the values of every run, their median and their spread between runs."""
    summary = {}
    for key in FIGURES:
        vals = [r["figures"][key]["value"] for r in runs if key in r["figures"]]
        if vals:
            summary[key] = {
                "values": vals,
                "median": statistics.median(vals),
                "between_runs_spread": round(spread(vals), 4),
                "in_run_spreads": [r["figures"][key]["spread"] for r in runs],
                "samples": runs[0]["figures"][key]["samples"],
            }
    return summary


def table(summary: dict, runs: list[dict]) -> str:
    """The summary as a Markdown table, values in the figures' usual units, with a last row of
    the CPU seconds other programs used during each run."""
    n = len(runs)
    head = "| figure | " + " | ".join(
        f"run {i + 1}{' (busy)' if r['busy'] else ''}" for i, r in enumerate(runs)
    )
    head += " | between runs | in-run spreads | samples |"
    lines = [head, "|---" * (n + 4) + "|"]
    for key, s in summary.items():
        label, div, unit = FIGURES[key]
        vals = " | ".join(f"{v / div:.3g}" for v in s["values"])
        ins = ", ".join(f"{x:.0%}" for x in s["in_run_spreads"])
        lines.append(
            f"| {label} ({unit}) | {vals} | {s['between_runs_spread']:.1%} | {ins} | "
            f"{s['samples']} |"
        )
    others = " | ".join(f"{r['others_cpu_s']:.1f}" for r in runs)
    lines.append(f"| other programs' CPU s | {others} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="profile runs (default 5)")
    ap.add_argument(
        "--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="disk test folder"
    )
    ap.add_argument("--machine", default="dev-linux-cpu", help="machine label for the file name")
    ap.add_argument("--quick", action="store_true", help="quick profiles (for a smoke test)")
    ap.add_argument(
        "--idle-wait",
        type=float,
        default=120.0,
        help="seconds to wait for an idle machine before each run (default 120; 0: don't wait)",
    )
    ap.add_argument(
        "--retries",
        type=int,
        default=10,
        help="busy runs (other programs used the CPU) measured again, at most (default 10)",
    )
    ap.add_argument("-o", "--output", type=Path, help="result file (default: results/DATE...)")
    args = ap.parse_args(argv)
    import mlx.core as mx

    try:
        runs, busy = profile_runs(
            args.runs,
            args.disk_dir,
            quick=args.quick,
            idle_wait_s=args.idle_wait,
            retries=args.retries,
        )
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(runs)
    date = datetime.date.today().isoformat()
    out = args.output or RESULTS / f"{date}.profile-steadiness.{args.machine}.json"
    result = {
        "what": "strata profile run --runs times back to back, each in a fresh process; per "
        "figure its value in every run and (max - min) / median between runs",
        "command": "python -m strata.benchmarks.profile_steadiness "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": date,
        "machine": args.machine,
        "platform": f"{platform.platform()}, {platform.processor() or platform.machine()}",
        "mlx": mx.__version__,
        "quick": args.quick,
        "summary": summary,
        "runs": runs,
        "busy_runs_set_aside": busy,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(summary, runs))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
