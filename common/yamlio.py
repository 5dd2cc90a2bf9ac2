"""Reading and writing the YAML documents so that they diff cleanly and fail clearly.

Writing: keys in schema order, integers as integers, floats rounded to 6 significant digits,
block style (a list of flat mappings one mapping per line), a trailing newline; the same
document always gives the same bytes.
Reading: a file that is missing, not YAML, or does not match its schema raises ``SchemaError``
with one line naming the file, the key path and the fix.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from strata.common.errors import SchemaError

M = TypeVar("M", bound=BaseModel)


def _round(obj: object) -> object:
    if isinstance(obj, float):
        if not obj.is_integer():
            obj = float(f"{obj:.6g}")
        # Whole numbers (byte counts, rounded bandwidths) are written as exact integers.
        return int(obj) if obj.is_integer() and abs(obj) < 2**53 else obj
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v) for v in obj]
    return obj


class _Dumper(yaml.SafeDumper):
    """SafeDumper that indents lists under their key (easier to read in diffs)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


class _Row(dict):
    """A mapping of scalars written on one line (a placement entry, a unit's costs)."""


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def _list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    # Short lists of numbers (shapes) read best on one line; lists of flat mappings (placement,
    # unit costs) one mapping per line, so that moving a unit is a one-line diff; everything else
    # in block style.
    flow = bool(data) and all(isinstance(v, int | float) for v in data)
    if data and all(isinstance(v, dict) and all(map(_scalar, v.values())) for v in data):
        data = [_Row(v) for v in data]
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _row(dumper: yaml.SafeDumper, data: _Row) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)
_Dumper.add_representer(_Row, _row)


def to_yaml(doc: BaseModel) -> str:
    """Serialize a schema document to YAML text (stable bytes for equal documents)."""
    data = _round(doc.model_dump(mode="json"))
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=160, allow_unicode=True)


GZIP_SUFFIX = ".gz"
"""A document path ending so is written gzip-compressed (and any gzip file is read as one): the
plan of a model with tens of thousands of experts is megabytes of one line per unit, which
compress about tenfold."""


