"""Plans over several hosts (``strata plan --cluster``, ``planner.cluster``): the loopback
cluster's plan of SmolLM2, its stages and links, the pipeline's cost (decode steps whole or cut
into micro-batches), and the views of it."""

from __future__ import annotations

import pytest
from conftest import DEV_PROFILE, ROOT
from strata.common.cluster import check_cluster_placement, stage_units, stage_view
from strata.common.errors import PlanError, SchemaError
from strata.common.schemas import HardwareProfile, LinkPlan, Plan, Pool, Request
from strata.common.yamlio import read_yaml, write_yaml
from strata.planner.archdesc import describe_arch
from strata.planner.cluster import build_cluster_plan, candidate_splits
from strata.planner.costmodel import batch_limits, kv_cache_bytes, recurrent_state_bytes
from strata.planner.diff import diff
from strata.planner.explain import explain
from strata.planner.pipeline import flowing_ttft, pipeline_prediction, transfer_s
from strata.planner.planning import build_plan
from strata.planner.rescore import edited, judge, memory_needs
from test_cli import assert_one_line_error, cli

LOOPBACK = ROOT / "profiles" / "clusters" / "loopback-2.yaml"
HALF = 103_928_448
"""Each loopback host's budgets: half of the one-host plan's memory (the file's comment)."""
REQUEST = Request(context=2048)


@pytest.fixture(scope="module")
def desc():
    """SmolLM2-135M Q4_1 described from its architecture file: the same units, bytes and costs
    as the GGUF's description, without the file (the fast tier)."""
    return describe_arch(ROOT / "profiles" / "arch" / "smollm2-135m.yaml", "Q4_1")


@pytest.fixture(scope="module")
def one_host(desc) -> Plan:
    return build_plan("smollm2-135m", DEV_PROFILE, REQUEST, desc=desc)


@pytest.fixture(scope="module")
def two_hosts(desc, tmp_path_factory) -> Plan:
    """The loopback cluster's plan, written and read back as a file."""
    plan = build_cluster_plan("smollm2-135m", LOOPBACK, REQUEST, desc=desc)
    path = tmp_path_factory.mktemp("cluster") / "plan.yaml"
    write_yaml(plan, path)
    return read_yaml(path, Plan)


def _cluster_file(
    tmp_path, hosts: list[tuple[str, str]], links: list[tuple[str, str]], backend="ring", **budget
):
    """A cluster file of ``hosts`` (name, profile path) and ``links`` (1 GB/s, 10 µs)."""
    lines = ["name: test", f"backend: {backend}", "hosts:"]
    for name, profile in hosts:
        lines += [f"  - name: {name}", "    address: 127.0.0.1", f"    profile: {profile}"]
        lines += [f"    {k}: {v}" for k, v in budget.items()]
    lines.append("links:" if links else "links: []")
    for a, b in links:
        lines += [
            f"  - hosts: [{a}, {b}]",
            "    bandwidth_bytes_s: {value: 1000000000, source: assumed, how: test}",
            "    latency_s: {value: 0.00001, source: assumed, how: test}",
        ]
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_loopback_budgets_are_half_the_one_host_plans_memory():
    one = read_yaml(ROOT / "plans" / "smollm2-135m.dev-linux-cpu.yaml", Plan)
    g = one.memory["gpu"]
    need = g.weights + g.kv_cache + g.activations + g.pool + g.expert_cache
    assert one.request.context == REQUEST.context and need // 2 == HALF


