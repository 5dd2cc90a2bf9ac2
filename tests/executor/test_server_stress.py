"""Stress of the OpenAI-compatible server (issue 6, item 3): 200 concurrent streaming requests with
random prompt and output lengths, about a third of them hung up on at a random point, against a
real ``execute.py serve`` subprocess on loopback.

The model is a tiny synthetic Llama 3 with SmolLM2's tokenizer (text prompts work, each step takes
milliseconds on a CPU), planned for 16 concurrent sequences with a KV pool shrunk well below what
16 of them need: requests queue behind the batch limit and running ones are preempted.

Every request that is not hung up on must come back complete and correct: ``finish_reason``
``length``, exactly ``max_tokens`` completion tokens, and the text the same request gives alone
(greedy). A few more connections close halfway through sending their request body: the server
answers those 499 (client closed request), not a 500 with a traceback. Afterwards no KV block is
in use, nothing runs or waits, and the server still serves.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import make_plan_file
from gguf_factory import write_arch_model
from test_server import parse_prometheus

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 256
CONCURRENCY = 16
KV_BLOCKS = 40
"""Blocks of 16 tokens: 16 sequences of up to ~10 blocks each would need ~4x more, so decodes
run out of blocks and preempt; the largest single request (about 9 blocks) still fits alone."""
REQUESTS = 200
UPLOAD_HANG_UPS = 5
"""Extra connections that close halfway through sending the request body."""
CASES = 40
"""Distinct (prompt, max_tokens) pairs, each run alone once for its reference text."""
SEED = 20261130
WORDS = (
    "the of and to in is was for on that with as by at from his her an it be are this which "
    "river stone light city winter garden paper music engine window market silver ocean forest "
    "quietly slowly under over between after before seven twelve hundred blue green red north "
    "mountain letter story morning evening table kitchen station bridge island valley cloud "
    "Über café naïve 東京 😀 1999 3.14 x=y+1; {a: [b]} <tag> #hash @user"
).split()


@dataclass
class Case:
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    how: str  # "done", "closed" (hung up after some events) or "cancelled" (task cancelled)
    events: int = 0
    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    done_marker: bool = False
    errors: tuple = ()


def _cases(rng: random.Random) -> list[Case]:
    """Prompts of 1..90 words; half are prefixes of one long text (shared blocks, prefix-cache
    hits mid-storm), half independent."""
    shared = [rng.choice(WORDS) for _ in range(90)]
    cases = []
    for i in range(CASES):
        n = rng.randint(1, 90)
        words = shared[:n] if i % 2 else [rng.choice(WORDS) for _ in range(n)]
        cases.append(Case(" ".join(words), rng.randint(1, 24)))
    return cases


def _small_kv_plan(base: Path, out: Path) -> Path:
    data = yaml.safe_load(base.read_text())
    assert data["batch"]["max_num_seqs"] == CONCURRENCY
    data["batch"]["kv_num_blocks"] = KV_BLOCKS
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _start_server(plan: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "execute.py", "serve", str(plan), "--port", "0"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 120
    while True:
        m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()}")
        time.sleep(0.1)


def _body(case: Case, stream: bool) -> dict:
    body = {
        "prompt": case.prompt,
        "max_tokens": case.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _reference(client: httpx.AsyncClient, case: Case) -> dict:
    r = await client.post("/v1/completions", json=_body(case, stream=False))
    assert r.status_code == 200, r.text
    return r.json()


async def _stream(
    client: httpx.AsyncClient, case: Case, hang_up_after: int | None, out: Outcome
) -> None:
    """One streamed request; with ``hang_up_after``, close the connection after that many data
    events (0: right after the response headers). Fills ``out`` as events arrive, so a cancelled
    task leaves what it had read."""
    texts: list[str] = []
    async with client.stream("POST", "/v1/completions", json=_body(case, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        if hang_up_after == 0:
            out.how = "closed"
            return
        async for line in r.aiter_lines():
            if not line or line.startswith(":"):  # blank, or a queued stream's keep-alive
                continue
            assert line.startswith("data: "), line
            data = line[6:]
            if data == "[DONE]":
                out.done_marker = True
                continue
            assert not out.done_marker, "an event after [DONE]"
            chunk = json.loads(data)
            if "error" in chunk:
                out.errors += (chunk["error"],)
                continue
            out.events += 1
            if chunk.get("usage") is not None:
                assert chunk["choices"] == []
                out.usage = chunk["usage"]
            for choice in chunk["choices"]:
                texts.append(choice["text"])
                out.finish = choice["finish_reason"] or out.finish
            out.text = "".join(texts)
            if hang_up_after is not None and out.events >= hang_up_after:
                out.how = "closed"
                return  # leaving the block closes the half-read response: the socket closes
    out.how = "done"


async def _storm(
    url: str, cases: list[Case], rng: random.Random, peaks: Counter
) -> list[tuple[Case, Outcome]]:
    """Fire the requests together; ``peaks`` gets the largest running, waiting and blocks-in-use
    gauges seen during the storm."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        plan = []
        for _ in range(REQUESTS):
            case = rng.choice(cases)
            roll = rng.random()
            hang_up = cancel = None
            if roll < 1 / 6:  # hang up after 0..max_tokens data events
                hang_up = rng.randint(0, case.max_tokens)
            elif roll < 1 / 4:  # cancel the task in the opening burst (connecting, sending
                cancel = rng.uniform(0, 0.3)  # the body, tokenizing, queued)
            elif roll < 1 / 3:  # cancel the task at a random time (queued, mid-stream, ...)
                cancel = rng.uniform(0, 4)
            plan.append((case, hang_up, cancel))
        outcomes = [Outcome("cancelled") for _ in plan]
        tasks = [
            asyncio.create_task(_stream(client, case, hang_up, out))
            for (case, hang_up, _), out in zip(plan, outcomes, strict=True)
        ]
        loop = asyncio.get_running_loop()
        for (_, _, cancel), task in zip(plan, tasks, strict=True):
            if cancel is not None:
                loop.call_later(cancel, task.cancel)
        poller = asyncio.create_task(_poll_peaks(client, peaks))
        uploads = [_hang_up_mid_body(url, rng.choice(cases)) for _ in range(UPLOAD_HANG_UPS)]
        results = await asyncio.gather(*tasks, *uploads, return_exceptions=True)
        poller.cancel()
        for res in results[REQUESTS:]:
            if isinstance(res, BaseException):
                raise AssertionError(f"a hang-up mid-body failed: {res!r}") from res
        results = results[:REQUESTS]
        for (case, _, _), out, res in zip(plan, outcomes, results, strict=True):
            if isinstance(res, asyncio.CancelledError):  # possibly while closing a hang-up
                assert out.how in ("cancelled", "closed")
            elif isinstance(res, BaseException):
                raise AssertionError(f"request {case} failed: {res!r}") from res
        return [(case, out) for (case, _, _), out in zip(plan, outcomes, strict=True)]


