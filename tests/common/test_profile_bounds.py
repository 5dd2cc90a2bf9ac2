"""A hardware profile's figures are bounded when it is read (issue 35), as a plan's counts are:
NaN, infinity, a negative number, a zero rate the cost model divides by, or a value far past any
machine (a typo, a unit slip, a hostile file) is one line naming the field, the value and the fix,
before anything is sized from it."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from fixtures.synthetic_desc import make_profile
from strata.common import yamlio
from strata.common.errors import SchemaError
from strata.common.schemas import (
    MAX_BANDWIDTH_BYTES_S,
    MAX_MEMORY_BYTES,
    MAX_QUEUE_DEPTH,
    PROFILE_FIX,
    HardwareProfile,
    Plan,
)

SHIPPED = ROOT / "profiles" / "h200-host.yaml"  # has every optional figure (rows, batch rate)


def _edit(tmp_path, field: str, value: str, source=SHIPPED):
    """The shipped profile with the first ``field:`` block's value (or the field's own value,
    for a plain number) replaced by ``value``, written to a temporary file."""
    text = source.read_text()
    plain = rf"(\n *{field}: )[0-9][^\n]*"
    figure = rf"(\n *{field}:\n +value: )[^\n]+"
    edited, n = re.subn(figure, rf"\g<1>{value}", text, count=1)
    if n == 0:
        edited, n = re.subn(plain, rf"\g<1>{value}", text, count=1)
    assert n == 1, field
    path = tmp_path / "profile.yaml"
    path.write_text(edited)
    return path


def _refused(path, model, *parts: str) -> str:
    with pytest.raises(SchemaError) as e:
        yamlio.read_yaml(path, model)
    msg = str(e.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("working_set_bytes", ".nan", "nan is not a finite number"),
        ("memory_bandwidth_bytes_s", ".inf", "inf is not a finite number"),
        ("capacity_bytes", "-1", "-1 is negative"),
        ("op_overhead_s", "-.inf", "-inf is not a finite number"),
        ("os_reserve_bytes", str(10**400), "1329-bit integer is too large"),
        ("read_bytes_s", "-2.5e+9", "-2.5e+09 is negative"),
    ],
)
def test_non_numbers_and_negatives_are_refused_with_the_field_named(tmp_path, field, value, shown):
    path = _edit(tmp_path, field, value)
    _refused(path, HardwareProfile, "profile.yaml: '", f"{field}.value'", shown, PROFILE_FIX)


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("working_set_bytes", str(2 * MAX_MEMORY_BYTES), "MAX_MEMORY_BYTES"),
        ("capacity_bytes", "1.0e+30", "MAX_MEMORY_BYTES"),
        ("memory_bandwidth_bytes_s", str(10 * MAX_BANDWIDTH_BYTES_S), "MAX_BANDWIDTH_BYTES_S"),
        ("host_to_device_bytes_s", "1.0e+20", "MAX_BANDWIDTH_BYTES_S"),
        ("compute_flops_s", "1.0e+30", "MAX_FLOPS_S"),
        ("decode_batch_flops_s", "1.0e+30", "MAX_FLOPS_S"),
        ("op_overhead_s", "5.9", "MAX_OP_SECONDS"),
        ("dequant_matmul_min_rows", "1000000000", "MAX_ROWS"),
        ("mma_matmul_max_rows", "12.5", "is not a whole number"),
        ("block_bytes", str(1 << 40), "MAX_BLOCK_BYTES"),
        ("block_bytes", "100", "MAX_BLOCK_BYTES"),
        ("queue_depth", str(MAX_QUEUE_DEPTH + 1), "MAX_QUEUE_DEPTH"),
        ("queue_depth", "0", "MAX_QUEUE_DEPTH"),
    ],
)
def test_absurd_values_are_refused_with_the_field_the_value_and_the_fix(
    tmp_path, field, value, shown
):
    path = _edit(tmp_path, field, value)
    msg = _refused(path, HardwareProfile, shown, PROFILE_FIX)
    assert re.search(rf"'[a-z]+\.{field}'", msg) or f"'{field}'" in msg, msg
    number = float(value)
    assert f"{number:g}" in msg or value in msg, msg


@pytest.mark.parametrize(
    "field", ["memory_bandwidth_bytes_s", "decode_matvec_flops_s", "host_to_device_bytes_s"]
)
def test_a_zero_rate_is_refused(tmp_path, field):
    """The cost model divides by every rate: 0 is refused when read, not met as a division."""
    _refused(_edit(tmp_path, field, "0"), HardwareProfile, f"{field}'", "must be above 0")


def test_zero_capacities_and_overhead_stay_allowed():
    """A machine with no device memory or no OS reserve, and a free operation, are real cases
    (the planner's tests use them); only rates must be positive."""
    profile = make_profile(gpu_bytes=0, ram_bytes=0, reserve=0, op_s=0.0)
    assert profile.gpu.working_set_bytes.value == 0


def test_a_bounded_figure_is_refused_in_a_plan_s_machine_section_too(tmp_path):
    """A plan embeds the profile it was made for: the same bound applies when the plan is read."""
    plan = ROOT / "plans" / "smollm2-135m.dev-linux-cpu.yaml"
    path = _edit(tmp_path, "memory_bandwidth_bytes_s", "1.0e+30", source=plan)
    _refused(path, Plan, "machine.gpu.memory_bandwidth_bytes_s'", "MAX_BANDWIDTH_BYTES_S")


def test_the_shipped_profiles_and_the_test_profile_load():
    paths = sorted((ROOT / "profiles").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        assert yamlio.read_yaml(path, HardwareProfile).name == path.stem
    make_profile(gpu_bytes=1 << 30, ram_bytes=1 << 34)


def test_sample_counts_are_bounded():
    from pydantic import ValidationError
    from strata.common.schemas import MAX_SAMPLES, Figure

    with pytest.raises(ValidationError, match="MAX_SAMPLES"):
        Figure(value=1.0, source="measured", how="a test", samples=MAX_SAMPLES + 1)
    with pytest.raises(ValidationError, match="MAX_SAMPLES"):
        Figure(value=1.0, source="measured", how="a test", samples=0)
