"""The placement ILP: brute force, capacities, infeasibility messages, determinism, 70B size."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter

import pytest
from strata.common.errors import PlanError
from strata.common.schemas import TIERS, Request
from strata.common.yamlio import to_yaml
from strata.planner.costmodel import (
    MAX_DEPTH,
    PinnedPlacement,
    activation_bytes,
    batch_limits,
    batch_size,
    capacity_use,
    interleaved_blocks,
    kv_cache_bytes,
    objective,
    score,
    unit_costs,
)
from strata.planner.ilp import ACCEPT_GAP, Solution, solve
from synthetic_desc import (
    GIB,
    MIB,
    U,
    llama70b_desc,
    m1max32_profile,
    make_desc,
    make_profile,
)


def _brute_force(desc, profile, request):
    """Enumerate every tier assignment x depth with the cost model: (best objective, tiers,
    depth), or (None, least total shortfall in bytes) when nothing fits."""
    best, least_short = None, None
    names = [u.name for u in desc.units]
    for assign in itertools.product(TIERS, repeat=len(names)):
        tiers = dict(zip(names, assign, strict=True))
        for depth in range(MAX_DEPTH + 1):
            use = capacity_use(desc, profile, request, PinnedPlacement(tiers, depth))
            short = sum(max(0, used - row.capacity) for row, used in use)
            if short:
                least_short = short if least_short is None else min(least_short, short)
                continue
            obj = objective(score(desc, profile, request, PinnedPlacement(tiers, depth)), request)
            if best is None or obj < best[0]:
                best = (obj, tiers, depth)
    return best or (None, least_short)


def _instance(seed: int):
    """A small random instance: 4-7 units (some identical), capacities that force spilling."""
    rng = random.Random(seed)
    n = rng.randint(4, 7)
    units: list[U] = []
    for i in range(n):
        if units and rng.random() < 0.3:  # an identical twin: exercises the ILP's unit classes
            t = rng.choice(units)
            units.append(U(f"blk.{i}.ffn", t.role, i, t.bytes, t.access, t.flops))
            continue
        role = rng.choice(["attention", "ffn", "expert"])
        units.append(
            U(
                f"blk.{i}.{ {'attention': 'attn', 'ffn': 'ffn', 'expert': 'ffn_exps'}[role] }",
                role,
                i,
                rng.randint(4, 64) * MIB + rng.randint(0, 4095),
                access=rng.choice([1.0, 1.0, 0.25]) if role == "expert" else 1.0,
                flops=rng.randint(0, 4) * 10**8,
            )
        )
    desc = make_desc(units)
    total = sum(u.bytes for u in units)
    unified = seed % 2 == 0
    request = Request(
        context=rng.choice([128, 1000, 4096]),
        concurrency=rng.randint(1, 4),
        objective="throughput" if seed % 3 == 0 else "latency",
    )
    batch = batch_limits(request)
    fixed = kv_cache_bytes(desc, make_profile(gpu_bytes=0, ram_bytes=0), batch)
    fixed += activation_bytes(desc, make_profile(gpu_bytes=0, ram_bytes=0), batch)
    gpu = fixed + int(total * rng.uniform(0.3, 1.0))
    ram = (gpu if unified else 0) + int(total * rng.uniform(0.1, 0.6))
    profile = make_profile(
        gpu_bytes=gpu,
        ram_bytes=ram,
        unified=unified,
        h2d_bw=rng.choice([10e9, 50e9]),
        nvme_bw=rng.choice([2e9, 7e9, 40e9]),
        flops=rng.choice([1e12, 10e12]),
    )
    return desc, profile, request


SEEDS = [*range(16), 24, 40]  # 24 and 40: optimal placements that prefetch (depth >= 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_ilp_equals_brute_force(seed: int) -> None:
    desc, profile, request = _instance(seed)
    best = _brute_force(desc, profile, request)
    if best[0] is None:
        # The phase-1 model finds the least total shortfall too.
        with pytest.raises(PlanError, match="does not fit") as e:
            solve(desc, profile, request)
        assert sum(e.value.short_bytes.values()) == pytest.approx(best[1], abs=16)  # type: ignore[attr-defined]
        return
    sol = solve(desc, profile, request)
    tiers = {p.unit: p.tier for p in sol.placement}
    use = capacity_use(desc, profile, request, PinnedPlacement(tiers, sol.prefetch.depth))
    assert all(used <= row.capacity for row, used in use)
    got = objective(sol.prediction, request)
    assert got == pytest.approx(best[0], rel=1e-9, abs=0)
    assert sol.solver.objective == pytest.approx(got, rel=1e-12)
    assert sol.solver.gap == 0  # small models are solved exactly (the first rung)


def test_brute_force_instances_cover_the_tiers_and_modes() -> None:
    """The instances above are not all the same easy case: both objectives, unified or not, and
    optimal placements that use ram and nvme, with and without prefetch."""
    seen: Counter[str] = Counter()
    for seed in SEEDS:
        desc, profile, request = _instance(seed)
        seen[request.objective] += 1
        seen["unified" if profile.unified_memory else "discrete"] += 1
        try:
            sol = solve(desc, profile, request)
        except PlanError:
            seen["infeasible"] += 1
            continue
        seen.update({f"tier:{p.tier}" for p in sol.placement})
        seen["depth>=1" if sol.prefetch.depth else "depth=0"] += 1
    for key in (
        "latency",
        "throughput",
        "unified",
        "discrete",
        "tier:ram",
        "tier:nvme",
        "depth>=1",
    ):
        assert seen[key] > 0, (key, seen)


def _check_solution(sol: Solution, desc, profile, request) -> None:
    names = [p.unit for p in sol.placement]
    assert sorted(names) == sorted(u.name for u in desc.units)  # every unit exactly once
    tiers = {p.unit: p.tier for p in sol.placement}
    pinned = PinnedPlacement(tiers, sol.prefetch.depth)
    for row, used in capacity_use(desc, profile, request, pinned):
        assert used <= row.capacity, row.name
    assert sol.memory["gpu"].weights == sum(p.bytes for p in sol.placement if p.tier == "gpu")
    assert sol.memory["ram"].weights == sum(p.bytes for p in sol.placement if p.tier == "ram")
    assert sol.memory["nvme"].weights == sum(p.bytes for p in sol.placement if p.tier == "nvme")
    streamed = [p.bytes for p in sol.placement if p.tier == "nvme"]
    if streamed:
        assert sol.pool.slots == sol.prefetch.depth + 1
        assert sol.pool.slot_bytes == max(streamed)
        assert sol.prefetch.io_threads == profile.nvme.queue_depth
    else:
        assert (sol.pool.slots, sol.pool.slot_bytes, sol.prefetch.depth) == (0, 0, 0)
        assert sol.prefetch.io_threads == 0
    assert sol.prediction == score(desc, profile, request, pinned)
    b = batch_size(request)
    assert sol.prediction.decode_tok_s == pytest.approx(b / sol.prediction.step_s)


def test_70b_solves_optimal_and_respects_capacities() -> None:
    desc, profile = llama70b_desc(), m1max32_profile()
    assert len(desc.units) == 162
    request = Request(context=4096, concurrency=1)
    start = time.perf_counter()
    sol = solve(desc, profile, request)
    wall = time.perf_counter() - start
    print(
        f"\n70B-size description (162 units): solved in {sol.solve_time_s:.3f} s "
        f"({wall:.3f} s wall)"
    )
    assert sol.solver.status == "Optimal"
    _check_solution(sol, desc, profile, request)
    # 49 GiB of weights on a 32 GB machine: some must stream, and the disk is the bottleneck.
    assert sol.memory["nvme"].weights > 0
    assert sol.prediction.bottleneck == "disk"
    assert "step = disk" in sol.prediction.binding


def test_70b_throughput_on_a_large_machine() -> None:
    desc = llama70b_desc()
    profile = make_profile(gpu_bytes=144 * GIB, ram_bytes=192 * GIB, reserve=16 * GIB)
    request = Request(context=8192, concurrency=8, objective="throughput")
    sol = solve(desc, profile, request)
    _check_solution(sol, desc, profile, request)
    assert {p.tier for p in sol.placement} == {"gpu"}  # everything fits: nothing copied or streamed
    assert sol.prediction.bottleneck == "compute"
    assert sol.prediction.decode_tok_s == pytest.approx(8 / sol.prediction.step_s)
    assert sol.batch.kv_num_blocks == 8 * 512 and sol.batch.max_num_batched_tokens == 512


def _mixed_quant_desc(n_sizes: int, seed: int = 1):
    """80 blocks whose attention and FFN sizes vary per layer (a per-layer mix of quant types)."""
    rng = random.Random(seed)
    base = llama70b_desc()
    units = []
    for u in base.units:
        b = u.bytes_mlx
        if u.layer is not None:
            b = int(b * (1 + 0.25 * rng.randrange(n_sizes) / n_sizes))
        units.append(U(u.name, u.role, u.layer, b, u.access_per_token, u.flops_per_token))
    return make_desc(
        units, width=8192, ff=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256, blocks=80
    )


@pytest.mark.parametrize("n_sizes", [5, 40])
def test_mixed_quant_sizes_solve_within_the_accepted_gap(n_sizes: int) -> None:
    """Many distinct unit sizes (above SLOT_LEVELS the slot levels are rounded up): still solved,
    capacities respected, the gap proven within ACCEPT_GAP, the same answer twice."""
    desc, profile = _mixed_quant_desc(n_sizes), m1max32_profile()
    request = Request(context=4096, concurrency=1)
    sol = solve(desc, profile, request)
    print(f"\n{n_sizes} sizes per role: {sol.solve_time_s:.2f} s, gap {sol.solver.gap:.2e}")
    _check_solution(sol, desc, profile, request)
    assert sol.solver.gap <= ACCEPT_GAP
    if n_sizes <= 5:
        assert solve(desc, profile, request) == sol


def test_determinism() -> None:
    desc, profile = llama70b_desc(), m1max32_profile()
    request = Request(context=4096, concurrency=2, objective="throughput")
    a, b = solve(desc, profile, request), solve(desc, profile, request)
    assert a == b
    assert to_yaml(a.to_plan(desc, profile, request)) == to_yaml(b.to_plan(desc, profile, request))


def test_identical_units_keep_early_layers_on_the_device() -> None:
    """Equal-cost placements resolve one way: of interchangeable units, early ones stay on gpu."""
    desc, profile = llama70b_desc(), m1max32_profile()
    sol = solve(desc, profile, Request(context=4096, concurrency=1))
    rank = {"gpu": 0, "ram": 1, "nvme": 2}
    ffn = [rank[p.tier] for p in sol.placement if p.unit.endswith(".ffn")]
    assert ffn == sorted(ffn)


def test_infeasible_gpu_names_tier_and_shortfall() -> None:
    # Discrete GPU with 64 MiB; the KV cache alone is 128 MiB. RAM is large, so the cheapest way
    # to fit is every weight in RAM (no pool): the gpu tier is short by KV + activations - 64 MiB.
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, 32 * MIB) for i in range(4)])
    profile = make_profile(gpu_bytes=64 * MIB, ram_bytes=64 * GIB, unified=False)
    request = Request(context=4096, concurrency=64)
    batch = batch_limits(request)
    need = kv_cache_bytes(desc, profile, batch) + activation_bytes(desc, profile, batch)
    short = need - 64 * MIB
    assert short > 0
    with pytest.raises(PlanError) as e:
        solve(desc, profile, request)
    msg = str(e.value)
    assert msg.startswith("does not fit: gpu tier is short by")
    assert f"({short} bytes)" in msg
    assert "every weight off the device" in msg
    assert "--gpu-budget" in msg and "--context/--concurrency" in msg
    assert e.value.short_bytes == {"gpu capacity": short}  # type: ignore[attr-defined]


def test_infeasible_unified_memory_names_shortfall() -> None:
    # Unified memory of 96 MiB, a KV cache of 64 MiB + activations, units of 16..40 MiB: the least
    # memory is every unit streamed through one slot of the largest (depth 0).
    sizes = [16 * MIB, 24 * MIB, 40 * MIB, 20 * MIB]
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, b) for i, b in enumerate(sizes)])
    profile = make_profile(gpu_bytes=10 * GIB, ram_bytes=96 * MIB, unified=True)
    request = Request(context=4096, concurrency=32, gpu_budget_bytes=10 * GIB)
    batch = batch_limits(request)
    need = (
        kv_cache_bytes(desc, profile, batch) + activation_bytes(desc, profile, batch) + max(sizes)
    )
    short = need - 96 * MIB
    assert short > 0
    with pytest.raises(PlanError) as e:
        solve(desc, profile, request)
    msg = str(e.value)
    assert "unified memory (gpu + ram tiers) is short by" in msg
    assert f"({short} bytes)" in msg
    assert "--ram-budget" in msg


def test_everything_fits_no_pool_no_prefetch() -> None:
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, 8 * MIB, flops=10**8) for i in range(6)])
    profile = make_profile(gpu_bytes=1 * GIB, ram_bytes=4 * GIB)
    request = Request(context=256, concurrency=1)
    sol = solve(desc, profile, request)
    _check_solution(sol, desc, profile, request)
    assert {p.tier for p in sol.placement} == {"gpu"}
    assert sol.prediction.host_copy_s == 0 and sol.prediction.disk_s == 0


def test_depth_zero_when_memory_only_allows_one_slot() -> None:
    # The gpu holds KV + activations + one 32 MiB slot but not two; ram holds nothing more:
    # streaming synchronously (depth 0) is the only feasible way.
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, 32 * MIB) for i in range(3)])
    profile = make_profile(gpu_bytes=0, ram_bytes=0, unified=False)
    request = Request(context=128, concurrency=1)
    batch = batch_limits(request)
    fixed = kv_cache_bytes(desc, profile, batch) + activation_bytes(desc, profile, batch)
    request = Request(
        context=128, concurrency=1, gpu_budget_bytes=fixed + 40 * MIB, ram_budget_bytes=40 * MIB
    )
    sol = solve(desc, profile, request)
    _check_solution(sol, desc, profile, request)
    assert sol.prefetch.depth == 0 and sol.pool.slots == 1
    assert "step = compute + host copy + disk (no prefetch)" in sol.prediction.binding


def test_score_rejects_a_placement_that_misses_units() -> None:
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, MIB) for i in range(2)])
    profile = make_profile(gpu_bytes=GIB, ram_bytes=GIB)
    with pytest.raises(PlanError, match="units without a tier: blk.1.ffn"):
        score(
            desc,
            profile,
            Request(context=16, concurrency=1),
            PinnedPlacement({"blk.0.ffn": "gpu"}, 0),
        )


def _blocks_instance(seed: int):
    """3 blocks of a small attention and a large FFN unit, on a machine where a streamed FFN's
    read outlasts its block's attention compute (so depth 1 stalls when both stream)."""
    rng = random.Random(seed)
    units = []
    for i in range(3):
        units.append(U(f"blk.{i}.attn", "attention", i, 8 * MIB, flops=rng.randint(1, 3) * 10**8))
        units.append(U(f"blk.{i}.ffn", "ffn", i, 48 * MIB, flops=rng.randint(15, 25) * 10**8))
    desc = make_desc(units)
    request = Request(context=128, concurrency=1)
    batch = batch_limits(request)
    fixed = kv_cache_bytes(desc, make_profile(gpu_bytes=0, ram_bytes=0), batch)
    fixed += activation_bytes(desc, make_profile(gpu_bytes=0, ram_bytes=0), batch)
    gpu = fixed + rng.choice([104, 112, 152, 160, 200]) * MIB
    profile = make_profile(
        gpu_bytes=gpu, ram_bytes=gpu, matvec_flops=1e11, nvme_bw=rng.choice([4e9, 6e9, 8e9])
    )
    return desc, profile, request


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force_with_interleaved_blocks(seed: int) -> None:
    desc, profile, request = _blocks_instance(seed)
    best = _brute_force(desc, profile, request)
    assert best[0] is not None
    sol = solve(desc, profile, request)
    assert objective(sol.prediction, request) == pytest.approx(best[0], rel=1e-9, abs=0)


