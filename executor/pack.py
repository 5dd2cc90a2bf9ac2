"""The packed store: a model's tensors repacked once into MLX layout, aligned for direct I/O.

Streaming a unit from NVMe means reading its bytes straight into a pool slot and computing on them
in place. GGUF blocks interleave scales and quants, so GGUF bytes would need repacking on every
read (numpy repacks Q4_1 at ~0.6 GB/s on one core here, below the disk's 1.5-2.5 GB/s); the packed
store holds each tensor's MLX parts (``weight``/``scales``/``biases``, or ``data`` for float
tensors) contiguously, every part starting on a ``ALIGN``-byte boundary, units one after another.
One ``preadv`` then fills a slot with a whole unit, and each part is a view of the slot.

Files: ``$STRATA_CACHE/packs/<model sha256[:16]>.v1.pack`` and a JSON manifest beside it, built on
first use of a plan that streams. The manifest records the model sha256, the pack format, each
unit's CRC-32 and the pack file's size and modification time as built. Before use, the size and
the layout are checked (``_check_layout``), and where the file's modification time is not the
one recorded (it was written since: edited, copied, restored), every unit's CRC-32 is checked
too, once, reading the pack through; a mismatch rebuilds it. An unchanged pack costs no reading.

Bytes are checked again whenever they are used: every streamed read of a whole unit is checked
against the unit's CRC-32 in the thread that read it, before the compute thread takes the slot
(``PackStore.check_read``; the I/O threads checksum their chunks and ``crc32_combine`` joins them),
and a streamed table read by rows (the embedding) is checked whole on its first use
(``PackStore.check_unit``: its rows read later are not checked again). A mismatch (bit rot that left
the file's modification time alone, a bad read) stops the run with a ``PackCorruptError`` naming the
pack and the unit, and marks the manifest stale, so the next start checks the whole pack and
rebuilds it where it is damaged.
The cost is in docs/hostile-inputs.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from strata.common.atomic import replaced
from strata.common.catalog import cache_dir
from strata.common.errors import StrataError
from strata.common.gguf_file import GGUFFile, TensorInfo
from strata.common.quant import PackedWeight, UnsupportedQuantError, repack
from strata.common.schemas import ModelDescription, UnitInfo
from strata.executor.direct_io import ALIGN
from tqdm import tqdm

PACK_FORMAT = "strata-mlx-pack-v2"  # v2: units' CRC-32 and the file's size and mtime as built

_CHECK_READS = True
"""Whether reads are checked against their unit's CRC-32 (``PackStore.check_read``); on. Not an
option: only the cost measurement (scripts/measure_pack_crc.py) turns it off."""


class PackCorruptError(StrataError):
    """A unit's bytes read from the packed store are not the ones built (its CRC-32 differs)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Part:
    """One array of a packed tensor: ``nbytes`` at ``offset`` within its unit."""

    tensor: str
    kind: str  # weight | scales | biases | data
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PackedUnit:
    """A unit's place in the pack: ``nbytes`` (multiple of ALIGN) at ``offset`` (aligned)."""

    name: str
    offset: int
    nbytes: int
    parts: tuple[Part, ...]
    bits: dict[str, tuple[int, int]]  # tensor -> (bits, group_size) for quantized tensors


