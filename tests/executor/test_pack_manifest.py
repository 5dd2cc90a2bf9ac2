"""A packed store whose manifest no longer describes it is rebuilt, never read (issue 35: one
unit's offset moved in the manifest ran and emitted token 0)."""

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
        assert json.loads(manifest.read_text()) == good, edit
