"""The planner on mixture-of-experts models: expert units, the expert cache and prefetch in the
ILP equal brute force over the cost model; what it pins, caches and streams; routing profiles."""

from __future__ import annotations

import itertools
import random

import pytest
from strata.common.errors import PlanError
from strata.common.schemas import TIERS, ExpertCache, ModelDescription, Request, RoutingProfile
from strata.planner.costmodel import (
    PinnedPlacement,
    activation_bytes,
    batch_limits,
    capacity_use,
    expert_cache_for,
    host_overlaps,
    kv_cache_bytes,
    objective,
    score,
    step_compute_s,
    unit_costs,
    working_slots,
)
from strata.planner.ilp import solve
from strata.planner.routing import apply_routing_profile
from synthetic_desc import MIB, U, make_desc, make_profile


def moe_desc(blocks: int, n: int, k: int, expert_mib: list[int] | int, attn_mib: int = 6):
    """A description of ``blocks`` MoE blocks of ``n`` experts (top ``k``): attention and router
    units plus one unit per expert (``expert`` set), uniform access k/n."""
    units = []
    sizes = expert_mib if isinstance(expert_mib, list) else [expert_mib] * (blocks * n)
    for i in range(blocks):
        units.append(U(f"blk.{i}.attn", "attention", i, attn_mib * MIB, flops=10**8))
        units.append(U(f"blk.{i}.ffn", "router", i, MIB // 4, flops=10**6))
        for e in range(n):
            units.append(
                U(f"blk.{i}.expert.{e}", "expert", i, sizes[i * n + e] * MIB, k / n, 10**8 * k // n)
            )
    desc = make_desc(units, blocks=blocks)
    arch = desc.architecture.model_copy(update={"expert_count": n, "expert_used_count": k})
    infos = [
        u.model_copy(update={"expert": int(u.name.rsplit(".", 1)[1])})
        if ".expert." in u.name
        else u
        for u in desc.units
    ]
    return desc.model_copy(update={"architecture": arch, "units": infos})


def _brute_force(desc: ModelDescription, profile, request):
    """Best objective over every tier assignment, depth 0..2, cache slots and prefetch {0, k}
    (depth >= 3 only adds pool slots in the cost model, and slots beyond the streamed experts
    plus the working ones hold nothing)."""
    names = [u.name for u in desc.units]
    n_exp = sum(u.expert is not None for u in desc.units)
    k = desc.architecture.expert_used_count
    best = None
    for assign in itertools.product(TIERS, repeat=len(names)):
        tiers = dict(zip(names, assign, strict=True))
        streamed = sum(1 for u in desc.units if u.expert is not None and tiers[u.name] == "nvme")
        for depth, m in itertools.product(range(3), (0, k)):
            slot_choices = range(working_slots(desc, m), streamed + working_slots(desc, m) + 1)
            for slots in slot_choices if streamed else [0]:
                cache = expert_cache_for(desc, tiers, slots, m) if streamed else ExpertCache()
                use = capacity_use(
                    desc, profile, request, PinnedPlacement(tiers, depth, experts=cache)
                )
                if any(used > row.capacity for row, used in use):
                    continue
                obj = objective(
                    score(desc, profile, request, PinnedPlacement(tiers, depth, experts=cache)),
                    request,
                )
                if best is None or obj < best:
                    best = obj
    assert n_exp
    return best


def _instance(seed: int, request: Request | None = None):
    rng = random.Random(seed)
    desc = moe_desc(1, 4, 2, [rng.choice([4, 8]) for _ in range(4)], attn_mib=rng.choice([3, 6]))
    request = request or Request(context=64)
    p0 = make_profile(gpu_bytes=0, ram_bytes=0)
    batch = batch_limits(request)
    fixed = kv_cache_bytes(desc, p0, batch) + activation_bytes(desc, p0, batch)
    total = sum(u.bytes_mlx for u in desc.units)
    unified = seed % 2 == 0
    gpu = fixed + int(total * rng.uniform(0.2, 0.9))
    profile = make_profile(
        gpu_bytes=gpu,
        ram_bytes=(gpu if unified else 0) + int(total * rng.uniform(0.0, 0.3)),
        unified=unified,
        nvme_bw=rng.choice([1e9, 5e9]),
        matvec_flops=rng.choice([1e11, 1e13]),
        op_s=rng.choice([0.0, 5e-6]),
    )
    return desc, profile, request


def _solved_as_brute_force(desc, profile, request):
    """The ILP's solution, checked to fit and to reach the brute force's best objective (or,
    where nothing fits, the ILP's refusal); None then."""
    best = _brute_force(desc, profile, request)
    if best is None:
        with pytest.raises(PlanError, match="does not fit"):
            solve(desc, profile, request)
        return None
    sol = solve(desc, profile, request)
    tiers = {p.unit: p.tier for p in sol.placement}
    use = capacity_use(
        desc, profile, request, PinnedPlacement(tiers, sol.prefetch.depth, experts=sol.expert_cache)
    )
    assert all(used <= row.capacity for row, used in use)
    assert objective(sol.prediction, request) == pytest.approx(best, rel=1e-9)
    return sol


@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_brute_force_with_experts(seed):
    _solved_as_brute_force(*_instance(seed))


@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_brute_force_with_experts_and_long_prompts(seed):
    """Prompts of many chunks and few output tokens: prefill's expert reads (every streamed
    expert the cache does not hold, once per chunk) weigh in the objective."""
    request = Request(context=4096, prompt_tokens=[100, 3000], output_tokens=4)
    sol = _solved_as_brute_force(*_instance(seed, request))
    if sol is not None:
        assert sol.prediction.ttft_s[1] > sol.prediction.ttft_s[0]


def _plan(desc, gpu_fraction: float):
    request = Request(context=64)
    p0 = make_profile(gpu_bytes=0, ram_bytes=0)
    batch = batch_limits(request)
    fixed = kv_cache_bytes(desc, p0, batch) + activation_bytes(desc, p0, batch)
    total = sum(u.bytes_mlx for u in desc.units)
    budget = fixed + int(total * gpu_fraction)
    return solve(desc, make_profile(gpu_bytes=budget, ram_bytes=budget), request)


def test_a_model_that_fits_streams_nothing():
    sol = _plan(moe_desc(4, 8, 2, 8), 1.05)
    assert {p.tier for p in sol.placement} == {"gpu"}
    assert sol.expert_cache.slots == 0 and sol.prediction.expert_hit_rate is None


def test_uniform_routing_gets_a_cache_not_arbitrary_pins():
    """Without a routing profile nothing says which experts are hot: the memory left for
    experts becomes cache slots (LRU learns the hot ones), and the prediction counts misses."""
    desc = moe_desc(4, 8, 2, 8)
    sol = _plan(desc, 0.4)
    ec = sol.expert_cache
    streamed = [p for p in sol.placement if ".expert." in p.unit and p.tier == "nvme"]
    assert streamed and ec.slots > working_slots(desc, ec.prefetch)
    assert ec.pinned == []
    assert ec.slot_bytes == 8 * MIB
    held = ec.slots - working_slots(desc, ec.prefetch)
    alpha = ec.prefetch / 8
    want = (held + alpha * (len(streamed) - held)) / len(streamed)
    assert sol.prediction.expert_hit_rate == pytest.approx(want)
    assert sol.memory["gpu"].expert_cache == ec.slots * ec.slot_bytes


def _skewed_profile(desc: ModelDescription, hot: int) -> RoutingProfile:
    """Routing where, per block, experts 0..hot-1 take 80% of the selections."""
    a = desc.architecture
    n, k, tokens = a.expert_count, a.expert_used_count, 1000
    counts = []
    for _ in range(a.block_count):
        row = [int(0.8 * k * tokens / hot) if e < hot else 0 for e in range(n)]
        rest = k * tokens - sum(row)
        for e in range(hot, n):
            row[e] = rest // (n - hot)
        row[-1] += k * tokens - sum(row)
        counts.append(row)
    return RoutingProfile(
        model_sha256=None,
        header_sha256=desc.model.header_sha256,
        layers=a.block_count,
        expert_count=n,
        tokens=[tokens] * a.block_count,
        counts=counts,
        successor=[[[0] * n for _ in range(n)] for _ in range(a.block_count - 1)],
        predicted=4000,
        predicted_hits=2000,
    )


def test_routing_profile_preloads_the_hot_experts_and_lowers_the_prediction():
    """With a profile the hot experts are known: the cache (preferred to pins, as without one)
    lists them hottest first in ``preload``, and the prediction counts them as hits."""
    desc = moe_desc(4, 8, 2, 8)
    uniform = _plan(desc, 0.4)
    measured = apply_routing_profile(desc, _skewed_profile(desc, hot=2))
    assert measured.routing is not None and measured.routing.prediction_recall == 0.5
    hot = [u for u in measured.units if u.expert is not None and u.expert < 2]
    assert sum(
        u.access_per_token for u in measured.units if u.layer == 0 and u.expert is not None
    ) == pytest.approx(2)
    sol = _plan(measured, 0.4)
    ec = sol.expert_cache
    assert uniform.expert_cache.preload == [] and ec.pinned == []
    assert len(ec.preload) == ec.slots - working_slots(desc, ec.prefetch) >= len(hot)
    assert set(ec.preload[: len(hot)]) == {u.name for u in hot}  # hottest first
    tiers = {p.unit: p.tier for p in sol.placement}
    assert all(tiers[u] == "nvme" for u in ec.preload)
    assert sol.prediction.step_s < uniform.prediction.step_s
    assert sol.prediction.expert_hit_rate > uniform.prediction.expert_hit_rate


def test_routing_profile_of_another_model_is_refused():
    desc = moe_desc(2, 4, 2, 4)
    doc = _skewed_profile(desc, 1).model_copy(update={"header_sha256": "f" * 64})
    with pytest.raises(PlanError, match="another model"):
        apply_routing_profile(desc, doc)
    doc = _skewed_profile(moe_desc(3, 4, 2, 4), 1)
    with pytest.raises(PlanError, match="blocks"):
        apply_routing_profile(desc, doc)


def test_host_operations_overlap_device_work_on_cuda_for_dense_models():
    """``host_overlaps``/``step_compute_s``: on CUDA (the executor schedules each block as soon as
    it is built) a dense model's step compute is the larger of the device and host sums, their
    sum elsewhere and for a MoE model (whose blocks sync on the router's choice); the ILP's
    prediction follows."""
    dense = make_desc(
        [
            U("blk.0.attn", "attention", 0, 6 * MIB, flops=10**8),
            U("blk.0.ffn", "ffn", 0, 24 * MIB, flops=4 * 10**8),
        ]
    )
    moe = moe_desc(1, 4, 2, 6)
    kw = dict(gpu_bytes=2**30, ram_bytes=2**30, op_s=2e-4, matvec_flops=1e12)
    cuda, metal = make_profile(unified=False, **kw), make_profile(unified=True, **kw)
    assert (cuda.backend, metal.backend) == ("cuda", "metal")
    assert host_overlaps(dense, cuda) and not host_overlaps(dense, metal)
    assert not host_overlaps(moe, cuda)
    request = Request(context=256)
    costs = unit_costs(dense, cuda, request)
    device = sum(c.device_s for c in costs)
    host = sum(c.ops_s for c in costs)
    assert device > 0 and host > 0 and device != host
    assert step_compute_s(costs, True) == pytest.approx(max(device, host))
    assert step_compute_s(costs, False) == pytest.approx(device + host)
    for profile, want in ((cuda, max(device, host)), (metal, device + host)):
        got = solve(dense, profile, request).prediction.compute_s
        assert got == pytest.approx(want, rel=1e-6)
