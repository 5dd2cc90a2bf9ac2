"""``strata chat MODEL`` driven through a pseudo-terminal, as a user types: no plan or profile
given (the machine's kept profile, a plan cached by its inputs), Gemma's built-in chat template,
streamed multi-turn replies, ``/exit``, and Ctrl-C stopping a reply, then the chat."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_autoplan import cache, catalog_cache  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


class Terminal:
    """``strata chat ...`` on a pseudo-terminal's slave side; its screen read from the master."""

    def __init__(self, *args: str, stderr: Path):
        self.master, slave = os.openpty()
        self.err = stderr.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "chat", *args],
            cwd=ROOT,
            stdin=slave,
            stdout=slave,
            stderr=self.err,
            # Ctrl-C as a terminal gives it, whatever this process inherited (a shell's
            # background job starts with SIGINT ignored, and a child keeps that).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        os.close(slave)
        self.screen = ""

    def expect(self, text: str, timeout: float = 300.0) -> str:
        """Read the screen until ``text`` shows after what was read before; what came before it."""
        start = len(self.screen)
        deadline = time.monotonic() + timeout
        while text not in self.screen[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} on the screen: {self.screen[start:]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    assert self.proc.poll() is not None
                    raise AssertionError(f"exited before {text!r}: {self.screen[start:]!r}")
                self.screen += chunk.decode(errors="replace")
        i = self.screen.index(text, start)
        return self.screen[start:i]

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.master)
            self.err.close()


def _chat(tmp_path: Path, model: str, *extra: str) -> Terminal:
    return Terminal(model, "--max-tokens", "12", *extra, stderr=tmp_path / f"{model}.err")


def test_chat_with_gemma_twice_reusing_profile_and_plan(catalog_cache, tmp_path):  # noqa: F811
    for run in ("new", "cached"):
        t = _chat(tmp_path, "gemma3-270m")
        t.expect(">>> ")
        t.type("What is the capital of France?")
        first = t.expect(">>> ")
        t.type("And of Italy?")
        second = t.expect(">>> ")
        t.type("/exit")
        assert t.close() == 0
        err = (tmp_path / "gemma3-270m.err").read_text()
        assert f"({run})" in err, err
        assert "built-in gemma3 template" in err and "profiling" not in err
        # the typed line is echoed, then the streamed reply (12 tokens at most)
        assert first.startswith("What is the capital of France?") and len(first) > 35, first
        assert second.startswith("And of Italy?") and len(second) > 15, second
    assert len(list((catalog_cache / "plans").glob("*.yaml"))) == 1


def test_ctrl_c_stops_a_reply_then_the_chat(catalog_cache, tmp_path):  # noqa: F811
    t = Terminal("smollm2-135m", "--max-tokens", "400", stderr=tmp_path / "err")
    t.expect(">>> ")
    t.type("Write a long story about a dragon.")
    t.expect("Write a long story about a dragon.")
    t.expect(" ", timeout=120)  # the reply is streaming
    sent = time.monotonic()
    t.proc.send_signal(signal.SIGINT)
    t.expect(">>> ", timeout=10)
    assert time.monotonic() - sent < 2.0  # the reply stopped; the chat goes on
    assert "(stopped)" in (tmp_path / "err").read_text()
    t.type("/reset")
    t.expect(">>> ")
    # readline writes the prompt before it waits for a key: a signal in between is seen at the
    # next key (CPython's readline), which no person is quick enough to hit
    time.sleep(0.5)
    sent = time.monotonic()
    t.proc.send_signal(signal.SIGINT)  # at the prompt: the chat ends
    assert t.close() == 130
    assert time.monotonic() - sent < 2.0


def test_chat_refuses_a_template_that_cannot_render_and_unknown_commands(
    catalog_cache,  # noqa: F811
    tmp_path,
):
    """A template that fails on a first turn stops the chat before the model loads (status 2,
    one line); an unknown /command is said, not sent to the model."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('no chats here') }}")
    done = subprocess.run(
        [sys.executable, "-m", "strata", "chat", "smollm2-135m", "--chat-template", str(bad)],
        cwd=ROOT, input="hi\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"error: --chat-template {bad}: the chat template rejected the messages: no chats here"
    ), done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "strata", "chat", "smollm2-135m", "--max-tokens", "2"],
        cwd=ROOT, input="/foo\n/exit\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "unknown command /foo" in done.stderr
    assert done.stdout == ">>> >>> "  # no reply: nothing was sent to the model