def test_every_unit_is_placed_once_on_its_stages_host(two_hosts, desc):
    plan = two_hosts
    check_cluster_placement(plan)
    stages = plan.cluster.stages
    assert [s.host for s in stages] == ["a", "b"]
    assert stages[0].first_block == 0 and stages[-1].end_block == desc.architecture.block_count
    assert all(s.end_block > s.first_block for s in stages)
    names = [p.unit for p in plan.placement]
    assert sorted(names) == sorted(u.name for u in desc.units) and len(set(names)) == len(names)
    host = {p.unit: p.host for p in plan.placement}
    for u in desc.units:
        if u.layer is None:
            assert host[u.name] == "a", u.name  # rank 0 holds the embedding and the head
        else:
            s = next(s for s in stages if s.first_block <= u.layer < s.end_block)
            assert host[u.name] == s.host, u.name
    ranges = [(s.first_block, s.end_block) for s in stages]
    for rank in range(len(stages)):
        view = stage_view(plan, rank)
        assert [p.unit for p in view.placement] == stage_units(desc.units, ranges, rank)
        assert all(p.host is None for p in view.placement) and view.cluster is None


def test_each_host_holds_its_stage_within_its_budgets(two_hosts, desc):
    plan = two_hosts
    for rank, s in enumerate(plan.cluster.stages):
        assert s.gpu_budget_bytes == s.ram_budget_bytes == HALF
        for row, used in memory_needs(stage_view(plan, rank)):
            assert row.capacity == HALF and used <= HALF, (s.host, row.name)
    # Half of what one host needs each: the stages cannot all stay resident, so one streams.
    assert any(p.tier == "nvme" for p in plan.placement)


def test_stage_memory_is_its_own_blocks(two_hosts, one_host, desc):
    """KV cache of a stage is its blocks' share; every stage reserves the activations; the
    weights are its own units'."""
    kv_total = one_host.memory["gpu"].kv_cache
    blocks = desc.architecture.block_count
    for s in two_hosts.cluster.stages:
        gpu = s.memory["gpu"]
        assert gpu.kv_cache == kv_total * (s.end_block - s.first_block) // blocks
        assert gpu.activations == one_host.memory["gpu"].activations
        mine = sum(p.bytes for p in two_hosts.placement if p.host == s.host and p.tier == "gpu")
        assert gpu.weights == mine
    assert sum(s.memory["gpu"].kv_cache for s in two_hosts.cluster.stages) == kv_total


def test_link_and_pipeline_prediction_by_hand(two_hosts, desc):
    """Each boundary sends one row of 576 float32 = 2,304 bytes per decode step: 22.5 µs + 2,304 B
    / 1.87 GB/s = 23.732 µs; the step is both stages' plus both transfers."""
    c = two_hosts.cluster
    assert [lk.hosts for lk in c.links] == [["a", "b"], ["b", "a"]]  # the ring back to rank 0
    for lk in c.links:
        assert lk.bytes_per_token == 576 * 4 == 2304
        assert lk.predicted_s == pytest.approx(22.5e-6 + 2304 / 1.87e9)
    steps = [s.prediction.step_s for s in c.stages]
    step = sum(steps) + 2 * (22.5e-6 + 2304 / 1.87e9)
    assert c.prediction.step_s == pytest.approx(step, rel=1e-6)
    assert two_hosts.prediction.step_s == pytest.approx(step, rel=1e-6)
    assert c.prediction.decode_tok_s == pytest.approx(1 / step, rel=1e-4)  # written rounded
    assert c.prediction.micro_batches == 1
    # TTFT: one chunk (128 tokens) is lock-step, the stages' TTFT and a transfer per link; two
    # chunks of 512 flow (planner.pipeline): the first through a, then the second at whichever
    # rank is slower, the last through b (and back to a).
    hop = [22.5e-6 + r * 2304 / 1.87e9 for r in (128, 512)]
    short = sum(s.prediction.ttft_s[0] for s in c.stages) + 2 * hop[0]
    c0, c1 = (s.prediction.prefill_chunk_s for s in c.stages)
    t0, t1 = (s.prediction.ttft_s[1] for s in c.stages)
    w = [c0 + hop[1], c1]  # a rank's first chunk (rank 1 sends it nowhere)
    v = [t0 - c0 + hop[1], t1 - c1 + hop[1]]  # its last chunk, rank 1's sent back to a
    long = max(w[0] + v[0] + v[1], w[0] + w[1] + v[1])
    assert two_hosts.prediction.ttft_s == pytest.approx([short, long], rel=1e-5)
    assert long < t0 + t1 + 4 * hop[1]  # below lock-step's
    slowest = max(c.stages, key=lambda s: s.prediction.step_s)
    assert c.prediction.binding == f"host {slowest.host}"
    assert two_hosts.prediction.binding[0] == c.prediction.binding


