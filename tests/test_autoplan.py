"""``strata run|serve MODEL`` with no plan given (``strata.autoplan``): the machine's kept profile
(or one measured once), a plan cached by its inputs' digest, one line saying what it decided, and
plan files working as before."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DEV_PROFILE, ROOT
from gguf_factory import write_tiny_llama
from strata.common.catalog import ResolvedModel
from strata.common.errors import StrataError
from strata.common.schemas import HardwareProfile, Plan
from strata.common.yamlio import read_yaml
from test_cli import assert_one_line_error

from strata import autoplan
from strata.cli import _parser

PROMPT = ("--prompt", "The capital of France is", "--max-tokens", "4", "--json")


def strata(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run ``strata`` as a user would (``python -m strata``), in this test's cache."""
    done = subprocess.run(
        [sys.executable, "-m", "strata", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def _kept_profile_file(cache: Path) -> Path:
    """Where this host's kept profile is in ``cache`` (``executor.machine``)."""
    return cache / "machine" / f"{socket.gethostname()}.yaml"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty ``STRATA_CACHE`` but for this machine's kept profile (the dev profile, so no
    test measures the machine unless it means to)."""
    d = tmp_path / "cache"
    kept = _kept_profile_file(d)
    kept.parent.mkdir(parents=True)
    shutil.copyfile(DEV_PROFILE, kept)
    monkeypatch.setenv("STRATA_CACHE", str(d))
    return d


@pytest.fixture
def catalog_cache(cache, smollm2_gguf):
    """``cache`` with the catalog's models where a fetch put them (no download)."""
    (cache / "models").symlink_to(smollm2_gguf.parent, target_is_directory=True)
    return cache


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_llama(tmp_path / "tiny.gguf")  # training context 512


def _plan_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("plan: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def _plans(cache) -> list:
    return sorted((cache / "plans").glob("*.yaml"))


def test_run_a_catalog_model_plans_once_then_reuses_the_plan(catalog_cache):
    first = strata("run", "smollm2-135m", *PROMPT)
    assert json.loads(first.stdout)["text"].startswith(" Paris")
    line = _plan_line(first.stderr)
    assert "(new): context 4096, 1 sequence; gpu " in line and "predicted " in line, line
    assert "solved in" in first.stderr and "profiling" not in first.stderr
    (plan,) = _plans(catalog_cache)
    assert f"plan: {autoplan._shown(plan)} " in line
    assert read_yaml(plan, Plan).model.name == "smollm2-135m"  # found by name wherever it is
    stamp = plan.stat().st_mtime_ns

    second = strata("run", "smollm2-135m", *PROMPT)
    assert json.loads(second.stdout)["output_ids"] == json.loads(first.stdout)["output_ids"]
    assert _plan_line(second.stderr) == line.replace("(new)", "(cached)")
    assert "solved in" not in second.stderr
    assert _plans(catalog_cache) == [plan] and plan.stat().st_mtime_ns == stamp

    # Plan options pass through: another digest, another plan, as asked.
    third = strata("run", "smollm2-135m", "--context", "512", "--gpu-budget", "200MiB", *PROMPT)
    assert "(new): context 512, 1 sequence" in _plan_line(third.stderr)
    (other,) = set(_plans(catalog_cache)) - {plan}
    planned = read_yaml(other, Plan).request
    assert (planned.context, planned.gpu_budget_bytes) == (512, 200 * 2**20)


def test_a_gguf_path_is_planned_within_its_training_context(cache, tiny):
    done = strata("run", str(tiny), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json")
    assert len(json.loads(done.stdout)["output_ids"]) == 2
    assert "(new): context 512, 1 sequence" in _plan_line(done.stderr)  # 4096 capped
    (plan,) = _plans(cache)
    assert read_yaml(plan, Plan).model.path == str(tiny.resolve())


def test_serve_defaults_and_overrides(cache, tiny):
    """``serve MODEL`` plans for 4 sequences; ``--context``/``--concurrency`` override it (the
    plan ``serve`` gets is the one ``prepare`` leaves in ``args.plan``)."""
    p = _parser("strata", "", None)
    args = p.parse_args(["serve", str(tiny)])
    autoplan.prepare(args)
    request = read_yaml(args.plan, Plan).request
    assert (request.context, request.concurrency) == (512, 4)
    args = p.parse_args(["serve", str(tiny), "--context", "64", "--concurrency", "2"])
    autoplan.prepare(args)
    request = read_yaml(args.plan, Plan).request
    assert (request.context, request.concurrency) == (64, 2)
    assert len(_plans(cache)) == 2


def test_only_given_plan_options_are_in_the_namespace():
    p = _parser("strata", "", None)
    args = p.parse_args(["run", "x", "--prompt", "hi"])
    assert autoplan.given_options(args) == {}
    args = p.parse_args(["run", "x", "--prompt", "hi", "--context", "5", "--baseline"])
    assert autoplan.given_options(args) == {"context": 5, "baseline": True}
    planned = p.parse_args(["plan", "--model", "x", "--profile", "p", "-o", "o"])
    assert planned.context == 4096 and planned.concurrency == 1 and planned.baseline is False


def test_every_plan_option_changes_the_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    model = ResolvedModel(tmp_path / "m.gguf", None, 1, "ab" * 32)
    profile = read_yaml(DEV_PROFILE, HardwareProfile)
    base = {**autoplan.planner_cli.PLAN_DEFAULTS, "context": None}
    base.pop("profile")
    digest = autoplan.plan_digest(model, profile, base)
    assert autoplan.plan_digest(model, profile, dict(base)) == digest
    changed = {
        "context": 512,
        "concurrency": 2,
        "objective": "throughput",
        "prompt_tokens": "16,64",
        "output_tokens": 10,
        "gpu_budget": "1GiB",
        "ram_budget": "2GiB",
        "tiers": "gpu,ram",
        "speculative": "prompt_lookup",
        "num_draft_tokens": 4,
        "acceptance_rate": 0.5,
        "baseline": True,
    }
    assert set(changed) | {"routing_profile", "draft_model"} == set(base)
    seen = {digest}
    for key, value in changed.items():
        d = autoplan.plan_digest(model, profile, {**base, key: value})
        assert d not in seen, key
        seen.add(d)
    routing = tmp_path / "routing.json"
    routing.write_text("{}")
    seen.add(autoplan.plan_digest(model, profile, {**base, "routing_profile": str(routing)}))
    routing.write_text('{"a": 1}')  # the file's bytes, not its name
    seen.add(autoplan.plan_digest(model, profile, {**base, "routing_profile": str(routing)}))
    other_model = ResolvedModel(model.path, None, 1, "cd" * 32)
    seen.add(autoplan.plan_digest(other_model, profile, base))
    seen.add(autoplan.plan_digest(model, profile.model_copy(update={"name": "x"}), base))
    moved = ResolvedModel(tmp_path / "copy.gguf", None, 1, model.sha256)  # its own path hint
    seen.add(autoplan.plan_digest(moved, profile, base))
    assert len(seen) == len(changed) + 6
    # A catalog model is found by its name wherever the cache is.
    named = ResolvedModel(model.path, "smollm2-135m", 1, model.sha256)
    elsewhere = ResolvedModel(moved.path, "smollm2-135m", 1, model.sha256)
    assert autoplan.plan_digest(named, profile, base) == autoplan.plan_digest(
        elsewhere, profile, base
    )
    # Sizes in bytes: the same budget spelled two ways is the same plan.
    a = autoplan.plan_digest(model, profile, {**base, "gpu_budget": "1GiB"})
    assert autoplan.plan_digest(model, profile, {**base, "gpu_budget": "1024MiB"}) == a


def test_what_the_positional_is(tmp_path, tiny):
    assert autoplan.is_model("smollm2-135m")
    assert autoplan.is_model(str(tiny))
    renamed = tmp_path / "tiny-model"  # a GGUF by its magic, whatever its name
    shutil.copyfile(tiny, renamed)
    assert autoplan.is_model(str(renamed))
    assert not autoplan.is_model(str(tmp_path / "missing.yaml"))  # the plan reader's error
    text = tmp_path / "plan-without-suffix"
    text.write_text(yaml.safe_dump({"format_version": "2.0"}))
    assert not autoplan.is_model(str(text))
    for missing in ("smollm3-135m", str(tmp_path / "none.gguf"), str(tmp_path)):
        with pytest.raises(StrataError, match="catalog model .*smollm2-135m, gemma3-270m"):
            autoplan.is_model(missing)


def test_bad_uses_are_one_line_errors(cache, tiny):
    plan = ROOT / "plans" / "smollm2-135m.dev-linux-cpu.yaml"
    done = strata("run", str(plan), "--context", "128", "--prompt", "hi", ok=False)
    assert_one_line_error(done, "--context applies when running a model, not a plan file")
    done = strata("serve", str(plan), "--concurrency", "2", "--profile", "p.yaml", ok=False)
    assert_one_line_error(done, "--profile, --concurrency apply", "re-plan with strata plan")
    done = strata("run", "smollm3-135m", "--prompt", "hi", ok=False)
    assert_one_line_error(
        done, "smollm3-135m: no such plan file, catalog model or GGUF", "smollm2-135m"
    )
    done = strata("run", str(tiny), "--model", str(tiny), "--prompt", "hi", ok=False)
    assert_one_line_error(done, "--model PATH goes with a plan file")
    done = strata("run", str(tiny), "--profile", "none.yaml", "--prompt", "hi", ok=False)
    assert_one_line_error(done, "--profile none.yaml: no such file")
    done = strata("run", str(tiny), "--gpu-budget", "lots", "--prompt", "hi", ok=False)
    assert_one_line_error(done, "lots")
    assert not (cache / "plans").exists()


@pytest.mark.slow
def test_without_a_kept_profile_the_machine_is_profiled_once(cache, tiny):
    """The real measurement (``strata profile``'s, ~15 s here), kept for the next run."""
    _kept_profile_file(cache).unlink()
    run = ("run", str(tiny), "--prompt-ids", "1,2,3", "--max-tokens", "1", "--json")
    first = strata(*run)
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("profiling this machine")]
    assert len(lines) == 1 and " done in " in lines[0], first.stderr
    assert "[profile]" not in first.stderr  # its progress lines are kept to that one line
    kept = read_yaml(_kept_profile_file(cache), HardwareProfile)
    assert kept.name == socket.gethostname().split(".")[0].lower()
    second = strata(*run)
    assert "profiling" not in second.stderr and "(cached)" in _plan_line(second.stderr)


def test_plan_from_args_is_what_strata_plan_writes(cache, tiny, tmp_path):
    """``strata plan`` and a model's cached plan come from one code path: the same options
    give the same plan, byte for byte."""
    out = tmp_path / "p.yaml"
    strata(
        "plan", "--model", str(tiny), "--profile", str(_kept_profile_file(cache)),
        "--context", "64", "-o", str(out),
    )  # fmt: skip
    args = _parser("strata", "", None).parse_args(
        ["run", str(tiny), "--context", "64", "--prompt", "x"]
    )
    autoplan.prepare(args)
    assert Path(args.plan).read_text() == out.read_text()
