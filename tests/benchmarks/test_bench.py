"""``execute.py bench``: measured figures in JSON and PNG, and the generated text checked."""

from __future__ import annotations

import json

from conftest import make_plan_file
from gguf_factory import write_tiny_llama
from plan_edits import moved_plan as _moved
from test_cli import assert_one_line_error, cli


def test_bench_streamed_plan(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3)
    plan = _moved(
        make_plan_file(str(model), tmp_path / "p.yaml", context=64),
        tmp_path / "nvme.yaml",
        "nvme",
        (".ffn",),
    )
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    bench = ("execute.py", "bench", str(plan), "--prompt", "hello", "--max-tokens", "8")
    cli(*bench, "-o", str(out), "--plot", str(png))
    r = json.loads(out.read_text())
    assert r["check_passed"] is True and r["decode_tokens"] == 8
    assert r["tiers"]["nvme"] == 3 and r["streamed_bytes_per_token"] > 0
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert r["peak_rss_bytes"] > 0 and r["bytes_read"]["nvme"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A reference that disagrees fails the bench: a fast wrong answer never counts.
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"output_ids": [0] * 8}))
    done = cli(*bench, "--check", str(wrong), ok=False)
    assert_one_line_error(done, "bench check failed")


def test_bench_judges_a_hand_edited_plan_and_measures_the_baseline(tmp_path):
    from strata.common.schemas import Plan
    from strata.common.yamlio import read_yaml

    model = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3)
    planned = make_plan_file(str(model), tmp_path / "p.yaml", context=64)
    edited = _moved(planned, tmp_path / "nvme.yaml", "nvme", (".ffn",))
    out = tmp_path / "b.json"
    cli("execute.py", "bench", str(edited), "--prompt", "hello", "--max-tokens", "4",
        "--baseline", "-o", str(out))  # fmt: skip
    r = json.loads(out.read_text())
    # Predicted from the edited decisions: the stored prediction is the all-resident one.
    stored = read_yaml(edited, Plan).prediction.decode_tok_s
    assert r["predicted_decode_tok_s"] < stored
    b = r["baseline"]
    assert b["tiers"]["nvme"] == 0  # the rule keeps everything resident where it fits
    assert b["rounds"] == 3 and len(b["decode_tok_s_runs"]) == len(b["plan_decode_tok_s_runs"]) == 3
    assert b["plan_over_baseline_decode"] > 0 and r["check_passed"] is True
    text = cli("plan.py", "explain", str(edited)).stdout
    assert "Edited by hand" in text and "nvme" in text
    assert "plan b is edited by hand" in cli("plan.py", "diff", str(planned), str(edited)).stdout


def test_bench_never_writes_over_its_plan(tmp_path):
    """``bench PLAN -o PLAN`` is refused before anything runs: the plan is left as it was."""
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=2)
    plan = make_plan_file(str(model), tmp_path / "p.yaml", context=64)
    before = plan.read_bytes()
    done = cli("execute.py", "bench", str(plan), "--prompt", "hi", "-o", str(plan), ok=False)
    assert_one_line_error(done, f"-o {plan} is also an input")
    assert plan.read_bytes() == before


def test_bench_given_a_model_name_says_it_measures_a_plan(capsys):
    """``strata bench NAME`` (as ``run`` and ``serve`` take one) says how to make the plan it
    measures, in one line."""
    from strata.cli import main

    assert main(["bench", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "no such plan file" in err and "strata plan --model smollm2-135m" in err
    assert "Traceback" not in err