def _link(a: str, b: str) -> LinkPlan:
    """A hand-built boundary: 1 ms latency and 0.1 ms per row (100 B per token at 1 MB/s)."""
    return LinkPlan(
        hosts=[a, b],
        bandwidth_bytes_s={"value": 1e6, "source": "assumed", "how": "by hand"},
        latency_s={"value": 1e-3, "source": "assumed", "how": "by hand"},
        bytes_per_token=100,
        predicted_s=0.0,
    )


def test_prefill_chunks_flow_through_two_stages_by_hand():
    """A 35-token prompt in chunks of 10: F = 3 full chunks and a last of 5. A chunk's transfer
    is 1 + 10 x 0.1 = 2 ms, the last one's 1.5 ms. Rank 0's send is part of its chunk; rank 1
    sends only the last chunk back."""
    links = [_link("a", "b"), _link("b", "a")]
    # Rank 0 slower (0.1 s a chunk, 0.06 s the last; 0.36 s in all), rank 1 0.05 / 0.03 (0.18).
    # w = [0.102, 0.05], v = [0.0615, 0.0315]: rank 0 runs its four chunks and sends them
    # (3 x 0.102 + 0.0615 = 0.3675), rank 1 keeps up and ends with the last (+ 0.0315).
    assert flowing_ttft([0.1, 0.05], [0.36, 0.18], links, 35, 10) == pytest.approx(0.399)
    # Rank 1 slower: the first chunk through rank 0 (0.052), rank 1's three full chunks (0.3),
    # its last with the send back (0.0615).
    assert flowing_ttft([0.05, 0.1], [0.18, 0.36], links, 35, 10) == pytest.approx(0.4135)
    # Lock-step: 0.36 + 0.18 + 3 chunks x 2 links x 2 ms + 2 x 1.5 ms = 0.555.
    # One chunk of 8 tokens (1.8 ms a transfer) is lock-step exactly: 0.05 + 0.04 + 2 x 1.8 ms.
    one = flowing_ttft([0.05, 0.04], [0.05, 0.04], links, 8, 10)
    assert one == 0.05 + 0.04 + 2 * (1e-3 + 8 * 100 / 1e6) and one == pytest.approx(0.0936)


def test_a_decode_step_cut_into_micro_batches_by_hand(two_hosts):
    """Four sequences over links of 1 ms + 0.1 ms a row. Compute-bound stages, ``t_a(r) = 2 +
    10 r`` ms and ``t_b(r) = 3 + 20 r`` ms: lock-step 42 + 83 + 2 x 1.4 = 127.8 ms; two
    micro-batches of 2 (w = 22 + 1.2, 43 + 1.2 ms) 67.4 + 44.2 = 111.6 ms; four of 1 (w = 13.1,
    24.1 ms) 37.2 + 3 x 24.1 = 109.5 ms, which is more than 1% faster: four. Weight-bound
    stages (the same time for any rows) stay whole, as does a rank 0 that streams a unit."""
    request = Request(context=2048, concurrency=4, objective="throughput")
    batch = batch_limits(request)
    links = [_link("a", "b"), _link("b", "a")]

    def stages(a: float, b: float, pool: int = 0) -> list:
        out = []
        for s, t in zip(two_hosts.cluster.stages, (a, b), strict=True):
            pred = s.prediction.model_copy(update={"step_s": t})
            out.append(
                s.model_copy(update={"prediction": pred, "pool": Pool(slots=pool, slot_bytes=1)})
            )
        return out

    def compute(rows: int) -> list[float]:
        return [0.002 + 0.01 * rows, 0.003 + 0.02 * rows]

    pred, cpred, got = pipeline_prediction(stages(0.042, 0.083), links, request, batch, compute)
    assert cpred.micro_batches == 4 and cpred.step_s == pytest.approx(0.1095)
    assert pred.step_s == cpred.step_s and pred.decode_tok_s == pytest.approx(4 / 0.1095)
    assert cpred.binding == "host b"  # the slowest stage per micro-batch
    assert [lk.predicted_s for lk in got] == pytest.approx([4 * 0.0011] * 2)  # 4 sends of a row
    _, two, _ = pipeline_prediction(
        stages(0.042, 0.083), links, request, batch, lambda r: compute(max(r, 2))
    )
    assert two.micro_batches == 2 and two.step_s == pytest.approx(0.1116)  # four: no faster
    for args in (((0.05, 0.06), lambda r: [0.05, 0.06]), ((0.042, 0.083, 2), compute)):
        _, whole, _ = pipeline_prediction(stages(*args[0]), links, request, batch, args[1])
        lock = sum(args[0][:2]) + 2 * transfer_s(links[0], 4)
        assert whole.micro_batches == 1 and whole.step_s == pytest.approx(lock)


