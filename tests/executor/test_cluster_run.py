"""Cluster plans run over MLX's ring backend: two (and three) loopback "hosts" as processes on
this machine (issue 39). Greedy ids through ``run`` (a prompt's chunks flowing, and lock-step)
and ``serve`` (two requests at once, a prefix-cache hit) are the one-host plan's, also for a
mixture-of-experts model whose experts stream from NVMe on rank 1, and for a rank started by
hand (attach mode); a rank killed mid-request ends the request with an error naming it within
seconds, the other ranks exit and nothing is left behind; rank 0 waits for a missing rank only so
long; the step descriptor rebuilds rank 0's layout; ``strata profile --link`` measures loopback
over the ring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import DEV_PROFILE, ROOT, make_plan_file
from gguf_factory import write_arch_model
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml, write_yaml
from test_server import serve_process

from strata.cli import main as strata_main

LOOPBACK = ROOT / "profiles" / "clusters" / "loopback-2.yaml"
PROMPT_A = [1, *range(400, 479)]  # 80 tokens: two prefill chunks on the CPU (64 each at most)
PROMPT_B = [504, 3575, 282, 4649, 314]  # "The capital of France is": no end of text soon
DECODE = 8
GONE_S = 10
"""Seconds a killed rank's request, or rank 0, has to end: a few seconds (the ring raises within
one, rank 0 waits up to ``ranks.DEATH_WAIT_S`` to name the rank), with room for a shared 2-core
CI machine; a hang meets the tests' own timeouts instead."""


def _plan_cluster(model: str, cluster: Path, out: Path, context: int) -> Path:
    """``strata plan --cluster`` (the planner's code, in this process)."""
    argv = ["plan", "--cluster", str(cluster), "--model", model, "--context", str(context)]
    assert strata_main([*argv, "-o", str(out)]) == 0
    return out


def _run(plan: Path, prompt: list[int], *extra: str, env: dict | None = None):
    """``strata run PLAN --prompt-ids ... --json`` as a process: (its process, its JSON)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "run",
            str(plan),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            str(DECODE),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _ranks(pid: int) -> list[psutil.Process]:
    """The rank processes (``strata rank``) a process started."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if "rank" in k.cmdline()]


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple[Path, Path]:
    """(one-host plan, two-host loopback plan) of SmolLM2 at the cluster file's context."""
    d = tmp_path_factory.mktemp("cluster")
    one = make_plan_file("smollm2-135m", d / "one.yaml", context=2048)
    two = _plan_cluster("smollm2-135m", LOOPBACK, d / "two.yaml", 2048)
    return one, two


@pytest.fixture(scope="module")
def one_host_ids(plans) -> dict[tuple[int, ...], list[int]]:
    """The one-host plan's greedy ids of each prompt, through ``run`` (run once per module)."""
    one, _ = plans
    return {tuple(p): _run(one, p)["output_ids"] for p in (PROMPT_A, PROMPT_B)}


def _children(pid: int) -> list[psutil.Process]:
    """Every process ``pid`` started (its ranks, the chat template's worker), recursively."""
    return psutil.Process(pid).children(recursive=True)


def _all_gone(procs: list[psutil.Process]) -> bool:
    """Whether every process of ``procs`` exits within 10 s (none left behind)."""
    return not psutil.wait_procs(procs, timeout=10)[1]