def unit_host_tensors(
    g: GGUFFile, unit: UnitInfo, by_name: dict[str, TensorInfo]
) -> Iterator[tuple[str, PackedWeight | np.ndarray]]:
    """A unit's tensors repacked into MLX layout on the host, as (GGUF tensor name, host array).

    An expert unit (``unit.expert`` set) yields only its slice of each stacked tensor: GGUF
    stores ``[cols, rows, n_expert]`` with the expert dimension outermost, so expert E's bytes
    are the E-th of ``n_expert`` equal runs, repacked as a ``(rows, cols)`` matrix. Float tensors
    are float16 or float32 copies that own their memory.

    Raises:
        StrataError: a GGML type the executor cannot load (names tensor and type).
    """
    for name in unit.tensors:
        t = by_name[name]
        shape = tuple(reversed(t.shape))
        raw = g.tensor_bytes(t)
        if unit.expert is not None:
            n = shape[0]
            raw = raw.reshape(n, -1)[unit.expert]
            shape = shape[1:]
        elif len(shape) > 2 and GGML_QUANT_SIZES[t.tensor_type][0] > 1:
            # A quantized tensor of more than two dimensions outside the experts (deepseek2's
            # attn_k_b [heads, rank, nope]): its rows in one matrix, which the model reshapes.
            shape = (int(np.prod(shape[:-1])), shape[-1])
        try:
            host = repack(t.tensor_type, raw, shape)
        except UnsupportedQuantError as e:
            raise StrataError(f"tensor {name}: {e}") from None
        if isinstance(host, np.ndarray):
            # A copy that owns its memory (float tensors may be views of the mapped file).
            host = host.astype(np.float32 if host.dtype != np.float16 else np.float16)
        yield name, host
        if unit.expert is None or unit.expert == shape_experts(t) - 1:
            g.drop_pages(t)  # copied: unmap the GGUF's pages


def shape_experts(t: TensorInfo) -> int:
    """Experts stacked in a tensor (its last GGUF dimension; 1 for a 2-D tensor)."""
    return t.shape[2] if len(t.shape) > 2 else 1


def _host_parts(host: PackedWeight | np.ndarray) -> list[tuple[str, np.ndarray]]:
    if isinstance(host, PackedWeight) and host.biases is None:  # mxfp4: codes and E8M0 scales
        return [("weight", host.weight), ("scales", host.scales)]
    if isinstance(host, PackedWeight):
        return [("weight", host.weight), ("scales", host.scales), ("biases", host.biases)]
    return [("data", np.ascontiguousarray(host))]


