"""The continuous-batching scheduler on CPU with no model (vLLM's habit): a fake engine loop
samples a token that depends only on the request and the position, so every sequence's outputs
are known in advance whatever the batching, chunking and preemption did to it."""

from __future__ import annotations

import pytest
from strata.common.errors import StrataError
from strata.executor.block_pool import BlockPool
from strata.executor.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerStep,
    SeqStatus,
    Sequence,
)


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 100,
    chunk: int = 100,
    max_model_len: int = 128,
    caching: bool = True,
) -> Scheduler:
    return Scheduler(
        BlockPool(num_blocks, block_size, caching), max_num_seqs, budget, chunk, max_model_len
    )


def token(request_id: str, pos: int) -> int:
    """The fake model's token at position ``pos`` of a request (deterministic)."""
    return 1000 + 100 * pos + sum(map(ord, request_id)) % 100


def expected_outputs(seq: Sequence) -> list[int]:
    return [token(seq.request_id, len(seq.prompt_ids) + k) for k in range(seq.max_tokens)]


def chunks_of(step: SchedulerStep) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in step.chunks]


def check_step(sched: Scheduler, step: SchedulerStep) -> None:
    """Invariants of every step: limits, contiguous chunks, blocks, arrival order."""
    pool, bs = sched.pool, sched.pool.block_size
    assert step.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len({id(c.seq) for c in step.chunks}) == len(step.chunks)
    for c in step.chunks:
        assert c.seq.status is SeqStatus.RUNNING
        assert 1 <= c.num_tokens <= sched.prefill_chunk
        assert c.start == c.seq.num_computed_tokens
        assert c.start + c.num_tokens <= c.seq.num_tokens
        assert len(c.seq.block_ids) == -(-(c.start + c.num_tokens) // bs)
    running_arrivals = [s.arrival for s in sched.running]
    assert running_arrivals == sorted(running_arrivals)
    waiting_arrivals = [s.arrival for s in sched.waiting]
    assert waiting_arrivals == sorted(waiting_arrivals)
    for p in step.preempted:  # the latest-arrived of those that were running
        assert p.status is SeqStatus.WAITING and p.block_ids == [] and p.num_computed_tokens == 0
        assert all(s.arrival < p.arrival for s in sched.running)
    # No leak: the used blocks are exactly those held by running sequences (shared or not)
    # and, until the engine copies their slots, the blocks lent to this step's admissions.
    held = {b for s in sched.running for b in s.block_ids}
    held |= {c.lent.src for c in step.chunks if c.lent}
    assert pool.num_used_blocks() == len(held)
    assert all(not s.block_ids for s in sched.waiting)


def engine_step(sched: Scheduler) -> SchedulerStep:
    """One step of a fake engine: schedule, "run", sample, update, finish at max_tokens."""
    step = sched.schedule()
    check_step(sched, step)
    sampled = {
        c.seq.request_id: token(c.seq.request_id, c.seq.num_tokens) for c in step.chunks if c.sample
    }
    sched.update(step, sampled)
    for c in step.chunks:
        if c.sample and len(c.seq.output_ids) == c.seq.max_tokens:
            sched.finish(c.seq, "length")
    copies = sched.take_copies()  # the engine copies the lent slots, then releases them
    assert copies == [c.lent for c in step.chunks if c.lent]
    sched.release_copies(copies)
    return step


def run_all(sched: Scheduler, max_steps: int = 2000) -> list[SchedulerStep]:
    steps = []
    while sched.has_work():
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        steps.append(engine_step(sched))
    return steps


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    seq = Sequence(rid, prompt, max_tokens)
    sched.add(seq)
    return seq


def test_chunked_prefill_then_decodes():
    sched = make(chunk=8, caching=False)
    a = add(sched, "a", list(range(20)), max_tokens=3)
    steps = run_all(sched)
    assert [chunks_of(s) for s in steps] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
        [("a", 20, 1, True)],
        [("a", 21, 1, True)],
    ]
    assert a.output_ids == expected_outputs(a)
    assert (a.status, a.finish_reason, a.block_ids) == (SeqStatus.FINISHED, "length", [])
    assert sched.pool.num_used_blocks() == 0


