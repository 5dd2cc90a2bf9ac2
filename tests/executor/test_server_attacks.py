"""Hostile clients and a hostile chat template against a real ``execute.py serve`` on 127.0.0.1
(issue 35, acceptance 2): every attack gets a clear answer or a closed connection, while a
watcher asks ``/health`` every 0.2 s and every answer must come within 1 s; the server then
exits on SIGTERM, and its memory has not grown by the gigabytes a template could ask for.

One server serves the module: SmolLM2 planned for one running sequence (``max_num_seqs`` 1)
with ``--max-waiting 1``, ``--read-timeout 2`` (so that slow clients are cut within seconds),
``--max-connections 150``, ``--render-workers 3``, a non-ASCII API key and a chat template that
misbehaves as the last message asks. When it stops, no render worker outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "clé-ключ-🔑"
AUTH = {"Authorization": b"Bearer " + KEY.encode()}
READ_TIMEOUT = 2
MAX_CONNECTIONS = 150
RENDER_WORKERS = 3

# The template's misbehaviour is picked by the last message's content; sizes come from the
# messages so that Jinja cannot fold them while compiling.
TEMPLATE = """\
{%- set c = messages[-1].content -%}
{%- set n = messages|length -%}
{%- if c == 'loop' -%}
{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor -%}
{%- elif c == 'range' -%}{{ range(10**9)|list|length }}
{%- elif c == 'macro' -%}{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}
{%- elif c == 'mul-float' -%}{{ 'x' * (n * 3e9) }}
{%- elif c == 'mul' -%}{{ 'x' * (n * 3000000000) }}
{%- elif c == 'tojson' -%}{{ messages|tojson(indent=n * 300000000) }}
{%- elif c == 'double' -%}
{%- set ns = namespace(s='x') -%}
{%- for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}
{%- elif c == 'long' -%}{{ 'y' * (n * 40000000) }}
{%- elif c == 'fail' -%}{{ 1 / 0 }}
{%- else -%}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% endif -%}
"""


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    template: str
    health: list[str] = field(default_factory=list)  # failures seen by the watcher

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def post(self, path: str, body: dict, timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=AUTH, timeout=timeout)

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def _watch_health(server: Server, stop: threading.Event) -> None:
    """Ask /health every 0.2 s; note every answer that takes over 1 s or is not 200/503."""
    with httpx.Client(timeout=1.0) as client:
        while not stop.wait(0.2):
            t0 = time.monotonic()
            try:
                r = client.get(f"{server.url}/health")
                if r.status_code not in (200, 503):  # 503: the connection cap is reached
                    server.health.append(f"status {r.status_code}")
            except httpx.HTTPError as e:
                server.health.append(f"{type(e).__name__} after {time.monotonic() - t0:.2f} s")


@pytest.fixture(scope="module")
def server(smollm2_plan, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("attacks")
    plan = yaml.safe_load(smollm2_plan.read_text())
    plan["batch"]["max_num_seqs"] = 1
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    (folder / "key.txt").write_text(KEY + "\n", encoding="utf-8")
    template = folder / "hostile.jinja"
    template.write_text(TEMPLATE)
    log = folder / "stderr.txt"
    options = [
        *("--api-key-file", str(folder / "key.txt")),
        *("--chat-template", str(template)),
        *("--max-waiting", "1", "--read-timeout", str(READ_TIMEOUT)),
        *("--max-connections", str(MAX_CONNECTIONS)),
        *("--render-workers", str(RENDER_WORKERS)),
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "execute.py", "serve", str(folder / "plan.yaml"), "--port", "0"]
            + options,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 120
    while not (m := re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()}")
        time.sleep(0.1)
    srv = Server(m.group(1), proc, log, f"--chat-template {template}")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(srv, stop))
    watcher.start()
    try:
        yield srv
    finally:
        stop.set()
        watcher.join()
        workers = _render_workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    alive = [pid for pid in workers if _alive(pid)]  # at once: the server killed and reaped them
    assert workers and not alive, (workers, alive)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    assert "without an API key" not in text  # a key is set
    assert srv.health == [], srv.health


def _render_workers(parent: int) -> list[int]:
    """The pids of ``parent``'s render worker processes (``... --render-worker``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"--render-worker" in cmdline:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for w in words:
        assert w in message, message
    return message