def test_io_stall_charges_blocks_whose_attention_and_ffn_both_stream() -> None:
    desc, profile, request = _blocks_instance(0)
    costs = {c.name: c for c in unit_costs(desc, profile, request)}
    both = {u.name: "nvme" if u.layer in (0, 2) else "gpu" for u in desc.units}
    ffn_only = {u.name: "nvme" if u.name.endswith(".ffn") else "gpu" for u in desc.units}
    assert interleaved_blocks(desc, both) == [0, 2]
    stall = sum(costs[f"blk.{i}.ffn"].read_s - costs[f"blk.{i}.attn"].compute_s for i in (0, 2))
    assert stall > 0

    def stall_s(tiers: dict[str, str], depth: int) -> float:
        return score(desc, profile, request, PinnedPlacement(tiers, depth)).io_stall_s

    assert stall_s(both, 1) == pytest.approx(stall)
    assert stall_s(both, 2) == 0  # a third slot hides it
    assert stall_s(ffn_only, 1) == 0


def test_streamed_attention_goes_to_blocks_whose_ffn_stays() -> None:
    # Uniform blocks (one class per role, so ``_decisions`` picks the blocks). Room for the
    # 2-slot pool, one FFN and two attention units: one attention unit must stream beside two
    # FFNs, and it goes to the block whose FFN is resident, so no block streams both.
    units = []
    for i in range(3):
        units.append(U(f"blk.{i}.attn", "attention", i, 8 * MIB, flops=2 * 10**8))
        units.append(U(f"blk.{i}.ffn", "ffn", i, 48 * MIB, flops=20 * 10**8))
    desc, profile = make_desc(units), make_profile(gpu_bytes=0, ram_bytes=0)
    # Decode-bound requests (one-token prompts): the case is about the decode step's stall.
    request = Request(context=4096, concurrency=1, prompt_tokens=[1, 1], output_tokens=4000)
    batch = batch_limits(request)
    profile = make_profile(
        gpu_bytes=kv_cache_bytes(desc, profile, batch)
        + activation_bytes(desc, profile, batch)
        + (2 * 48 + 48 + 8) * MIB,
        ram_bytes=GIB,
        matvec_flops=1e11,
        nvme_bw=2e9,
    )
    sol = solve(desc, profile, request)
    tiers = {p.unit: p.tier for p in sol.placement}
    streamed = {u for u, t in tiers.items() if t == "nvme"}
    assert sol.prefetch.depth == 1
    assert sum(u.endswith(".attn") for u in streamed) == 1  # the case the decoder must place
    assert sum(u.endswith(".ffn") for u in streamed) == 2
    assert interleaved_blocks(desc, tiers) == []
    assert sol.prediction.io_stall_s == 0


