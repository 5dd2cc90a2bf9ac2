"""Shared pytest fixtures: the real SmolLM2 GGUF (fetched once by the catalog), reference data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from strata.common.schemas import ModelDescription

DATA = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched and sha256-checked by the catalog."""
    from strata.common.catalog import resolve_model

    return resolve_model("smollm2-135m").path


ROOT = Path(__file__).resolve().parent.parent
DEV_PROFILE = ROOT / "profiles" / "dev-linux-cpu.yaml"


def make_plan_file(
    model: str,
    path: Path,
    profile: Path = DEV_PROFILE,
    desc: ModelDescription | None = None,
    **request,
) -> Path:
    """Plan ``model`` with the real planner (``plan.py plan``'s code) and write it to ``path``
    (``desc``: the model's description, when already made)."""
    from strata.common.schemas import Request
    from strata.common.yamlio import write_yaml
    from strata.planner.planning import build_plan

    req = Request(**{"context": 2048, "concurrency": 1, **request})
    write_yaml(build_plan(model, profile, req, desc=desc), path)
    return path


@pytest.fixture(scope="session")
def smollm2_plan(tmp_path_factory) -> Path:
    """An all-resident plan of SmolLM2 for the dev profile."""
    return make_plan_file("smollm2-135m", tmp_path_factory.mktemp("plans") / "smollm2.yaml")


BUDGET_CONTEXT = 256
"""Context of the budget plans: its KV cache (11.25 MiB) and activations (7.3 MiB) are small next to
SmolLM2's 93.8 MiB of weights, so budgets can sit well below the all-resident size."""


@pytest.fixture(scope="session")
def budget_plans(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 planned by the planner (``plan.py plan --gpu-budget X --ram-budget X`` or
    ``--tiers``) at ``BUDGET_CONTEXT``. Budgets come from the plan without budgets, by the planner's
    own accounting (weights + KV cache + activations + pool on the device tier); the same budget
    is given as ``--ram-budget``, which on unified memory covers the gpu and ram tiers together,
    so the ram tier has no room of its own: what the device cannot hold streams. Tests assert
    the placements they rely on.

    - ``resident``: exactly what every unit resident needs (112.35 MiB): all on gpu.
    - ``ffn-nvme``: the embedding, all attention units, KV cache, activations, a pool of two
      FFN-sized slots and half an attention unit of slack (68.26 MiB): every FFN streams. The
      planner chooses exactly that only in a window about half a MiB wide above the exact fit
      (67.99 MiB): at or below it some attention or the output norm streams too, above it an FFN
      stays.
    - ``all-nvme``: ``--tiers nvme``, budgets = KV cache, activations and a pool of two
      embedding-sized slots (79.31 MiB). Budgets alone never stream the embedding: its pool
      slots would take twice the memory that keeping it does.
    - ``gpu-ram``: ``--tiers gpu,ram`` and the ``ffn-nvme`` device budget: units split over gpu
      and ram. ``all-ram``: ``--tiers ram``.
    """
    from strata.common.describe import describe
    from strata.common.schemas import Plan
    from strata.common.yamlio import read_yaml

    d = tmp_path_factory.mktemp("budget-plans")
    desc, _ = describe("smollm2-135m")

    def plan(name: str, **request) -> Path:
        path = d / f"{name}.yaml"
        return make_plan_file("smollm2-135m", path, desc=desc, context=BUDGET_CONTEXT, **request)

    free = read_yaml(plan("unbudgeted"), Plan)
    gpu = free.memory["gpu"]
    units = {p.unit: p.bytes for p in free.placement}
    ffn = [b for u, b in units.items() if u.endswith(".ffn")]
    attn = [b for u, b in units.items() if u.endswith(".attn")]
    fixed = gpu.kv_cache + gpu.activations
    resident = fixed + sum(units.values())
    ffn_nvme = resident - sum(ffn) + 2 * max(ffn) + min(attn) // 2
    all_nvme = fixed + 2 * max(units.values())
    return {
        "resident": plan("resident", gpu_budget_bytes=resident, ram_budget_bytes=resident),
        "ffn-nvme": plan("ffn-nvme", gpu_budget_bytes=ffn_nvme, ram_budget_bytes=ffn_nvme),
        "all-nvme": plan(
            "all-nvme", gpu_budget_bytes=all_nvme, ram_budget_bytes=all_nvme, tiers=["nvme"]
        ),
        "gpu-ram": plan("gpu-ram", gpu_budget_bytes=ffn_nvme, tiers=["gpu", "ram"]),
        "all-ram": plan("all-ram", tiers=["ram"]),
    }


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_plan):
    """The executor loaded with ``smollm2_plan`` (load once per test session)."""
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan

    return Engine(load_plan(smollm2_plan))


@pytest.fixture(scope="session")
def smollm2_serving(smollm2_engine):
    """The serving engine over ``smollm2_engine``, started: what ``strata run`` generates with
    (``executor.generate.generate``). Closing it at the end closes the engine too."""
    from strata.executor.serving import ServingEngine

    serving = ServingEngine(smollm2_engine)
    serving.start()
    yield serving
    serving.close()


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    """llama.cpp's outputs on the visible reference cases (copied from shared/reference)."""
    return json.loads((DATA / "llamacpp_visible.json").read_text())


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma-3-270M Q4_K_M GGUF (253 MB, four wheels concatenated), sha256-checked."""
    from strata.common.catalog import resolve_model

    return resolve_model("gemma3-270m").path


SLOW_FIXTURES = frozenset(
    {
        "smollm2_gguf",
        "smollm2_plan",
        "budget_plans",
        "smollm2_engine",
        "smollm2_serving",
        "gemma3_gguf",
    }
)
"""Fixtures that load a real model: a test using any of them (directly or through another
fixture) is marked ``slow``, so ``pytest -m "not slow"`` is the fast tier for everyday work."""


def _has_gpu() -> bool:
    """Whether MLX's CUDA backend is here: ``gpu`` tests (Strata's CUDA kernels) skip without."""
    import mlx.core as mx

    return mx.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu = None
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            gpu = _has_gpu() if gpu is None else gpu
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs MLX's CUDA backend"))
