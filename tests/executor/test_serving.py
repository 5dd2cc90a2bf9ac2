"""Continuous batching (``executor.serving``) on tiny synthetic models of every architecture and
on the real SmolLM2: a request gives the same greedy ids alone and inside a batch of mixed
requests, with and without a prefix-cache hit, under preemption and on streamed tiers; no KV block
leaks; the plan's batch limits hold.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import strata.executor.serving as serving_module
import yaml
from attention_reference import attention_by_definition
from conftest import make_plan_file
from gguf_factory import ARCH_MODELS, MOE_MODELS, write_arch_model
from plan_edits import moved_plan as _moved
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.paged_kv import _pieces
from strata.executor.plan_loader import load_plan
from strata.executor.runner import warm_up_sizes
from strata.executor.sampling import SamplingParams
from strata.executor.serving import GenerationRequest, ServingEngine, TokenEvent
from test_tiers import _nvme_bytes

NAMES = list(ARCH_MODELS) + list(MOE_MODELS)
CONTEXT = 256
BATCH = 16


def _serve(plan: Path, **options) -> ServingEngine:
    se = ServingEngine(Engine(load_plan(plan)), **options)
    se.start()
    return se


def run_all(
    se: ServingEngine, reqs: list[GenerationRequest], on_first=None
) -> dict[str, TokenEvent]:
    """Submit ``reqs`` together; wait for all to finish. Returns the last event per request with
    ``token_ids`` replaced by all its tokens."""
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    last: dict[str, TokenEvent] = {}
    done = threading.Event()

    def on_event(ev: TokenEvent) -> None:
        out[ev.request_id] += ev.token_ids
        if on_first is not None and ev.token_ids:
            on_first(ev)
        if ev.finish_reason is not None:
            last[ev.request_id] = ev
            if len(last) == len(reqs):
                done.set()

    for r in reqs:
        se.submit(r, on_event)
    assert done.wait(600), "requests did not finish"
    for rid, ev in last.items():
        ev.token_ids = out[rid]
    return last


def _requests(tag: str, vocab: int, n: int, seed: int = 0) -> list[GenerationRequest]:
    """``n`` greedy requests of different prompt lengths (3..45 tokens) and output lengths."""
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            f"{tag}-{i}",
            rng.integers(0, vocab, size=3 + (i * 6) % 43).tolist(),
            4 + i % 5,
            SamplingParams(),
            ignore_eos=True,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("serving-models")
    return {n: write_arch_model(folder / f"{n}.gguf", n, smollm2_gguf) for n in NAMES}


@pytest.mark.parametrize(
    "name, invariant",
    [(n, False) for n in NAMES] + [("llama3", True), ("gemma3", True)],
    ids=NAMES + ["llama3-batch-invariant", "gemma3-batch-invariant"],
)
def test_batch_equals_alone(name, invariant, models, tmp_path):
    """Every architecture: 16 mixed requests (prefill chunks and decodes in the same steps, a
    sliding window on gemma3, experts on the MoE ones) give the ids each gives alone, and alone
    equals one request of ``executor.generate`` (``strata run``'s). The batch's prompts are the
    ones run alone, so the prefix cache serves their full blocks: the same ids with and without a
    hit.
    Batch-invariant mode (llama3, and gemma3 for its 8-token window inside 16-token pieces):
    the same, a cold batch after a prefix-cache reset too, and what makes it hold on backends
    whose kernels are not batch-invariant (this CPU's are): each request attends in the same
    pieces alone and in any batch, cold or with a hit (which leaves out the cached pieces)."""
    plan = make_plan_file(
        str(models[name]), tmp_path / "p.yaml", context=CONTEXT, concurrency=BATCH
    )
    se = _serve(plan, batch_invariant=invariant)
    pieces: dict[str, set[tuple[int, int]]] = defaultdict(set)  # request -> attention pieces
    schedule = se.scheduler.schedule

    def recording_schedule():
        step = schedule()
        for c in step.chunks:
            pieces[c.seq.request_id] |= set(_pieces(c.start, c.start + c.num_tokens, se._tile))
        return step

    se.scheduler.schedule = recording_schedule
    try:
        vocab = se.vocab_size
        alone = {
            r.request_id: run_all(se, [r])[r.request_id].token_ids
            for r in _requests("a", vocab, BATCH)
        }
        batch = run_all(se, _requests("b", vocab, BATCH))
        hits = se.metrics()["prefix_hit_tokens"]
        if invariant:
            assert se.reset_prefix_cache()
            cold = run_all(se, _requests("c", vocab, BATCH))
            assert se.metrics()["prefix_hit_tokens"] == hits  # no hit after the reset
            for i in range(BATCH):
                assert cold[f"c-{i}"].token_ids == alone[f"a-{i}"], f"request {i} differs cold"
                assert pieces[f"c-{i}"] == pieces[f"a-{i}"] >= pieces[f"b-{i}"]
                assert all(lo // 16 == (hi - 1) // 16 for lo, hi in pieces[f"c-{i}"])
        r0 = _requests("x", vocab, 1)[0]
        single = generate(se, r0.prompt_ids, SamplingParams(), r0.max_tokens, stop_at_eog=False)
        m = se.metrics()
    finally:
        se.close()
    for i in range(BATCH):
        assert batch[f"b-{i}"].token_ids == alone[f"a-{i}"], f"request {i} differs in the batch"
        assert batch[f"b-{i}"].finish_reason == "length"
        assert len(alone[f"a-{i}"]) == 4 + i % 5
    assert single.output_ids == alone["a-0"]
    assert hits > 0 and m["batch_invariant"] == int(invariant)
    assert m["kv_blocks_in_use"] == 0 and m["running"] == 0 and m["waiting"] == 0
    # the batch ran as batches: fewer steps than tokens
    assert m["batched_tokens"] > m["steps"]


def test_prefix_cache_hit_gives_the_same_ids(models, tmp_path):
    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    se = _serve(plan)
    try:
        rng = np.random.default_rng(7)
        prefix = rng.integers(0, se.vocab_size, size=40).tolist()  # 2 full blocks of 16
        mk = lambda rid, tail: GenerationRequest(rid, prefix + tail, 6, SamplingParams(), True)  # noqa: E731
        cold = run_all(se, [mk("cold", [5, 6, 7])])["cold"]
        m0 = se.metrics()
        warm = run_all(se, [mk("warm", [5, 6, 7])])["warm"]
        other = run_all(se, [mk("other", [9, 9])])["other"]
        m1 = se.metrics()
    finally:
        se.close()
    assert cold.cached_tokens == 0
    # Two whole blocks, then the rest of the prefix from cold's third block (lent slots): all
    # but the last token for warm, the 40 prefix tokens for other.
    assert warm.cached_tokens == 42 and other.cached_tokens == 40
    assert m1["prefix_hit_tokens"] - m0["prefix_hit_tokens"] == 82
    assert warm.token_ids == cold.token_ids
    # the same prefix with another tail, on a fresh engine (no cache): the same ids
    se2 = _serve(plan)
    try:
        fresh = run_all(se2, [mk("fresh", [9, 9])])["fresh"]
    finally:
        se2.close()
    assert fresh.cached_tokens == 0 and fresh.token_ids == other.token_ids


def test_lent_slots_are_copied_into_the_borrowers_block(models, tmp_path):
    """A partial prefix hit copies the lent KV slots into the borrower's own block after its
    first pass: a later prompt that hits that block whole (and reads the copied slots) gets the
    log-probabilities a fresh engine computes (the slots left unwritten would change them), and
    no block stays in use."""
    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 1000, size=40).tolist()  # 2 whole blocks of 16, 8 tokens into a 3rd
    a = GenerationRequest("a", prefix + [5, 6, 7], 6, SamplingParams(), True)
    b = GenerationRequest("b", prefix + [9] * 10, 4, SamplingParams(), True)
    c = GenerationRequest("c", prefix + [9] * 10 + [1], 1, SamplingParams(), True, logprobs=8)
    se = _serve(plan)
    try:
        run_all(se, [a])  # registers a's third block: prefix[32:40], 5 6 7, outputs
        got_b = run_all(se, [b])["b"]  # lends 8 slots of it; b's own third block gets them
        got_c = run_all(se, [c])["c"]  # hits b's third block whole
        m = se.metrics()
    finally:
        se.close()
    assert got_b.cached_tokens == 40 and got_c.cached_tokens == 48
    assert m["kv_blocks_in_use"] == 0
    se2 = _serve(plan)
    try:
        fresh = run_all(se2, [c])["c"]
    finally:
        se2.close()
    assert fresh.cached_tokens == 0 and fresh.token_ids == got_c.token_ids
    (want,), (got,) = fresh.logprobs, got_c.logprobs
    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert np.allclose([v for _, v in got.top], [v for _, v in want.top], rtol=0, atol=1e-4)


def test_a_failed_lent_slot_copy_ends_the_borrower_and_forgets_the_cache(
    models, tmp_path, monkeypatch
):
    """If copying lent slots fails, the borrower (whose own block lacks them) ends with
    ``error`` after the tokens it had, no cached block is served afterwards, no block stays in
    use, and the engine keeps serving."""
    from strata.executor.paged_kv import PagedKVCache

    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    prefix = np.random.default_rng(12).integers(0, 1000, size=40).tolist()
    se = _serve(plan)
    try:
        run_all(se, [GenerationRequest("a", prefix + [5, 6, 7], 6, SamplingParams(), True)])

        def broken(self, src, dst):
            raise RuntimeError("no copy today")

        monkeypatch.setattr(PagedKVCache, "copy_slots", broken)
        b = run_all(se, [GenerationRequest("b", prefix + [9] * 10, 4, SamplingParams(), True)])
        monkeypatch.undo()
        c = run_all(se, [GenerationRequest("c", prefix + [9] * 11, 2, SamplingParams(), True)])
        m = se.metrics()
    finally:
        se.close()
    assert b["b"].finish_reason == "error" and "copying" in (b["b"].error or "")
    assert b["b"].cached_tokens == 40 and len(b["b"].token_ids) == 1
    assert c["c"].finish_reason == "length" and c["c"].cached_tokens == 0
    assert m["kv_blocks_in_use"] == 0


def test_staged_inputs_give_the_ids_of_fresh_arrays(models, tmp_path, monkeypatch):
    """A batch of 16 mixed requests whose passes write their integer inputs into the engine's
    kept buffers (``executor.host_inputs``, the default) gives the ids of the same batch with a
    new array per input, on a fresh engine each, and the buffers were used (their fences:
    ``tests/test_host_inputs.py``)."""
    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=BATCH
    )
    out = {}
    for staged in (True, False):
        loaded = load_plan(plan)
        config = RuntimeConfig.build(loaded.plan.runtime, stage_inputs=staged)
        se = ServingEngine(Engine(loaded, config=config))
        se.start()
        try:
            out[staged] = run_all(se, _requests("s", se.vocab_size, BATCH, seed=3))
            grown = se.runner.staging.grown
        finally:
            se.close()
        assert (grown > 0) == staged
    for rid, ev in out[True].items():
        assert ev.token_ids == out[False][rid].token_ids, rid


def test_reset_prefix_cache(models, tmp_path):
    """Refused while a request is live (the cache still serves the next one); applied once idle:
    the same prompt is then computed in full, with the same ids."""
    from strata.common.errors import StrataError

    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT)
    se = _serve(plan)
    try:
        prompt = np.random.default_rng(3).integers(0, se.vocab_size, size=40).tolist()
        mk = lambda rid: GenerationRequest(rid, prompt, 4, SamplingParams(), True)  # noqa: E731
        first = run_all(se, [mk("first")])["first"]
        finished = threading.Event()
        se.submit(mk("live"), lambda ev: ev.finish_reason and finished.set())
        refused = se.reset_prefix_cache()  # applied after the submit: the request is live
        assert finished.wait(600)
        hit = run_all(se, [mk("hit")])["hit"]
        reset = se.reset_prefix_cache()
        cold = run_all(se, [mk("cold")])["cold"]
    finally:
        se.close()
    assert (refused, reset) == (False, True)
    assert first.cached_tokens == 0 and hit.cached_tokens == 32 and cold.cached_tokens == 0
    assert cold.token_ids == hit.token_ids == first.token_ids
    with pytest.raises(StrataError, match="not running"):
        se.reset_prefix_cache()


def _with_batch(plan: Path, out: Path, **batch) -> Path:
    data = yaml.safe_load(plan.read_text())
    data["batch"].update(batch)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def test_preemption_under_a_small_kv_pool(models, tmp_path):
    """A pool of 8 blocks for 6 requests that need 3-4 blocks each: sequences are preempted and
    recomputed, every request still completes with its alone ids, and no block leaks."""
    base = make_plan_file(str(models["qwen3"]), tmp_path / "p.yaml", context=64, concurrency=6)
    small = _with_batch(base, tmp_path / "small.yaml", kv_num_blocks=8)
    reqs = lambda tag: [  # noqa: E731
        GenerationRequest(
            f"{tag}-{i}", [(7 * i + j) % 200 for j in range(30 + i)], 20, SamplingParams(), True
        )
        for i in range(6)
    ]
    se = _serve(base)
    try:
        alone = {r.request_id[2:]: run_all(se, [r])[r.request_id].token_ids for r in reqs("a")}
    finally:
        se.close()
    se = _serve(small)
    try:
        got = run_all(se, reqs("b"))
        m = se.metrics()
    finally:
        se.close()
    assert m["preemptions"] > 0
    assert m["kv_blocks_total"] == 8 and m["kv_blocks_in_use"] == 0
    for i in range(6):
        assert got[f"b-{i}"].token_ids == alone[str(i)]


def test_abort_frees_blocks_and_limits_hold(models, tmp_path):
    """An abort mid-generation frees its blocks; a step never runs more sequences or tokens than
    the plan allows."""
    base = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=3
    )
    plan = _with_batch(base, tmp_path / "b.yaml", max_num_batched_tokens=20, prefill_chunk=16)
    se = _serve(plan)
    seen = []
    orig = se.scheduler.schedule

    def schedule():
        step = orig()
        seen.append((len(step.chunks), step.num_tokens))
        return step

    se.scheduler.schedule = schedule
    try:
        long = GenerationRequest("long", [3] * 10, 200, SamplingParams(), True)

        def on_first(ev):
            if ev.request_id == "long":
                se.abort("long")

        reqs = [long] + _requests("c", se.vocab_size, 5)
        res = run_all_or_abort(se, reqs, on_first)
        m = se.metrics()
    finally:
        se.close()
    assert "long" not in res or res["long"].finish_reason in ("abort", None)
    assert all(n <= 3 and t <= 20 for n, t in seen), seen
    assert max(t for _, t in seen) > 1
    assert m["kv_blocks_in_use"] == 0 and m["running"] == 0


def run_all_or_abort(se, reqs, on_first):
    """Like ``run_all`` where an aborted request sends no final event: wait for the others."""
    others = [r for r in reqs if r.request_id != "long"]
    out: dict[str, TokenEvent] = {}
    done = threading.Event()

    def on_event(ev: TokenEvent) -> None:
        if ev.token_ids:
            on_first(ev)
        if ev.finish_reason is not None:
            out[ev.request_id] = ev
            if all(r.request_id in out for r in others):
                done.set()

    for r in reqs:
        se.submit(r, on_event)
    assert done.wait(600)
    return out


def test_streamed_tier_reads_each_unit_once_per_step(models, tmp_path):
    """FFNs on NVMe: a batch gives the resident ids, and each step reads every streamed unit
    once for the whole batch (bytes read = steps x one pass)."""
    base = make_plan_file(str(models["qwen2"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4)
    streamed = _moved(base, tmp_path / "ffn-nvme.yaml", "nvme", roles=[".ffn"])
    se = _serve(base)
    try:
        want = run_all(se, _requests("r", se.vocab_size, 4))
    finally:
        se.close()
    se = _serve(streamed)
    try:
        m0 = se.metrics()
        got = run_all(se, _requests("r", se.vocab_size, 4))
        m1 = se.metrics()
        per_pass = _nvme_bytes(se.engine, 1, 0)
    finally:
        se.close()
    for rid, ev in want.items():
        assert got[rid].token_ids == ev.token_ids
    steps = m1["steps"] - m0["steps"]
    assert per_pass > 0
    assert m1["bytes_read"]["nvme"] - m0["bytes_read"]["nvme"] == steps * per_pass


def test_submit_refuses_requests_that_cannot_run(models, tmp_path):
    from strata.common.errors import StrataError

    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=64)
    se = _serve(plan)
    try:
        for ids, msg in (([], "empty"), ([1] * 64, "context"), ([10**7], "vocabulary")):
            with pytest.raises(StrataError, match=msg):
                se.submit(GenerationRequest("x", ids, 4, SamplingParams()), lambda ev: None)
    finally:
        se.close()
    # A KV cache cut by hand below one request's need: refused at submit (the server's 400),
    # not as an error event after it was accepted.
    data = yaml.safe_load(plan.read_text())
    data["batch"]["kv_num_blocks"] = 2
    small = tmp_path / "small-kv.yaml"
    small.write_text(yaml.safe_dump(data, sort_keys=False))
    se = _serve(small)
    try:
        with pytest.raises(StrataError, match="needs up to 3 KV blocks"):
            se.submit(GenerationRequest("y", [1] * 20, 20, SamplingParams()), lambda ev: None)
    finally:
        se.close()


def test_smollm2_batch_of_mixed_requests(smollm2_gguf, tmp_path):
    """The real model: 4 prompts alone and together give the same greedy ids, and the batch's
    limits are the ones the planner chose for the concurrency."""
    plan = make_plan_file(str(smollm2_gguf), tmp_path / "p.yaml", context=512, concurrency=4)
    se = _serve(plan)
    try:
        tok = se.tokenizer
        texts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,"]
        mk = lambda tag: [  # noqa: E731
            GenerationRequest(f"{tag}{i}", tok.encode(t), 6, SamplingParams(), True)
            for i, t in enumerate(texts)
        ]
        alone = [run_all(se, [r])[r.request_id].token_ids for r in mk("a")]
        batch = run_all(se, mk("b"))
        plan_batch = load_plan(plan).plan.batch
    finally:
        se.close()
    assert [batch[f"b{i}"].token_ids for i in range(4)] == alone
    assert se.batch == plan_batch and se.scheduler.max_num_seqs == plan_batch.max_num_seqs == 4


def test_batch_invariant_speculative_decoding(models, tmp_path):
    """Batch-invariant serving with prompt lookup: verifications attend one token per piece, so
    greedy ids equal the mode's plain decoding, alone and as a batch, with drafts accepted."""
    from strata.executor.drafters import PromptLookupDrafter

    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=64)
    engine = Engine(load_plan(plan))
    mk = lambda tag: [  # noqa: E731  (random weights repeat themselves: lookup finds drafts)
        GenerationRequest(f"{tag}{i}", [5 + i, 9, 5 + i, 9, 5 + i], 24, SamplingParams(), True)
        for i in range(3)
    ]
    try:
        runs = {}
        for name, options in (
            ("plain", {"speculative": False}),
            ("spec", {"drafter": PromptLookupDrafter(), "num_draft_tokens": 3}),
        ):
            se = ServingEngine(engine, batch_invariant=True, **options)
            se.start()
            try:
                alone = [run_all(se, [r])[r.request_id].token_ids for r in mk("a")]
                batch = run_all(se, mk("b"))
                runs[name] = (alone, [batch[f"b{i}"].token_ids for i in range(3)], se.spec_stats())
            finally:
                se.close()
    finally:
        engine.close()
    assert runs["spec"][0] == runs["plain"][0] == runs["plain"][1] == runs["spec"][1]
    assert runs["spec"][2]["accepted"] > 0


def test_warm_up_runs_every_row_bucket_and_leaves_no_state(models, tmp_path):
    """``start(warm_up=True)`` (on by default on MLX's CUDA backend) runs one forward pass per
    row bucket up to the plan's token budget, waits for it, and leaves the block pool, the
    prefix cache and every later output as they would be without it."""
    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT)
    plan = _with_batch(
        plan, tmp_path / "b.yaml", max_num_batched_tokens=40, prefill_chunk=40, max_num_seqs=8
    )
    reqs = _requests("w", 512, 3)
    outs = []
    for warm in (False, True):
        se = ServingEngine(Engine(load_plan(plan)))
        seen = []
        run = se.runner.run  # one forward pass of the runner's (its inputs' tokens counted)
        se.runner.run = lambda inputs, seen=seen, run=run: (
            seen.append(sum(len(s.ids) for s in inputs)) or run(inputs)
        )
        try:
            took = se.start(warm_up=warm)
            assert (took > 0) == warm
            # chunks of 1..40 tokens, then decode groups of 2..8 sequences (the plan's max)
            buckets = [1, 2, 4, 8, 16, 24, 32, 40, 2, 4, 8]
            assert seen == (buckets if warm else [])
            assert se.pool.num_used_blocks() == 0 and se.pool.prefix_query_tokens == 0
            outs.append({r: ev.token_ids for r, ev in run_all(se, reqs).items()})
        finally:
            se.close()
    assert outs[0] == outs[1]