@pytest.mark.slow
def test_run_gives_the_one_host_ids(plans, one_host_ids):
    _, two = plans
    plan = read_yaml(two, Plan)
    stages = plan.cluster.stages
    assert [s.host for s in stages] == ["a", "b"] and stages[0].first_block == 0
    assert any(p.tier == "nvme" and p.host == "b" for p in plan.placement)  # rank 1 streams
    want = one_host_ids[tuple(PROMPT_A)]
    flowing = _run(two, PROMPT_A)
    assert flowing["output_ids"] == want and len(want) == DECODE
    # The prompt's chunks before its last flowed through the ranks without coming back to rank
    # 0 (executor.pipeline); with the switch off every pass is lock-step, the ids the same.
    chunks = -(-len(PROMPT_A) // flowing["stats"]["prefill_chunk"])
    assert chunks >= 2 and flowing["stats"]["passes_flowed"] == chunks - 1
    lockstep = _run(two, PROMPT_A, env={"STRATA_PIPELINE_FLOW": "0"})
    assert lockstep["output_ids"] == want and lockstep["stats"]["passes_flowed"] == 0


@pytest.mark.slow
def test_serve_gives_the_one_host_ids(plans, one_host_ids, tmp_path):
    _, two = plans
    want = one_host_ids
    with serve_process(two, tmp_path / "serve.log", key=()) as srv:
        assert len(_ranks(srv.proc.pid)) == 1
        got: dict[tuple, list[int]] = {}

        def ask(prompt: list[int]) -> None:
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": DECODE,
                    "temperature": 0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text
            got[tuple(prompt)] = _ids(r.json())

        threads = [threading.Thread(target=ask, args=(p,)) for p in (PROMPT_A, PROMPT_B)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == want
        ask(PROMPT_A)  # again: its prompt's blocks come from the prefix cache on every rank
        assert got[tuple(PROMPT_A)] == want[tuple(PROMPT_A)]
        rank = _ranks(srv.proc.pid)
    assert rank and not rank[0].is_running()  # stopped with the server


def _ids(body: dict) -> list[int]:
    """The generated ids of a completion asked with ``return_tokens_as_token_ids``."""
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.slow
def test_moe_with_experts_on_nvme_on_rank_1(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))  # its pack: built here
    gguf = write_arch_model(tmp_path / "mixtral.gguf", "mixtral", smollm2_gguf)
    one = make_plan_file(str(gguf), tmp_path / "one.yaml", context=64)
    cluster = tmp_path / "two-hosts.yaml"
    cluster.write_text(
        "name: two\nhosts:\n"
        + "".join(f"  - {{name: {h}, address: 127.0.0.1, profile: {DEV_PROFILE}}}\n" for h in "ab")
        + "links:\n  - hosts: [a, b]\n"
        "    bandwidth_bytes_s: {value: 4000000000, source: assumed, how: loopback}\n"
        "    latency_s: {value: 0.000025, source: assumed, how: loopback}\n"
    )
    two = _plan_cluster(str(gguf), cluster, tmp_path / "two.yaml", 64)
    plan = read_yaml(two, Plan)
    streamed = [p for p in plan.placement if p.host == "b" and ".expert." in p.unit]
    assert streamed and plan.cluster.stages[1].first_block > 0
    for p in streamed:  # rank 1's experts stream through its expert cache
        p.tier = "nvme"
    stage = plan.cluster.stages[1]
    stage.expert_cache.slots, stage.expert_cache.pinned = 3, []
    write_yaml(plan, two)
    packs = tmp_path / "cache" / "packs"  # what a rank streaming from NVMe reads
    want = _run(one, PROMPT_B)
    assert not list(packs.glob("*.pack"))  # the one-host plan holds every unit
    got = _run(two, PROMPT_B)
    assert got["output_ids"] == want["output_ids"] and len(want["output_ids"]) == DECODE
    assert got["stats"]["bytes_read"]["nvme"] == 0  # rank 0 streamed nothing
    assert list(packs.glob("*.pack"))  # rank 1 did


@pytest.mark.slow
def test_a_rank_killed_mid_request_ends_it(plans, tmp_path):
    _, two = plans
    log = tmp_path / "serve.log"
    with serve_process(two, log, key=()) as srv:
        rank = _ranks(srv.proc.pid)[0]
        left = _children(srv.proc.pid)
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            json={
                "prompt": PROMPT_B,
                "max_tokens": 400,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=60,
        ) as r:
            lines = r.iter_lines()
            while "text" not in next(lines):  # the first token: the request is running
                pass
            rank.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            rest = list(lines)
        took = time.monotonic() - t0
        assert took < GONE_S, took
        error = next(json.loads(x[6:]) for x in rest if x.startswith("data: {") and "error" in x)
        assert "rank 1 (host b at 127.0.0.1)" in error["error"]["message"], error
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
        again = httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": PROMPT_B, "max_tokens": 2}, timeout=10
        )
        assert again.status_code == 503 and "rank 1" in again.text
        assert not _ranks(srv.proc.pid)  # the killed rank was reaped while the server runs
    assert _all_gone(left)  # nothing left behind


