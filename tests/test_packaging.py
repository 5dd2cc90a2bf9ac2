"""The install: one top-level package, ``strata``, whose subpackages are the repository's
top-level folders (pyproject's package-dir), and a ``strata`` command."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str, dirs: dict[str, str]) -> Path:
    """The folder ``package`` is installed from: its nearest mapped parent's, then the rest."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in dirs:
            return ROOT / dirs[head] / Path(*parts[i:])
    raise AssertionError(f"{package} has no package-dir mapping")


def test_every_package_folder_is_listed():
    """A folder with an ``__init__.py`` under a mapped folder that ``packages`` leaves out would
    be missing from the wheel (an editable install would still find it)."""
    cfg = _setuptools()
    dirs, listed = cfg["package-dir"], set(cfg["packages"])
    found = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed
    assert all(_folder(p, dirs).joinpath("__init__.py").is_file() for p in listed)


@pytest.mark.slow
def test_wheel_holds_one_top_level_package_and_the_command(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("strata-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (entry,) = [n for n in names if n.endswith("entry_points.txt")]
        entry_points = z.read(entry).decode()
    assert {n.split("/")[0] for n in names} == {
        "strata",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    assert "strata/executor/server/app.py" in names and "strata/common/schemas.py" in names
    assert "strata = strata.entry:main" in entry_points


def test_the_command_line_imports_no_mlx():
    """``strata describe|plan|explain|diff`` (and ``plan.py``) run where MLX is absent or slow
    to import: the command layer and the planner's commands import MLX only inside the
    executor's commands. import-linter cannot check this (it counts imports inside functions)."""
    code = "import sys, strata.cli; print(sorted(m for m in sys.modules if m.startswith('mlx')))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
