"""``strata cache ls`` and ``strata cache rm`` on a cache folder of their own (``STRATA_CACHE``
pointed at a temporary folder) holding files laid out as Strata writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gguf_factory import write_tiny_llama
from strata.common.catalog import CATALOG
from strata.common.gguf_file import open_gguf
from strata.common.sizes import format_size

from strata.caches import entries
from strata.cli import main

SMOL = CATALOG["smollm2-135m"]
UNKNOWN_SHA = "ab" * 32


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder with one entry of each kind, sizes chosen to be told apart:

    models/  the catalog's SmolLM2 file (1000 bytes: only its name matters here) and a tiny GGUF
    packs/   SmolLM2's pack and manifest (3000 + 100 bytes), a pack of an unknown model (500)
    tokenizers/  the tiny GGUF's built tokenizer (named by its header sha256), 70 bytes
    plans/   a plan of gemma3-270m (its model section), machine/ this host's profile,
    sha256-cache.json (two entries), and a file that is not Strata's.
    """
    root = tmp_path / "cache"
    (root / "models").mkdir(parents=True)
    (root / "models" / SMOL.filename).write_bytes(b"m" * 1000)
    tiny = write_tiny_llama(root / "models" / "tiny.gguf")
    (root / "packs").mkdir()
    prefix = SMOL.sha256[:16]
    (root / "packs" / f"{prefix}.v1.pack").write_bytes(b"p" * 3000)
    manifest = json.dumps({"model_sha256": SMOL.sha256}).encode()
    (root / "packs" / f"{prefix}.v1.json").write_bytes(manifest.ljust(100))
    (root / "packs" / f"{UNKNOWN_SHA[:16]}.v1.pack").write_bytes(b"q" * 500)
    (root / "tokenizers").mkdir()
    header = open_gguf(tiny).header_sha256
    (root / "tokenizers" / f"{header}.v1.json").write_bytes(b"t" * 70)
    (root / "plans").mkdir()
    plan = "format_version: '2.0'\nmodel:\n  name: gemma3-270m\n  path: null\n"
    (root / "plans" / "0123abcd.yaml").write_text(plan)
    (root / "machine").mkdir()
    (root / "machine" / "somehost.yaml").write_text("name: somehost\n")
    hashes = {f"{root}/models/{SMOL.filename}|1000|1|1": SMOL.sha256, "/gone|1|1|1": UNKNOWN_SHA}
    (root / "sha256-cache.json").write_text(json.dumps(hashes))
    (root / "notes.txt").write_text("mine")
    monkeypatch.setenv("STRATA_CACHE", str(root))
    return root


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[str, list[str]]:
    """``ls``'s table: entry name -> [kind, size, what]."""
    lines = out.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "SIZE", "WHAT"]
    rows = {}
    for line in lines[1:-1]:
        kind, name, number, unit, what = line.split(maxsplit=4)
        rows[name] = [kind, f"{number} {unit}", what]
    return rows


def test_ls_lists_every_entry_with_its_size_and_what_it_is(cache, capsys):
    code, out, err = _run(capsys, "ls")
    assert code == 0 and err == ""
    rows = _rows(out)
    tiny_size = (cache / "models" / "tiny.gguf").stat().st_size
    assert rows[SMOL.filename] == ["models", "1000 B", "smollm2-135m (catalog model)"]
    assert rows["tiny.gguf"] == ["models", format_size(tiny_size), "model file"]
    prefix = SMOL.sha256[:16]
    assert rows[prefix][:2] == ["packs", format_size(3100)]  # the pack and its manifest
    assert rows[prefix][2].endswith("of smollm2-135m")
    assert "ababababab" in rows[UNKNOWN_SHA[:16]][2]  # a model this cache cannot name
    header = open_gguf(cache / "models" / "tiny.gguf").header_sha256
    assert rows[header[:16]] == ["tokenizers", "70 B", "built tokenizer of tiny.gguf"]
    assert rows["0123abcd.yaml"][0] == "plans" and "for gemma3-270m" in rows["0123abcd.yaml"][2]
    assert rows["somehost.yaml"][0] == "profiles" and "host somehost" in rows["somehost.yaml"][2]
    assert (
        rows["sha256-cache.json"][0] == "hashes" and "2 model file" in rows["sha256-cache.json"][2]
    )
    assert rows["notes.txt"][0] == "other" and "left alone" in rows["notes.txt"][2]
    total = sum(e.size for e in entries(cache))
    assert out.splitlines()[-1].startswith(f"total {format_size(total)}: models ")
    assert str(cache) in out.splitlines()[-1]
    # ls NAME: the entries rm NAME would remove
    code, out, _ = _run(capsys, "ls", "smollm2-135m")
    assert set(_rows(out)) == {SMOL.filename, prefix}


