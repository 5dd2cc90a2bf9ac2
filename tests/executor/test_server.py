"""The OpenAI-compatible server: a real ``execute.py serve`` subprocess with the real SmolLM2 plan,
driven by the official ``openai`` client, ``httpx`` and ``curl`` over loopback.

One server process serves the whole module (loading takes a few seconds); requests ask for few
tokens. Greedy decoding makes the texts comparable across endpoints and streaming modes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from strata.executor.server.logprobs import TextOffsets, completion_logprobs
from strata.executor.server.stop import StopMatcher

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
MODEL = "smollm2-135m"
CONTEXT = 2048
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def post(
        self, path: str, body: object, key: str | None = KEY, timeout: float = 60
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, str | bytes) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        return parse_prometheus(r.text)


def parse_prometheus(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` from Prometheus text format, checking every line's syntax."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    sample = re.compile(
        r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? (\S+)$'
    )
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge", "histogram"), line
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        m = sample.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name = m.group(1)
        assert re.sub(r"_(bucket|sum|count)$", "", name) in typed or name in typed, line
        samples[name + (m.group(2) or "")] = float(m.group(4))
    return samples


@contextlib.contextmanager
def serve_process(
    plan: Path,
    log: Path,
    *options: str,
    key: tuple[str, ...] = ("--api-key", KEY),
    env: dict[str, str] | None = None,
    model: str = MODEL,
) -> Iterator[Server]:
    """``execute.py serve PLAN --port 0 *key *options`` (port 0: the server reports the one it
    got; ``key``: how it is given the API key KEY), stopped with SIGINT after use; its stderr
    goes to ``log``; ``env``: variables added to the environment; ``model``: the name it
    serves."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "execute.py", "serve", str(plan), "--port", "0", *key, *options],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        m = re.search(r"serving (\S+) on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            assert m.group(1) == model
            url = m.group(2)
        elif proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()}")
        else:
            time.sleep(0.2)
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}  # no key needed
    try:
        yield Server(url, proc, log)
    except BaseException:  # a failed test: the server (and a cluster plan's ranks) must go
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def server(smollm2_plan, tmp_path_factory) -> Iterator[Server]:
    """The module's server: ``execute.py serve`` on the SmolLM2 plan, its API key read from a
    file (``--api-key-file``: the key's first line, its spaces and later lines left out)."""
    folder = tmp_path_factory.mktemp("serve")
    (folder / "key.txt").write_text(f"  {KEY} \nnot the key\n")
    key = ("--api-key-file", str(folder / "key.txt"))
    with serve_process(smollm2_plan, folder / "stderr.txt", key=key) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from strata.executor.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(smollm2_gguf)


def chat(server: Server, **kw):
    kw.setdefault("temperature", 0)
    return server.client().chat.completions.create(model=MODEL, messages=CHAT, **kw)


def stream_chat(server: Server, **kw) -> tuple[list[str], str | None, object]:
    """(content deltas, finish reason, usage) of a streamed chat completion."""
    deltas, finish, usage = [], None, None
    stream = chat(server, stream=True, stream_options={"include_usage": True}, **kw)
    for i, chunk in enumerate(stream):
        if i == 0:
            assert chunk.choices[0].delta.role == "assistant"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert chunk.model == MODEL and chunk.object == "chat.completion.chunk"
        choice = chunk.choices[0]
        if choice.delta.content:
            deltas.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
    return deltas, finish, usage


def complete(server: Server, prompt: str | list[int] = PROMPT, **kw):
    kw.setdefault("temperature", 0)
    return server.client().completions.create(model=MODEL, prompt=prompt, **kw)


def stream_complete(server: Server, prompt: str | list[int] = PROMPT, **kw):
    texts, finish, usage = [], None, None
    stream = complete(server, prompt, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text)
            finish = choice.finish_reason or finish
    return texts, finish, usage


# ------------------------------------------------------------------------------------ happy path


