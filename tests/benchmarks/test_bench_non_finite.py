"""``strata bench`` on a model whose weights hold NaN names the step, the first layer that
produced non-finite numbers and its tensor (issue 35), in its error line and its JSON."""

from __future__ import annotations

import json

import pytest
from conftest import make_plan_file
from nan_models import nan_model
from plan_edits import moved_plan
from test_cli import assert_one_line_error, cli


@pytest.mark.parametrize("streamed", [False, True])
def test_bench_names_the_layer(tmp_path, streamed):
    model = nan_model(tmp_path, "blk.1.attn_q.weight")
    plan = make_plan_file(str(model), tmp_path / "p.yaml", context=64)
    if streamed:
        plan = moved_plan(plan, tmp_path / "nvme.yaml", "nvme", (".ffn",))
    out = tmp_path / "b.json"
    done = cli("-m", "strata", "bench", str(plan), "--prompt", "hello", "--max-tokens", "4",
               "-o", str(out), ok=False)  # fmt: skip
    assert_one_line_error(
        done, "NaN or infinite logits at the prompt's prefill", "block 1 (blk.1): attention output",
        "non-finite weights: blk.1.attn_q.weight",
    )  # fmt: skip
    r = json.loads(out.read_text())
    assert r["check_passed"] is False
    assert r["non_finite"] == {
        "step": f"the prompt's prefill (position {r['prompt_tokens'] - 1})",
        "first_stage": "block 1 (blk.1): attention output",
        "block": 1,
        "tensors": ["blk.1.attn_q.weight"],
    }


def test_clean_model_has_no_diagnosis(tmp_path):
    plan = make_plan_file(str(nan_model(tmp_path, None)), tmp_path / "p.yaml", context=64)
    done = cli("-m", "strata", "bench", str(plan), "--prompt", "hello", "--max-tokens", "4")
    r = json.loads(done.stdout)
    assert r["check_passed"] is True and "non_finite" not in r
