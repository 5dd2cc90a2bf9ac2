"""Helpers shared by the command lines: where a document goes, and refusing an ``-o`` that would
overwrite an input."""

from __future__ import annotations

import sys
from pathlib import Path

from strata.common.errors import StrataError
from strata.common.yamlio import to_yaml, write_yaml


def emit(doc, output: str | None) -> None:
    """Write ``doc`` as YAML to ``output`` (saying so on stderr), or to stdout when None."""
    if output:
        write_yaml(doc, output)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(to_yaml(doc))


def check_output(output: str | None, *inputs: str | None) -> None:
    """Refuse an ``-o`` path that is a folder or an input of the command (it would be overwritten).

    Raises:
        StrataError: names the option and the fix.
    """
    if not output:
        return
    out = Path(output)
    if out.is_dir():
        raise StrataError(f"-o {output} is a folder; give a file path")
    for src in inputs:
        if src and Path(src).exists() and out.exists() and out.samefile(src):
            raise StrataError(f"-o {output} is also an input; write to another file")
