"""Prefill in the cost model and the ILP: chunk times by hand, TTFT, the per-request objective,
agreement with exhaustive scoring, and plans for long prompts that differ from plans for chat."""

from __future__ import annotations

import itertools
import random

import pytest
from strata.common.schemas import TIERS, ExpertCache, Request
from strata.planner.costmodel import (
    PinnedPlacement,
    activation_bytes,
    batch_limits,
    capacity_use,
    expert_cache_for,
    kv_cache_bytes,
    objective,
    prefill_chunk,
    prefill_chunks,
    score,
    ttft,
    working_slots,
)
from strata.planner.ilp import ACCEPT_GAP, solve
from synthetic_desc import GIB, MIB, U, make_desc, make_profile


def _fixed(desc, request) -> int:
    """KV cache + activations of the request (bytes), for capacities that leave room for them."""
    p0 = make_profile(gpu_bytes=0, ram_bytes=0)
    batch = batch_limits(request)
    return kv_cache_bytes(desc, p0, batch) + activation_bytes(desc, p0, batch)


@pytest.mark.parametrize(
    ("prompt", "chunk", "want"),
    [(1, 512, (0, 1)), (512, 512, (0, 512)), (513, 512, (1, 1)), (1100, 512, (2, 76))],
)
def test_prompts_split_into_full_chunks_and_a_last_one(prompt, chunk, want) -> None:
    assert prefill_chunks(prompt, chunk) == want


def test_ttft_by_hand() -> None:
    """Three units on gpu / ram / nvme, unified memory, depth 1; a 1100-token prompt in chunks
    of 512: two full chunks and one of 76 rows, each reading the streamed unit whole."""
    units = [
        U("blk.0.attn", "attention", 0, 16 * MIB, flops=10**8),
        U("blk.0.ffn", "ffn", 0, 32 * MIB, flops=3 * 10**8),
        U("blk.1.ffn", "ffn", 1, 64 * MIB, flops=2 * 10**8),
    ]
    desc = make_desc(units)
    profile = make_profile(
        gpu_bytes=GIB, ram_bytes=2 * GIB, gpu_bw=400e9, flops=1e12, h2d_bw=50e9, nvme_bw=2e9
    )
    tiers = {"blk.0.attn": "gpu", "blk.0.ffn": "ram", "blk.1.ffn": "nvme"}
    request = Request(context=2048, prompt_tokens=[100, 1100], output_tokens=8)
    assert batch_limits(request).prefill_chunk == 512

    def by_hand(rows: int, depth: int) -> float:
        compute = sum(max(u.bytes / 400e9, rows * u.flops / 1e12) for u in units)
        copy = 32 * MIB / 50e9  # the ram unit, again every chunk
        disk = 64 * MIB / 2e9  # the streamed unit, whole, every chunk
        return max(compute + copy, disk) if depth >= 1 else compute + copy + disk

    for depth in (0, 1):
        got = prefill_chunk(desc, profile, tiers, depth, ExpertCache(), 512)
        assert got.chunk_s == pytest.approx(by_hand(512, depth), rel=1e-12)
        want = [by_hand(100, depth), 2 * by_hand(512, depth) + by_hand(76, depth)]
        pred = score(desc, profile, request, PinnedPlacement(tiers, depth))
        assert pred.prefill_chunk_s == pytest.approx(by_hand(512, depth), rel=1e-12)
        assert pred.ttft_s == pytest.approx(want, rel=1e-12)
        assert ttft(desc, profile, tiers, depth, ExpertCache(), 1100, 512) == pytest.approx(want[1])
        # The objective: one request of 8 output tokens, the first from prefill.
        mean = (want[0] + want[1]) / 2
        assert objective(pred, request) == pytest.approx((mean + 7 * pred.step_s) / 8)
    # At depth 1 the 34 ms read hides behind a full chunk's compute, not behind a short one's.
    assert by_hand(512, 1) < by_hand(512, 0)
    assert by_hand(8, 1) == pytest.approx(64 * MIB / 2e9)


def test_throughput_objective_prefills_each_sequence() -> None:
    desc = make_desc([U("blk.0.ffn", "ffn", 0, 64 * MIB, flops=10**9)])
    profile = make_profile(gpu_bytes=GIB, ram_bytes=2 * GIB)
    request = Request(context=4096, concurrency=4, objective="throughput", prompt_tokens=[64, 2048])
    pred = score(desc, profile, request, PinnedPlacement({"blk.0.ffn": "gpu"}, 0))
    mean, n = sum(pred.ttft_s) / 2, request.output_tokens
    assert objective(pred, request) == pytest.approx((4 * mean + (n - 1) * pred.step_s) / (4 * n))