def test_hostile_templates_get_400s_and_leave_no_memory_behind(server):
    """Each misbehaviour ends in a 400 naming the template, within the 2 s budget (plus
    margin), and the server's own memory does not grow: the render ran in the worker."""
    rss = server.rss_mib()
    cases = {
        "loop": "took over 2 s",
        "range": "Range too big",
        "macro": "recursed too deeply",
        "mul-float": "TypeError",
        # Memory-hungry renders: the cap's 400, or under heavy load (a CI run beside other
        # work, 2026-12-07) the clock's: both bounded 400s naming the template, and the server's
        # memory is checked below; test_chat_template proves the cap itself on these cases.
        "mul": ("MiB to render", "took over 2 s"),
        "tojson": ("MiB to render", "took over 2 s"),
        "double": ("MiB to render", "took over 2 s"),
        "long": "Mi characters",
        "fail": "ZeroDivisionError",
    }
    for content, words in cases.items():
        t0 = time.monotonic()
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        r = server.post("/v1/chat/completions", body)
        if isinstance(words, tuple):  # either answer
            message = _error(r, 400, server.template)
            assert any(w in message for w in words), message
        else:
            _error(r, 400, server.template, words)
        assert time.monotonic() - t0 < 6, content
    hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = server.post("/v1/chat/completions", hi)
    assert r.status_code == 200, r.text  # the worker was restarted after each kill
    assert server.rss_mib() - rss < 200


