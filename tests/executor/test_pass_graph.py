"""Compiled forward passes (``executor.pass_graph``): a layout's pass traced once by
``mx.compile`` and replayed gives the eager pass's logits, KV pool and byte counters.

On the CPU the whole-pass attention path is forced (as ``test_serving`` forces it), its CUDA kernel
replaced by its definition in MLX operations that reads only arrays (so that it can be traced); on
MLX's CUDA backend the real kernel runs.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import attention_by_definition
from conftest import make_plan_file
from gguf_factory import write_arch_model
from strata.executor import attention, pass_graph
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput
from strata.executor.plan_loader import load_plan
from strata.executor.runner import forward

NAMES = ["llama3", "gemma3", "mixtral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pass-graph-models")
    return {n: write_arch_model(folder / f"{n}.gguf", n, smollm2_gguf) for n in NAMES}


def _engine(plan: Path, compiled: bool, **settings) -> Engine:
    """A fresh engine of ``plan`` whose runtime config compiles passes or not
    (``compiled``), with ``settings`` changed. The mechanism is tested on passes of two
    sequences (``max_sequences`` 0, unless ``settings`` say otherwise); the default's
    single-sequence rule has its own test."""
    loaded = load_plan(plan)
    settings = {"max_sequences": 0, **settings, "compiled_passes": compiled}
    return Engine(loaded, config=RuntimeConfig.build(loaded.plan.runtime, **settings))


def _force_kernel_path(monkeypatch):
    from strata.executor import cuda_attention

    if not mx.cuda.is_available():
        monkeypatch.setattr(cuda_attention, "supported", lambda t, h, kvh, d, dt: h % kvh == 0)
        monkeypatch.setattr(cuda_attention, "attention", attention_by_definition)


def _steps(model, vocab: int) -> list[ForwardBatch]:
    """A 6-token prefill of two sequences, then 5 decode steps of both (one layout, so the
    second is traced and the rest replayed), then a step with a 3-token chunk of one."""
    rng = np.random.default_rng(0)
    slots = [np.arange(0, 64, dtype=np.int32), np.arange(127, 63, -1, dtype=np.int32)]
    pos = [0, 0]
    batches = []

    def seq(i: int, t: int) -> SeqInput:
        ids = rng.integers(0, vocab, t).tolist()
        s = SeqInput(ids, pos[i], slots[i], "last")
        pos[i] += t
        return s

    batches.append(ForwardBatch.build([seq(0, 6), seq(1, 6)]))
    for _ in range(5):
        batches.append(ForwardBatch.build([seq(0, 1), seq(1, 1)]))
    batches.append(ForwardBatch.build([seq(0, 3), seq(1, 1)]))
    return batches


def _run(model) -> tuple[list, list, int, PagedKVCache]:
    kv = model.make_paged_cache(32, 4)
    start = model.store.bytes_read["gpu"]
    logits = []
    for batch in _steps(model, model.arch.vocab_size):
        out = forward(model, batch, kv)
        mx.eval(out)
        logits.append(np.array(out))
    read = model.store.bytes_read["gpu"] - start
    return (
        logits,
        [np.array(a) for a in kv.keys + kv.values],
        read,
        kv,
    )


@pytest.mark.parametrize(
    "name, segment",
    [*((n, 0) for n in NAMES), ("llama3", 2), ("llama3", RuntimeConfig.build().segment_blocks)],
)
def test_replayed_pass_equals_eager(name, segment, models, tmp_path, monkeypatch):
    """The same steps eager and compiled: identical logits, KV pool and bytes read; on the dense
    models the decode layout is traced once and replayed (a MoE model is never compiled: its
    router's choice is read on the host). The 3-block model in segments of 2 blocks: its pass
    traced and replayed in two graphs (the second runs the head), the same again."""
    _force_kernel_path(monkeypatch)
    plan = make_plan_file(str(models[name]), tmp_path / "p.yaml", context=256, concurrency=4)
    want, want_kv, want_read, eager_kv = _run(_engine(plan, False, segment_blocks=segment).model)
    model = _engine(plan, True, segment_blocks=segment).model
    got, got_kv, got_read, kv = _run(model)
    # What /metrics exports: nothing for the eager cache (or none), the graphs' counts here.
    assert pass_graph.counters(eager_kv) == pass_graph.counters(None) == (0, 0)
    assert pass_graph.counters(kv) == ((0, 0) if name == "mixtral" else (1, 3))
    graphs = pass_graph.graphs_for(model, kv)
    if name != "mixtral":
        (graph,) = graphs._graphs.values()
        assert len(graph.fns) == (-(-model.arch.block_count // segment) if segment else 1)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got_kv, want_kv, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_read == want_read > 0
    if name == "mixtral":
        assert graphs.traces == graphs.replays == 0
    else:
        assert graphs.traces == 1 and graphs.replays == 3  # 5 decode steps: eager, trace, 3 replays
    del graphs, kv, eager_kv  # the KV caches go: their compiled passes go with them
    gc.collect()
    assert not [g for g in pass_graph._BY_CACHE.values() if g.model is model]


def test_only_single_sequence_passes_are_compiled_by_default(models, tmp_path, monkeypatch):
    """With ``max_sequences`` = 1 (the default) the two-sequence steps run eagerly, while three
    chunks of one sequence in one layout run eager, traced, replayed, with the eager logits."""
    _force_kernel_path(monkeypatch)
    default = RuntimeConfig.build().max_sequences
    assert default == 1
    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=256, concurrency=4)
    by_mode = {c: _engine(plan, c, max_sequences=default).model for c in (False, True)}
    *_, kv = _run(by_mode[True])
    assert pass_graph.counters(kv) == (0, 0)
    slots = np.arange(64, dtype=np.int32)
    ids = np.random.default_rng(1).integers(0, by_mode[True].arch.vocab_size, 9).tolist()
    logits = {}
    for compiled, model in by_mode.items():
        kv = model.make_paged_cache(32, 4)
        logits[compiled] = [
            np.array(forward(model, ForwardBatch.build([SeqInput(ids[p : p + 3], p, slots)]), kv))
            for p in (0, 3, 6)
        ]
    assert pass_graph.counters(kv) == (1, 1)
    for a, b in zip(logits[True], logits[False], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("compiled", [True, False], ids=["on", "off"])
def test_the_serving_warm_up_traces_a_layout_where_passes_compile(
    compiled, models, tmp_path, monkeypatch
):
    """The serving engine's warm-up traces one single-sequence layout where such passes are
    compiled (its fused kernels built before any request), and none where they are not. (Where
    compiled passes are on but the pass is not eligible, as on the CPU without the kernel forced,
    the warm-up runs no extra pass: ``test_serving``'s warm-up test counts its passes.)"""
    from strata.executor.serving import ServingEngine

    _force_kernel_path(monkeypatch)
    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=256, concurrency=4)
    se = ServingEngine(_engine(plan, compiled, max_sequences=1))
    try:
        se.start(warm_up=True)
        chunk = ForwardBatch.build([SeqInput([1, 2], 0, np.arange(2, dtype=np.int32))])
        pair = ForwardBatch.build([SeqInput([1], 0, np.arange(2, dtype=np.int32))] * 2)
        model = se.engine.model
        assert pass_graph.compiles(model, chunk, se.kv) == compiled
        assert not pass_graph.compiles(model, pair, se.kv)  # two sequences
        assert pass_graph.counters(se.kv)[0] == (1 if compiled else 0)  # traced: 1 layout
    finally:
        se.close()


def test_graphs_are_the_models_own(models, tmp_path, monkeypatch):
    """A pass traced under one runtime config is never replayed under another: the graphs are
    the model's (whose config is fixed), so a model of another config (RoPE in the Q/K/V
    product's store off) over the same KV cache traces its own."""
    _force_kernel_path(monkeypatch)
    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=256, concurrency=4)
    rope_on = _engine(plan, True, fused_rope=True).model
    *_, kv = _run(rope_on)
    graphs = pass_graph.graphs_for(rope_on, kv)
    assert (graphs.traces, graphs.replays) == (1, 3)
    rope_off = _engine(plan, True, fused_rope=False).model
    for batch in _steps(rope_off, rope_off.arch.vocab_size)[1:3]:  # the decode layout, twice
        mx.eval(forward(rope_off, batch, kv))
    others = pass_graph.graphs_for(rope_off, kv)
    assert others is not graphs and others.model is rope_off
    assert (others.traces, others.replays) == (1, 0)  # seen once eager, then traced anew
    assert (graphs.traces, graphs.replays) == (1, 3)


