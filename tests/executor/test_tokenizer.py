"""The GGUF tokenizer and chat templating against llama.cpp's ids for the real SmolLM2 (byte-level
BPE) and Gemma-3 (SentencePiece) files, plus tiny hand-made GGUFs for the rules those do not
exercise (BOS, other pre-tokenizers, add_space_prefix, add_eos, errors).

``data/gemma3_tokenizer_llamacpp.json`` holds llama.cpp's ids and detokenized texts for prompts of
ours on the Gemma file (made once with llama-cpp-python; its ``reference`` field says how)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import TokenType
from strata.common.catalog import CATALOG
from strata.executor.chat import NO_TEMPLATE, ChatError, messages_to_ids, render_chat
from strata.executor.tokenizer import _PRE_TOKENIZERS, GGUFTokenizer, StreamDecoder, TokenizerError

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = 2  # "<|im_end|>" in SmolLM2's vocabulary
GEMMA_REF = json.loads((DATA / "gemma3_tokenizer_llamacpp.json").read_text())
GEMMA_BYTES = range(238, 494)  # Gemma's <0x00>..<0xFF>


def _finish(writer) -> None:
    """Write a GGUFWriter's header, metadata and one small tensor (a model file has tensors),
    and close it."""
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(smollm2_gguf)


def _smollm2_cases(reference_cases: list[dict]) -> list[tuple[dict, dict]]:
    """(reference entry, its case: {"prompt": ...} or {"messages": ...}) for SmolLM2."""
    cases = {c["id"]: c for c in json.loads((DATA / "cases_visible.json").read_text())}
    return [(e, cases[e["case"]]) for e in reference_cases if e["model_file"] == SMOLLM2_FILE]


# -- SmolLM2 against llama.cpp ---------------------------------------------------------------


def test_reference_prompt_ids(smollm2: GGUFTokenizer, reference_cases: list[dict]) -> None:
    pairs = _smollm2_cases(reference_cases)
    assert {"prompt", "messages"} <= {key for _, case in pairs for key in case}
    for entry, case in pairs:
        if "prompt" in case:
            assert smollm2.encode(case["prompt"]) == entry["prompt_ids"], entry["case"]
        else:
            bos, eos = smollm2.token_text(smollm2.bos_id), smollm2.token_text(smollm2.eos_id)
            rendered = render_chat(smollm2.chat_template, case["messages"], bos, eos)
            assert rendered == entry["rendered_prompt"], entry["case"]
            assert messages_to_ids(smollm2, case["messages"]) == entry["prompt_ids"], entry["case"]


def test_reference_greedy_text_decodes(smollm2: GGUFTokenizer, reference_cases: list[dict]) -> None:
    for entry, _ in _smollm2_cases(reference_cases):
        assert smollm2.decode(entry["greedy_ids"]) == entry["greedy_text"], entry["case"]


def test_special_ids(smollm2: GGUFTokenizer) -> None:
    assert smollm2.token_text(IM_END) == "<|im_end|>"
    assert smollm2.eos_id == IM_END and smollm2.eot_id == IM_END
    assert {IM_END, 0} <= smollm2.eog_ids  # <|im_end|>, <|endoftext|>
    assert smollm2.bos_id == 1 and not smollm2.add_bos
    assert smollm2.vocab_size == 49152


def test_special_tokens_only_parsed_on_request(smollm2: GGUFTokenizer) -> None:
    assert smollm2.encode("<|im_end|>", parse_special=True) == [IM_END]
    plain = smollm2.encode("<|im_end|>")
    assert IM_END not in plain and smollm2.decode(plain) == "<|im_end|>"
    ids = smollm2.encode("a<|im_end|>b", parse_special=True)
    assert ids.count(IM_END) == 1
    assert smollm2.decode(ids) == "ab"
    assert smollm2.decode(ids, skip_special=False) == "a<|im_end|>b"


def test_explicit_bos(smollm2: GGUFTokenizer) -> None:
    assert smollm2.encode("hi", add_bos=True) == [smollm2.bos_id, *smollm2.encode("hi")]


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew\r\nlines\n\n\n",
        "héllo wörld, naïve café — “quotes” 你好 🙂 👩‍👩‍👧",
        "def f(x):\n    return x ** 2  # 1234567890",
        "",
    ],
)
def test_round_trip(smollm2: GGUFTokenizer, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_digits_split_one_by_one(smollm2: GGUFTokenizer) -> None:
    ids = smollm2.encode("12345")
    assert [smollm2.decode([i]) for i in ids] == list("12345")


def test_stream_decoder_never_splits_a_character(smollm2: GGUFTokenizer) -> None:
    text = "héllo 你好 🙂"
    ids = smollm2.encode(text)
    stream = StreamDecoder(smollm2)
    chunks = [stream.push(i) for i in ids]
    chunks.append(stream.flush())
    assert "".join(chunks) == text == smollm2.decode(ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks[:-1]  # some token ended mid-character and was held back


def test_stream_decoder_matches_decode_on_special_and_broken_bytes(
    smollm2: GGUFTokenizer,
) -> None:
    ids = [*smollm2.encode("a你"), IM_END, *smollm2.encode("你")[:1]]  # ends mid-character
    for skip in (True, False):
        stream = smollm2.stream_decoder(skip_special=skip)
        joined = "".join(stream.push(i) for i in ids) + stream.flush()
        assert joined == smollm2.decode(ids, skip_special=skip)


def test_id_outside_vocab(smollm2: GGUFTokenizer) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        smollm2.decode([smollm2.vocab_size])


# -- Gemma-3 (SentencePiece) against llama.cpp -----------------------------------------------


@functools.cache
def gemma_tokenizer(path: Path) -> GGUFTokenizer:
    """The Gemma-3 tokenizer, built once per session (test_chat_template.py uses it too)."""
    return GGUFTokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def gemma(gemma3_gguf: Path) -> GGUFTokenizer:
    return gemma_tokenizer(gemma3_gguf)


def test_gemma_reference_is_for_the_catalog_file() -> None:
    entry = CATALOG["gemma3-270m"]
    assert (GEMMA_REF["model_file"], GEMMA_REF["model_sha256"]) == (entry.filename, entry.sha256)
    assert len(GEMMA_REF["cases"]) >= 30
    assert any(set(case["ids"]) & set(GEMMA_BYTES) for case in GEMMA_REF["cases"])


@pytest.mark.parametrize(
    "case",
    GEMMA_REF["cases"],
    ids=[f"{i}-{c['text'][:20]!r}" for i, c in enumerate(GEMMA_REF["cases"])],
)
def test_gemma_matches_llamacpp(gemma: GGUFTokenizer, case: dict) -> None:
    ids = gemma.encode(case["text"], parse_special=case["parse_special"])
    assert ids == case["ids"]
    assert gemma.decode(ids) == case["detokenized"]
    assert gemma.decode(ids, skip_special=False) == case["detokenized_special"]


def test_gemma_reference_case(gemma: GGUFTokenizer, reference_cases: list[dict]) -> None:
    cases = {c["id"]: c for c in json.loads((DATA / "cases_visible.json").read_text())}
    entries = [e for e in reference_cases if e["model_file"] == CATALOG["gemma3-270m"].filename]
    assert entries
    for entry in entries:
        assert gemma.encode(cases[entry["case"]]["prompt"]) == entry["prompt_ids"], entry["case"]
        assert gemma.decode(entry["greedy_ids"]) == entry["greedy_text"], entry["case"]


def test_gemma_special_tokens(gemma: GGUFTokenizer) -> None:
    assert (gemma.bos_id, gemma.eos_id, gemma.eot_id) == (2, 1, 106)  # <bos>, <eos>, <end_of_turn>
    assert gemma.token_text(105) == "<start_of_turn>"
    assert {1, 106} <= gemma.eog_ids
    assert gemma.add_bos and not gemma.add_eos
    assert gemma.chat_template is None
    assert gemma.vocab_size == 262144
    # control tokens only on request; user-defined ones ("\n", "<b>") always, as llama.cpp
    assert gemma.encode("<start_of_turn>", add_bos=False, parse_special=True) == [105]
    assert 105 not in gemma.encode("<start_of_turn>", add_bos=False)
    assert gemma.encode("\n<b>", add_bos=False) == [gemma.hf.token_to_id(t) for t in ("\n", "<b>")]


def test_gemma_stream_decoder_never_splits_a_character(gemma: GGUFTokenizer) -> None:
    text = "𓀀 héllo 你好 🙂👩‍👩‍👧"  # 𓀀 is no token: it falls back to its 4 <0xXX> byte tokens
    ids = gemma.encode(text, add_bos=False)
    assert set(ids) & set(GEMMA_BYTES)
    stream = gemma.stream_decoder()
    chunks = [stream.push(i) for i in ids]
    chunks.append(stream.flush())
    assert "".join(chunks) == text == gemma.decode(ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks[:-1]  # a byte token ended mid-character and was held back


# -- tiny hand-made GGUFs --------------------------------------------------------------------

_BYTE_CHARS = [chr(c) for c in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]]
_BYTE_CHARS += [chr(256 + n) for n in range(256 - len(_BYTE_CHARS))]
_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _tiny_gguf(tmp_path: Path, pre: str | None = "smollm", model: str = "gpt2", **keys) -> Path:
    """A byte-level vocab (specials, the 256 byte letters, "12") with the merge "1 2".

    ``keys``: add_bos (bool), chat_template (str) to set those keys.
    """
    path = tmp_path / f"tiny-{pre}.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    tokens = [*_SPECIALS, *_BYTE_CHARS, "12"]
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL] * len(_SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(_SPECIALS))
    )
    writer.add_token_merges(["1 2"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if "add_bos" in keys:
        writer.add_add_bos_token(keys["add_bos"])
    if "chat_template" in keys:
        writer.add_chat_template(keys["chat_template"])
    _finish(writer)
    return path


def _tiny(tmp_path: Path, **kwargs) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(_tiny_gguf(tmp_path, **kwargs))


def test_unknown_pre_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"'nonsense'.*supported: .*smollm") as err:
        _tiny(tmp_path, pre="nonsense")
    assert isinstance(err.value, ValueError)


_SPM_PIECES = [
    "▁",
    "a",
    "b",
    "c",
    "é",
    "你",
    "▁a",
    "ab",
    "bc",
    "abc",
    "▁ab",
    "▁abc",
    "ca",
    "▁▁",
    "好",
]


def _tiny_spm(tmp_path: Path, **keys: bool) -> GGUFTokenizer:
    """A SentencePiece vocab: <unk>, <s>, </s>, the user-defined <tag>, the 256 <0xXX> tokens
    (ids 4..259), then ``_SPM_PIECES`` (ids 260..) with falling scores.

    ``keys``: add_space_prefix, add_eos (bool) to set those keys.
    """
    path = tmp_path / "tiny-spm.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    writer.add_token_list(["<unk>", "<s>", "</s>", "<tag>", *bytes_, *_SPM_PIECES])
    writer.add_token_types(
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.USER_DEFINED]
        + [TokenType.BYTE] * len(bytes_)
        + [TokenType.NORMAL] * len(_SPM_PIECES)
    )
    writer.add_token_scores(
        [0.0] * (4 + len(bytes_)) + [-float(i) for i in range(len(_SPM_PIECES))]
    )
    if "add_space_prefix" in keys:
        writer.add_add_space_prefix(keys["add_space_prefix"])
    if "add_eos" in keys:
        writer.add_add_eos_token(keys["add_eos"])
    _finish(writer)
    return GGUFTokenizer.from_gguf(path)


# llama.cpp's ids (llama_tokenize, add_special=True) for _tiny_spm with the defaults: BOS,
# add_space_prefix (also after a special token), byte fallback (x, \n), user-defined <tag>.
_SPM_DEFAULT_IDS = [
    ("a b  c", False, [1, 266, 260, 262, 273, 263]),
    ("abcabc<tag>abc", False, [1, 271, 269, 3, 271]),
    ("<s>abc</s> ab", True, [1, 1, 271, 2, 260, 270]),
    ("<s>abc</s> ab", False, [1, 260, 64, 119, 66, 269, 64, 51, 119, 66, 270]),
    ("é你好 bca", False, [1, 260, 264, 265, 274, 260, 268, 261]),
    ("x\n", False, [1, 260, 124, 14]),
    ("", False, [1]),
]


@pytest.mark.parametrize(("text", "parse_special", "want"), _SPM_DEFAULT_IDS)
def test_sentencepiece_defaults(tmp_path: Path, text: str, parse_special: bool, want: list) -> None:
    tok = _tiny_spm(tmp_path)
    assert tok.encode(text, parse_special=parse_special) == want
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)


def test_sentencepiece_flags(tmp_path: Path) -> None:
    """add_space_prefix false, add_eos true: llama.cpp's ids."""
    tok = _tiny_spm(tmp_path, add_space_prefix=False, add_eos=True)
    assert tok.encode("abc") == [1, 269, 2]
    assert tok.encode(" abc") == [1, 271, 2]
    assert tok.encode("") == [1, 2]
    assert tok.encode("<s>abc</s> ab", parse_special=True) == [1, 1, 269, 2, 270, 2]
    assert tok.encode("abc", add_bos=False, add_eos=False) == [269]
    assert tok.decode([1, 271, 4 + 0xC3, 4 + 0xA9, 2]) == " abcé"


