"""``planner.atomic.replaced``: a file written whole under its own name, renamed into place."""

from __future__ import annotations

import os
import stat

import pytest
from strata.common.atomic import replaced


def test_replaced_writes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "cache.json"
    target.write_text("old")
    with replaced(target, "w") as f:
        f.write("new")
        assert target.read_text() == "old"  # readers see the old file until the rename
    assert target.read_text() == "new"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask  # as open() would make it

    for error in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(error)), replaced(target, "wb") as f:
            f.write(b"half")
            raise error
        assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]  # no temporary left


def test_two_writers_of_one_target_never_share_a_file(tmp_path):
    target = tmp_path / "x.pack"
    with replaced(target) as a, replaced(target) as b:
        assert len(list(tmp_path.iterdir())) == 2  # two temporary files
        a.write(b"a" * 10)
        b.write(b"b" * 20)
    assert target.read_bytes() == b"a" * 10  # a's block ends last: its rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["x.pack"]


def test_temporary_files_beside_a_target_have_names_of_their_own(tmp_path):
    from strata.common.atomic import _MODE, temporary_beside

    target = tmp_path / "model.gguf"
    a, b = temporary_beside(target), temporary_beside(target)
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(".model.gguf.") and a.name.endswith(".partial")
    assert a.stat().st_size == 0 and (a.stat().st_mode & 0o777) == _MODE
    with pytest.raises(OSError):
        temporary_beside(tmp_path / "missing" / "model.gguf")