async def _hang_up_mid_body(url: str, case: Case) -> None:
    """Send the headers and half the body of a request, then close the connection: the server
    sees the client go while it reads the body."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(_body(case, stream=True)).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(0.5)  # the handler starts reading the body
    writer.close()
    await writer.wait_closed()


async def _poll_peaks(client: httpx.AsyncClient, peaks: Counter) -> None:
    while True:
        r = await client.get("/metrics")
        m = parse_prometheus(r.text)
        for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_in_use"):
            peaks[name] = max(peaks[name], int(m[f"strata_{name}"]))
        await asyncio.sleep(0.05)


def _metrics(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return parse_prometheus(r.text)


def _wait_for_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        busy = m["strata_num_requests_running"] + m["strata_num_requests_waiting"]
        if m["strata_kv_blocks_in_use"] == 0 and busy == 0:
            return m
        assert time.monotonic() < deadline, (
            f"not idle: {m['strata_kv_blocks_in_use']} blocks in use, "
            f"{m['strata_num_requests_running']} running, "
            f"{m['strata_num_requests_waiting']} waiting"
        )
        time.sleep(0.1)


def test_200_concurrent_streams_with_disconnects(smollm2_gguf, tmp_path):
    rng = random.Random(SEED)
    cases = _cases(rng)
    model = write_arch_model(tmp_path / "llama3.gguf", "llama3", smollm2_gguf)
    base = make_plan_file(
        str(model), tmp_path / "base.yaml", context=CONTEXT, concurrency=CONCURRENCY
    )
    plan = _small_kv_plan(base, tmp_path / "small-kv.yaml")
    log = tmp_path / "stderr.txt"
    proc, url = _start_server(plan, log)
    try:

        async def references() -> list[dict]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return [await _reference(client, c) for c in cases]  # one at a time: alone

        refs = {id(c): r for c, r in zip(cases, asyncio.run(references()), strict=True)}
        for c in cases:
            ref = refs[id(c)]
            assert ref["choices"][0]["finish_reason"] == "length"
            assert ref["usage"]["completion_tokens"] == c.max_tokens
        before = _metrics(url)
        assert before["strata_kv_blocks_total"] == KV_BLOCKS
        assert before["strata_preemptions_total"] == 0  # alone, every request fits

        t0 = time.monotonic()
        peaks: Counter = Counter()
        results = asyncio.run(_storm(url, cases, rng, peaks))
        storm_s = time.monotonic() - t0
        assert proc.poll() is None, f"the server died: {log.read_text()}"
        # Requests queued beyond the batch, and the pool ran full.
        assert peaks["num_requests_waiting"] > 0 and peaks["num_requests_running"] > 1, peaks
        assert peaks["kv_blocks_in_use"] > KV_BLOCKS // 2, peaks

        done = [(c, o) for c, o in results if o.how == "done"]
        cut = Counter(o.how for _, o in results)
        print(f"storm: {storm_s:.1f} s, {dict(cut)}, peaks {dict(peaks)}")
        assert len(done) >= REQUESTS // 2 and cut["closed"] + cut["cancelled"] >= REQUESTS // 5
        for c, o in done:
            ref = refs[id(c)]
            assert o.errors == () and o.done_marker, (c, o)
            assert o.finish == "length", (c, o)
            assert o.usage is not None and o.usage["completion_tokens"] == c.max_tokens, (c, o)
            assert o.usage["prompt_tokens"] == ref["usage"]["prompt_tokens"], (c, o)
            assert o.text == ref["choices"][0]["text"], (c, o, ref)
        for c, o in results:  # a hung-up stream saw no error and at most its whole text
            assert o.errors == () and ref_prefix(o.text, refs[id(c)]), (c, o)

        m = _wait_for_idle(url)  # aborts are applied between engine steps
        statuses = {k: v for k, v in m.items() if k.startswith("strata_requests_total")}
        completions = 'strata_requests_total{endpoint="/v1/completions",status="%d"}'
        assert m.get(completions % 499, 0) >= UPLOAD_HANG_UPS, statuses  # client closed request
        assert completions % 500 not in m, statuses
        assert m["strata_preemptions_total"] > 0, "the small KV pool never preempted"
        assert m["strata_kv_blocks_total"] == KV_BLOCKS
        tokens = m["strata_generation_tokens_total"]
        time.sleep(0.3)
        assert _metrics(url)["strata_generation_tokens_total"] == tokens  # nothing still runs

        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        c = cases[0]
        r = httpx.post(f"{url}/v1/completions", json=_body(c, stream=False), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0] == refs[id(c)]["choices"][0]
        _wait_for_idle(url)
        print(f"preemptions: {m['strata_preemptions_total']:.0f}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "warning" not in text and "error" not in text, text


def ref_prefix(text: str, ref: dict) -> bool:
    """``text`` is a prefix of the reference text (a partial last character aside)."""
    full = ref["choices"][0]["text"]
    return full.startswith(text.rstrip("\ufffd"))
