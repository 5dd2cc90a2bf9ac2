"""The serving engine's thread around its requests: the warm-up (which records no routing and
stops early when the engine closes) and the release of what the thread made, however it ends."""

from __future__ import annotations

import threading

import pytest
from conftest import make_plan_file
from gguf_factory import write_arch_model
from strata.common.errors import StrataError
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory, smollm2_gguf):
    """A tiny Mixtral-style model (8 experts, top-2), all resident."""
    d = tmp_path_factory.mktemp("engine-thread")
    gguf = write_arch_model(d / "mixtral.gguf", "mixtral", smollm2_gguf)
    return make_plan_file(str(gguf), d / "p.yaml", context=64, concurrency=2)


def test_warm_up_records_no_routing(moe_plan):
    """The warm-up's passes of token 0 route through every MoE block but are not traffic: the
    routing tracker (what ``--save-routing-profile`` writes and the prefetch predicts from)
    holds only the request's tokens."""
    se = ServingEngine(Engine(load_plan(moe_plan)))
    try:
        se.start(warm_up=True)
        routing = se.engine.store.routing
        assert routing.tokens.sum() == 0
        g = generate(se, [1, 2, 3, 4, 5], SamplingParams(), 3)
        # Every block routed each computed token once: the prompt's and all but the last output.
        assert routing.tokens.tolist() == [5 + len(g.output_ids) - 1] * len(routing.tokens)
    finally:
        se.close()


def test_a_failed_warm_up_releases_the_kv_pool(moe_plan, monkeypatch):
    """A warm-up that raises: ``start`` says so, and the engine thread has dropped the KV pool
    it made (on CUDA, compiled passes outliving their thread abort the process at exit)."""
    se = ServingEngine(Engine(load_plan(moe_plan)))

    def boom(*args, **kwargs):
        raise RuntimeError("kernel build failed")

    monkeypatch.setattr(se.runner, "warm_up", boom)
    try:
        with pytest.raises(StrataError, match="kernel build failed"):
            se.start(warm_up=True)
        assert se.runner.kv is None
    finally:
        se.close()


def test_a_stopped_warm_up_runs_no_more_passes(moe_plan, monkeypatch):
    """``ModelRunner.warm_up`` with its stop event set (the engine closing: Ctrl-C) runs none of
    its passes; unset, it runs them."""
    engine = Engine(load_plan(moe_plan))
    try:
        se = ServingEngine(engine)
        runner, b = se.runner, engine.loaded.plan.batch
        runner.make_kv(b.kv_num_blocks, b.kv_block_size)
        passes = []
        real = runner.run
        monkeypatch.setattr(runner, "run", lambda inputs: passes.append(1) or real(inputs))
        stop = threading.Event()
        stop.set()
        runner.warm_up(b.max_num_batched_tokens, b.max_num_seqs, se.context, stop)
        assert passes == []
        runner.warm_up(b.max_num_batched_tokens, b.max_num_seqs, se.context, threading.Event())
        assert passes
        runner.close()
        assert runner.kv is None
    finally:
        engine.close()
