"""Compiled forward passes: a small pass traced once per layout with ``mx.compile``, then replayed.

A decode step or a short prefill chunk of a large model does little work on the GPU, and the
Python that builds its graph (every block's norms, projections, RoPE, KV write and attention:
about 10 operations a block) is a large part of its time, with MLX's own scheduling of the
graph (docs/kernels.md#compiled-passes).

Here such a pass is traced once by ``mx.compile``, in segments of ``segment_blocks`` blocks (the
model's ordinary ``LlamaModel.blocks``, and ``LlamaModel.head`` in the last, run on placeholder
arrays), and later passes of the same layout replay the traced graphs from C++, with no Python
per operation, each segment handed to ``mx.async_eval`` as soon as it is replayed. What varies
between passes of one layout enters as arrays: the embedded rows, each row's position, the KV
slots written, the attention tables and row metadata (``executor.attention.kernel_layout``) and
query groups (``executor.attention.kernel_groups``), the rows whose logits are returned, and
each segment's key and value pools (the updated pools come back as outputs, and replace the live
ones before the segment is evaluated, so that MLX updates a pool in place rather than copying
it). What fixes the graph's shape is the layout key (:func:`layout_key`): the pass's rows,
tokens, sequences, table width (padded to a multiple of ``TABLE_SLOTS`` so that a growing
sequence keeps its graph for that many tokens), logit rows, and the number and largest of the
query groups.

Which passes: a dense model (no MoE router, whose choice is read on the host) with every unit
resident on the device tier (a streamed unit's read is host work per pass), no row tile (the
batch-invariant mode), at most ``MAX_ROWS`` rows and ``max_sequences`` sequences, where
Strata's paged kernel attends the whole pass (``kernel_attention``: MLX's CUDA backend; its
inputs are all arrays, while the other attention paths build masks and gathers from host data).
A layout is compiled the second time it is seen (``COMPILE_AFTER``): one seen once (a passing
batch composition) runs as before rather than paying a trace. Everything else runs as before.

The replayed graph is the traced pass's graph: the same operations on the same arrays, so its logits
are the eager pass's (``tests/executor/test_pass_graph.py`` checks bit equality on the CPU, with the
kernel replaced by its definition in MLX operations; on a GPU the greedy tokens of 16 sequences were
equal, ``benchmarks/prefix_inprocess.py``). Bytes read (``WeightStore.bytes_read``) are counted per
replay as the traced pass counted them. The graphs are the model's own, and so is the runtime config
they were traced under (``LlamaModel.config``: kernel paths, segments, fused RoPE), fixed for the
model's life: the layout alone keys them. Which passes compile, and in what segments, is that
config's (``compiled_passes``, ``max_sequences``, ``segment_blocks``:
``executor.config.RuntimeConfig``). A trace that raises in Python turns compiled passes off for the
KV cache (one warning on stderr) and the pass runs eagerly (segments traced before it have written
this pass's keys and values already: the eager pass writes the same ones again); a replay whose call
raises drops its graph and fails the step, its earlier segments' writes left in the slots of that
step's sequences. Evaluation is lazy: a graph that fails when its outputs are evaluated fails that
step like any failed forward pass, and stays cached.

What it gains (docs/kernels.md#compiled-passes) is measured by ``benchmarks/prefix_inprocess.py
--variants eager,compiled``, and by ``strata bench`` against a server started with
``STRATA_COMPILED_PASSES=0`` (every pass eager).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import mlx.core as mx
from strata.executor.attention import kernel_attention, kernel_groups, kernel_layout, traced_inputs
from strata.executor.cuda_attention import QueryGroups
from strata.executor.ops import row_tile

if TYPE_CHECKING:
    from strata.executor.models.llama import LlamaModel
    from strata.executor.paged_kv import ForwardBatch, PagedKVCache

MAX_ROWS = 64
"""Passes of at most this many rows are compiled: those whose host work is a large part (decode
steps, short chunks). A longer prefill is bound by the GPU, and a trace of each of its lengths
would cost more than it saves."""

TABLE_SLOTS = 256
"""The attention tables' width is padded to a multiple of this many slots, so that a decoding
sequence keeps one graph for that many tokens (the kernel reads a row's slots only up to its
position: the padding is never read)."""

COMPILE_AFTER = 2
"""A layout is traced on its second pass: a layout seen once runs eagerly, costing no trace."""

MAX_GRAPHS = 256
"""Compiled layouts kept per model and KV cache, least recently used dropped first (a graph holds
only its tape: the weights are the model's own arrays)."""


@dataclasses.dataclass
class _Graph:
    """One layout's compiled pass: ``fns`` (``mx.compile`` of each segment's tracer), the bytes
    each segment counted per tier when it was traced (``reads``), the number of segment traces
    so far (``traced``: MLX may trace a segment again by itself), and the batch being traced
    (set per call)."""

    fns: list
    reads: list = dataclasses.field(default_factory=list)
    traced: int = 0
    batch: ForwardBatch | None = None
    ready: bool = False  # a call has traced it: later calls replay


class PassGraphs:
    """The compiled passes of one model over one paged KV cache.

    Args:
        model: the model (its ``blocks`` and ``head`` are what is traced).
        kv: the KV cache every pass reads and writes (its ``keys``/``values`` lists are
            replaced by the replayed graph's outputs).
    """

    def __init__(self, model: LlamaModel, kv: PagedKVCache):
        # The cache is held weakly: it keys this object in ``graphs_for``'s table, which drops
        # the entry once nothing else holds the cache.
        self.model, self._kv = model, weakref.ref(kv)
        store = model.store
        self.resident = model.routing is None and all(
            store.tier(u) == "gpu" for u in model.unit_order()
        )  # a dense model with every unit on the device tier
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self.replays = 0
        self.traces = 0
        self.disabled: str | None = None  # why tracing failed, once it has

    @property
    def kv(self) -> PagedKVCache:
        """The KV cache (alive while a pass over it runs)."""
        kv = self._kv()
        assert kv is not None  # graphs_for drops this object with its cache
        return kv

    def eligible(self, batch: ForwardBatch, rows: int) -> bool:
        """Whether the pass of ``batch`` over ``rows`` rows is one this module compiles."""
        m = self.model
        if rows > MAX_ROWS or row_tile() or not self.resident:
            return False
        most = m.config.max_sequences
        if most and len(batch.seq_slots) > most:
            return False
        a = m.arch
        windows = {la.window for la in m.layers}
        lone = m.config.lone_decode_kernel
        return all(
            kernel_attention(batch, self.kv, 0, a.head_count, m.dtype, w, lone) for w in windows
        )

    def run(self, batch: ForwardBatch, x: mx.array, rows: int) -> mx.array | None:
        """The pass's logits from a compiled graph, or None where the pass runs eagerly
        (not eligible, or a layout not seen ``COMPILE_AFTER`` times yet).

        Args:
            batch: the pass's tokens and KV slots.
            x: the embedded rows, [1, rows, d] in the compute dtype (padding rows included).
            rows: the pass's rows (``LlamaModel.pass_rows``).

        Returns:
            float32 logits [S, vocab] of ``batch.logit_rows``, or None.
        """
        if self.disabled or not self.eligible(batch, rows):
            return None
        width = table_width(batch)
        # The layout alone: everything else the trace depends on is the model's config.
        key = layout_key(batch, rows, width)
        graph = self._graphs.get(key)
        if graph is None:
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < COMPILE_AFTER:
                return None
            del self._seen[key]
            segments = self._segments()
            fns = [mx.compile(self._tracer(key, rows, i, *ab)) for i, ab in enumerate(segments)]
            graph = self._graphs[key] = _Graph(fns, [{} for _ in segments])
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
            if len(self._seen) > 4 * MAX_GRAPHS:  # layouts seen once, long ago
                self._seen.clear()
        self._graphs.move_to_end(key)
        tables, meta = kernel_layout(batch, rows, width)
        if tables.shape[1] != width:  # laid out before, unpadded: not this key's shape
            return None
        groups = kernel_groups(batch).array
        inputs = (x, batch.positions(rows), batch.write_slots, tables, meta, groups)
        inputs += (batch.logit_rows,)
        fresh = not graph.ready  # this call traces
        graph.batch = batch
        store = self.model.store
        read = dict(store.bytes_read)
        kv, blocks = self.kv, self.model.arch.block_count
        traced, replayed = graph.traced, []  # the segments this call replays
        try:
            out, rope = x, []
            for i, (fn, (a, b)) in enumerate(zip(graph.fns, self._segments(), strict=True)):
                before = graph.traced
                out, rope, keys, values = fn(out, *inputs[1:], rope, kv.keys[a:b], kv.values[a:b])
                if graph.traced == before:
                    replayed.append(i)
                # The segment's updated pools replace the live ones before anything is
                # evaluated: an old pool that nothing else holds is written in place (MLX
                # donates it to the scatter), where one still held would be copied whole.
                kv.keys[a:b], kv.values[a:b] = keys, values
                del keys, values
                if b < blocks:
                    mx.async_eval(out)  # the GPU starts on this segment
            logits = out
        except Exception as e:
            if not fresh:
                del self._graphs[key]  # not replayed again
                raise
            # A pass that cannot be traced (an operation mx.compile refuses) runs eagerly, and
            # so does every later pass over this cache: said once, never a failed request.
            store.bytes_read.update(read)  # the failed trace read nothing
            self.disabled = f"{type(e).__name__}: {e}"
            self._graphs.clear()
            print(
                f"warning: compiled passes are off for this KV cache: tracing failed ({e})",
                file=sys.stderr,
            )
            return None
        finally:
            graph.batch = None
        graph.ready = True
        if graph.traced != traced:  # a trace counted its own reads
            self.traces += 1
        else:
            self.replays += 1
        for i in replayed:  # a replay runs no Python: count the reads its trace counted
            for tier, n in graph.reads[i].items():
                store.bytes_read[tier] += n
        return logits

    def _segments(self) -> list[tuple[int, int]]:
        """The compiled segments' blocks, ``(first, end)`` each: the config's ``segment_blocks``
        blocks, or the whole pass where it is 0."""
        n, segment = self.model.arch.block_count, self.model.config.segment_blocks
        step = segment if segment > 0 else n
        return [(a, min(a + step, n)) for a in range(0, n, step)]

    def _tracer(self, key: tuple, rows: int, index: int, first: int, end: int):
        """The function ``mx.compile`` traces for blocks ``first .. end - 1`` of the pass: from
        the residual stream (the embedded rows for the first segment), the pass's arrays, the
        RoPE factors (a list: empty where the model has none; the first segment reads them from
        the store and returns them) and the segment's key and value pools, to the stream (the
        logits for the last segment), the factors and the updated pools."""
        last = end == self.model.arch.block_count

        def trace(x, positions, write_slots, tables, meta, groups, logit_rows, rope, keys, values):
            graph = self._graphs[key]
            assert graph.batch is not None  # set by run() around the call
            largest = kernel_groups(graph.batch).largest  # in the key: the same for every pass
            batch = dataclasses.replace(
                graph.batch,
                write_slots=write_slots,
                logit_rows=logit_rows,
                _positions={rows: positions},
                backend=traced_inputs(rows, tables, meta, QueryGroups(groups, largest)),
                _masks=dict(graph.batch._masks),
                _decode_table=None,
            )
            kv = copy.copy(self.kv)  # the segment's pools in place of the live ones
            kv.keys, kv.values = list(self.kv.keys), list(self.kv.values)
            kv.keys[first:end], kv.values[first:end] = keys, values
            model, store = self.model, self.model.store
            before = dict(store.bytes_read)
            if first == 0:
                factors = model.rope_factors()
                rope = [] if factors is None else [factors]
            x = model.blocks(x, batch, kv, rope[0] if rope else None, first, end)
            if last:
                x = model.head(x, batch)
            graph.reads[index] = {t: store.bytes_read[t] - before[t] for t in before}
            graph.traced += 1
            return x, rope, kv.keys[first:end], kv.values[first:end]

        return trace


def table_width(batch: ForwardBatch) -> int:
    """The attention tables' width (slots) in a compiled pass: the longest sequence's slots,
    rounded up to a multiple of ``TABLE_SLOTS``."""
    return -(-max(len(t) for t in batch.seq_slots) // TABLE_SLOTS) * TABLE_SLOTS


def layout_key(batch: ForwardBatch, rows: int, width: int) -> tuple[int, ...]:
    """What fixes a compiled pass's graph: rows, tokens, sequences, table width (slots), logit
    rows, and the attention kernel's query groups (their number and the largest's rows, which
    sizes its blocks). Two passes of one key differ only in their arrays' values."""
    groups = kernel_groups(batch)
    key = (rows, batch.num_tokens, len(batch.seq_slots), width, batch.logit_rows.shape[0])
    return (*key, groups.array.shape[0], groups.largest)


_BY_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replay(model: LlamaModel, batch: ForwardBatch, kv: PagedKVCache, x: mx.array, rows: int):
    """The logits of ``model``'s pass of ``batch`` over ``kv`` from a compiled graph
    (:meth:`PassGraphs.run`), or None where it runs eagerly. Passes of more than ``MAX_ROWS``
    rows, or under a row tile, are declined before any lookup."""
    if rows > MAX_ROWS or row_tile():
        return None
    return graphs_for(model, kv).run(batch, x, rows)


def compiles(model: LlamaModel, batch: ForwardBatch, kv: PagedKVCache) -> bool:
    """Whether ``model``'s pass of ``batch`` over ``kv`` is one this module compiles (traced on
    its layout's ``COMPILE_AFTER``-th sighting, replayed after): compiled passes on, and the
    pass eligible (:meth:`PassGraphs.eligible`)."""
    return model.config.compiled_passes and graphs_for(model, kv).eligible(
        batch, model.pass_rows(batch.num_tokens)
    )


def counters(kv: PagedKVCache | None) -> tuple[int, int]:
    """``(traces, replays)`` of the compiled passes over ``kv`` so far ((0, 0) when none ran)."""
    graphs = None if kv is None else _BY_CACHE.get(kv)
    return (0, 0) if graphs is None else (graphs.traces, graphs.replays)


def release(kv: PagedKVCache) -> None:
    """Drop the compiled passes traced over ``kv`` now, on the calling thread.

    Call it on the thread that traced them, before that thread ends: on MLX's CUDA backend a
    compiled pass that outlives the thread that traced it aborts the process at exit
    ("terminate called without an active exception"; docs/kernels.md, Compiled passes)."""
    if _BY_CACHE.pop(kv, None) is not None:
        gc.collect()  # a graph's cycles must not wait for a later collection on another thread


def graphs_for(model: LlamaModel, kv: PagedKVCache) -> PassGraphs:
    """The compiled passes of ``model`` over ``kv`` (made on first use, dropped with ``kv``)."""
    graphs = _BY_CACHE.get(kv)
    if graphs is None or graphs.model is not model:
        graphs = _BY_CACHE[kv] = PassGraphs(model, kv)
    return graphs
