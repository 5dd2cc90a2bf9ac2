"""``strata serve`` on the catalog's Gemma-3-270M (no chat template in its GGUF) with
``--chat-template templates/gemma3.jinja``, through the official ``openai`` client: chat
completions answered, streamed and not, and one access-log line per request (issue 34)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import openai
from conftest import ROOT, make_plan_file
from test_server import ACCESS


def test_gemma_chat_through_the_openai_client(gemma3_gguf, tmp_path):
    plan = make_plan_file(str(gemma3_gguf), tmp_path / "gemma.yaml", context=512)
    log = tmp_path / "stderr.txt"
    template = ROOT / "templates" / "gemma3.jinja"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", str(plan), "--port", "0",
             "--chat-template", str(template)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"serving (\S+) on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        name, url = m.group(1), m.group(2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        stream = client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content  # greedy: the same reply
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
    lines = [ACCESS.match(line) for line in log.read_text().splitlines()]
    lines = [m for m in lines if m]
    assert [(m["method"], m["path"], m["status"]) for m in lines] == [
        ("POST", "/v1/chat/completions", "200"),
        ("POST", "/v1/chat/completions", "200"),
        ("GET", "/health", "200"),
    ], log.read_text()
    for m in lines[:2]:
        assert int(m["prompt"]) == reply.usage.prompt_tokens
        assert int(m["completion"]) == reply.usage.completion_tokens
        assert int(m["ttft"]) <= int(m["total"])
    assert "Traceback" not in log.read_text()
