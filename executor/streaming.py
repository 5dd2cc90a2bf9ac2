"""The NVMe tier: units read with direct I/O into a fixed pool of slots, ``depth`` units ahead.

The forward pass uses streamed units in the same order every step (``schedule``), so one I/O
thread walks that order cyclically: it waits for a free slot, reads the unit's packed bytes into it
with ``preadv`` (chunks spread over ``io_threads`` threads), and marks the slot ready. The compute
thread ``acquire``s each unit in turn (waiting only if the read is late: that wait is the I/O wait),
builds its arrays as views of the slot, and ``release``s the slot once the computation that reads
it has been evaluated — a slot is never overwritten while a lazy MLX computation still reads it.

Slots are MLX uint8 arrays allocated once (reused, never reallocated); reads land in them in place
(``memoryview`` of an evaluated MLX array is writable on CPU and unified memory), aligned for
O_DIRECT by an offset into a slightly larger array. On MLX's CUDA backend direct-I/O reads go
through a host buffer instead (the runtime config's ``stage_direct_reads``: a DMA into the
array's memory is not coherent with the GPU's reads there). Reads finish
(``executor.direct_io``): a short read is continued and an interrupted one retried; a direct read
the filesystem refuses (``EINVAL``) switches the file to buffered reads for the rest of the run,
with one warning line. A read that ends before the unit does (the file is shorter than the
manifest says) or fails otherwise raises a ``StrataError`` in the compute thread, never silently
wrong weights. Every unit read is checked against its CRC-32 (``PackStore.check_read``) by the
threads that read it, before the slot is handed over: a mismatch raises ``PackCorruptError``.
"""

from __future__ import annotations

import mmap
import threading
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor import pack as _pack
from strata.executor.direct_io import ALIGN, UncachedFile, pread_into
from strata.executor.ops import QuantLinear
from strata.executor.pack import PackedUnit, PackStore, crc32_combine

CHUNK = 4 << 20
"""Read size per preadv call, bytes: 4 MiB, the profile's direct-I/O test block."""

_DTYPES = {"uint32": mx.uint32, "uint8": mx.uint8, "float16": mx.float16, "float32": mx.float32}