def test_layout_key_pads_the_table_width():
    """A decoding sequence keeps its layout (and graph) within ``TABLE_SLOTS`` slots; the padded
    table's extra slots are zeros the kernel never reads."""
    slots = np.arange(300, dtype=np.int32)
    keys = []
    for start in (10, 11, 255, 256):
        b = ForwardBatch.build(
            [SeqInput([1], start, slots, "last"), SeqInput([2], 3, slots, "last")]
        )
        width = pass_graph.table_width(b)
        keys.append(pass_graph.layout_key(b, 2, width))
        tables, _ = attention.kernel_layout(b, 2, width)
        assert tables.shape == (2, width) and not np.array(tables)[1, 4:].any()
    assert [k[3] for k in keys] == [256, 256, 256, 512]
    assert keys[0] == keys[1] == keys[2] != keys[3]


def test_layout_key_tells_apart_passes_grouped_differently():
    """The attention kernel's launch depends on the number of query groups and the largest
    (``executor.cuda_attention``): passes of the same tokens and sequences whose chunks group
    differently get their own graphs; those that group alike share one (the groups enter as
    an array)."""
    slots = np.arange(64, dtype=np.int32)

    def key(a: int, b: int) -> tuple:
        batch = ForwardBatch.build([SeqInput([1] * a, 20, slots), SeqInput([2] * b, 30, slots)])
        return pass_graph.layout_key(batch, 16, pass_graph.table_width(batch))

    assert key(9, 3) != key(6, 6)  # groups 8 + 1 + 3 against 6 + 6
    assert key(9, 3)[-2:] == (3, 8) and key(6, 6)[-2:] == (2, 6)
    assert key(5, 7) == key(7, 5)


