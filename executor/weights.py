"""Weight stores per tier: where the plan put a unit decides how its tensors reach the compute.

- ``gpu``: resident MLX arrays, made once at load.
- ``ram``: host-resident copies in MLX layout (numpy arrays, repacked once at load), copied into
  MLX arrays each time the unit is used — on unified memory this is a memcpy, on a discrete GPU the
  host->device transfer the planner's ``host_copy_s`` term models.
- ``nvme``: read from the packed store (``executor.pack``) with direct I/O into the pool slots of
  ``executor.streaming``, prefetched ahead of the forward pass; an untied embedding's rows are
  read one by one.

Numerics never depend on the tier: all three hand the same repacked arrays to the same ops.
Counters are honest: ``bytes_read[tier]`` counts, per use, the bytes of weights the forward pass
took from that tier (for ``ram``, exactly the bytes copied).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from strata.common.errors import PlanError, StrataError
from strata.common.gguf_file import GGUFFile
from strata.common.quant import PackedWeight
from strata.common.schemas import ModelDescription, RoutingProfile
from strata.executor.direct_io import pread_into
from strata.executor.experts import ExpertCache, RoutingTracker, expert_key, split_gate_up
from strata.executor.ops import QuantLinear, embedding, to_mlx
from strata.executor.pack import PackStore, unit_host_tensors
from strata.executor.pinned import pinned_for
from strata.executor.streaming import StreamPool

Weight = QuantLinear | mx.array
HostWeight = PackedWeight | np.ndarray

RAM_UNITS_AHEAD = 2
"""RAM-tier units whose device copies may be scheduled and not yet computed
(``WeightStore.release``): the copy of the next unit overlaps the compute of the ones before,
and the device never holds more than this many units' copies (a lazy pass would otherwise hold
every RAM unit's copy at once: the whole RAM tier on the device)."""


def _host_nbytes(w: HostWeight) -> int:
    return int(w.nbytes)


def _rows(w: HostWeight, ids: np.ndarray) -> HostWeight:
    """The given rows of a host weight, still in MLX layout."""
    if isinstance(w, PackedWeight):
        return PackedWeight(
            weight=w.weight[ids],
            scales=w.scales[ids],
            biases=None if w.biases is None else w.biases[ids],
            bits=w.bits,
            group_size=w.group_size,
            shape=(len(ids), w.shape[1]),
        )
    return w[ids]