class PackStore:
    """The packed store of one model.

    Args:
        path: the ``.pack`` file.
        units: unit name -> its layout.
    """

    def __init__(
        self,
        path: Path,
        units: dict[str, PackedUnit],
        crcs: dict[str, int],
        manifest: Path,
    ):
        self.path, self.units, self.crcs, self.manifest = path, units, crcs, manifest
        self._stale_lock = threading.Lock()
        self._marked_stale = False

    def check_read(self, unit: PackedUnit, crc: int) -> None:
        """Check ``crc``, the CRC-32 of ``unit``'s whole bytes as just read, against the one
        recorded when the pack was built.

        Raises:
            PackCorruptError: they differ: the manifest is marked stale first
                (:meth:`mark_stale`), so the next start checks the pack and rebuilds it.
        """
        want = self.crcs[unit.name]
        if crc != want and _CHECK_READS:
            self.mark_stale()
            raise PackCorruptError(
                f"the packed store {self.path}: unit {unit.name}'s bytes as read are not the "
                f"ones built (CRC-32 {crc:08x}, built {want:08x}): the pack is damaged or the "
                "read was; run again: the next start checks the pack and rebuilds it"
            )

    def check_unit(self, unit: PackedUnit, fd: int) -> None:
        """Read ``unit`` through from ``fd`` (the open pack the caller then reads rows from,
        ``CHECK_CHUNK`` bytes at a time, through the page cache) and check its CRC-32: for a unit
        read in pieces (a streamed embedding's rows), whose reads cannot each be checked against
        the unit's CRC-32. Rows read after this check are not checked again.

        Raises:
            PackCorruptError: as :meth:`check_read`; also when the file ends inside the unit.
            OSError: the pack cannot be read.
        """
        crc, pos, end = 0, unit.offset, unit.offset + unit.nbytes
        while pos < end:
            chunk = os.pread(fd, min(end - pos, CHECK_CHUNK), pos)
            if not chunk:
                self.mark_stale()
                raise PackCorruptError(
                    f"the packed store {self.path} ends inside unit {unit.name}: the pack is "
                    "damaged; run again: the next start checks the pack and rebuilds it"
                )
            crc, pos = zlib.crc32(chunk, crc), pos + len(chunk)
        self.check_read(unit, crc)

    def mark_stale(self) -> None:
        """Make the next start check every unit of the pack (and rebuild it on a mismatch): the
        manifest's recorded modification time is cleared, or, where the manifest cannot be
        rewritten, the manifest is removed (the pack is then rebuilt). Once per store."""
        with self._stale_lock:
            if self._marked_stale:
                return
            self._marked_stale = True
            try:
                meta = json.loads(self.manifest.read_text())
                meta["mtime_ns"] = None
                with replaced(self.manifest, "w") as f:
                    f.write(json.dumps(meta))
            except (OSError, ValueError, TypeError):
                self.manifest.unlink(missing_ok=True)

    @staticmethod
    def paths(sha256: str) -> tuple[Path, Path]:
        """(pack file, manifest) for a model sha256."""
        d = cache_dir() / "packs"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{sha256[:16]}.v1.pack", d / f"{sha256[:16]}.v1.json"

    @classmethod
    def open_or_build(cls, g: GGUFFile, desc: ModelDescription, sha256: str) -> PackStore:
        """Open the model's pack, building it first if it is missing or stale.

        Raises:
            StrataError: the pack cannot be written (disk full, unwritable cache).
        """
        pack, manifest = cls.paths(sha256)
        try:
            meta = json.loads(manifest.read_text())
            if (
                meta.get("format") == PACK_FORMAT
                and meta.get("model_sha256") == sha256
                and pack.stat().st_size == meta["size"]
            ):
                units = _units_from_json(meta["units"])
                _check_layout(units, meta["size"])
                if set(units) != {u.name for u in desc.units}:
                    raise ValueError("the manifest's units are not the model's")
                crcs = {name: int(meta["crc32"][name]) for name in units}
                if pack.stat().st_mtime_ns != meta["mtime_ns"]:
                    # Written since it was built, or a read found it damaged (``mark_stale``).
                    _check_crcs(pack, units, crcs)
                    meta["mtime_ns"] = pack.stat().st_mtime_ns
                    with replaced(manifest, "w") as f:  # checked: not again
                        f.write(json.dumps(meta))
                return cls(pack, units, crcs, manifest)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls._build(g, desc, sha256, pack, manifest)

    @classmethod
    def _build(
        cls, g: GGUFFile, desc: ModelDescription, sha256: str, pack: Path, manifest: Path
    ) -> PackStore:
        by_name = {t.name: t for t in g.tensor_infos}
        units: dict[str, PackedUnit] = {}
        crcs: dict[str, int] = {}
        pos = 0
        try:
            # Written beside the pack under a name of its own and renamed into place: processes
            # building one pack at once (a fresh cache's first runs, parallel test workers)
            # never write into one file, and an interrupted build leaves nothing behind.
            with (
                replaced(pack) as f,
                tqdm(
                    total=desc.bytes_mlx,
                    unit="B",
                    unit_scale=True,
                    desc="packing for streaming",
                    file=sys.stderr,
                ) as bar,
            ):
                for u in desc.units:
                    parts, bits, start, crc = [], {}, pos, 0
                    for name, host in unit_host_tensors(g, u, by_name):
                        if isinstance(host, PackedWeight):
                            bits[name] = (host.bits, host.group_size)
                        for kind, arr in _host_parts(host):
                            raw = memoryview(np.ascontiguousarray(arr)).cast("B")  # no copy
                            parts.append(
                                Part(
                                    name,
                                    kind,
                                    str(arr.dtype),
                                    tuple(arr.shape),
                                    pos - start,
                                    len(raw),
                                )
                            )
                            pad = b"\0" * (_align(len(raw)) - len(raw))
                            f.write(raw)
                            f.write(pad)
                            crc = zlib.crc32(pad, zlib.crc32(raw, crc))
                            pos += _align(len(raw))
                            bar.update(len(raw))
                    units[u.name] = PackedUnit(u.name, start, pos - start, tuple(parts), bits)
                    crcs[u.name] = crc
            meta = {
                "format": PACK_FORMAT,
                "model_sha256": sha256,
                "size": pos,
                "mtime_ns": pack.stat().st_mtime_ns,  # renamed into place: as built
                "crc32": crcs,
                "units": _units_to_json(units),
            }
            with replaced(manifest, "w") as f:
                f.write(json.dumps(meta))
        except OSError as e:
            raise StrataError(f"cannot write the packed store {pack}: {e.strerror or e}") from None
        return cls(pack, units, crcs, manifest)