@pytest.mark.parametrize("segment", [0, 2], ids=["one-graph", "second-segment"])
def test_a_pass_that_cannot_be_traced_runs_eagerly(segment, models, tmp_path, monkeypatch, capsys):
    """Tracing that raises (an operation ``mx.compile`` refuses) turns compiled passes off for
    the KV cache, with one warning: the same logits, KV pool and bytes read as eager passes;
    also where the second of two segments refuses after the first was traced and replaced its
    pools."""
    _force_kernel_path(monkeypatch)
    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=256, concurrency=4)
    want, want_kv, want_read, _ = _run(_engine(plan, False, segment_blocks=segment).model)
    model = _engine(plan, True, segment_blocks=segment).model
    compile_ = mx.compile
    made = []

    def refuses(fn):
        made.append(fn)
        if segment and len(made) % 2:  # the first of the two segments compiles
            return compile_(fn)

        def call(*args):
            raise ValueError("[compile] this primitive cannot be traced")

        return call

    monkeypatch.setattr(pass_graph.mx, "compile", refuses)
    got, got_kv, got_read, kv = _run(model)
    graphs = pass_graph.graphs_for(model, kv)
    for a, b in zip([*got, *got_kv], [*want, *want_kv], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_read == want_read
    assert graphs.disabled and "cannot be traced" in graphs.disabled
    assert graphs.traces == graphs.replays == 0
    assert capsys.readouterr().err.count("compiled passes are off") == 1


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_lone_decodes_compile_with_the_lone_decode_kernel(name, models, tmp_path, monkeypatch):
    """``lone_decode_kernel``: a lone sequence's decode steps are attended by the paged kernel,
    so that the compiled passes take them (traced once, then replayed step after step), with the
    greedy ids of the eager decodes that MLX's SDPA attends (gemma3: its sliding window too)."""
    from strata.executor.generate import generate
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import ServingEngine

    _force_kernel_path(monkeypatch)
    plan = make_plan_file(str(models[name]), tmp_path / "p.yaml", context=256, concurrency=1)
    prompt = np.random.default_rng(3).integers(0, 200, 5).tolist()
    got = {}
    for lone in (False, True):
        se = ServingEngine(_engine(plan, True, max_sequences=1, lone_decode_kernel=lone))
        try:
            se.start(warm_up=False)
            out = generate(se, prompt, SamplingParams(), 24, stop_at_eog=False)
            got[lone] = (out.output_ids, pass_graph.counters(se.kv))
        finally:
            se.close()
    assert got[True][0] == got[False][0]
    assert got[False][1] == (0, 0)  # every decode eager (SDPA)
    traces, replays = got[True][1]
    assert traces >= 1 and replays >= 20  # one layout for the lone decodes' table width
