"""The command lines: real subprocesses, one-line errors for bad input, deterministic plans."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import DEV_PROFILE, ROOT, make_plan_file
from gguf_factory import write_tiny_llama


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run ``plan.py``/``execute.py`` as a user would."""
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_run_json(smollm2_plan):
    done = cli(
        "execute.py",
        "run",
        str(smollm2_plan),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--json",
    )
    out = json.loads(done.stdout)
    assert out["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert out["output_ids"][0] == 7042 and out["text"].startswith(" Paris")
    for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "peak_mlx_bytes"):
        assert out["stats"][key] > 0
    assert set(out["stats"]["bytes_read"]) == {"gpu", "ram", "nvme"}


def test_run_honours_the_plans_speculative_section(smollm2_plan, tmp_path):
    """``run`` decodes with the plan's speculative section (prompt lookup here), as ``serve``
    does: drafts verified and accepted, fewer decode steps than tokens, and the greedy ids of
    the plan without it."""
    spec = tmp_path / "spec.yaml"
    cli(
        "plan.py", "plan", "--model", "smollm2-135m", "--profile", str(DEV_PROFILE),
        "--context", "512", "--speculative", "prompt_lookup", "--num-draft-tokens", "4",
        "-o", str(spec),
    )  # fmt: skip
    prompt = "one two three four five six seven eight. one two three four five six seven eight."
    args = ("--prompt", prompt, "--max-tokens", "16", "--json")
    plain = json.loads(cli("execute.py", "run", str(smollm2_plan), *args).stdout)
    out = json.loads(cli("execute.py", "run", str(spec), *args).stdout)
    assert "speculative" not in plain["stats"]
    s = out["stats"]["speculative"]
    assert s["spec_verification_steps"] > 0 and s["spec_accepted_tokens"] > 0
    assert out["stats"]["decode_steps"] < out["stats"]["decode_tokens"]
    assert out["output_ids"] == plain["output_ids"]


def test_run_streams_text_and_stats(smollm2_plan, tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text(
        json.dumps([{"role": "user", "content": "What is 2+2? Answer with one number."}])
    )
    done = cli("execute.py", "run", str(smollm2_plan), "--messages", str(msgs), "--max-tokens", "8")
    assert "4" in done.stdout
    assert "decode" in done.stderr and "tok/s" in done.stderr


def test_plan_is_byte_identical_and_stale_model_refused(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    a = make_plan_file(str(model), tmp_path / "a.yaml", context=256)
    b = make_plan_file(str(model), tmp_path / "b.yaml", context=256)
    assert a.read_bytes() == b.read_bytes()
    write_tiny_llama(model, seed=1)  # same shapes, other weights: the file changed
    done = cli("execute.py", "run", str(a), "--prompt", "hi", ok=False)
    assert_one_line_error(done, "changed", "re-run strata plan")


def test_a_remeasured_or_removed_profile_invalidates_no_plan(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    prof = tmp_path / "prof.yaml"
    shutil.copy(DEV_PROFILE, prof)
    plan = make_plan_file(str(model), tmp_path / "p.yaml", profile=prof, context=256)
    data = yaml.safe_load(prof.read_text())
    data["nvme"]["queue_depth"] = 7
    prof.write_text(yaml.safe_dump(data))
    cli("execute.py", "run", str(plan), "--prompt", "hi", "--max-tokens", "1")
    prof.unlink()
    cli("execute.py", "run", str(plan), "--prompt", "hi", "--max-tokens", "1")


def test_edited_request_refused(tmp_path):
    """A plan whose request was raised by hand (a context the budgets never sized a KV cache
    for) is refused before anything is allocated, not run out of memory."""
    from strata.common.errors import PlanError
    from strata.executor.plan_loader import load_plan

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    plan = make_plan_file(str(model), tmp_path / "p.yaml", context=256)
    data = yaml.safe_load(plan.read_text())
    data["request"]["context"] = 999999
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError, match="request section .* edited after planning"):
        load_plan(plan)


def test_unknown_architecture(tmp_path):
    # Refused at plan time (issue 35: deepseek2 was planned as if the executor could run it).
    from strata.common.errors import StrataError

    model = write_tiny_llama(tmp_path / "odd.gguf", arch="odd")
    with pytest.raises(StrataError, match="architecture 'odd' is not supported by the executor"):
        make_plan_file(str(model), tmp_path / "p.yaml", context=256)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "missing.gguf", ("no such file",)),
        (
            lambda d: (d / "text.gguf").write_text("not a model at all") and d / "text.gguf",
            ("not a GGUF",),
        ),
        (lambda d: _truncated(d), ("truncated",)),
    ],
    ids=["missing", "not-gguf", "truncated"],
)
def test_describe_bad_files(tmp_path, make, words):
    assert_one_line_error(cli("plan.py", "describe", str(make(tmp_path)), ok=False), *words)