def test_decodes_and_a_prefill_chunk_share_one_budget():
    sched = make(budget=10, chunk=16)
    add(sched, "a", [1, 2, 3, 4], max_tokens=5)
    assert chunks_of(engine_step(sched)) == [("a", 0, 4, True)]
    add(sched, "b", list(range(20, 40)), max_tokens=2)
    steps = [engine_step(sched) for _ in range(3)]
    assert [chunks_of(s) for s in steps] == [
        [("a", 4, 1, True), ("b", 0, 9, False)],
        [("a", 5, 1, True), ("b", 9, 9, False)],
        [("a", 6, 1, True), ("b", 18, 2, True)],
    ]
    assert [s.num_tokens for s in steps] == [10, 10, 3]


def test_budget_left_over_admits_a_partial_prefill():
    sched = make(budget=10, chunk=16)
    for rid in "abc":
        add(sched, rid, [ord(rid)] * 6, max_tokens=3)
    step1, step2 = engine_step(sched), engine_step(sched)
    assert chunks_of(step1) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert [s.request_id for s in sched.waiting] == []  # c was admitted in step 2
    assert chunks_of(step2) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 6, True)]


def test_max_num_seqs_holds_back_admission():
    sched = make(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, [ord(rid)] * 4, max_tokens=2)
    steps = run_all(sched)
    assert [[c.seq.request_id for c in s.chunks] for s in steps] == [
        ["a", "b"],
        ["a", "b"],
        ["c"],
        ["c"],
    ]


def test_fcfs_a_blocked_head_is_not_skipped():
    sched = make(num_blocks=6, block_size=4, caching=False)
    add(sched, "a", list(range(16)), max_tokens=4)  # takes 4 of the 6 blocks
    add(sched, "b", list(range(12)), max_tokens=1)  # needs 3: must wait
    add(sched, "c", [1, 2], max_tokens=1)  # would fit in 1, but arrived after b
    assert chunks_of(engine_step(sched)) == [("a", 0, 16, True)]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert sched.pool.num_used_blocks() == 4
    steps = run_all(sched)
    order = [c.seq.request_id for s in steps for c in s.chunks if c.start == 0]
    assert order == ["b", "c"]


def test_preemption_by_recompute_step_by_step():
    # 4 blocks of 2 tokens; two sequences of 3 + 4 tokens each need 4 blocks at their peak.
    sched = make(num_blocks=4, block_size=2)
    pool = sched.pool
    a = add(sched, "a", [1, 2, 3], max_tokens=4)
    b = add(sched, "b", [4, 5, 6], max_tokens=4)
    s1, s2, s3 = engine_step(sched), engine_step(sched), engine_step(sched)
    assert chunks_of(s1) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert chunks_of(s2) == [("a", 3, 1, True), ("b", 3, 1, True)]
    # a's fifth token needs a third block: b, the latest arrival, is preempted.
    assert chunks_of(s3) == [("a", 4, 1, True)]
    assert s3.preempted == [b] and sched.num_preemptions == 1
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (
        SeqStatus.WAITING,
        [],
        0,
        1,
    )
    assert b.output_ids == expected_outputs(b)[:2]  # kept for the recompute
    assert list(sched.waiting) == [b]
    # b's freed tail block went to a (an eviction); its first block stays cached. b cannot be
    # admitted while a holds 3 of the 4 blocks: the failed try is not counted as a lookup.
    assert chunks_of(engine_step(sched)) == [("a", 5, 1, True)]
    assert a.status is SeqStatus.FINISHED and a.output_ids == expected_outputs(a)
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens) == (6, 0)
    # Re-admitted with all 5 tokens; the prefix cache serves its first block.
    s5 = engine_step(sched)
    assert chunks_of(s5) == [("b", 2, 3, True)]
    assert b.num_cached_tokens == 2
    assert chunks_of(engine_step(sched)) == [("b", 5, 1, True)]
    assert b.output_ids == expected_outputs(b) and b.finish_reason == "length"
    assert not sched.has_work()
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens, pool.evictions) == (11, 2, 3)
    assert pool.num_used_blocks() == 0


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_pool_preempts_and_every_sequence_completes(caching):
    sched = make(num_blocks=12, block_size=4, max_num_seqs=4, budget=16, chunk=8, caching=caching)
    shared = [7] * 8
    seqs = [
        add(
            sched,
            f"s{i}",
            (shared if i % 2 else []) + [10 * i + k for k in range(3 + 2 * i)],
            max_tokens=4 + i,
        )
        for i in range(8)
    ]
    steps = run_all(sched)
    assert sched.num_preemptions >= 1
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    assert sum(len(s.preempted) for s in steps) == sched.num_preemptions
    for s in seqs:
        assert s.output_ids == expected_outputs(s), s.request_id
        assert (s.status, s.finish_reason, s.block_ids) == (SeqStatus.FINISHED, "length", [])
    assert sched.pool.num_used_blocks() == 0
    assert sched.pool.num_free_blocks() == 12
    assert not sched.running and not sched.waiting
    if not caching:
        assert sched.pool.prefix_query_tokens == sched.pool.prefix_hit_tokens == 0


