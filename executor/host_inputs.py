"""A forward pass's small integer inputs (token ids, KV slots, positions, attention tables)
written in place into host buffers kept for the engine's life, instead of new arrays per pass.

Why, on MLX's CUDA backend (0.32): an array built from host data (``mx.array(numpy)``) lives in
managed memory, and one buffer cache serves those arrays and the GPU's outputs alike
(``mlx/backend/cuda/allocator.cpp``: ``malloc_async`` reuses any cached buffer of a close size,
and moves a device buffer it hands to a host array into managed memory with a synchronous
``cudaMemcpy``). A pass that builds its inputs afresh therefore pays, before its first kernel:

- a ``cudaMallocManaged`` for each input the cache cannot serve, and where the cache hands a
  host array a buffer that a GPU operation wrote, a synchronous copy of that buffer into managed
  memory and the device buffer's ``cudaFreeAsync``;
- and at its end it frees them into the cache, where a later GPU operation's output can land in
  pages the CPU wrote last: the GPU's write then faults them over.

Turning MLX's cache off instead made every allocation a CUDA call, and warm passes slower. The
costs of each, and what staging gained: docs/kernels.md#input-staging.

Here :class:`InputStaging` keeps ``SLOTS`` int32 buffers (made once from host data, so managed
memory on CUDA; grown by doubling when a pass needs more); each pass writes its inputs into the
next one (:meth:`StagedPass.put`) and the kernels read views of it: no allocation, no copy, and
the buffers never go back to the cache. On the CPU and Metal backends the same code runs (there
an ``mx.array`` copy per input is all it saves).

MLX treats arrays as immutable, so a buffer is rewritten only once the pass that last read it has
finished: each pass records an output computed from everything it read (its logits,
:meth:`StagedPass.fence`), and the buffer's next user evaluates that first, which costs nothing
where the caller has read the logits already, as the serving loop has before its next step. A
pass that failed before recording one (it may have left lazy reads of its buffer, a KV write not
yet evaluated), or whose fence fails to evaluate, gives up its buffer: the next user makes a new
one. A pass's handle refuses inputs once a later pass has begun on its buffer. A staged array
is never donated to an operation's output: the staging object keeps a reference to its buffer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from strata.executor.cuda_driver import keep_on_host

SLOTS = 2
"""Buffers in the ring: pass i writes buffer i mod SLOTS, so pass i never waits for pass i - 1,
which may still run on the GPU while pass i's inputs are written."""

ALIGN = 16
"""Each input starts on a multiple of this many int32 elements (64 bytes): kernels may load an
input in 16-byte vectors."""

