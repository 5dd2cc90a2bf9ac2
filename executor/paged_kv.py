"""The paged KV cache: keys and values of every sequence in fixed-size blocks of one pool, and the
layout of one batched forward pass over it.

Storage (:class:`PagedKVCache`): per layer, keys and values are ``[num_blocks * block_size,
n_kv_heads, head_dim]`` arrays in the compute dtype, one row per token slot; the token at position
p of a sequence lives in slot ``block_ids[p // block_size] * block_size + p % block_size``. Which
blocks a sequence owns is bookkeeping outside this module (``executor.block_pool``, the
scheduler); here a sequence is just its slot table.

A forward pass (:class:`ForwardBatch`) carries the next tokens of several sequences at once,
flattened into one ``[1, N, d]`` activation so that every weight is read once for all of them:

- **decodes** (one token each) come first and attend together: one gather of their keys padded
  to the longest, a boolean mask for the padding (and for sliding windows), one
  scaled-dot-product attention;
- **prefill chunks** (several tokens of one sequence) follow, each attending on its own with a
  causal mask over its sequence's earlier tokens and itself.

Every row is RoPE'd at its own position (``ForwardBatch.positions``) in one call. Which
attention backend attends the pass, and the inputs it derives from this layout (on MLX's CUDA
backend, one call of Strata's paged kernel where the chunks are short, each row naming its
sequence's slot table and its position), is ``executor.attention``'s: this module knows no
kernel. The K/V of all N tokens are written with one scatter per layer
before anyone attends, so a chunk sees its own tokens. A single sequence is the same path with
one entry (:class:`SequenceCache` gives it a private pool), so a request computes the same
numbers alone or in a batch wherever the kernels are batch-invariant (measured on MLX CPU:
quantized and dense matmul rows and padded attention are bit-identical to one row at a time).

Where they are not (MLX CUDA: the padded decode attention depends on the padded key length),
``ForwardBatch.build(..., tile=T)`` lays every input out as chunks cut at absolute positions that
are multiples of T, decodes included (one-token chunks): a token's attention call then has the
same queries and keys (its tile of its own sequence, keys up to the tile's end) whatever else is
in the batch and however the scheduler cut the prompt, provided chunks end on multiples of T
(``Scheduler(chunk_align=T)``) and prefix-cache hits are whole blocks of T tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor.host_inputs import StagedPass

ToDevice = Callable[[np.ndarray], mx.array]
"""How a pass's integer inputs become arrays: ``mx.array``, or a staged pass's ``put``
(``executor.host_inputs``: written into a buffer kept for the engine's life)."""


class PagedKVCache:
    """Keys and values of all layers in ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        n_layers: blocks (layers) of the model.
        n_kv_heads: key/value heads per layer.
        head_dim: dimension of one head.
        num_blocks: KV blocks in the pool (the plan's ``batch.kv_num_blocks``).
        block_size: tokens per block (the plan's ``batch.kv_block_size``).
        dtype: element dtype (the compute dtype).
        value_dim: None: values are a pool of their own, as wide as the keys. A width: the
            values are the first ``value_dim`` elements of each key row, stored once
            (multi-head latent attention, ``executor/models/deepseek2.py``: a row is the
            compressed latent, which is also the value, then the RoPE'd part); ``values`` is then
            empty and :meth:`gather` slices the keys.

    Memory: ``2 * n_layers * num_blocks * block_size * n_kv_heads * head_dim * dtype bytes``
    (without the factor 2 where ``value_dim`` is given), allocated on the first write (MLX arrays
    are lazy).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype,
        value_dim: int | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise StrataError(
                f"a KV cache of {num_blocks} blocks of {block_size} tokens cannot hold a token; "
                "re-plan (strata plan) with a larger context"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(n_layers)]
        self.value_dim = value_dim
        self.value_width = head_dim if value_dim is None else value_dim
        """Elements of one head's value (what attention returns per head)."""
        shared = value_dim is not None
        if shared and not 0 < value_dim <= head_dim:
            raise StrataError(
                f"values of {value_dim} elements cannot be part of {head_dim}-wide keys"
            )
        self.values = [] if shared else [mx.zeros(shape, dtype) for _ in range(n_layers)]

    @property
    def num_slots(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array | None) -> None:
        """Store ``k``/``v`` ([N, kv_heads, head_dim]) of N tokens in ``slots`` (int32 [N]);
        ``v`` None where the values are part of the keys (``value_dim``)."""
        self.keys[layer][slots] = k
        if self.values:
            self.values[layer][slots] = v

    def copy_slots(self, src: mx.array, dst: mx.array) -> None:
        """Copy every layer's keys and values of slots ``src`` into slots ``dst`` (int32 [N]
        each, ``dst`` distinct and none of them in ``src``).

        The rows are gathered and evaluated first (one synchronization), then written by one
        scatter per pool, left lazy, which updates the pool in place. Gathered and scattered in
        one graph, every scatter copied its whole pool instead (MLX 0.32: the pool was still an
        input of the gather when its scatter ran, so the scatter could not take its buffer;
        costs in docs/benchmarks.md#prefix-cache-ttft)."""
        held = [(pools, i) for pools in (self.keys, self.values) for i in range(len(pools))]
        held = [(pools, i) for pools, i in held if pools[i].shape[0]]  # a stage's layers only
        rows = [pools[i][src] for pools, i in held]
        mx.eval(rows)
        for (pools, i), r in zip(held, rows, strict=True):
            pools[i][dst] = r

    def keep_layers(self, first: int, end: int) -> None:
        """Hold the pools of layers ``first .. end - 1`` only (a pipeline stage of a cluster
        plan: ``executor.pipeline``): the others become empty arrays, never allocated, which
        :meth:`copy_slots` skips."""
        for pools in (self.keys, self.values):
            for i, pool in enumerate(pools):
                if not first <= i < end:
                    pools[i] = mx.zeros((0, *pool.shape[1:]), pool.dtype)

    def gather(self, layer: int, table: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values of the slots in ``table`` (int32 [B, L]): [B, kv_heads, L, head_dim]
        and [B, kv_heads, L, value_width] (the keys' first ``value_dim`` elements where the
        values are part of them)."""
        k = self.keys[layer][table].transpose(0, 2, 1, 3)
        if not self.values:
            return k, k[..., : self.value_dim]
        v = self.values[layer][table].transpose(0, 2, 1, 3)
        return k, v


def slot_table(
    block_ids: list[int],
    block_size: int,
    length: int,
    lent: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """Slots of positions ``0..length-1`` of a sequence that owns ``block_ids`` (int32 [length]);
    with ``lent`` = ``(position, block, tokens)``, positions ``position .. + tokens - 1`` read
    slots ``0 .. tokens - 1`` of ``block`` instead (a partial prefix-cache hit,
    ``BlockPool.match_partial``; ``position`` a multiple of ``block_size``).

    Raises:
        StrataError: the blocks hold fewer than ``length`` tokens (a scheduler bug).
    """
    if length > len(block_ids) * block_size:
        raise StrataError(
            f"{length} tokens need {-(-length // block_size)} KV blocks but the sequence has "
            f"{len(block_ids)}; this is a bug in block allocation"
        )
    blocks = np.asarray(block_ids, dtype=np.int32)
    pos = np.arange(length, dtype=np.int32)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    if lent is not None:
        position, block, tokens = lent
        end = min(position + tokens, length)
        slots[position:end] = block * block_size + np.arange(end - position, dtype=np.int32)
    return slots


@dataclass
class SeqInput:
    """One sequence's part of a forward pass.

    Attributes:
        ids: the tokens to compute now (positions ``start .. start + len(ids) - 1``).
        start: position of ``ids[0]`` (tokens already in the KV cache).
        slots: int32 [start + len(ids)], the KV slot of every position (:func:`slot_table`).
        logits: ``"last"`` (the last token's logits), ``"all"`` (every token's) or ``"none"``.
        one_per_piece: with a tile (``ForwardBatch.build``), attend one token per piece, as a
            decode does: a speculative verification's tokens then compute exactly what decoding
            them one at a time would. Ignored without a tile.
    """

    ids: list[int]
    start: int
    slots: np.ndarray
    logits: str = "last"
    one_per_piece: bool = False


@dataclass
class Chunk:
    """Tokens ``start .. start + length - 1`` of one sequence attending together: rows ``row ..
    row + length - 1`` of the activation (a prefill chunk, or with tiles a piece of any input).
    ``slots``: int32 [start + length], the slots of its sequence's positions up to its end."""

    row: int
    length: int
    start: int
    slots: np.ndarray
    to_device: ToDevice = mx.array
    backend: dict = field(default_factory=dict)
    """Arrays an attention backend derives from the chunk once, for every layer
    (``executor.attention``)."""
    _masks: dict[int, tuple[int, mx.array | str | None]] = field(default_factory=dict)
    _table: mx.array | None = None

    @property
    def table(self) -> mx.array:
        """``slots`` on the device, int32 [1, start + length]: made on first use (a pass that
        one kernel call attends whole never needs it), then kept."""
        if self._table is None:
            self._table = self.to_device(self.slots[None])
        return self._table

    def attention_mask(self, window: int) -> tuple[int, mx.array | str | None]:
        """Which of ``table``'s keys the chunk's queries attend and how: ``(first, mask)`` for
        ``mx.fast.scaled_dot_product_attention`` over keys ``first:`` of the gathered table.

        Query i (position ``start + i``) sees key j iff ``j <= start + i`` and, with a sliding
        ``window`` (llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``), ``start + i - j < window``; keys
        older than every query's window are sliced off (``first``): ``"causal"`` (bottom-right
        aligned) without a window, None for one query, else a boolean [T, L - first] mask. Cached
        per window: every layer with that window reuses it.
        """
        if window not in self._masks:
            self._masks[window] = self._mask(window)
        return self._masks[window]

    def _mask(self, window: int) -> tuple[int, mx.array | str | None]:
        t, start = self.length, self.start
        if not window:
            return 0, "causal" if t > 1 else None
        first = max(0, start - window + 1)  # the oldest key the first query sees
        if t == 1:
            return first, None
        qpos = mx.arange(start, start + t)[:, None]
        kpos = mx.arange(first, start + t)[None, :]
        return first, (kpos <= qpos) & (qpos - kpos < window)


@dataclass
class ForwardBatch:
    """The layout of one forward pass over the paged KV cache (see the module docstring).

    Attributes:
        ids: the N tokens, decodes first, then each prefill chunk's tokens.
        write_slots: int32 [N], the KV slot each token's keys/values go to.
        decode_rows: B, the number of decode sequences (rows ``0 .. B-1``, one token each).
        decode_slots: int32 [B, L], each decode sequence's slots, padded to the longest (L)
            with 0 (on the device: ``decode_table``).
        decode_lengths: int [B], each decode sequence's length including its new token.
        chunks: the prefill chunks (with a tile: every input's pieces), in row order after the
            decodes.
        logit_rows: int32 [S], the rows whose logits are returned, in the order of the inputs.
        logit_counts: rows of ``logit_rows`` per input (0, 1 or its token count).
        seq_slots: per input, the slots of its positions up to its last new token.
        row_inputs: int32 [N], the input each row belongs to (its index in ``seq_slots``).
        row_positions: int32 [N], each row's position in its sequence.
        to_device: how the pass's integer inputs become arrays (``mx.array``, or a staged
            pass's ``put``).
        backend: arrays an attention backend derives from the layout once per pass, kept for
            every layer (``executor.attention``), by a key of that module's choosing.
        tile, one_per_piece: the ``tile`` and each input's ``one_per_piece`` it was built with
            (a pipeline stage builds the same layout from them: ``executor.pipeline``).
    """

    ids: list[int]
    write_slots: mx.array
    decode_rows: int
    decode_slots: np.ndarray
    decode_lengths: np.ndarray
    chunks: list[Chunk]
    logit_rows: mx.array
    logit_counts: list[int]
    seq_slots: list[np.ndarray] = field(default_factory=list)
    row_inputs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    row_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    to_device: ToDevice = mx.array
    backend: dict = field(default_factory=dict)
    tile: int = 0
    one_per_piece: list[bool] = field(default_factory=list)
    _ids: mx.array | None = None
    _masks: dict[int, mx.array | None] = field(default_factory=dict)
    _positions: dict[int, mx.array] = field(default_factory=dict)
    _decode_table: mx.array | None = None

    @classmethod
    def build(
        cls, seqs: list[SeqInput], tile: int = 0, staged: StagedPass | None = None
    ) -> ForwardBatch:
        """Lay ``seqs`` out: one-token inputs form the decode group, the others are chunks.

        Args:
            seqs: the inputs; their rows are contiguous, in the decode group or as chunks.
            tile: 0: as above. T > 0 (batch-invariant serving, module docstring): no decode
                group; every input becomes chunks cut at absolute positions that are multiples
                of T (start 40, 30 tokens, T 16: [40, 48), [48, 64), [64, 70)), each attending
                to the slots of its sequence up to its own end; an input with
                ``one_per_piece`` is cut at every token. ``write_slots`` and ``logit_rows`` are
                the same as without tiles.
            staged: where the pass's integer inputs are written (``executor.host_inputs``);
                None: a new array each.

        Raises:
            StrataError: an input without tokens, or with fewer slots than its positions; a
                negative ``tile``.
        """
        if not seqs or any(not s.ids for s in seqs):
            raise StrataError("a forward pass needs at least one token per sequence")
        for s in seqs:
            if len(s.slots) < s.start + len(s.ids):
                raise StrataError(
                    f"an input of {len(s.ids)} tokens at position {s.start} has "
                    f"{len(s.slots)} KV slots, fewer than its positions; this is a bug in "
                    "block allocation"
                )
        if tile < 0:
            raise StrataError(f"attention tile {tile} is negative; give 0 (none) or a block size")
        to_device = mx.array if staged is None else staged.put
        grouped = [len(s.ids) == 1 and not tile for s in seqs]  # in the decode group
        decodes = [i for i, g in enumerate(grouped) if g]
        prefills = [i for i, g in enumerate(grouped) if not g]
        ids: list[int] = []
        writes: list[np.ndarray] = []
        row_of: dict[int, int] = {}
        for i in decodes:
            s = seqs[i]
            row_of[i] = len(ids)
            ids.extend(s.ids)
            writes.append(s.slots[s.start : s.start + 1])
        lengths = np.array([seqs[i].start + 1 for i in decodes], dtype=np.int64)
        padded = np.zeros((len(decodes), int(lengths.max()) if decodes else 0), dtype=np.int32)
        for r, i in enumerate(decodes):
            padded[r, : lengths[r]] = seqs[i].slots[: lengths[r]]
        chunks = []
        for i in prefills:
            s = seqs[i]
            row_of[i] = len(ids)
            end = s.start + len(s.ids)
            for lo, hi in _pieces(s.start, end, 1 if tile and s.one_per_piece else tile):
                chunks.append(Chunk(row_of[i] + lo - s.start, hi - lo, lo, s.slots[:hi], to_device))
            ids.extend(s.ids)
            writes.append(s.slots[s.start : end])
        rows: list[int] = []
        counts = []
        row_inputs = np.zeros(len(ids), dtype=np.int32)
        row_positions = np.zeros(len(ids), dtype=np.int32)
        for i, s in enumerate(seqs):
            n = {"last": 1, "all": len(s.ids), "none": 0}[s.logits]
            rows.extend(range(row_of[i] + len(s.ids) - n, row_of[i] + len(s.ids)))
            counts.append(n)
            mine = slice(row_of[i], row_of[i] + len(s.ids))
            row_inputs[mine] = i
            row_positions[mine] = np.arange(s.start, s.start + len(s.ids))
        return cls(
            ids=ids,
            write_slots=to_device(np.concatenate(writes)),
            decode_rows=len(decodes),
            decode_slots=padded,
            decode_lengths=lengths,
            chunks=chunks,
            logit_rows=to_device(np.array(rows, dtype=np.int32)),
            logit_counts=counts,
            seq_slots=[s.slots[: s.start + len(s.ids)] for s in seqs],
            row_inputs=row_inputs,
            row_positions=row_positions,
            to_device=to_device,
            tile=tile,
            one_per_piece=[s.one_per_piece for s in seqs],
        )

    @property
    def num_tokens(self) -> int:
        """N, the pass's tokens (its rows before any padding)."""
        return len(self.ids)

    @property
    def id_array(self) -> mx.array:
        """``ids`` on the device, int32 [N]: made on first use, then kept."""
        if self._ids is None:
            self._ids = self.to_device(np.asarray(self.ids, dtype=np.int32))
        return self._ids

    def take_ids(self, rows: np.ndarray, tokens: mx.array) -> None:
        """Rows ``rows`` (int [R]) of the pass take their token ids from ``tokens`` (int32 [R]
        on the device: a previous step's sampled ids the host has not read, pipelined steps)
        in place of ``ids``, whose values there are placeholders; the other rows keep theirs.
        Call it before the pass is built (it sets ``id_array``). A negative token (a previous
        row whose logits were not finite: its request fails) is read as 0, never as an index
        before the table."""
        n = self.num_tokens
        host = np.asarray(self.ids, dtype=np.int32).copy()
        host[rows] = 0
        src = np.zeros(n, dtype=np.int32)
        src[rows] = np.arange(len(rows), dtype=np.int32)
        taken = np.zeros(n, dtype=np.int32)
        taken[rows] = 1
        fed = mx.maximum(tokens, 0)[self.to_device(src)]
        self._ids = mx.where(self.to_device(taken) > 0, fed, self.to_device(host))

    @property
    def decode_table(self) -> mx.array:
        """``decode_slots`` on the device, int32 [B, L]: made on first use, then kept."""
        if self._decode_table is None:
            self._decode_table = self.to_device(self.decode_slots)
        return self._decode_table

    def positions(self, rows: int) -> mx.array:
        """int32 [rows]: each row's position (its RoPE offset), 0 for the rows past
        ``num_tokens`` that pad the pass. Made once per pass, for every layer.

        Raises:
            StrataError: ``rows`` is below the pass's tokens.
        """
        if rows not in self._positions:
            self.check_rows(rows)
            positions = np.zeros(rows, dtype=np.int32)
            positions[: self.num_tokens] = self.row_positions
            self._positions[rows] = self.to_device(positions)
        return self._positions[rows]

    @functools.cached_property
    def table_width(self) -> int:
        """Slots of the longest input's table (up to its last new token)."""
        return max(len(t) for t in self.seq_slots)

    def check_rows(self, rows: int) -> None:
        """Refuse a layout of the pass in fewer ``rows`` than its tokens.

        Raises:
            StrataError: ``rows`` is below ``num_tokens``.
        """
        if rows < self.num_tokens:
            n = self.num_tokens
            raise StrataError(f"a pass of {n} tokens cannot be laid out in {rows} rows")

    def decode_mask(self, window: int) -> mx.array | None:
        """Boolean [B, 1, 1, L] mask of the decode group's keys for a ``window`` (0: none):
        key j of sequence b is seen iff ``j < length_b`` and, with a window, ``length_b - 1 - j <
        window``. None when nothing is masked (one sequence, no window reach)."""
        if window not in self._masks:
            lengths = self.decode_lengths
            width = int(lengths.max())
            kpos = np.arange(width)[None, :]
            keep = kpos < lengths[:, None]
            if window:
                keep &= (lengths[:, None] - 1 - kpos) < window
            self._masks[window] = None if keep.all() else mx.array(keep[:, None, None, :])
        return self._masks[window]


def _pieces(start: int, end: int, tile: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at the multiples of ``tile`` inside it (0: not cut)."""
    if not tile:
        return [(start, end)]
    cuts = range((start // tile + 1) * tile, end, tile)
    bounds = [start, *cuts, end]
    return list(zip(bounds, bounds[1:], strict=False))


class SequenceCache:
    """A private paged KV cache for one sequence of at most ``max_tokens`` tokens (teacher-forced
    logits: ``Engine.logits_for``), its blocks in order.

    Args:
        n_layers, n_kv_heads, head_dim, dtype, value_dim: as :class:`PagedKVCache`.
        max_tokens: most tokens the sequence may hold (the plan's context).
        block_size: tokens per block.

    Attributes:
        offset: tokens already stored (the position of the next token).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: mx.Dtype,
        block_size: int = 16,
        value_dim: int | None = None,
    ):
        blocks = -(-max_tokens // block_size)
        self.kv = PagedKVCache(n_layers, n_kv_heads, head_dim, blocks, block_size, dtype, value_dim)
        self.max_tokens = max_tokens
        self.offset = 0
        self._slots = np.arange(blocks * block_size, dtype=np.int32)

    def next_input(self, ids: list[int], logits: str) -> SeqInput:
        """The sequence's next ``ids`` as a forward-pass input.

        Raises:
            StrataError: the sequence would exceed ``max_tokens``.
        """
        end = self.offset + len(ids)
        if end > self.max_tokens:
            raise StrataError(
                f"sequence of {end} tokens exceeds the plan's context of {self.max_tokens}; "
                "re-plan with a larger --context or lower --max-tokens"
            )
        return SeqInput(list(ids), self.offset, self._slots[:end], logits)

    def advance(self, t: int) -> None:
        """Mark ``t`` more tokens as stored."""
        self.offset += t