def test_models(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL


def test_chat_stream_equals_non_stream(server, tokenizer):
    from strata.executor.chat import messages_to_ids

    prompt_ids = messages_to_ids(tokenizer, CHAT)
    r = chat(server, max_tokens=12)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert text and "Paris" in text
    u = r.usage
    assert u.prompt_tokens == len(prompt_ids)
    assert 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    assert r.choices[0].finish_reason == ("length" if u.completion_tokens == 12 else "stop")

    deltas, finish, usage = stream_chat(server, max_tokens=12)
    assert "".join(deltas) == text
    assert finish == r.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (u.prompt_tokens, u.completion_tokens)
    # The same prompt as token ids through /v1/completions gives the same greedy text.
    assert complete(server, prompt_ids, max_tokens=12).choices[0].text == text
    # The prompt's full blocks are in the prefix cache now.
    assert chat(server, max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0


def test_completions_stream_equals_non_stream(server, tokenizer):
    r = complete(server, max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    texts, finish, usage = stream_complete(server, max_tokens=8)
    assert "".join(texts) == r.choices[0].text and finish == "length"
    assert usage.completion_tokens == 8
    # Default max_tokens of /v1/completions is OpenAI's 16.
    assert complete(server).usage.completion_tokens == 16


def test_completion_prompt_reads_control_tokens(server, tokenizer):
    """A text prompt's control tokens are those tokens (llama.cpp's server and vLLM agree), so a
    chat prompt rendered by hand equals the chat endpoint's."""
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, parse_special=True)
    assert len(ids) < len(tokenizer.encode(text))
    r = complete(server, text, max_tokens=8)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == complete(server, ids, max_tokens=8).choices[0].text


def test_seeded_sampling_repeats(server):
    a, b = (
        complete(
            server, max_tokens=8, temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 40}
        )
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b


def _log_softmax(row):
    import numpy as np

    x = row.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_chat_logprobs_are_the_models(server, tokenizer, smollm2_engine):
    from strata.executor.chat import messages_to_ids

    r = chat(server, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    by_bytes: dict[bytes, int] = {}
    for i in range(tokenizer.vocab_size):
        by_bytes.setdefault(tokenizer.token_bytes(i, skip_special=False), i)
    ids = [by_bytes[bytes(e.bytes)] for e in content]
    prompt = messages_to_ids(tokenizer, CHAT)
    # Teacher-forced through the engine: the same log-probabilities (the CPU's kernels are
    # batch-invariant, so only summation order could differ).
    rows = smollm2_engine.logits_for(prompt + ids, first=len(prompt) - 1)
    for j, e in enumerate(content):
        lp = _log_softmax(rows[j])
        assert abs(e.logprob - lp[ids[j]]) < 1e-4
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy
        assert abs(e.top_logprobs[1].logprob - sorted(lp)[-2]) < 1e-4
    # Streamed: the same entries, spread over the chunks.
    stream = chat(server, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert chat(server, max_tokens=2).choices[0].logprobs is None  # not asked for


def test_completion_logprobs(server):
    r = complete(server, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == value and top[tok] == value  # greedy
        assert value <= 0
    texts, tops = [], []
    for chunk in complete(server, max_tokens=5, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            texts += chunk.choices[0].logprobs.tokens
            tops += chunk.choices[0].logprobs.token_logprobs
    assert texts == lp.tokens and tops == lp.token_logprobs
    # Sampled (the logits come to the host for sampling, and the logprobs are read there): the
    # same seed gives the same entries, each no likelier than the most likely token.
    kw = {"max_tokens": 5, "logprobs": 2, "temperature": 0.9, "seed": 11}
    a, b = (complete(server, **kw).choices[0].logprobs for _ in range(2))
    assert a.tokens == b.tokens and a.token_logprobs == b.token_logprobs and len(a.tokens) >= 1
    for value, top in zip(a.token_logprobs, a.top_logprobs, strict=True):
        assert value <= max(top.values()) <= 0


def test_logprob_token_names_and_text_offsets():
    """Tokens holding part of a UTF-8 character are named by their bytes (as OpenAI does), so
    they do not collide as ``top_logprobs`` keys; ``text_offset`` counts the text's characters:
    a character once complete, nothing for a special token."""
    from strata.executor.serving import TokenLogprob

    class Tok:
        table = {1: b"a", 2: b"\xf0\x9f", 3: b"\x98\x80", 4: b"\xf0", 5: b"<|im_end|>"}

        def token_bytes(self, i, skip_special=True):
            return b"" if skip_special and i == 5 else self.table[i]

        def token_text(self, i):
            return self.table[i].decode(errors="replace")

    entries = [(t, TokenLogprob(-0.5, [(t, -0.5), (4, -1.0)])) for t in (1, 2, 3, 5, 1)]
    out = completion_logprobs(Tok(), entries, TextOffsets(Tok()))
    assert out["tokens"] == ["a", "bytes:\\xf0\\x9f", "bytes:\\x98\\x80", "<|im_end|>", "a"]
    assert out["top_logprobs"][1] == {"bytes:\\xf0\\x9f": -0.5, "bytes:\\xf0": -1.0}
    assert out["text_offset"] == [0, 1, 1, 2, 2]  # the text: "a😀a"


def test_reference_logprobs_name_token_ids(server, tokenizer):
    """The serving bench's near-tie check: token ids (``return_tokens_as_token_ids``) and top-2
    log-probs of a greedy completion, which decode back to its text."""
    import asyncio

    import aiohttp
    from strata.benchmarks.http_bench import classify_divergence, reference_logprobs

    async def ask():
        headers = {"Authorization": f"Bearer {KEY}"}
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(server.url, headers=headers, timeout=timeout) as c:
            return await reference_logprobs(c, MODEL, PROMPT, 6)

    text, ids, tops = asyncio.run(ask())
    assert len(ids) == 6 and tokenizer.decode(ids) == text
    assert text == complete(server, max_tokens=6, extra_body={"ignore_eos": True}).choices[0].text
    for tid, top in zip(ids, tops, strict=True):
        assert len(top) == 2 and max(top, key=top.get) == tid  # greedy: the top token
    # A text that took the runner-up at token 3 (then anything): classified there, by its gap.
    runner = min(tops[3], key=tops[3].get)
    gap = tops[3][ids[3]] - tops[3][runner]
    got = tokenizer.decode([*ids[:3], runner]) + " and so on"
    flip = classify_divergence(tokenizer, ids, tops, got, gap + 0.01)
    assert flip["token_index"] == 3 and flip["runner_up"] == runner and flip["near_tie"]
    assert flip["gap"] == pytest.approx(gap, abs=1e-4)
    assert not classify_divergence(tokenizer, ids, tops, got, gap - 0.01)["near_tie"]


def test_logit_bias_and_penalties_pick_the_adjusted_argmax(server):
    """Greedy with OpenAI's logit bias and penalties: each token is the argmax of the raw
    log-probabilities (reported before any adjustment, as vLLM reports them) plus the bias, less
    the penalties of the tokens generated before it; checked over the top-20 alternatives."""
    first = complete(
        server, max_tokens=1, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    greedy = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    forced = (greedy + 1) % 1000 + 100
    r = complete(server, max_tokens=1, logit_bias={str(forced): 100}, logprobs=1)
    assert r.choices[0].text != first.choices[0].text
    r = complete(server, max_tokens=1, logit_bias={str(greedy): -100})
    assert r.choices[0].text != first.choices[0].text
    bias, presence, frequency = {greedy: 1.0}, 0.6, 0.9
    r = complete(
        server,
        max_tokens=16,
        logprobs=20,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias={str(k): v for k, v in bias.items()},
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    counts: dict[int, int] = {}
    penalized = 0
    for tid, top in zip(ids, lp.top_logprobs, strict=True):

        def adjusted(t: int, v: float) -> float:
            c = counts.get(t, 0)
            return v + bias.get(t, 0.0) - c * frequency - (c > 0) * presence

        alts = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
        best = max(adjusted(t, v) for t, v in alts.items())
        assert adjusted(tid, alts[tid]) >= best - 1e-3
        penalized += max(alts, key=alts.get) != tid  # the raw argmax was not taken
        counts[tid] = counts.get(tid, 0) + 1
    assert penalized > 0  # the adjustments changed some choice


def test_ignore_eos_runs_to_max_tokens(server):
    r = chat(server, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------ stop strings


def test_stop_strings(server, tokenizer):
    full = complete(server, max_tokens=12).choices[0].text
    ids = tokenizer.encode(full, add_bos=False)
    # A stop string across a token boundary, from the middle of the text.
    cut = len(tokenizer.decode(ids[: len(ids) // 2]))
    stop = full[cut - 2 : cut + 2]
    assert len(stop) == 4
    expected = full[: full.find(stop)]
    r = complete(server, max_tokens=12, stop=[stop, "never-seen-zq"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12
    texts, finish, _ = stream_complete(server, max_tokens=12, stop=stop)
    assert "".join(texts) == expected and finish == "stop"
    assert not any(stop in t for t in texts)
    # A stop string that never completes: nothing held back is lost.
    never = full[cut : cut + 3] + "\x00"
    texts, finish, _ = stream_complete(server, max_tokens=12, stop=never)
    assert "".join(texts) == full and finish == "length"


def test_stop_matcher_any_split():
    """StopMatcher's pieces join to the text cut before the first stop, however it is split."""
    rng = random.Random(0)
    text = "abcabd xyz ab abcab abcabd the end"
    for stops in (["abd"], ["cab", "d x"], ["zz"], ["end", "the end"], ["b"], ["ab abcab"]):
        hits = [text.find(s) for s in stops if s in text]
        expected = text[: min(hits)] if hits else text
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 8)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            m, out, hit = StopMatcher(stops), [], False
            for p in pieces:
                emit, hit = m.push(p)
                out.append(emit)
                if hit:
                    break
            if not hit:
                out.append(m.flush())
            assert "".join(out) == expected and hit == bool(hits)
            assert not any(s in o for o in out for s in stops)


# ------------------------------------------------------------------------------------ errors


def error_of(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err
    return err


def test_bad_requests(server):
    chat_path = "/v1/chat/completions"
    ok = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    error_of(server.post(chat_path, "{not json"), 400, "not valid JSON")
    form = httpx.post(
        f"{server.url}{chat_path}",
        content="model=x&prompt=hi",
        headers={
            "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/x-www-form-urlencoded",
        },
        timeout=60,
    )
    error_of(form, 400, "not valid JSON", "sent as application/x-www-form-urlencoded")
    lone = json.dumps({"model": MODEL, "prompt": "a @ b"}).replace("@", "\\ud800")  # half a pair
    error_of(server.post("/v1/completions", lone), 400, "not valid JSON", "surrogate pair")
    low = json.dumps({"model": MODEL, "prompt": "a @ b"}).replace("@", "\\udc00")
    error_of(server.post("/v1/completions", low), 400, "surrogate pair")
    short = json.dumps({"model": MODEL, "prompt": "a @ b"}).replace("@", "\\u12")
    error_of(server.post("/v1/completions", short), 400, "invalid escape", "4 hex digits")
    latin1 = (
        json.dumps({"model": MODEL, "prompt": "caf\u00e9"}).encode().replace(b"\\u00e9", b"\xe9")
    )
    error_of(server.post("/v1/completions", latin1), 400, "must be UTF-8")
    error_of(server.post(chat_path, "[1, 2]"), 400, "JSON object")
    for field, value in (
        ("temperature", "hot"),
        ("max_tokens", "ten"),
        ("messages", "hi"),
        ("stream", "yes"),
        ("max_tokens", 0),
        ("top_p", 2),
    ):
        err = error_of(server.post(chat_path, {**ok, field: value}), 400, field)
        assert err["param"] == field and err["type"] == "invalid_request_error"
    err = error_of(server.post(chat_path, {**ok, "messages": [{"content": "x"}]}), 400, "role")
    assert err["param"] == "messages.0.role"
    # Tools with a template that renders no tool-call format (SmolLM2's ChatML) are refused, not
    # accepted and ignored; the rest of the tools checks: tests/executor/test_server_tools.py.
    for field, value, what in (
        ("tools", [{"type": "function", "function": {"name": "f"}}], "renders no tool calls"),
        ("tools", [], "tools is empty"),
        ("tool_choice", "required", "needs tools"),
    ):
        err = error_of(server.post(chat_path, {**ok, field: value}), 400, what)
        assert err["param"] == field
    err = error_of(server.post("/v1/completions", {**ok, "prompt": "x", "suffix": "y"}), 400)
    assert err["param"] == "suffix"
    # vLLM's sampling extensions: refused unless at their no-op value; stream_options needs a
    # stream; a seed outside int64 (it would wrap onto another seed's samples).
    for path, body in ((chat_path, ok), ("/v1/completions", {**ok, "prompt": "x"})):
        for field, value in (
            ("repetition_penalty", 1.3),
            ("min_tokens", 4),
            ("stop_token_ids", [30]),
            ("include_stop_str_in_output", True),
            ("guided_choice", ["a", "b"]),
        ):
            err = error_of(server.post(path, {**body, field: value}), 400, "not supported")
            assert err["param"] == field
        for noop in ({"repetition_penalty": 1.0}, {"min_tokens": 0}, {"skip_special_tokens": True}):
            assert server.post(path, {**body, **noop, "max_tokens": 1}).status_code == 200
        err = error_of(server.post(path, {**body, "stream_options": {"include_usage": True}}), 400)
        assert err["param"] == "stream_options"
        err = error_of(server.post(path, {**body, "seed": 2**64}), 400, "seed")
        assert err["param"] == "seed"
    for field, value, what in (
        ("presence_penalty", 2.5, "presence_penalty"),
        ("logit_bias", {"x": 1}, "token ids"),
        ("logit_bias", {"1": 101}, "[-100, 100]"),
        ("logit_bias", {str(1 << 30): 1}, "token ids"),
        ("logit_bias", {"\u00b2": 1}, "token ids"),  # isdigit() but not int()
        ("logit_bias", {"1" * 5000: 1}, "token ids"),  # past int()'s digit limit
    ):
        err = error_of(server.post(chat_path, {**ok, field: value}), 400, what)
        assert err["param"] == field
    # OpenAI's limit of 4 stop strings; an empty one would end every reply at once; a null model
    # is more likely an unset variable than a wish for the served model (leaving it out is that).
    for path, body in ((chat_path, ok), ("/v1/completions", {**ok, "prompt": "x"})):
        for field, value, what in (
            ("stop", ["a", "b", "c", "d", "e"], "at most 4"),
            ("stop", "", "empty stop string"),
            ("stop", ["x", ""], "empty stop string"),
            ("model", None, "null is not a model name"),
        ):
            err = error_of(server.post(path, {**body, field: value}), 400, field, what)
            assert err["param"] == field
    no_model = {k: v for k, v in ok.items() if k != "model"}
    assert server.post(chat_path, {**no_model, "stop": ["a", "b", "c", "d"]}).status_code == 200
    null_user = {**ok, "messages": [{"role": "user", "content": None}]}
    err = error_of(server.post(chat_path, null_user), 400, "0: a 'user' message needs its content")
    assert err["param"] == "messages.0"
    error_of(server.post(chat_path, {**ok, "n": 2}), 400, "n=2")
    error_of(server.post(chat_path, {**ok, "top_logprobs": 2}), 400, "logprobs: true")
    err = error_of(server.post(chat_path, {**ok, "logprobs": True, "top_logprobs": 21}), 400)
    assert err["param"] == "top_logprobs"
    err = error_of(server.post("/v1/completions", {**ok, "prompt": "x", "logprobs": 21}), 400)
    assert err["param"] == "logprobs"
    # Fields this server ignores (clients send many) do not fail the request.
    assert server.post(chat_path, {**ok, "user": "u", "presence_penalty": 0}).status_code == 200
    long = {"model": MODEL, "prompt": list(range(10, 10 + CONTEXT)), "max_tokens": 1}
    err = error_of(server.post("/v1/completions", long), 400, str(CONTEXT), "no room is left for a")
    assert err["code"] == "context_length_exceeded"
    # a text past INLINE_TOKENIZE_CHARS, tokenized in a worker thread, and a chat the same
    text = {**long, "prompt": "word " * 4000}
    err = error_of(server.post("/v1/completions", text), 400, str(CONTEXT), "more than it holds")
    assert err["code"] == "context_length_exceeded"
    chat = {**ok, "messages": [{"role": "user", "content": "word " * 4000}]}
    err = error_of(server.post(chat_path, chat), 400, str(CONTEXT), "context")
    assert err["code"] == "context_length_exceeded"
    err = error_of(server.post(chat_path, {**ok, "max_tokens": CONTEXT}), 400, str(CONTEXT))
    assert err["param"] == "max_tokens"
    newer = {**ok, "max_completion_tokens": CONTEXT}  # the field the request used is named
    err = error_of(server.post(chat_path, newer), 400, "max_completion_tokens")
    assert err["param"] == "max_completion_tokens"
    error_of(server.post("/v1/completions", {**long, "prompt": [1 << 30]}), 400, "vocabulary")
    error_of(server.post(chat_path, {**ok, "model": "gpt-4"}), 404, "gpt-4", MODEL)
    error_of(server.post("/v1/nowhere", ok), 404, "/v1/nowhere")
    error_of(httpx.get(f"{server.url}/v1/completions", headers=auth()), 405, "GET")
    error_of(server.post(chat_path, ok, key="wrong"), 401, "API key")
    error_of(server.post(chat_path, ok, key=None), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without the key


def test_client_errors(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        chat(server, n=2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=str(CONTEXT)):
        complete(server, "word " * CONTEXT, max_tokens=1)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------------------------ curl


def curl(server: Server, path: str, body: str | None = None, stream: bool = False) -> tuple:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    cmd = ["curl", "-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {KEY}"]
    if stream:
        cmd.append("-N")
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", body]
    done = subprocess.run(cmd + [server.url + path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out, _, code = done.stdout.rpartition("\n")
    return int(code), out


def test_curl(server):
    expected = complete(server, max_tokens=8).choices[0].text
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    code, out = curl(server, "/v1/completions", json.dumps(body))
    assert code == 200 and json.loads(out)["choices"][0]["text"] == expected
    code, out = curl(server, "/v1/completions", json.dumps({**body, "stream": True}), stream=True)
    assert code == 200
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    code, out = curl(server, "/v1/chat/completions", '{"model": "x", "messages": [')
    assert code == 400 and "not valid JSON" in json.loads(out)["error"]["message"]
    # No model named: the served one (as vLLM).
    code, out = curl(
        server, "/v1/completions", json.dumps({k: body[k] for k in body if k != "model"})
    )
    assert code == 200 and json.loads(out)["model"] == MODEL
    code, out = curl(server, "/v1/models")
    assert code == 200 and json.loads(out)["data"][0]["id"] == MODEL


# ------------------------------------------------------------------------------------ metrics


def test_metrics(server):
    before = server.metrics()
    chat(server, max_tokens=4)
    server.post("/v1/chat/completions", "{bad")
    m = server.metrics()
    ok = 'strata_requests_total{endpoint="/v1/chat/completions",status="200"}'
    bad = 'strata_requests_total{endpoint="/v1/chat/completions",status="400"}'
    assert m[ok] == before.get(ok, 0) + 1
    assert m[bad] == before.get(bad, 0) + 1
    assert (
        m["strata_generation_tokens_total"] >= before.get("strata_generation_tokens_total", 0) + 1
    )
    assert m["strata_prompt_tokens_total"] > before.get("strata_prompt_tokens_total", 0)
    for h in ("strata_time_to_first_token_seconds", "strata_time_per_output_token_seconds"):
        buckets = [v for k, v in m.items() if k.startswith(h + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == m[h + "_count"] >= 1
        assert m[h + "_sum"] > 0
    assert m["strata_kv_blocks_total"] > 0
    assert m["strata_kv_blocks_in_use"] == 0
    assert m["strata_num_requests_running"] == 0 and m["strata_num_requests_waiting"] == 0
    assert m["strata_prefix_cache_queries_total"] >= m["strata_prefix_cache_hits_total"] > 0
    assert 0 < m["strata_prefix_cache_hit_rate"] <= 1
    # a plan without speculative decoding: its counters are there, at zero
    assert m["strata_spec_draft_tokens_total"] == m["strata_spec_accepted_tokens_total"] == 0
    # compiled passes apply only on MLX CUDA (the paged kernel): their counters are there, at 0
    assert m["strata_compiled_pass_traces_total"] == m["strata_compiled_pass_replays_total"] == 0
    assert m['strata_bytes_read_total{tier="gpu"}'] > 0
    assert "strata_preemptions_total" in m


def test_batch_invariant_server(server, smollm2_plan, tmp_path):
    """``serve --batch-invariant``: the gauge says so (the module's server says 0), and a
    completion gives the module's server's text."""
    assert server.metrics()["strata_batch_invariant"] == 0
    with serve_process(smollm2_plan, tmp_path / "stderr.txt", "--batch-invariant") as inv:
        assert inv.metrics()["strata_batch_invariant"] == 1
        text = complete(inv, max_tokens=3).choices[0].text
    assert text == complete(server, max_tokens=3).choices[0].text


# ------------------------------------------------------------------------------------ disconnects


def wait_for_idle(server: Server, timeout: float = 15) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = m["strata_num_requests_running"] + m["strata_num_requests_waiting"]
        if m["strata_kv_blocks_in_use"] == 0 and busy == 0:
            return m
        assert time.monotonic() < deadline, f"blocks never freed: {m['strata_kv_blocks_in_use']}"
        time.sleep(0.1)


def wait_for(server: Server, key: str, value: float, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()[key] != value:
        assert time.monotonic() < deadline, f"{key} never became {value}"
        time.sleep(0.05)


def open_stream(stack: contextlib.ExitStack, server: Server, body: dict) -> httpx.Response:
    return stack.enter_context(
        httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=auth()
        )
    )


def test_disconnect_frees_blocks(server, smollm2_plan):
    from strata.common.schemas import Plan
    from strata.common.yamlio import read_yaml

    max_seqs = read_yaml(smollm2_plan, Plan).batch.max_num_seqs
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with contextlib.ExitStack() as running:
        # Fill the batch with streams that are generating, then hang up on one still waiting.
        for _ in range(max_seqs):
            lines = open_stream(running, server, long).iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        assert server.metrics()["strata_kv_blocks_in_use"] > 0
        with contextlib.ExitStack() as queued:
            assert open_stream(queued, server, long).status_code == 200
            wait_for(server, "strata_num_requests_waiting", 1)
        wait_for(server, "strata_num_requests_waiting", 0)
        assert server.metrics()["strata_num_requests_running"] == max_seqs
    m = wait_for_idle(server)  # the generating streams were aborted when they closed
    generated = m["strata_generation_tokens_total"]
    time.sleep(0.5)
    assert server.metrics()["strata_generation_tokens_total"] == generated  # it really stopped
    # Not streaming: the client gives up waiting for the whole answer.
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", long, timeout=1.5)
    m = wait_for_idle(server)
    assert m['strata_requests_total{endpoint="/v1/completions",status="499"}'] >= 1
    assert chat(server, max_tokens=2).usage.completion_tokens >= 1  # the server still serves


def test_reset_prefix_cache(server):
    """vLLM's ``POST /reset_prefix_cache``: needs the key; 409 while a request runs; 200 once
    idle, after which a cached prompt is computed in full again."""
    ids = list(range(100, 117))  # one full KV block of 16 (the last token is always computed)

    def cached() -> int:
        return complete(server, ids, max_tokens=1).usage.prompt_tokens_details.cached_tokens

    error_of(server.post("/reset_prefix_cache", "", key=None), 401, "API key")
    error_of(httpx.get(f"{server.url}/reset_prefix_cache", headers=auth()), 405, "POST")
    cached()
    assert cached() == 16
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with contextlib.ExitStack() as running:
        lines = open_stream(running, server, long).iter_lines()  # kept: dropping it hangs up
        assert next(line for line in lines if line.startswith("data:"))
        err = error_of(server.post("/reset_prefix_cache", ""), 409, "running")
        assert err["code"] == "requests_running"
    wait_for_idle(server)
    r = server.post("/reset_prefix_cache", "")
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert cached() == 0
    m = server.metrics()
    assert m['strata_requests_total{endpoint="/reset_prefix_cache",status="200"}'] == 1
    assert m['strata_requests_total{endpoint="/reset_prefix_cache",status="409"}'] == 1


def test_concurrent_requests_match_sequential(server):
    expected = complete(server, max_tokens=6).choices[0].text
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(complete(server, max_tokens=6).choices[0].text)
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [expected, expected]


# ------------------------------------------------------------------------------------ access log

ACCESS = re.compile(
    r"^(?P<method>GET|POST) (?P<path>/\S*) (?P<status>\d{3})"
    r"(?: prompt=(?P<prompt>\d+) completion=(?P<completion>\d+)(?: ttft=(?P<ttft>\d+)ms)?)?"
    r" total=(?P<total>\d+)ms(?: \((?P<note>.+)\))?$"
)
"""An access-log line (``executor.server.access_log``)."""


def access_lines(log: Path) -> list[dict]:
    """The access-log lines in a server's stderr, parsed."""
    return [m.groupdict() for m in map(ACCESS.match, log.read_text().splitlines()) if m]


def new_access_lines(server: Server, before: int, count: int, timeout: float = 15) -> list[dict]:
    """The access-log lines after the first ``before``, once there are ``count`` of them (a
    line is written as its response ends, a moment after the client has read it)."""
    deadline = time.monotonic() + timeout
    while len(lines := access_lines(server.log)[before:]) < count:
        assert time.monotonic() < deadline, f"{len(lines)} of {count} lines: {lines}"
        time.sleep(0.05)
    time.sleep(0.2)
    lines = access_lines(server.log)[before:]
    assert len(lines) == count, lines  # one line per request, no more
    return lines


def test_access_log(server):
    """One line per request with its method, route, status, tokens and times: a chat, a
    streamed completion, a refused key, an open route, and a stream the client hangs up on."""
    before = len(access_lines(server.log))
    r = chat(server, max_tokens=4)
    _, _, usage = stream_complete(server, max_tokens=3)
    server.post("/v1/completions", {"prompt": PROMPT}, key="wrong")
    httpx.get(f"{server.url}/health", timeout=10)
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        lines = open_stream(stack, server, long).iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    chat_line, stream_line, refused, health_line, gone = new_access_lines(server, before, 5)
    assert chat_line["method"] == "POST" and chat_line["path"] == "/v1/chat/completions"
    assert chat_line["status"] == "200" and chat_line["note"] is None
    assert int(chat_line["prompt"]) == r.usage.prompt_tokens
    assert int(chat_line["completion"]) == r.usage.completion_tokens
    assert int(chat_line["ttft"]) <= int(chat_line["total"])
    assert stream_line["path"] == "/v1/completions" and stream_line["status"] == "200"
    assert (int(stream_line["prompt"]), int(stream_line["completion"])) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert stream_line["ttft"] is not None and stream_line["note"] is None
    assert refused["status"] == "401" and refused["prompt"] is None  # nothing generated
    assert (health_line["method"], health_line["path"], health_line["status"]) == (
        "GET",
        "/health",
        "200",
    )
    assert gone["path"] == "/v1/completions" and gone["note"] == "client disconnected"
    assert 1 <= int(gone["completion"]) < 1500
    wait_for_idle(server)


def test_quiet_server_takes_its_key_from_the_environment(smollm2_plan, tmp_path):
    """``serve --quiet``: no access log; ``STRATA_API_KEY`` is the key when no option gives
    one."""
    log = tmp_path / "stderr.txt"
    env = {"STRATA_API_KEY": f" {KEY}\n"}
    with serve_process(smollm2_plan, log, "--quiet", key=(), env=env) as srv:
        assert complete(srv, max_tokens=2).usage.completion_tokens >= 1
        error_of(srv.post("/v1/completions", {"prompt": PROMPT}, key="wrong"), 401, "API key")
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        time.sleep(0.2)
    assert access_lines(log) == [], log.read_text()


def test_access_log_notes_a_stream_that_ended_in_an_error(tokenizer, capsys):
    """A streamed request's status (200) is sent before its error: the line says what ended
    it. ``access_log=False`` (``--quiet``) writes nothing."""
    from starlette.testclient import TestClient
    from strata.executor.server import create_app

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
    with TestClient(create_app(FailingEngine(tokenizer), "m")) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and list(r.iter_lines())
    line = capsys.readouterr().err.strip()
    m = ACCESS.match(line)
    assert m, line
    assert m["status"] == "200" and (m["prompt"], m["completion"]) == ("3", "1")
    assert m["note"].startswith("stream ended with error 500:") and "out of memory" in m["note"]
    with TestClient(create_app(FailingEngine(tokenizer), "m", access_log=False)) as client:
        assert client.get("/health").status_code == 200
    assert capsys.readouterr().err == ""
    # a path that would write a second, forged line (or an escape) stays on its own line
    with TestClient(create_app(FailingEngine(tokenizer), "m")) as client:
        forged = "/v1/models%0APOST%20/v1/chat/completions%20200%20prompt=1%1B[2J"
        assert client.get(forged).status_code == 404
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, err
    assert err.startswith("GET /v1/models%0APOST%20/v1/chat/completions%20200%20prompt=1%1B"), err


# ------------------------------------------------------------------------------------ CLI


def test_serve_errors(tmp_path):
    """Bad plans and busy ports are one-line errors, before any model is loaded."""
    done = subprocess.run(
        [sys.executable, "execute.py", "serve", str(tmp_path / "missing.yaml"), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "execute.py", "serve", "unused.yaml", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert str(port) in done.stderr


# ------------------------------------------------------------------------------------ engine errors


class FailingEngine:
    """Stands in for ``ServingEngine`` to reach what a real engine failure does (a step that
    raises, which the real engine reports as an ``error`` event): one token, then the error."""

    context = CONTEXT
    failure = None  # no cluster rank stopped (ServingEngine.failure)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.aborted: list[str] = []

    def submit(self, req, on_event) -> None:
        from strata.executor.serving import TokenEvent

        if req.prompt_ids[0] == 0:
            raise RuntimeError("engine thread died")
        n = len(req.prompt_ids)

        def run() -> None:
            on_event(TokenEvent(req.request_id, [req.prompt_ids[-1]], None, n, 1, 0))
            on_event(TokenEvent(req.request_id, [], "error", n, 1, 0, "out of memory"))

        threading.Thread(target=run).start()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def metrics(self) -> dict:
        return {}


def test_engine_errors_and_missing_template(tokenizer):
    from starlette.testclient import TestClient
    from strata.executor.chat import ChatTemplate
    from strata.executor.server import create_app

    engine = FailingEngine(tokenizer)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
    with TestClient(create_app(engine, "m"), raise_server_exceptions=False) as client:
        err = error_of(client.post("/v1/completions", json=body), 500, "out of memory")
        assert err["type"] == "server_error"
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [e for e in r.iter_lines() if e]
        assert events[-1] == "data: [DONE]"
        assert "out of memory" in json.loads(events[-2][6:])["error"]["message"]
        error_of(client.post("/v1/completions", json={**body, "prompt": [0]}), 500, "died")
        assert client.get("/health").status_code == 200
        m = parse_prometheus(client.get("/metrics").text)
        assert m['strata_requests_total{endpoint="/v1/completions",status="500"}'] == 2
        chat_body = {"model": "m", "messages": CHAT}
        engine.tokenizer = copy.copy(tokenizer)
        engine.tokenizer.chat_template = None
        error_of(client.post("/v1/chat/completions", json=chat_body), 400, "--chat-template FILE")
        big = {"model": "m", "prompt": "x" * (17 << 20)}
        error_of(client.post("/v1/completions", json=big), 413, "MiB")
    assert engine.aborted == []  # errors end requests in the engine already: nothing to abort
    # serve --chat-template: a GGUF without a template renders chats with the given one.
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>", "test"
    )
    with TestClient(create_app(engine, "m", chat_template=template)) as client:
        r = client.post("/v1/chat/completions", json=chat_body)
        assert r.status_code == 500 and "out of memory" in r.text  # it reached the engine


def test_chats_that_get_no_render_worker_in_time_get_503_with_retry_after(tokenizer):
    """With every render worker held by a template that loops, a chat waits for one at most the
    pool's wait, then gets 503 ``render_busy`` with ``Retry-After``, naming the cause; a worker
    freed by the kill serves the next chat; once the workers are stopped (the server's
    shutdown) a chat gets 503 too, never a 400 blaming the messages."""
    import asyncio

    from strata.executor.chat import RENDER_RETRY_AFTER_S, RENDER_TIMEOUT_S, ChatTemplate
    from strata.executor.server import create_app

    template = ChatTemplate(
        "{% if messages[-1].content == 'loop' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>",
        "--chat-template loop.jinja",
    )
    app = create_app(FailingEngine(tokenizer), "m", chat_template=template, render_workers=1)
    renders = app.state.strata.renders
    renders.wait_s = 0.5

    def body(content: str) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            url = "/v1/chat/completions"
            loop = asyncio.create_task(client.post(url, json=body("loop")))
            await asyncio.sleep(0.3)  # the loop holds the only worker
            t0 = time.monotonic()
            r = await client.post(url, json=body("Hi"))
            assert 0.5 <= time.monotonic() - t0 < RENDER_TIMEOUT_S - 0.5
            err = error_of(r, 503, "chat template renders are all busy", "--render-workers")
            assert err["code"] == "render_busy" and err["type"] == "server_error"
            assert r.headers["retry-after"] == str(RENDER_RETRY_AFTER_S)
            error_of(await loop, 400, "--chat-template loop.jinja took over 2 s")
            r = await client.post(url, json=body("Hi"))  # rendered: it reached the engine
            assert r.status_code == 500 and "out of memory" in r.text, r.text
            renders.close()
            error_of(await client.post(url, json=body("Hi")), 503, "shutting down")

    try:
        asyncio.run(run())
    finally:
        renders.close()


@pytest.mark.parametrize("workers", ["0", "17", "-1"])
def test_render_workers_outside_1_to_16_is_a_one_line_error(workers, tmp_path, capsys):
    """``serve --render-workers`` takes 1..16: anything else is a one-line error (exit status 2)
    naming the option and the range, before anything is bound or loaded."""
    from strata.cli import main

    plan = str(tmp_path / "missing.yaml")  # never reached: the option is checked first
    assert main(["serve", plan, "--port", "0", "--render-workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--render-workers {workers}: give 1..16" in err, err


def test_short_prompts_are_tokenized_on_the_event_loop(monkeypatch):
    """Up to ``INLINE_TOKENIZE_CHARS`` characters the prompt is encoded in the calling task
    (a worker-thread round trip costs a prefix-cache hit's TTFT); longer ones in a worker
    thread, so that the loop keeps serving other streams."""
    import asyncio

    import strata.executor.server.routes as server

    hops = []

    async def threadpool(fn, *args):
        hops.append(len(args[0]))
        return fn(*args)

    monkeypatch.setattr(server, "run_in_threadpool", threadpool)
    limit = server.INLINE_TOKENIZE_CHARS
    for n in (10, limit, limit + 1):
        got = asyncio.run(server._tokenize(n, lambda text: [len(text)], "x" * n))
        assert got == [n]
    assert hops == [limit + 1]


def _serve_args(*argv: str):
    from strata.cli import _parser

    return _parser("strata", "", None).parse_args(["serve", "p.yaml", *argv])


def test_api_key_sources(tmp_path, monkeypatch):
    """``--api-key``, else ``--api-key-file``'s first line, else ``$STRATA_API_KEY`` (each
    without surrounding spaces, but --api-key as given), else no key."""
    from strata.executor.cli import api_key

    key_file = tmp_path / "key.txt"
    key_file.write_text(" from-file \nsecond line\n")
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv("STRATA_API_KEY", "  from-env\n")
    assert api_key(_serve_args()) == "from-env"
    assert api_key(_serve_args("--api-key-file", str(key_file))) == "from-file"
    assert api_key(_serve_args("--api-key", "from-option")) == "from-option"


@pytest.mark.parametrize(
    ("argv", "content", "env", "expected"),
    [
        (["--api-key", "k", "--api-key-file", "{file}"], "k", "", "keep one of them"),
        (["--api-key", " "], None, "", "--api-key is empty"),
        (["--api-key-file", "{file}"], None, "", "--api-key-file {file}: no such file"),
        (["--api-key-file", "{file}"], "", "", "{file}: the first line is empty"),
        (["--api-key-file", "{file}"], "  \nkey\n", "", "{file}: the first line is empty"),
        (["--api-key-file", "{file}"], b"\xff\xfe", "", "{file}: not UTF-8 text"),
        (["--api-key-file", "{dir}"], None, "", "--api-key-file {dir}: cannot read it"),
        ([], None, "  ", "STRATA_API_KEY holds only white space"),
    ],
)
def test_api_key_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, content, env, expected):
    """A bad key source is a one-line error (exit status 2) before anything is bound or loaded."""
    from strata.cli import main

    file = tmp_path / "key.txt"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif content is not None:
        file.write_text(content)
    fill = {"file": str(file), "dir": str(tmp_path)}
    monkeypatch.setenv("STRATA_API_KEY", env)
    plan = str(tmp_path / "missing.yaml")  # never reached: the key is checked first
    assert main(["serve", plan, "--port", "0", *(a.format(**fill) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected.format(**fill) in err, err
