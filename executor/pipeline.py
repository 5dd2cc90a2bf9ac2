"""A cluster plan's passes over MLX's distributed backend: rank 0's side and the other ranks' loop.

A pass goes through the ring (``strata.common.cluster``): rank 0 sends the step's descriptor to
rank 1 (which forwards it to rank 2 before it computes, and so on), embeds the tokens and runs its
blocks, and sends the residual rows ``[1, rows, d]`` (its compute dtype) to rank 1; each rank
receives them, runs its blocks and sends them on; the last rank sends them back to rank 0, which
runs the final norm and the head.

Flowing passes (``RuntimeConfig.pipeline_flow``). A pass whose output nobody reads (a long
prompt's chunks before its last: ``head`` False, no unit streamed) does not come back: its header
says so (``back`` 0), the last rank keeps its rows, and rank 0 returns its own blocks' output
(evaluated by the send) without waiting, so it builds and runs the next chunk while rank 1
computes this one: the chunks flow through the stages one behind the other. Every other pass
(logits read, or a unit streamed) comes back (``back`` 1).

Micro-batched decode steps (``RuntimeConfig.decode_micro_batches``, the plan's
``ClusterPrediction.micro_batches``). A step whose rows are all one-token inputs (decodes) of
several sequences, where rank 0 streams no unit, is cut into ``m`` micro-batches of consecutive
rows, each its own pass (its own header and ``ForwardBatch``): rank 0 embeds micro-batch 1's
rows, runs its blocks, sends them (``back`` 1) and goes on to micro-batch 2 without waiting, so
rank 1 computes micro-batch 1 while rank 0 computes micro-batch 2; once all are out it receives
them back in order, building each one's head as it comes, and the step's logits are the
micro-batches' in row order: the scheduler and the sampling see one step. A step with a prefill
chunk or a verification, or of one sequence, goes whole. Rows of different sequences are
independent, so the ids are the uncut step's wherever a row's result does not depend on the
row count of its call: on MLX's CPU (measured: ``executor.paged_kv``) and in batch-invariant
serving, whose row and attention tiles the micro-batches' headers carry as the step's would;
elsewhere a micro-batch rounds as a batch of its size would, as continuous batching's batches do.

Why it cannot deadlock: every message but one kind goes to the next rank of the ring only and
each rank receives in the order its neighbour sends, so every rank runs the passes in rank 0's
order (a chunk's KV writes come before the next chunk's reads on every rank). A send waits until
MLX's ring backend has written all its bytes to the socket (``mlx/distributed/ring/ring.cpp``
as of MLX 0.32, unchanged since 0.32.1: ``RingGroup::send`` waits on the futures of
``SocketThread::send_impl``, whose non-blocking ``::send`` loop ends once the kernel took the
last byte; two 64 MiB messages crossing in blocking sends were still waiting after 40 s, and
pass with :meth:`Ring.post`, a test): it blocks while the TCP buffers between the two ranks are
full and the receiver is not receiving: flow control, rank 0 running
ahead only as far as the buffers hold. The one message against the ring's order, the last rank's
rows back to rank 0 (``back`` 1 passes only), is sent without waiting: queued on a stream of its
own (:meth:`Ring.post`), which MLX's stream thread hands to the socket while the rank's own
thread goes on receiving. So the last rank never waits on a send; every rank before it waits in
a send only for its next rank to receive, and the last rank always does receive what comes:
the waits form a chain that ends at the last rank, never a cycle, whatever the buffers' sizes.
Rank 0 sends every micro-batch of a step before it receives any (only its receive waits on the
last rank), and it sends nothing more until it has received them all. A bound on the
micro-batches' bytes instead would rest on socket buffers no process controls (Linux's
``tcp_wmem``/``tcp_rmem`` and their autotuning, macOS's ``tcp.sendspace``), so none is used. The
doorbell (``wake``, ``executor.ranks.wait_bell``) is one byte per header, so each header sent
while a rank is busy is counted and none is slept through. A rank that dies after a pass went
out unanswered (flowing, or a micro-batch) is seen by the next send or receive that needs it (or
by rank 0's watch of its children), as in lock-step: a :class:`ClusterError`, the pipeline
broken; a last rank's queued send that fails fails its next one, and its receive from the rank
before fails too.

The descriptor is small int32 arrays: a header (:data:`HEADER`: command, body length, pass rows,
attention tile, row tile, inputs, back) and a body. A step's body is each input's token count,
start, slot count and ``one_per_piece``, then the slots: with them a rank builds the same
``ForwardBatch`` (positions, KV write slots, decode tables, chunks) as rank 0 without the token
ids, which only rank 0's embedding reads. The KV block tables are the same on every rank (the
scheduler's, on rank 0), so a KV copy (``COPY``: partial prefix-cache hits) is the same slots on
every rank.

A rank that dies: MLX's ring backend raises ``[ring] connection to a peer was lost`` in the send
or receive that needed it (within about a second: measured with MLX 0.32.4), which becomes a
:class:`ClusterError` naming the rank and host; the pipeline is broken from then on (every pass
and every request fails at once with that message) and rank 0 stops the ranks it started.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor.ops import row_tile, set_row_tile
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput

STEP, COPY, STOP = 1, 2, 3
"""The commands of a header: a forward pass, a KV slot copy, the end."""

HEADER = 7
"""int32 elements of a header: command, body length, pass rows, attention tile, row tile,
inputs, back (1: the last rank sends the pass's rows back to rank 0; 0: a flowing pass, it does
not)."""

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class ClusterError(StrataError):
    """A rank of the cluster stopped or its link failed: the pipeline cannot run passes."""


@dataclass(frozen=True)
class Peer:
    """One rank of the ring as rank 0 names it in messages."""

    rank: int
    host: str
    address: str

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.host} at {self.address})"


def encode_step(batch: ForwardBatch, rows: int, back: bool = True) -> np.ndarray:
    """The header and body of a pass (module docstring): int32 [HEADER + body]; ``back`` False:
    a flowing pass, whose rows the last rank does not send back."""
    n = len(batch.seq_slots)
    meta = np.zeros((n, 4), dtype=np.int32)
    starts = np.full(n, np.iinfo(np.int32).max, dtype=np.int64)
    np.minimum.at(starts, batch.row_inputs, batch.row_positions)
    meta[:, 0] = np.bincount(batch.row_inputs, minlength=n)
    meta[:, 1] = starts
    meta[:, 2] = [len(s) for s in batch.seq_slots]
    meta[:, 3] = batch.one_per_piece or [False] * n
    body = np.concatenate([meta.ravel(), *[np.asarray(s, np.int32) for s in batch.seq_slots]])
    head = np.array([STEP, len(body), rows, batch.tile, row_tile(), n, back], dtype=np.int32)
    return np.concatenate([head, body]).astype(np.int32)


def control_header(cmd: int, length: int) -> np.ndarray:
    """The header of a ``COPY`` or ``STOP`` (``length``: its body's int32): int32 [HEADER]."""
    head = np.zeros(HEADER, dtype=np.int32)
    head[:2] = cmd, length
    return head


def decode_step(body: np.ndarray, n: int, tile: int) -> ForwardBatch:
    """The ``ForwardBatch`` of a step's body of ``n`` inputs (:func:`encode_step`), its ids
    zeros: the same layout rank 0 built."""
    meta = body[: 4 * n].reshape(n, 4)
    slots = np.split(body[4 * n :], np.cumsum(meta[:-1, 2]))
    inputs = [
        SeqInput([0] * int(m[0]), int(m[1]), s, "none", bool(m[3]))
        for m, s in zip(meta, slots, strict=True)
    ]
    return ForwardBatch.build(inputs, tile=tile)


class Ring:
    """Sends and receives over one MLX group, every failure a :class:`ClusterError` naming the
    peer the operation needed (``name``: rank -> :class:`Peer`). On the CPU stream: the ring
    backend's operations are the CPU's (unified memory on Apple silicon: no copy)."""

    def __init__(self, group, name: Callable[[int], Peer]):
        self.group, self.name = group, name
        self.rank, self.size = group.rank(), group.size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self._posts: mx.Stream | None = None  # made by the thread that posts (MLX >= 0.31.2)

    def send(self, x: mx.array, dst: int) -> None:
        """Send ``x`` to rank ``dst`` (waits until it is handed to the link)."""
        try:
            mx.eval(mx.distributed.send(x, dst, group=self.group, stream=mx.cpu))
        except RuntimeError as e:
            raise ClusterError(f"sending to {self.name(dst)} failed: {e}") from None

    def post(self, x: mx.array, dst: int) -> None:
        """Send ``x`` to rank ``dst`` without waiting (module docstring, "Why it cannot
        deadlock"): queued on a CPU stream of this ring's own, whose thread waits for the link
        while the caller goes on; posts go out in order. A post that failed raises here at the
        next post (MLX keeps a stream's first error for its next task)."""
        if self._posts is None:
            self._posts = mx.new_stream(mx.cpu)
        try:
            mx.async_eval(mx.distributed.send(x, dst, group=self.group, stream=self._posts))
        except RuntimeError as e:
            raise ClusterError(f"sending to {self.name(dst)} failed: {e}") from None

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        """Receive an array of ``shape`` and ``dtype`` from rank ``src`` (evaluated)."""
        try:
            x = mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)
            mx.eval(x)
        except RuntimeError as e:
            raise ClusterError(f"receiving from {self.name(src)} failed: {e}") from None
        return x

    def recv_ints(self, n: int, src: int) -> np.ndarray:
        """``n`` int32 from rank ``src``, on the host."""
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        return np.array(self.recv((n,), mx.int32, src))


