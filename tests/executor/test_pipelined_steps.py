"""Pipelined serving steps (``executor.serving``, "Pipelined steps"): a greedy step is launched
while the step before it computes, its tokens read one step later. The outputs must be exactly
those of the engine that reads every step's tokens first (``pipelined_steps=False``), whatever
ends a sequence (an end-of-generation token, ``max_tokens``, the context, an abort, a
preemption), with sampled requests mixed in, and no KV block may leak.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_plan_file
from gguf_factory import write_arch_model
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import GenerationRequest, ServingEngine
from test_serving import _with_batch, run_all

CONTEXT = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pipelined-models")
    return {
        n: write_arch_model(folder / f"{n}.gguf", n, smollm2_gguf)
        for n in ("llama3", "gemma3", "qwen3moe")
    }


def _engine(plan: Path, pipelined: bool, eog: set[int], **options) -> ServingEngine:
    loaded = load_plan(plan)
    config = RuntimeConfig.build(loaded.plan.runtime, pipelined_steps=pipelined)
    se = ServingEngine(Engine(loaded, config=config), **options)
    se._eog = set(eog)  # the same end-of-generation ids for both engines (module docstring)
    se.start()
    return se


def _requests(vocab: int, n: int, sampled: bool) -> list[GenerationRequest]:
    """``n`` requests of prompts 3..45 tokens, max_tokens 3..40 (some reach the context), every
    third one sampled (seeded) where ``sampled``; end-of-generation ids honoured."""
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(n):
        params = SamplingParams(temperature=0.8, seed=i) if sampled and i % 3 == 2 else None
        prompt = rng.integers(0, vocab, size=3 + (i * 7) % 43).tolist()
        reqs.append(
            GenerationRequest(f"r{i}", prompt, 3 + (i * 11) % 38, params or SamplingParams())
        )
    return reqs


def _outputs(plan: Path, pipelined: bool, eog: set[int], reqs, **options):
    se = _engine(plan, pipelined, eog, **options)
    try:
        got = run_all(se, reqs)
        m = se.metrics()
    finally:
        se.close()
    assert m["kv_blocks_in_use"] == 0 and m["running"] == 0 and m["waiting"] == 0
    return {r: (ev.token_ids, ev.finish_reason, ev.completion_tokens) for r, ev in got.items()}, m


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3moe"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "mixed"])
def test_pipelined_outputs_equal_unpipelined(name, sampled, models, tmp_path):
    """12 requests at once: ids, finish reasons and token counts equal with and without
    pipelining; greedy-only traffic is pipelined, and an end-of-generation token (one the
    unpipelined run produces) ends some requests early."""
    plan = make_plan_file(str(models[name]), tmp_path / "p.yaml", context=CONTEXT, concurrency=6)
    reqs = _requests(1000, 12, sampled)
    probe, _ = _outputs(plan, False, set(), _requests(1000, 12, sampled))
    # Tokens the requests produce early on, as end-of-generation ids: several stop with "stop".
    eog = {probe[f"r{i}"][0][2] for i in (1, 4) if len(probe[f"r{i}"][0]) > 2}
    want, m0 = _outputs(plan, False, eog, reqs)
    got, m1 = _outputs(plan, True, eog, _requests(1000, 12, sampled))
    assert got == want
    assert {r[1] for r in want.values()} >= {"stop", "length"}
    assert m0["pipelined_steps"] == 0
    if not sampled:
        assert m1["pipelined_steps"] > m1["steps"] // 2
    # A pipelined step after a sequence ended computes it once more, discarded: never fewer
    # steps, never a token more.
    assert sum(len(r[0]) for r in got.values()) == sum(len(r[0]) for r in want.values())


def test_pipelined_under_preemption_and_batch_invariance(models, tmp_path):
    """A pool too small for the batch (preemptions while tokens are in flight) and
    batch-invariant serving: the unpipelined ids."""
    base = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=6
    )
    small = _with_batch(base, tmp_path / "small.yaml", kv_num_blocks=10)
    reqs = lambda: [  # noqa: E731
        GenerationRequest(
            f"q{i}", [(5 * i + j) % 300 for j in range(20 + 3 * i)], 24, SamplingParams()
        )
        for i in range(6)
    ]
    want, _ = _outputs(small, False, set(), reqs())
    got, m = _outputs(small, True, set(), reqs())
    assert got == want and m["preemptions"] > 0 and m["pipelined_steps"] > 0
    want, _ = _outputs(base, False, set(), reqs(), batch_invariant=True)
    got, m = _outputs(base, True, set(), reqs(), batch_invariant=True)
    assert got == want and m["pipelined_steps"] > 0


def test_abort_while_a_step_is_in_flight(models, tmp_path):
    """Aborting a request on its first token (its next step already launched) ends it and
    frees its blocks; the others give their unpipelined ids."""
    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    reqs = lambda: _requests(1000, 4, False)  # noqa: E731
    want, _ = _outputs(plan, False, set(), reqs())
    se = _engine(plan, True, set())
    events: dict[str, list] = {}
    import threading

    done = threading.Event()
    rs = reqs()
    rs[0] = GenerationRequest("long", rs[0].prompt_ids, 40, SamplingParams())

    def on_event(ev):
        events.setdefault(ev.request_id, []).append(ev)
        if ev.request_id == "long" and ev.token_ids and ev.finish_reason is None:
            se.abort("long")
        if all(r.request_id in events and events[r.request_id][-1].finish_reason for r in rs[1:]):
            done.set()

    try:
        for r in rs:
            se.submit(r, on_event)
        assert done.wait(120)
        se.close()
    finally:
        se.close()
    m = se.metrics()
    assert m["kv_blocks_in_use"] == 0
    for r in rs[1:]:
        ids = [t for ev in events[r.request_id] for t in ev.token_ids]
        assert ids == want[r.request_id][0]
    assert len([t for ev in events["long"] for t in ev.token_ids]) < 40


def test_a_reused_request_id_gets_none_of_the_old_requests_tokens(models, tmp_path):
    """A request aborted and submitted again under the same id while its step is in flight:
    the step's token belongs to the old request and is dropped; the new one runs to its end
    (the engine thread once died here on the new request's empty outputs)."""
    import threading

    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    se = _engine(plan, True, set())
    events: list = []
    done, state = threading.Event(), {"resubmitted": False}

    def on_event(ev):
        events.append(ev)
        if ev.request_id == "x" and not state["resubmitted"] and ev.token_ids:
            state["resubmitted"] = True
            se.abort("x")
            se.submit(GenerationRequest("x", [7, 8, 9, 10], 5, SamplingParams()), on_event)
        elif ev.finish_reason is not None and state["resubmitted"]:
            done.set()

    try:
        se.submit(GenerationRequest("x", [1, 2, 3, 4, 5, 6], 30, SamplingParams()), on_event)
        assert done.wait(60) and se._thread.is_alive()
        m = se.metrics()
    finally:
        se.close()
    last = events[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 5
    assert m["kv_blocks_in_use"] == 0


def test_a_step_that_fails_when_read_leaves_nothing_in_the_prefix_cache(models, tmp_path):
    """A pipelined step offers its blocks to the prefix cache at launch; when reading it fails,
    the cache is forgotten: the same prompt afterwards is computed, not served from blocks of a
    failed pass."""
    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    se = _engine(plan, True, set())
    collect, failed = se.runner.collect, []

    def failing(launched):
        if not failed and any(c.seq.request_id == "a" for c in launched.step.chunks):
            failed.append(True)
            raise RuntimeError("simulated device failure")
        return collect(launched)

    se.runner.collect = failing
    prompt = list(range(1, 40))
    try:
        a = run_all(se, [GenerationRequest("a", prompt, 3, SamplingParams())])["a"]
        b = run_all(se, [GenerationRequest("b", prompt, 3, SamplingParams())])["b"]
    finally:
        se.close()
    assert a.finish_reason == "error" and "simulated" in (a.error or "")
    assert b.finish_reason == "length" and b.cached_tokens == 0
