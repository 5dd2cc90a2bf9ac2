#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install Strata with its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "error: Strata needs Python 3.11 or newer (found $("$PY" --version 2>&1)); set PYTHON=..." >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
