#!/usr/bin/env python3
"""Strata's executor: run, bench, serve (the same as `strata <command>`)."""

import sys

try:
    from strata.cli import execute_main
except ModuleNotFoundError as e:  # a clone whose Python has not installed Strata
    print(
        f"error: {e}; Strata is not installed in this Python ({sys.executable}): run "
        "`bash scripts/setup.sh` and use .venv/bin/python, or `pip install .`",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(execute_main())
