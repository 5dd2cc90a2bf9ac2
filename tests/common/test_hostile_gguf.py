"""Hostile GGUF headers (issue 35): every value typed and bounded, names escaped, tensor data
aligned and disjoint; each refusal one ``GGUFError`` line naming the key or tensor, in bounded
time."""

from __future__ import annotations

import math
import resource

import gguf
import pytest
from gguf_bytes import VT, Parts, read_parts, write_parts
from gguf_factory import write_tiny_llama
from strata.common.describe import describe
from strata.common.errors import GGUFError
from strata.common.gguf_file import open_gguf
from strata.common.gguf_values import MAX_BLOCKS, MAX_EXPERT_UNITS, shown
from strata.executor.tokenizer import GGUFTokenizer

A = "llama"


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Parts:
    return read_parts(write_tiny_llama(tmp_path_factory.mktemp("seed") / "seed.gguf"))


def _refused(tmp_path, parts: Parts, *words: str) -> str:
    """Describe ``parts`` written to a file; the one-line GGUFError's message, checked for
    ``words``."""
    path = write_parts(tmp_path / "m.gguf", parts)
    with pytest.raises(GGUFError) as e:
        describe(str(path))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize(
    ("key", "vtype", "value", "etype", "words"),
    [
        ("block_count", VT.ARRAY, [2, 3], VT.UINT32, ("an array of 2 UINT32, not an integer",)),
        ("block_count", VT.STRING, b"2", None, ("the string '2', not an integer",)),
        ("block_count", VT.UINT64, 2**40, None, ("1099511627776", f"1 to {MAX_BLOCKS}")),
        ("embedding_length", VT.FLOAT32, math.nan, None, ("nan, not an integer",)),
        ("attention.head_count", VT.FLOAT64, math.inf, None, ("inf, not an integer",)),
        ("attention.head_count", VT.UINT32, 0, None, ("is 0, outside",)),
        (
            "attention.head_count_kv",
            VT.UINT32,
            8,
            None,
            ("is 8, outside the plausible range 0 to 4",),
        ),
        ("rope.freq_base", VT.FLOAT32, math.inf, None, ("rope.freq_base' is inf",)),
        ("rope.freq_base", VT.FLOAT32, -1.0, None, ("-1.0, outside",)),
        ("rope.scaling.factor", VT.ARRAY, [1.0, 2.0], VT.FLOAT32, ("different values",)),
        ("rope.scaling.factor", VT.FLOAT32, math.nan, None, ("is nan",)),
        ("rope.dimension_count", VT.UINT32, 2**32 - 2, None, ("4294967294",)),
        ("rope.dimension_count", VT.UINT32, 15, None, ("even number of dimensions",)),
        ("rope.dimension_count", VT.UINT32, 64, None, ("at most the head dimension 16",)),
        ("attention.layer_norm_rms_epsilon", VT.FLOAT32, -math.inf, None, ("is -inf",)),
        ("expert_count", VT.STRING, b"8", None, ("expert_count' is the string",)),
        ("expert_count", VT.UINT32, 2**17, None, ("outside the plausible range",)),
        ("expert_weights_norm", VT.UINT32, 7, None, ("is 7, not a boolean",)),
        ("expert_weights_scale", VT.FLOAT32, math.inf, None, ("is inf",)),
        ("attention.sliding_window", VT.ARRAY, [b"x"], VT.STRING, ("an array of 1 STRING",)),
        ("attention.sliding_window", VT.INT32, -5, None, ("is -5, outside",)),
        ("context_length", VT.UINT64, 2**60, None, ("outside the plausible range",)),
        ("rope.scaling.type", VT.UINT32, 1, None, ("UINT32 1, not a string",)),
    ],
)
def test_hyperparameters_are_typed_and_bounded(tmp_path, seed, key, vtype, value, etype, words):
    _refused(tmp_path, seed.set(f"{A}.{key}", vtype, value, etype), f"{A}.{key}", *words)


def test_per_layer_arrays_of_one_value_are_read_as_it(tmp_path, seed):
    ok = describe(str(write_parts(tmp_path / "ok.gguf", seed)))[0].architecture
    parts = seed.set(f"{A}.attention.head_count_kv", VT.ARRAY, [2, 2], VT.UINT32)
    arch = describe(str(write_parts(tmp_path / "m.gguf", parts)))[0].architecture
    assert arch.head_count_kv == 2 == ok.head_count_kv