def test_compute_bound_plans_cut_decode_steps_weight_bound_ones_do_not(desc, tmp_path):
    """The dev CPU's decode costs per row (compute-bound): over two loopback hosts at 16
    sequences the plan cuts its steps, priced by the stages' own cost model at 16 / m sequences,
    and its judged view (explain) agrees. The same model on two M3 Ultras is bound by weight
    reads and per-operation costs: its steps stay whole."""
    request = Request(context=128, concurrency=16, objective="throughput")
    plan = build_cluster_plan("smollm2-135m", LOOPBACK, request, desc=desc)
    c = plan.cluster
    m = c.prediction.micro_batches
    lock = sum(s.prediction.step_s for s in c.stages) + sum(transfer_s(lk, 16) for lk in c.links)
    assert m > 1 and c.prediction.step_s < 0.9 * lock
    view = judge(plan).view.cluster.prediction
    assert view.micro_batches == m and view.step_s == pytest.approx(c.prediction.step_s)
    assert f"in {m} micro-batches of {16 // m} sequence" in explain(plan)
    ultra = str(ROOT / "profiles" / "m3-ultra-512gb.yaml")
    cluster = _cluster_file(tmp_path, [("a", ultra), ("b", ultra)], [("a", "b"), ("b", "a")])
    plan = build_cluster_plan("smollm2-135m", cluster, request, desc=desc)
    assert plan.cluster.prediction.micro_batches == 1


def test_a_rank_0_that_streams_prefills_lock_step(two_hosts):
    """Rank 0 streaming a unit from NVMe runs every pass's head and waits for it (executor's
    ``Pipeline.forward``): the plan's TTFT is then the stages' and every chunk's transfers."""
    c = two_hosts.cluster
    stages = [c.stages[0].model_copy(update={"pool": Pool(slots=2, slot_bytes=1)}), c.stages[1]]
    pred, _, _ = pipeline_prediction(stages, c.links, two_hosts.request, two_hosts.batch)
    hop = 22.5e-6 + 512 * 2304 / 1.87e9
    lock = sum(s.prediction.ttft_s[1] for s in c.stages) + 2 * 2 * hop
    assert pred.ttft_s[1] == pytest.approx(lock, rel=1e-6)
    assert lock > two_hosts.prediction.ttft_s[1]  # the plan's own rank 0 streams nothing: flows