def _truncated(d):
    good = write_tiny_llama(d / "good.gguf").read_bytes()
    (d / "cut.gguf").write_bytes(good[: len(good) - 500])
    return d / "cut.gguf"


def test_unknown_catalog_name():
    assert_one_line_error(
        cli("plan.py", "describe", "smollm3-1b", ok=False),
        "unknown model 'smollm3-1b'",
        "smollm2-135m",
    )


def test_profile_typo(tmp_path):
    data = yaml.safe_load(DEV_PROFILE.read_text())
    data["nvme"]["queue_dept"] = data["nvme"].pop("queue_depth")
    prof = tmp_path / "typo.yaml"
    prof.write_text(yaml.safe_dump(data))
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    done = cli(
        "plan.py",
        "plan",
        "--model",
        str(model),
        "--profile",
        str(prof),
        "-o",
        str(tmp_path / "p.yaml"),
        ok=False,
    )
    assert_one_line_error(done, "nvme.queue_dept", "did you mean 'nvme.queue_depth'")


def test_plan_of_unknown_major_version(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    plan = make_plan_file(str(model), tmp_path / "p.yaml", context=256)
    data = yaml.safe_load(plan.read_text())
    data["format_version"] = "3.0"
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt", "hi", ok=False), "format 3.0", "re-run"
    )
    assert_one_line_error(cli("plan.py", "explain", str(plan), ok=False), "format 3.0")


def test_bad_sizes_and_infeasible(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    base = (
        "plan.py",
        "plan",
        "--model",
        str(model),
        "--profile",
        str(DEV_PROFILE),
        "-o",
        str(tmp_path / "p.yaml"),
    )
    assert_one_line_error(cli(*base, "--gpu-budget", "12 parsecs", ok=False), "cannot read size")
    done = cli(
        *base, "--context", "100000", "--gpu-budget", "1MiB", "--ram-budget", "1MiB", ok=False
    )
    assert_one_line_error(done, "short by")
    assert not (tmp_path / "p.yaml").exists()


def test_prompt_too_long_and_bad_ids(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    plan = make_plan_file(str(model), tmp_path / "p.yaml", context=16)
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt", "x" * 40, ok=False), "context"
    )
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt-ids", "1,x", ok=False), "--prompt-ids"
    )
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt-ids", "99999", ok=False),
        "outside the vocabulary",
    )


def test_seeded_runs_repeat_across_processes(smollm2_plan):
    def run(seed: str) -> list[int]:
        done = cli(
            "execute.py",
            "run",
            str(smollm2_plan),
            "--prompt",
            "Once upon a time",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "--max-tokens",
            "16",
            "--json",
        )
        return json.loads(done.stdout)["output_ids"]

    first = run("11")
    assert run("11") == first
    assert run("12") != first


def test_plan_of_described_model_is_not_executable():
    plan = ROOT / "plans" / "qwen2.5-14b-q4_k_m.m1-max-32gb.yaml"
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt", "hi", ok=False), "can only be compared"
    )