def test_prefix_hit_on_a_shared_prompt():
    sched = make(block_size=4)
    pool = sched.pool
    shared = list(range(100, 112))  # 3 full blocks
    a = add(sched, "a", shared + [1, 2], max_tokens=2)
    run_all(sched)
    b = add(sched, "b", shared + [3, 4], max_tokens=2)
    assert chunks_of(engine_step(sched)) == [("b", 12, 2, True)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens) == (14 + 14, 12)
    run_all(sched)
    assert b.output_ids == expected_outputs(b)
    assert pool.num_used_blocks() == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make(block_size=4)
    prompt = list(range(50, 58))  # exactly 2 full blocks
    add(sched, "a", prompt, max_tokens=1)
    run_all(sched)
    b = add(sched, "b", prompt, max_tokens=1)
    # Both blocks are cached, but the last token's logits are needed: the first block is hit,
    # three slots of the second are lent, and the last token is computed.
    step = engine_step(sched)
    assert chunks_of(step) == [("b", 7, 1, True)]
    lent = step.chunks[0].lent
    assert lent is not None and (lent.position, lent.tokens) == (4, 3)
    assert lent.dst != lent.src  # b's own second block (b has finished: its table is empty)
    assert b.num_cached_tokens == 7 and b.output_ids == expected_outputs(b)
    c = add(sched, "c", prompt + [9], max_tokens=1)
    assert chunks_of(engine_step(sched)) == [("c", 8, 1, True)]
    assert c.num_cached_tokens == 8
    assert sched.pool.num_used_blocks() == 0


def test_abort_waiting_running_and_unknown():
    sched = make()
    a = add(sched, "a", [1, 2, 3], max_tokens=5)
    b = add(sched, "b", [4, 5, 6], max_tokens=5)
    assert sched.abort("b") is b
    assert (b.status, b.finish_reason) == (SeqStatus.FINISHED, "abort")
    assert list(sched.waiting) == [a]
    engine_step(sched)
    assert sched.running == [a] and sched.pool.num_used_blocks() == 1
    assert sched.abort("a") is a
    assert (a.status, a.finish_reason, a.block_ids) == (SeqStatus.FINISHED, "abort", [])
    assert sched.running == [] and sched.pool.num_used_blocks() == 0
    assert sched.abort("a") is None  # already finished
    assert sched.abort("nope") is None
    assert not sched.has_work()
    # Aborted between schedule() and update(): its chunk is skipped.
    c = add(sched, "c", [7, 8], max_tokens=2)
    step = sched.schedule()
    sched.abort("c")
    sched.update(step, {"c": 42})
    assert (c.output_ids, c.num_computed_tokens) == ([], 0)
    # The id is free again once finished.
    add(sched, "a", [1], max_tokens=1)