def test_a_slow_link_binds(two_hosts):
    """A 10 kB/s link takes 0.23 s per row: the link binds, in the judged view of the plan."""
    c = two_hosts.cluster
    slow = [
        lk.model_copy(
            update={"bandwidth_bytes_s": lk.bandwidth_bytes_s.model_copy(update={"value": 1e4})}
        )
        for lk in c.links
    ]
    _, cpred, links = pipeline_prediction(c.stages, slow, two_hosts.request, two_hosts.batch)
    assert cpred.binding == "link a-b" and links[0].predicted_s == pytest.approx(22.5e-6 + 0.2304)
    edited_plan = two_hosts.model_copy(update={"cluster": c.model_copy(update={"links": slow})})
    judged = judge(edited_plan)
    assert judged.edited and judged.view.cluster.prediction.binding == "link a-b"
    assert "binding: link a-b" in explain(edited_plan)
    # diff names the link's change, not an unchanged split or memory.
    text = diff(two_hosts, edited_plan)
    assert "links: a → b 2.25 KiB/token over 1.74 GiB/s" in text
    assert "→ a → b 2.25 KiB/token over 9.77 KiB/s" in text
    assert "hosts:" not in text and "device memory:" not in text
    assert "binding: host " in text and "→ link a-b" in text


def test_a_unit_moved_to_another_host_is_named(two_hosts):
    """A hand edit that puts a block's unit on the other host: judge (explain, diff, check)
    names the unit and the fix rather than a stage's missing unit."""
    unit = f"blk.{two_hosts.cluster.stages[1].first_block}.ffn"
    placement = [
        p.model_copy(update={"host": "a"}) if p.unit == unit else p for p in two_hosts.placement
    ]
    moved = two_hosts.model_copy(update={"placement": placement})
    with pytest.raises(
        PlanError, match=f"placement of {unit} is on a, but its block is in stage b"
    ):
        judge(moved)


def test_a_written_plan_is_its_own_judgement(two_hosts):
    judged = judge(two_hosts)
    assert not edited(two_hosts) and not judged.edited
    assert judged.view.prediction.step_s == pytest.approx(two_hosts.prediction.step_s, rel=1e-6)
    for a, b in zip(judged.view.cluster.stages, two_hosts.cluster.stages, strict=True):
        assert a.memory == b.memory
    # Moving a block to the other host is an edit of the decisions.
    stages = two_hosts.cluster.stages
    moved = [
        stages[0].model_copy(update={"end_block": stages[0].end_block - 1}),
        stages[1].model_copy(update={"first_block": stages[1].first_block - 1}),
    ]
    other = two_hosts.model_copy(
        update={"cluster": two_hosts.cluster.model_copy(update={"stages": moved})}
    )
    assert edited(other)


def test_one_host_cluster_places_as_the_plain_plan(desc, one_host, tmp_path):
    path = _cluster_file(tmp_path, [("solo", str(DEV_PROFILE))], [])
    plan = build_cluster_plan(None, path, REQUEST, desc=desc)
    assert [(p.unit, p.tier) for p in plan.placement] == [
        (p.unit, p.tier) for p in one_host.placement
    ]
    assert {p.host for p in plan.placement} == {"solo"} and plan.cluster.links == []
    assert plan.prediction.step_s == pytest.approx(one_host.prediction.step_s, rel=1e-9)
    assert plan.cluster.prediction.binding == "host solo"


def test_no_split_fits_names_the_short_host_and_the_fix(desc, tmp_path):
    path = _cluster_file(
        tmp_path,
        [("a", str(DEV_PROFILE)), ("b", str(DEV_PROFILE))],
        [("a", "b")],
        gpu_budget_bytes="40MiB",
        ram_budget_bytes="40MiB",
    )
    with pytest.raises(PlanError) as e:
        build_cluster_plan(None, path, REQUEST, desc=desc)
    text = str(e.value)
    assert "\n" not in text and "cluster test: no split of the 30 blocks over a, b fits" in text
    assert "short by" in text and "gpu_budget_bytes" in text and "add a host" in text


def test_candidate_splits():
    assert candidate_splits(3, 2) == [[(0, 1), (1, 3)], [(0, 2), (2, 3)]]
    with pytest.raises(PlanError, match="3 blocks and the cluster 4 hosts"):
        candidate_splits(3, 4)
    with pytest.raises(PlanError, match="list fewer hosts"):
        candidate_splits(400, 4)


