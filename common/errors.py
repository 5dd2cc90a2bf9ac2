"""The one exception type the command lines turn into a one-line message (no traceback)."""

from __future__ import annotations

import sys
from collections.abc import Callable


class StrataError(Exception):
    """A user-facing error: the message names the problem and the fix, on one line."""


class GGUFError(StrataError):
    """A GGUF file is missing, malformed, truncated or of an unsupported kind."""


class SchemaError(StrataError):
    """A YAML document (profile, description, plan) does not match its schema."""


class PlanError(StrataError):
    """A plan cannot be made (infeasible request) or cannot be used (stale, wrong version)."""


def run_command(command: Callable[[], None]) -> int:
    """Run a command-line action; a ``StrataError`` becomes one line on stderr and exit status 2.

    Ctrl-C exits with 130 and a closed stdout (``| head``) with 0, neither with a traceback;
    Ctrl-C's one line is ``interrupted``, followed by what the ``KeyboardInterrupt`` says where
    a command raised it with a message (``strata run``: how far it got).
    """
    try:
        command()
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt as e:
        detail = " ".join(str(e).split())
        print(f"interrupted {detail}" if detail else "interrupted", file=sys.stderr)
        return 130
    return 0
