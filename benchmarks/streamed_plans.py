"""What the streaming benches (``tier_streaming.py``, ``moe_streaming.py``) share: their common
options, running ``strata`` commands from the project root, and the device budget of a streamed
plan (a quarter of the model's MLX bytes, so that the model is at least 4x the budget)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = "256"
"""The planned context (tokens) of every streaming bench plan."""


def run_strata(*args: str) -> None:
    """Run ``python -m strata ARGS`` in the project root, the command echoed on stderr first.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    print("+", " ".join(args), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "strata", *args], cwd=ROOT, check=True)


def streaming_parser(description: str, tokens: int) -> argparse.ArgumentParser:
    """A parser with the options every streaming bench takes: ``--profile``, ``--out``,
    ``--tokens`` (default ``tokens``), ``--tiers`` and ``--tokenizer``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--profile", required=True, help="hardware profile YAML")
    p.add_argument("--out", required=True, help="folder for models, plans and results")
    p.add_argument("--tokens", type=int, default=tokens, help=f"decode steps per bench ({tokens})")
    p.add_argument("--tiers", default="gpu,ram,nvme", help="tiers of the streamed plans")
    p.add_argument("--tokenizer", default=None, help="GGUF to copy the tokenizer from (offline)")
    return p


def model_mlx_bytes(plan: Path) -> int:
    """The model's bytes in MLX form: the sum over the plan's placement."""
    return sum(p["bytes"] for p in yaml.safe_load(plan.read_text())["placement"])


def quarter_budget(model_bytes: int, tiers: str) -> tuple[int, list[str]]:
    """The device budget a quarter of ``model_bytes``, and the ``strata plan`` options that give
    it to the gpu and the ram tier each, planning on ``tiers`` only."""
    budget = model_bytes // 4
    return budget, ["--gpu-budget", str(budget), "--ram-budget", str(budget), "--tiers", tiers]
