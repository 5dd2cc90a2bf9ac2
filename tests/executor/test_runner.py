"""The model runner (``executor.runner``) on its own: scheduler steps turned into tokens on the
calling thread, with no serving engine, no engine thread and no events."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import make_plan_file
from gguf_factory import write_arch_model
from strata.executor.block_pool import BlockPool
from strata.executor.engine import Engine
from strata.executor.plan_loader import load_plan
from strata.executor.runner import ModelRunner
from strata.executor.sampling import Sampler, SamplingParams
from strata.executor.scheduler import Scheduler, SeqStatus, Sequence


@dataclass
class _Request:
    """What the runner reads of a live request (``runner.SampledRequest``)."""

    sampler: Sampler
    logprobs: int | None = None


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_gguf):
    folder = tmp_path_factory.mktemp("runner")
    gguf = write_arch_model(folder / "llama3.gguf", "llama3", smollm2_gguf)
    plan = make_plan_file(str(gguf), folder / "p.yaml", context=128, concurrency=4)
    eng = Engine(load_plan(plan))
    yield eng
    eng.close()


def test_scheduled_steps_give_the_greedy_tokens_of_teacher_forcing(engine):
    """Three requests of different lengths scheduled together (prefill chunks and decodes in
    shared steps): each one's tokens are the argmax of the teacher-forced logits of its prompt
    and the tokens before them, and a request that asked for log-probabilities gets one per
    token, its chosen token's among its alternatives."""
    b = engine.loaded.plan.batch
    runner = ModelRunner(engine.model, engine.config)
    runner.make_kv(b.kv_num_blocks, b.kv_block_size)
    pool = BlockPool(b.kv_num_blocks, b.kv_block_size)
    scheduler = Scheduler(pool, b.max_num_seqs, 16, 16, engine.context)
    vocab = engine.model.arch.vocab_size
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(0, vocab, n).tolist() for i, n in enumerate((5, 23, 40))}
    live = {rid: _Request(Sampler(SamplingParams()), 3 if rid == "r1" else None) for rid in prompts}
    seqs = {rid: Sequence(rid, ids, 4) for rid, ids in prompts.items()}
    for seq in seqs.values():
        scheduler.add(seq)
    logprobs: dict[str, list] = {rid: [] for rid in prompts}
    steps = 0
    while any(len(s.output_ids) < s.max_tokens for s in seqs.values()):
        step = scheduler.schedule()
        out = runner.execute(step, live)
        assert not out.failed and out.verifications == 0
        scheduler.update(step, out.sampled)
        for rid, lps in out.logprobs.items():
            logprobs[rid] += lps
        for seq in seqs.values():
            if seq.status is SeqStatus.RUNNING and len(seq.output_ids) >= seq.max_tokens:
                scheduler.finish(seq, "length")
        steps += 1
        assert steps < 50
    for rid, seq in seqs.items():
        want = engine.logits_for(seq.all_ids[:-1], first=len(seq.prompt_ids) - 1)
        assert seq.output_ids == np.argmax(want, axis=-1).tolist(), rid
    assert [len(v) for v in logprobs.values()] == [0, 4, 0]
    for tok, lp in zip(seqs["r1"].output_ids, logprobs["r1"], strict=True):
        assert lp.top[0][0] == tok and len(lp.top) == 3