def test_add_errors_name_the_fix():
    sched = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(StrataError, match="empty prompt; send at least one token"):
        sched.add(Sequence("e", [], 4))
    with pytest.raises(StrataError, match="64-token context; shorten it to at most 63 tokens"):
        sched.add(Sequence("long", list(range(64)), 1))
    # 16 tokens + 1 to generate need 5 blocks of 4; the pool has 4 in all.
    with pytest.raises(StrataError, match="needs up to 5 KV blocks .* plan more KV blocks"):
        sched.add(Sequence("big", list(range(16)), 1))
    with pytest.raises(StrataError, match="needs up to 8 KV blocks .*lower max_tokens"):
        sched.add(Sequence("gen", list(range(10)), 20))
    with pytest.raises(StrataError, match="max_tokens 0; ask for at least 1"):
        sched.add(Sequence("zero", [1], 0))
    assert not sched.has_work()
    add(sched, "fits", list(range(15)), max_tokens=1)  # 16 tokens: exactly the pool
    with pytest.raises(StrataError, match="already waiting or running; give each request its own"):
        sched.add(Sequence("fits", [1], 1))
    assert [s.request_id for s in sched.waiting] == ["fits"]


def test_scheduler_limits_must_be_positive():
    with pytest.raises(StrataError, match="max_num_seqs is 0"):
        Scheduler(BlockPool(4, 4), 0, 16, 16, 64)
    with pytest.raises(StrataError, match="prefill_chunk is 0"):
        Scheduler(BlockPool(4, 4), 1, 16, 0, 64)


def test_chunk_ids_and_sample_across_prompt_and_outputs():
    seq = Sequence("x", [1, 2, 3], 5, output_ids=[4, 5])
    assert (seq.all_ids, seq.num_tokens) == ([1, 2, 3, 4, 5], 5)
    assert ScheduledChunk(seq, 0, 2).ids == [1, 2]
    assert ScheduledChunk(seq, 2, 3).ids == [3, 4, 5]
    assert ScheduledChunk(seq, 4, 1).ids == [5]
    done, partial = ScheduledChunk(seq, 4, 1), ScheduledChunk(seq, 0, 2)
    assert (done.sample, partial.sample) == (True, False)
    seq.output_ids.append(6)  # what update() does: the chunk still says it sampled
    assert done.sample is True
    assert SchedulerStep([done, partial]).num_tokens == 3


def test_chunk_align_ends_chunks_on_multiples():
    """Blocks of 4, chunks aligned to 4, a budget of 10: prompts are cut at multiples of 4; the
    last chunk of a prompt is not rounded; an admission rounded to nothing stops admitting."""
    sched = Scheduler(BlockPool(64, 4), 8, 10, 100, 128, chunk_align=4)
    add(sched, "a", [1, 2, 3], max_tokens=5)
    assert chunks_of(engine_step(sched)) == [("a", 0, 3, True)]  # final chunk: 3, not rounded
    add(sched, "b", list(range(20, 41)), max_tokens=2)  # 21 tokens
    add(sched, "c", list(range(50, 60)), max_tokens=2)
    # 9 left after a's decode: b's 9 round down to 8; the 1 left would give c nothing.
    assert chunks_of(engine_step(sched)) == [("a", 3, 1, True), ("b", 0, 8, False)]
    assert [s.request_id for s in sched.waiting] == ["c"]
    assert chunks_of(engine_step(sched)) == [("a", 4, 1, True), ("b", 8, 8, False)]
    # b's last 5 tokens are its final chunk; c gets the 4 left, a multiple.
    assert chunks_of(engine_step(sched)) == [
        ("a", 5, 1, True),
        ("b", 16, 5, True),
        ("c", 0, 4, False),
    ]
    steps = run_all(sched)
    assert all(done or (start + n) % 4 == 0 for s in steps for _, start, n, done in chunks_of(s))
    assert not sched.has_work() and sched.pool.num_used_blocks() == 0


