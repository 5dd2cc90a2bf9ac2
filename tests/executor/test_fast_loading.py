"""Loading reads the GGUF's metadata without gguf-py's per-token parsing, and caches the built
tokenizer of a large vocabulary (issue 34: first token in seconds). Calls are counted, not timed."""

from __future__ import annotations

import gguf
from conftest import make_plan_file
from strata.executor import tokenizer as tokenizer_module
from strata.executor.tokenizer import HF_CACHE_MIN_TOKENS, GGUFTokenizer

from strata.cli import main


class _Counter:
    """Wraps a function, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_a_run_never_parses_the_vocabulary_through_gguf_py(
    gemma3_gguf, tmp_path, monkeypatch, capsys
):
    """Describe, plan, tokenize, load and generate on Gemma-3-270M (262,144 tokens): gguf-py's
    reader, which builds numpy views of every token, is never built and never reads a string."""
    built = _Counter(gguf.GGUFReader.__init__)
    strings = _Counter(gguf.GGUFReader._get_str)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", built)
    monkeypatch.setattr(gguf.GGUFReader, "_get_str", strings)
    plan = make_plan_file(str(gemma3_gguf), tmp_path / "gemma.yaml", context=256)
    status = main(["run", str(plan), "--prompt", "The capital of France is", "--max-tokens", "2"])
    assert status == 0, capsys.readouterr().err
    assert built.calls == 0 and strings.calls == 0


def test_a_large_vocabulary_is_built_once_then_read_from_the_cache(
    gemma3_gguf, smollm2_gguf, tmp_path, monkeypatch
):
    """Gemma's SentencePiece merges are derived once per header; the next tokenizer is read
    from <cache>/tokenizers and encodes the same ids. SmolLM2's small vocabulary is not cached
    (building it costs as much as reading it back)."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    merges = _Counter(tokenizer_module._spm_merges)
    monkeypatch.setattr(tokenizer_module, "_spm_merges", merges)
    text = "The capital of France is Paris. ▁<start_of_turn>user\nhé"
    first = GGUFTokenizer.from_gguf(gemma3_gguf)
    assert merges.calls == 1
    cached = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    second = GGUFTokenizer.from_gguf(gemma3_gguf)
    assert merges.calls == 1  # read back, not rebuilt
    assert second.encode(text) == first.encode(text)
    assert second.decode(first.encode(text)) == first.decode(first.encode(text))
    cached[0].write_text("{not json")  # a damaged file is rebuilt and replaced
    third = GGUFTokenizer.from_gguf(gemma3_gguf)
    assert merges.calls == 2 and third.encode(text) == first.encode(text)
    # a valid tokenizer of another vocabulary (SmolLM2's) in its place: rebuilt, not trusted
    cached[0].write_text(GGUFTokenizer.from_gguf(smollm2_gguf, cache=False).hf.to_str())
    assert GGUFTokenizer.from_gguf(gemma3_gguf).encode(text) == first.encode(text)
    assert merges.calls == 3
    # a file another builder (older code, another tokenizers version) made is never read, and
    # is removed once this one's is written
    stale = cached[0].with_name(cached[0].name.split(".")[0] + ".000000000000.json")
    stale.write_text("{}")
    cached[0].unlink()
    GGUFTokenizer.from_gguf(gemma3_gguf)
    assert merges.calls == 4 and not stale.exists() and cached[0].is_file()
    GGUFTokenizer.from_gguf(gemma3_gguf, cache=False)
    assert merges.calls == 5
    small = GGUFTokenizer.from_gguf(smollm2_gguf)
    assert small.vocab_size < HF_CACHE_MIN_TOKENS
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1


def test_an_unwritable_cache_costs_only_the_build(gemma3_gguf, tmp_path, monkeypatch):
    """A cache folder that cannot be written: the tokenizer is built and works (one warning)."""
    blocked = tmp_path / "cache"
    blocked.mkdir()
    (blocked / "tokenizers").write_text("a file where the folder should be")
    monkeypatch.setenv("STRATA_CACHE", str(blocked))
    tok = GGUFTokenizer.from_gguf(gemma3_gguf)
    assert (
        tok.encode("Paris")[-1]
        == GGUFTokenizer.from_gguf(gemma3_gguf, cache=False).encode("Paris")[-1]
    )