def test_rm_a_model_removes_its_file_and_pack_and_says_what_it_freed(cache, capsys):
    code, out, err = _run(capsys, "rm", "smollm2-135m")
    assert code == 0 and err == ""
    assert not (cache / "models" / SMOL.filename).exists()
    assert not list((cache / "packs").glob(f"{SMOL.sha256[:16]}.*"))
    assert (cache / "packs" / f"{UNKNOWN_SHA[:16]}.v1.pack").exists()
    assert (cache / "models" / "tiny.gguf").exists()
    lines = out.splitlines()
    assert lines[0].startswith(f"removed models {SMOL.filename} (1000 B)")
    assert lines[1].startswith(f"removed packs {SMOL.sha256[:16]} ({format_size(3100)})")
    assert lines[-1] == f"freed {format_size(4100)} in 2 entries"
    # Again: nothing left of it, which is said, not an error.
    code, out, _ = _run(capsys, "rm", "smollm2-135m")
    assert code == 0 and out.startswith("nothing to remove for smollm2-135m")


def test_rm_kinds_names_and_all_leave_what_is_not_stratas(cache, capsys):
    code, out, _ = _run(capsys, "rm", "packs", "somehost.yaml")
    assert code == 0 and out.splitlines()[-1] == f"freed {format_size(3615)} in 3 entries"
    assert list((cache / "packs").iterdir()) == []
    assert not (cache / "machine" / "somehost.yaml").exists()
    code, out, _ = _run(capsys, "rm", "all")
    assert code == 0
    left = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    assert left == ["notes.txt"]
    code, out, _ = _run(capsys, "ls")
    assert [e.kind for e in entries(cache)] == ["other"]


def test_rm_unknown_names_are_one_line_errors(cache, capsys):
    code, out, err = _run(capsys, "rm", "packs", "nonesuch")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "'nonesuch'" in err and "smollm2-135m" in err and SMOL.sha256[:16] in err
    assert (cache / "packs" / f"{SMOL.sha256[:16]}.v1.pack").exists()  # nothing was removed
    code, _, err = _run(capsys, "rm", "notes.txt")
    assert code == 2 and "not one of Strata's caches" in err and (cache / "notes.txt").exists()


def test_rm_never_reaches_outside_the_cache(cache, tmp_path, capsys):
    """A link in the cache is removed as a link (its target stays); a kind's folder that is a
    link to elsewhere is refused before anything is removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.gguf").write_bytes(b"k" * 10)
    os.symlink(outside / "keep.gguf", cache / "models" / "linked.gguf")
    code, out, _ = _run(capsys, "rm", "linked.gguf")
    assert code == 0 and not (cache / "models" / "linked.gguf").is_symlink()
    assert (outside / "keep.gguf").read_bytes() == b"k" * 10
    (cache / "routing").symlink_to(outside, target_is_directory=True)
    code, out, err = _run(capsys, "rm", "routing")
    assert code == 2 and "outside the cache folder" in err and err.count("\n") == 1
    assert (outside / "keep.gguf").exists()


def test_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "empty"))
    code, out, _ = _run(capsys, "ls")
    assert code == 0 and out == f"nothing cached in {tmp_path / 'empty'}\n"
    code, _, err = _run(capsys, "rm", "gemma3-270m")  # a catalog name: nothing to remove
    assert code == 0
    code, _, err = _run(capsys, "rm", "x")
    assert code == 2 and "(the cache is empty)" in err
