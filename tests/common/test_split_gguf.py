"""Split GGUFs (llama.cpp's gguf-split convention): any shard opens and describes the whole set.

The real SmolLM2 file is split into three shards (``tests/fixtures/gguf_split.py``); a shard of
another set, a missing shard, shards out of order or misnamed are refused by ``open_gguf`` (a
header walk, before any tensor data is read) with one line naming the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from gguf_factory import write_tiny_llama
from gguf_split import split_gguf
from strata.common.catalog import file_sha256, resolve_model
from strata.common.describe import describe
from strata.common.errors import GGUFError
from strata.common.gguf_file import open_gguf, split_paths

SPLIT_KEYS = {
    "split.no",
    "split.count",
    "split.tensors.count",
    "GGUF.tensor_count",
    "GGUF.kv_count",
}


@pytest.fixture(scope="module")
def shards(smollm2_gguf, tmp_path_factory) -> list[Path]:
    """SmolLM2 split into three shards."""
    return split_gguf(smollm2_gguf, tmp_path_factory.mktemp("split"), 3)


def _linked(shards: list[Path], folder: Path, names: dict[int, str] | None = None) -> list[Path]:
    """Hard links to ``shards`` in ``folder`` (paths of their own, as copies), shard i named
    ``names[i]`` when given."""
    folder.mkdir(exist_ok=True)
    out = []
    for i, s in enumerate(shards):
        link = folder / (names or {}).get(i, s.name)
        os.link(s, link)
        out.append(link)
    return out


def test_any_shard_opens_the_set(smollm2_gguf, shards):
    """Every shard opens the whole set: each tensor's bytes are the whole file's, read from the
    shard that holds it; the metadata is the whole file's plus the split keys."""
    whole = open_gguf(smollm2_gguf)
    assert [len(open_gguf(s).shards) for s in shards] == [3, 3, 3]
    g = open_gguf(shards[1])
    assert g.path == shards[0] and g.paths == shards
    assert g.size_bytes == sum(s.stat().st_size for s in shards)
    assert {g.file_of(t) for t in g.tensor_infos} == set(shards)
    by_name = {t.name: t for t in g.tensor_infos}
    assert list(by_name) == [t.name for t in whole.tensor_infos]
    for t in whole.tensor_infos:
        s = by_name[t.name]
        assert (s.tensor_type, s.shape, s.n_bytes) == (t.tensor_type, t.shape, t.n_bytes)
        assert np.array_equal(g.tensor_bytes(s), whole.tensor_bytes(t)), t.name
    assert [k for k in g.keys() if k not in SPLIT_KEYS] == [
        k for k in whole.keys() if k not in SPLIT_KEYS
    ]
    assert all(g.field(k) == whole.field(k) for k in whole.keys() if k not in SPLIT_KEYS)
    assert [s.field("split.no") for s in g.shards] == [0, 1, 2]


def test_describe_from_any_shard(smollm2_gguf, shards):
    """The description from any shard is the whole file's but for the identity of the model
    (the set's size, sha256 of the shards' sha256s, header) and where each tensor's data lies."""
    whole, _ = describe(str(smollm2_gguf))

    def facts(desc):
        d = desc.model_dump(exclude={"model"})
        for t in d["tensors"]:
            del t["offset"]
        return d

    sha = hashlib.sha256("".join(file_sha256(s) for s in shards).encode()).hexdigest()
    headers = set()
    for s in shards:
        desc, _ = describe(str(s))
        assert facts(desc) == facts(whole)
        m = desc.model
        assert (m.path, m.size_bytes, m.sha256) == (
            str(shards[0].absolute()),
            sum(p.stat().st_size for p in shards),
            sha,
        )
        headers.add(m.header_sha256)
    assert len(headers) == 1 and whole.model.header_sha256 not in headers
    assert resolve_model(str(shards[2])).path == shards[0]


