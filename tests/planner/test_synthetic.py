"""Synthetic GGUFs (planner/synthetic.py, synth.py): deterministic, described, runnable, checked.

Only tiny shapes here. The comparison with llama.cpp (tiny, Llama-3-1B and -8B shapes) is run by
hand, not here: CI has no llama.cpp.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, make_plan_file
from strata.common.describe import describe
from strata.common.errors import StrataError
from strata.common.gguf_file import open_gguf
from strata.planner.synthetic import (
    FTYPES,
    SHAPES,
    architecture,
    shape_from_args,
    tensor_specs,
    write_synthetic,
)

from strata.cli import synth_main

TINY1 = shape_from_args("tiny", layers=1)


TOKENIZER_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    """The 2-layer tiny shape, Q4_0, seed 0, SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_synthetic(path, SHAPES["tiny"], tokenizer=str(smollm2_gguf))
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf) -> dict:
    """SmolLM2's tokenizer keys (opening its header once: 49152 tokens take ~1.5 s to parse)."""
    g = open_gguf(smollm2_gguf)
    return {key: g.field(key) for key in TOKENIZER_KEYS}


def test_same_seed_same_bytes_other_seed_differs(tmp_path, smollm2_gguf):
    tok = str(smollm2_gguf)
    a = write_synthetic(tmp_path / "a.gguf", TINY1, seed=7, tokenizer=tok).path
    b = write_synthetic(tmp_path / "b.gguf", TINY1, seed=7, tokenizer=tok).path
    c = write_synthetic(tmp_path / "c.gguf", TINY1, seed=8, tokenizer=tok).path
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)
    assert not list(tmp_path.glob("*.partial"))


def test_tensors_do_not_depend_on_the_rest_of_the_file(tmp_path, tiny, smollm2_gguf):
    one = write_synthetic(tmp_path / "one.gguf", TINY1, tokenizer=str(smollm2_gguf)).path
    g1, g2 = open_gguf(one), open_gguf(tiny)
    t2 = {t.name: t for t in g2.tensor_infos}
    for t in g1.tensor_infos:  # block 0, embedding and head of --layers 1 = those of --layers 2
        assert np.array_equal(g1.tensor_bytes(t), g2.tensor_bytes(t2[t.name])), t.name


def test_presets_are_valid_and_sized_like_the_real_models():
    for shape in SHAPES.values():
        shape.validate()
    q4_0 = FTYPES["Q4_0"][0]
    specs = tensor_specs(SHAPES["llama3-8b"], q4_0, 49152)
    assert len(specs) == 2 + 32 * 9 + 1
    # 7.38 B weights, 3.96 GiB of tensor data (what plan.py describe reported for the written file)
    assert sum(math.prod(s.shape) for s in specs) == 7_382_241_280
    assert sum(s.nbytes for s in specs) == 4_254_089_216
    one_b = tensor_specs(SHAPES["llama3-1b"], q4_0, 49152)
    assert {s.name: s.shape for s in one_b}["blk.15.attn_k.weight"] == (512, 2048)


def test_architecture_is_the_one_describe_reads_back(tmp_path, tiny, smollm2_gguf):
    """The hyperparameters the tensor list is made from (``architecture``, through
    ``strata.common.tensors``) are those of the file's metadata, MoE widths included."""
    qwen = shape_from_args("qwen3-30b-a3b", layers=1, width=256, ffn=64, heads=4, kv_heads=2)
    path = write_synthetic(tmp_path / "q.gguf", qwen, tokenizer=str(smollm2_gguf)).path
    for shape, p in ((SHAPES["tiny"], tiny), (qwen, path)):
        read = describe(str(p))[0].architecture
        made = architecture(shape, read.vocab_size)
        assert made.rms_norm_eps == pytest.approx(read.rms_norm_eps, rel=1e-6)  # float32 there
        assert made.model_copy(update={"rms_norm_eps": read.rms_norm_eps}) == read, shape.name


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_1", "Q8_0"])
def test_describe_shapes_types_and_tokenizer(tmp_path, smollm2_gguf, smollm2_tokenizer, ftype):
    shape = shape_from_args("tiny", layers=1, width=96, ffn=160, heads=6, kv_heads=3)
    path = write_synthetic(tmp_path / "m.gguf", shape, ftype=ftype, tokenizer=str(smollm2_gguf))
    desc, g = describe(str(path.path))
    a = desc.architecture
    assert (a.name, a.block_count, a.embedding_length, a.feed_forward_length) == (
        "llama",
        1,
        96,
        160,
    )
    assert (a.head_count, a.head_count_kv, a.head_dim, a.vocab_size) == (6, 3, 16, 49152)
    assert not a.tied_embeddings
    assert desc.file_type == f"MOSTLY_{ftype}"
    assert "synthetic" in g.field("general.name").lower() and "+width=96" in g.field("general.name")
    expect = {
        "token_embd.weight": ([96, 49152], ftype),
        "blk.0.attn_norm.weight": ([96], "F32"),
        "blk.0.attn_q.weight": ([96, 96], ftype),
        "blk.0.attn_k.weight": ([96, 48], ftype),
        "blk.0.attn_v.weight": ([96, 48], ftype),
        "blk.0.attn_output.weight": ([96, 96], ftype),
        "blk.0.ffn_gate.weight": ([96, 160], ftype),
        "blk.0.ffn_up.weight": ([96, 160], ftype),
        "blk.0.ffn_down.weight": ([160, 96], ftype),
        "output.weight": ([96, 49152], "Q8_0"),
    }
    got = {t.name: (t.shape, t.ggml_type) for t in desc.tensors}
    for name, want in expect.items():
        assert got[name] == want, name
    assert all(t.supported for t in desc.tensors)
    for key, value in smollm2_tokenizer.items():
        assert g.field(key) == value, key