def _long_vs_chat(prompt_tokens: list[int], output_tokens: int):
    """Four compute-heavy FFNs of 64 MiB, room for three on the gpu tier, plenty of ram, an NVMe
    that reads at 20 GB/s against 50 GB/s host copies."""
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, 64 * MIB, flops=2 * 10**8) for i in range(4)])
    request = Request(context=16384, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    fixed = _fixed(desc, request)
    profile = make_profile(
        gpu_bytes=fixed + 3 * 64 * MIB,
        ram_bytes=fixed + 8 * GIB,
        matvec_flops=1e11,
        h2d_bw=50e9,
        nvme_bw=20e9,
        flops=1e12,
    )
    return desc, profile, request


def test_long_prompts_stream_where_chat_copies_from_ram() -> None:
    """Chat (short prompts, 256 tokens out): decode dominates, and a ram unit's 1.3 ms copy beats
    streaming (three NVMe reads of 3.4 ms each bind the step). Long prompts with short answers
    (4000-8000 tokens in, 16 out): every chunk copies a ram unit again on the compute thread,
    while at depth 1 the reads of streamed units hide behind the chunk's 0.4 s of compute, so the
    plan streams instead."""
    chat = solve(*_long_vs_chat([16, 64], 256))
    long = solve(*_long_vs_chat([4000, 8000], 16))
    tiers = {s: sorted(p.tier for p in sol.placement) for s, sol in (("c", chat), ("l", long))}
    assert tiers["c"] == ["gpu", "gpu", "gpu", "ram"] and chat.prefetch.depth == 0
    assert tiers["l"] == ["gpu", "nvme", "nvme", "nvme"] and long.prefetch.depth >= 1

    # Each plan is the better one for its own request, by the cost model.
    def obj(sol, args) -> float:
        desc, profile, request = _long_vs_chat(*args)
        pinned = PinnedPlacement({p.unit: p.tier for p in sol.placement}, sol.prefetch.depth)
        return objective(score(desc, profile, request, pinned), request)

    chat_req, long_req = ([16, 64], 256), ([4000, 8000], 16)
    assert obj(chat, chat_req) < obj(long, chat_req)
    assert obj(long, long_req) < obj(chat, long_req)
    # The long plan pays for it in decode and wins it back in prefill.
    assert long.prediction.step_s > chat.prediction.step_s
    assert long.prediction.prefill_chunk_s < chat.prediction.prefill_chunk_s


def _brute_force(desc, profile, request):
    """Best objective over every tier assignment and depth 0..2 (deeper only adds pool slots)."""
    best = None
    names = [u.name for u in desc.units]
    for assign in itertools.product(TIERS, repeat=len(names)):
        tiers = dict(zip(names, assign, strict=True))
        for depth in range(3):
            pinned = PinnedPlacement(tiers, depth)
            if any(
                used > row.capacity for row, used in capacity_use(desc, profile, request, pinned)
            ):
                continue
            obj = objective(score(desc, profile, request, pinned), request)
            best = obj if best is None else min(best, obj)
    return best


def _instance(seed: int):
    """4-6 dense units of random bytes and FLOPs, a random prompt range (one chunk to many) and
    few or many output tokens, capacities that force spilling."""
    rng = random.Random(seed)
    units = [
        U(
            f"blk.{i}.{rng.choice(['attn', 'ffn'])}",
            rng.choice(["attention", "ffn"]),
            i,
            rng.randint(4, 64) * MIB + rng.randint(0, 4095),
            flops=rng.choice([0, 10**8, 10**9]),
        )
        for i in range(rng.randint(4, 6))
    ]
    desc = make_desc(units)
    shortest = rng.choice([8, 200, 1500])
    request = Request(
        context=8192,
        concurrency=rng.randint(1, 3),
        objective="throughput" if seed % 3 == 0 else "latency",
        prompt_tokens=[shortest, shortest + rng.choice([0, 700, 5000])],
        output_tokens=rng.choice([1, 8, 256]),
    )
    total = sum(u.bytes for u in units)
    unified = seed % 2 == 0
    gpu = _fixed(desc, request) + int(total * rng.uniform(0.3, 0.9))
    profile = make_profile(
        gpu_bytes=gpu,
        ram_bytes=(gpu if unified else 0) + int(total * rng.uniform(0.1, 0.6)),
        unified=unified,
        h2d_bw=rng.choice([10e9, 50e9]),
        nvme_bw=rng.choice([2e9, 20e9]),
        flops=rng.choice([1e12, 10e12]),
        matvec_flops=rng.choice([1e11, 1e15]),
    )
    return desc, profile, request


SEEDS = [0, 2, 3, 5, 6, 7, 9, 10, 11, 12, 14, 15]
"""Instances where some placement fits (both objectives, unified or not, one chunk or many)."""


@pytest.mark.parametrize("seed", SEEDS)
def test_ilp_equals_brute_force_with_prefill(seed: int) -> None:
    desc, profile, request = _instance(seed)
    best = _brute_force(desc, profile, request)
    assert best is not None
    sol = solve(desc, profile, request)
    got = objective(sol.prediction, request)
    assert got == pytest.approx(best, rel=1e-9, abs=0)
    assert sol.solver.objective == pytest.approx(got, rel=1e-12)
    assert len(sol.prediction.ttft_s) == 2 and sol.prediction.prefill_chunk_s is not None


def _moe_desc(sizes_mib: list[int], access: list[float], attn_mib: int, flops: list[int]):
    """One MoE block of ``len(sizes_mib)`` experts, top-1: attention and router units plus one unit
    per expert (``expert`` set) of the given MiB, access per token and FLOPs per token."""
    units = [
        U("blk.0.attn", "attention", 0, attn_mib * MIB, flops=10**8),
        U("blk.0.ffn", "router", 0, MIB // 4, flops=10**6),
    ]
    for e, (size, a, f) in enumerate(zip(sizes_mib, access, flops, strict=True)):
        units.append(U(f"blk.0.expert.{e}", "expert", 0, size * MIB, a, f))
    desc = make_desc(units, blocks=1)
    arch = desc.architecture.model_copy(
        update={"expert_count": len(sizes_mib), "expert_used_count": 1}
    )
    infos = [
        u.model_copy(update={"expert": int(u.name.rsplit(".", 1)[1])}) if u.role == "expert" else u
        for u in desc.units
    ]
    return desc.model_copy(update={"architecture": arch, "units": infos})


def _moe_brute_force(desc, profile, request):
    """Best objective over every tier assignment, depth 0..2, prefetch {0, k} and every cache
    size from the working slots to the working slots plus every streamed expert (the cost model
    holds the hottest streamed experts, ``hottest_streamed``); None when nothing fits."""
    names = [u.name for u in desc.units]
    k = desc.architecture.expert_used_count
    best = None
    for assign in itertools.product(TIERS, repeat=len(names)):
        tiers = dict(zip(names, assign, strict=True))
        streamed = sum(1 for u in desc.units if u.expert is not None and tiers[u.name] == "nvme")
        for depth, m in itertools.product(range(3), (0, k)):
            work = working_slots(desc, m)
            for slots in range(work, streamed + work + 1) if streamed else [0]:
                cache = expert_cache_for(desc, tiers, slots, m) if streamed else ExpertCache()
                pinned = PinnedPlacement(tiers, depth, experts=cache)
                use = capacity_use(desc, profile, request, pinned)
                if any(used > row.capacity for row, used in use):
                    continue
                obj = objective(score(desc, profile, request, pinned), request)
                best = obj if best is None else min(best, obj)
    return best


def _moe_instance(seed: int):
    """Four experts of 2-8 MiB with random access (summing to top-1), a gpu tier that holds the
    dense units and one expert slot plus part of the rest, prompts of 200-2000 tokens (one to four
    chunks) and 1-64 output tokens; memory unified for two seeds in three."""
    rng = random.Random(seed)
    sizes = [rng.choice([2, 4, 8]) for _ in range(4)]
    weights = [rng.uniform(0.05, 1.0) for _ in range(4)]
    access = [round(w / sum(weights), 3) for w in weights]
    attn = rng.choice([2, 6])
    desc = _moe_desc(sizes, access, attn, [rng.choice([10**7, 10**8]) for _ in range(4)])
    lo = rng.randint(200, 2000)
    request = Request(
        context=4096,
        prompt_tokens=[lo, rng.randint(lo, 2000)],
        output_tokens=rng.choice([1, 2, 4, 16, 64]),
    )
    experts = sum(s * MIB for s in sizes)
    dense = (attn + 0.25) * MIB
    unified = seed % 3 != 0
    gpu = _fixed(desc, request) + int(dense + max(sizes) * MIB)
    gpu += int((experts - max(sizes) * MIB) * rng.uniform(0.2, 0.8))
    profile = make_profile(
        gpu_bytes=gpu,
        ram_bytes=(gpu if unified else int(dense)) + int(experts * rng.uniform(0.0, 0.5)),
        unified=unified,
        nvme_bw=rng.choice([1e9, 5e9]),
        matvec_flops=rng.choice([1e11, 1e13]),
        flops=rng.choice([1e12, 1e13]),
        op_s=rng.choice([0.0, 5e-6]),
    )
    return desc, profile, request


def _check_moe_against_brute_force(desc, profile, request) -> None:
    best = _moe_brute_force(desc, profile, request)
    assert best is not None
    sol = solve(desc, profile, request)
    got = objective(sol.prediction, request)
    # The ILP's plan is one of the placements enumerated, so never better than the best; it is
    # accepted within the gap it proves (0 on these small models), at most ACCEPT_GAP.
    assert got >= best * (1 - 1e-12)
    assert got <= best * (1 + max(sol.solver.gap, 1e-9)) and sol.solver.gap <= ACCEPT_GAP
    # The plan's own placement, scored again, gives the solver's reported objective.
    tiers = {p.unit: p.tier for p in sol.placement}
    pinned = PinnedPlacement(tiers, sol.prefetch.depth, experts=sol.expert_cache)
    again = objective(score(desc, profile, request, pinned), request)
    assert again == pytest.approx(sol.solver.objective, rel=1e-12)
    assert len(sol.prediction.ttft_s) == 2 and sol.prediction.prefill_chunk_s is not None


MOE_SEEDS = [1, 2, 11, 12, 20, 25]
"""Instances that fit and stream experts (11, 20, 25 also hold some in the cache beyond its
working slots; 12 is not unified)."""


@pytest.mark.parametrize("seed", MOE_SEEDS)
def test_moe_prefill_matches_brute_force(seed: int) -> None:
    """With prefill priced (every chunk reads each streamed expert the cache does not hold,
    ``costmodel.prefill_chunk``) the ILP's expert rows (``_prefill_rows`` on the held counts
    ``h_c``) reach the cost model's best placement."""
    _check_moe_against_brute_force(*_moe_instance(seed))


def _held_expert_instance(seed: int):
    """One 8 MiB expert read rarely (access 0.04-0.1) beside three of 3 MiB sharing the rest:
    per decode token the small ones are read more (access x bytes), per prefill chunk (every
    expert, whole) the large one is. The gpu tier holds the dense units and two 8 MiB slots;
    prompts of 1000-2000 tokens, 1-4 output tokens, so prefill dominates."""
    rng = random.Random(seed)
    big = round(rng.uniform(0.04, 0.1), 3)
    small = round((1 - big) / 3, 3)
    desc = _moe_desc([8, 3, 3, 3], [big, small, small, small], 2, [10**7] * 4)
    lo = rng.randint(1000, 2000)
    request = Request(
        context=4096,
        prompt_tokens=[lo, rng.randint(lo, 2000)],
        output_tokens=rng.choice([1, 2, 4]),
    )
    gpu = _fixed(desc, request) + int(2.25 * MIB) + 16 * MIB + 1000
    return desc, make_profile(gpu_bytes=gpu, ram_bytes=gpu, nvme_bw=1e9), request


@pytest.mark.xfail(
    strict=True,
    reason="the ILP's held counts h_c may cache the largest streamed expert (its prefill rows "
    "save a whole expert per chunk), while costmodel.expert_cache_for/prefill_chunk hold the "
    "hottest by access x bytes (hottest_streamed), so the plan scores worse than pinning it",
)
@pytest.mark.parametrize("seed", range(4))
def test_moe_prefill_held_expert_matches_brute_force(seed: int) -> None:
    _check_moe_against_brute_force(*_held_expert_instance(seed))


def test_explain_and_diff_show_prefill() -> None:
    from strata.planner.diff import diff
    from strata.planner.explain import explain

    plans = []
    for args in (([16, 64], 256), ([4000, 8000], 16)):
        desc, profile, request = _long_vs_chat(*args)
        plans.append(solve(desc, profile, request).to_plan(desc, profile, request))
    chat, long = plans
    text = explain(long)
    p = long.prediction
    assert p is not None and p.prefill_chunk_s is not None
    assert "Predicted TTFT: " in text and "at 4000 tokens" in text and "at 8000 tokens" in text
    assert "prefill chunk of 512 tokens" in text and "max(compute " in text  # depth >= 1
    assert "over requests of 4000–8000 prompt + 16 output tokens" in text
    assert "compute " in explain(chat).split("Predicted TTFT")[1]
    changes = diff(chat, long)
    assert "prefill chunk " in changes
    assert "TTFT (longest prompt, 64 → 8000 tokens)" in changes