def write_yaml(doc: BaseModel, path: str | Path) -> None:
    """Write ``doc`` to ``path`` (parent folders created), whole or not at all: a reader never
    sees half a file, and Ctrl-C leaves the old one (``atomic.replaced``). A path ending in
    ``GZIP_SUFFIX`` gets the YAML gzip-compressed, with no timestamp (equal documents, equal
    bytes)."""
    from strata.common.atomic import replaced

    text = to_yaml(doc)
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.name.endswith(GZIP_SUFFIX):
            with replaced(p, "wb") as f:
                f.write(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        else:
            with replaced(p, "w") as f:
                f.write(text)
    except OSError as e:
        raise SchemaError(f"cannot write {p}: {e.strerror or e}; choose another -o path") from None


def canonical_sha256(doc: BaseModel) -> str:
    """sha256 of a document's canonical JSON form: formatting and comments do not change it."""
    return sha256_of(doc.model_dump(mode="json"))


def sha256_of(data: object) -> str:
    """sha256 of JSON-able data in canonical form (sorted keys, floats as ``to_yaml`` writes
    them), so that a value read back from YAML hashes as the one written."""
    return hashlib.sha256(json.dumps(_round(data), sort_keys=True).encode()).hexdigest()


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


_KIND_KEYS = {
    "Plan": {"placement", "batch"},
    "HardwareProfile": {"gpu", "nvme", "os_reserve_bytes"},
    "ModelDescription": {"tensors", "units", "architecture"},
}
"""Top-level keys that only a document of that kind has: a misplaced file is named as what it is."""
_KIND_WORDS = {
    "Plan": "plan",
    "HardwareProfile": "hardware profile",
    "ModelDescription": "model description",
}


def _document_kind(data: dict) -> str | None:
    """The kind of document ``data`` clearly is (all of a kind's keys present), or None."""
    kinds = [k for k, keys in _KIND_KEYS.items() if keys <= data.keys()]
    return kinds[0] if len(kinds) == 1 else None


def parse_doc(data: object, model: type[M], origin: str) -> M:
    """Validate already-parsed YAML data against ``model``; errors name ``origin`` and the key."""
    if not isinstance(data, dict):
        raise SchemaError(f"{origin}: expected a YAML mapping of {model.__name__} fields")
    kind = _document_kind(data)
    if kind is not None and kind != model.__name__:
        want = _KIND_WORDS.get(model.__name__, model.__name__)
        raise SchemaError(
            f"{origin}: this is a {_KIND_WORDS[kind]}, not a {want}; check the argument order"
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # A misspelt key shows up as one unknown key and one missing key: report the unknown one
        # first, with the missing key it most likely meant.
        errors.sort(key=lambda err: err["type"] != "extra_forbidden")
        err = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        if err["type"] == "extra_forbidden":
            missing = [_where(x["loc"]) for x in errors if x["type"] == "missing"]
            guess = difflib.get_close_matches(_where(err["loc"]), missing, n=1)
            hint = (
                f"did you mean '{guess[0]}'?" if guess else "check its spelling against the schema"
            )
            msg = f"unknown key '{_where(err['loc'])}' — {hint}"
            more = f" (and {len(errors) - 2} more)" if guess and len(errors) > 2 else more
            more = "" if guess and len(errors) == 2 else more
        elif err["type"] == "missing":
            msg = f"missing key '{_where(err['loc'])}'"
        else:
            text = err["msg"].removeprefix("Value error, ")  # our validators' own sentences
            msg = f"'{_where(err['loc'])}': {text}" if err["loc"] else text
        raise SchemaError(f"{origin}: {msg}{more}") from None


MAX_DOCUMENT_BYTES = 32 << 20
"""Largest YAML document read: a plan of a model with tens of thousands of placement units and
its embedded profile and costs is a few MiB; the pure-Python loader reads about 0.4 MB/s, so
this also bounds the work (about a minute)."""

MAX_DEPTH = 32
"""Deepest nesting of a YAML document read: Strata's schemas nest a handful of levels; without a
bound, a file nested thousands deep exhausts Python's recursion (a ``RecursionError``)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds: no aliases (a few KB of ``&a [*b, *b, ...]`` expand to
    billions of values; Strata writes none) and at most ``MAX_DEPTH`` levels of nesting."""

    def __init__(self, text: str):
        super().__init__(text)
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"YAML aliases (*{event.anchor}) are not allowed", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(
                    f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data_bounded(self, origin: Path):
        """``get_single_data``, the bounds' refusal as a ``SchemaError`` naming the line."""
        try:
            return self.get_single_data()
        except _Refused as e:
            raise SchemaError(f"{origin}: {e.args[0]} (line {e.mark.line + 1})") from None
        finally:
            self.dispose()


# YAML 1.1 (PyYAML) reads 1e9 and 2.5e-5 without a dot or exponent sign as strings; YAML 1.2
# and every other reader take them as numbers, and people write figures that way.
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class _Refused(Exception):
    def __init__(self, what: str, mark):  # noqa: ANN001 - a yaml Mark
        super().__init__(what)
        self.mark = mark


def document_text(path: Path) -> str:
    """The text of a YAML document file, gunzipped where it is gzip-compressed, at most
    ``MAX_DOCUMENT_BYTES`` (a compressed file is cut off there, never inflated whole).

    Raises:
        SchemaError: too large, a damaged gzip stream, or unreadable.
        UnicodeDecodeError: not UTF-8 text.
    """
    too_big = SchemaError(
        f"{path}: over the {MAX_DOCUMENT_BYTES >> 20} MiB a plan, profile or description may "
        "have; not a Strata document"
    )
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
            if data[:2] == b"\x1f\x8b":  # gzip's magic
                f.seek(0)
                with gzip.open(f) as g:
                    data = g.read(MAX_DOCUMENT_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise SchemaError(f"{path}: cannot be read ({e}); not a Strata document") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise too_big
    return data.decode()


def read_yaml(path: str | Path, model: type[M]) -> M:
    """Read and validate a YAML document.

    Raises:
        SchemaError: missing file, invalid YAML, or a schema mismatch (one line, with the fix).
    """
    p = Path(path)
    if p.is_dir():
        raise SchemaError(f"{p}: is a folder; give the YAML file in it")
    if not p.is_file():
        raise SchemaError(f"{p}: no such file")
    try:
        data = _BoundedLoader(document_text(p)).get_single_data_bounded(p)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SchemaError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError:
        raise SchemaError(f"{p}: not a text file") from None
    return parse_doc(data, model, str(p))
