#!/usr/bin/env python3
"""Write a synthetic GGUF of a real model's shape (the same as `strata synth`)."""

import sys

try:
    from strata.cli import synth_main
except ModuleNotFoundError as e:  # a clone whose Python has not installed Strata
    print(
        f"error: {e}; Strata is not installed in this Python ({sys.executable}): run "
        "`bash scripts/setup.sh` and use .venv/bin/python, or `pip install .`",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(synth_main())
