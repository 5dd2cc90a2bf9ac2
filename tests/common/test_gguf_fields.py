"""GGUF metadata and tensor tables read by Strata's own header walk, checked against the
``gguf`` package's reader (``ReaderField.contents()``, ``GGUFReader.tensors``), and the reader
itself built only when tensor data is read."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import write_arch_model, write_tiny_llama
from strata.common.describe import describe
from strata.common.errors import GGUFError
from strata.common.gguf_file import open_gguf
from strata.executor.tokenizer import GGUFTokenizer

VT = gguf.GGUFValueType


def _same(a: object, b: object) -> bool:
    """Equal values of equal Python types, lists element by element (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _assert_same_as_gguf(path: Path) -> None:
    """Every key's ``field``, ``field_types`` and ``field_count``, and the tensor table, as
    ``gguf.GGUFReader`` gives them (``GGUFError`` where ``contents()`` fails on bad UTF-8)."""
    g = open_gguf(path)
    r = gguf.GGUFReader(path)
    assert g.keys() == list(r.fields)
    for key, f in r.fields.items():
        try:
            want = f.contents()
        except UnicodeDecodeError:
            with pytest.raises(GGUFError, match=f"metadata {key} is not valid UTF-8"):
                g.field(key)
        else:
            got = g.field(key)
            assert _same(got, want), (key, type(got), type(want))
        assert g.field_types(key) == tuple(f.types), key
        assert g.field_count(key) == len(f.data), key
    want_tensors = [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
        for t in r.tensors
    ]
    assert [tuple(t) for t in g.tensor_infos] == want_tensors
    for t, rt in zip(g.tensor_infos, r.tensors, strict=True):
        assert np.array_equal(g.tensor_bytes(t), np.asarray(rt.data).reshape(-1).view(np.uint8))
    assert g.field("no.such.key", 7) == 7 and g.field_types("no.such.key") is None


def _every_type_gguf(path: Path, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A GGUF with a value of every metadata type, scalar and array, in ``endian`` order."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    scalars = {
        VT.UINT8: 200,
        VT.INT8: -100,
        VT.UINT16: 60000,
        VT.INT16: -30000,
        VT.UINT32: 4_000_000_000,
        VT.INT32: -2_000_000_000,
        VT.FLOAT32: 0.1,
        VT.BOOL: True,
        VT.UINT64: 2**63 + 5,
        VT.INT64: -(2**62),
        VT.FLOAT64: 1e-300,
        VT.STRING: "héllo ▁ wörld",
    }
    for vt, v in scalars.items():
        w.add_key_value(f"test.scalar.{vt.name.lower()}", v, vt)
        w.add_key_value(f"test.array.{vt.name.lower()}", [v, v, v], VT.ARRAY, sub_type=vt)
    w.add_key_value("test.scalar.false", False, VT.BOOL)
    w.add_key_value("test.array.bools", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_key_value("test.array.nan", [float("nan"), float("inf"), -0.0], VT.ARRAY, VT.FLOAT32)
    w.add_key_value("test.array.empty_strings", ["", "a", ""], VT.ARRAY, sub_type=VT.STRING)
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _raw_gguf(
    kvs: list[tuple[bytes, int, bytes]],
    tensor_names: tuple[bytes, ...] = (b"t",),
    *,
    ttype: int = 0,
) -> bytes:
    """A little-endian GGUF v3 from raw (key, type, value bytes), with F32 [32] tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensor_names), len(kvs))
    for key, vtype, value in kvs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value
    for i, name in enumerate(tensor_names):
        out += struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 32, ttype, i * 128)
    out += b"\0" * (-len(out) % 32)
    return out + b"\1" * 128 * len(tensor_names)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_tiny_models_match_gguf(tmp_path):
    _assert_same_as_gguf(write_tiny_llama(tmp_path / "a.gguf", chat_template="{{ x }}"))
    _assert_same_as_gguf(write_tiny_llama(tmp_path / "b.gguf", tied=False, extra_vocab=11))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3moe"])
def test_architecture_models_match_gguf(tmp_path, arch, smollm2_gguf):
    _assert_same_as_gguf(write_arch_model(tmp_path / "m.gguf", arch, smollm2_gguf))


def test_every_value_type_matches_gguf(tmp_path):
    path = _every_type_gguf(tmp_path / "types.gguf", gguf.GGUFEndian.LITTLE)
    _assert_same_as_gguf(path)
    g = open_gguf(path)
    assert g.field("test.scalar.uint64") == 2**63 + 5
    assert g.field("test.scalar.bool") is True and g.field("test.scalar.false") is False
    assert g.field("test.array.string") == ["héllo ▁ wörld"] * 3
    # A fresh list each call: changing one leaves the next untouched.
    g.field("test.array.string").append("x")
    assert len(g.field("test.array.string")) == 3


def test_big_endian_files_are_refused(tmp_path):
    # Tensor data would be read in the wrong byte order (wrong tokens, exit 0): refused at open.
    path = _every_type_gguf(tmp_path / "types.gguf", gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFError, match="big-endian GGUF files are not supported"):
        open_gguf(path)


def test_empty_arrays_and_bad_utf8_values_match_gguf(tmp_path):
    arr, arr2 = struct.pack("<IQ", VT.STRING, 0), struct.pack("<IQ", VT.STRING, 2)
    p = tmp_path / "edge.gguf"
    p.write_bytes(
        _raw_gguf(
            [
                (b"general.architecture", VT.STRING, _s(b"llama")),
                (b"test.empty_strings", VT.ARRAY, arr),
                (b"test.empty_ints", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)),
                (b"test.bad_text", VT.STRING, _s(b"ab\xffcd")),
                (b"test.bad_list", VT.ARRAY, arr2 + _s(b"ok") + _s(b"\xc3")),
                (b"test.odd_bool", VT.BOOL, b"\x02"),
            ]
        )
    )
    _assert_same_as_gguf(p)
    g = open_gguf(p)
    assert g.field("test.empty_strings") == []
    assert g.field_types("test.empty_strings") == (VT.ARRAY,)
    with pytest.raises(GGUFError, match="metadata test.bad_list is not valid UTF-8 text"):
        g.field("test.bad_list")


@pytest.mark.parametrize(
    ("kvs", "names", "match"),
    [
        (
            [(b"a.b", VT.UINT8, b"\1"), (b"a.b", VT.UINT8, b"\2")],
            (b"t",),
            "metadata key 'a.b' appears twice",
        ),
        ([(b"a\xff", VT.UINT8, b"\1")], (b"t",), "key of metadata entry 0 is not valid UTF-8"),
        ([], (b"t", b"t"), "tensor 't' appears twice"),
        ([], (b"\xfft",), "name of tensor 0 is not valid UTF-8"),
        (
            [(b"general.alignment", VT.UINT64, struct.pack("<Q", 32))],
            (b"t",),
            "general.alignment is a UINT64, not a UINT32",
        ),
        (
            [(b"general.alignment", VT.UINT32, struct.pack("<I", 24))],
            (b"t",),
            "general.alignment 24 is not a power of two",
        ),
    ],
)
def test_headers_gguf_refuses_are_refused_when_opened(tmp_path, kvs, names, match):
    """What ``gguf.GGUFReader`` would refuse is refused by ``open_gguf`` itself, one line."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(_raw_gguf(kvs, names))
    with pytest.raises(Exception):  # noqa: B017 - the gguf package's own refusal, any type
        gguf.GGUFReader(p)
    with pytest.raises(GGUFError, match=match) as e:
        open_gguf(p)
    assert "\n" not in str(e.value)


def test_metadata_tokenizer_and_description_need_no_reader(tmp_path, monkeypatch):
    """Opening, describing, tokenizing and reading tensor bytes use the header walk and one
    memory map: ``gguf.GGUFReader`` is never built."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    want = GGUFTokenizer.from_gguf(path).encode("hello world <|im_end|>")
    want_bytes = np.asarray(gguf.GGUFReader(path).tensors[0].data).reshape(-1).view(np.uint8)

    def refuse(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader built")

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFReader, "__init__", refuse)
        g = open_gguf(path)
        assert g.architecture == "llama"
        desc, _ = describe(str(path))
        assert desc.architecture.vocab_size == 261
        assert len(desc.tensors) == len(g.tensor_infos)
        tok = GGUFTokenizer.from_gguf(g)
        assert tok.encode("hello world <|im_end|>") == want
        assert np.array_equal(g.tensor_bytes(g.tensor_infos[0]), want_bytes)


def test_smollm2_fields_match_gguf(smollm2_gguf):
    _assert_same_as_gguf(smollm2_gguf)
    text = "Hello, world! <|im_start|>user\nThe café costs 3.50€.<|im_end|>"
    want = [504, 3575, 282, 4649, 314]  # llama.cpp's ids (tests/executor/test_reference.py)
    assert (
        GGUFTokenizer.from_gguf(open_gguf(smollm2_gguf)).encode("The capital of France is")[-5:]
        == want
    )
    assert (
        GGUFTokenizer.from_gguf(smollm2_gguf).decode(
            GGUFTokenizer.from_gguf(smollm2_gguf).encode(text), skip_special=False
        )
        == text
    )


def test_gemma3_fields_match_gguf(gemma3_gguf):
    _assert_same_as_gguf(gemma3_gguf)


def test_a_file_changed_since_opening_is_refused(tmp_path):
    """Tensor data is mapped after ``open_gguf``: a file rewritten with another size in between
    is refused when tensor data is first read, not read with the old table."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    g = open_gguf(path)
    write_tiny_llama(path, tied=False)  # one more tensor (output.weight)
    with pytest.raises(GGUFError, match="changed since it was opened"):
        g.tensor_bytes(g.tensor_infos[0])
    # the same size, another header: a tensor renamed in place
    path = write_tiny_llama(tmp_path / "n.gguf")
    g = open_gguf(path)
    data = bytearray(path.read_bytes())
    at = data.index(g.tensor_infos[0].name.encode())
    data[at] ^= 0x20  # "token_embd" -> "Token_embd"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match="changed since it was opened"):
        g.tensor_bytes(g.tensor_infos[0])