def _units_to_json(units: dict[str, PackedUnit]) -> list:
    return [
        {
            "name": u.name,
            "offset": u.offset,
            "nbytes": u.nbytes,
            "bits": {k: list(v) for k, v in u.bits.items()},
            "parts": [
                [p.tensor, p.kind, p.dtype, list(p.shape), p.offset, p.nbytes] for p in u.parts
            ],
        }
        for u in units.values()
    ]


CHECK_CHUNK = 16 << 20
"""Bytes read at a time when a pack's CRCs are checked."""


def _check_crcs(pack: Path, units: dict[str, PackedUnit], crcs: dict[str, int]) -> None:
    """Check every unit's CRC-32 against the manifest's, reading the pack through (buffered:
    once, when the file changed since it was built).

    Raises:
        ValueError: a unit's bytes are not the ones built (the caller rebuilds the pack).
        OSError: the pack cannot be read.
    """
    print(
        f"checking the packed store {pack.name} (changed since it was built) ...", file=sys.stderr
    )
    with open(pack, "rb") as f:
        for u in sorted(units.values(), key=lambda u: u.offset):
            crc = _unit_crc(f, u)
            if crc is None:
                raise ValueError(f"the pack ends inside unit {u.name}")
            if crc != crcs[u.name]:
                raise ValueError(f"unit {u.name}'s bytes are not the ones built")


def _unit_crc(f, u: PackedUnit) -> int | None:
    """CRC-32 of unit ``u``'s bytes in the open pack ``f`` (None: the file ends inside it)."""
    f.seek(u.offset)
    crc, left = 0, u.nbytes
    while left:
        chunk = f.read(min(left, CHECK_CHUNK))
        if not chunk:
            return None
        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    return crc


_CRC_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial (bit-reflected, zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31 (zlib's x2n_table)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))

_SHIFT_CACHE: dict[int, int] = {}


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: what appending ``n`` bytes does to a preceding CRC."""
    p = _SHIFT_CACHE.get(n)
    if p is None:
        p, k, left = 1 << 31, 3, n
        while left:
            if left & 1:
                p = _multmodp(_X2N[k & 31], p)
            left >>= 1
            k += 1
        if len(_SHIFT_CACHE) < 64:  # a few lengths recur (the read chunk size)
            _SHIFT_CACHE[n] = p
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` = CRC-32 of ``A``, ``crc2`` = CRC-32 of ``B`` and
    ``len2`` = ``len(B)`` in bytes (zlib's ``crc32_combine``, which Python's zlib does not
    expose): so chunks checksummed by parallel threads check against one CRC-32 per unit."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def _check_layout(units: dict[str, PackedUnit], size: int) -> None:
    """Refuse a manifest whose units do not tile the pack as ``_build`` lays them out: each at
    an ``ALIGN``-aligned offset, a whole number of ``ALIGN`` blocks long, one after another
    from byte 0 to the end, each part inside its unit. A moved or damaged entry would read
    another unit's bytes (and an unaligned one is refused by direct I/O, whose fallback would
    read them without a word).

    Raises:
        ValueError: the layout does not hold (the caller rebuilds the pack).
    """
    pos = 0
    for u in sorted(units.values(), key=lambda u: u.offset):
        if u.offset != pos or u.offset % ALIGN or u.nbytes % ALIGN or u.nbytes < 0:
            raise ValueError(f"unit {u.name} is not where the pack's layout puts it")
        if any(p.offset < 0 or p.offset + p.nbytes > u.nbytes for p in u.parts):
            raise ValueError(f"a part of unit {u.name} lies outside it")
        pos += u.nbytes
    if pos != size:
        raise ValueError("the units do not fill the pack")


def _units_from_json(data: list) -> dict[str, PackedUnit]:
    return {
        u["name"]: PackedUnit(
            u["name"],
            u["offset"],
            u["nbytes"],
            tuple(Part(t, k, d, tuple(s), o, n) for t, k, d, s, o, n in u["parts"]),
            {k: (v[0], v[1]) for k, v in u["bits"].items()},
        )
        for u in data
    }