def test_batched_decode_is_charged_at_the_measured_decode_batch_rate() -> None:
    """``gpu.decode_batch_flops_s`` prices B tokens' products: where the quantized kernel costs in
    proportion to its rows (MLX's CPU backend: the rate equals the matvec rate), a 16-sequence
    step's compute is 16 single steps'; without the figure the matrix-product rate applies."""
    from strata.common.schemas import Figure

    desc = llama70b_desc()
    slow = 1e9  # FLOP/s: compute-bound, far below what the bandwidth allows
    base = make_profile(gpu_bytes=144 * GIB, ram_bytes=192 * GIB, flops=1e15, matvec_flops=slow)
    measured = Figure(value=slow, source="measured", how="a test")
    rows_bound = base.model_copy(
        update={"gpu": base.gpu.model_copy(update={"decode_batch_flops_s": measured})}
    )

    def ffn_compute(profile, b: int) -> float:
        request = Request(context=4096, concurrency=b, objective="throughput")
        return {c.name: c for c in unit_costs(desc, profile, request)}["blk.0.ffn"].compute_s

    assert ffn_compute(rows_bound, 16) == pytest.approx(16 * ffn_compute(rows_bound, 1))
    assert ffn_compute(base, 16) == pytest.approx(ffn_compute(base, 1))  # the matvec bound