@pytest.mark.parametrize("pre", sorted(_PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds(tmp_path: Path, pre: str) -> None:
    tok = _tiny(tmp_path, pre=pre)
    text = "Hello, World! 12 3456 'll\n\n  x"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


@pytest.mark.parametrize(("pre", "merged"), [("smollm", False), ("gpt-2", True), ("qwen2", False)])
def test_pre_tokenizer_decides_digit_merges(tmp_path: Path, pre: str, merged: bool) -> None:
    twelve = len(_SPECIALS) + len(_BYTE_CHARS)
    ids = _tiny(tmp_path, pre=pre).encode("12", add_bos=False)
    assert (ids == [twelve]) is merged


def test_add_bos_default_follows_llama_cpp(tmp_path: Path) -> None:
    assert _tiny(tmp_path, pre="llama-bpe").add_bos
    assert not _tiny(tmp_path, pre="smollm").add_bos
    assert _tiny(tmp_path, pre="smollm", add_bos=True).encode("x")[0] == 0


def test_no_double_bos(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    writes_bos = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = _tiny(tmp_path, add_bos=True, chat_template=writes_bos)
    ids = messages_to_ids(tok, messages)
    assert ids[0] == 0 and ids.count(0) == 1
    ids = messages_to_ids(tok, messages, template="{{ messages[0]['content'] }}")
    assert ids[0] == 0 and ids.count(0) == 1  # BOS added since the template did not write it


def test_no_chat_template(tmp_path: Path) -> None:
    with pytest.raises(ChatError) as err:
        messages_to_ids(_tiny(tmp_path), [{"role": "user", "content": "hi"}])
    assert str(err.value) == NO_TEMPLATE


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"role": "user"}], [{"role": 1, "content": "x"}], ["hi"]],
)
def test_malformed_messages(messages: object) -> None:
    with pytest.raises(ChatError):
        render_chat("{{ messages }}", messages, "", "")  # type: ignore[arg-type]


def test_template_errors_are_chat_errors() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatError, match="no system role"):
        render_chat("{{ raise_exception('no system role') }}", messages, "", "")
    with pytest.raises(ChatError, match="not valid Jinja"):
        render_chat("{% if %}", messages, "", "")
    with pytest.raises(ChatError):
        render_chat("{{ messages.__class__.__mro__ }}", messages, "", "")  # sandboxed
