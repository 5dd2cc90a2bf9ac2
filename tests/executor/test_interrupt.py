"""Ctrl-C stops the engine promptly: a pass evaluated in pieces stops between blocks, an abort
frees the engine for the next request, and ``strata run``, ``bench`` and ``serve`` (real
subprocesses on SmolLM2 with a 300-token prompt) exit within about a second of the signal even
in the middle of a prefill, ``run --json`` with its partial result.

When to signal: a child is in its prefill once it has used ``PREFILL_CPU_S`` seconds of CPU
(read from ``/proc``, so a busy machine only makes the wait longer, never the signal early):
loading takes 1 to 3 s of CPU and SmolLM2's 300-token prefill about 20 s on the dev CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
"""300 tokens for SmolLM2 (with its BOS rule): a prefill of about 20 s on the dev CPU."""

PREFILL_CPU_S = 5.0
"""CPU seconds after which a child started on ``PROMPT`` is in its prefill (module docstring)."""

EXIT_WITHIN_S = 2.0
"""Most seconds from the signal to the exit: the target is 1 s (about 0.2 s measured on the dev
CPU); the rest is slack for a loaded machine. Waiting for the prefill would take over 10 s."""

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads a child's CPU time from /proc"
)

cpu_only = pytest.mark.skipif(
    mx.default_device().type != mx.cpu,
    reason="times a prefill in the CPU's 64-token chunks (a GPU's chunk is the whole prompt)",
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_cpu(proc: subprocess.Popen, seconds: float, timeout: float = 300) -> None:
    """Wait until ``proc`` has used ``seconds`` of CPU; fail if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while cpu_seconds(proc.pid) < seconds:
        if proc.poll() is not None:
            pytest.fail(f"the process exited ({proc.returncode}) before it was signalled")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the process did not use {seconds} s of CPU in {timeout} s")
        time.sleep(0.05)


