"""Byte sizes as people write them: ``512MiB``, ``8GiB`` (2^30), ``8GB`` (10^9) or plain bytes."""

from __future__ import annotations

import re

from strata.common.errors import StrataError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size into bytes.

    Args:
        text: ``"512MiB"``, ``"8GiB"`` (binary, 2^30), ``"8GB"`` (decimal, 10^9), ``"1.5GiB"``,
            ``"1048576"`` or an int.

    Returns:
        The size in bytes (int, rounded down).

    Raises:
        StrataError: the text is not a size or names an unknown unit.
    """
    if isinstance(text, int):
        if text < 0:
            raise StrataError(f"size {text} is negative; give bytes >= 0")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise StrataError(
            f"cannot read size {text!r}: write e.g. 512MiB, 8GiB (2^30), 8GB (10^9) or plain bytes"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """Format bytes for people: ``1.50 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
