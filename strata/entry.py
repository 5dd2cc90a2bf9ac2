"""What ``strata``, ``python -m strata``, ``plan.py``, ``execute.py`` and ``synth.py`` run: one
of ``strata.cli``'s entry points, or, in a clone whose Python has not installed Strata, one line
that says how to install it (the subpackages are found only once installed: pyproject's
package-dir)."""

from __future__ import annotations

import sys


def run(main: str) -> int:
    """Run ``strata.cli.<main>`` (``main``, ``plan_main``, ``execute_main``, ``synth_main``); its
    status, 130 on Ctrl-C while the command's modules are still importing (one line, as the
    command itself says it), or 2 when Strata is not installed in this Python."""
    try:
        from strata import cli
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:
        print(
            f"error: {e}; Strata is not installed in this Python ({sys.executable}): run "
            "`bash scripts/setup.sh` and use .venv/bin/python, or `pip install .`",
            file=sys.stderr,
        )
        return 2
    return getattr(cli, main)()


def main() -> int:
    """The ``strata`` console command and ``python -m strata``."""
    return run("main")
