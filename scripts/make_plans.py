#!/usr/bin/env python3
"""Re-make the example plans checked in under plans/ (tests/test_plans.py keeps them current).

Run from the project root: ``.venv/bin/python scripts/make_plans.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.common.schemas import Plan, Request  # noqa: E402
from strata.common.yamlio import write_yaml  # noqa: E402
from strata.planner.archdesc import describe_arch  # noqa: E402
from strata.planner.planning import build_plan  # noqa: E402

# plan file -> (model, profile file, request); a model is a catalog name, or (architecture file
# under profiles/arch/, llama.cpp file type) for a model described without its weights.
EXAMPLES: dict[str, tuple[str | tuple[str, str], str, dict]] = {
    "smollm2-135m.dev-linux-cpu.yaml": ("smollm2-135m", "dev-linux-cpu.yaml", {"context": 2048}),
    "smollm2-135m.m1-max-32gb.yaml": ("smollm2-135m", "m1-max-32gb.yaml", {"context": 8192}),
    "smollm2-135m.h200-host.yaml": (
        "smollm2-135m",
        "h200-host.yaml",
        {"context": 8192, "concurrency": 16, "objective": "throughput"},
    ),
    # The published benchmark machine and models (shared/anchor-models.md).
    "qwen2.5-14b-q4_k_m.m1-max-32gb.yaml": (
        ("qwen2.5-14b.yaml", "Q4_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    "llama-3.3-70b-q4_k_m.m1-max-32gb.yaml": (
        ("llama-3.3-70b.yaml", "Q4_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    "mixtral-8x7b-q5_k_m.m1-max-32gb.yaml": (
        ("mixtral-8x7b.yaml", "Q5_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
}


def make(name: str) -> Plan:
    """The example plan ``name`` made afresh from its inputs."""
    model, profile, request = EXAMPLES[name]
    desc = None
    if isinstance(model, tuple):
        arch_file, ftype = model
        desc = describe_arch(ROOT / "profiles" / "arch" / arch_file, ftype)
    spec = model if isinstance(model, str) else None
    return build_plan(spec, ROOT / "profiles" / profile, Request(**request), desc=desc)


if __name__ == "__main__":
    for name in EXAMPLES:
        write_yaml(make(name), ROOT / "plans" / name)
        print(f"wrote plans/{name}")
