"""Opening GGUF files safely: every length, count, shape and offset is bounded before use.

GGUF headers come from untrusted files, and the ``gguf`` package trusts them (it has been seen to
hang on a tiny hostile header). So ``open_gguf`` walks the header itself with bounds checks —
string and array lengths against the bytes left, tensor shapes against overflow, tensor data against
the file size — and keeps what it read: the metadata values (``GGUFFile.field``), arrays as the
file's bytes until asked for, and the tensor table (``GGUFFile.tensor_infos``). Tensor data is read
through one read-only memory map of the file (``GGUFFile.tensor_bytes``). ``gguf.GGUFReader`` is not
used: it builds numpy views of every vocabulary entry (over a million Python objects for a
262,144-token vocabulary). The format is GGUF v2/v3 as specified in ggml's docs/gguf.md.

Split models: llama.cpp's ``gguf-split`` writes a big model as shards ``NAME-00001-of-0000N.gguf``
(``llama_split_path``), each a whole GGUF file with the keys ``split.no`` (0-based),
``split.count`` and ``split.tensors.count`` (tensors of the whole set); the first shard holds the
model's metadata. ``open_gguf`` given any shard opens the set as one ``GGUFFile``: the first
shard's metadata, the tensor table of every shard (``GGUFFile.file_of`` says whose file holds
the data) and an identity of the set; shards missing, of another set or out of order are refused
before any tensor is read.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from strata.common.errors import GGUFError
from strata.common.gguf_values import read_int, shown

# Size in bytes of each fixed-size GGUF metadata value type (gguf.md: GGUFValueType).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# struct / numpy codes of the fixed-size value types (the numpy dtype is the byte order + code).
_CODE = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32  # gguf.md: general.alignment defaults to 32
MAX_TENSORS = 65536
"""Tensors in one file: released models have at most a few thousand (one per weight, experts
stacked); each becomes a description entry, so this bounds the work a tiny file can cause."""
MAX_ALIGNMENT = 2**16
"""``general.alignment``, bytes: files use 32 (the default) or a page (4 KiB to 64 KiB)."""
_VT = gguf.GGUFValueType
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""A shard's file name as llama.cpp's gguf-split writes it (``llama_split_path``:
"%s-%05d-of-%05d.gguf", shards numbered from 1; ``split.count`` is a u16, so five digits)."""
_SPLIT_NO = gguf.Keys.Split.LLM_KV_SPLIT_NO
_SPLIT_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_COUNT
_SPLIT_TENSORS = gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT


class TensorInfo(NamedTuple):
    """One entry of the GGUF tensor table, as the header walk read it.

    Attributes:
        name: tensor name.
        tensor_type: GGML type of its data.
        shape: dimensions in file order (``ne[0]``, the row length, first).
        data_offset: absolute byte offset of its data in its file (a split model's shard:
            ``GGUFFile.file_of``).
        n_bytes: size of its data in bytes.
    """

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int


class _Meta(NamedTuple):
    """One metadata value as walked: its GGUF types (as ``gguf.ReaderField.types``: the value
    type, then the element type for a non-empty array) and its raw form — a Python value for a
    scalar, the bytes of a string, (numpy dtype, bytes) for an array of fixed-size values, a list
    of bytes for an array of strings. Strings are decoded when asked for."""

    types: tuple[gguf.GGUFValueType, ...]
    raw: Any