class SlotArena:
    """Fixed slots of device-visible memory that packed units are read into with direct I/O.

    Slots are MLX uint8 arrays allocated once (reused, never reallocated); reads land in them in
    place through a ``memoryview`` of the evaluated array, aligned for O_DIRECT by an offset into
    a slightly larger array. Used by the dense pool (:class:`StreamPool`) and the MoE expert cache
    (``executor.experts``).

    Args:
        store: the packed store (its file is read; its CRC-32s check every read).
        slots: number of slots.
        slot_bytes: bytes per slot (the largest unit it will hold).
        io_threads: threads issuing one unit's chunk reads in parallel.
        dtype: compute dtype float tensors are cast to.
        stage_direct_reads: direct-I/O reads go through a host buffer, then a copy into the slot
            (``RuntimeConfig.stage_direct_reads``: on MLX's CUDA backend).
    """

    def __init__(
        self,
        store: PackStore,
        slots: int,
        slot_bytes: int,
        io_threads: int,
        dtype: mx.Dtype,
        *,
        stage_direct_reads: bool,
    ):
        self.dtype = dtype
        self.slot_bytes = slot_bytes
        self._slots = [mx.zeros((slot_bytes + ALIGN,), dtype=mx.uint8) for _ in range(slots)]
        mx.eval(self._slots)
        self._views, self._base = [], []
        for s in self._slots:
            mv = memoryview(s).cast("B")
            addr = np.asarray(mv).ctypes.data
            base = (-addr) % ALIGN
            self._views.append(mv[base : base + slot_bytes])
            self._base.append(base)
        self.store = store
        self.file = UncachedFile(store.path)
        self._staged = self.file.direct and stage_direct_reads
        self._stage = threading.local()  # per I/O thread: an aligned CHUNK-byte host buffer
        self.io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="strata-io")

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache now (False once the file fell back to buffered
        reads, at open or later)."""
        return self.file.direct

    @property
    def method(self) -> str:
        """How the file is read now (``executor.direct_io.UncachedFile.method``)."""
        return self.file.method

    def _read_into(self, mv: memoryview, offset: int) -> int:
        """``mv``'s bytes at file ``offset`` (``direct_io.pread_into``: short reads continued,
        ``EINTR`` retried); ``EINVAL`` on a direct read switches the file to buffered reads and
        reads again."""
        while True:
            fd = self.file.fd
            try:
                return pread_into(fd, mv, offset)
            except OSError as e:
                self.file.fall_back(fd, offset, e)  # re-raises anything else

    def read(self, slot: int, unit: PackedUnit) -> int:
        """Read ``unit``'s packed bytes into ``slot`` (chunks in parallel) and check them
        against the unit's CRC-32 (each chunk's CRC-32 computed in the thread that read it, over
        the slot's bytes; zlib releases the GIL); the bytes the OS returned.

        Raises:
            StrataError: the file ends before the unit (the pack file is damaged).
            PackCorruptError: the bytes read are not the ones built (``PackStore.check_read``).
            OSError: the OS refused a read (``EINVAL`` on a direct read is not refused: the
                file falls back to buffered reads).
        """
        view = self._views[slot]
        chunks = [(o, min(CHUNK, unit.nbytes - o)) for o in range(0, unit.nbytes, CHUNK)]
        check = _pack._CHECK_READS

        def one(chunk: tuple[int, int]) -> tuple[int, int]:
            off, n = chunk
            if self._staged:
                buf = getattr(self._stage, "buf", None)
                if buf is None:
                    buf = self._stage.buf = memoryview(mmap.mmap(-1, CHUNK))  # page-aligned
                got = self._read_into(buf[:n], unit.offset + off)
                view[off : off + got] = buf[:got]  # a CPU write: coherent with the GPU's reads
            else:
                got = self._read_into(view[off : off + n], unit.offset + off)
            if got != n:
                raise StrataError(
                    f"short read from {unit.name} in the packed store {self.file.path}: the file "
                    f"ended after {got} of {n} bytes at offset {unit.offset + off}; the pack file "
                    "is damaged — delete it to rebuild"
                )
            return got, zlib.crc32(view[off : off + got]) if check else 0

        done = list(self.io.map(one, chunks))
        if check:
            crc = 0
            for (_, n), (_, part_crc) in zip(chunks, done, strict=True):
                crc = crc32_combine(crc, part_crc, n)
            self.store.check_read(unit, crc)
        return sum(got for got, _ in done)

    def arrays(self, slot: int, unit: PackedUnit) -> dict[str, QuantLinear | mx.array]:
        """The unit's tensors as views of ``slot`` (by the pack's tensor names)."""
        base, arr = self._base[slot], self._slots[slot]
        parts: dict[str, dict[str, mx.array]] = {}
        for p in unit.parts:
            raw = arr[base + p.offset : base + p.offset + p.nbytes]
            parts.setdefault(p.tensor, {})[p.kind] = mx.view(raw, _DTYPES[p.dtype]).reshape(p.shape)
        out: dict[str, QuantLinear | mx.array] = {}
        for name, ps in parts.items():
            if "data" in ps:
                out[name] = ps["data"].astype(self.dtype)
            else:
                bits, group = unit.bits[name]
                # No biases part: MXFP4 in MLX's mxfp4 form (``strata.common.quant``).
                biases = ps.get("biases")
                out[name] = QuantLinear(ps["weight"], ps["scales"], biases, bits, group)
        return out

    def close(self) -> None:
        """Wait for reads in flight and close the file."""
        self.io.shutdown(wait=True)
        self.file.close()


class StreamPool:
    """Streams ``schedule``'s units from the packed store through ``slots`` pool slots.

    Args:
        store: the packed store.
        schedule: streamed unit names in the order the forward pass uses them (one step).
        slots: pool slots: depth + 1 (1 = synchronous reads: the unit is read when its slot frees).
        io_threads: threads issuing reads of one unit's chunks in parallel.
        dtype: compute dtype float tensors are cast to.
        stage_direct_reads: as :class:`SlotArena`'s.

    Raises:
        StrataError: no slots.
    """

    def __init__(
        self,
        store: PackStore,
        schedule: list[str],
        slots: int,
        io_threads: int,
        dtype: mx.Dtype,
        *,
        stage_direct_reads: bool,
    ):
        if slots < 1:
            raise StrataError(f"the plan's pool has {slots} slots; streaming needs at least 1")
        self.units: list[PackedUnit] = [store.units[u] for u in schedule]
        self.arena = SlotArena(
            store,
            slots,
            max(u.nbytes for u in self.units),
            io_threads,
            dtype,
            stage_direct_reads=stage_direct_reads,
        )
        self._cv = threading.Condition()
        self._loaded: list[int | None] = [None] * slots  # read sequence number held by each slot
        self._got = [0] * slots  # bytes the OS returned for the unit each slot holds
        self._free = list(range(slots))
        self._next_read = 0  # sequence number of the next unit to read
        self._next_use = 0  # sequence number of the next unit the compute thread acquires
        self._in_use: deque[int] = deque()  # acquired slots, oldest first
        self._error: BaseException | None = None
        self._stop = False
        self.bytes_read = 0
        self.io_wait_s = 0.0
        self._reader = threading.Thread(target=self._read_loop, name="strata-prefetch", daemon=True)
        self._reader.start()

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache now (:attr:`SlotArena.direct`)."""
        return self.arena.direct

    @property
    def method(self) -> str:
        """How the packed store is read now (:attr:`SlotArena.method`)."""
        return self.arena.method

    # ------------------------------------------------------------------ I/O thread

    def _read_loop(self) -> None:
        n = len(self.units)
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self._free)
                    if self._stop:
                        return
                    slot = self._free.pop(0)
                    seq = self._next_read
                    self._next_read += 1
                self._got[slot] = self.arena.read(slot, self.units[seq % n])
                with self._cv:
                    self._loaded[slot] = seq
                    self._cv.notify_all()
        except BaseException as e:  # handed to the compute thread, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    # ------------------------------------------------------------------ compute thread

    def acquire(self, name: str) -> dict[str, QuantLinear | mx.array]:
        """The next scheduled unit's tensors, as views of its slot (blocks until it is read).

        Raises:
            StrataError: the unit is not the next in the schedule, or its read failed.
        """
        seq = self._next_use
        unit = self.units[seq % len(self.units)]
        if unit.name != name:
            raise StrataError(f"streaming order broken: expected {unit.name}, asked for {name}")
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or seq in self._loaded)
            if self._error is not None:
                err = self._error
                raise (
                    err
                    if isinstance(err, StrataError)
                    else StrataError(f"reading {unit.name} from the packed store failed: {err}")
                ) from err
            slot = self._loaded.index(seq)
        self.io_wait_s += time.perf_counter() - t0
        self.bytes_read += self._got[slot]  # counted per use, when the compute thread takes it
        self._in_use.append(slot)
        self._next_use = seq + 1
        return self.arena.arrays(slot, unit)

    def release(self, result: mx.array) -> None:
        """Evaluate ``result`` (which reads the oldest acquired slot), then free that slot."""
        mx.eval(result)
        with self._cv:
            slot = self._in_use.popleft()
            self._loaded[slot] = None
            self._free.append(slot)
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the I/O threads and close the file (idempotent)."""
        with self._cv:
            if self._stop:
                return
            self._stop = True
            self._cv.notify_all()
        self._reader.join(timeout=30)
        self.arena.close()