def test_warm_up_sizes_meet_every_row_bucket():
    """One pass per bucket of ``bucket_rows``: powers of two and 24 to 256, then multiples of
    256."""
    from strata.executor.ops import bucket_rows

    assert warm_up_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert warm_up_sizes(600) == [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512, 600]
    assert warm_up_sizes(1) == [1] and warm_up_sizes(0) == []
    sizes = warm_up_sizes(2048)
    assert sizes[-4:] == [1280, 1536, 1792, 2048]
    assert {bucket_rows(n) for n in range(1, 2049)} == {bucket_rows(n) for n in sizes}


def test_a_failed_warm_up_is_reported_and_stops_the_thread(models, tmp_path):
    from strata.common.errors import StrataError

    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT)
    se = ServingEngine(Engine(load_plan(plan)))

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    se.runner.run = broken
    with pytest.raises(StrataError, match="could not start: RuntimeError: out of memory"):
        se.start(warm_up=True)
    assert not se._thread.is_alive()
    with pytest.raises(StrataError, match="not running"):
        se.submit(_requests("x", 512, 1)[0], lambda ev: None)
    se.close()


def test_a_step_that_schedules_nothing_does_not_spin(models, tmp_path, monkeypatch):
    """While the scheduler can run nothing (waiting requests whose blocks only a finish or an
    abort would free), the engine thread waits for a message between tries instead of a busy
    loop that would starve the server's event loop of the GIL; the request runs once the
    scheduler can run it."""
    import time

    from strata.executor.scheduler import SchedulerStep

    plan = make_plan_file(str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT)
    se = _serve(plan)
    real, tries = se.scheduler.schedule, []
    se.scheduler.schedule = lambda: tries.append(1) or SchedulerStep()  # nothing can run
    try:
        done = threading.Event()
        req = _requests("w", 512, 1)[0]
        se.submit(req, lambda ev: ev.finish_reason and done.set())
        time.sleep(0.5)
        assert 0 < len(tries) < 0.5 / serving_module.STALL_WAIT_S + 10  # not thousands
        se.scheduler.schedule = real
        se.abort("nobody")  # any message wakes it at once
        assert done.wait(60)
    finally:
        se.scheduler.schedule = real
        se.close()