@dataclass
class GGUFFile:
    """A validated GGUF file, or a split model's set of shards read as one.

    Attributes:
        path: the file (a split model's first shard).
        size_bytes: file size (a split model's: all its shards').
        data_offset: absolute offset where tensor data starts (in ``path``).
        header_sha256: sha256 of bytes [0, data_offset): metadata and tensor table; a split
            model's is the sha256 of its shards' header sha256s (hex, in shard order).
        tensor_infos: the tensor table, in file order (a split model's: shard by shard).
        shards: a split model's shards, each opened as a file of its own, in order; empty for
            a single file.
        shard_of: a split model's tensors by name: the index in ``shards`` of the one that
            holds each; empty for a single file.
    """

    path: Path
    size_bytes: int
    data_offset: int
    header_sha256: str
    tensor_infos: list[TensorInfo]
    _meta: dict[str, _Meta] = dataclass_field(repr=False)
    _decoded: dict[str, Any] = dataclass_field(default_factory=dict, repr=False)
    _map: mmap.mmap | None = dataclass_field(default=None, repr=False, compare=False)
    _map_lock: threading.Lock = dataclass_field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    shards: list[GGUFFile] = dataclass_field(default_factory=list, repr=False)
    shard_of: dict[str, int] = dataclass_field(default_factory=dict, repr=False)

    @property
    def paths(self) -> list[Path]:
        """The model's files: the file, or a split model's shards in order."""
        return [s.path for s in self.shards] or [self.path]

    def _holder(self, t: TensorInfo) -> GGUFFile:
        """The opened file that holds ``t``'s data (its shard in a split model)."""
        return self.shards[self.shard_of[t.name]] if self.shards else self

    def file_of(self, t: TensorInfo) -> Path:
        """The file that holds ``t``'s data (its shard in a split model)."""
        return self._holder(t).path

    def _mapped(self) -> mmap.mmap:
        """The file's read-only memory map, made on first use (one per ``GGUFFile``, kept while
        the object lives: the tensors' views point into it), of the file as it was opened: its
        size and header bytes (``header_sha256``) are checked, so that a file replaced or
        rewritten since is never read with the old tensor table.

        Raises:
            GGUFError: the file is gone, or its size or header is not the one opened (it was
                rewritten since: open it again).
        """
        with self._map_lock:  # one map per file object, even when threads ask at once
            if self._map is None:
                try:
                    with open(self.path, "rb") as f:
                        same = os.fstat(f.fileno()).st_size == self.size_bytes
                        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if same else None
                except OSError as e:
                    raise GGUFError(f"{self.path}: cannot read it ({e.strerror})") from None
                if mapped is not None:
                    header = hashlib.sha256(mapped[: self.data_offset]).hexdigest()
                    if header != self.header_sha256:
                        mapped.close()
                        mapped = None
                if mapped is None:
                    raise GGUFError(
                        f"{self.path}: the file changed since it was opened (another size or "
                        "header); open it again"
                    )
                self._map = mapped
        return self._map

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars as Python values, strings decoded, arrays as lists), as
        ``gguf.ReaderField.contents()`` gives it; ``default`` when the key is absent.

        Raises:
            GGUFError: the value is text that is not valid UTF-8.
        """
        m = self._meta.get(key)
        if m is None:
            return default
        t = m.types
        if t[0] == _VT.STRING:
            return self._text(key, m.raw)
        if t[0] != _VT.ARRAY:
            return m.raw
        if len(t) == 1:  # empty array
            return []
        if t[1] == _VT.STRING:
            texts = self._decoded.get(key)
            if texts is None:
                texts = self._decoded[key] = [self._text(key, b) for b in m.raw]
            return list(texts)  # a fresh list each call, as contents() gives
        dtype, data = m.raw
        return np.frombuffer(data, dtype).tolist()

    def field_types(self, key: str) -> tuple[gguf.GGUFValueType, ...] | None:
        """The GGUF types of a metadata value, as ``gguf.ReaderField.types``: (value type,) or
        (ARRAY, element type) for a non-empty array; None when the key is absent."""
        m = self._meta.get(key)
        return None if m is None else m.types

    def field_count(self, key: str) -> int | None:
        """The number of elements of an array value (1 for a scalar or string, as the length of
        ``gguf.ReaderField.data``), without decoding it; None when the key is absent."""
        m = self._meta.get(key)
        if m is None:
            return None
        if m.types[0] != _VT.ARRAY:
            return 1
        if len(m.types) == 1:
            return 0
        if m.types[1] == _VT.STRING:
            return len(m.raw)
        dtype, data = m.raw
        return len(data) // np.dtype(dtype).itemsize

    def string_bytes(self, key: str) -> list[bytes] | None:
        """An array of strings as the file's bytes, not decoded (a vocabulary may hold tokens
        that are not UTF-8 on their own); None when the key is absent or not such an array."""
        m = self._meta.get(key)
        if m is None or m.types != (_VT.ARRAY, _VT.STRING):
            return None
        return list(m.raw)

    def keys(self) -> list[str]:
        """The metadata keys in file order (after gguf's ``GGUF.version``, ``GGUF.tensor_count``
        and ``GGUF.kv_count``, as ``gguf.GGUFReader.fields``)."""
        return list(self._meta)

    def _text(self, key: str, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: metadata {key} is not valid UTF-8 text") from None

    @property
    def architecture(self) -> str:
        """``general.architecture``."""
        arch = self.field("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(
                f"{self.path}: no general.architecture in the metadata; not a model GGUF"
            )
        return arch

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 view into the memory map of the file
        that holds it (no copy)."""
        return np.frombuffer(self._holder(t)._mapped(), np.uint8, t.n_bytes, t.data_offset)

    def drop_pages(self, t: TensorInfo) -> None:
        """Unmap the tensor's file pages from this process once its bytes were copied elsewhere.

        The pages stay in the OS page cache, but no longer count in the process's resident set:
        without this, loading a model holds its whole file mapped on top of the loaded copy
        (seen: 1.75 GiB peak RSS for a 0.68 GiB file). Linux/macOS ``madvise(MADV_DONTNEED)``
        on a read-only file mapping; a no-op where the platform lacks it.
        """
        mapped = self._holder(t)._map
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = t.data_offset // page * page
        end = t.data_offset + t.n_bytes
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass  # only a memory-saving hint


