"""Drafters for speculative decoding (``executor.drafters``) and the draft-model cutter
(``scripts/cut_gguf.py``).

- Prompt lookup on hand-made sequences (longest n-gram first, most recent occurrence, no match,
  the k cap, periodic continuation), on repetitive code, and its incremental index against a
  brute-force search.
- ``cut_gguf.py`` on the real SmolLM2 cut to 4 blocks: tensors and metadata as stored, and the
  result describes, plans and generates.
- ``DraftModelDrafter`` with the target itself as the draft: its drafts are the target's own
  greedy continuation, for 3 prompts in one batch, after full and partial acceptance and a
  corrected token; a short pool drafts fewer sequences; ``release`` frees its blocks; a draft of
  another vocabulary is refused. The drafter runs on a worker thread with its own MLX stream,
  as the serving engine's thread does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, make_plan_file
from gguf_factory import write_tiny_llama
from strata.common.errors import StrataError
from strata.executor.drafters import DraftInput, DraftModelDrafter, PromptLookupDrafter
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

CUT = ROOT / "scripts" / "cut_gguf.py"


def _lookup(tokens: list[int], k: int, drafter: PromptLookupDrafter | None = None) -> list[int]:
    d = drafter or PromptLookupDrafter()
    return d.propose([DraftInput("r", tokens, k)])[0]


# ------------------------------------------------------------------ prompt lookup


def test_prompt_lookup_longest_ngram_wins():
    # "1 2 3" recurs (followed by 9 9 7); the 1-gram "3" recurs more recently (followed by 8).
    toks = [1, 2, 3, 9, 9, 7, 3, 8, 5, 1, 2, 3]
    assert _lookup(toks, 3) == [9, 9, 7]
    # Limited to 1-grams, the most recent "3" wins.
    assert _lookup(toks, 3, PromptLookupDrafter(max_ngram=1)) == [8, 5, 1]


def test_prompt_lookup_most_recent_occurrence():
    assert _lookup([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]
    assert _lookup([5, 6, 1, 5, 6, 2, 4, 5, 6], 2) == [2, 4]


def test_prompt_lookup_no_match_and_k():
    assert _lookup([1, 2, 3, 4], 5) == []
    assert _lookup([7], 3) == []
    assert _lookup([1, 2, 1, 2], 0) == []
    assert _lookup([1, 2, 3, 1, 2, 3, 1, 2, 3], 2) == [1, 2]
    # min_ngram 2: a single repeated token is not enough.
    assert _lookup([4, 9, 5, 9], 2, PromptLookupDrafter(min_ngram=2)) == []
    with pytest.raises(StrataError, match="n-gram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_prompt_lookup_periodic_continuation():
    # A match right before the end continues with the period it implies.
    assert _lookup([7, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert _lookup([3, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def _brute(tokens: list[int], k: int, lo: int = 1, hi: int = 4) -> list[int]:
    """The reference: scan every earlier position for each n (O(n * ngram * n))."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for end in range(L - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[L - n :]:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[end + 1 + i])
                return ext[L:]
    return []


def test_prompt_lookup_incremental_index_matches_brute_force():
    rng = np.random.default_rng(0)
    d = PromptLookupDrafter()
    for rid, vocab in (("a", 3), ("b", 6), ("c", 40)):
        toks = rng.integers(0, vocab, 5).tolist()
        for _ in range(150):  # grown 1-3 tokens at a time, as decoding with accepted drafts
            k = int(rng.integers(1, 6))
            assert d.propose([DraftInput(rid, toks, k)])[0] == _brute(toks, k)
            toks += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
    # A reused id with other tokens rebuilds its index; release drops it.
    assert d.propose([DraftInput("a", [9, 8, 9], 2)])[0] == [8, 9]
    for rid in "abc":
        d.release(rid)
    assert not d._index


def test_prompt_lookup_repetitive_code(smollm2_engine):
    tok = smollm2_engine.tokenizer
    block = (
        "    def test_case_{i}(self):\n"
        "        result = self.client.get('/api/items', params={{'limit': 10}})\n"
        "        self.assertEqual(result.status_code, 200)\n"
        "        self.assertIn('items', result.json())\n\n"
    )
    code = "class TestItems(unittest.TestCase):\n" + "".join(block.format(i=i) for i in range(4))
    full = tok.encode(code)
    cut = len(full) - len(tok.encode(block.format(i=3))) // 2  # half-way in the last method
    # The body repeats: its next 8 tokens are drafted from the previous method.
    assert _lookup(full[:cut], 8) == full[cut : cut + 8]


