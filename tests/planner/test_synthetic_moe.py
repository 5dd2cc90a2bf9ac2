"""Synthetic mixture-of-experts GGUFs (planner/synthetic.py, synthetic_routing.py, synth.py).

Shapes, metadata and tensors as llama.cpp's converter writes them; determinism; the routing design
in the weights (routing subspace, routers); routing statistics measured by an independent numpy
forward pass (tests/moe_reference.py) on real text, against the design's fixed targets; the
oracle itself checked against the executor. Tiny shapes only: the whole module takes seconds.
The bench-size figures are measured by hand (``python tests/moe_reference.py MODEL.gguf``).
"""

from __future__ import annotations

import math
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import ROOT, make_plan_file
from moe_reference import Reference, forward, measure, reader, sample_ids
from strata.common.errors import StrataError
from strata.common.gguf_file import open_gguf
from strata.planner.synthetic import (
    FTYPES,
    ROUTING_KEY,
    SEED_KEY,
    SHAPES,
    routing_layout,
    shape_from_args,
    tensor_specs,
    write_synthetic,
)
from strata.planner.synthetic_routing import (
    TARGET_LIFT,
    TARGET_SHARE,
    calibrate,
    expert_lanes,
    file_successors,
    routing_stats,
    simulate_pair,
    successor_permutations,
)

Q4_0 = FTYPES["Q4_0"][0]
TINY = SHAPES["tiny-moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf) -> dict:
    """tiny-moe (4 blocks, 8 experts top-2, width 128), Q4_0, seed 0, in each routing mode."""
    d = tmp_path_factory.mktemp("moe")
    return {
        r: write_synthetic(d / f"{r}.gguf", TINY, routing=r, tokenizer=str(smollm2_gguf)).path
        for r in ("uniform", "skewed", "random")
    }


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory, smollm2_gguf):
    """A skewed qwen3moe: 3 blocks, width 128, 4 heads of 128 (2 KV), 8 experts of 64, top-2."""
    shape = shape_from_args(
        "qwen3-30b-a3b", layers=3, width=128, ffn=64, heads=4, kv_heads=2, experts=8, experts_used=2
    )
    path = tmp_path_factory.mktemp("qwen3moe") / "q3.gguf"
    return write_synthetic(path, shape, routing="skewed", tokenizer=str(smollm2_gguf)).path


@pytest.fixture(scope="module")
def measured(models) -> dict:
    """(RoutingStats, ForwardResult) of each tiny model on the sample text."""
    return {r: measure(p) for r, p in models.items()}


def tensors(path) -> dict:
    return {t.name: t for t in reader(path).tensors}


def dq(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type)


# ------------------------------------------------------------------------ shapes and files


def test_presets_have_the_real_models_shapes_and_sizes():
    mix = {s.name: s for s in tensor_specs(SHAPES["mixtral-8x7b"], Q4_0, 32000)}
    # Mixtral-8x7B has 46.70 B parameters (32000-token vocabulary): 46,702,792,704.
    assert sum(math.prod(s.shape) for s in mix.values()) == 46_702_792_704
    assert mix["blk.31.ffn_gate_inp.weight"].shape == (8, 4096)
    assert mix["blk.31.ffn_gate_inp.weight"].qtype == gguf.GGMLQuantizationType.F32
    assert mix["blk.0.ffn_gate_exps.weight"].shape == (8, 14336, 4096)
    assert mix["blk.0.ffn_down_exps.weight"].shape == (8, 4096, 14336)
    assert mix["blk.0.attn_k.weight"].shape == (1024, 4096)
    assert not any(".ffn_gate.weight" in n or ".ffn_down.weight" in n for n in mix)
    qwen = {s.name: s for s in tensor_specs(SHAPES["qwen3-30b-a3b"], Q4_0, 151936)}
    # Qwen3-30B-A3B: 30.53 B parameters (151936-token vocabulary, untied head).
    assert sum(math.prod(s.shape) for s in qwen.values()) == 30_532_122_624
    assert qwen["blk.47.attn_q.weight"].shape == (4096, 2048)  # 32 heads of 128, width 2048
    assert qwen["blk.47.attn_output.weight"].shape == (2048, 4096)
    assert qwen["blk.0.attn_q_norm.weight"].shape == (128,)
    assert qwen["blk.0.ffn_up_exps.weight"].shape == (128, 768, 2048)
    bench = tensor_specs(SHAPES["mixtral-bench"], Q4_0, 49152)
    assert 1.0e9 < sum(s.nbytes for s in bench) < 2.0e9  # "about 1-2 GB in Q4_0"