def strata(*args: str, **kwargs) -> subprocess.Popen:
    """``strata ARGS`` with Ctrl-C handled as in a terminal, whatever this process inherited (a
    shell's background job starts with SIGINT ignored, and its children keep that)."""
    return subprocess.Popen(
        [sys.executable, "-m", "strata", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def interrupt(proc: subprocess.Popen) -> tuple[float, str, str]:
    """SIGINT ``proc``; seconds until it exited, its stdout and stderr."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return time.monotonic() - t0, out, err


def assert_interrupted(err: str) -> None:
    """No traceback; the last line of stderr is the one ``interrupted`` line."""
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err


# ------------------------------------------------------------------ in process


def test_pass_in_pieces_equals_the_whole_pass(smollm2_engine):
    """A pass evaluated block by block gives the whole pass's logits bit for bit; the callable
    is asked between blocks, and True stops the pass (its later blocks never built)."""
    from strata.executor.paged_kv import ForwardBatch
    from strata.executor.runner import INTERRUPTIBLE_MIN_ROWS, PassInterrupted, forward

    model = smollm2_engine.model
    ids = smollm2_engine.tokenizer.encode(PROMPT)[:12]
    assert len(ids) >= INTERRUPTIBLE_MIN_ROWS

    def run(stop=None) -> np.ndarray:
        cache = model.make_cache(64)
        batch = ForwardBatch.build([cache.next_input(ids, "all")])
        return np.array(forward(model, batch, cache.kv, interrupt=stop))

    def asker(stop_at: int | None) -> tuple[list[int], object]:
        asked: list[int] = []

        def ask() -> bool:
            asked.append(1)
            return len(asked) == stop_at

        return asked, ask

    whole = run()
    asked, never = asker(None)
    assert np.array_equal(whole, run(never))
    blocks = smollm2_engine.loaded.desc.architecture.block_count
    assert len(asked) == blocks - 1  # between blocks, not after the last

    asked, third = asker(3)
    with pytest.raises(PassInterrupted):
        run(third)
    assert len(asked) == 3
    mx.synchronize()


@cpu_only
def test_abort_stops_a_prefill_and_keeps_the_cache_right(smollm2_serving):
    """An abort mid-prefill frees the engine within a second (the next request's first token
    comes at once), and what the stopped pass left in the KV pool is never read as computed:
    the same prompt afterwards (its finished blocks from the prefix cache) generates what it
    generates from an empty cache."""
    from strata.executor.generate import generate, request_for
    from strata.executor.sampling import SamplingParams

    serving = smollm2_serving
    ids = serving.tokenizer.encode(PROMPT)[:100]  # two chunks on the CPU: 64 and 36 tokens
    greedy = SamplingParams()
    assert serving.reset_prefix_cache()
    reference = generate(serving, ids, greedy, 4).output_ids
    assert serving.reset_prefix_cache()

    events = []
    req = request_for(ids, greedy, 4)
    serving.submit(req, events.append)
    deadline = time.monotonic() + 120

    def first_chunk_done() -> bool:  # its pass computed (on the CPU, block by block)
        running = list(serving.scheduler.running)
        return bool(running) and running[0].num_computed_tokens >= 64

    while not first_chunk_done():  # then the second is running
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    t0 = time.monotonic()
    serving.abort(req.request_id)
    short = generate(serving, serving.tokenizer.encode("Hello"), greedy, 1)
    waited = time.monotonic() - t0
    assert waited < EXIT_WITHIN_S, f"the next request waited {waited:.1f} s for the abort"
    assert short.output_ids
    assert not any(e.token_ids for e in events)  # the aborted request produced nothing

    again = generate(serving, ids, greedy, 4)
    assert again.stats["cached_tokens"] > 0  # the chunks finished before the abort were kept
    assert again.output_ids == reference


@cpu_only
def test_ctrl_c_in_generate_gives_the_partial_result(smollm2_serving):
    """Ctrl-C (a real SIGINT to this thread) while ``generate`` waits on the prefill raises
    ``GenerationInterrupted`` at once with the partial result, and the engine serves the next
    request: what ``strata chat`` relies on to stop a reply and go on."""
    from strata.executor.generate import GenerationInterrupted, generate
    from strata.executor.sampling import SamplingParams

    serving = smollm2_serving
    ids = serving.tokenizer.encode(PROMPT)[:100]
    assert serving.reset_prefix_cache()
    main = threading.main_thread().ident
    assert threading.get_ident() == main
    sent: list[float] = []

    def ctrl_c() -> None:
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(1.5, ctrl_c)  # the prefill of 100 tokens takes several seconds
    # Python's own handler, as at an interactive start (a background job inherits SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        with pytest.raises(GenerationInterrupted) as info:
            generate(serving, ids, SamplingParams(), 4)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    assert time.monotonic() - sent[0] < EXIT_WITHIN_S
    gen = info.value.generation
    assert gen.output_ids == [] and gen.prompt_ids == ids
    s = gen.stats
    assert s["finish_reason"] == "interrupted" and s["interrupted"] is True
    assert s["prefill_s"] is None and 1.0 < s["elapsed_s"] < 1.5 + EXIT_WITHIN_S
    assert "after 0 generated tokens" in str(info.value)
    assert generate(serving, serving.tokenizer.encode("Hello"), SamplingParams(), 1).output_ids


def test_streamed_units_abort_at_the_step_end_and_close_at_once(budget_plans):
    """Where FFNs stream from NVMe an abort lets the pass finish (the stream's order holds: the
    next request runs and reads right), while ``close`` stops a pass within a block."""
    from strata.executor.engine import Engine
    from strata.executor.generate import generate, request_for
    from strata.executor.plan_loader import load_plan
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import ServingEngine

    serving = ServingEngine(Engine(load_plan(budget_plans["ffn-nvme"])))
    serving.start()
    greedy = SamplingParams()
    try:
        ids = serving.tokenizer.encode(PROMPT)[:100]
        reference = generate(serving, ids[:20], greedy, 4).output_ids

        def submit_and_wait_a_step() -> str:
            req = request_for(ids, greedy, 4)
            steps = serving.metrics()["steps"]
            serving.submit(req, lambda ev: None)
            deadline = time.monotonic() + 120
            while serving.metrics()["steps"] == steps:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)  # in the second chunk's pass
            return req.request_id

        serving.abort(submit_and_wait_a_step())
        assert generate(serving, ids[:20], greedy, 4).output_ids == reference

        submit_and_wait_a_step()
        t0 = time.monotonic()
        assert serving.close()
        assert time.monotonic() - t0 < EXIT_WITHIN_S
    finally:
        serving.close()


# ------------------------------------------------------------------ the commands


def test_run_json_interrupted_mid_prefill(smollm2_plan):
    """SIGINT in the middle of ``run --json``'s prefill: exit within a second, status 130, one
    ``interrupted`` line, and the partial result printed with ``"interrupted": true``."""
    proc = strata("run", str(smollm2_plan), "--prompt", PROMPT, "--max-tokens", "8", "--json")
    wait_for_cpu(proc, PREFILL_CPU_S)
    took, out, err = interrupt(proc)
    assert proc.returncode == 130, err
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGINT"
    assert_interrupted(err)
    result = json.loads(out)
    assert result["interrupted"] is True
    s = result["stats"]
    assert s["interrupted"] is True and s["finish_reason"] == "interrupted"
    assert s["prompt_tokens"] == len(result["prompt_ids"]) >= 290
    assert result["output_ids"] == [] and result["text"] == ""
    assert s["output_tokens"] == 0 and s["prefill_s"] is None  # stopped in the prefill
    assert s["elapsed_s"] > 0 and s["load_s"] > 0


def test_run_text_interrupted_keeps_what_was_streamed(smollm2_plan):
    """SIGINT while ``run`` streams tokens: the text so far stays on stdout, one line on stderr
    says how far it got, status 130."""
    proc = strata(
        "run", str(smollm2_plan), "--prompt", "The capital of France is", "--max-tokens", "256"
    )
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout=120)  # the first character of the streamed text
    assert got and got[0], proc.stderr.read() if proc.poll() is not None else "no text"
    time.sleep(0.5)
    took, out, err = interrupt(proc)
    assert proc.returncode == 130, err
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGINT"
    assert_interrupted(err)
    n = int(re.search(r"interrupted after (\d+) generated tokens", err).group(1))
    assert 0 < n < 256
    assert (got[0] + out).strip()


def test_bench_interrupted_mid_prefill(smollm2_plan):
    """SIGINT during ``bench``'s prefill: exit within a second, status 130, no traceback."""
    proc = strata(
        "bench", str(smollm2_plan), "--prompt", PROMPT, "--max-tokens", "2", "--check", "none"
    )
    wait_for_cpu(proc, PREFILL_CPU_S)
    took, _, err = interrupt(proc)
    assert proc.returncode == 130, err
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGINT"
    assert_interrupted(err)


@dataclass
class Serving:
    """A ``serve`` subprocess with one completion request in its prefill."""

    proc: subprocess.Popen
    log: Path
    client: threading.Thread
    answer: list  # the request's httpx.Response, or the httpx error it ended with

    def sigint(self) -> float:
        """Send SIGINT; the monotonic time it was sent."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        return t

    def wait_for_log(self, text: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.02)

    def exited(self) -> tuple[float, str]:
        """Wait for the exit: its monotonic time, and the log (no traceback, ends "stopped")."""
        self.proc.wait(timeout=120)
        t = time.monotonic()
        text = self.log.read_text()
        assert self.proc.returncode == 0, text
        assert "Traceback" not in text, text
        assert text.strip().splitlines()[-1] == "stopped", text
        return t, text


@contextlib.contextmanager
def serving_a_prefill(plan: Path, tmp_path: Path) -> Iterator[Serving]:
    """``strata serve PLAN`` with a 300-token completion request sent and 2 s of CPU into its
    prefill; killed at the end if still running."""
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", str(plan), "--port", "0", "--quiet"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as strata()
        )
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"serving \S+ on (http://\S+:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url, answer = m.group(1), []

        def ask() -> None:
            body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 8}
            try:
                answer.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))
            except httpx.HTTPError as e:  # the server went away before answering
                answer.append(e)

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        wait_for_cpu(proc, cpu_seconds(proc.pid) + 2.0)  # 2 s of CPU into the prefill
        yield Serving(proc, log, client, answer)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_second_sigint_exits_at_once_mid_prefill(smollm2_plan, tmp_path):
    """``serve`` with a request in its prefill: the first SIGINT starts the drain, the second
    exits within a second."""
    with serving_a_prefill(smollm2_plan, tmp_path) as server:
        server.sigint()
        server.wait_for_log("shutting down: 1 running request")
        sent = server.sigint()
        done, text = server.exited()
    assert done - sent < EXIT_WITHIN_S, f"exited {done - sent:.1f} s after the second SIGINT"
    server.client.join(timeout=10)
    if server.answer and isinstance(server.answer[0], httpx.Response):
        assert server.answer[0].status_code == 503, server.answer[0].text


def test_serve_first_sigint_drains_for_the_grace_period(smollm2_plan, tmp_path):
    """One SIGINT with a request in a prefill longer than the grace period: the request gets
    the grace period, then a 503, and the server exits within a second of it (the stopped
    request's pass stops between blocks, not at the end of its prefill)."""
    from strata.executor.server.app import GRACEFUL_SHUTDOWN_S

    with serving_a_prefill(smollm2_plan, tmp_path) as server:
        sent = server.sigint()
        done, text = server.exited()
    assert "shutting down: 1 running request" in text
    took = done - sent
    assert GRACEFUL_SHUTDOWN_S - 0.5 < took < GRACEFUL_SHUTDOWN_S + EXIT_WITHIN_S, took
    server.client.join(timeout=10)
    assert isinstance(server.answer[0], httpx.Response), server.answer
    assert server.answer[0].status_code == 503, server.answer[0].text
    assert "shutting down" in server.answer[0].json()["error"]["message"]