def test_chunk_align_skips_a_running_sequence_and_serves_the_next():
    """a's final chunk (7 tokens) leaves 3 of the budget: b's aligned end does not fit, so b is
    skipped this step and c, after it, still decodes."""
    sched = Scheduler(BlockPool(64, 4), 8, 10, 7, 128, chunk_align=4)
    a = add(sched, "a", list(range(11)), max_tokens=3)
    b = add(sched, "b", list(range(20, 40)), max_tokens=2)
    c = add(sched, "c", [5], max_tokens=3)
    assert chunks_of(engine_step(sched)) == [
        ("a", 0, 4, False),  # prefill_chunk 7 -> 4
        ("b", 0, 4, False),  # 6 left -> 4
        ("c", 0, 1, True),  # a whole 1-token prompt: not rounded
    ]
    assert chunks_of(engine_step(sched)) == [("a", 4, 7, True), ("c", 1, 1, True)]
    assert chunks_of(engine_step(sched)) == [
        ("a", 11, 1, True),
        ("b", 4, 4, False),
        ("c", 2, 1, True),
    ]
    run_all(sched)
    for seq in (a, b, c):
        assert seq.output_ids == expected_outputs(seq)


def test_chunk_align_prefix_hit_starts_on_a_multiple():
    sched = Scheduler(BlockPool(64, 4), 8, 100, 6, 128, chunk_align=4)
    shared = list(range(100, 112))  # 3 full blocks
    add(sched, "a", shared + [1, 2, 3], max_tokens=1)
    steps = run_all(sched)
    assert [chunks_of(s) for s in steps] == [
        [("a", 0, 4, False)],  # prefill_chunk 6 -> 4
        [("a", 4, 4, False)],
        [("a", 8, 4, False)],
        [("a", 12, 3, True)],
    ]
    add(sched, "b", shared + [7, 8, 9, 10, 11, 12, 13], max_tokens=1)
    assert chunks_of(engine_step(sched)) == [("b", 12, 4, False)]  # from the hit, to 16


def test_chunk_align_larger_than_a_limit_names_the_fix():
    with pytest.raises(StrataError, match="need prefill_chunk >= 16, but the plan has 8; set"):
        Scheduler(BlockPool(4, 16), 1, 64, 8, 64, chunk_align=16)
    with pytest.raises(StrataError, match="need max_num_batched_tokens >= 16, but the plan has 12"):
        Scheduler(BlockPool(4, 16), 1, 12, 16, 64, chunk_align=16)
    with pytest.raises(StrataError, match="chunk_align is -1"):
        Scheduler(BlockPool(4, 16), 1, 16, 16, 64, chunk_align=-1)


def test_partial_block_hit_lends_the_longest_agreeing_block():
    """After the whole-block hits, the cached block that begins with the most of the prompt's
    next tokens is lent (prefill starts at the first token that differs); its reference is held
    until the engine takes the copy and released then; no whole block, or no agreeing first
    token, lends nothing."""
    sched = make(block_size=4)
    pool = sched.pool
    shared = list(range(100, 106))  # one full block, then 2 tokens into the next
    add(sched, "a", shared + [1, 2, 3, 4], max_tokens=1)  # blocks [100..103] [104 105 1 2]
    add(sched, "x", shared + [7, 7, 7, 7], max_tokens=1)  # [104 105 7 7] also cached
    run_all(sched)
    hits0 = pool.prefix_hit_tokens
    b = add(sched, "b", shared + [1, 9, 9], max_tokens=2)
    step = sched.schedule()
    (chunk,) = step.chunks
    assert (chunk.start, chunk.num_tokens) == (7, 2)  # 4 whole + 3 lent ([104 105 1])
    assert chunk.lent is not None and (chunk.lent.position, chunk.lent.tokens) == (4, 3)
    assert chunk.lent.dst == b.block_ids[1] and chunk.lent.src not in b.block_ids
    assert b.num_cached_tokens == 7 and pool.prefix_hit_tokens - hits0 == 7
    used = pool.num_used_blocks()
    sched.update(step, {"b": token("b", b.num_tokens)})
    copies = sched.take_copies()
    assert copies == [chunk.lent] and sched.take_copies() == []
    sched.release_copies(copies)
    assert pool.num_used_blocks() == used - 1  # the lent block went back (it stays cached)
    run_all(sched)
    assert b.output_ids == expected_outputs(b)
    c = add(sched, "c", [100, 101, 102, 103, 55, 56], max_tokens=1)
    assert chunks_of(engine_step(sched)) == [("c", 4, 2, True)]  # no child begins with 55
    assert c.num_cached_tokens == 4 and pool.num_used_blocks() == 0


