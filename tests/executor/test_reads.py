"""Reads of the packed store finish: short reads are continued, an interrupted read is retried,
and a direct read the filesystem refuses (``EINVAL``, at open or later) falls back to buffered
reads with one warning line, the read method reported in the stats.

Faults are injected into ``executor.direct_io.read_once``, the one OS read every read of the
store goes through (pool, expert cache, embedding rows), so the store, its threads and its
fallback run for real.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import threading
from pathlib import Path

import pytest
from conftest import make_plan_file
from gguf_factory import write_arch_model
from strata.executor import direct_io
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.pack import PackStore
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

PROMPT = [504, 3575, 282, 4649, 314]
TOKENS = 6
CAP = 4096
"""Bytes a faulty read returns at most per call."""

needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


def _is_direct(fd: int) -> bool:
    return bool(hasattr(os, "O_DIRECT") and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class Faults:
    """A ``read_once`` that returns at most ``CAP`` bytes per call, raises ``InterruptedError``
    once (on its ``eintr_at``-th call), and ``EINVAL`` on every direct read from the
    ``einval_at``-th on (None: never); the counts tell what happened."""

    def __init__(self, real, eintr_at: int = 3, einval_at: int | None = 2):
        self.real, self.eintr_at, self.einval_at = real, eintr_at, einval_at
        self.lock = threading.Lock()
        self.calls = self.direct_calls = self.eintr = self.einval = 0
        self.short = 0  # calls that returned fewer bytes than asked

    def __call__(self, fd: int, mv: memoryview, offset: int) -> int:
        direct = _is_direct(fd)
        with self.lock:
            self.calls += 1
            self.direct_calls += direct
            if self.calls == self.eintr_at:
                self.eintr += 1
                raise InterruptedError(errno.EINTR, os.strerror(errno.EINTR))
            if direct and self.einval_at is not None and self.direct_calls >= self.einval_at:
                self.einval += 1
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            self.short += len(mv) > CAP
        return self.real(fd, mv[:CAP], offset)


@pytest.fixture
def faults(monkeypatch):
    """Installs a :class:`Faults` (``faults(**kw)``) and forgets earlier fallback warnings."""
    monkeypatch.setattr(direct_io, "_warned", set())

    def install(**kw) -> Faults:
        f = Faults(direct_io.read_once, **kw)
        monkeypatch.setattr(direct_io, "read_once", f)
        return f

    return install


def _ids(plan: Path, prompt=PROMPT, tokens=TOKENS, **gen_kw):
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()
    try:
        return generate(serving, prompt, SamplingParams(), tokens, **gen_kw)
    finally:
        serving.close()


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("warning:") and "buffered" in ln]


# ---------------------------------------------------------------- direct_io on a small file


def test_pread_into_finishes_short_and_interrupted_reads(tmp_path, faults):
    data = os.urandom(5 * CAP + 100)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    fault = faults(eintr_at=2, einval_at=None)
    fd = os.open(f, os.O_RDONLY)
    try:
        buf = bytearray(len(data) - 50)
        assert direct_io.pread_into(fd, memoryview(buf), 50) == len(data) - 50
        assert bytes(buf) == data[50:]
        assert fault.eintr == 1 and fault.short >= 5  # a read of 5 calls and more, one retried
        # Past the end: fewer bytes, only what the file holds (the caller's "damaged" case).
        tail = bytearray(3 * CAP)
        assert direct_io.pread_into(fd, memoryview(tail), len(data) - CAP) == CAP
        assert bytes(tail[:CAP]) == data[-CAP:]
    finally:
        os.close(fd)


def test_endless_interrupts_give_up(tmp_path, monkeypatch):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * CAP)
    calls = []

    def eintr(fd, mv, offset):
        calls.append(offset)
        raise InterruptedError(errno.EINTR, os.strerror(errno.EINTR))

    monkeypatch.setattr(direct_io, "read_once", eintr)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(InterruptedError):
            direct_io.pread_into(fd, memoryview(bytearray(CAP)), 0)
    finally:
        os.close(fd)
    assert len(calls) == direct_io.MAX_INTERRUPTED


@needs_o_direct
def test_refused_o_direct_at_open_warns_once(tmp_path, monkeypatch, capsys, faults):
    f = tmp_path / "f.pack"
    f.write_bytes(os.urandom(2 * CAP))
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a)

    faults(einval_at=None, eintr_at=0)  # capped reads only
    monkeypatch.setattr(os, "open", no_direct)
    files = [direct_io.UncachedFile(f), direct_io.UncachedFile(f)]  # a pool and an expert cache
    try:
        assert [(x.direct, x.read_method) for x in files] == [(False, "buffered")] * 2
        assert "refused O_DIRECT" in files[0].method
    finally:
        for x in files:
            x.close()
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and str(f) in lines[0] and "EINVAL" in lines[0], lines


@needs_o_direct
def test_einval_on_a_later_read_falls_back(tmp_path, capsys, faults):
    """The first direct read works, the next ones are refused: the file is read buffered from
    then on, the bytes are right, and the warning comes once."""
    data = os.urandom(8 * CAP)
    f = tmp_path / "f.pack"
    f.write_bytes(data)
    fault = faults(eintr_at=0, einval_at=2)
    uf = direct_io.UncachedFile(f)
    try:
        if not uf.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        assert fault.direct_calls == 1  # the probe at open
        buf = memoryview(mmap.mmap(-1, 4 * CAP))  # aligned for O_DIRECT
        for off in (0, 4 * CAP):
            while True:  # as the store's SlotArena reads
                fd = uf.fd
                try:
                    got = direct_io.pread_into(fd, buf, off)
                    break
                except OSError as e:
                    uf.fall_back(fd, off, e)
            assert got == 4 * CAP and bytes(buf) == data[off : off + 4 * CAP]
        assert fault.einval == 1 and not uf.direct and uf.read_method == "buffered"
        assert "at byte 0 was refused (EINVAL)" in uf.method
        with pytest.raises(OSError, match="Input/output"):  # other errors are not fallen back on
            uf.fall_back(uf.fd, 0, OSError(errno.EIO, os.strerror(errno.EIO)))
    finally:
        uf.close()
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and str(f) in lines[0], lines


# ---------------------------------------------------------------- the store, end to end


@pytest.fixture(scope="module")
def resident_ids(smollm2_serving) -> list[int]:
    """Greedy ids of the all-resident SmolLM2 plan."""
    return generate(smollm2_serving, PROMPT, SamplingParams(), TOKENS).output_ids


@pytest.mark.parametrize(
    ("name", "einval_at"), [("ffn-nvme", 2), ("ffn-nvme", 200), ("all-nvme", 2)]
)
def test_streamed_plans_survive_faulty_reads(
    budget_plans, resident_ids, faults, capsys, name, einval_at
):
    """Acceptance 5: reads capped at 4 KiB per call, one EINTR, and EINVAL on the direct reads
    from the ``einval_at``-th on (2: right after the probe at open, the first read; 200: inside
    a unit, part of it read direct): the streamed plans (every FFN; every unit, the embedding's
    rows included) give the all-resident ids, read buffered after one warning, and say so in
    the stats."""
    fault = faults(eintr_at=3, einval_at=einval_at)
    gen = _ids(budget_plans[name])
    assert gen.output_ids == resident_ids
    assert fault.eintr == 1 and fault.short > 0
    err = capsys.readouterr().err
    if fault.direct_calls:  # the filesystem took O_DIRECT: the later reads were refused
        assert fault.einval >= 1
        assert "EINVAL" in gen.stats["read_method_detail"]
    assert gen.stats["read_method"] == "buffered"
    assert len(_warnings(err)) == 1, err


def test_clean_reads_report_their_method(budget_plans, smollm2_plan, resident_ids):
    """Without faults: the read method the packed store's filesystem gives (direct on a disk,
    buffered where O_DIRECT is refused), and none for a plan that streams nothing."""
    gen = _ids(budget_plans["ffn-nvme"])
    assert gen.output_ids == resident_ids
    store = PackStore.paths(load_plan(budget_plans["ffn-nvme"]).desc.model.sha256)[0]
    fd, direct, method = direct_io.open_uncached(store)  # what the store's reads were told
    os.close(fd)
    assert gen.stats["read_method"] == ("direct" if direct else "buffered")
    assert gen.stats["read_method_detail"] == method
    resident = _ids(smollm2_plan)
    assert resident.stats["read_method"] is None and resident.stats["read_method_detail"] is None


def test_run_json_reports_the_read_method(budget_plans):
    """``strata run --json`` carries the read method in its stats."""
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run(
        [sys.executable, "execute.py", "run", str(budget_plans["ffn-nvme"])]
        + ["--prompt", "The capital of France is", "--max-tokens", "2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["read_method"] in ("direct", "buffered")
    assert stats["read_method_detail"]


def test_moe_streamed_experts_survive_faulty_reads(smollm2_gguf, tmp_path, monkeypatch, faults):
    """The expert cache's reads (its own slot arena) under the same faults: a tiny mixtral with
    every unit streamed gives the ids of its all-resident plan."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    gguf = write_arch_model(tmp_path / "mixtral.gguf", "mixtral", smollm2_gguf)
    resident = make_plan_file(str(gguf), tmp_path / "resident.yaml", context=64)
    streamed = make_plan_file(str(gguf), tmp_path / "nvme.yaml", context=64, tiers=["nvme"])
    prompt = [1, 17, 400, 2048, 77, 9001, 31, 5]
    want = _ids(resident, prompt, 6, stop_at_eog=False)
    fault = faults(eintr_at=3, einval_at=2)
    gen = _ids(streamed, prompt, 6, stop_at_eog=False)
    assert gen.output_ids == want.output_ids
    assert gen.stats["experts"]["misses"] > 0 and gen.stats["read_method"] == "buffered"
    assert fault.eintr == 1 and fault.short > 0


def test_bench_reports_the_read_method(budget_plans, faults):
    """``strata bench``'s result carries the read method in force after the run: buffered once
    a direct read was refused."""
    from strata.benchmarks.bench import bench

    fault = faults(eintr_at=3, einval_at=2)
    r = bench(str(budget_plans["ffn-nvme"]), "The capital of France is", 2, "none")
    assert r["read_method"] == "buffered" and r["tiers"]["nvme"] > 0
    if fault.direct_calls:
        assert "EINVAL" in r["read_method_detail"]