MIN_CAPACITY = 1 << 16
"""Elements of a buffer when first made (256 KiB): a decode step of 16 sequences with 2,048-slot
tables needs about 34 K; a longer pass grows the buffer (the old one then goes back to MLX's
cache once its views are gone)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class InputStaging:
    """The ring of input buffers of one engine thread (MLX arrays belong to the stream of the
    thread that made them: make and use this on one thread).

    Args:
        slots: buffers in the ring (at least 1).
        mapped: keep each buffer in host memory, mapped for the GPU (``cuda_driver.keep_on_host``;
            ``RuntimeConfig.mapped_inputs``), until it is dropped or :meth:`close`.

    Raises:
        ValueError: ``slots`` below 1.
    """

    def __init__(self, slots: int = SLOTS, mapped: bool = False):
        if slots < 1:
            raise ValueError(f"input staging needs at least one buffer, got {slots}")
        self._mapped = mapped
        self.mapped = 0  # buffers the driver keeps on the host now
        self._kept = [False] * slots  # which of them (only those are given back on a drop)
        self._buffers: list[mx.array | None] = [None] * slots
        self._hosts: list[np.ndarray | None] = [None] * slots  # numpy views of the buffers
        self._fences: list[mx.array | None] = [None] * slots
        self._unfenced = [False] * slots  # a pass began on the buffer and recorded no output
        self._uses = [0] * slots  # passes begun on each buffer: a stale StagedPass is refused
        self._next = 0
        self.grown = 0  # buffers made or remade (a new size)

    def begin(self) -> StagedPass:
        """The next pass's inputs: the next buffer of the ring once the pass that last used it
        has finished (its fence evaluated), or a new buffer where that pass recorded no fence or
        its fence failed."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        fence, self._fences[i] = self._fences[i], None
        if self._unfenced[i]:
            self._drop(i)  # its pass may have left lazy reads of the buffer: never rewrite it
        elif fence is not None:
            try:
                mx.eval(fence)
            except Exception:
                self._drop(i)  # the pass failed on the device: leave its buffer to it
        self._unfenced[i] = True
        self._uses[i] += 1
        return StagedPass(self, i, self._uses[i])

    def _drop(self, slot: int) -> None:
        """Forget buffer ``slot`` (a new one is made on its next use); views of the old one keep
        it alive for whatever still reads them. A mapped buffer is given back to the driver's
        placement first: it returns to MLX's cache once those views are gone."""
        host = self._hosts[slot]
        if host is not None and self._kept[slot] and keep_on_host(host, keep=False):
            self.mapped -= 1
        self._kept[slot] = False
        self._buffers[slot] = self._hosts[slot] = None

    def close(self) -> None:
        """Drop every buffer (the engine's end)."""
        for slot in range(len(self._buffers)):
            self._drop(slot)

    def _buffer(self, slot: int, need: int) -> tuple[mx.array, np.ndarray]:
        """Buffer ``slot`` with room for at least ``need`` elements (a new one, twice the size
        or more, where it has less: views of the old one keep it alive while they are used)."""
        buf, host = self._buffers[slot], self._hosts[slot]  # set and dropped together
        if buf is None or host is None or buf.size < need:
            size = max(MIN_CAPACITY, 2 * (0 if buf is None else buf.size), 2 * need)
            self._drop(slot)
            buf = mx.array(np.zeros(size, dtype=np.int32))
            host = np.asarray(buf)  # the buffer's own memory: writes reach the array
            if self._mapped:
                if keep_on_host(host):
                    self.mapped += 1
                    self._kept[slot] = True
                else:  # unmanaged memory, or refused: whatever part was set is taken back
                    keep_on_host(host, keep=False)
            self._buffers[slot], self._hosts[slot] = buf, host
            self.grown += 1
        return buf, host


class StagedPass:
    """One pass's use of a buffer of :class:`InputStaging` (from :meth:`InputStaging.begin`)."""

    def __init__(self, staging: InputStaging, slot: int, use: int):
        self._staging, self._slot, self._use = staging, slot, use
        self._used = 0  # elements of the buffer taken by this pass's inputs

    def put(self, a: np.ndarray) -> mx.array:
        """``a`` (integers, any shape, each within int32) as an int32 array of its shape: a view
        of the pass's buffer, written now.

        Raises:
            ValueError: the pass has recorded its fence, or a later pass has begun on its buffer
                (a layout built lazily after that would overwrite the later pass's inputs).
        """
        st = self._staging
        if st._fences[self._slot] is not None or st._uses[self._slot] != self._use:
            raise ValueError(
                "this pass's inputs are fenced, or a later pass has begun on its buffer: stage "
                "the next pass's with begin()"
            )
        flat = np.asarray(a).astype(np.int32, copy=False).reshape(-1)
        n = flat.size
        if not n:
            return mx.array(np.zeros(np.shape(a), dtype=np.int32))
        start = self._used
        old = self._staging._buffers[self._slot]
        buf, host = self._staging._buffer(self._slot, start + n)
        if buf is not old:  # a new buffer: the pass's earlier inputs stay in the old one
            start = 0
        host[start : start + n] = flat
        self._used = start + _aligned(n)
        return buf[start : start + n].reshape(np.shape(a))

    def fence(self, out: mx.array) -> None:
        """Record ``out``, an output computed from everything the pass read (its logits): the
        buffer is rewritten only after ``out`` is evaluated."""
        if self._staging._uses[self._slot] == self._use:
            self._staging._fences[self._slot] = out
            self._staging._unfenced[self._slot] = False
