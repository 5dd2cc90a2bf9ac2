"""``explain`` and ``diff`` on solved and hand-written plans."""

from __future__ import annotations

import re

import pytest
from strata.common.schemas import Placement, Plan, Request
from strata.planner.costmodel import batch_limits, score_plan
from strata.planner.diff import diff
from strata.planner.explain import explain, group_runs, infer_role, unit_refs
from strata.planner.ilp import solve
from strata.planner.rescore import model_costs
from synthetic_desc import (
    GIB,
    MIB,
    U,
    llama70b_desc,
    m1max32_profile,
    make_desc,
    make_profile,
)


def _plan(desc, profile, request) -> Plan:
    return solve(desc, profile, request).to_plan(desc, profile, request)


@pytest.fixture(scope="module")
def two_machines() -> tuple[Plan, Plan, object]:
    """The 70B-size model planned on a 32 GB and a 64 GB machine (same request)."""
    desc = llama70b_desc()
    request = Request(context=4096, concurrency=1)
    big = make_profile(
        gpu_bytes=48 * GIB, ram_bytes=64 * GIB, reserve=6 * GIB, nvme_bw=5.1e9, name="m1-max-64gb"
    )
    return _plan(desc, m1max32_profile(), request), _plan(desc, big, request), desc


def _hand_plan(tiers: list[str], *, depth: int = 1) -> tuple[Plan, object]:
    """A hand-written plan (no memory, prediction or solver) over 1-MiB FFN units."""
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, MIB) for i in range(len(tiers))])
    request = Request(context=64, concurrency=1)
    streams = "nvme" in tiers
    plan = Plan(
        model=desc.model,
        machine=make_profile(gpu_bytes=GIB, ram_bytes=GIB),
        costs=model_costs(desc),
        request=request,
        placement=[
            Placement(unit=u.name, tier=t, bytes=u.bytes_mlx)  # type: ignore[arg-type]
            for u, t in zip(desc.units, tiers, strict=True)
        ],
        pool={"slots": depth + 1 if streams else 0, "slot_bytes": MIB if streams else 0},
        prefetch={"depth": depth if streams else 0, "io_threads": 1 if streams else 0},
        batch=batch_limits(request),
    )
    return plan, desc


def test_explain_solved_plan(two_machines) -> None:
    a, _, desc = two_machines
    text = explain(a, desc)
    assert "Plan for llama-70b-synthetic" in text and "on m1-max-32gb" in text
    assert "Request: context 4096 tokens, concurrency 1, objective latency" in text
    assert re.search(r"^  gpu .* 21\.30 GiB  9\d\.\d%$", text, re.M)  # bytes vs capacity, % used
    assert re.search(r"^  nvme .* unbounded", text, re.M)
    # FFNs: early blocks on the device, the last ones streamed.
    assert re.search(r"^  ffn +blk 0–\d+  gpu \(.*blk \d+–79  nvme \(", text, re.M)
    assert re.search(r"^Pool: 2 slots × .* prefetch depth 1, 8 I/O threads$", text, re.M)
    assert "= max(compute + host copy + I/O stall, disk)" in text
    assert re.search(r"^  I/O stall  \d", text, re.M)
    assert "  bottleneck: disk" in text
    assert "  binding: gpu capacity, unified memory capacity (gpu + ram), step = disk" in text
    assert re.search(r"^Predicted decode: 0\.\d+ tok/s$", text, re.M)
    assert "Solver: CBC" in text and "Optimal" in text
    # Roles inferred from unit names match the description's.
    assert explain(a) == text


def test_explain_groups_contiguous_layers() -> None:
    plan, desc = _hand_plan(["gpu"] * 10 + ["nvme"] * 20)
    text = explain(plan, desc)
    assert (
        "  ffn        blk 0–9  gpu (10.00 MiB, 10 units);  blk 10–29  nvme (20.00 MiB, 20 units)"
        in text
    )
    # Written by hand (no digest of the solver's decisions): marked, and judged from its own
    # decisions with its own figures.
    assert text.startswith("Plan for ") and "\nEdited by hand: " in text
    assert re.search(r"^  nvme +20\.00 MiB ", text, re.M)
    assert "Pool: 2 slots × 1.00 MiB" in text
    assert re.search(r"^Predicted decode: [\d.]+ tok/s$", text, re.M)


def test_score_plan_scores_a_hand_written_plan() -> None:
    plan, desc = _hand_plan(["gpu"] * 10 + ["nvme"] * 20)
    profile = make_profile(gpu_bytes=GIB, ram_bytes=GIB)
    pred = score_plan(plan, desc, profile)
    assert pred.disk_s == pytest.approx(20 * MIB / 5e9)
    assert pred.bottleneck == "disk"
    scored = plan.model_copy(update={"prediction": pred})
    assert "bottleneck: disk" in explain(scored, desc)


