"""Chunked encoding of long texts (``executor.tokenizer._ChunkCache``): the same ids as encoding
each piece whole, for every pre-tokenizer family, and the chunk cache doing its job.

The families are checked on a byte-level vocab (``_pair_tokenizer``) whose highest-ranked merges
join a letter to the space after it: a pre-tokenizer that did not cut before such a space would
make those tokens when encoding whole, but never in chunks (``test_a_straddling_regex_is_caught``
shows the check failing for such a regex)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import pytest
from gguf import TokenType
from strata.executor import tokenizer as tokenizer_module
from strata.executor.tokenizer import (
    _PRE_TOKENIZER_GROUPS,
    GGUFTokenizer,
    _ChunkCache,
    _PreTokenizer,
    _safe_chunks,
)
from test_tokenizer import _BYTE_CHARS, _SPECIALS, _finish, _tiny_spm

_LETTERS = [chr(c) for c in [*range(0x41, 0x5B), *range(0x61, 0x7B)]]
_PAIR_CHARS = [*_LETTERS, "Ġ", "Ċ", "'", ".", ",", *"0123456789"]  # Ġ, Ċ: space, newline


def _pair_gguf(tmp_path: Path, pre: str, added: tuple[str, ...] = ()) -> Path:
    """A byte-level vocab: specials, the 256 byte letters, every pair of ``_PAIR_CHARS``, then
    ``added`` (user-defined). Merges: each letter + space first, then the other pairs in a
    fixed shuffled order."""
    pairs = [(a, b) for a in _PAIR_CHARS for b in _PAIR_CHARS]
    random.Random(0).shuffle(pairs)
    pairs.sort(key=lambda p: not (p[0] in _LETTERS and p[1] == "Ġ"))  # stable
    path = tmp_path / f"pairs-{pre}.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    tokens = [*_SPECIALS, *_BYTE_CHARS, *(a + b for a, b in pairs), *added]
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL] * len(_SPECIALS)
        + [TokenType.NORMAL] * (len(tokens) - len(_SPECIALS) - len(added))
        + [TokenType.USER_DEFINED] * len(added)
    )
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    _finish(writer)
    return path


def _pair_tokenizer(tmp_path: Path, pre: str, added: tuple[str, ...] = ()) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(_pair_gguf(tmp_path, pre, added))


def _whole(tok: GGUFTokenizer, text: str, **kwargs) -> list[int]:
    """``tok.encode`` with every piece encoded whole (chunking off)."""
    chunks, tok.chunks = tok.chunks, None
    try:
        return tok.encode(text, **kwargs)
    finally:
        tok.chunks = chunks


def _chunk_small(tok: GGUFTokenizer, chunk_chars: int) -> _ChunkCache:
    """Chunk every piece, the first safe boundary ``chunk_chars`` on."""
    assert tok.chunks is not None
    tok.chunks.min_chars, tok.chunks.chunk_chars = 0, chunk_chars
    return tok.chunks


_FRAGMENTS = [
    *["the", "Cat", "SAYS", "eXample", "iPhone", "a", "I", "x", "QwErTy", "ok"],
    *["'s", "'S", "'ll", "'LL", "'re", "'ve", "'m", "'d", "'t", "'", "''", "'x"],
    *["1", "12", "123", "1234567", "3.14", "1,000", "٣", "²"],
    *[".", ",", "!", "?", "...", "…", "(", ")", "-", "--", '"', "/", "#", "$", "+", "<=>", "`"],
    *["\n", "\n\n", "\r\n", "\t", "  ", "   ", "\u00a0", "\u3000", "\u2009"],
    *["é", "naïve", "Straße", "Ωmega", "жук", "e\u0301", "n\u0303o", "ǅ", "ﬁ"],
    *["你好", "中文", "ひらがな", "カタカナ", "한국어", "。", "，", "、", "।", "۔"],
    *["🙂", "👩\u200d👩\u200d👧", "😀😀", "\u200b"],
]


def _random_text(rng: random.Random, n: int) -> str:
    """``n`` random fragments, mostly separated by one space (so many safe boundaries)."""
    parts = []
    for _ in range(n):
        parts.append(rng.choice(_FRAGMENTS))
        parts.append(rng.choice([" "] * 6 + ["", "  ", "\n", " '"]))
    return "".join(parts)


_FAMILIES = [names[0] for names, _ in _PRE_TOKENIZER_GROUPS]


@pytest.mark.parametrize("pre", _FAMILIES)
def test_chunks_encode_as_whole(tmp_path: Path, pre: str) -> None:
    tok = _pair_tokenizer(tmp_path, pre)
    rng = random.Random(pre)
    english = " ".join(rng.choice(_LETTERS[26:]) * rng.randint(1, 6) for _ in range(300))
    texts = [english, *(_random_text(rng, rng.randint(1, 150)) for _ in range(60))]
    for chunk_chars in (1, 3, 16):
        chunks = _chunk_small(tok, chunk_chars)
        for text in texts:
            assert tok.encode(text) == _whole(tok, text), (chunk_chars, text)
        assert len(_safe_chunks(english, chunk_chars)) > 10
    assert chunks._ids  # the chunked path ran


def test_a_straddling_regex_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regex whose matches run over the space after a word: chunking it would change ids,
    and the comparison above sees it."""
    straddling = _PreTokenizer((r"\S+ ?",))
    monkeypatch.setitem(tokenizer_module._PRE_TOKENIZERS, "straddling", straddling)
    tok = _pair_tokenizer(tmp_path, "straddling")
    _chunk_small(tok, 1)
    text = "the cat sat on the mat"
    assert tok.encode(text) != _whole(tok, text)