@pytest.mark.parametrize(
    "hosts, links, words",
    [
        ([("a", "P"), ("b", "P")], [("a", "c")], ["names host c", "not in hosts"]),
        (
            [("a", "P"), ("b", "P"), ("c", "P")],
            [("a", "b"), ("b", "c")],
            ["no link between c and a"],
        ),
        ([("a", "P"), ("a", "P")], [], ["host a is named twice"]),
        ([("a", "P"), ("b", "missing.yaml")], [("a", "b")], ["host b's profile"]),
    ],
    ids=["unknown-host-in-link", "missing-link", "duplicate-host", "bad-profile-path"],
)
def test_bad_cluster_files_are_one_line_errors(tmp_path, hosts, links, words):
    hosts = [(n, str(DEV_PROFILE) if p == "P" else p) for n, p in hosts]
    path = _cluster_file(tmp_path, hosts, links)
    with pytest.raises(SchemaError) as e:
        build_cluster_plan("smollm2-135m", path, REQUEST)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_explain_shows_hosts_links_and_binding(two_hosts):
    text = explain(two_hosts)
    s0, s1 = two_hosts.cluster.stages
    assert f"0 a (127.0.0.1, dev-linux-cpu, cpu): blk 0–{s0.end_block - 1} + embedding" in text
    assert f"1 b (127.0.0.1, dev-linux-cpu, cpu): blk {s1.first_block}–29" in text
    assert "a → b: 2.25 KiB per token" in text and "b → a: 2.25 KiB per token" in text
    assert f"binding: {two_hosts.cluster.prediction.binding}" in text
    assert "== host a (rank 0" in text and "== host b (rank 1" in text


def test_diff_of_one_host_and_two_hosts_shows_the_split_and_links(one_host, two_hosts):
    text = diff(one_host, two_hosts)
    s0, s1 = two_hosts.cluster.stages
    assert "hosts: one host (dev-linux-cpu) → 2 hosts over ring" in text
    assert f"blk {s1.first_block}–29: the one host → b" in text
    assert f"blk 0–{s0.end_block - 1}, token_embd, output: the one host → a" in text
    assert "links: none (one host) → a → b 2.25 KiB/token over 1.74 GiB/s" in text
    assert "device memory: the one host gpu" in text
    assert len(text.splitlines()) < 40, text


@pytest.mark.slow  # the real model: plan.py describes and check hashes it
def test_cli_plan_cluster_and_check_says_rank_0(tmp_path):
    out = tmp_path / "plan.yaml"
    done = cli(
        "plan.py", "plan", "--cluster", str(LOOPBACK), "--model", "smollm2-135m",
        "--context", "2048", "-o", str(out),
    )  # fmt: skip
    assert "2 hosts (a blk 0–" in done.stderr and "binding host" in done.stderr
    check = cli("plan.py", "check", str(out)).stdout
    assert "rank 0's stage (host a, blocks 0–" in check and "(b) are not checked here" in check
    both = cli("plan.py", "plan", "--cluster", str(LOOPBACK), "--profile", str(DEV_PROFILE),
               "--model", "smollm2-135m", "-o", str(out), ok=False)  # fmt: skip
    assert_one_line_error(both, "exactly one of --profile FILE and --cluster FILE")
    spec = cli("plan.py", "plan", "--cluster", str(LOOPBACK), "--model", "smollm2-135m",
               "--speculative", "prompt_lookup", "-o", str(out), ok=False)  # fmt: skip
    assert_one_line_error(spec, "--cluster plans take no --speculative")
    # New-user trial: a one-host budget with --cluster was accepted and ignored.
    budget = cli("plan.py", "plan", "--cluster", str(LOOPBACK), "--model", "smollm2-135m",
                 "--gpu-budget", "1MiB", "-o", str(out), ok=False)  # fmt: skip
    assert_one_line_error(budget, "a cluster's budgets are per host")


