"""Cluster plans run over MLX's ring backend: two (and three) loopback "hosts" as processes on this
machine (issue 39). Greedy ids through ``run`` (a prompt's chunks flowing, and lock-step) and
``serve`` (two requests at once, a prefix-cache hit) are the one-host plan's, also for a
mixture-of-experts model whose experts stream from NVMe on rank 1, for a rank started by hand
(attach mode), and for concurrent requests whose decode steps flow as micro-batches; a rank killed
mid-request ends the request with an error naming it within seconds, the other ranks exit and
nothing is left behind; rank 0 waits for a missing rank only so long; the step descriptor rebuilds
rank 0's layout; ``strata profile --link`` measures loopback over the ring."""

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
def four(tmp_path_factory) -> Path:
    """The loopback cluster's plan of SmolLM2 for four sequences at once (each host's KV cache
    as large as the two-host plan's: 4 x 512 tokens)."""
    out = tmp_path_factory.mktemp("four") / "four.yaml"
    argv = ["--context", "512", "--concurrency", "4", "--objective", "throughput"]
    plan = ["plan", "--cluster", str(LOOPBACK), "--model", "smollm2-135m", *argv]
    assert strata_main([*plan, "-o", str(out)]) == 0
    return out


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
    assert flowing["stats"]["passes_micro_batched"] == 0  # one sequence: no step is cut


@pytest.mark.slow
def test_micro_batched_decode_gives_the_one_host_ids(plans, four, one_host_ids, tmp_path):
    """Four requests at once over a plan of four sequences: their decode steps whole and cut
    into two micro-batches (``benchmarks/cluster_decode.py``, one process tree, the ways
    switched between rounds) give every request the one-host plan's ids; the cut steps ran as
    micro-batched passes; ``STRATA_DECODE_MICRO_BATCHES`` sets the pipeline's at start."""
    one, _ = plans
    prompts = [PROMPT_A, PROMPT_B, [1, *range(700, 740)], [504, 3575, 282, 4649, 314, 260]]
    want = [one_host_ids.get(tuple(p)) or _run(one, p)["output_ids"] for p in prompts]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cluster_decode.py"), str(four)]
        + ["--micro-batches", "1,2", "--rounds", "1", "--max-tokens", str(DECODE)]
        + ["--prompt-ids", ";".join(",".join(map(str, p)) for p in prompts), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STRATA_DECODE_MICRO_BATCHES": "3"},
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["check_passed"] and got["output_ids"] == want
    assert got["micro_batched_passes"]["1"] == [0] and got["micro_batched_passes"]["2"][0] > 0
    assert got["started_micro_batches"] == 3


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
def test_a_rank_killed_during_micro_batched_decode_ends_every_request(four, tmp_path):
    """Four streams whose decode steps go as two micro-batches (several passes out at once):
    rank 1 killed, every stream ends with the error naming it within seconds, nothing hangs."""
    env = {"STRATA_DECODE_MICRO_BATCHES": "2"}
    with serve_process(four, tmp_path / "serve.log", key=(), env=env) as srv:
        rank = _ranks(srv.proc.pid)[0]
        left = _children(srv.proc.pid)
        errors: list[str] = []
        ended: list[float] = []

        def stream(prompt: list[int]) -> None:
            body = {"prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        errors.append(json.loads(line[6:])["error"]["message"])
            ended.append(time.monotonic())

        prompts = [PROMPT_B, [1, *range(700, 720)], [1, *range(800, 820)], [504, 3575, 282]]
        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while "micro_batched_total 0" in httpx.get(f"{srv.url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "no decode step was cut"
            time.sleep(0.2)
        rank.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        assert len(ended) == 4 and max(ended) - t0 < GONE_S, [e - t0 for e in ended]
        assert len(errors) == 4 and all("rank 1 (host b at 127.0.0.1)" in e for e in errors)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
    assert _all_gone(left)


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


@pytest.mark.parametrize("tile", [0, 4])
def test_a_decode_step_is_cut_into_micro_batches_of_its_rows(tile):
    """Five decodes in two micro-batches: rows 0-2 and 3-4, each laid out as the step lays
    those rows out (slots, positions, KV writes, tile) with the step's device ids (a pipelined
    step's sampled one included); a step with a prefill chunk, or of one sequence, goes whole."""
    import mlx.core as mx
    import numpy as np
    from strata.common.errors import StrataError
    from strata.executor.paged_kv import ForwardBatch, SeqInput
    from strata.executor.pipeline import Pipeline

    slots = np.arange(100, dtype=np.int32)[::-1].copy()
    inputs = [SeqInput([5 + i], 3 + i, slots[10 * i : 10 * i + 4 + i]) for i in range(5)]
    step = ForwardBatch.build(inputs, tile=tile)
    step.take_ids(np.array([1]), mx.array([99], dtype=mx.int32))  # a pipelined step's token
    parts = Pipeline(None, [], micro_batches=2).cut(step)
    assert [p.num_tokens for p in parts] == [3, 2] and all(p.tile == tile for p in parts)

    def joined(f) -> list:
        return np.concatenate([np.asarray(f(p)) for p in parts]).tolist()

    assert joined(lambda p: p.id_array) == [5, 99, 7, 8, 9]
    assert joined(lambda p: p.write_slots) == np.asarray(step.write_slots).tolist()
    assert joined(lambda p: p.row_positions) == step.row_positions.tolist()
    assert [list(t) for p in parts for t in p.seq_slots] == [list(t) for t in step.seq_slots]
    assert len(Pipeline(None, [], micro_batches=8).cut(step)) == 5
    prefill = ForwardBatch.build([*inputs, SeqInput([1, 2], 0, slots[60:62])], tile=tile)
    assert Pipeline(None, [], micro_batches=2).cut(prefill) == [prefill]
    one = ForwardBatch.build(inputs[:1], tile=tile)
    assert Pipeline(None, [], micro_batches=2).cut(one) == [one]
    with pytest.raises(StrataError, match="micro_batches is 0"):
        Pipeline(None, [], micro_batches=0)


_CROSSING = """
import sys
import mlx.core as mx
from strata.executor.pipeline import Peer, Ring

ring = Ring(mx.distributed.init(backend="ring", strict=True), lambda r: Peer(r, "h", "a"))
n = 16 * 1024 * 1024  # 64 MiB of float32 a message: far more than any socket buffer holds
if ring.rank == 0:  # two micro-batches out before either comes back
    ring.send(mx.full((n,), 1.0), 1)
    ring.send(mx.full((n,), 2.0), 1)
    got = [float(ring.recv((n,), mx.float32, 1)[k]) for k in (0, -1)]
    ring.send(mx.zeros((1,)), 1)  # done
    print(got)
else:  # the last rank: each back to rank 0 while rank 0 is still sending
    for _ in range(2):
        ring.post(ring.recv((n,), mx.float32, 0) * 10, 0)
    ring.recv((1,), mx.float32, 0)
"""


def test_sends_back_to_rank_0_never_wait_so_crossing_messages_pass(tmp_path):
    """Rank 0 sends two 64 MiB messages before it receives; the last rank sends each back as it
    comes. With MLX's ring send, which waits until its socket took every byte, both ranks would
    wait in their sends forever (tried: both still there after 40 s); the last rank's
    ``Ring.post`` never waits, so both messages come back (``executor.pipeline``, "Why it
    cannot deadlock")."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    script = tmp_path / "crossing.py"
    script.write_text(_CROSSING)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0].strip() == "[10.0, 20.0]"


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
