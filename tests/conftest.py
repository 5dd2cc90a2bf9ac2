"""Shared pytest fixtures: the real SmolLM2 GGUF (fetched once by the catalog), reference data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched and sha256-checked by the catalog."""
    from planner.catalog import resolve_model

    return resolve_model("smollm2-135m").path


ROOT = Path(__file__).resolve().parent.parent
DEV_PROFILE = ROOT / "profiles" / "dev-linux-cpu.yaml"


def make_plan_file(model: str, path: Path, profile: Path = DEV_PROFILE, **request) -> Path:
    """Plan ``model`` with the real planner (``plan.py plan``'s code) and write it to ``path``."""
    from planner.planning import build_plan
    from planner.schemas import Request
    from planner.yamlio import write_yaml

    req = Request(**{"context": 2048, "concurrency": 1, **request})
    write_yaml(build_plan(model, profile, req, path), path)
    return path


@pytest.fixture(scope="session")
def smollm2_plan(tmp_path_factory) -> Path:
    """An all-resident plan of SmolLM2 for the dev profile."""
    return make_plan_file("smollm2-135m", tmp_path_factory.mktemp("plans") / "smollm2.yaml")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_plan):
    """The executor loaded with ``smollm2_plan`` (load once per test session)."""
    from executor.engine import Engine
    from executor.plan_loader import load_plan

    return Engine(load_plan(smollm2_plan))


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    """llama.cpp's outputs on the visible reference cases (copied from shared/reference)."""
    return json.loads((DATA / "llamacpp_visible.json").read_text())


def pytest_configure(config):
    # Test helpers (tests/gguf_factory.py) import as top-level modules.
    import sys

    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma-3-270M Q4_K_M GGUF (253 MB, four wheels concatenated), sha256-checked."""
    from planner.catalog import resolve_model

    return resolve_model("gemma3-270m").path
