"""Every read of the packed store is checked against its unit's CRC-32, not only a pack whose
modification time moved: one byte flipped in place (bit rot, the mtime kept) stops the run with
one clear error naming the pack and the unit, and the next start rebuilds the pack and runs
right (issue 35)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import ROOT, make_plan_file
from gguf_factory import write_tiny_llama
from strata.common.errors import StrataError
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.pack import PackStore, crc32_combine
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

PROMPT = [1, 17, 40, 200, 77, 9, 31, 5]
TOKENS = 6


def test_crc32_combine_is_zlibs():
    rng = random.Random(0)
    for n1, n2 in [(0, 0), (0, 7), (5, 0), (1, 1), (4096, 4 << 20), (12345, 67891)]:
        n1, n2 = n1 or rng.randrange(2), n2
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny llama in a private cache, planned three ways: ``nvme`` (every unit streamed, the
    embedding read by rows), ``ffn`` (the FFNs streamed, the rest resident, by a device budget as
    ``conftest.budget_plans`` makes them) and ``resident``."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3))
    free = load_plan(make_plan_file(model, tmp_path / "resident.yaml", context=64)).plan
    units = {p.unit: p.bytes for p in free.placement}
    ffn = [b for u, b in units.items() if u.endswith(".ffn")]
    attn = [b for u, b in units.items() if u.endswith(".attn")]
    gpu = free.memory["gpu"]
    budget = gpu.kv_cache + gpu.activations + sum(units.values()) - sum(ffn)
    budget += 2 * max(ffn) + min(attn) // 2
    plans = {
        "resident": tmp_path / "resident.yaml",
        "nvme": make_plan_file(model, tmp_path / "nvme.yaml", context=64, tiers=["nvme"]),
        "ffn": make_plan_file(
            model,
            tmp_path / "ffn.yaml",
            context=64,
            gpu_budget_bytes=budget,
            ram_budget_bytes=budget,
        ),
    }
    tiers = load_plan(plans["ffn"]).plan.tier_of()
    streamed = {u for u, t in tiers.items() if t == "nvme"}
    assert streamed == {u for u in units if u.endswith(".ffn")}, tiers
    assert set(load_plan(plans["nvme"]).plan.tier_of().values()) == {"nvme"}
    return plans


def _ids(plan: Path) -> list[int]:
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()
    try:
        return generate(serving, PROMPT, SamplingParams(), TOKENS, stop_at_eog=False).output_ids
    finally:
        serving.close()


def _flip(plan: Path, unit: str) -> PackStore:
    """Flip one byte inside ``unit``'s part of the pack (its last part's first byte: a scale, a
    weight) and put the file's modification time back: the start's check cannot see it."""
    loaded = load_plan(plan)
    store = PackStore.open_or_build(loaded.gguf, loaded.desc, loaded.desc.model.sha256)
    u = store.units[unit]
    st = store.path.stat()
    with open(store.path, "r+b") as f:
        f.seek(u.offset + u.parts[-1].offset)
        byte = f.read(1)
        f.seek(u.offset + u.parts[-1].offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(store.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store.path.stat().st_mtime_ns == st.st_mtime_ns
    return store


@pytest.mark.parametrize(("plan", "unit"), [("ffn", "blk.1.ffn"), ("nvme", "token_embd")])
def test_a_flipped_byte_of_a_streamed_unit_stops_the_run_and_is_rebuilt(tiny, capsys, plan, unit):
    """A streamed unit (read whole into a pool slot) and the embedding (read by rows, checked
    whole on first use): the run stops with the error, the manifest is marked stale, and the
    next start checks the pack, rebuilds it and gives the clean run's ids."""
    want = _ids(tiny["resident"])
    assert _ids(tiny[plan]) == want
    store = _flip(tiny[plan], unit)
    capsys.readouterr()
    with pytest.raises(StrataError) as e:
        _ids(tiny[plan])
    msg = str(e.value)
    assert str(store.path) in msg and f"unit {unit}'s bytes" in msg and "rebuilds" in msg, msg
    assert json.loads(store.manifest.read_text())["mtime_ns"] is None  # stale: checked next
    assert _ids(tiny[plan]) == want
    assert "checking the packed store" in capsys.readouterr().err  # checked, then rebuilt
    assert _ids(tiny[plan]) == want  # rebuilt and recorded: not checked again
    assert "checking" not in capsys.readouterr().err


def test_a_resident_unit_comes_from_the_gguf_and_its_pack_bytes_are_checked_when_streamed(tiny):
    """Resident units are loaded from the GGUF, never from the pack: a flipped byte in the pack
    where a unit resident in this plan lies changes nothing in its runs, and a plan that streams
    that unit stops on it."""
    want = _ids(tiny["resident"])
    _flip(tiny["ffn"], "blk.1.attn")  # resident in the ffn plan, streamed in the nvme plan
    assert _ids(tiny["ffn"]) == want
    with pytest.raises(StrataError, match=r"unit blk\.1\.attn's bytes"):
        _ids(tiny["nvme"])
    assert _ids(tiny["nvme"]) == want


def test_the_command_line_gives_one_line(tiny, tmp_path):
    """``strata run`` on the damaged pack: exit 2 and one ``error:`` line (no traceback, no
    tokens); run again: the right ids."""
    want = _ids(tiny["resident"])
    _flip(tiny["nvme"], "blk.2.ffn")
    cmd = [sys.executable, "execute.py", "run", str(tiny["nvme"]), "--prompt-ids"]
    cmd += [",".join(map(str, PROMPT)), "--max-tokens", str(TOKENS), "--json"]
    env = {**os.environ}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    # The command's own line is the last; the serving engine logs the failed step before it.
    assert errors and all("unit blk.2.ffn's bytes" in ln for ln in errors), done.stderr
    assert "the packed store" in errors[-1] and "rebuilds it" in errors[-1], done.stderr
    assert not done.stdout.strip()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_ids"][: len(want)] == want


def test_a_flipped_byte_of_a_streamed_expert_stops_the_run(smollm2_gguf, tmp_path, monkeypatch):
    """The expert cache's reads (its own slot arena) are checked too: a tiny mixtral with every
    unit streamed, one byte flipped in each expert of block 0 (some of them are routed to)."""
    from gguf_factory import write_arch_model

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    gguf = write_arch_model(tmp_path / "mixtral.gguf", "mixtral", smollm2_gguf)
    plan = make_plan_file(str(gguf), tmp_path / "nvme.yaml", context=64, tiers=["nvme"])
    want = _ids(plan)
    experts = [u for u in load_plan(plan).plan.tier_of() if u.startswith("blk.0.expert.")]
    assert experts
    for unit in experts:
        _flip(plan, unit)
    with pytest.raises(StrataError, match=r"unit blk\.0\.expert\.\d+'s bytes as read"):
        _ids(plan)
    assert _ids(plan) == want