def test_partial_block_hit_is_undone_when_admission_waits():
    """An admission that cannot get its blocks gives the lent block back with the whole
    blocks, and counts no hit (the lookup is repeated)."""
    sched = make(num_blocks=4, block_size=4)
    pool = sched.pool
    add(sched, "a", list(range(20, 26)), max_tokens=1)
    run_all(sched)  # [20..23] registered, [24 25 ...] not full: lends nothing
    add(sched, "a2", list(range(20, 28)), max_tokens=1)
    run_all(sched)  # [24..27] registered under [20..23]
    hold = add(sched, "hold", [1, 2, 3, 4, 5], max_tokens=4)  # takes 2 of the 4 blocks
    engine_step(sched)
    counters = pool.prefix_query_tokens, pool.prefix_hit_tokens
    late = add(sched, "late", list(range(20, 26)) + [9, 9, 9, 9, 9, 9], max_tokens=1)
    step = sched.schedule()
    assert [c.seq for c in step.chunks] == [hold]  # late waits: too few free blocks
    assert (pool.prefix_query_tokens, pool.prefix_hit_tokens) == counters
    assert pool.num_used_blocks() == len(set(hold.block_ids)) and sched.take_copies() == []
    assert late.status is SeqStatus.WAITING


def test_chunk_align_lends_no_partial_block():
    """Batch-invariant scheduling (aligned chunks) keeps whole-block hits only."""
    sched = Scheduler(BlockPool(64, 4), 8, 100, 100, 128, chunk_align=4)
    add(sched, "a", list(range(100, 110)), max_tokens=1)
    run_all(sched)
    add(sched, "b", list(range(100, 107)) + [1, 2], max_tokens=1)
    step = sched.schedule()
    assert chunks_of(step) == [("b", 4, 5, True)] and step.chunks[0].lent is None


def test_lending_off_keeps_whole_block_hits():
    """``lend_partial_blocks=False`` (the runtime config's setting) keeps whole-block hits only,
    where the same prompts with lending on borrow the next block's agreeing slots."""
    for lend, want in ((True, ("b", 7, 2, True)), (False, ("b", 4, 5, True))):
        sched = Scheduler(BlockPool(64, 4), 8, 100, 100, 128, lend_partial_blocks=lend)
        add(sched, "a", list(range(100, 110)), max_tokens=1)
        run_all(sched)
        add(sched, "b", list(range(100, 107)) + [1, 2], max_tokens=1)
        step = sched.schedule()
        assert chunks_of(step) == [want] and (step.chunks[0].lent is not None) == lend


def test_an_admission_that_needs_the_lendable_block_takes_it_instead():
    """The block a partial hit would lend can be the free block an admission needs (a cached
    free block is also what allocate hands out): the sequence is then admitted without lending,
    not left waiting for a block that only it holds."""
    sched = make(num_blocks=4, block_size=4, budget=64, chunk=64, max_model_len=64)
    a = add(sched, "a", list(range(100, 108)), max_tokens=1)  # registers two blocks
    run_all(sched)
    b = add(sched, "b", list(range(100, 106)) + list(range(1, 10)), max_tokens=1)  # 15 tokens
    step = engine_step(sched)
    assert chunks_of(step) == [("b", 4, 11, True)] and step.chunks[0].lent is None
    assert b.num_cached_tokens == 4 and b.output_ids == expected_outputs(b)
    assert a.output_ids == expected_outputs(a) and sched.pool.num_used_blocks() == 0