def test_diff_identical(two_machines) -> None:
    a, _, _ = two_machines
    assert diff(a, a) == "plans are identical\n"
    assert diff(a, a.model_copy(deep=True)) == "plans are identical\n"


def test_diff_two_machines(two_machines) -> None:
    a, b, desc = two_machines
    text = diff(a, b, desc)
    assert text.startswith("machine: m1-max-32gb (")
    assert re.search(r"^  gpu\.working_set_bytes: [\d.]+ GiB → [\d.]+ GiB$", text, re.M)
    assert "model:" not in text and "request:" not in text  # same model and request
    assert re.search(r"^placement: \d+ units moved$", text, re.M)
    assert re.search(r"^  ffn blk \d+–79: nvme → gpu, \d+ units, [\d.]+ GiB$", text, re.M)
    assert re.search(r"^  gpu: weights 18\.\d+ GiB → 4\d\.\d+ GiB \(\+", text, re.M)
    assert re.search(r"^  step 4\.\d+ s → \d+\.\d+ ms \(−4\.\d+ s\)$", text, re.M)
    assert re.search(r"^  decode 0\.\d+ → \d+\.\d+ tok/s \(\+", text, re.M)
    assert "  bottleneck: disk → compute" in text


def test_explain_and_diff_name_the_kernel_paths(two_machines) -> None:
    a, _, desc = two_machines
    assert "quantized products: MLX's" in explain(a, desc)
    runtime = a.runtime.model_copy(
        update={"dequant_matmul_min_rows": 128, "mma_matmul_min_rows": 2, "mma_matmul_max_rows": 32}
    )
    b = a.model_copy(update={"runtime": runtime})
    text = diff(a, b, desc)
    assert "tensor-core kernel for 2-32 rows, dequantize + matmul from 128 rows" in text
    assert text.startswith("plan b is edited by hand")
    assert "\nruntime: " in text


def test_diff_tier_moves_by_layer_range() -> None:
    a, desc = _hand_plan(["gpu"] * 30)
    b, _ = _hand_plan(["gpu"] * 10 + ["nvme"] * 20)
    text = diff(a, b, desc)
    assert "placement: 20 units moved\n  ffn blk 10–29: gpu → nvme, 20 units, 20.00 MiB\n" in text
    assert (
        "pool: none (nothing streams); prefetch depth 0, 0 I/O threads → 2 slots × 1.00 MiB" in text
    )
    # Moves on non-adjacent layers are separate ranges.
    c, _ = _hand_plan(["gpu"] * 3 + ["ram"] + ["gpu"] * 3 + ["ram"] + ["gpu"] * 22)
    text = diff(a, c)
    assert (
        "  ffn blk 3: gpu → ram, 1 unit, 1.00 MiB\n  ffn blk 7: gpu → ram, 1 unit, 1.00 MiB\n"
        in text
    )


def test_infer_role_and_runs() -> None:
    assert infer_role("blk.12.expert.3") == (12, "expert")
    assert infer_role("blk.0.attn") == (0, "attention")
    assert infer_role("token_embd") == (None, "embedding")
    assert infer_role("output") == (None, "output")
    plan, _ = _hand_plan(["gpu", "gpu", "ram", "gpu"])
    tiers = plan.tier_of()
    runs = group_runs(unit_refs(plan), key=lambda u: tiers[u.name])["ffn"]
    assert [(r.span, r.key, len(r.units)) for r in runs] == [
        ("blk 0–1", "gpu", 2),
        ("blk 2", "ram", 1),
        ("blk 3", "gpu", 1),
    ]


def test_explain_names_excluded_tiers() -> None:
    # Units of 1 MiB on a roomy machine: with --tiers ram the reason is the request.
    desc = make_desc([U(f"blk.{i}.ffn", "ffn", i, MIB) for i in range(6)])
    profile = make_profile(gpu_bytes=GIB, ram_bytes=GIB)
    text = explain(_plan(desc, profile, Request(context=64, tiers=["ram"])), desc)
    assert "Because the request keeps weights off the device (--tiers ram)" in text
    fixed = explain(_plan(desc, profile, Request(context=64)), desc)
    assert "Every weight is on the device" in fixed


def test_rate_label_says_what_the_predicted_rate_counts():
    """A throughput plan's rate is an aggregate; a latency plan for several users is per sequence
    (a new user could not tell the two apart)."""
    from strata.common.schemas import Request
    from strata.planner.costmodel import rate_label

    assert rate_label(Request(context=2048)) == ""
    assert rate_label(Request(context=2048, concurrency=4, objective="throughput")) == (
        " aggregate (4 sequences)"
    )
    assert rate_label(Request(context=2048, concurrency=4)) == (
        " for one sequence (latency objective)"
    )