def test_safe_chunks() -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = _random_text(rng, rng.randint(0, 60))
        chunks = _safe_chunks(text, rng.randint(1, 40))
        assert "".join(chunks) == text
        for chunk in chunks[1:]:  # each cut: letter, space, letter
            assert chunk[0] == " " and chunk[1].isascii() and chunk[1].isalpha()
        for before in chunks[:-1]:
            assert before[-1].isascii() and before[-1].isalpha()
    text = "word " * 100
    assert _safe_chunks(text, 512) == [text]
    assert _safe_chunks(text, 12) == ["word word word", *[" word word word"] * 32, " word "]
    # a shared prefix is cut alike, up to the last cut before the texts part
    a, b = _safe_chunks(text + "one two", 12), _safe_chunks(text + "three", 12)
    assert a[:-1] == b[:-1] and a[-1] != b[-1]


class _CountingHF:
    """Passes calls to a HF tokenizer, recording the texts of each ``encode_batch``."""

    def __init__(self, hf):
        self.hf = hf
        self.batches: list[list[str]] = []

    def encode(self, *args, **kwargs):
        return self.hf.encode(*args, **kwargs)

    def encode_batch(self, texts, **kwargs):
        self.batches.append(list(texts))
        return self.hf.encode_batch(texts, **kwargs)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(smollm2_gguf)


def _document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "report", "of", "a", "market", "Paris", "it's", "grew", "by", "12%", "and"]
    ends = [""] * 8 + [".", ",", "\n\n"]
    return " ".join(rng.choice(vocab) + rng.choice(ends) for _ in range(words))