def test_metadata_and_tensors_as_llama_cpp_writes_them(models):
    r = reader(models["skewed"])
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
    assert f["general.architecture"] == "llama"
    assert (f["llama.expert_count"], f["llama.expert_used_count"]) == (8, 2)
    assert f["llama.feed_forward_length"] == 64  # Mixtral: the experts' width
    assert (f[SEED_KEY], f[ROUTING_KEY]) == (0, "skewed")
    t = tensors(models["skewed"])
    # GGUF shapes (ne0 first): router [d, E], gate/up [d, ff, E], down [ff, d, E].
    assert list(t["blk.3.ffn_gate_inp.weight"].shape) == [128, 8]
    assert t["blk.3.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["blk.3.ffn_gate_exps.weight"].shape) == [128, 64, 8]
    assert list(t["blk.3.ffn_up_exps.weight"].shape) == [128, 64, 8]
    assert list(t["blk.3.ffn_down_exps.weight"].shape) == [64, 128, 8]
    assert t["blk.3.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert "blk.0.ffn_gate.weight" not in t and "blk.0.ffn_up.weight" not in t


def test_qwen3moe_metadata_and_head_dim(tmp_path, smollm2_gguf):
    shape = shape_from_args(
        "qwen3-30b-a3b", layers=1, width=256, ffn=64, heads=4, kv_heads=2, experts=8
    )
    p = write_synthetic(tmp_path / "q.gguf", shape, tokenizer=str(smollm2_gguf)).path
    r = reader(p)
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("qwen3moe.")}
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert f["qwen3moe.expert_feed_forward_length"] == 64
    assert f["qwen3moe.feed_forward_length"] == 6144  # the config's dense size, as converted
    assert f["qwen3moe.attention.key_length"] == f["qwen3moe.attention.value_length"] == 128
    assert (f["qwen3moe.expert_count"], f["qwen3moe.expert_used_count"]) == (8, 8)
    assert f["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    t = tensors(p)
    assert list(t["blk.0.attn_q.weight"].shape) == [256, 512]
    assert list(t["blk.0.attn_output.weight"].shape) == [512, 256]
    assert list(t["blk.0.attn_k_norm.weight"].shape) == [128]


def test_same_seed_same_bytes_and_blocks_independent_of_depth(tmp_path, models, smollm2_gguf):
    tok = str(smollm2_gguf)
    again = write_synthetic(tmp_path / "a.gguf", TINY, routing="skewed", tokenizer=tok).path
    assert again.read_bytes() == models["skewed"].read_bytes()
    other = write_synthetic(tmp_path / "b.gguf", TINY, routing="skewed", seed=1, tokenizer=tok)
    assert other.path.read_bytes() != again.read_bytes()
    two = shape_from_args("tiny-moe", layers=2)
    short = tensors(write_synthetic(tmp_path / "c.gguf", two, routing="skewed", tokenizer=tok).path)
    full = tensors(models["skewed"])
    for name, t in short.items():  # blocks 0-1, embedding and head equal those of 4 blocks
        assert np.array_equal(t.data, full[name].data), name


def test_uniform_and_skewed_differ_only_in_the_routers(models):
    u, s, r = tensors(models["uniform"]), tensors(models["skewed"]), tensors(models["random"])
    differ = {n for n in u if not np.array_equal(u[n].data, s[n].data)}
    assert differ == {f"blk.{i}.ffn_gate_inp.weight" for i in range(4)}
    # random routing: the plain random model, so the designed rows differ from it too
    assert not np.array_equal(u["token_embd.weight"].data, r["token_embd.weight"].data)


def test_routing_subspace_is_written_only_by_the_embedding(models):
    t = tensors(models["skewed"])
    m = routing_layout(TINY, "skewed").width
    assert m == 64  # P block (32) + N block (32 at width 128)
    embd = dq(t["token_embd.weight"])
    assert (embd[:, :32] == 1).all()  # the shared popularity direction, exact
    noise = embd[:, 32:m]  # the token noise block: random, std 1, about one norm for all
    assert abs(noise.std() - 1) < 0.05
    norms = np.linalg.norm(noise, axis=1)
    assert norms.std() / norms.mean() < 0.12  # no per-block scale jitter (with it: 0.3)
    for i in range(4):
        assert (dq(t[f"blk.{i}.attn_output.weight"])[:m] == 0).all()
        down = dq(t[f"blk.{i}.ffn_down_exps.weight"])  # [E, d, ff]
        assert (down[:, :m] == 0).all() and (down[:, m:] != 0).mean() > 0.8
    router = dq(t["blk.2.ffn_gate_inp.weight"])
    assert (router[:, m:] == 0).all()
    # Row of lane c reads beta[c] = -B c / (E - 1) from the P block.
    lanes = expert_lanes(8, 4, 0)[2]
    beta = router[lanes, :32].sum(axis=1)
    assert np.allclose(beta, -calibrate(8, 2).spread * np.arange(8) / 7, atol=1e-5)


# ------------------------------------------------------------------------ measured routing


def test_skewed_routing_meets_the_targets_on_real_text(measured):
    s, _ = measured["skewed"]
    assert s.tokens > 300
    assert abs(s.top_quarter_share - TARGET_SHARE) < 0.07, s.summary()
    assert abs(s.successor_lift - TARGET_LIFT) < 0.5, s.summary()
    assert min(s.share_per_layer) > 0.5 and min(s.lift_per_pair) > 2.2, s


def test_uniform_routing_is_uniform_and_layers_independent(measured):
    # On these ~400 tokens (189 distinct), routing that is uniform per distinct token gives a
    # top-quarter share of 0.32 on average (0.29-0.36 in 90% of draws), not 0.25.
    s, _ = measured["uniform"]
    assert s.top_quarter_share < 0.36, s.summary()
    assert 0.75 < s.successor_lift < 1.3, s.summary()


def test_random_routers_are_not_designed(measured):
    # The plain random model routes with a context-dependent, drifting bias; nothing about
    # successors: its lift stays near chance (its share is not asserted: it is whatever the
    # residual stream's shared component makes it).
    s, _ = measured["random"]
    assert 0.7 < s.successor_lift < 1.5, s.summary()


def test_designed_routing_depends_on_the_token_id_only(measured, models):
    # Nothing but the embedding writes the routing subspace: a token routes the same way
    # wherever it stands (the plain random model does not: its routers read the context).
    ids = np.array(sample_ids(models["skewed"]))
    values, counts = np.unique(ids, return_counts=True)
    repeated = values[np.argsort(-counts)[:5]]  # the five most frequent tokens
    assert counts.max() >= 10
    for r in ("uniform", "skewed", "random"):
        chosen = measured[r][1].chosen  # [T, L, k]
        routes = [
            {tuple(map(tuple, np.sort(chosen[pos], axis=1))) for pos in np.nonzero(ids == tok)[0]}
            for tok in repeated
        ]
        if r == "random":
            assert max(len(x) for x in routes) > 1
        else:
            assert all(len(x) == 1 for x in routes), r


def test_reference_forward_agrees_with_the_executor(tmp_path, smollm2_gguf, models, qwen3moe):
    # The oracle against the executor (itself checked against llama.cpp), all positions, all
    # logits: on the MoE models where the executor runs experts (llama: adjacent-pair RoPE;
    # qwen3moe: NeoX RoPE, Q/K norms, head dim 128), else on a dense tiny llama.
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan

    if _executor_runs_moe():
        cases = [models["skewed"], qwen3moe]
    else:
        tok = str(smollm2_gguf)
        cases = [write_synthetic(tmp_path / "d.gguf", SHAPES["tiny"], tokenizer=tok).path]
    for path in cases:
        eng = Engine(load_plan(make_plan_file(str(path), tmp_path / "plan.yaml", context=256)))
        ids = sample_ids(path, 48)
        ours = eng.logits_for(ids)
        ref = forward(Reference.open(path), ids, logits=True).logits
        assert np.abs(ours - ref).max() < 1e-3, path


def _executor_runs_moe() -> bool:
    try:  # the executor's mixture-of-experts support (executor/experts.py) may not be there yet
        import strata.executor.experts  # noqa: F401
    except ImportError:
        return False
    return True


def test_qwen3moe_skewed_routing(qwen3moe):
    s, _ = measure(qwen3moe)
    assert abs(s.top_quarter_share - TARGET_SHARE) < 0.07, s.summary()
    assert abs(s.successor_lift - TARGET_LIFT) < 0.5, s.summary()


# ------------------------------------------------------------------------ statistics


def test_routing_stats_by_hand():
    # 4 tokens, 2 layers, 8 experts, 2 used; successor of e is e + 1 (mod 8).
    succ = np.array([[(e + 1) % 8 for e in range(8)]])
    chosen = [
        [{0, 1}, {1, 2}],  # 0 -> 1 and 1 -> 2 both fire: 2 hits
        [{0, 1}, {1, 5}],  # 0 -> 1 fires: 1 hit
        [{0, 3}, {6, 7}],  # none
        [{0, 2}, {1, 3}],  # 0 -> 1 and 2 -> 3: 2 hits
    ]
    s = routing_stats(chosen, 8, succ)
    # layer 0: expert 0 taken 4 times, 1 twice: top quarter (2 experts) 6 of 8 selections
    assert s.share_per_layer[0] == pytest.approx(6 / 8)
    # layer 1: expert 1 three times, then a tie at 1: 4 of 8
    assert s.share_per_layer[1] == pytest.approx(4 / 8)
    assert s.top_quarter_share == pytest.approx((6 / 8 + 4 / 8) / 2)
    assert s.successor_lift == pytest.approx(5 / 8 / (2 / 8))
    # independence: sum over e of count0[e] * count1[succ e] / T
    c0 = np.bincount([0, 1, 0, 1, 0, 3, 0, 2], minlength=8)
    c1 = np.bincount([1, 2, 1, 5, 6, 7, 1, 3], minlength=8)
    assert s.marginal_lift == pytest.approx(5 / ((c0 * c1[succ[0]]).sum() / 4))


def test_routing_stats_against_a_loop(tmp_path):
    rng = np.random.default_rng(3)
    t, n_layers, n, k = 50, 4, 16, 3
    chosen = np.array(
        [[rng.choice(n, k, replace=False) for _ in range(n_layers)] for _ in range(t)]
    )
    succ = np.array([rng.permutation(n) for _ in range(n_layers - 1)])
    s = routing_stats(chosen, n, succ)
    hits = fires = 0
    for tok in chosen:
        for i in range(n_layers - 1):
            for e in tok[i]:
                fires += 1
                hits += succ[i][e] in tok[i + 1]
    assert s.successor_lift == pytest.approx(hits / fires / (k / n))
    for i in range(n_layers):
        counts = sorted(np.bincount(chosen[:, i].ravel(), minlength=n), reverse=True)
        assert s.share_per_layer[i] == pytest.approx(sum(counts[: n // 4]) / (t * k))


@pytest.mark.parametrize(
    "chosen, layers, match",
    [
        ([[{0}, {1, 2}]], 2, "k experts"),
        (np.zeros((3, 2, 2), dtype=int), 2, "twice"),
        (np.array([[[0, 9]]]), 1, "outside"),
        (np.zeros((0, 2, 1), dtype=int), 2, "no tokens"),
        (np.zeros((3, 2), dtype=int), 2, "expected"),
    ],
)
def test_routing_stats_rejects_bad_records(chosen, layers, match):
    with pytest.raises(StrataError, match=match):
        routing_stats(chosen, 8, np.zeros((layers - 1, 8), dtype=int))


def test_routing_stats_rejects_successors_of_another_shape():
    with pytest.raises(StrataError, match="successors"):
        routing_stats(np.array([[[0], [1]]]), 8, np.zeros((2, 8), dtype=int))


def test_successors_follow_the_lanes_and_do_not_depend_on_depth():
    lanes = expert_lanes(8, 5, 7)
    succ = successor_permutations(8, 5, 7)
    for i in range(4):
        assert sorted(succ[i]) == list(range(8))
        assert (succ[i][lanes[i]] == lanes[i + 1]).all()
    assert np.array_equal(successor_permutations(8, 3, 7), succ[:2])
    assert not np.array_equal(successor_permutations(8, 3, 8), succ[:2])


def test_file_successors_reads_the_seed(tmp_path, models, smollm2_gguf):
    assert np.array_equal(file_successors(models["skewed"]), successor_permutations(8, 4, 0))
    assert np.array_equal(
        file_successors(open_gguf(models["uniform"])), file_successors(models["skewed"])
    )
    seven = write_synthetic(tmp_path / "s7.gguf", TINY, seed=7, tokenizer=str(smollm2_gguf))
    assert np.array_equal(file_successors(seven.path), successor_permutations(8, 4, 7))
    dense = write_synthetic(tmp_path / "d.gguf", SHAPES["tiny"], tokenizer=str(smollm2_gguf))
    with pytest.raises(StrataError, match="not a mixture-of-experts"):
        file_successors(dense.path)
    with pytest.raises(StrataError, match="missing.gguf: no such file"):
        file_successors(tmp_path / "missing.gguf")


@pytest.mark.parametrize("n, k", [(8, 2), (32, 4)])
def test_calibration_meets_the_targets_on_fresh_draws(n, k):
    cal = calibrate(n, k)
    fresh = simulate_pair(n, k, cal.spread, cal.rho, seed=99)  # not the draws it was fit on
    assert abs(fresh.top_quarter_share - TARGET_SHARE) < 0.02
    assert abs(fresh.successor_lift - TARGET_LIFT) < 0.15
    flat = simulate_pair(n, k, 0.0, 0.0, seed=99)
    assert flat.top_quarter_share < 0.28 and 0.9 < flat.successor_lift < 1.1


# ------------------------------------------------------------------------ errors and CLI


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shape", "tiny-moe", "--routing", "zipf"], ["--routing 'zipf'", "skewed"]),
        (["--shape", "tiny", "--routing", "skewed"], ["--routing skewed", "MoE shape"]),
        (["--shape", "tiny-moe", "--width", "96", "--heads", "4"], ["--width at least 128"]),
        (["--shape", "tiny-moe", "--experts-used", "9"], ["--experts-used 9", "--experts 8"]),
        (["--shape", "tiny-moe", "--experts", "8", "--experts-used", "4", "--routing", "skewed"],
         ["4 of 8", "top quarter"]),
        (["--shape", "tiny-moe", "--experts", "3", "--experts-used", "1", "--routing", "skewed"],
         ["at least 4 experts"]),
        (["--shape", "qwen3-30b-a3b", "--experts", "0"], ["qwen3moe", "--experts"]),
    ],
)  # fmt: skip
def test_bad_moe_arguments_are_one_line_errors(tmp_path, capsys, argv, words):
    from test_synthetic import assert_synth_error

    assert_synth_error(tmp_path, capsys, argv, words)


def test_random_routing_allows_narrow_widths_and_experts_zero_is_dense(tmp_path, smollm2_gguf):
    tok = str(smollm2_gguf)
    narrow = shape_from_args("tiny-moe", layers=1, width=64)
    m = write_synthetic(tmp_path / "n.gguf", narrow, routing="random", tokenizer=tok)
    assert m.routing == "random"
    dense = shape_from_args("tiny-moe", layers=1, experts=0)
    t = tensors(write_synthetic(tmp_path / "d.gguf", dense, tokenizer=tok).path)
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t


def test_cli_writes_skewed_and_help_explains_routing(tmp_path, smollm2_gguf):
    out = tmp_path / "cli.gguf"
    done = subprocess.run(
        [sys.executable, "synth.py", "--shape", "tiny-moe", "--layers", "2", "--experts", "16"]
        + ["--experts-used", "4", "--routing", "skewed", "--tokenizer", str(smollm2_gguf)]
        + ["-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "tiny-moe+layers=2+experts=16+experts_used=4 Q4_0, 4 of 16 experts, skewed" in (
        done.stderr
    )
    r = reader(out)
    assert r.fields["llama.expert_count"].contents() == 16
    text = subprocess.run(
        [sys.executable, "synth.py", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    for word in ("--routing", "uniform", "skewed", "random", "--experts-used", "mixtral-8x7b"):
        assert word in text, word
