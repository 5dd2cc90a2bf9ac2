"""``execute.py bench --concurrency``: the serving bench, driving a real ``execute.py serve`` over
HTTP with the real SmolLM2 plan.

Decode and prefill on this CPU run at roughly 5-15 tokens/s, so the one end-to-end run asks for
little: levels 1 and 2, two requests of 4 tokens each, prompts of 16 and 24 tokens and a 96-token
prefix. Argument errors are checked in-process, before any server would start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, make_plan_file
from strata.benchmarks.http_bench import (
    RequestResult,
    ServerProcess,
    _level_result,
    _mismatches,
    make_text,
    parse_concurrency,
    parse_metrics,
    queue_note,
    requests_per_level,
    server_summary,
)
from strata.common.errors import StrataError
from test_cli import cli

from strata.cli import execute_main

CONTEXT = 1200


@pytest.fixture(scope="module")
def serving_plan(tmp_path_factory) -> Path:
    """SmolLM2 planned for throughput at concurrency 2 with a small context."""
    path = tmp_path_factory.mktemp("plans") / "serving.yaml"
    return make_plan_file(
        "smollm2-135m", path, context=CONTEXT, concurrency=2, objective="throughput"
    )


def _bench_args(plan: Path, *extra: str) -> list[str]:
    return ["execute.py", "bench", str(plan), "--max-tokens", "4", "--requests", "2", *extra]


@pytest.mark.slow  # starts a server and runs every level
def test_serving_bench_end_to_end(serving_plan, tmp_path):
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    args = _bench_args(serving_plan, "--concurrency", "2,1", "--prompt-tokens", "16,24")
    done = cli(
        *args, "--prefix-tokens", "96", "--prefix-trials", "2", "-o", str(out), "--plot", str(png)
    )
    assert "Traceback" not in done.stderr
    r = json.loads(out.read_text())
    assert r["kind"] == "serving" and r["model"] == "smollm2-135m"
    assert r["batch_invariant"] is False
    assert r["check_passed"] is True and r["mismatches"] == []
    m = r["machine"]
    assert m["cpu_count"] >= 1 and m["mlx_device"] and m["platform"] and m["mlx_version"]
    limits = r["plan_limits"]
    assert limits["context"] == CONTEXT and limits["objective"] == "throughput"
    assert limits["batch"]["max_num_seqs"] >= 2 and limits["batch"]["kv_block_size"] > 0
    s = r["settings"]
    assert s["concurrency"] == [1, 2] and s["added_level_1"] is False
    assert s["max_tokens"] == 4 and s["requests"] == {"1": 2, "2": 2}
    assert s["prompt_lengths"] == [16, 24] and all(n <= 24 for n in s["prompt_tokens"])
    assert s["temperature"] == 0 and s["ignore_eos"] is True and s["server_per_level"] is False

    one, two = r["levels"]
    assert [one["concurrency"], two["concurrency"]] == [1, 2]
    for lv in (one, two):
        assert lv["requests"] == 2 and lv["completion_tokens"] == 8 and lv["queued"] is False
        assert lv["wall_s"] > 0 and lv["aggregate_tok_s"] == pytest.approx(8 / lv["wall_s"], 1e-2)
        for key in ("ttft_s", "tpot_s", "request_decode_tok_s"):
            q = lv[key]
            assert 0 < q["min"] <= q["p50"] <= q["p99"] <= q["max"], (key, q)
        assert lv["check_passed"] is True and lv["mismatched_prompts"] == []
        for req in lv["per_request"]:
            assert req["completion_tokens"] == 4 and req["finish_reason"] == "length"
            assert req["tpot_s"] == pytest.approx(1 / req["decode_tok_s"], 1e-2)
        srv = lv["server"]
        assert srv["kv_blocks_total"] == limits["batch"]["kv_num_blocks"]
        assert srv["kv_blocks_peak"] >= 1 and srv["preemptions"] == 0
        assert srv["prefix_hit_tokens"] == 0  # the cache is reset before each level
        assert srv["server_ttft_mean_s"] > 0 and srv["server_tpot_mean_s"] > 0
        w = lv["warmup"]
        assert w["requests"] == len(w["prompt_tokens"]) + w["concurrent"] and w["wall_s"] > 0
    # Warm-up: level 1 prefills each prompt length alone; level 2 (same lengths) sends 2 at once.
    assert sorted(one["warmup"]["prompt_tokens"]) == sorted(set(s["prompt_tokens"]))
    assert one["warmup"]["concurrent"] == 0 and two["warmup"]["prompt_tokens"] == []
    assert two["warmup"]["concurrent"] == 2 and two["warmup"]["max_tokens"] == 2
    # Two requests at once share engine steps (prefill and decode batched): fewer steps.
    assert two["server"]["engine_steps"] < one["server"]["engine_steps"]
    assert one["vs_level_1"] == 1.0
    assert r["scaling"] == {"1": 1.0, "2": two["vs_level_1"]}
    assert two["vs_level_1"] == pytest.approx(two["aggregate_tok_s"] / one["aggregate_tok_s"], 1e-2)
    assert len(r["texts"]) == 2 and all(r["texts"])

    p = r["prefix_cache"]
    assert p["check_passed"] is True and p["cold_hit_tokens"] == 0
    assert p["warm_hit_tokens"] > 0 and p["warm_hit_tokens"] == p["expected_hit_tokens"]
    assert p["warm_cached_tokens"] == p["warm_hit_tokens"]
    assert 90 <= p["prefix_tokens"] <= 96 and p["shared_prefix_tokens"] >= p["prefix_tokens"]
    assert p["warm_ttft_s"] < p["cold_ttft_s"]  # ~3x less prefill on a CPU that prefills slowly
    assert p["warm_over_cold"] == pytest.approx(p["warm_ttft_s"] / p["cold_ttft_s"], 1e-2)
    assert len(p["trials"]) == 2  # --prefix-trials (1 by default on the CPU)
    for trial in p["trials"]:  # each pair after a reset; no compiled pass on the CPU
        assert (
            trial["cold_hit_tokens"] == 0 and trial["warm_hit_tokens"] == p["expected_hit_tokens"]
        )
        assert trial["warm_compiled_traces"] == trial["warm_compiled_replays"] == 0
        # the server's own TTFT (submission to first token) is inside the client's
        for kind in ("cold", "warm"):
            assert 0 < trial[f"{kind}_server_ttft_s"] < trial[f"{kind}_ttft_s"]
    for kind in ("cold", "warm"):
        servers = sorted(t[f"{kind}_server_ttft_s"] for t in p["trials"])
        assert p[f"{kind}_server_ttft_s"] == pytest.approx(sum(servers) / 2, abs=2e-6)
    assert "in the server: cold " in done.stderr
    cut = p["cold_ttft_s"] / p["warm_ttft_s"]  # said as how many times shorter warm is
    assert f"(cut {cut:.2f}x; in the server" in done.stderr
    assert one["server"]["compiled_pass_traces"] == one["server"]["compiled_pass_replays"] == 0

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench: concurrency 2:" in done.stderr and "bench: prefix cache:" in done.stderr
    assert done.stderr.count("server up (pid ") == 1  # one server for every level


def test_ctrl_c_stops_the_server(serving_plan):
    """SIGINT while a level runs: exit 130, one line, and the server process is gone."""
    proc = subprocess.Popen(
        [sys.executable, "execute.py", "bench", str(serving_plan), "--concurrency", "1"]
        + ["--max-tokens", "200", "--requests", "2", "--prompt-tokens", "8"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # A runner started in the background ignores SIGINT and a child inherits that: give the
        # child a terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    pid = None
    for line in proc.stderr:
        if "server up (pid " in line:
            pid = int(line.split("server up (pid ")[1].split(",")[0])
            break
    assert pid is not None, proc.communicate(timeout=60)
    time.sleep(1)  # the level's requests are in flight (after one 8-token warm-up request)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped by the bench


def _run(capsys, *args: str) -> str:
    """``execute.py`` in-process; the one error line it must print (exit status 2)."""
    assert execute_main(list(args)) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--concurrency", "0"], ["--concurrency", "not positive"]),
        (["--concurrency", "1,-4"], ["not positive"]),
        (["--concurrency", "1,two"], ["'two' is not an integer"]),
        (["--concurrency", "1.5"], ["not an integer"]),
        (["--concurrency", "1,,4"], ["comma-separated positive integers"]),
        (["--concurrency", ""], ["comma-separated positive integers"]),
        (["--concurrency", "2,2"], ["repeated"]),
        (["--concurrency", "1,4", "--requests", "3"], ["--requests 3 is below", "4"]),
        (["--concurrency", "1", "--requests", "0"], ["--requests 0"]),
        (["--concurrency", "1", "--prompt-tokens", "8,0"], ["--prompt-tokens", "not positive"]),
        (["--concurrency", "1", "--check", "none"], ["--check applies to the single-stream"]),
        (["--concurrency", "1", "--expert-cache-modes", "cache"], ["--expert-cache-modes"]),
        (["--concurrency", "1", "--max-tokens", "1"], ["at least 2"]),
        (["--concurrency", "1", "--plot", "x.txt"], ["--plot", ".png"]),
        (["--requests", "3"], ["--requests applies to the serving bench", "--concurrency"]),
        (["--prefix-tokens", "10"], ["--prefix-tokens applies to the serving bench"]),
        (["--prefix-trials", "5"], ["--prefix-trials applies to the serving bench"]),
        (["--batch-invariant"], ["--batch-invariant applies to the serving bench"]),
    ],
)
def test_argument_errors(capsys, tmp_path, extra, words):
    line = _run(capsys, "bench", str(tmp_path / "no-plan-needed.yaml"), *extra)
    for w in words:
        assert w in line, line


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prefix-tokens", "1190"], ["--prefix-tokens 1190", "re-plan with a larger --context"]),
        (["--max-tokens", "1195"], ["--max-tokens 1195", "context is 1200", "--context"]),
        (["--prefix-tokens", "8"], ["below the plan's KV block size", "0 to skip"]),
        (["--prefix-tokens", "-1"], ["--prefix-tokens -1"]),
        (["--prefix-trials", "0"], ["--prefix-trials 0", "at least 1"]),
        (["--prefix-tokens", "0", "--prefix-trials", "2"], ["--prefix-trials applies"]),
    ],
)
def test_workload_must_fit_the_plan(capsys, serving_plan, extra, words):
    """Checked against the plan before any server starts."""
    line = _run(capsys, "bench", str(serving_plan), "--concurrency", "1", *extra)
    for w in words:
        assert w in line, line


def test_server_that_fails_to_start_is_one_line_with_its_stderr():
    fail = "import sys; print('loading...', file=sys.stderr); "
    fail += "print('error: the plan is broken', file=sys.stderr); sys.exit(2)"
    srv = ServerProcess([sys.executable, "-c", fail], "key")
    with pytest.raises(StrataError) as e:
        with srv:
            pass
    msg = str(e.value)
    assert "\n" not in msg and "exit status 2" in msg and "error: the plan is broken" in msg
    assert not srv._log.exists()


def test_server_that_never_answers_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    hang = (
        "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
        "print('serving m on http://127.0.0.1:9', file=sys.stderr, flush=True); time.sleep(600)"
    )
    srv = ServerProcess([sys.executable, "-c", hang, str(pid_file)], "key", start_timeout_s=1)
    with pytest.raises(StrataError, match="never answered /health"):
        with srv:
            pass
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_parse_concurrency_and_requests():
    assert parse_concurrency(" 8, 1,2 ") == [1, 2, 8]
    assert requests_per_level([1, 2, 4, 8, 16], None) == {1: 32, 2: 8, 4: 8, 8: 16, 16: 32}
    assert requests_per_level([1, 4], 5) == {1: 5, 4: 5}
    with pytest.raises(StrataError, match="below --concurrency 4"):
        requests_per_level([1, 4], 3)
    assert queue_note(2, 2) is None
    assert "max_num_seqs 2" in queue_note(4, 2)


def _result(prompt: int, text: str, tokens: int = 4, t0: float = 10.0) -> RequestResult:
    # Sent at t0, first token 0.5 s later, then one token every 0.1 s.
    return RequestResult(
        prompt, text, "length", 20, tokens, 0, t0, t0 + 0.5, t0 + 0.5 + 0.1 * (tokens - 1)
    )


def test_level_figures_and_text_check():
    results = [_result(0, " a b"), _result(1, " c d")]
    lv = _level_result(4, 2, results, 2.0, {}, 4)
    assert lv["queued"] is True and "max_num_seqs 2" in lv["note"]
    assert lv["aggregate_tok_s"] == 4.0 and lv["ttft_s"]["p50"] == pytest.approx(0.5)
    assert lv["tpot_s"]["p99"] == pytest.approx(0.1) and lv["request_decode_tok_s"]["max"] == 10
    assert not _level_result(2, 2, results, 2.0, {}, 4)["queued"]
    with pytest.raises(StrataError, match="despite ignore_eos"):
        _level_result(1, 2, [_result(0, "x", tokens=3)], 1.0, {}, 4)
    bad = _mismatches(2, [_result(0, " a b"), _result(1, " c e")], [" a b", " c d"])
    assert bad == [
        {"concurrency": 2, "prompt": 1, "first_difference": 3, "expected": " c d", "got": " c e"}
    ]


def test_metrics_summary():
    def expo(hits: int, steps: int, used: int, ttft_sum: float, ttft_n: int) -> dict:
        return parse_metrics(
            "# HELP strata_prefix_cache_hits_total x\n"
            "# TYPE strata_prefix_cache_hits_total counter\n"
            f"strata_prefix_cache_hits_total {hits}\n"
            f"strata_engine_steps_total {steps}\nstrata_batched_tokens_total {steps * 3}\n"
            f"strata_kv_blocks_in_use {used}\nstrata_kv_blocks_total 150\n"
            f'strata_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_n}\n'
            f"strata_time_to_first_token_seconds_sum {ttft_sum!r}\n"
            f"strata_time_to_first_token_seconds_count {ttft_n}\n"
        )

    before, during, after = (
        expo(16, 10, 0, 1.0, 1),
        expo(16, 12, 9, 1.0, 1),
        expo(48, 20, 2, 4.0, 3),
    )
    s = server_summary(before, after, [during])
    assert s["prefix_hit_tokens"] == 32 and s["engine_steps"] == 10 and s["batched_tokens"] == 30
    assert s["mean_batched_tokens_per_step"] == 3.0 and s["server_ttft_mean_s"] == 1.5
    assert s["kv_blocks_peak"] == 9 and s["kv_blocks_total"] == 150
    assert s["preemptions"] is None and s["server_tpot_mean_s"] is None  # not exported here
    # A level over before its first sample: its peak was not seen (the idle snapshot after it
    # says nothing of it).
    assert server_summary(before, after, [])["kv_blocks_peak"] is None


def test_prompts_are_deterministic_and_fit(smollm2_gguf):
    from strata.executor.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(smollm2_gguf)
    for n in (16, 100, 257):
        text, count = make_text(tok, f"prompt-{n}", n)
        assert n - 3 <= count <= n and count == len(tok.encode(text))
        assert make_text(tok, f"prompt-{n}", n) == (text, count)
    assert make_text(tok, "prompt-0", 50)[0] != make_text(tok, "prompt-1", 50)[0]


def test_failed_check_writes_the_json_then_fails(capsys, monkeypatch, tmp_path):
    """A text mismatch is never silent: the JSON is written, then one error line names it."""
    import strata.benchmarks.http_bench as hb

    mismatch = {
        "concurrency": 2,
        "prompt": 1,
        "first_difference": 3,
        "expected": "a",
        "got": "b",
        "near_tie": False,
    }
    result = {"check_passed": False, "mismatches": [mismatch], "prefix_cache": None}
    monkeypatch.setattr(hb, "http_bench", lambda *a, **k: result)
    out = tmp_path / "r.json"
    line = _run(capsys, "bench", "p.yaml", "--concurrency", "1,2", "-o", str(out))
    assert "bench check failed" in line and "c=2 prompt 1" in line
    assert json.loads(out.read_text())["mismatches"] == [mismatch]


def test_batch_invariant_reaches_the_server(monkeypatch, tmp_path):
    """``bench --concurrency ... --batch-invariant`` asks ``http_bench`` for it, which starts
    ``serve --batch-invariant``."""
    import strata.benchmarks.http_bench as hb

    seen = {}
    result = {"check_passed": True, "mismatches": [], "prefix_cache": None}
    monkeypatch.setattr(hb, "http_bench", lambda *a, **k: seen.update(k) or result)
    argv = ["bench", "p.yaml", "--concurrency", "1", "--batch-invariant"]
    assert execute_main([*argv, "-o", str(tmp_path / "r.json")]) == 0
    assert seen["batch_invariant"] is True
    cmd = ServerProcess.serve_command(Path("p.yaml"), "k", batch_invariant=True)
    assert cmd[-1] == "--batch-invariant"
    assert "--batch-invariant" not in ServerProcess.serve_command(Path("p.yaml"), "k")


class _Bytes:
    """A tokenizer stand-in: token id -> bytes."""

    def __init__(self, table: dict[int, bytes]):
        self.table = table

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        return self.table[token_id]


def test_near_tie_classification():
    from strata.benchmarks.http_bench import classify_divergence

    tok = _Bytes(
        {1: b"a", 2: b" b", 3: b" c", 4: b" d", 5: b" x", 6: b"\xc3", 7: b"\xa9", 8: b"\xa8"}
    )
    ids = [1, 2, 3, 4]
    tops = [{1: -0.1, 2: -3.0}, {2: -0.2, 5: -2.5}, {3: -0.6, 5: -0.8}, {4: -0.1, 1: -4.0}]
    # The c=16 text took the runner-up (5) at token 2, where the gap was 0.2: a near-tie flip.
    flip = classify_divergence(tok, ids, tops, "a b x d", 0.5)
    assert flip == {
        "token_index": 2,
        "reference_token": 3,
        "runner_up": 5,
        "gap": 0.2,
        "runner_up_taken": True,
        "near_tie": True,
    }
    assert classify_divergence(tok, ids, tops, "a b x d", 0.1)["near_tie"] is False  # gap too big
    other = classify_divergence(tok, ids, tops, "a b q", 0.5)  # not the runner-up: an error
    assert other["runner_up_taken"] is False and other["near_tie"] is False
    assert classify_divergence(tok, ids, tops, "a b c d", 0.5)["token_index"] is None
    # A character split over two tokens ("é" = c3 a9) left for "è" (c3 a8) at its second token.
    ids, tops = [1, 6, 7], [{1: -0.1, 2: -5.0}, {6: -0.1, 2: -4.0}, {7: -0.5, 8: -0.6}]
    split = classify_divergence(tok, ids, tops, "aè", 0.5)
    assert split["token_index"] == 2 and split["runner_up"] == 8 and split["near_tie"] is True


def test_near_tie_gap_defaults_by_model(smollm2_gguf):
    from strata.benchmarks.http_bench import NEAR_TIE_GAP, NEAR_TIE_GAP_RANDOM, default_near_tie_gap
    from strata.common.gguf_file import open_gguf

    class Synthetic:
        def field(self, key, default=None):
            return "Synthetic llama3-8b Q4_0 (random weights, seed 0)"

    assert default_near_tie_gap(open_gguf(smollm2_gguf)) == NEAR_TIE_GAP == 0.5
    assert default_near_tie_gap(Synthetic()) == NEAR_TIE_GAP_RANDOM == 1.0


# --------------------------------------------------------------------------------------------
# The aiohttp client against a scripted in-process server (no model: fast)
# --------------------------------------------------------------------------------------------


def _chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    event = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        event = {"choices": [], "usage": usage}
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


_USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}


def _scripted(script, seen: dict):
    """``(url, runner)`` of an aiohttp server whose ``/v1/completions`` streams ``script`` (a list
    of byte strings and pauses in seconds, or ``(status, body)`` for a plain reply), after checking
    the bench's key; it counts the client's connections in ``seen["peers"]``."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.setdefault("peers", set()).add(request.transport.get_extra_info("peername"))
        seen["body"] = await request.json()
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "no key"}}, status=401)
        if isinstance(script, tuple):
            return web.Response(status=script[0], body=script[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in script:
            if isinstance(part, float):
                await asyncio.sleep(part)
            else:
                await resp.write(part)
        await resp.write_eof()
        return resp

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "requests are running"}}, status=409)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="strata_engine_steps_total 5\n")

    async def start():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/reset_prefix_cache", reset)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}", runner

    return start