# ------------------------------------------------------------------ cut_gguf.py


def _cut_module():
    spec = importlib.util.spec_from_file_location("cut_gguf", CUT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cut4(tmp_path_factory, smollm2_gguf) -> Path:
    out = tmp_path_factory.mktemp("cut") / "smollm2-4.gguf"
    subprocess.run(
        [sys.executable, str(CUT), str(smollm2_gguf), "--blocks", "4", "-o", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return out


def _kv(r: gguf.GGUFReader) -> dict[str, tuple[list[str], object]]:
    out = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        raw = [bytes(f.parts[i]) for i in f.data] if f.types[-1] == 8 else f.contents()
        out[key] = ([t.name for t in f.types], raw)
    return out


def test_cut_gguf_tensors_and_metadata(cut4, smollm2_gguf):
    src, dst = gguf.GGUFReader(smollm2_gguf), gguf.GGUFReader(cut4)
    kept = [
        t for t in src.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 4
    ]
    assert [t.name for t in dst.tensors] == [t.name for t in kept]
    assert len(kept) == 2 + 4 * 9  # token_embd, output_norm (tied head), 9 tensors per block
    for a, b in zip(kept, dst.tensors, strict=True):
        assert b.tensor_type == a.tensor_type and list(b.shape) == list(a.shape)
        assert np.asarray(b.data).tobytes() == np.asarray(a.data).tobytes()
    sk, dk = _kv(src), _kv(dst)
    assert list(dk) == list(sk)
    for key, (types, value) in sk.items():
        if key == "llama.block_count":
            assert dk[key] == (types, 4)
        elif key == "general.name":
            assert dk[key][1] == [value[0] + b" (first 4 blocks)"]
        else:
            assert dk[key] == (types, value), key


def test_cut_gguf_runs(cut4, tmp_path):
    from strata.common.describe import describe

    desc, _ = describe(str(cut4))
    assert desc.architecture.block_count == 4
    assert sum(u.name.startswith("blk.") for u in desc.units) == 8
    plan = make_plan_file(str(cut4), tmp_path / "cut4.yaml", desc=desc, context=256)
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()
    try:
        ids = serving.tokenizer.encode("The capital of France is")
        gen = generate(serving, ids, SamplingParams(), max_tokens=4, stop_at_eog=False)
    finally:
        serving.close()
    assert len(gen.output_ids) == 4
    assert all(0 <= t < desc.architecture.vocab_size for t in gen.output_ids)


def test_cut_gguf_errors(smollm2_gguf, tmp_path, capsys):
    main = _cut_module().main
    assert main([str(smollm2_gguf), "--blocks", "31", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "outside 1..30" in capsys.readouterr().err
    assert main([str(smollm2_gguf), "--blocks", "2", "-o", str(smollm2_gguf)]) == 2
    assert "the model itself" in capsys.readouterr().err


# ------------------------------------------------------------------ draft model


@pytest.fixture(scope="module")
def worker():
    """One thread with its own MLX stream, like the serving engine's thread."""
    with ThreadPoolExecutor(
        1, initializer=lambda: mx.set_default_stream(mx.new_stream(mx.default_device()))
    ) as ex:
        yield lambda fn, *a: ex.submit(fn, *a).result()


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of",
]


def _greedy(serving: ServingEngine, ids: list[int], n: int) -> list[int]:
    gen = generate(serving, ids, SamplingParams(), max_tokens=n, stop_at_eog=False)
    return gen.output_ids


@pytest.fixture(scope="module")
def greedy(smollm2_serving) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's first 11 greedy tokens) of each of ``PROMPTS``."""
    prompts = [smollm2_serving.tokenizer.encode(p) for p in PROMPTS]
    return [(p, _greedy(smollm2_serving, p, 11)) for p in prompts]


def test_draft_model_matches_target_greedy(smollm2_engine, smollm2_serving, greedy, worker):
    eng = smollm2_engine
    prompts = [p for p, _ in greedy]
    cont = [c for _, c in greedy]
    d = DraftModelDrafter(eng, num_blocks=64, block_size=16, target=eng)
    ks = [4, 3, 5]
    # Step 1: each sequence is its prompt plus the pending first token.
    seqs = [p + c[:1] for p, c in greedy]
    inputs = [DraftInput(f"r{i}", s, k) for i, (s, k) in enumerate(zip(seqs, ks, strict=True))]
    got = worker(d.propose, inputs)
    assert got == [c[1 : 1 + k] for c, k in zip(cont, ks, strict=True)]
    assert d.passes == max(ks)  # one catch-up pass, then k-1 one-token passes

    # Verification outcomes, with accepted() told the final prefix: r0 accepts its 4 drafts and
    # the bonus; r1 accepts 1 draft, then the target samples another token than the greedy one;
    # r2 is told that none of its drafts was kept (its new token happens to be the first draft).
    other = next(t for t in (13, 42, 1000) if t != cont[1][2])
    seqs[0] = prompts[0] + cont[0][:6]
    worker(d.accepted, "r0", len(prompts[0]) + 5)
    seqs[1] = prompts[1] + cont[1][:2] + [other]
    worker(d.accepted, "r1", len(prompts[1]) + 2)
    seqs[2] = prompts[2] + cont[2][:2]
    worker(d.accepted, "r2", len(prompts[2]) + 1)
    after1 = _greedy(smollm2_serving, seqs[1], 7)
    got = worker(d.propose, [DraftInput(f"r{i}", s, 4) for i, s in enumerate(seqs)])
    assert got == [cont[0][6:10], after1[:4], cont[2][2:6]]
    assert d.passes == max(ks) + 4

    # Without accepted() the drafter rolls back by itself: r1 keeps 3 drafts (its new token is
    # the fourth); r2's first draft is rejected (another token, counted generously as final).
    seqs[1] = seqs[1] + after1[:4]
    seqs[2] = seqs[2] + [next(t for t in (13, 42, 1000) if t != cont[2][2])]
    worker(d.accepted, "r2", len(seqs[2]))
    got = worker(d.propose, [DraftInput("r1", seqs[1], 3), DraftInput("r2", seqs[2], 3)])
    assert got == [after1[4:7], _greedy(smollm2_serving, seqs[2], 3)]

    assert d.pool.num_used_blocks() > 0
    for i in range(3):
        worker(d.release, f"r{i}")
    assert d.pool.num_used_blocks() == 0


def test_draft_model_short_pool(smollm2_engine, greedy, worker):
    eng = smollm2_engine
    (a, ga), (b, gb) = greedy[2], greedy[0]
    sa, sb = a + ga[:1], b + gb[:1]
    bs = 8
    blocks_a = -(-(len(sa) + 3) // bs)  # positions 0 .. len + k - 2 for k = 4
    d = DraftModelDrafter(eng, num_blocks=blocks_a, block_size=bs, target=eng)
    # Only the first sequence fits: the second gets no drafts, and nothing fails.
    got = worker(d.propose, [DraftInput("a", sa, 4), DraftInput("b", sb, 4)])
    assert got == [ga[1:5], []]
    # Alone in the call, b takes a's blocks (a is idle: dropped, recomputed later) and drafts
    # as many tokens as they hold; then a drafts again from scratch, still right.
    got = worker(d.propose, [DraftInput("b", sb, 4)])
    fit = min(4, blocks_a * bs - len(sb) + 1)
    assert fit >= 1 and got == [gb[1 : 1 + fit]]
    assert worker(d.propose, [DraftInput("a", sa, 4)]) == [ga[1:5]]
    # A sequence longer than the whole pool never drafts.
    assert worker(d.propose, [DraftInput("c", sa + ga[1:] * 4, 2)]) == [[]]
    for rid in ("a", "b", "c", "unknown"):
        worker(d.release, rid)
    assert d.pool.num_used_blocks() == 0


def test_draft_model_other_vocab_refused(smollm2_engine, tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    engine = Engine(load_plan(make_plan_file(str(tiny), tmp_path / "tiny.yaml", context=64)))
    try:
        with pytest.raises(StrataError, match="another vocabulary"):
            DraftModelDrafter(engine, 8, 16, target=smollm2_engine)
    finally:
        engine.close()