def test_huge_block_counts_and_patterns_are_refused_in_bounded_time(tmp_path, seed):
    # A 66 KB file once made a per-block list of 2^40 entries (over 2 GiB).
    before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    windowed = seed.set(f"{A}.attention.sliding_window", VT.UINT32, 4)
    _refused(tmp_path, windowed.set(f"{A}.block_count", VT.UINT64, 2**40), "block_count")
    pattern = windowed.set(f"{A}.attention.sliding_window_pattern", VT.ARRAY, [1] * 10**6, VT.UINT8)
    _refused(tmp_path, pattern, "an array of 1000000 UINT8", "one BOOL per block (2)")
    experts = seed.set(f"{A}.expert_count", VT.UINT32, 2**14).set(f"{A}.block_count", VT.UINT32, 4)
    _refused(tmp_path, experts, f"limit of {MAX_EXPERT_UNITS}")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - before < 5


def test_names_are_shown_escaped():
    assert shown("\x1b[2Jerror: forged\n") == "'\\x1b[2Jerror: forged\\n'"
    assert shown("x" * 100, 10) == "'xxxxxxxxxx...'"


def test_tensor_names_with_control_characters_are_refused(tmp_path, seed):
    name = seed.tensors[0].name
    parts = seed.tensor(name, name="\x1b[2Jerror: forged")
    path = write_parts(tmp_path / "m.gguf", parts)
    with pytest.raises(GGUFError, match="holds control characters") as e:
        open_gguf(path)
    assert "\x1b" not in str(e.value) and "\\x1b[2J" in str(e.value)


def test_misaligned_and_overlapping_tensor_data_are_refused_at_open(tmp_path, seed):
    last, first = seed.tensors[-1], seed.tensors[0]
    path = write_parts(tmp_path / "a.gguf", seed.tensor(last.name, offset=last.offset + 4))
    with pytest.raises(GGUFError, match=f"'{last.name}': its offset .* not a multiple of .* 32"):
        open_gguf(path)
    path = write_parts(tmp_path / "b.gguf", seed.tensor(last.name, offset=first.offset))
    with pytest.raises(GGUFError, match="overlap"):
        open_gguf(path)


def test_overflowing_sizes_and_offsets_are_not_called_truncation(tmp_path, seed):
    t = seed.tensors[0]
    path = write_parts(tmp_path / "a.gguf", seed.tensor(t.name, shape=(2**31, 2**31)))
    with pytest.raises(GGUFError, match="its size .* overflows the file") as e:
        open_gguf(path)
    assert "truncated" not in str(e.value)
    path = write_parts(tmp_path / "b.gguf", seed.tensor(t.name, offset=2**63))
    with pytest.raises(GGUFError, match="its offset .* overflows the file"):
        open_gguf(path)
    path = write_parts(tmp_path / "c.gguf", seed.tensor(t.name, shape=(2**32, 2**32, 2**2)))
    with pytest.raises(GGUFError, match="overflows .more than 2.62 elements"):
        open_gguf(path)


@pytest.mark.parametrize(
    ("vtype", "value", "etype", "match"),
    [
        (VT.STRING, b"32", None, "general.alignment is a STRING, not a UINT32"),
        (VT.ARRAY, [32], VT.UINT32, "general.alignment is a ARRAY/UINT32, not a UINT32"),
        (VT.UINT32, 2**31, None, "not a power of two from 1 to 65536"),
    ],
)
def test_wrongly_typed_alignment_is_named(tmp_path, seed, vtype, value, etype, match):
    path = write_parts(tmp_path / "m.gguf", seed.set("general.alignment", vtype, value, etype))
    with pytest.raises(GGUFError, match=match):
        open_gguf(path)


def test_quantized_one_dimensional_tensors_are_refused(tmp_path, seed):
    norm = next(t for t in seed.tensors if len(t.shape) == 1)
    q4 = int(gguf.GGMLQuantizationType.Q4_0)
    msg = _refused(tmp_path, seed.tensor(norm.name, ggml_type=q4), "1-D tensor", "Q4_0")
    assert norm.name in msg


def test_non_utf8_vocabulary_is_one_line(tmp_path, seed):
    tokens = seed.meta["tokenizer.ggml.tokens"][2]
    parts = seed.set("tokenizer.ggml.tokens", VT.ARRAY, [b"\xff\xfe", *tokens[1:]], VT.STRING)
    path = write_parts(tmp_path / "m.gguf", parts)
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens is not valid UTF-8 text"):
        GGUFTokenizer.from_gguf(path, cache=False)


def test_tensors_of_blocks_past_block_count_are_refused(tmp_path, seed):
    t = next(t for t in seed.tensors if t.name.startswith("blk.1."))
    bad = t.name.replace("blk.1.", "blk.50000000.")
    _refused(tmp_path, seed.tensor(t.name, name=bad), bad, "belongs to block 50000000", "2 blocks")
