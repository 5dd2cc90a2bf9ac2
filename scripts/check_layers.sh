#!/usr/bin/env bash
# Check the import contracts (.importlinter) with import-linter. The package `strata` is laid out
# from the repository's top-level folders only when installed (pyproject's package-dir), and
# import-linter reads a package from one folder, so this lays the sources out as installed in a
# temporary folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/strata"
cp strata/*.py "$tmp/strata/"
# Every subpackage folder that pyproject maps (strata.X = "folder"), so a new one is checked too.
.venv/bin/python - "$tmp" <<'PY'
import shutil, sys, tomllib
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    if package.count(".") == 1:
        shutil.copytree(folder, f"{sys.argv[1]}/strata/{package.split('.')[1]}")
PY
find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
cd "$tmp"
PYTHONPATH="$tmp" "$repo/.venv/bin/lint-imports" "$repo/.importlinter" --no-cache "$@"
