#!/usr/bin/env python3
"""Time to first token from a cold process: ``strata run MODEL`` as a user types it.

For each model it times, in fresh processes one after another: ``strata describe MODEL``
(start to exit), then ``strata run MODEL --prompt PROMPT --max-tokens N`` from the moment the
process is started to the first byte of generated text on its standard output (``first_token_s``)
and to its exit (``total_s``), generating as many tokens as llama.cpp's greedy choices are clear
(its top-2 logit gap at least ``NEAR_TIE`` at every step, the project's rule; at most
``--max-tokens``). The first run of each model may build caches (this machine's
profile, the plan, the tokenizer) and is reported apart (``cold``: with ``--fresh-cache``, in an
empty cache but for the model files and this host's kept profile, so that it builds the plan and
the tokenizer); the next ``--runs`` runs are
the figure (``warm``: median, min, max). Each run's text is checked against llama.cpp's greedy
text for the same GGUF and prompt (tests/fixtures/data/llamacpp_visible.json, written by
tests/fixtures/make_arch_references.py): a run whose text is not a prefix of llama.cpp's fails
the benchmark. The load average is recorded with every run (``os.getloadavg``: 1 minute), as the
machine is shared.

Usage (from the project root): ``python -m strata.benchmarks.first_token --runs 3
--fresh-cache`` (writes benchmarks/results/<date>.first-token.<machine>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata.common import envs
from strata.common.errors import StrataError, run_command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ORACLE = ROOT / "tests" / "fixtures" / "data" / "llamacpp_visible.json"
PROMPT = "The capital of France is"
MODELS = ("smollm2-135m", "gemma3-270m")
NEAR_TIE = 0.5
"""llama.cpp's top-2 logit gap below which a greedy step is a legitimate near-tie on a real model
(it rounds activations to 8 bits): the text is compared up to the first such step."""
SHA256 = {  # the catalog's files, as llama.cpp's stored outputs name them
    "smollm2-135m": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "gemma3-270m": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}


def oracle(model: str) -> tuple[str, int]:
    """llama.cpp's greedy text after ``PROMPT`` on the model's catalog GGUF, and how many of its
    first steps are clear choices (top-2 gap at least ``NEAR_TIE``).

    Raises:
        StrataError: the stored outputs hold no such case.
    """
    for case in json.loads(ORACLE.read_text()):
        if case["model_sha256"] == SHA256[model] and case["rendered_prompt"] == PROMPT:
            steps = case["greedy_step_top5"]
            clear = next(
                (i for i, top in enumerate(steps) if top[0][1] - top[1][1] < NEAR_TIE), len(steps)
            )
            return case["greedy_text"], clear
    raise StrataError(f"{ORACLE} has no llama.cpp output for {model} on {PROMPT!r}")


def fresh_cache(folder: Path) -> dict[str, str]:
    """The environment of a run in an empty ``STRATA_CACHE`` at ``folder`` that still has this
    machine's catalog models (linked) and kept profile (copied): a cold run plans and builds the
    tokenizer, it neither downloads nor profiles.

    Raises:
        StrataError: this host has no kept profile (run ``strata profile`` first).
    """
    from strata.common.catalog import cache_dir
    from strata.executor.machine import kept_profile_path

    kept = kept_profile_path()
    if not kept.is_file():
        raise StrataError(f"no kept profile at {kept}: run strata profile first")
    models = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(models, target_is_directory=True)
    (folder / "machine").mkdir()
    shutil.copyfile(kept, folder / "machine" / kept.name)
    return envs.child_environment(STRATA_CACHE=str(folder))


def _strata(*args: str) -> list[str]:
    return [sys.executable, "-m", "strata", *args]


def time_describe(model: str) -> float:
    """Seconds from start to exit of ``strata describe MODEL``.

    Raises:
        StrataError: the command failed.
    """
    t0 = time.perf_counter()
    done = subprocess.run(_strata("describe", model), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise StrataError(f"strata describe {model} failed: {done.stderr.strip()[-300:]}")
    return seconds


def time_run(model: str, max_tokens: int, env: dict[str, str] | None = None) -> dict:
    """One ``strata run MODEL``: seconds to the first byte of text and to exit, the text, the
    1-minute load average when it started.

    Raises:
        StrataError: the command failed or printed no text.
    """
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _strata("run", model, "--prompt", PROMPT, "--max-tokens", str(max_tokens)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    first = os.read(proc.stdout.fileno(), 65536)  # blocks until the first streamed piece
    first_s = time.perf_counter() - t0
    rest = proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    status = proc.wait()
    total_s = time.perf_counter() - t0
    if status or not first:
        raise StrataError(f"strata run {model} failed (status {status}): {err.strip()[-300:]}")
    return {
        "first_token_s": round(first_s, 3),
        "total_s": round(total_s, 3),
        "loadavg_1m": round(load, 2),
        "text": (first + rest).decode(),
    }


def measure(models: list[str], runs: int, max_tokens: int, fresh: bool) -> dict:
    """Every model's describe time and cold and warm runs (see the module docstring).

    Raises:
        StrataError: a command failed, or a text is not llama.cpp's.
    """
    out: dict = {}
    for model in models:
        want, clear = oracle(model)
        tokens = min(max_tokens, clear)
        with tempfile.TemporaryDirectory() as tmp:
            env = fresh_cache(Path(tmp) / "cache") if fresh else None
            cold = time_run(model, tokens, env)
            warm = [time_run(model, tokens, env) for _ in range(runs)]
        for r in [cold, *warm]:
            if not want.startswith(r["text"]):
                raise StrataError(
                    f"{model}: generated {r['text']!r}, but llama.cpp's greedy text is "
                    f"{want[:80]!r}"
                )
        describe = [time_describe(model) for _ in range(runs)]
        firsts = [r["first_token_s"] for r in warm]
        out[model] = {
            "tokens": tokens,
            "describe_s": {"median": round(statistics.median(describe), 3), "all": describe},
            "cold": cold,
            "warm": warm,
            "first_token_s": {
                "median": statistics.median(firsts),
                "min": min(firsts),
                "max": max(firsts),
            },
        }
        print(
            f"{model}: describe {statistics.median(describe):.2f} s; first token cold "
            f"{cold['first_token_s']:.2f} s, warm median {statistics.median(firsts):.2f} s "
            f"(min {min(firsts):.2f}, max {max(firsts):.2f}; load "
            f"{', '.join(str(r['loadavg_1m']) for r in warm)}); text {warm[0]['text']!r}",
            file=sys.stderr,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.benchmarks.first_token", description=__doc__)
    p.add_argument("--models", default=",".join(MODELS), help="catalog names, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="warm runs per model (3)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per run (8)")
    p.add_argument(
        "--fresh-cache",
        action="store_true",
        help="run in an empty cache (but for the models and the kept profile): the first run "
        "builds the plan and the tokenizer",
    )
    p.add_argument("--machine", default="dev-linux-cpu", help="machine name in the result's name")
    p.add_argument("-o", "--output", help="result file (default: benchmarks/results/...)")
    args = p.parse_args(argv)

    def run() -> None:
        models = [m for m in args.models.split(",") if m]
        unknown = [m for m in models if m not in SHA256]
        if unknown:
            raise StrataError(f"--models {unknown[0]}: give some of {', '.join(SHA256)}")
        if args.runs < 1:
            raise StrataError(f"--runs {args.runs}: give 1 or more")
        result = {
            "benchmark": "first-token",
            "date": datetime.date.today().isoformat(),
            "machine": args.machine,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "command": "strata run MODEL --prompt PROMPT --max-tokens N",
            "fresh_cache": args.fresh_cache,
            "models": measure(models, args.runs, args.max_tokens, args.fresh_cache),
        }
        today = datetime.date.today().isoformat()
        path = Path(args.output or RESULTS / f"{today}.first-token.{args.machine}.json")
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)

    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
