"""The environment variables (``strata.common.envs``): one table, read in one module, parsed
with errors that name the fix; and the runtime config built from them
(``strata.executor.config``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from strata.common import envs
from strata.common.errors import StrataError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_where_unset_or_empty(monkeypatch):
    monkeypatch.delenv("STRATA_CACHE", raising=False)
    monkeypatch.setenv("STRATA_COMPILED_PASSES", "")
    assert envs.STRATA_CACHE == Path.home() / ".cache" / "strata"
    assert envs.get("STRATA_COMPILED_PASSES") is True


@pytest.mark.parametrize(
    "text, value", [("0", False), ("off", False), ("False", False), ("no", False), ("1", True)]
)
def test_a_boolean_is_read_when_asked(text, value, monkeypatch):
    monkeypatch.setenv("STRATA_COMPILED_PASSES", text)
    assert envs.STRATA_COMPILED_PASSES is value


def test_a_count_is_a_whole_number_of_at_least_one(monkeypatch):
    monkeypatch.delenv("STRATA_DECODE_MICRO_BATCHES", raising=False)
    assert envs.STRATA_DECODE_MICRO_BATCHES is None  # the plan's
    monkeypatch.setenv("STRATA_DECODE_MICRO_BATCHES", " 4 ")
    assert envs.STRATA_DECODE_MICRO_BATCHES == 4
    for text in ("0", "two", "2.5"):
        monkeypatch.setenv("STRATA_DECODE_MICRO_BATCHES", text)
        with pytest.raises(StrataError, match="is not a whole number >= 1; set one or unset it"):
            envs.get("STRATA_DECODE_MICRO_BATCHES")


def test_a_value_that_does_not_parse_names_the_variable_and_the_fix(monkeypatch):
    monkeypatch.setenv("STRATA_COMPILED_PASSES", "maybe")
    with pytest.raises(StrataError, match=r"STRATA_COMPILED_PASSES='maybe' .* 0, false, off"):
        envs.get("STRATA_COMPILED_PASSES")
    with pytest.raises(KeyError):
        envs.get("STRATA_NOT_A_VARIABLE")
    with pytest.raises(AttributeError):
        _ = envs.STRATA_NOT_A_VARIABLE


def test_the_docstring_table_lists_every_variable():
    """The table users read (the module docstring) and the one the code reads agree."""
    documented = set(re.findall(r"^``(STRATA_[A-Z_]+)``", envs.__doc__, re.M))
    assert documented == set(envs.VARIABLES)


def test_the_architecture_docs_list_every_variable():
    """docs/architecture.md's table, which the README points users to, names every variable (a
    new user found three missing)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    assert [n for n in envs.VARIABLES if f"| `{n}` |" not in doc] == []


def test_no_other_module_reads_a_strata_variable():
    """Every ``STRATA_*`` variable is read through ``envs``: no other source file of the
    package reads one from ``os.environ`` or ``os.getenv``."""
    reads = re.compile(r"(environ|getenv)\b[^\n]*STRATA_")
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("common", "planner", "executor", "strata", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "envs.py" and reads.search(p.read_text())
    ]
    assert offenders == []


def test_the_runtime_config_reads_the_environment_when_built(monkeypatch):
    """``RuntimeConfig.build`` takes ``STRATA_COMPILED_PASSES`` as it is then; a misspelled
    setting is refused with the list of settings."""
    from strata.executor.config import RuntimeConfig

    monkeypatch.setenv("STRATA_COMPILED_PASSES", "off")
    config = RuntimeConfig.build()
    assert config.compiled_passes is False
    monkeypatch.setenv("STRATA_COMPILED_PASSES", "on")
    assert config.compiled_passes is False  # built once: frozen
    assert RuntimeConfig.build().compiled_passes is True
    assert RuntimeConfig.build(segment_blocks=2).segment_blocks == 2
    with pytest.raises(StrataError, match="no setting 'segment_block'.*segment_blocks"):
        RuntimeConfig.build(segment_block=2)
    with pytest.raises(AttributeError):
        config.fused_rope = False  # frozen


def test_the_runtime_config_takes_the_plans_kernel_paths_and_refuses_impossible_settings():
    """The plan's measured ranges become the config's; a range no row count falls in is never
    (as the kernel-path choice always read it); a setting below 0 or an upside-down range given
    directly is refused, naming the setting."""
    from strata.common.schemas import Runtime
    from strata.executor.config import RuntimeConfig

    runtime = Runtime(dequant_matmul_min_rows=128, mma_matmul_min_rows=2, mma_matmul_max_rows=32)
    config = RuntimeConfig.build(runtime)
    assert (config.mma_rows, config.dequant_min_rows) == ((2, 32), 128)
    for lo, hi in ((0, 32), (8, 4)):
        runtime = Runtime(mma_matmul_min_rows=lo, mma_matmul_max_rows=hi)
        assert RuntimeConfig.build(runtime).mma_rows == (0, 0)
    with pytest.raises(StrataError, match=r"RuntimeConfig.segment_blocks is -1; give 0 or more"):
        config.replace(segment_blocks=-1)
    with pytest.raises(StrataError, match=r"mma_rows is \(8, 4\).*\(0, 0\) for never"):
        config.replace(mma_rows=(8, 4))
