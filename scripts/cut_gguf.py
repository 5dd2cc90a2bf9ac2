#!/usr/bin/env python3
"""Cut a GGUF model to its first K blocks: a draft model for speculative decoding tests.

``scripts/cut_gguf.py MODEL --blocks K -o OUT.gguf`` writes a GGUF that holds blocks ``0..K-1``
of MODEL (a path or a catalog name such as ``smollm2-135m``) and every tensor outside the blocks
(``token_embd``, ``output_norm``, ``output`` when present, ``rope_freqs``, ...), so it has the same
vocabulary, tokenizer and head as MODEL and runs as a shallower model of the same architecture
(the early-exit model of LayerSkip, Elhoushi et al. 2024, without its training).

What is copied:

- tensors: as stored (raw bytes, GGML type and shape unchanged, quantized blocks included),
  in the source's order, through ``gguf.GGUFWriter.add_tensor(raw_dtype=...)``;
- metadata: every key with its value type (so a ``uint32`` stays a ``uint32``, strings and string
  arrays byte-exact, even text that is not valid UTF-8), except ``{arch}.block_count`` = K,
  ``general.name`` suffixed " (first K blocks)", and per-block arrays (an ``{arch}.*`` array with
  one entry per source block, e.g. ``attention.sliding_window_pattern``) cut to their first K
  entries, since llama.cpp and ``planner.describe`` read them per block; ``general.alignment``
  (when present) is also the writer's data alignment.

Run from the project root: ``/work/venv/bin/python scripts/cut_gguf.py smollm2-135m --blocks 4
-o /tmp/smollm2-4.gguf``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.common.catalog import resolve_model  # noqa: E402
from strata.common.errors import StrataError, run_command  # noqa: E402
from strata.common.gguf_file import open_gguf  # noqa: E402

_BLOCK = re.compile(r"blk\.(\d+)\.")
_VT = gguf.GGUFValueType
# Pseudo-fields gguf.GGUFReader adds for the file header (not metadata keys), and the key the
# writer adds itself.
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _field_value(field: gguf.ReaderField) -> tuple[object, _VT, _VT | None]:
    """A reader field as (value, value type, array item type) for ``GGUFWriter.add_key_value``.

    Strings are returned as raw bytes (the writer writes bytes as given), so nothing is re-encoded.

    Raises:
        StrataError: an array of arrays (the gguf reader does not expose their items).
    """
    vtype = _VT(field.types[0])
    if vtype == _VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype != _VT.ARRAY:
        return field.contents(), vtype, None
    sub = _VT(field.types[-1])
    if len(field.types) > 2 or sub == _VT.ARRAY:
        raise StrataError(
            f"metadata {field.name} is an array of arrays, which this tool cannot copy; "
            "cut the model with llama.cpp's tools instead"
        )
    if sub == _VT.STRING:
        return [bytes(field.parts[i]) for i in field.data], vtype, sub
    return field.contents(), vtype, sub


def cut_gguf(model: str | Path, blocks: int, out: str | Path) -> Path:
    """Write the first ``blocks`` blocks of ``model`` (and its non-block tensors) to ``out``.

    Args:
        model: a GGUF path or a catalog name (``planner.catalog``).
        blocks: K, how many leading blocks to keep (1 .. the model's block count).
        out: the GGUF file to write (overwritten).

    Returns:
        ``out`` as a Path.

    Raises:
        StrataError: unknown model, malformed GGUF, K out of range, ``out`` is the model itself,
            or metadata this tool cannot copy.
    """
    src = resolve_model(str(model)).path
    out = Path(out)
    if out.exists() and out.resolve() == Path(src).resolve():
        raise StrataError(f"-o {out} is the model itself; write the cut model to another file")
    g = open_gguf(src)  # bounds-checked header walk before gguf.GGUFReader trusts it
    # A tool, not the run path: gguf's reader (slow for a large vocabulary) copies every field
    # and tensor as the gguf package sees them.
    reader, arch = gguf.GGUFReader(src), g.architecture
    count_key = f"{arch}.block_count"
    total = g.field(count_key)
    if total is None:
        raise StrataError(f"{src} has no {count_key}; it is not a model with blocks to cut")
    total = int(total)
    if not 1 <= blocks <= total:
        raise StrataError(f"--blocks {blocks} is outside 1..{total} ({src.name} has {total})")

    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key in _SKIP:
            continue
        value, vtype, sub = _field_value(field)
        if key == count_key:
            value = blocks
        elif key == "general.name":
            value = value.decode("utf-8", "replace") + f" (first {blocks} blocks)"
        elif key == "general.alignment":
            w.data_alignment = int(value)
        elif vtype == _VT.ARRAY and key.startswith(arch + ".") and len(value) == total:
            value = value[:blocks]  # one entry per block
        if vtype == _VT.ARRAY and not value:
            # GGUFWriter cannot write an empty array; an absent key reads the same in llama.cpp.
            continue
        w.add_key_value(key, value, vtype, sub)
    if "general.name" not in reader.fields:
        w.add_name(f"{Path(src).stem} (first {blocks} blocks)")

    kept = [t for t in reader.tensors if not ((m := _BLOCK.match(t.name)) and int(m[1]) >= blocks)]
    write_tensors(w, kept)
    return out


def write_tensors(w: gguf.GGUFWriter, tensors) -> None:
    """Add ``tensors`` (a ``GGUFReader``'s) to ``w`` as stored, then write and close the file.

    The bytes as stored, rows of whole quant blocks: GGUFWriter turns this byte shape back into
    the element shape (quant_shape_from_byte_shape) and writes the bytes unchanged."""
    for t in tensors:
        data = np.asarray(t.data)
        raw = data.view(np.uint8).reshape(*data.shape[:-1], -1) if data.ndim else data
        w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); exit status 0, or 2 with a one-line error."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF path or catalog name")
    ap.add_argument("--blocks", type=int, required=True, help="leading blocks to keep (K)")
    ap.add_argument("-o", "--output", required=True, help="the GGUF file to write")
    args = ap.parse_args(argv)

    def run() -> None:
        out = cut_gguf(args.model, args.blocks, args.output)
        print(f"wrote {out} ({out.stat().st_size} bytes, {args.blocks} blocks)")

    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