class WeightStore:
    """All of a model's tensors, each held on the tier the plan chose for its unit.

    Args:
        g: the opened GGUF.
        desc: its description (tensor -> unit).
        tiers: unit name -> tier ("gpu", "ram", "nvme").
        dtype: compute dtype for float tensors (float32 on CPU).
        pinned: read the RAM tier from page-locked host memory on MLX's CUDA backend
            (``executor.pinned``; ``RuntimeConfig.pinned_ram_tier``); ignored elsewhere.
        pack_desc: the whole model's description where ``desc`` is a pipeline stage's
            (``strata.common.cluster.stage_description``): the packed store NVMe units stream
            from is the whole model's, one per model whichever stages a host runs.

    Raises:
        PlanError: a plan streams a model it has no sha256 for.
        StrataError: a tensor has a GGML type the executor cannot load (names tensor and type).
    """

    def __init__(
        self,
        g: GGUFFile,
        desc: ModelDescription,
        tiers: dict[str, str],
        dtype: mx.Dtype,
        pinned: bool = False,
        pack_desc: ModelDescription | None = None,
    ):
        self.dtype = dtype
        self._pinned = pinned_for(pinned and "ram" in tiers.values())
        self._ram_ahead: deque[mx.array] = deque()  # RAM units' results scheduled, not waited
        self.pool: StreamPool | None = None
        self._pack: PackStore | None = None
        self.bytes_read = {"gpu": 0, "ram": 0, "nvme": 0}
        self.copy_seconds = 0.0
        self._tier_of_unit = dict(tiers)
        self._unit_tensors: dict[str, list[str]] = {}
        self._gpu: dict[str, Weight] = {}
        self._ram: dict[str, HostWeight] = {}
        by_name = {t.name: t for t in g.tensor_infos}
        self._experts: dict[str, dict[str, Weight | HostWeight]] = {}
        if "nvme" in tiers.values():
            # Before any resident unit is loaded: a first run builds the pack, and its transient
            # memory should not add to the resident units'.
            if desc.model.sha256 is None:
                raise PlanError("a plan without the model's sha256 cannot stream it from NVMe")
            self._pack = PackStore.open_or_build(g, pack_desc or desc, desc.model.sha256)
            self._row_fd = os.open(self._pack.path, os.O_RDONLY)
            self._rows_checked: set[str] = set()  # streamed tables checked whole (``rows``)
        self._expert_units = {u.name: u for u in desc.units if u.expert is not None}
        for u in desc.units:
            if u.expert is None:
                self._unit_tensors[u.name] = list(u.tensors)
            if tiers[u.name] == "nvme":
                continue  # read from the packed store while the model runs
            for name, host in unit_host_tensors(g, u, by_name):
                if u.expert is not None:
                    key = expert_key(name)
                    held = self._to_device(host) if tiers[u.name] == "gpu" else self._pin(host)
                    self._experts.setdefault(u.name, {})[key] = held
                elif tiers[u.name] == "gpu":
                    self._gpu[name] = self._to_device(host)
                else:
                    # The RAM tier is this host copy, not the mapped file.
                    self._ram[name] = self._pin(host)
        for t in g.tensor_infos:
            g.drop_pages(t)
        resident = list(self._gpu.values()) + [
            w for u, ws in self._experts.items() if tiers[u] == "gpu" for w in ws.values()
        ]
        mx.eval([w.weight if isinstance(w, QuantLinear) else w for w in resident])
        fault_in(resident)
        # A gpu unit's tensors and bytes, as every pass asks for them (summing a unit's sizes
        # per pass read a few dozen array sizes per block, each a call into MLX).
        self._gpu_units = {
            u: (
                {n: self._gpu[n] for n in names},
                sum(_weight_nbytes(self._gpu[n]) for n in names),
            )
            for u, names in self._unit_tensors.items()
            if tiers[u] == "gpu"
        }
        self.experts_cache: ExpertCache | None = None
        self.routing = RoutingTracker(desc.architecture)
        self._record_routing = True  # off inside routing_unrecorded()
        self.expert_uses = {"gpu": 0, "ram": 0}
        self._group_needs_eval = False

    def start_streaming(
        self, schedule: list[str], slots: int, io_threads: int, *, stage_direct_reads: bool
    ) -> None:
        """Start the NVMe pool for the streamed units of ``schedule`` (forward-pass order).

        Args:
            schedule: every unit the forward pass asks for, in order; the nvme ones stream.
            slots: pool slots from the plan (depth + 1).
            io_threads: I/O threads from the plan.
            stage_direct_reads: the runtime config's (``executor.streaming.SlotArena``).
        """
        streamed = [u for u in schedule if self._tier_of_unit[u] == "nvme"]
        if streamed and self._pack is not None:
            self.pool = StreamPool(
                self._pack,
                streamed,
                max(slots, 1),
                io_threads,
                self.dtype,
                stage_direct_reads=stage_direct_reads,
            )

    def start_expert_cache(
        self,
        slots: int,
        io_threads: int,
        mode: str,
        prefetch: int,
        preload: list[str] | None = None,
        prior: RoutingProfile | None = None,
        *,
        stage_direct_reads: bool,
    ) -> None:
        """Start the expert cache for the experts the plan streams (none: nothing to do).

        Args:
            slots: the plan's ``expert_cache.slots``.
            io_threads: I/O threads from the plan.
            mode: ``executor.experts.CACHE_MODES`` (``prefetch`` in normal runs).
            prefetch: experts prefetched per block in ``prefetch`` mode.
            preload: the plan's ``expert_cache.preload``, read into the cache now.
            prior: the plan's routing profile, which seeds the routing tracker.
            stage_direct_reads: the runtime config's (``executor.streaming.SlotArena``).

        Raises:
            StrataError: a prior of another shape, or a failed preload read.
        """
        if prior is not None:
            self.routing.seed(prior)
        streamed = [u for u in self._expert_units if self._tier_of_unit[u] == "nvme"]
        if streamed and self._pack is not None:
            self.experts_cache = ExpertCache(
                self._pack,
                streamed,
                slots,
                io_threads,
                self.dtype,
                mode,
                prefetch,
                frequency=self.routing.rank,
                stage_direct_reads=stage_direct_reads,
            )
            self.experts_cache.preload(preload or [])

    @contextmanager
    def routing_unrecorded(self) -> Iterator[None]:
        """Forward passes inside record no routing (the serving warm-up's all-zero ids are not
        traffic: they would skew the routing profile and the co-activation prefetch)."""
        self._record_routing = False
        try:
            yield
        finally:
            self._record_routing = True

    def route(self, layer: int, chosen: np.ndarray) -> list[list[int]]:
        """Record block ``layer``'s routing and group its experts for loading.

        Args:
            layer: block index.
            chosen: int [T, k], each token's chosen experts (the router's top-k).

        Returns:
            The distinct chosen experts, ascending, split into consecutive groups that each
            hold at most as many streamed experts as the expert cache has slots besides those
            of its prefetches (one group when nothing streams). In ``prefetch`` mode, block
            ``layer + 1``'s likely experts are queued for reading after this block's own.
        """
        chosen = np.asarray(chosen, dtype=np.int64)
        if self._record_routing:
            self.routing.observe(layer, chosen)
        ids = [int(e) for e in np.unique(chosen)]
        # Always predicted (top-k), so a routing profile carries the prediction's recall.
        guess = self.routing.predict(layer + 1, chosen, chosen.shape[1])
        cache = self.experts_cache
        if cache is None:
            return [ids]
        cache.plan_prefetch(layer + 1, guess)
        groups: list[list[int]] = [[]]
        streamed = any_streamed = 0
        room = max(1, cache.slots - cache.prefetch)  # the prefetched experts keep their slots
        for e in ids:
            on_nvme = self._tier_of_unit[f"blk.{layer}.expert.{e}"] == "nvme"
            if on_nvme and streamed == room:
                groups.append([])
                streamed = 0
            groups[-1].append(e)
            streamed += on_nvme
            any_streamed |= on_nvme
        if not any_streamed:  # no acquire follows, which would issue the guesses after its reads
            cache.issue_prefetch()
        return groups

    def experts(self, layer: int, group: list[int]) -> dict[int, dict[str, Weight]]:
        """The weights of ``group``'s experts of block ``layer``: expert -> {``gate``, ``up``,
        ``down``: [ff, d], [ff, d], [d, ff] in MLX (out, in) order}.

        Pinned (gpu) experts are resident arrays; ram experts are copied now (``copy_seconds``);
        streamed ones come from the expert cache, pinned there until ``release_experts``.
        """
        out: dict[int, dict[str, Weight]] = {}
        streamed = []
        t0 = time.perf_counter()
        copied = False
        for e in group:
            unit = f"blk.{layer}.expert.{e}"
            tier = self._tier_of_unit[unit]
            if tier == "nvme":
                streamed.append(e)
                continue
            held = self._experts[unit]
            self.expert_uses[tier] += 1
            if tier == "gpu":
                out[e] = dict(held)  # type: ignore[arg-type]
                self.bytes_read["gpu"] += sum(_weight_nbytes(w) for w in held.values())
            else:
                out[e] = {k: self._ram_to_device(w) for k, w in held.items()}  # type: ignore[arg-type]
                self.bytes_read["ram"] += sum(_host_nbytes(w) for w in held.values())
                copied = True
        if copied:
            self.copy_seconds += time.perf_counter() - t0
        if streamed:
            if self.experts_cache is None:
                raise PlanError(f"experts of block {layer} are on nvme but no cache was started")
            out.update(self.experts_cache.acquire(layer, streamed))
        self._group_needs_eval = copied or bool(streamed)
        return {e: split_gate_up(out[e]) for e in group}

    def release_experts(self, layer: int, result: mx.array) -> mx.array:
        """Mark the last ``experts`` group used by ``result``: evaluated when any of its experts
        was copied or streamed (their buffers are then freed or reused). Returns ``result``."""
        if self._group_needs_eval:
            mx.eval(result)
            self._group_needs_eval = False
        if self.experts_cache is not None:
            self.experts_cache.release()
        return result

    def expert_counters(self) -> dict[str, float]:
        """Expert uses per tier and the expert cache's counters (``ExpertCache.counters``)."""
        out: dict[str, float] = {
            "uses_gpu": self.expert_uses["gpu"],
            "uses_ram": self.expert_uses["ram"],
        }
        if self.experts_cache is not None:
            out.update(self.experts_cache.counters())
        return out

    @property
    def pack_path(self):
        """The packed store streamed units are read from (None when nothing streams)."""
        return self._pack.path if self._pack is not None else None

    def counters(self) -> dict[str, float]:
        """Bytes read per tier so far (nvme: bytes the OS returned) and seconds of I/O wait."""
        read = dict(self.bytes_read)
        read["io_wait_s"] = 0.0
        for streamer in (self.pool, self.experts_cache):
            if streamer is not None:
                read["nvme"] += streamer.bytes_read
                read["io_wait_s"] += streamer.io_wait_s
        return read

    def read_method(self) -> dict[str, str | None]:
        """How streamed units are read from the packed store now: ``read_method`` ``direct``
        (``O_DIRECT``/``F_NOCACHE``) or ``buffered`` (the filesystem refused direct I/O, at open
        or on a later read: ``executor.direct_io.UncachedFile``), and ``read_method_detail``, the
        method in words with the reason; both None when no unit streams. Where the pool and the
        expert cache read differently, the buffered one is reported. A streamed embedding's rows
        are read buffered either way (single rows, far below the direct-I/O block)."""
        files = [s.arena.file for s in (self.pool, self.experts_cache) if s is not None]
        if not files:
            return {"read_method": None, "read_method_detail": None}
        f = min(files, key=lambda f: f.direct)  # a buffered one first
        return {"read_method": f.read_method, "read_method_detail": f.method}

    def close(self) -> None:
        """Stop streaming threads and close files."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.experts_cache is not None:
            self.experts_cache.close()
            self.experts_cache = None
        if self._pack is not None:
            os.close(self._row_fd)
            self._pack = None
        if self._pinned is not None:
            mx.synchronize()  # no copy kernel reads the registered arrays any more
            self._pinned.close()
            self._pinned = None

    @property
    def pinned_bytes(self) -> int:
        """RAM-tier bytes read by the GPU from page-locked host memory (``executor.pinned``)."""
        return 0 if self._pinned is None else self._pinned.registered_bytes

    def _pin(self, host: HostWeight) -> HostWeight:
        """A RAM-tier host weight whose arrays are page-locked copies registered for the device's
        reads, where pinned copies are on (``Pinned.adopt``: an array the runtime refuses stays
        as it was, copied the ordinary way)."""
        p = self._pinned
        if p is None:
            return host
        if isinstance(host, PackedWeight):
            return dataclasses.replace(
                host,
                weight=p.adopt(host.weight),
                scales=p.adopt(host.scales),
                biases=None if host.biases is None else p.adopt(host.biases),
            )
        return p.adopt(host)

    def _ram_to_device(self, host: HostWeight) -> Weight:
        """A RAM-tier weight on the device for one use: copied by the pinned-copy kernel where
        its arrays are registered, else as :meth:`_to_device` copies."""
        p = self._pinned
        if p is not None:
            if isinstance(host, PackedWeight):
                arrays = [a for a in (host.weight, host.scales, host.biases) if a is not None]
                parts = [p.to_device(a) for a in arrays]
                if all(x is not None for x in parts):
                    w, sc, b = (*parts, None)[:3]  # no biases: mxfp4
                    return QuantLinear(w, sc, b, bits=host.bits, group_size=host.group_size)
            else:
                a = p.to_device(host)
                if a is not None:
                    return a if a.dtype == self.dtype else a.astype(self.dtype)
        return self._to_device(host)

    def _to_device(self, host: HostWeight) -> Weight:
        w = to_mlx(host)
        if isinstance(w, mx.array) and w.dtype != self.dtype:
            w = w.astype(self.dtype)
        return w

    def tier(self, unit: str) -> str:
        """The tier a unit lives on."""
        return self._tier_of_unit[unit]

    def has(self, name: str) -> bool:
        """Whether the model has a tensor of this name."""
        return name in self._gpu or name in self._ram

    def unit(self, unit: str) -> dict[str, Weight]:
        """The unit's tensors as MLX arrays, by GGUF tensor name (short names also: ``attn_q``).

        A ``ram`` unit is copied from its host copies now; the copy time adds to
        ``copy_seconds``.
        """
        tier = self._tier_of_unit[unit]
        out: dict[str, Weight] = {}
        if tier == "nvme":
            if self.pool is None:
                raise PlanError(f"unit {unit} is on nvme but streaming was not started")
            return self.pool.acquire(unit)
        if tier == "gpu":
            tensors, nbytes = self._gpu_units[unit]
            self.bytes_read["gpu"] += nbytes
            return dict(tensors)
        else:
            t0 = time.perf_counter()
            for name in self._unit_tensors[unit]:
                out[name] = self._ram_to_device(self._ram[name])
                self.bytes_read["ram"] += _host_nbytes(self._ram[name])
            self.copy_seconds += time.perf_counter() - t0
        return out

    def release(self, unit: str, result: mx.array) -> mx.array:
        """Mark ``unit`` used by ``result``: a streamed unit's slot is freed once it is computed,
        and a RAM unit's device copy once it is computed (else a lazy step would hold every RAM
        unit's copy at once, the whole RAM tier on the device).

        Returns ``result`` (evaluated when the unit is on nvme or ram, untouched on gpu).
        """
        tier = self._tier_of_unit[unit]
        if tier == "nvme" and self.pool is not None:
            self.pool.release(result)
        elif tier == "ram":
            # At most RAM_UNITS_AHEAD units' device copies are alive: the unit's result is
            # scheduled now, and the one that many units back waited for.
            self._ram_ahead.append(result)
            mx.async_eval(result)
            while len(self._ram_ahead) > RAM_UNITS_AHEAD:
                mx.eval(self._ram_ahead.popleft())
        return result

    def rows(
        self, name: str, unit: str, ids: Sequence[int], device_ids: mx.array | None = None
    ) -> mx.array:
        """Rows ``ids`` of a (possibly quantized) table, dequantized to the compute dtype.

        Only the rows asked for are read (and, on ``ram``, copied): an embedding lookup never
        touches the whole table. ``device_ids``: the same ids as an int32 array [len(ids)]
        (``executor.host_inputs``), looked up where the table is on the device tier; None: one
        is made. Returns shape [len(ids), d].
        """
        idx = np.asarray(ids, dtype=np.int64)
        if self._tier_of_unit[unit] != "gpu" and idx.size and idx.min() < 0:
            raise StrataError(
                f"a token id not yet read from the device reached {name}'s lookup on the "
                f"{self._tier_of_unit[unit]} tier; this is a bug in pipelined scheduling"
            )
        if self._tier_of_unit[unit] == "gpu":
            w = self._gpu[name]
            table_rows = w.shape[0] if isinstance(w, mx.array) else w.weight.shape[0]
            self.bytes_read["gpu"] += _weight_nbytes(w) * len(idx) // table_rows
            if device_ids is None:
                device_ids = mx.array(idx.astype(np.int32))
            return embedding(device_ids, w, self.dtype)
        if self._tier_of_unit[unit] == "nvme":
            host = self._read_rows(name, unit, idx)
            self.bytes_read["nvme"] += _host_nbytes(host)
            return embedding(mx.arange(len(idx)), self._to_device(host), self.dtype)
        host = _rows(self._ram[name], idx)
        self.bytes_read["ram"] += _host_nbytes(host)
        return embedding(mx.arange(len(idx)), self._to_device(host), self.dtype)

    def _read_rows(self, name: str, unit: str, idx: np.ndarray) -> HostWeight:
        """Rows of a streamed table read from the packed store (one read per row and part,
        ``direct_io.pread_into``: short reads continued, ``EINTR`` retried).

        Single rows cannot be checked against the unit's CRC-32, so the unit is read through
        and checked whole on its first use (``PackStore.check_unit``, a read of the whole table
        through the page cache on the first request); rows read later are not checked again.

        Raises:
            StrataError: the file ends inside a row (the pack file is damaged).
            PackCorruptError: the unit's bytes are not the ones built.
        """
        packed = self._pack.units[unit]
        if unit not in self._rows_checked:
            try:
                self._pack.check_unit(packed, self._row_fd)
            except OSError as e:
                raise StrataError(
                    f"cannot read {unit} from the packed store {self._pack.path}: {e.strerror or e}"
                ) from None
            self._rows_checked.add(unit)
        parts = {p.kind: p for p in packed.parts if p.tensor == name}
        arrays = {}
        for kind, p in parts.items():
            row_bytes = p.nbytes // p.shape[0]
            buf = bytearray(row_bytes * len(idx))
            mv = memoryview(buf)
            for i, r in enumerate(idx):
                off = packed.offset + p.offset + int(r) * row_bytes
                got = pread_into(self._row_fd, mv[i * row_bytes : (i + 1) * row_bytes], off)
                if got != row_bytes:
                    raise StrataError(
                        f"short read of {name} row {r} from the packed store {self._pack.path}: "
                        f"the file ended after {got} of {row_bytes} bytes at offset {off}; the "
                        "pack file is damaged — delete it to rebuild"
                    )
            arrays[kind] = np.frombuffer(buf, dtype=p.dtype).reshape(len(idx), *p.shape[1:])
        if "data" in arrays:
            return arrays["data"]
        bits, group = packed.bits[name]
        cols = arrays["weight"].shape[1] * 32 // bits
        return PackedWeight(
            arrays["weight"],
            arrays["scales"],
            arrays.get("biases"),  # none: MXFP4 (``strata.common.quant``)
            bits,
            group,
            (len(idx), cols),
        )

    def resident_nbytes(self) -> dict[str, int]:
        """Bytes held per tier (gpu: MLX arrays; ram: host copies)."""
        return {
            "gpu": sum(_weight_nbytes(w) for w in self._gpu.values()),
            "ram": sum(_host_nbytes(w) for w in self._ram.values()),
            "nvme": 0,
        }


def fault_in(weights: Sequence[Weight]) -> None:
    """Move GPU-tier weights into the GPU's memory now, on MLX's CUDA backend (elsewhere: nothing).

    MLX 0.32's CUDA backend allocates an array built from host data (the loader's
    ``mx.array(numpy)``) in managed memory (``mlx/backend/cuda/allocator.h``: ``malloc`` gives
    unified memory, ``CudaBuffer.device`` -1; arrays that GPU operations write come from
    ``malloc_async`` on a device), and its pages stay on the host until the GPU touches each
    one, which then faults it in. A matmul touches its whole
    weight on its first pass, but an embedding lookup touches only the rows of its token ids,
    and its gathers were slow (docs/kernels.md#managed-memory-of-the-weights). A reduction over
    each array reads every page once, here, before any request."""
    if not mx.cuda.is_available():
        return
    arrays = [a for w in weights for a in (w.parts if isinstance(w, QuantLinear) else (w,))]
    arrays = [a for a in arrays if a is not None]  # an mxfp4 weight has no biases
    mx.eval([mx.sum(a) for a in arrays])


def _weight_nbytes(w: Weight) -> int:
    return int(w.nbytes)