def test_more_bad_inputs(smollm2_plan, tmp_path):
    run = ("execute.py", "run", str(smollm2_plan), "--max-tokens", "1")
    assert_one_line_error(cli(*run, "--prompt", "hi", "--seed", "-1", ok=False), "--seed")
    assert_one_line_error(
        cli(*run, "--prompt", "hi", "--temperature", "nan", ok=False), "--temperature"
    )
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    assert_one_line_error(
        cli("plan.py", "describe", str(model), "-o", str(model), ok=False), "also an input"
    )
    assert_one_line_error(
        cli("plan.py", "describe", str(model), "-o", str(tmp_path), ok=False), "is a folder"
    )
    data = yaml.safe_load(smollm2_plan.read_text())
    data["placement"].append(dict(data["placement"][0], tier="ram"))
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(data, sort_keys=False))
    assert_one_line_error(
        cli("execute.py", "run", str(twice), "--prompt", "hi", ok=False), "placed twice"
    )


def test_inconsistent_gguf_is_refused(tmp_path):
    bad = write_tiny_llama(tmp_path / "bad.gguf", skip=frozenset({"blk.1.ffn_up.weight"}))
    plan = make_plan_file(str(bad), tmp_path / "p.yaml", context=64)
    assert_one_line_error(
        cli("execute.py", "run", str(plan), "--prompt", "hi", ok=False),
        "no tensor blk.1.ffn_up.weight",
    )


def test_tiers_option_keeps_units_off_nvme(smollm2_gguf, tmp_path):
    out = tmp_path / "tight.yaml"
    cli(
        "plan.py",
        "plan",
        "--model",
        str(smollm2_gguf),
        "--profile",
        str(DEV_PROFILE),
        "--context",
        "256",
        "--gpu-budget",
        "20MiB",
        "--tiers",
        "gpu,ram",
        "-o",
        str(out),
    )
    tiers = {p["tier"] for p in yaml.safe_load(out.read_text())["placement"]}
    assert tiers == {"gpu", "ram"}
    done = cli(
        "execute.py",
        "run",
        str(out),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "2",
        "--json",
    )
    assert json.loads(done.stdout)["output_ids"][0] == 7042


def test_misplaced_and_ignored_inputs(smollm2_plan, tmp_path):
    """A plan where a profile belongs (and back), a repeated tier, empty ids, a template without
    --messages, and bench outputs in a folder that cannot exist: one-line errors, before work."""
    from conftest import DEV_PROFILE

    plan_cmd = ("plan.py", "plan", "--model", "smollm2-135m", "-o", str(tmp_path / "p.yaml"))
    err = cli(*plan_cmd, "--profile", str(smollm2_plan), ok=False)
    assert_one_line_error(err, "this is a plan, not a hardware profile")
    err = cli("plan.py", "explain", str(DEV_PROFILE), ok=False)
    assert_one_line_error(err, "this is a hardware profile, not a plan")
    err = cli(*plan_cmd, "--profile", str(DEV_PROFILE), "--tiers", "gpu,gpu", ok=False)
    assert_one_line_error(err, "each tier once")
    run = ("execute.py", "run", str(smollm2_plan), "--max-tokens", "1")
    assert_one_line_error(cli(*run, "--prompt-ids", "1,,2", ok=False), "--prompt-ids")
    err = cli(*run, "--prompt", "hi", "--chat-template", "x.jinja", ok=False)
    assert_one_line_error(err, "--messages only")
    bench = ("execute.py", "bench", str(smollm2_plan), "--max-tokens", "2", "--check", "none")
    assert_one_line_error(cli(*bench, "--plot", str(tmp_path / "x.foo"), ok=False), ".png")
    blocked = tmp_path / "file"
    blocked.write_text("")
    err = cli(*bench, "-o", str(blocked / "sub" / "r.json"), ok=False)
    assert_one_line_error(err, "cannot write")


def test_version():
    """``strata --version`` prints the package's version, as every CLI a user knows does."""
    from strata import __version__

    done = cli("-m", "strata", "--version")
    assert done.stdout.strip() == f"strata {__version__}"