def test_three_hosts_cut_the_blocks_in_three_and_close_the_ring(desc, tmp_path):
    hosts = [(n, str(DEV_PROFILE)) for n in "abc"]
    path = _cluster_file(
        tmp_path, hosts, [("a", "b"), ("b", "c"), ("c", "a")], gpu_budget_bytes="80MiB",
        ram_budget_bytes="80MiB",
    )  # fmt: skip
    plan = build_cluster_plan(None, path, REQUEST, desc=desc)
    stages = plan.cluster.stages
    assert [s.host for s in stages] == ["a", "b", "c"] and stages[-1].end_block == 30
    assert [lk.hosts for lk in plan.cluster.links] == [["a", "b"], ["b", "c"], ["c", "a"]]
    check_cluster_placement(plan)
    # The same inputs, the same plan.
    assert build_cluster_plan(None, path, REQUEST, desc=desc) == plan


def test_a_backend_the_hosts_cannot_run_is_refused(desc, tmp_path):
    path = _cluster_file(
        tmp_path, [("a", str(DEV_PROFILE)), ("b", str(DEV_PROFILE))], [("a", "b")], backend="jaccl"
    )
    with pytest.raises(PlanError, match="jaccl backend joins metal hosts, and host a's profile is"):
        build_cluster_plan(None, path, REQUEST, desc=desc)


def test_a_hybrid_stage_holds_its_own_blocks_kv_and_recurrent_state(tmp_path):
    """Qwen3-Coder-Next (every fourth block attention, the others gated delta-net) over two
    hosts: each stage's KV cache and recurrent state are its own blocks' share of the whole
    model's, the judged plan agrees, and explain counts the stage's blocks, not the model's."""
    hybrid = describe_arch(ROOT / "profiles" / "arch" / "qwen3-coder-next-80b-a3b.yaml", "Q4_K_M")
    m3 = ROOT / "profiles" / "m3-max-48gb.yaml"
    profile = read_yaml(m3, HardwareProfile)
    path = _cluster_file(tmp_path, [("a", str(m3)), ("b", str(m3))], [("a", "b")])
    request = Request(context=4096)
    plan = build_cluster_plan(None, path, request, desc=hybrid)
    arch = hybrid.architecture
    recurrent = set(arch.recurrent_layers)
    limits = batch_limits(request)
    kv_all = kv_cache_bytes(hybrid, profile, limits)
    state_all = recurrent_state_bytes(hybrid, limits)
    text = explain(plan)
    for s, judged in zip(plan.cluster.stages, judge(plan).view.cluster.stages, strict=True):
        blocks = set(range(s.first_block, s.end_block))
        rec, attn = len(blocks & recurrent), len(blocks - recurrent)
        assert 0 < rec and 0 < attn
        gpu = s.memory["gpu"]
        assert gpu.kv_cache == kv_all * attn // (arch.block_count - len(recurrent))
        assert gpu.recurrent_state == state_all * rec // len(recurrent)
        assert judged.memory == s.memory
        assert f"state of the {rec} gated delta-net blocks" in text
        assert f"the KV cache is the {attn} attention blocks'" in text


@pytest.mark.parametrize(
    "edit, words",
    [
        ("drop-link", "links are not its stage boundaries in order (a → b, b → a)"),
        ("short-stages", "the stages end at block 29 and the model has 30"),
        ("empty-stage", "stage b holds no block"),
    ],
)
def test_hand_edited_stages_and_links_are_named(two_hosts, edit, words):
    """judge (explain, diff, check, the executor's load) refuses a cluster section that the
    pipeline cannot run, in one line naming it and the fix."""
    c = two_hosts.cluster
    s0, s1 = c.stages
    if edit == "drop-link":
        c = c.model_copy(update={"links": c.links[:1]})
    elif edit == "short-stages":
        c = c.model_copy(update={"stages": [s0, s1.model_copy(update={"end_block": 29})]})
    else:
        empty = s1.model_copy(update={"first_block": s0.end_block, "end_block": s0.end_block})
        c = c.model_copy(update={"stages": [s0, empty]})
    with pytest.raises(PlanError) as e:
        judge(two_hosts.model_copy(update={"cluster": c}))
    assert words in str(e.value) and "re-run strata plan --cluster" in str(e.value)
    assert "\n" not in str(e.value)
