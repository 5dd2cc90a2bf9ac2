"""The anchor plans of docs/anchors.md: checked in, loadable, and tabled as they are.

``tests/planner/test_plans.py`` checks that each plan is current (re-made from its inputs, it
equals the file); here: every anchor has its plan, the doc's table is the one
``scripts/make_plans.py --anchors`` prints from the plans, and the few sections that command reads
are the plan's as the full loader reads it.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import ROOT
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml

_spec = importlib.util.spec_from_file_location("make_plans", ROOT / "scripts" / "make_plans.py")
make_plans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_plans)


def test_every_anchor_has_a_checked_in_plan():
    names = [a.plan for a in make_plans.ANCHORS]
    assert len(set(names)) == len(names)
    for name in names:
        assert name in make_plans.EXAMPLES, name
        assert (ROOT / "plans" / name).is_file(), name


def test_doc_table_is_the_table_of_the_plans():
    """docs/anchors.md shows what the checked-in plans predict and decide; after re-making the
    plans, ``scripts/make_plans.py --anchors --write-doc`` updates it."""
    table = make_plans.anchor_table()
    assert make_plans.doc_table() == table
    assert len(table.splitlines()) == 2 + len(make_plans.ANCHORS)


def test_doc_table_needs_its_markers(tmp_path):
    doc = tmp_path / "anchors.md"
    doc.write_text(f"# anchors\n{make_plans.END}\n{make_plans.BEGIN}\n")
    with pytest.raises(ValueError, match="no <!-- anchors:begin -->"):
        make_plans.doc_table(doc)


ANCHOR_PARAMS = [
    pytest.param(a, marks=[pytest.mark.slow] if a.plan in make_plans.SLOW else [], id=a.plan)
    for a in make_plans.ANCHORS
]


@pytest.mark.parametrize("anchor", ANCHOR_PARAMS)
def test_anchor_plan_loads_and_its_summary_is_the_plans(anchor):
    """The plan loads whole (schema and cross-checks), and the sections the table reads without
    the full loader are the same values; the weights per tier are the placement's."""
    path = ROOT / "plans" / anchor.plan
    plan = read_yaml(path, Plan)
    summary = make_plans.plan_summary(path)
    assert summary["request"] == plan.request
    assert summary["prediction"] == plan.prediction
    assert summary["expert_cache"] == plan.expert_cache
    assert summary["memory"] == plan.memory
    assert summary["cluster"] == plan.cluster
    # A cluster plan's top-level memory is stage 0's: its host's weights.
    host = plan.cluster.stages[0].host if plan.cluster else None
    for tier, mem in plan.memory.items():
        mine = [p.bytes for p in plan.placement if p.tier == tier and p.host == host]
        assert mem.weights == sum(mine), tier
        assert summary["weights"].get(tier, 0) == sum(
            p.bytes for p in plan.placement if p.tier == tier
        )
    assert summary["units"] == make_plans.unit_kinds(plan)
    assert plan.prediction.decode_tok_s > 0 and len(plan.prediction.ttft_s) == 2