def test_looping_templates_hold_one_render_worker_each_not_every_chat(server):
    """Two chats whose template loops, at once, hold two of the three render workers for their
    2 s; a third, normal chat meanwhile renders in the free one and is answered in about its own
    time (a worker start and a render: its ``max_tokens`` over the context gets the 400 that
    follows tokenizing, so no generation is timed), not after theirs."""
    results: list[httpx.Response] = []

    def hostile() -> None:
        body = {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 1}
        results.append(server.post("/v1/chat/completions", body))

    normal = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6}
    threads = [threading.Thread(target=hostile) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # both loops are rendering
    t0 = time.monotonic()
    r = server.post("/v1/chat/completions", normal)
    took = time.monotonic() - t0
    for t in threads:
        t.join()
    _error(r, 400, "plus max_tokens")  # rendered and tokenized
    assert took < 1.0, took  # the loops end 1.7 s later
    assert len(_render_workers(server.proc.pid)) <= RENDER_WORKERS
    assert len(results) == 2
    for r in results:
        _error(r, 400, server.template, "took over 2 s")


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_trickled_and_idle_heads_are_cut_at_the_read_timeout(server):
    """100 connections sending their head a byte at a time, and one that sends nothing, are
    closed within the read timeout (the trickling ones with a 408)."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    socks = [_connect(server) for _ in range(100)]
    idle = _connect(server)
    t0 = time.monotonic()
    closed = [False] * len(socks)
    for i in range(len(head)):
        if time.monotonic() - t0 > READ_TIMEOUT + 3:
            break
        for k, s in enumerate(socks):
            if not closed[k]:
                try:
                    s.send(head[i : i + 1])
                except OSError:
                    closed[k] = True
        time.sleep(0.05)
    for s in socks:
        assert b" 408 " in _read_all(s, 5).split(b"\r\n")[0]
        s.close()
    assert time.monotonic() - t0 < READ_TIMEOUT + 6
    assert _read_all(idle, 5) == b""
    idle.close()


def test_huge_and_numerous_headers_get_431(server):
    """A 64 MiB header is not read beyond the 64 KiB cap: 431 and the connection closed; so
    are 200 header fields."""
    sock = _connect(server)
    sent = 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        block = b"a" * 2**20
        for _ in range(64):
            sock.sendall(block)
            sent += len(block)
    except OSError:
        pass  # the server closed the connection: it stopped reading
    assert sent < 8 * 2**20
    sock.close()
    sock = _connect(server)
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(200))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    answer = _read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"header fields" in answer
    sock.close()


def test_bodies_announced_and_not_sent(server):
    """A body announced over 16 MiB gets 413 at once; one announced and stopped halfway gets
    408 after the read timeout; both connections are closed."""
    head = (
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer "
        )
        + KEY.encode()
        + b"\r\n"
    )
    sock = _connect(server)
    sock.sendall(head + b"Content-Length: 100000000\r\n\r\n" + b"{" * 1024)
    t0 = time.monotonic()
    answer = _read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert time.monotonic() - t0 < 2
    sock.close()
    sock = _connect(server)
    sock.sendall(head + b"Content-Length: 10000\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
    t0 = time.monotonic()
    answer = _read_all(sock, READ_TIMEOUT + 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"stopped arriving" in answer
    assert READ_TIMEOUT - 0.5 < time.monotonic() - t0 < READ_TIMEOUT + 3
    sock.close()


def test_a_body_left_unread_after_an_early_answer_is_not_a_next_request(server):
    """A request answered before its body came (a wrong key: 401) has its connection closed
    after the answer: the 300 KiB of body that follow are never read as the next request's
    head (which answered a second, stale 431 on the same connection)."""
    sock = _connect(server)
    body = b"{" + b"a" * (300 << 10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer wrong\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with contextlib.suppress(OSError):  # the server may close while the body is sent
        sock.sendall(body)
    answer = _read_all(sock, 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:400]


def test_connection_cap_answers_503_then_recovers(server):
    """Past --max-connections open connections a request gets 503 at once; once the idle ones
    are closed (the read timeout), requests are served again."""
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=5)
        assert r.status_code == 503
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_non_ascii_api_key(server):
    """The key is compared as UTF-8 bytes: the right key (sent as UTF-8) passes, a wrong one
    or the key's Latin-1 reading does not."""
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    for token in (b"cle", KEY.encode()[:-1], KEY.encode("utf-8").decode("latin-1").encode()):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": b"Bearer " + token})
        assert r.status_code == 401


def test_max_completion_tokens_on_both_endpoints(server):
    """``max_completion_tokens`` is honoured on /v1/completions as on chat, and wins over
    ``max_tokens`` on both; an over-long one is named in the error."""
    for path, body in (
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {**body, "temperature": 0, "ignore_eos": True}
        r = server.post(path, {**body, "max_completion_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3, r.text
        r = server.post(path, {**body, "max_tokens": 5, "max_completion_tokens": 2})
        assert r.json()["usage"]["completion_tokens"] == 2, r.text
        r = server.post(path, {**body, "max_tokens": 2, "max_completion_tokens": 10**6})
        assert r.json()["error"]["param"] == "max_completion_tokens"


def test_waiting_queue_limit_and_queued_comments(server):
    """With one sequence running and --max-waiting 1, a second stream waits and gets
    ': queued' comments before its first token; a third request gets 429 with Retry-After."""
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=30, headers=AUTH))
        url = f"{server.url}/v1/completions"
        first = stack.enter_context(client.stream("POST", url, json=body))
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # running: it has a token
        second = stack.enter_context(
            client.stream("POST", f"{server.url}/v1/completions", json=body)
        )
        assert second.status_code == 200
        r = client.post(f"{server.url}/v1/completions", json={**body, "stream": False})
        _error(r, 429, "--max-waiting 1")
        assert r.headers["retry-after"] == "1"
        r = client.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "loop"}]},
        )
        assert r.status_code == 429  # refused before the template is rendered
        chunk = next(second.iter_raw())
        assert chunk.startswith(b": queued\n\n"), chunk
    # both streams closed: their requests are aborted and the queue is free again
    deadline = time.monotonic() + 10
    while server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_warning_when_serving_beyond_loopback_without_a_key(smollm2_plan, tmp_path):
    """``--host 0.0.0.0`` without a key: one warning line at start (before the plan loads)."""
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "execute.py", "serve", str(smollm2_plan), "--host", "0.0.0.0"]
            + ["--port", "0"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={k: v for k, v in os.environ.items() if k != "STRATA_API_KEY"},
        )
    try:
        deadline = time.monotonic() + 60
        while "without an API key" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        line = next(x for x in log.read_text().splitlines() if "without an API key" in x)
        assert line.startswith("warning: serving on 0.0.0.0") and "--api-key-file" in line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_loopback_addresses():
    from strata.executor.server.app import _loopback, bind_socket

    for host, loop in (("127.0.0.1", True), ("0.0.0.0", False), ("localhost", True)):
        sock = bind_socket(host, 0)
        try:
            assert _loopback(sock) is loop, host
        finally:
            sock.close()


def test_serve_option_defaults_match_help():
    """``serve --help`` states the defaults the server module holds."""
    from strata.executor.chat import DEFAULT_RENDER_WORKERS, MAX_RENDER_WORKERS
    from strata.executor.server.app import DEFAULT_MAX_CONNECTIONS
    from strata.executor.server.protocol import BODY_READ_TIMEOUT_S, DEFAULT_MAX_WAITING

    out = subprocess.run(
        [sys.executable, "execute.py", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    text = " ".join(out.split())
    assert f"batch ({DEFAULT_MAX_WAITING})" in text
    assert f"get 503 ({DEFAULT_MAX_CONNECTIONS})" in text
    assert f"body ({BODY_READ_TIMEOUT_S:g})" in text
    assert f"1..{MAX_RENDER_WORKERS} ({DEFAULT_RENDER_WORKERS})" in text
    json.dumps(text)  # the help is plain text
