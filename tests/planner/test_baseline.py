"""The baseline rule (``planner.baseline``): first blocks resident in order, the rest on the next
tier; a valid, runnable plan; never predicted better than the ILP's."""

from __future__ import annotations

import random

import pytest
from strata.common.errors import PlanError
from strata.common.schemas import TIERS, Request
from strata.planner.baseline import baseline_placement, baseline_plan
from strata.planner.costmodel import PinnedPlacement, capacity_use, objective
from strata.planner.explain import explain
from strata.planner.ilp import solve
from synthetic_desc import GIB, MIB, U, llama70b_desc, m1max32_profile, make_desc, make_profile


def _blocks(n: int, attn: int = MIB, ffn: int = 3 * MIB) -> list[U]:
    units = [U("token_embd", "embedding", None, 2 * MIB)]
    for i in range(n):
        units += [U(f"blk.{i}.attn", "attention", i, attn), U(f"blk.{i}.ffn", "ffn", i, ffn)]
    return units + [U("output", "output", None, 2 * MIB)]


def _tier_rank(t: str) -> int:
    return TIERS.index(t)


def test_first_blocks_resident_in_order():
    desc = make_desc(_blocks(10), kv_elements_per_token=0)
    profile = make_profile(gpu_bytes=20 * MIB, ram_bytes=64 * GIB, unified=False)
    tiers = baseline_placement(desc, profile, Request(context=16)).tiers
    order = ["token_embd"] + [f"blk.{i}.{p}" for i in range(10) for p in ("attn", "ffn")]
    ranks = [_tier_rank(tiers[n]) for n in order]
    assert ranks == sorted(ranks), "a later block never sits on a faster tier"
    for i in range(10):  # a block's units together
        assert tiers[f"blk.{i}.attn"] == tiers[f"blk.{i}.ffn"]
    assert tiers["blk.0.attn"] == "gpu" and tiers["blk.9.ffn"] == "ram"
    # As many leading blocks as fit: one more would not.
    k = sum(1 for i in range(10) if tiers[f"blk.{i}.attn"] == "gpu")
    more = dict(tiers, **{f"blk.{k}.attn": "gpu", f"blk.{k}.ffn": "gpu"})
    rows = capacity_use(desc, profile, Request(context=16), PinnedPlacement(more, 0))
    assert any(used > row.capacity for row, used in rows)


def test_the_rest_streams_when_ram_is_short_and_it_fits():
    desc = make_desc(_blocks(10), kv_elements_per_token=0)
    profile = make_profile(gpu_bytes=24 * MIB, ram_bytes=10 * MIB, unified=False)
    request = Request(context=16)
    plan = baseline_plan(desc, profile, request)
    assert plan.provenance.method == "baseline" and plan.solver is None
    used = {p.tier for p in plan.placement}
    assert used == {"gpu", "ram", "nvme"}
    assert plan.pool.slots == plan.prefetch.depth + 1 >= 1  # depth 1 where two slots fit
    placement = PinnedPlacement.of(plan)
    assert all(u <= r.capacity for r, u in capacity_use(desc, profile, request, placement))
    # explain puts it beside itself: the ILP's plan is not slower than the rule.
    assert "Baseline" in explain(plan)


def test_no_room_at_all_is_a_clear_error():
    desc = make_desc(_blocks(2), kv_elements_per_token=10**6)
    profile = make_profile(gpu_bytes=MIB, ram_bytes=MIB, unified=False)
    with pytest.raises(PlanError, match="baseline rule finds no placement"):
        baseline_placement(desc, profile, Request(context=64, tiers=["gpu"]))


@pytest.mark.parametrize("seed", range(6))
def test_the_ilp_is_never_predicted_slower_than_the_rule(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    units = [U("token_embd", "embedding", None, rng.randint(1, 4) * MIB, flops=10**6)]
    for i in range(n):
        units += [
            U(f"blk.{i}.attn", "attention", i, rng.randint(1, 3) * MIB, flops=10**7),
            U(f"blk.{i}.ffn", "ffn", i, rng.randint(2, 8) * MIB, flops=3 * 10**7),
        ]
    desc = make_desc(units, kv_elements_per_token=64)
    profile = make_profile(
        gpu_bytes=rng.randint(20, 48) * MIB,
        ram_bytes=rng.randint(8, 40) * MIB,
        unified=rng.random() < 0.5,
        h2d_bw=rng.choice([5e9, 50e9]),
        nvme_bw=rng.choice([1e9, 5e9]),
        op_s=rng.choice([0.0, 1e-5]),
    )
    request = Request(context=32, objective=rng.choice(["latency", "throughput"]), concurrency=2)
    try:
        base = baseline_plan(desc, profile, request)
    except PlanError:
        pytest.skip("the rule finds no placement here")
    sol = solve(desc, profile, request)
    assert base.prediction is not None
    assert objective(sol.prediction, request, sol.batch) <= objective(
        base.prediction, request, base.batch
    ) * (1 + 1e-6)


def test_explain_shows_the_baseline_beside_the_plan():
    desc, profile = llama70b_desc(), m1max32_profile()
    request = Request(context=4096)
    plan = solve(desc, profile, request).to_plan(desc, profile, request)
    text = explain(plan)
    assert "Baseline (first blocks resident in order" in text
    assert "faster per request than the baseline" in text or "no better than the rule" in text
