"""A packed store whose manifest no longer describes it, or whose bytes changed since it was
built, is rebuilt, never read (issue 35: one unit's offset moved in the manifest, or one scale
byte zeroed, ran and emitted token 0)."""

from __future__ import annotations

import json

from conftest import make_plan_file
from gguf_factory import write_tiny_llama
from strata.executor.direct_io import ALIGN
from strata.executor.pack import PackStore
from strata.executor.plan_loader import load_plan


def test_a_moved_unit_offset_or_a_foreign_unit_rebuilds_the_pack(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3)
    loaded = load_plan(make_plan_file(str(model), tmp_path / "p.yaml", context=64))
    g, desc, sha = loaded.gguf, loaded.desc, loaded.desc.model.sha256
    first = PackStore.open_or_build(g, desc, sha)
    pack, manifest = PackStore.paths(sha)
    good = json.loads(manifest.read_text())
    built = pack.stat().st_mtime_ns

    def reopened(meta: dict) -> PackStore:
        manifest.write_text(json.dumps(meta))
        return PackStore.open_or_build(g, desc, sha)

    # unchanged: opened as it is, not rebuilt
    assert reopened(good).units == first.units and pack.stat().st_mtime_ns == built
    for edit in ("moved", "unaligned", "part outside", "foreign unit"):
        meta = json.loads(json.dumps(good))
        u = max(meta["units"], key=lambda u: u["nbytes"])
        if edit == "moved":
            u["offset"] += ALIGN
        elif edit == "unaligned":
            u["offset"] += 512
        elif edit == "part outside":
            u["parts"][0][4] = u["nbytes"]
        else:
            u["name"] = "blk.99.ffn"
        store = reopened(meta)
        assert store.units == first.units, edit  # rebuilt: the layout it writes
        rebuilt = json.loads(manifest.read_text())
        assert {**rebuilt, "mtime_ns": 0} == {**good, "mtime_ns": 0}, edit


def test_a_changed_byte_rebuilds_the_pack_and_an_unchanged_pack_is_not_read(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3)
    loaded = load_plan(make_plan_file(str(model), tmp_path / "p.yaml", context=64))
    g, desc, sha = loaded.gguf, loaded.desc, loaded.desc.model.sha256
    first = PackStore.open_or_build(g, desc, sha)
    pack, _ = PackStore.paths(sha)
    good = pack.read_bytes()
    capsys.readouterr()
    PackStore.open_or_build(g, desc, sha)  # unchanged: neither checked nor rebuilt
    assert "checking" not in capsys.readouterr().err
    u = max(first.units.values(), key=lambda u: u.nbytes)
    with open(pack, "r+b") as f:  # one byte of a unit zeroed in place (a scale, a weight)
        f.seek(u.offset + u.parts[-1].offset)
        byte = f.read(1)
        f.seek(u.offset + u.parts[-1].offset)
        f.write(b"\xff" if byte == b"\0" else b"\0")
    PackStore.open_or_build(g, desc, sha)
    assert "checking the packed store" in capsys.readouterr().err
    assert pack.read_bytes() == good  # rebuilt
    PackStore.open_or_build(g, desc, sha)  # rebuilt and recorded: not checked again
    assert "checking" not in capsys.readouterr().err
