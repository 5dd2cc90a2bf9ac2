"""Plans that travel: a plan runs from any folder, survives a re-measured profile, is refused
(one line) where the machine is too small or the model's bytes changed, and ``strata check``
says why (``strata.check``, ``executor.plan_loader``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml
from conftest import make_plan_file
from gguf_factory import write_tiny_llama
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml
from strata.executor.machine import MachineNow
from test_cli import assert_one_line_error, cli

from strata.check import needs, verdict

GIB = 2**30


@pytest.fixture
def tiny_plan(tmp_path):
    """A tiny llama GGUF and its plan, in a folder of their own."""
    home = tmp_path / "made"
    home.mkdir()
    model = write_tiny_llama(home / "tiny.gguf")
    return model, make_plan_file(str(model), home / "tiny.yaml", context=64)


def _run(plan, *extra, ok=True):
    return cli("execute.py", "run", str(plan), "--prompt-ids", "1,2,3", "--max-tokens", "2",
               "--json", *extra, ok=ok)  # fmt: skip


def test_a_copied_plan_runs_from_another_folder(tiny_plan, tmp_path):
    model, plan = tiny_plan
    first = json.loads(_run(plan).stdout)["output_ids"]
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    copy = shutil.copy(plan, elsewhere / "copy.yaml")
    assert json.loads(_run(copy).stdout)["output_ids"] == first
    # A re-measured profile changes nothing: the plan carries its own figures.
    doc = read_yaml(copy, Plan)
    assert doc.machine.name == "dev-linux-cpu" and doc.model.path == str(model.resolve())


def test_a_moved_model_is_found_by_sha256_or_given(tmp_path):
    # Weights no other test (or earlier run of this one) wrote: no other file this machine
    # hashed has their sha256.
    model = write_tiny_llama(tmp_path / "unique.gguf", seed=int.from_bytes(os.urandom(4)) >> 1)
    plan = make_plan_file(str(model), tmp_path / "unique.yaml", context=64)
    _run(plan)  # hashed at its place: remembered by the cache
    moved = tmp_path / "moved.gguf"
    shutil.copy(model, moved)
    cli("plan.py", "check", str(plan), "--model", str(moved))  # hashes the copy too
    model.unlink()
    # The path hint is gone; the copy is known by its sha256.
    assert '"output_ids"' in _run(plan).stdout
    moved.unlink()
    assert_one_line_error(_run(plan, ok=False), "not on this machine", "--model PATH")


def test_changed_model_bytes_are_refused(tiny_plan, tmp_path):
    model, plan = tiny_plan
    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    assert_one_line_error(_run(plan, "--model", str(other), ok=False), "sha256", "bytes changed")
    done = cli("plan.py", "check", str(plan), "--model", str(other), ok=False)
    assert done.returncode == 2 and "does NOT hold" in done.stdout and "sha256" in done.stdout


def test_a_plan_for_another_machine_is_refused(tiny_plan, tmp_path):
    _, plan = tiny_plan
    data = yaml.safe_load(plan.read_text())
    data["machine"]["backend"] = "cuda"
    data["machine"]["unified_memory"] = False
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text(yaml.safe_dump(data, sort_keys=False))
    assert_one_line_error(_run(cuda, ok=False), "cuda backend", "this machine runs cpu")


def test_check_names_the_short_tier_and_bytes(tiny_plan):
    _, plan = tiny_plan
    doc = read_yaml(plan, Plan)
    roomy = MachineNow("cpu", 64 * GIB, 64 * GIB, True)
    v = verdict(doc, roomy, None)
    assert v.holds and any("bandwidths: not compared" in c for c in v.checked)
    small = MachineNow("cpu", 1 << 16, 64 * GIB, True)
    v = verdict(doc, small, None)
    assert not v.holds
    assert len(v.refusals) == 1 and v.refusals[0].startswith("gpu tier: the plan needs ")
    assert "this machine has 64.00 KiB" in v.refusals[0] and " short)" in v.refusals[0]


def test_check_warns_when_this_machines_figures_change_the_prediction(tiny_plan):
    _, plan = tiny_plan
    doc = read_yaml(plan, Plan)
    here = MachineNow("cpu", 64 * GIB, 64 * GIB, True)
    same = verdict(doc, here, doc.machine)
    assert same.holds and not same.warnings
    slow = doc.machine.model_copy(deep=True)
    slow.name = "slower"
    for fig in (slow.gpu.decode_matvec_flops_s, slow.gpu.memory_bandwidth_bytes_s,
                slow.gpu.compute_flops_s, slow.gpu.decode_batch_flops_s):  # fmt: skip
        if fig is not None:
            fig.value /= 3
    slow.gpu.op_overhead_s.value *= 3
    v = verdict(doc, here, slow)
    assert v.holds  # measurements never refuse
    assert len(v.warnings) >= 1 and "with this machine's figures (slower)" in v.warnings[0]


def test_older_plan_formats_say_how_to_remake_them(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("format_version: '1.4'\nfingerprints: {}\nplacement: []\n")
    assert_one_line_error(
        cli("plan.py", "explain", str(old), ok=False), "format 1.4", "re-run strata plan"
    )


def test_an_edited_costs_section_is_refused_and_marked(tiny_plan, tmp_path):
    _, plan = tiny_plan
    data = yaml.safe_load(plan.read_text())
    unit = data["costs"]["units"][1]
    where = next(p for p in data["placement"] if p["unit"] == unit["name"])
    unit["bytes"] = where["bytes"] = 10**12  # a unit's size is in both sections
    edited = tmp_path / "costs.yaml"
    edited.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "Edited by hand" in cli("plan.py", "explain", str(edited)).stdout
    assert_one_line_error(_run(edited, ok=False), "does not hold")  # 931 GiB on the device
    unit["bytes"] = where["bytes"] = 1000
    edited.write_text(yaml.safe_dump(data, sort_keys=False))
    assert_one_line_error(_run(edited, ok=False), "costs of unit", "re-run strata plan")
    where["bytes"] = 7  # placement and costs disagree: every view refuses it
    edited.write_text(yaml.safe_dump(data, sort_keys=False))
    done = cli("plan.py", "explain", str(edited), ok=False)
    assert_one_line_error(done, "its size, not a decision")


def test_memory_short_within_noise_warns_instead_of_refusing(tiny_plan):
    _, plan = tiny_plan
    doc = read_yaml(plan, Plan)
    doc.machine.backend, doc.machine.unified_memory = "cuda", False
    gpu_need = dict((label, need) for label, need, _ in needs(doc))["gpu tier"]
    # A CUDA device's working set is its free memory now: 1% short is a warning.
    v = verdict(doc, MachineNow("cuda", int(gpu_need * 0.99), 64 * GIB, False), None)
    assert v.holds and any("within the noise" in w for w in v.warnings)
    v = verdict(doc, MachineNow("cuda", int(gpu_need * 0.9), 64 * GIB, False), None)
    assert not v.holds
    # Elsewhere capacities come from total RAM, which does not move: short is short.
    cpu = read_yaml(plan, Plan)
    need = dict((label, need) for label, need, _ in needs(cpu))["gpu tier"]
    assert not verdict(cpu, MachineNow("cpu", int(need * 0.99), 64 * GIB, True), None).holds