def test_cache_encodes_only_new_chunks(smollm2: GGUFTokenizer) -> None:
    chunks = smollm2.chunks
    assert chunks is not None and chunks.min_chars == 1024
    counting = _CountingHF(chunks.hf)
    chunks.hf = counting
    try:
        chunks.clear()
        doc = _document(0, 1000)
        question = " What grew? Answer in one word."
        first = smollm2.encode(doc + question)
        assert first == _whole(smollm2, doc + question)
        n_chunks = len(_safe_chunks(doc + question, chunks.chunk_chars))
        assert n_chunks >= 8 and [len(b) for b in counting.batches] == [n_chunks]
        other = doc + " Who wrote it?"
        assert smollm2.encode(other) == _whole(smollm2, other)
        cut = _safe_chunks(doc + question, chunks.chunk_chars)
        seen = set(cut[:-1])  # a text's last chunk is not remembered
        new = [c for c in _safe_chunks(other, chunks.chunk_chars) if c not in seen]
        assert len(counting.batches) == 2 and counting.batches[1] == new
        assert len("".join(new)) < 2 * chunks.chunk_chars + 30  # the tail only
        assert smollm2.encode(doc + question) == first
        assert counting.batches[2:] == [[cut[-1]]]  # the rest remembered
        smollm2.encode("a short prompt")
        assert len(counting.batches) == 3  # encoded whole
    finally:
        chunks.hf = counting.hf


def test_cache_is_bounded_and_thread_safe(smollm2: GGUFTokenizer) -> None:
    chunks = smollm2.chunks
    assert chunks is not None
    saved = chunks.max_chunks, chunks.chunk_chars
    chunks.max_chunks, chunks.chunk_chars = 20, 64
    try:
        texts = [_document(seed % 7, 400) + f" question {seed}" for seed in range(40)]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(smollm2.encode, texts))
        assert got == [_whole(smollm2, text) for text in texts]
        assert len(chunks._ids) <= 20
    finally:
        chunks.max_chunks, chunks.chunk_chars = saved
        chunks.clear()


def test_long_and_last_chunks_are_not_remembered(smollm2: GGUFTokenizer) -> None:
    """A chunk runs to the first safe boundary past ``chunk_chars``: text with none for a while
    (CJK) makes a long one, which is encoded but not remembered (the cache's size stays bounded
    in characters); nor is a text's last chunk, which a longer text would cut elsewhere."""
    chunks = smollm2.chunks
    assert chunks is not None
    chunks.clear()
    try:
        text = "中" * 3000 + "x y" + " abc" * 600
        cut = _safe_chunks(text, chunks.chunk_chars)
        assert len(cut[0]) > chunks.keep_chars and len(cut) > 3
        assert smollm2.encode(text) == _whole(smollm2, text)
        assert set(chunks._ids) == set(cut[1:-1])
        assert max(len(c) for c in chunks._ids) <= chunks.keep_chars
    finally:
        chunks.clear()


@pytest.mark.parametrize("chunk_chars", [1, 7, 512])
def test_smollm2_chunks_encode_as_whole(smollm2: GGUFTokenizer, chunk_chars: int) -> None:
    chunks = smollm2.chunks
    assert chunks is not None
    saved = chunks.min_chars, chunks.chunk_chars
    _chunk_small(smollm2, chunk_chars)
    try:
        rng = random.Random(chunk_chars)
        texts = [_document(1, 2000), *(_random_text(rng, rng.randint(1, 200)) for _ in range(50))]
        for text in texts:
            for parse_special in (False, True):
                special = text.replace("\n\n", "<|im_end|>\n", 3)
                want = _whole(smollm2, special, parse_special=parse_special)
                assert smollm2.encode(special, parse_special=parse_special) == want, text
    finally:
        chunks.min_chars, chunks.chunk_chars = saved
        chunks.clear()


def test_sentencepiece_is_never_chunked(tmp_path: Path) -> None:
    tok = _tiny_spm(tmp_path)
    assert tok.chunks is None
    text = "abc ab " * 500
    assert tok.encode(text)[:3] == [1, 271, 270]


def test_no_chunking_with_a_spaced_added_token(tmp_path: Path) -> None:
    assert _pair_tokenizer(tmp_path, "smollm").chunks is not None
    assert _pair_tokenizer(tmp_path, "smollm", added=("<tag>",)).chunks is not None
    assert _pair_tokenizer(tmp_path, "smollm", added=("a b",)).chunks is None
