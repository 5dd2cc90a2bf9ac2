"""Batch-invariant serving's pieces (the end-to-end check is in ``test_serving.py``): ``linear``
in fixed row tiles (``executor.ops.set_row_tile``) and the attention layout cut at multiples of a
tile (``ForwardBatch.build(..., tile=T)``).

On MLX's CPU backend a row's result does not depend on the call's row count, so the tiled
products must equal the untiled ones bit for bit here; what tiling buys (the same shapes on every
call) matters on CUDA.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from strata.common.errors import StrataError
from strata.executor.config import RuntimeConfig
from strata.executor.ops import QuantLinear, linear, row_tile, set_row_tile
from strata.executor.paged_kv import ForwardBatch, SeqInput

IN, OUT, TILE = 64, 48, 16
CONFIG = RuntimeConfig.build()  # this backend's defaults


@pytest.fixture
def tiled():
    """Row tiles of 16 on this thread for one test, switched off after it."""
    set_row_tile(TILE)
    yield
    set_row_tile(0)


def _weights() -> dict[str, QuantLinear | mx.array]:
    rng = np.random.default_rng(0)
    dense = mx.array(rng.standard_normal((OUT, IN)).astype(np.float32))
    q, scales, biases = mx.quantize(dense, group_size=32, bits=4)
    return {"quantized": QuantLinear(q, scales, biases, 4, 32), "dense": dense}


@pytest.mark.parametrize("kind", ["quantized", "dense"])
@pytest.mark.parametrize("shape", [(1, IN), (16, IN), (17, IN), (1, 40, IN), (2, 20, IN), (IN,)])
def test_tiled_linear_equals_untiled(kind, shape, tiled):
    w = _weights()[kind]
    x = mx.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    got = linear(x, w, CONFIG)
    set_row_tile(0)
    want = linear(x, w, CONFIG)
    assert got.shape == want.shape == (*shape[:-1], OUT)
    assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("rows, calls", [(1, [16]), (16, [16]), (17, [16, 16]), (40, [16] * 3)])
def test_every_call_has_tile_rows(rows, calls, tiled, monkeypatch):
    import strata.executor.ops as ops

    seen, one_call = [], ops._linear
    monkeypatch.setattr(
        ops, "_linear", lambda x, w, c: seen.append(x.shape[0]) or one_call(x, w, c)
    )
    linear(mx.zeros((rows, IN)), _weights()["quantized"], CONFIG)
    assert seen == calls


def test_row_tile_is_per_thread_and_checked(tiled):
    seen = []
    t = threading.Thread(target=lambda: seen.append(row_tile()))
    t.start()
    t.join()
    assert (row_tile(), seen) == (TILE, [0])
    with pytest.raises(ValueError, match="give a tile of >= 1 rows, or 0"):
        set_row_tile(-1)
    w = _weights()["quantized"]
    with pytest.raises(ValueError, match="input has 32 features"):
        linear(mx.zeros((3, 32)), w, CONFIG)


def _input(start: int, n: int, logits: str = "last", base: int = 0) -> SeqInput:
    slots = np.arange(base, base + start + n, dtype=np.int32)
    return SeqInput(list(range(n)), start, slots, logits)


def test_build_with_a_tile_cuts_at_multiples():
    """A decode, a chunk [40, 70) and a chunk inside one tile: every input is chunks; the
    second is cut at 48 and 64; rows, writes and logit rows are those of the untiled layout."""
    seqs = [
        _input(9, 1, base=1000),
        _input(40, 30, "all", base=2000),
        _input(16, 5, base=3000),
    ]
    plain, tiled = ForwardBatch.build(seqs), ForwardBatch.build(seqs, tile=16)
    assert tiled.decode_rows == 0 and plain.decode_rows == 1
    assert np.array(plain.decode_table).tolist() == [list(range(1000, 1010))]
    assert [(c.start, c.table.shape[1]) for c in plain.chunks] == [(40, 70), (16, 21)]
    spans = [(c.row, c.start, c.length, c.table.shape[1]) for c in tiled.chunks]
    assert spans == [
        (0, 9, 1, 10),  # the decode: a one-token chunk seeing its 10 slots
        (1, 40, 8, 48),
        (9, 48, 16, 64),
        (25, 64, 6, 70),
        (31, 16, 5, 21),
    ]
    owners = [(0, 10), (1, 48), (1, 64), (1, 70), (2, 21)]  # (input, the table's end)
    for c, (seq, end) in zip(tiled.chunks, owners, strict=True):
        assert np.array_equal(np.array(c.table[0]), seqs[seq].slots[:end])
    # Decodes come first in both layouts, so the rows, the writes and the logits agree.
    assert tiled.ids == plain.ids
    assert np.array_equal(np.array(tiled.write_slots), np.array(plain.write_slots))
    assert np.array(tiled.logit_rows).tolist() == np.array(plain.logit_rows).tolist()
    assert tiled.logit_counts == plain.logit_counts == [1, 30, 1]
    assert np.array(tiled.logit_rows).tolist() == [0, *range(1, 31), 35]


def test_one_per_piece_cuts_every_token():
    """A verification (``one_per_piece``) attends token by token, each as a decode would; without
    a tile the flag changes nothing."""
    v = SeqInput([1, 2, 3], 30, np.arange(33, dtype=np.int32), "all", one_per_piece=True)
    b = ForwardBatch.build([v], tile=16)
    assert [(c.start, c.length, c.table.shape[1]) for c in b.chunks] == [
        (30, 1, 31),
        (31, 1, 32),
        (32, 1, 33),
    ]
    assert [(c.start, c.length) for c in ForwardBatch.build([v]).chunks] == [(30, 3)]


def test_build_tile_edges():
    # A chunk that starts and ends on tile boundaries is cut only inside.
    b = ForwardBatch.build([_input(16, 32)], tile=16)
    assert [(c.start, c.length) for c in b.chunks] == [(16, 16), (32, 16)]
    with pytest.raises(StrataError, match="negative"):
        ForwardBatch.build([_input(0, 3)], tile=-1)


def test_cuda_row_buckets(monkeypatch) -> None:
    """On CUDA a product's rows are padded to a bucket (few kernel shapes); the result is the
    unpadded one's, sliced (checked here on the CPU with the padding forced on)."""
    from strata.executor import ops

    assert [ops.bucket_rows(r) for r in (1, 2, 3, 5, 9, 16, 17, 24, 25, 64, 65, 257, 600)] == [
        1, 2, 4, 8, 16, 16, 24, 24, 32, 64, 128, 512, 768,
    ]  # fmt: skip
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((48, 64)).astype(np.float32))
    wq = ops.QuantLinear(*mx.quantize(w, group_size=32, bits=4), bits=4, group_size=32)
    calls = []
    real = ops._linear
    monkeypatch.setattr(ops, "_linear", lambda x, w, c: calls.append(x.shape[0]) or real(x, w, c))
    unpadded, padded = CONFIG.replace(pad_rows=False), CONFIG.replace(pad_rows=True)
    for rows in (1, 3, 17, 300):
        x = mx.array(rng.standard_normal((1, rows, 64)).astype(np.float32))
        for weight in (w, wq):
            want = ops.linear(x, weight, unpadded)
            calls.clear()
            got = ops.linear(x, weight, padded)
            assert calls == [ops.bucket_rows(rows)]  # one call of the bucket's rows
            assert got.shape == want.shape == (1, rows, 48)
            assert mx.array_equal(got, want).item()
