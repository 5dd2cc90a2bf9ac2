"""Checked-in plans stay current, and every shipped profile runs through the planner."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import ROOT
from strata.common.schemas import Request
from strata.common.yamlio import document_text, to_yaml
from strata.planner.planning import build_plan

_spec = importlib.util.spec_from_file_location("make_plans", ROOT / "scripts" / "make_plans.py")
make_plans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_plans)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow] if n in make_plans.SLOW else [])
        for n in sorted(make_plans.EXAMPLES)
    ],
)
def test_checked_in_plan_is_current(name):
    """Golden files: re-planning from the same inputs gives the same bytes.

    If this fails after an intended planner change, run ``scripts/make_plans.py`` and review the
    diff of plans/ like any other change.
    """
    assert to_yaml(make_plans.make(name)) == document_text(ROOT / "plans" / name)


@pytest.mark.parametrize(
    "profile", sorted((ROOT / "profiles").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_shipped_profile_plans(profile: Path, smollm2_gguf, tmp_path):
    plan = build_plan(str(smollm2_gguf), profile, Request(context=4096))
    assert plan.solver.status == "Optimal"
    assert {p.unit for p in plan.placement} and plan.prediction.decode_tok_s > 0
