"""The NVMe tier's failure paths (its numbers are checked in test_tiers.py): a short or failed
read is an error, and the I/O threads stop on errors, on Ctrl-C and at close."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT
from strata.common.errors import StrataError
from strata.executor import streaming
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine


def _io_threads(before: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """Names of the threads of Strata's alive in this process (the serving engine's, prefetch
    and read workers) but for ``before`` (another test file's session engine may still run)."""
    return [
        t.name for t in threading.enumerate() if t.name.startswith("strata-") and t not in before
    ]


def _serving(engine: Engine) -> ServingEngine:
    """A started serving engine over ``engine`` (``strata run``'s)."""
    serving = ServingEngine(engine)
    serving.start()
    return serving


def _generate_until_error(budget_plans, monkeypatch, fault) -> StrataError:
    before = frozenset(threading.enumerate())
    serving = _serving(Engine(load_plan(budget_plans["ffn-nvme"])))
    engine = serving.engine
    try:
        monkeypatch.setattr(streaming, "pread_into", fault)
        # Slots already read before the fault still serve; the next read fails loudly.
        with pytest.raises(StrataError) as e:
            for _ in range(3):
                generate(serving, [504, 3575], SamplingParams(), 2)
    finally:
        serving.close()
    assert not engine.store.pool  # closed
    assert _io_threads(before) == []  # and its threads joined
    return e.value


def test_short_read_is_an_error(budget_plans, monkeypatch):
    real = streaming.pread_into
    err = _generate_until_error(
        budget_plans, monkeypatch, lambda fd, mv, off: real(fd, mv, off) - 1
    )
    assert "short read" in str(err) and "packed store" in str(err)


def test_failed_read_is_an_error(budget_plans, monkeypatch):
    def eio(fd, mv, off):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    err = _generate_until_error(budget_plans, monkeypatch, eio)
    assert "Input/output error" in str(err) and "blk." in str(err)


def test_ctrl_c_stops_the_io_threads(budget_plans):
    before = frozenset(threading.enumerate())
    serving = _serving(Engine(load_plan(budget_plans["ffn-nvme"])))
    assert _io_threads(before)  # the prefetch thread runs while the engine is open

    def interrupt(piece: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        try:
            generate(serving, [504, 3575], SamplingParams(), 4, on_text=interrupt)
        finally:
            serving.close()  # what execute.py run does on every way out
    assert _io_threads(before) == []


def test_ctrl_c_in_execute_run_exits_cleanly(budget_plans):
    """SIGINT to ``execute.py run`` mid-generation: exit 130, one line, no traceback, no hang."""
    proc = subprocess.Popen(
        [sys.executable, "execute.py", "run", str(budget_plans["ffn-nvme"]), "--prompt", "Hi",
         "--max-tokens", "200"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A runner started in the background by a shell ignores SIGINT, and a child inherits
        # that (Python then installs no handler): give the child a terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.read(1)  # generation has started: the first text arrived
    status = Path(f"/proc/{proc.pid}/status")  # the signal masks, should the signal be lost
    masks = (
        [ln for ln in status.read_text().splitlines() if ln.startswith("Sig")]
        if status.exists()
        else []
    )
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"{err}\n{masks}"
    assert "interrupted" in err and "Traceback" not in err


def test_staged_reads_give_the_same_weights(budget_plans, monkeypatch):
    """The CUDA read path (``RuntimeConfig.stage_direct_reads``: direct I/O into a host buffer,
    then a copy into the slot) gives the same greedy ids as this backend's default reads, through
    the chunking of units larger than one buffer (a CHUNK shrunk to force several per unit)."""

    def ids(**settings):
        loaded = load_plan(budget_plans["ffn-nvme"])
        engine = Engine(loaded, config=RuntimeConfig.build(loaded.plan.runtime, **settings))
        serving = _serving(engine)
        try:
            assert engine.store.pool is not None
            return generate(serving, [504, 3575, 28], SamplingParams(), 6).output_ids
        finally:
            serving.close()

    want = ids()
    monkeypatch.setattr(streaming, "CHUNK", 64 << 10)
    real_init = streaming.SlotArena.__init__

    def staged_init(self, *a, **k):
        real_init(self, *a, **k)
        self._staged = True  # also where the test's filesystem refuses O_DIRECT

    monkeypatch.setattr(streaming.SlotArena, "__init__", staged_init)
    staged = []
    real_pread = streaming.pread_into

    def pread(fd, mv, off):
        staged.append((type(mv.obj).__name__, len(mv)))
        return real_pread(fd, mv, off)

    monkeypatch.setattr(streaming, "pread_into", pread)
    assert ids(stage_direct_reads=True) == want
    assert staged and {kind for kind, _ in staged} == {"mmap"}  # into the host buffer
    assert max(n for _, n in staged) <= 64 << 10
