"""``executor.diagnose``: the first stage of a pass whose output is not finite, and its
non-finite weights (issue 35: ``bench`` names the layer that produced NaN logits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_plan_file
from nan_models import nan_model
from plan_edits import moved_plan
from strata.executor.diagnose import first_non_finite
from strata.executor.plan_loader import load_plan


def plan_of(d: Path, model: Path, streamed: bool = False) -> Path:
    """Its plan: all resident, or every block streamed from the packed store."""
    plan = make_plan_file(str(model), d / "p.yaml", context=64)
    return moved_plan(plan, d / "nvme.yaml", "nvme", (".attn", ".ffn")) if streamed else plan


@pytest.mark.parametrize("streamed", [False, True])
def test_names_the_block_and_the_tensor(tmp_path, streamed):
    """A NaN in block 1's Q projection: its attention output is the first non-finite one, on
    resident weights and with every block streamed from the packed store."""
    plan = plan_of(tmp_path, nan_model(tmp_path, "blk.1.attn_q.weight"), streamed)
    found = first_non_finite(load_plan(plan), [1, 2, 3])
    assert found is not None
    assert found.stage == "block 1 (blk.1): attention output" and found.block == 1
    assert found.tensors == ["blk.1.attn_q.weight"]


@pytest.mark.parametrize(
    ("tensor", "stage"),
    [
        ("blk.2.ffn_down.weight", "block 2 (blk.2): FFN output"),
        ("blk.0.attn_norm.weight", "block 0 (blk.0): attention output"),
        ("output_norm.weight", "output head (output_norm, output projection)"),
    ],
)
def test_other_stages(tmp_path, tensor, stage):
    found = first_non_finite(load_plan(plan_of(tmp_path, nan_model(tmp_path, tensor))), [5, 6])
    assert found is not None and (found.stage, found.tensors) == (stage, [tensor])


def test_clean_model_has_no_stage(tmp_path):
    plan = plan_of(tmp_path, nan_model(tmp_path, None))
    assert first_non_finite(load_plan(plan), [1, 2, 3]) is None