def test_a_failed_sampling_ends_only_its_request(models, tmp_path, monkeypatch):
    """One request's sampler raising (here: its verify) in a step of four: that request ends
    with an error event naming the failure, the others finish with the ids they get without
    it, and no KV block stays in use."""
    import strata.executor.serving as serving

    plan = make_plan_file(
        str(models["llama3"]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4
    )
    # Sampled, not greedy: every request goes through Sampler.verify.
    sampled = SamplingParams(temperature=0.8, seed=7)
    reqs = [replace(r, params=sampled) for r in _requests("s", 512, 4)]
    se = _serve(plan)
    try:
        want = run_all(se, reqs)
    finally:
        se.close()

    class Failing(serving.Sampler):
        calls = 0

        def verify(self, rows, draft):
            self.calls += 1
            if self.params.seed == 666 and self.calls == 2:  # its second token
                raise FloatingPointError("probabilities are NaN")
            return super().verify(rows, draft)

    monkeypatch.setattr(serving, "Sampler", Failing)
    bad = replace(reqs[0], request_id="bad", params=SamplingParams(temperature=0.8, seed=666))
    se = _serve(plan)
    try:
        got = run_all(se, [*reqs[:3], bad])
        assert se.pool.num_used_blocks() == 0
    finally:
        se.close()
    assert got["bad"].finish_reason == "error" and len(got["bad"].token_ids) == 1
    assert "sampling failed: FloatingPointError: probabilities are NaN" in got["bad"].error
    for r in reqs[:3]:
        assert got[r.request_id].finish_reason == "length"
        assert got[r.request_id].token_ids == want[r.request_id].token_ids


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "gemma3", "mixtral"])
def test_pass_padding_and_whole_pass_attention_change_no_row(name, models, tmp_path, monkeypatch):
    """What CUDA does, forced here on the CPU, against the plain path, on a mixed pass (a chunk
    before the decodes in input order, cached tokens written by a first pass, a window of 8 on
    gemma3):

    - pass padding (``LlamaModel.pass_rows``): every block's product is one call of the
      bucket's rows (none of ``linear``'s own padding), a MoE model is not padded (its router
      would route the padding), and the logits and the whole KV pool are the unpadded pass's;
    - the whole-pass attention path (``attention.kernel_attention``; the kernel replaced by its
      definition in MLX operations, padding on): the same logits and KV pool."""
    import strata.executor.ops as ops
    from strata.executor import attention, cuda_attention
    from strata.executor.paged_kv import ForwardBatch, SeqInput

    plan = make_plan_file(str(models[name]), tmp_path / "p.yaml", context=CONTEXT, concurrency=4)
    loaded = load_plan(plan)
    # Products unpadded (CUDA pads them): only the pass is padded here, where it is asked.
    plain = RuntimeConfig.build(loaded.plan.runtime, pad_rows=False, pad_pass_rows=False)
    by_padding = {p: Engine(loaded, config=plain.replace(pad_pass_rows=p)).model for p in (0, 1)}
    vocab = by_padding[0].arch.vocab_size
    shapes = [(5, 20), (1, 9), (11, 0), (1, 33), (3, 40)]  # (tokens, start): 21 tokens, bucket 32

    def run(model) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
        kv = model.make_paged_cache(60, 4)
        seqs, used = [], 0
        for t, start in shapes:
            slots = np.arange(used + start + t - 1, used - 1, -1, dtype=np.int32)  # scattered
            ids = np.random.default_rng(start + 1).integers(0, vocab, t).tolist()
            seqs.append(SeqInput(ids, start, slots, "all"))
            used += start + t
        cached = [
            SeqInput(np.random.default_rng(s.start).integers(0, vocab, s.start).tolist(), 0,
                     s.slots[: s.start], "last")
            for s in seqs if s.start
        ]  # fmt: skip
        model.forward_batch(ForwardBatch.build(cached), kv)
        rows: list[int] = []
        real = ops._linear
        monkeypatch.setattr(
            ops, "_linear", lambda x, w, c: rows.append(x.size // x.shape[-1]) or real(x, w, c)
        )
        logits = model.forward_batch(ForwardBatch.build(seqs), kv)
        monkeypatch.setattr(ops, "_linear", real)
        return np.array(logits), [np.array(a) for a in kv.keys + kv.values], rows

    want, want_kv, plain_rows = run(by_padding[0])
    assert 21 in plain_rows and 32 not in plain_rows
    model = by_padding[1]
    got, got_kv, padded_rows = run(model)
    assert got.shape == want.shape == (21, vocab)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_kv, want_kv, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if name == "mixtral":
        assert model.pass_rows(21) == 21
    else:
        assert model.pass_rows(21) == 24
        # every block's products at the bucket's rows; the head at the 21 rows asked for
        assert set(padded_rows[:-1]) == {24} and padded_rows[-1] == 21

    taken = []
    decide = attention.kernel_attention
    monkeypatch.setattr(
        attention, "kernel_attention", lambda *a: taken.append(decide(*a)) or taken[-1]
    )
    monkeypatch.setattr(cuda_attention, "supported", lambda t, h, kvh, d, dt: h % kvh == 0)
    monkeypatch.setattr(cuda_attention, "attention", attention_by_definition)
    got, got_kv, _ = run(model)
    assert taken and all(taken)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_kv, want_kv, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