@pytest.mark.slow
def test_run_ends_with_the_rank_that_died(plans):
    _, two = plans
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata",
            "run",
            str(two),
            "--prompt-ids",
            ",".join(map(str, PROMPT_B)),
            "--max-tokens",
            "1000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.read(1)  # the first piece of text: decoding
        left = _children(proc.pid)
        _ranks(proc.pid)[0].kill()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < GONE_S
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "rank 1 (host b at 127.0.0.1)" in last, err
    assert "Traceback" not in err
    assert _all_gone(left)


@pytest.mark.parametrize("tile", [0, 4])
def test_a_step_descriptor_rebuilds_the_same_layout(tile):
    import numpy as np
    from strata.executor.paged_kv import ForwardBatch, SeqInput
    from strata.executor.pipeline import HEADER, decode_step, encode_step

    slots = np.arange(40, dtype=np.int32)[::-1].copy()
    inputs = [
        SeqInput([5], 6, slots[:7]),  # a decode
        SeqInput([1, 2, 3], 9, slots[10:22], "all", one_per_piece=True),  # a verification
        SeqInput([7] * 10, 0, slots[20:30], "none"),  # a prefill chunk
        SeqInput([9], 0, slots[35:36]),  # a one-token prompt
    ]
    sent = ForwardBatch.build(inputs, tile=tile)
    msg = encode_step(sent, 16)
    assert msg[2] == 16 and msg[3] == tile and msg[5] == len(inputs) and msg[6] == 1
    assert encode_step(sent, 16, back=False)[6] == 0  # a flowing pass: not sent back
    got = decode_step(msg[HEADER:], len(inputs), tile)
    assert got.num_tokens == sent.num_tokens and got.decode_rows == sent.decode_rows
    assert np.array_equal(np.array(got.write_slots), np.array(sent.write_slots))
    assert np.array_equal(got.decode_slots, sent.decode_slots)
    assert np.array_equal(got.row_positions, sent.row_positions)
    assert np.array_equal(got.row_inputs, sent.row_inputs)
    assert [(c.row, c.length, c.start, list(c.slots)) for c in got.chunks] == [
        (c.row, c.length, c.start, list(c.slots)) for c in sent.chunks
    ]


def _announcing(port: int, rank: int, identity: str = "") -> tuple[threading.Thread, list]:
    """A thread announcing ``rank`` to a rendezvous on ``port``; its outcome in the list."""
    from strata.executor.ranks import announce

    out: list = []

    def run() -> None:
        try:
            out.append(announce(f"127.0.0.1:{port}", rank, timeout=10, identity=identity))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_rank_0_waits_for_a_missing_rank_only_so_long():
    from strata.common.errors import StrataError
    from strata.executor.ranks import Rendezvous

    meet = Rendezvous("127.0.0.1")
    try:
        t, out = _announcing(meet.port, 2)  # rank 2 is ready; rank 1 never comes
        t0 = time.monotonic()
        with pytest.raises(StrataError) as e:
            meet.wait({1, 2}, 1.0, lambda missing: f"ranks {sorted(missing)}")
        assert time.monotonic() - t0 < 5
    finally:
        meet.close()
    assert str(e.value) == (
        "the cluster's ranks did not all start within 1 s; still waiting for ranks [1]"
    )
    t.join(10)  # rank 2 is told rank 0 stopped rather than left to join a ring forever
    assert isinstance(out[0], StrataError) and "stopped before the ring formed" in str(out[0])


def test_a_rank_with_another_plan_is_refused_on_both_sides():
    """New-user trial: a rank started by hand with another plan (its stages cut elsewhere) was
    let in and the answer was garbage with status 0; each rank names the plan it loaded
    (``ranks.plan_identity``) and rank 0 refuses a different one, the rank hearing why."""
    from strata.common.errors import StrataError
    from strata.executor.ranks import Rendezvous

    meet = Rendezvous("127.0.0.1")
    try:
        t, out = _announcing(meet.port, 1, identity="b" * 64)
        with pytest.raises(StrataError, match="rank 1 runs another plan than this one"):
            meet.wait({1}, 10.0, str, identity="a" * 64)
    finally:
        meet.close()
    t.join(10)
    assert isinstance(out[0], StrataError) and "runs another plan" in str(out[0])
    meet = Rendezvous("127.0.0.1")  # the same plan: let in, told to join
    try:
        t, out = _announcing(meet.port, 1, identity="a" * 64)
        meet.wait({1}, 10.0, str, identity="a" * 64)
        t.join(10)
        assert not isinstance(out[0], Exception)
        out[0].close()
    finally:
        meet.close()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.2 is loopback on Linux")