class _Walker:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path, endian: str):
        self.buf, self.size, self.path, self.pos, self.e = buf, size, path, 0, endian
        self.u64 = struct.Struct(endian + "Q").unpack_from

    def fail(self, what: str) -> GGUFError:
        return GGUFError(
            f"{self.path}: malformed or truncated GGUF: {what} at byte {self.pos} "
            f"(file is {self.size} bytes); re-download or re-convert the file"
        )

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes past the end of the file")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(self.e + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", f"length of {what}")
        self.need(n, what)
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return s

    def text(self, what: str) -> str:
        """A string that must be UTF-8 without control characters (keys and tensor names: gguf
        cannot read others, and a name is printed in messages)."""
        start = self.pos
        raw = self.string(what)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            self.pos = start
            raise self.fail(f"{what} is not valid UTF-8 text") from None
        if not text.isprintable():
            self.pos = start
            raise self.fail(f"{what} {shown(text)} holds control characters")
        return text

    def strings(self, count: int, what: str) -> list[bytes]:
        """``count`` length-prefixed strings, each bounded by the bytes left."""
        # Each string takes at least its 8-byte length: bound the count before looping.
        self.need(count * 8, what)
        buf, size, u64, pos = self.buf, self.size, self.u64, self.pos
        out: list[bytes] = []
        append = out.append
        for _ in range(count):
            start = pos + 8
            if start > size:
                self.pos = pos
                self.need(8, f"length of {what}")
            pos = start + u64(buf, pos)[0]
            if pos > size:
                self.pos = start
                self.need(pos - start, what)
            append(buf[start:pos])
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> _Meta:
        """Read one metadata value (see ``_Meta``)."""
        if vtype in _FIXED:
            return _Meta((_VT(vtype),), self.unpack(_CODE[vtype], what))
        if vtype == _STRING:
            return _Meta((_VT.STRING,), self.string(what))
        if vtype == _ARRAY:
            etype = self.unpack("I", f"element type of {what}")
            count = self.unpack("Q", f"length of {what}")
            if etype in _FIXED:
                n = count * _FIXED[etype]
                self.need(n, what)
                raw = (self.e + _CODE[etype], self.buf[self.pos : self.pos + n])
                self.pos += n
            elif etype == _STRING:
                raw = self.strings(count, what)
            else:
                raise self.fail(f"unsupported array element type {etype} in {what}")
            # gguf.ReaderField.types names the element type only when there is an element.
            return _Meta((_VT.ARRAY, _VT(etype)) if count else (_VT.ARRAY,), raw)
        raise self.fail(f"unknown metadata value type {vtype} in {what}")