class Pipeline:
    """Rank 0's side of a cluster plan's passes (module docstring), on the engine thread.

    Args:
        ring: the group's sends and receives.
        dtypes: each rank's compute dtype (what it sends), by rank.
        on_fail: called once with the message when a pass fails (rank 0 stops its ranks).
        explain: turns a failed send's or receive's message into the failure's (rank 0 names
            the rank that died where it started it: ``RankSet.explain``).
        wake: called before each header: the other ranks wait for it asleep
            (``executor.ranks.Rendezvous``: MLX's receive would poll at full speed).
        flow: passes whose output nobody reads flow on without coming back (module docstring;
            ``RuntimeConfig.pipeline_flow``); False: every pass is lock-step.
        micro_batches: a decode step of several sequences is cut into up to this many
            micro-batches (module docstring; ``RuntimeConfig.decode_micro_batches``); 1: whole.

    Attributes:
        failure: None while the ranks run; the message once one stopped (every pass fails with
            it, and the server says it: ``ServingEngine.failure``).
        flowed: passes sent without waiting for them to come back (``/metrics``:
            ``strata_cluster_passes_flowed_total``).
        micro_batched: passes that were one micro-batch of a cut decode step (``/metrics``:
            ``strata_cluster_passes_micro_batched_total``).
    """

    def __init__(
        self,
        ring: Ring,
        dtypes: list[mx.Dtype],
        on_fail: Callable[[str], None] | None = None,
        explain: Callable[[str], str] | None = None,
        wake: Callable[[], None] = lambda: None,
        flow: bool = True,
        micro_batches: int = 1,
    ):
        if micro_batches < 1:
            raise StrataError(f"micro_batches is {micro_batches}; give 1 (whole steps) or more")
        self.ring, self.dtypes, self.on_fail = ring, dtypes, on_fail
        self.explain = explain or (lambda message: message)
        self.wake, self.flow, self.micro_batches = wake, flow, micro_batches
        self.flowed = self.micro_batched = 0
        self.failure: str | None = None
        self._lock = threading.Lock()  # the failure is set by the engine or the watchdog

    def fail(self, message: str) -> None:
        """Mark the pipeline broken with ``message`` (the first one stays) and tell ``on_fail``."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = message
        if self.on_fail is not None:
            self.on_fail(message)

    def _check(self) -> None:
        if self.failure is not None:
            raise ClusterError(self.failure)

    def _guard(self, action: Callable[[], mx.array]) -> mx.array:
        self._check()
        try:
            return action()
        except ClusterError as e:
            self.fail(f"the cluster stopped: {self.explain(str(e))}")
            raise ClusterError(self.failure or str(e)) from None

    def forward(self, model, batch: ForwardBatch, kv: PagedKVCache, head: bool = True) -> mx.array:
        """One pass of ``batch`` through every rank (module docstring): rank 0's embedding and
        blocks, the others' blocks, rank 0's head. With ``head`` False, no streamed unit and
        ``flow`` on, the pass flows: sent without waiting for it to come back. A decode step of
        several sequences goes as micro-batches (:meth:`cut`) where ``micro_batches`` > 1.

        Returns:
            float32 logits [S, vocab] of ``batch.logit_rows`` (or, with ``head`` False and no
            streamed unit, a residual stream: the last rank's, or where the pass flows rank 0's
            blocks' output, evaluated).

        Raises:
            ClusterError: a rank stopped or a link failed (names it); the pipeline is broken.
        """
        parts = self.cut(batch) if head and model.store.pool is None else []
        if len(parts) > 1:
            return self._micro_batched(model, parts, kv)
        headed = head or model.store.pool is not None
        back = headed or not self.flow
        x = model.embed_pass(batch)
        msg = encode_step(batch, x.shape[1], back)

        def through() -> mx.array:
            r = self.ring
            y = self._send_pass(model, batch, x, kv, msg)
            if not back:  # flowing: the next pass is built while the other ranks run this one
                self.flowed += 1
                return y
            last = r.size - 1
            return r.recv(tuple(y.shape), self.dtypes[last], last).astype(model.dtype)

        y = self._guard(through)
        return model.head(y, batch) if headed else y

    def cut(self, batch: ForwardBatch) -> list[ForwardBatch]:
        """The micro-batches of a decode step (module docstring): up to ``micro_batches``
        passes of consecutive rows (``np.array_split``: sizes differing by one at most), each
        laid out with the step's attention tile and its rows' device ids (a pipelined step's
        sampled ones included); ``[batch]`` for a step that is not cut (an input of several
        tokens, one sequence, ``micro_batches`` 1)."""
        n = len(batch.seq_slots)
        m = min(self.micro_batches, n)
        if m < 2 or batch.num_tokens != n:  # every input one token: row r is input r
            return [batch]
        ids = batch.id_array
        each = batch.one_per_piece or [False] * n
        parts = []
        for rows in np.array_split(np.arange(n), m):
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            inputs = [
                SeqInput(
                    [batch.ids[r]],
                    int(batch.row_positions[r]),
                    batch.seq_slots[r],
                    "last" if batch.logit_counts[r] else "none",
                    each[r],
                )
                for r in range(lo, hi)
            ]
            part = ForwardBatch.build(inputs, tile=batch.tile)
            part.take_ids(np.arange(hi - lo), ids[lo:hi])
            parts.append(part)
        return parts

    def _micro_batched(self, model, parts: list[ForwardBatch], kv: PagedKVCache) -> mx.array:
        """A cut decode step (module docstring): every micro-batch sent before any comes back;
        float32 logits [S, vocab] of the step, the micro-batches' in row order."""
        r = self.ring
        last = r.size - 1
        logits: list[mx.array] = []

        def through() -> None:
            shapes = []
            for part in parts:
                try:
                    x = model.embed_pass(part)
                    msg = encode_step(part, x.shape[1], True)
                except Exception as e:
                    if not shapes:  # nothing went out: the ranks are still in step
                        raise
                    # Earlier micro-batches are on their way back: no later pass would fit.
                    raise ClusterError(
                        f"rank 0 failed to build a micro-batch after the step went out: {e}"
                    ) from e
                y = self._send_pass(model, part, x, kv, msg)
                shapes.append(tuple(y.shape))
                self.micro_batched += 1
            failed: Exception | None = None
            for part, shape in zip(parts, shapes, strict=True):
                y = r.recv(shape, self.dtypes[last], last).astype(model.dtype)
                if failed is None:  # every micro-batch is received, whatever a head raised
                    try:
                        logits.append(model.head(y, part))
                        mx.async_eval(logits[-1])  # computed while the next one is waited for
                    except Exception as e:
                        failed = e
            if failed is not None:
                raise failed

        self._guard(through)
        return mx.concatenate(logits)

    def _send_pass(
        self, model, batch: ForwardBatch, x: mx.array, kv: PagedKVCache, msg: np.ndarray
    ) -> mx.array:
        """Send a pass's descriptor ``msg``, run rank 0's blocks on its embedded rows ``x`` and
        send the result on to rank 1 (returned). Once the descriptor is out, rank 1 waits for
        these rows, so a failure of the blocks breaks the pipeline (:class:`ClusterError`): no
        later message would fit."""
        self._send_message(msg)
        try:
            y = model.blocks(x, batch, kv, model.rope_factors(), *model.stage, schedule=True)
            self.ring.send(y, self.ring.next)
        except ClusterError:
            raise
        except Exception as e:
            raise ClusterError(f"rank 0's blocks failed after the step went out: {e}") from e
        return y

    def _send_message(self, msg: np.ndarray) -> None:
        r = self.ring
        self.wake()
        r.send(mx.array(msg[:HEADER]), r.next)
        if len(msg) > HEADER:
            r.send(mx.array(msg[HEADER:]), r.next)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every other rank copies KV slots ``src`` into ``dst`` too (before its next pass).

        Raises:
            ClusterError: as :meth:`forward`.
        """
        body = np.concatenate([src, dst]).astype(np.int32)
        msg = np.concatenate([control_header(COPY, len(body)), body])
        self._guard(lambda: self._send_message(msg))

    def stop(self) -> None:
        """Tell the other ranks to exit (nothing where the pipeline is broken)."""
        if self.failure is not None:
            return
        try:
            self._send_message(control_header(STOP, 0))
        except ClusterError as e:
            print(f"warning: stopping the other ranks: {e}", file=sys.stderr)


def serve_stage(
    model,
    kv: PagedKVCache,
    ring: Ring,
    sender_dtype: mx.Dtype,
    wait: Callable[[], bool] = lambda: True,
) -> None:
    """The loop of a rank past 0 (module docstring) until ``STOP``: receive a header and body
    from the rank before, hand them on (but the last rank), then copy KV slots or run a pass's
    blocks on the rows received and send them on (the last rank: back to rank 0 without waiting,
    :meth:`Ring.post`, but for a flowing pass, whose rows it only evaluates).

    Args:
        model: the stage's model (``model.stage``: its blocks).
        kv: its KV cache (``PagedKVCache.keep_layers``: its blocks' layers).
        ring: its group's sends and receives.
        sender_dtype: the compute dtype of the rank before (the rows arrive in it).
        wait: sleeps until rank 0 is about to send a header (``executor.ranks.wait_bell``);
            False: rank 0 is gone. The rows of a pass are waited for in MLX's receive, which
            polls: a doorbell for them too was tried and measured no faster (7.2 decode tok/s
            against 8.5-9.0, SmolLM2 over two loopback ranks on the shared 2-core dev CPU).

    Raises:
        ClusterError: a rank stopped (rank 0, or the rank before or after).
    """
    last = ring.rank == ring.size - 1
    while True:
        if not wait():
            raise ClusterError(f"rank {ring.rank}: {ring.name(0)} stopped")
        head = ring.recv_ints(HEADER, ring.prev)
        cmd, length, rows, tile, tiles, n, back = (int(v) for v in head)
        body = ring.recv_ints(length, ring.prev)
        if not last:
            ring.send(mx.array(head), ring.next)
            if length:
                ring.send(mx.array(body), ring.next)
        if cmd == STOP:
            return
        if cmd == COPY:
            half = length // 2
            kv.copy_slots(mx.array(body[:half]), mx.array(body[half:]))
            mx.async_eval(kv.keys + kv.values)
            continue
        if cmd != STEP:
            raise ClusterError(f"rank {ring.rank}: unknown command {cmd} from rank {ring.prev}")
        set_row_tile(tiles)
        batch = decode_step(body, n, tile)
        x = ring.recv((1, rows, model.arch.embedding_length), sender_dtype, ring.prev)
        x = model.blocks(x.astype(model.dtype), batch, kv, model.rope_factors(), *model.stage)
        if last and not back:
            mx.eval(x)  # its KV writes, as a send would evaluate them; rank 0 is not waiting
        elif last:  # the one send against the ring's order: never waited on (no cycle)
            ring.post(x, ring.next)
        else:
            ring.send(x, ring.next)