def _stream(script, n: int = 1, seen: dict | None = None) -> list[RequestResult]:
    """``n`` bench requests, one after another, against a server that streams ``script``."""
    import types

    from strata.benchmarks.http_bench import _client, stream_completion

    seen = {} if seen is None else seen

    async def go():
        url, runner = await _scripted(script, seen)()
        try:
            srv = types.SimpleNamespace(url=url, api_key="k")
            async with _client(srv, 2) as client:
                return [await stream_completion(client, "m", "hi", 3, 5) for _ in range(n)]
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_stream_completion_reads_and_times_the_events():
    """Lines split on b"\\n" only (U+2028 and U+0085 are text, which httpx's ``aiter_lines``
    split on), other SSE lines skipped, a line far over aiohttp's default 512 KiB limit read
    whole, the timing points taken at the chunks with text, and one connection kept alive."""
    big = "x" * (1 << 20)
    script = [
        b": a comment\n\nevent: ping\n\n",
        _chunk(""),  # no text yet: not the first token
        _chunk("a\u2028b\x85"),
        _chunk(big),
        _chunk("", "length"),
        _chunk("", usage=_USAGE),
        b"data: [DONE]\n\n",
        0.05,  # the body's end comes later: the client must still read it to keep the connection
    ]
    seen: dict = {}
    results = _stream(script, n=3, seen=seen)
    r = results[0]
    assert r.text == "a\u2028b\x85" + big and r.finish_reason == "length" and r.prompt == 5
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (7, 3, 4)
    assert r.t_sent < r.t_first < r.t_last and r.tpot_s == (r.t_last - r.t_first) / 2
    assert all(x.text == r.text for x in results)
    assert len(seen["peers"]) == 1  # the body is read to its end: the connection is reused
    body = seen["body"]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["max_tokens"] == 3 and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "script, words",
    [
        ((400, b'{"error": {"message": "bad prompt"}}'), "prompt 5: HTTP 400: bad prompt"),
        ((502, b"<html>bad gateway</html>"), "prompt 5: HTTP 502: <html>bad gateway</html>"),
        (
            [_chunk("a"), b'data: {"error": {"message": "engine died"}}\n\n'],
            "prompt 5: the server failed: engine died",
        ),
        ([_chunk("a"), b"data: {oops\n\n"], "prompt 5: the server sent a non-JSON event"),
        ([_chunk("a"), b'data: {"error": "overloaded"}\n\n'], "the server failed: overloaded"),
        ([b'data: {"id": 1}\n\n'], 'an event that is not a completion chunk: {"id": 1}'),
        ([b'data: {"choices": [{"text": 1}]}\n\n'], "not a completion chunk"),
        ([_chunk("a"), b"data: [DONE]\n\n"], "the stream ended without a finish reason"),
        ([_chunk("a")], "the stream ended without a finish reason"),
    ],
)
def test_stream_completion_errors(script, words):
    with pytest.raises(StrataError) as e:
        _stream(script)
    assert words in str(e.value), str(e.value)


