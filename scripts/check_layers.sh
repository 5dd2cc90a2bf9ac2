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
for d in common planner executor benchmarks; do
  cp -r "$d" "$tmp/strata/$d"
done
find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
cd "$tmp"
PYTHONPATH="$tmp" "$repo/.venv/bin/lint-imports" "$repo/.importlinter" --no-cache "$@"