def test_missing_shard_is_named(shards, tmp_path):
    """A set with a shard missing fails on opening, resolving or describing, naming the shard."""
    first, _, last = _linked(shards, tmp_path / "set")
    os.remove(tmp_path / "set" / shards[1].name)
    missing = str(tmp_path / "set" / shards[1].name)
    for call in (open_gguf, split_paths, resolve_model, describe):
        with pytest.raises(GGUFError, match="shard 2 of the 3-file split model") as e:
            call(str(last if call is describe else first))
        assert str(e.value).startswith(missing + ": no such file")
        assert "\n" not in str(e.value)


def _tiny_split(folder: Path, n: int) -> list[Path]:
    """A tiny synthetic model split into ``n`` shards in ``folder``."""
    folder.mkdir()
    return split_gguf(write_tiny_llama(folder / "tiny.gguf"), folder, n)


def test_shard_of_another_set(shards, tmp_path):
    """A shard of another split in the set's place is refused naming it: another shard count,
    or the same count but another set's tensor count."""
    cases = [
        (_tiny_split(tmp_path / "two", 2)[1], "split.count is 2 but its name says the set has 3"),
        (
            _tiny_split(tmp_path / "three", 3)[1],
            "split.tensors.count is [0-9]+ but shard 1 says 272",
        ),
    ]
    for i, (stranger, what) in enumerate(cases):
        first, middle, _ = _linked(
            [shards[0], stranger, shards[2]], tmp_path / f"set{i}", {1: shards[1].name}
        )
        with pytest.raises(GGUFError, match=what) as e:
            open_gguf(first)
        assert str(e.value).startswith(f"{middle}: ")
        assert "another split; download the set again" in str(e.value)


def test_shards_out_of_order_or_misnamed(shards, tmp_path):
    """Shards renamed out of order, a shard not named as gguf-split names shards, and a whole
    file named as a shard are each refused naming the file and the fix."""
    swapped = _linked(shards, tmp_path / "swapped", {1: shards[2].name, 2: shards[1].name})
    with pytest.raises(
        GGUFError, match="split.no says it is shard 3 of 3 but its name says shard 2"
    ):
        open_gguf(swapped[0])
    (renamed,) = _linked(shards[:1], tmp_path / "renamed", {0: "model.gguf"})
    with pytest.raises(
        GGUFError, match=r"NAME-00001-of-00003\.gguf\), side by side, and open the set by any"
    ):
        open_gguf(renamed)
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")  # a whole file: no split keys
    fake = _linked(
        [tiny, tiny], tmp_path / "fake", {0: "m-00001-of-00002.gguf", 1: "m-00002-of-00002.gguf"}
    )
    with pytest.raises(GGUFError, match="has no split.count key: not a gguf-split shard"):
        open_gguf(fake[1])
    with pytest.raises(GGUFError, match="named as shard 3 of 2, which no split writes"):
        split_paths(tmp_path / "m-00003-of-00002.gguf")


def test_a_set_behind_symlinks_and_a_moved_set_are_found(shards, tmp_path, monkeypatch):
    """Shards that are symbolic links to files of other names (the Hugging Face cache's
    snapshots point into blobs): the description keeps the link's path, whose name is a shard's,
    and the set opens from it; a set hashed at a new place is found by its sha256
    (``cached_by_sha256``, what a moved plan's model is located by)."""
    from strata.common.catalog import cached_by_sha256, model_sha256

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots"
    blobs.mkdir()
    snap.mkdir()
    for i, s in enumerate(shards):
        target = blobs / f"blob{i}"
        os.link(s, target)
        (snap / s.name).symlink_to(target)
    desc, _ = describe(str(snap / shards[1].name))
    assert desc.model.path == str(snap / shards[0].name)
    assert len(open_gguf(desc.model.path).tensor_infos) == len(open_gguf(shards[0]).tensor_infos)
    moved = _linked(shards, tmp_path / "moved")
    sha = model_sha256(split_paths(moved[1]))
    assert cached_by_sha256(sha) == [moved[0]]
    assert cached_by_sha256(sha[::-1]) == []