def test_a_rank_started_by_hand_attaches(plans, one_host_ids, tmp_path):
    import shlex

    _, two = plans
    plan = read_yaml(two, Plan)
    plan.cluster.stages[1].address = "127.0.0.2"  # not this host's name: attach mode
    attach = tmp_path / "attach.yaml"
    write_yaml(plan, attach)
    rank0 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata",
            "run",
            str(attach),
            "--prompt-ids",
            ",".join(map(str, PROMPT_B)),
            "--max-tokens",
            str(DECODE),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rank1 = None
    try:
        for line in rank0.stderr:
            if "there: python " in line:
                break
        assert "start rank 1 (host b at 127.0.0.2) there: " in line, line
        cmd = shlex.split(line.split("there: python ", 1)[1].split(" (with the plan")[0])
        assert cmd[:3] == ["-m", "strata", "rank"], cmd
        rank1 = subprocess.Popen(  # elsewhere than the repository, as on another host
            [sys.executable, *cmd], stderr=subprocess.DEVNULL, cwd=tmp_path
        )
        out, err = rank0.communicate(timeout=120)
        assert rank0.returncode == 0, err
        assert rank1.wait(timeout=30) == 0
    finally:
        for p in (rank0, rank1):
            if p is not None and p.poll() is None:
                p.kill()
    assert json.loads(out.splitlines()[-1])["output_ids"] == one_host_ids[tuple(PROMPT_B)]


@pytest.mark.slow
def test_profile_link_measures_loopback_over_the_ring(tmp_path):
    import yaml
    from strata.common.schemas import ClusterLink

    out = tmp_path / "link.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "profile",
            "--link",
            "127.0.0.1",
            "--link-names",
            "a,b",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (entry,) = yaml.safe_load(out.read_text())["links"]
    link = ClusterLink.model_validate(entry)
    assert link.hosts == ["a", "b"]
    for f in (link.bandwidth_bytes_s, link.latency_s):
        assert f.source == "measured" and f.samples == 7 and "ring backend" in f.how
    assert 1e7 < link.bandwidth_bytes_s.value and 0 < link.latency_s.value < 0.05


@pytest.mark.slow
def test_three_ranks_and_the_middle_one_dies(tmp_path):
    """Rank 1 forwards each step's descriptor to rank 2; killed, it is the rank named, though
    rank 0 sees the failure on its link from rank 2, and rank 2 exits too."""
    budget = 80_000_000  # each host holds about a third of SmolLM2 at this context
    link = "bandwidth_bytes_s: {value: 1870000000, source: assumed, how: loopback}, "
    link += "latency_s: {value: 0.0000225, source: assumed, how: loopback}"
    cluster = tmp_path / "three.yaml"
    cluster.write_text(
        "name: three\nhosts:\n"
        + "".join(
            f"  - {{name: {h}, address: 127.0.0.1, profile: {DEV_PROFILE}, "
            f"gpu_budget_bytes: {budget}, ram_budget_bytes: {budget}}}\n"
            for h in "abc"
        )
        + "links:\n"
        + "".join(f"  - {{hosts: [{a}, {b}], {link}}}\n" for a, b in ("ab", "bc", "ca"))
    )
    three = _plan_cluster("smollm2-135m", cluster, tmp_path / "three-plan.yaml", 512)
    assert len(read_yaml(three, Plan).cluster.stages) == 3
    one = make_plan_file("smollm2-135m", tmp_path / "one.yaml", context=512)
    got = _run(three, PROMPT_A)  # its first chunk flows through rank 1 to rank 2
    assert got["output_ids"] == _run(one, PROMPT_A)["output_ids"]
    assert got["stats"]["passes_flowed"] == 1

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata",
            "run",
            str(three),
            "--prompt-ids",
            ",".join(map(str, PROMPT_B)),
            "--max-tokens",
            "400",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.read(1)
        ranks = {r.cmdline()[r.cmdline().index("--rank") + 1]: r for r in _ranks(proc.pid)}
        assert sorted(ranks) == ["1", "2"]
        ranks["1"].kill()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "the cluster stopped: rank 1 (host b at 127.0.0.1) was killed" in err, err
    ranks["2"].wait(timeout=10)  # gone too