def test_dense_files_have_no_moe_keys(tiny):
    # Dense files are what they were before MoE shapes existed: no expert or strata.* keys.
    keys = open_gguf(tiny).keys()
    assert not any("expert" in k or k.startswith("strata.") for k in keys)
    assert not any(".ffn_gate_inp." in t.name for t in open_gguf(tiny).tensor_infos)


def test_weights_have_the_documented_scale(tiny):
    import gguf

    r = gguf.GGUFReader(tiny)  # the gguf package's own reading, as a check of ours
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name.endswith("norm.weight"):
            assert abs(w.mean() - 1) < 0.05 and 0.02 < w.std() < 0.1, t.name
        elif t.name == "token_embd.weight":
            assert abs(w.std() - 1) < 0.05
        elif t.name == "output.weight":
            assert abs(w.std() * np.sqrt(64) - 3) < 0.15  # default logit_std 3
        else:  # std 1/sqrt(fan-in), mean ~0
            assert abs(w.std() * np.sqrt(w.shape[-1]) - 1) < 0.15, t.name
            assert abs(w.mean()) < 0.2 * w.std(), t.name


def test_executor_runs_it_with_finite_logits(tmp_path, tiny):
    from strata.executor.engine import Engine
    from strata.executor.generate import generate
    from strata.executor.plan_loader import load_plan
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import ServingEngine

    plan = make_plan_file(str(tiny), tmp_path / "plan.yaml", context=256)
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()
    eng = serving.engine
    try:
        ids = eng.tokenizer.encode("The capital of France is")
        assert ids == [504, 3575, 282, 4649, 314]  # SmolLM2's ids: the real tokenizer came along
        logits = eng.logits_for(ids)
        assert logits.shape == (len(ids), 49152)
        assert np.isfinite(logits).all()
        assert 1.5 < logits.std(axis=1).mean() < 6  # about logit_std (3), not collapsed
        gen = generate(serving, ids, SamplingParams(), max_tokens=4)
    finally:
        serving.close()
    assert len(gen.output_ids) == 4


def test_cli_writes_and_reports(tmp_path, smollm2_gguf):
    out = tmp_path / "cli.gguf"
    done = subprocess.run(
        [sys.executable, "synth.py", "--shape", "tiny", "--layers", "1", "--ftype", "Q8_0"]
        + ["--tokenizer", str(smollm2_gguf), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: tiny+layers=1 Q8_0" in done.stderr and out.is_file()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shape", "llama3-70b"], ["unknown shape", "llama3-8b"]),
        (["--shape", "tiny", "--ftype", "Q4_K"], ["--ftype", "Q4_0"]),
        (["--shape", "tiny", "--width", "100"], ["--width 100", "multiple of 32"]),
        (["--shape", "tiny", "--width", "96", "--heads", "5"], ["--width 96", "--heads 5"]),
        (["--shape", "tiny", "--width", "96", "--heads", "32"], ["head dim 3", "even"]),
        (["--shape", "tiny", "--heads", "8", "--kv-heads", "3"], ["--kv-heads 3"]),
        (["--shape", "tiny", "--ffn", "100"], ["--ffn 100", "multiple of 32"]),
        (["--shape", "tiny", "--layers", "0"], ["--layers must be at least 1"]),
        (["--shape", "tiny", "--seed", "-1"], ["--seed -1"]),
        (["--shape", "tiny", "--logit-std", "0"], ["logit_std"]),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, words):
    assert_synth_error(tmp_path, capsys, argv, words)


def assert_synth_error(tmp_path, capsys, argv: list[str], words: list[str]) -> None:
    """``synth.py ARGV`` exits 2 with one ``error:`` line naming ``words``, writing nothing."""
    rc = synth_main([*argv, "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    assert not list(tmp_path.iterdir())


def test_missing_output_folder(tmp_path, capsys):
    rc = synth_main(["--shape", "tiny", "-o", str(tmp_path / "no" / "x.gguf")])
    assert rc == 2 and "no such folder" in capsys.readouterr().err


def test_tokenizer_source_without_tokenizer(tmp_path, tiny):
    # A GGUF without tokenizer keys cannot lend one; say so instead of writing a broken file.
    import gguf

    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "llama")
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StrataError, match="no tokenizer.ggml.tokens"):
        write_synthetic(tmp_path / "y.gguf", TINY1, tokenizer=str(bare))


def test_a_model_is_written_beside_another_writers_partial_file(tmp_path, smollm2_gguf):
    """Each run writes under a name of its own: a partial file of another run writing the same
    model (the old fixed name ``NAME.partial`` included) is left alone, and none of this run's
    stays behind."""
    other = tmp_path / "m.gguf.partial"
    other.write_bytes(b"another run's bytes")
    out = write_synthetic(tmp_path / "m.gguf", TINY1, seed=7, tokenizer=str(smollm2_gguf)).path
    assert other.read_bytes() == b"another run's bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.partial"]
    assert open_gguf(out).field("general.architecture") is not None