class _Header(NamedTuple):
    """What ``_walk_header`` read: where tensor data starts, the metadata by key (in file order,
    after gguf's three ``GGUF.*`` entries) and the tensor table (in file order)."""

    data_offset: int
    meta: dict[str, _Meta]
    tensors: list[TensorInfo]


def _walk_header(path: Path, size: int) -> _Header:
    """Validate the header and read its metadata and tensor table.

    Everything the format forbids is refused here, as a one-line ``GGUFError``, before any
    tensor data is read.
    """
    with open(path, "rb") as f:
        if size < 24:
            raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic at the start)")
        if struct.unpack_from("<I", buf, 4)[0] >= 65536:
            # The version is 2 or 3: read little-endian, a big-endian file's is 2^25 or more.
            raise GGUFError(
                f"{path}: big-endian GGUF files are not supported; convert the model again "
                "without --bigendian (llama.cpp's convert_hf_to_gguf.py writes little-endian)"
            )
        w = _Walker(buf, size, path, "<")
        w.pos = 4
        version = w.unpack("I", "version")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = w.unpack("Q", "tensor count")
        n_kv = w.unpack("Q", "metadata count")
        meta: dict[str, _Meta] = {
            "GGUF.version": _Meta((_VT.UINT32,), version),
            "GGUF.tensor_count": _Meta((_VT.UINT64,), n_tensors),
            "GGUF.kv_count": _Meta((_VT.UINT64,), n_kv),
        }
        # Each key-value pair takes >= 12 bytes and each tensor info >= 24: bound counts first.
        w.need(n_kv * 12 + n_tensors * 24, "metadata and tensor table")
        if n_tensors > MAX_TENSORS:
            raise w.fail(f"{n_tensors} tensors (at most {MAX_TENSORS} in a model file)")
        alignment = _DEFAULT_ALIGNMENT
        for i in range(n_kv):
            start = w.pos
            key = w.text(f"key of metadata entry {i}")
            if key in meta:
                w.pos = start
                raise w.fail(f"metadata key {shown(key, 64)} appears twice")
            vtype = w.unpack("I", f"type of {shown(key, 64)}")
            m = meta[key] = w.value(vtype, f"value of {shown(key, 64)}")
            if key == "general.alignment":
                v = m.raw
                if m.types != (_VT.UINT32,):
                    raise w.fail(
                        f"general.alignment is a {'/'.join(t.name for t in m.types)}, not a "
                        "UINT32 (the type the format requires)"
                    )
                if not v or v & (v - 1) or v > MAX_ALIGNMENT:
                    raise w.fail(
                        f"general.alignment {v} is not a power of two from 1 to {MAX_ALIGNMENT}"
                    )
                alignment = v
        infos: dict[str, TensorInfo] = {}
        for i in range(n_tensors):
            name = w.text(f"name of tensor {i}")
            shown_name = shown(name)
            if name in infos:
                raise w.fail(f"tensor {shown_name} appears twice in the tensor table")
            n_dims = w.unpack("I", f"dimension count of {shown_name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise w.fail(
                    f"tensor {shown_name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)"
                )
            shape = [w.unpack("Q", f"shape of {shown_name}") for _ in range(n_dims)]
            ttype = w.unpack("I", f"type of {shown_name}")
            offset = w.unpack("Q", f"offset of {shown_name}")
            try:
                qtype = gguf.GGMLQuantizationType(ttype)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise w.fail(f"tensor {shown_name} has unknown GGML type {ttype}") from None
            n = 1
            for d in shape:
                if d == 0:
                    raise w.fail(f"tensor {shown_name} has an empty dimension in its shape {shape}")
                if n * d > 2**62:
                    raise w.fail(
                        f"tensor {shown_name}: its shape {shape} overflows (more than 2^62 "
                        "elements)"
                    )
                n *= d
            if shape[0] % block:
                raise w.fail(
                    f"tensor {shown_name}: row length {shape[0]} is not a multiple of "
                    f"{qtype.name}'s block of {block}"
                )
            infos[name] = TensorInfo(name, qtype, tuple(shape), offset, n // block * type_size)
        data_offset = -(-w.pos // alignment) * alignment
        return _Header(data_offset, meta, _place(path, size, data_offset, alignment, infos))
    finally:
        buf.close()


def _place(
    path: Path, size: int, data_offset: int, alignment: int, infos: dict[str, TensorInfo]
) -> list[TensorInfo]:
    """The tensor table with absolute offsets, each tensor's data checked: inside the file,
    aligned to ``alignment`` and not overlapping another tensor's (gguf.md).

    A tensor whose size or offset alone exceeds the file is malformed (an overflowing shape or
    offset); one that starts inside the file and ends past it means the file was cut short.

    Raises:
        GGUFError: overflow, truncation, misalignment or overlap (names the tensor).
    """
    tensors = []
    for t in infos.values():
        name = shown(t.name)
        if t.n_bytes > size or t.data_offset > size:
            what = "size" if t.n_bytes > size else "offset"
            value = t.n_bytes if t.n_bytes > size else t.data_offset
            raise GGUFError(
                f"{path}: malformed GGUF: tensor {name}: its {what} ({value} bytes) overflows "
                f"the file ({size} bytes); the header is damaged — re-download or re-convert it"
            )
        if t.data_offset % alignment:
            raise GGUFError(
                f"{path}: malformed GGUF: tensor {name}: its offset {t.data_offset} is not a "
                f"multiple of the alignment {alignment}; re-download or re-convert the file"
            )
        end = data_offset + t.data_offset + t.n_bytes
        if end > size:
            raise GGUFError(
                f"{path}: truncated GGUF: tensor {name} ends at byte {end} but the file "
                f"has {size} bytes; the file was cut short — download it again"
            )
        tensors.append(t._replace(data_offset=data_offset + t.data_offset))
    by_start = sorted(tensors, key=lambda t: t.data_offset)
    for a, b in zip(by_start, by_start[1:], strict=False):
        if a.data_offset + a.n_bytes > b.data_offset:
            raise GGUFError(
                f"{path}: malformed GGUF: the data of tensors {shown(a.name)} and "
                f"{shown(b.name)} overlap; re-download or re-convert the file"
            )
    return tensors


def _open_file(p: Path) -> GGUFFile:
    """Validate and open one GGUF file (``open_gguf``, without looking for shards)."""
    if not p.is_file():
        raise GGUFError(f"{p}: no such file")
    size = p.stat().st_size
    header = _walk_header(p, size)
    with open(p, "rb") as f:
        header_sha = hashlib.sha256(f.read(header.data_offset)).hexdigest()
    return GGUFFile(p, size, header.data_offset, header_sha, header.tensors, header.meta)


def split_paths(path: str | Path) -> list[Path]:
    """The files of the model at ``path``: the file itself, or, when its name is a shard's as
    llama.cpp's gguf-split names them (``NAME-00002-of-00003.gguf``), every shard of its set in
    order. Only names are read (``open_gguf`` checks the shards' split keys), so that sizing and
    hashing a model (``catalog``) cost no header walk.

    Raises:
        GGUFError: a shard number outside 1..count, or a shard of the set that is not there
            (names it and the fix).
    """
    p = Path(path)
    m = SPLIT_NAME.match(p.name)
    if m is None or int(m["count"]) == 1:
        return [p]
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count or count > 65535:  # split.count is a u16
        raise GGUFError(
            f"{p}: named as shard {no} of {count}, which no split writes; give the shard its "
            "own name NAME-0000K-of-0000N.gguf (K from 1 to N) as gguf-split wrote it"
        )
    paths = [p.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, s in enumerate(paths, 1):
        if not s.is_file():
            raise GGUFError(
                f"{s}: no such file: shard {i} of the {count}-file split model {paths[0].name} "
                f"is missing; put every shard of the set in {p.parent} (download it again)"
            )
    return paths


def _open_split(paths: list[Path], given: GGUFFile) -> GGUFFile:
    """The shards ``paths`` (``split_paths``) opened as one model, ``given`` (one of them)
    already open, each checked against llama.cpp's loader rules: ``split.no`` is the shard's
    place, ``split.count`` the set's size, the tensors add up to ``split.tensors.count`` and no
    tensor is in two shards.

    Raises:
        GGUFError: a shard without split keys, of another set, out of order or damaged (names
            the file and the fix).
    """
    n, total, shards = len(paths), None, []
    where: dict[str, int] = {}
    for i, path in enumerate(paths):
        s = given if path == given.path else _open_file(path)
        if s.field_types(_SPLIT_COUNT) is None:
            raise GGUFError(
                f"{path}: named as shard {i + 1} of {n} of a split model but it has no "
                f"{_SPLIT_COUNT} key: not a gguf-split shard; rename it, or split the model "
                "again with llama.cpp's gguf-split"
            )
        no = read_int(s, _SPLIT_NO, 0, 65535)
        count = read_int(s, _SPLIT_COUNT, 1, 65535)
        tensors = read_int(s, _SPLIT_TENSORS, 0, n * MAX_TENSORS)
        if count != n:
            raise GGUFError(
                f"{path}: {_SPLIT_COUNT} is {count} but its name says the set has {n} shards: a "
                "shard of another split; download the set again"
            )
        if no != i:
            raise GGUFError(
                f"{path}: {_SPLIT_NO} says it is shard {no + 1} of {n} but its name says shard "
                f"{i + 1}: the shards were renamed out of order; give each the name gguf-split "
                "gave it"
            )
        if total is None:
            total = tensors
        elif tensors != total:
            raise GGUFError(
                f"{path}: {_SPLIT_TENSORS} is {tensors} but shard 1 says {total}: a shard of "
                "another split; download the set again"
            )
        for t in s.tensor_infos:
            if t.name in where:
                raise GGUFError(
                    f"{path}: tensor {shown(t.name)} is also in {paths[where[t.name]].name}: a "
                    "shard of another split; download the set again"
                )
            where[t.name] = i
        shards.append(s)
    if len(where) != total:
        raise GGUFError(
            f"{paths[0]}: its {n} shards hold {len(where)} tensors but {_SPLIT_TENSORS} is "
            f"{total}: a shard is damaged or of another split; download the set again"
        )
    first = shards[0]
    return GGUFFile(
        first.path,
        sum(s.size_bytes for s in shards),
        first.data_offset,
        hashlib.sha256("".join(s.header_sha256 for s in shards).encode()).hexdigest(),
        [t for s in shards for t in s.tensor_infos],
        first._meta,
        shards=shards,
        shard_of=where,
    )


def open_gguf(path: str | Path) -> GGUFFile:
    """Validate and open a GGUF file; given a shard of a split model (``split_paths``), the
    whole set (``GGUFFile.shards``).

    Raises:
        GGUFError: missing file, not a GGUF, big-endian, unsupported version, malformed or
            truncated header or tensor data, misaligned or overlapping tensor data; a shard
            missing, of another split, out of order or not named as gguf-split names shards
            (one line naming the problem and the fix; names escaped).
    """
    p = Path(path)
    g = _open_file(p)
    count = g.field_types(_SPLIT_COUNT) and read_int(g, _SPLIT_COUNT, 1, 65535)
    paths = split_paths(p)
    if count and count > 1 and len(paths) == 1:
        no = read_int(g, _SPLIT_NO, 0, count - 1)
        raise GGUFError(
            f"{p}: shard {no + 1} of a {count}-file split model ({_SPLIT_COUNT}), but its name "
            f"is not a shard's; keep the names gguf-split gave the shards (NAME-{no + 1:05d}-of-"
            f"{count:05d}.gguf), side by side, and open the set by any of them"
        )
    if len(paths) > 1:
        g = _open_split(paths, g)
    if not g.tensor_infos:
        raise GGUFError(f"{p}: the GGUF holds no tensors; it is not a model file")
    return g
