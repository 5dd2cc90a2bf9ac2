"""Planning a hybrid linear-attention model (qwen3next): the KV cache of its attention blocks and
the fixed per-sequence recurrent state of its gated delta-net blocks in memory, named in the plan
and its explanation; ``strata run`` refuses its plans (and the model itself) in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEV_PROFILE, ROOT, make_plan_file
from gguf_qwen3next import write_hybrid_model
from strata.common.describe import describe
from strata.common.schemas import HardwareProfile, Request
from strata.common.yamlio import read_yaml
from strata.planner.archdesc import describe_arch
from strata.planner.costmodel import (
    batch_limits,
    capacity_rows,
    kv_cache_bytes,
    recurrent_state_bytes,
)
from strata.planner.explain import explain
from strata.planner.rescore import description_of, memory_needs

SEQUENCES = 3


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smollm2_gguf) -> tuple[Path, Path]:
    """(the tiny qwen3next GGUF, its plan for 3 sequences of 512 tokens on the dev profile)."""
    folder = tmp_path_factory.mktemp("qwen3next")
    model = write_hybrid_model(folder / "qwen3next.gguf", "qwen3next", smollm2_gguf)
    plan = make_plan_file(str(model), folder / "plan.yaml", context=512, concurrency=SEQUENCES)
    return model, plan


def test_the_plan_holds_the_recurrent_state_beside_the_kv_cache(hybrid):
    from strata.common.schemas import Plan

    model, path = hybrid
    plan = read_yaml(path, Plan)
    desc, _ = describe(str(model))
    gpu = plan.memory["gpu"]
    # 2816 elements per sequence (tests/common/test_qwen3next_describe.py) at float32.
    assert gpu.recurrent_state == SEQUENCES * 2816 * 4
    # The KV cache counts the 2 attention blocks' 128 elements per token only.
    tokens = plan.batch.kv_num_blocks * plan.batch.kv_block_size
    assert gpu.kv_cache == tokens * 128 * 4  # the dev profile computes in float32
    # Rebuilt from the plan alone (check, explain, diff on another machine), the same bytes.
    assert description_of(plan).recurrent_state_elements_per_sequence == 2816
    (row, used), *_ = memory_needs(plan)
    assert used == gpu.weights + gpu.kv_cache + gpu.recurrent_state + gpu.activations
    assert desc.recurrent_state_elements_per_sequence == 2816
    text = explain(plan)
    assert "recurrent state of the 2 gated delta-net blocks" in text
    assert f"for {SEQUENCES} sequences whatever the context" in text


def test_the_anchor_reserves_a_state_per_sequence():
    """Qwen3-Coder-Next: 79 MB of recurrent state per sequence beside 24 KiB of KV cache per
    token (12 attention blocks of 48), both in the device's capacity row."""
    desc = describe_arch(ROOT / "profiles/arch/qwen3-coder-next-80b-a3b.yaml", "Q4_K_M")
    profile = read_yaml(ROOT / "profiles/m3-max-48gb.yaml", HardwareProfile)
    request = Request(context=4096, concurrency=2)
    batch = batch_limits(request)
    state = recurrent_state_bytes(desc, batch)
    assert state == 2 * 19759104 * 4
    fixed = dict(capacity_rows(desc, profile, request)[0].fixed)
    assert fixed["recurrent state"] == state
    assert fixed["KV cache"] == kv_cache_bytes(desc, profile, batch) == 2 * 4096 * 12288 * 2


def test_an_arch_file_needs_every_delta_net_key(tmp_path):
    from strata.common.errors import StrataError

    text = (ROOT / "profiles/arch/qwen3-coder-next-80b-a3b.yaml").read_text()
    path = tmp_path / "no-conv.yaml"
    path.write_text(text.replace("ssm_conv_kernel: 4\n", ""))
    with pytest.raises(StrataError, match="ssm_conv_kernel") as e:
        describe_arch(path, "Q4_K_M")
    assert "\n" not in str(e.value).strip()
    path.write_text(text.replace("name: qwen3next", "name: llama"))
    with pytest.raises(StrataError, match="absent otherwise"):
        describe_arch(path, "Q4_K_M")


def _strata(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "STRATA_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "strata", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _one_line_refusal(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    assert "'qwen3next' cannot be run" in lines[0] and "gated delta-net" in lines[0]
    assert "`strata describe` and `strata plan` work" in lines[0]
    return lines[0]


def test_strata_run_refuses_the_plan_and_the_model(hybrid, tmp_path):
    model, plan = hybrid
    line = _one_line_refusal(_strata("run", str(plan), "--prompt", "hi", cache=tmp_path))
    assert str(plan) in line
    # Given the model itself, refused from its header: nothing is planned or measured.
    done = _strata(
        "run", str(model), "--prompt", "hi", "--profile", str(DEV_PROFILE), cache=tmp_path
    )
    _one_line_refusal(done)
    assert not (tmp_path / "plans").exists() or not any((tmp_path / "plans").iterdir())