def test_a_line_over_the_limit_is_one_clear_error(monkeypatch):
    import strata.benchmarks.http_bench as hb

    monkeypatch.setattr(hb, "STREAM_LINE_BYTES", 4096)
    assert _stream([_chunk("y" * 1000, "length"), b"data: [DONE]\n\n"])[0].text == "y" * 1000
    with pytest.raises(StrataError, match="prompt 5: the server sent a stream line over 4096"):
        _stream([_chunk("y" * 10000, "length"), b"data: [DONE]\n\n"])


def test_reset_metrics_and_failures_on_the_server():
    """``reset_prefix_cache`` names the status and the server's message; ``_metrics`` parses;
    a request to a dead server becomes one StrataError line with the server's stderr."""
    import socket
    import types

    from strata.benchmarks.http_bench import _client, _metrics, _on_server, reset_prefix_cache

    async def go():
        url, runner = await _scripted([], {})()
        try:
            async with _client(types.SimpleNamespace(url=url, api_key="k"), 2) as client:
                assert await _metrics(client) == {"strata_engine_steps_total": 5.0}
                await reset_prefix_cache(client)
        finally:
            await runner.cleanup()

    with pytest.raises(StrataError, match="prefix cache: HTTP 409: requests are running"):
        asyncio.run(go())

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerProcess(["unused"], "k")
    srv.url = f"http://127.0.0.1:{port}"

    async def dead():
        async with _client(srv, 1) as client:
            await reset_prefix_cache(client)

    try:
        with pytest.raises(StrataError) as e:
            _on_server(srv, "concurrency 4", dead())
    finally:
        srv.stop()
    msg = str(e.value)
    assert msg.startswith("concurrency 4: the request failed (ClientConnectorError(")
    assert "server stderr:" in msg and "\n" not in msg
