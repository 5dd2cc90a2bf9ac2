"""``common.atomic``: a file written whole under its own name, renamed into place; what a killed
writer left swept away."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from strata.common import atomic
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


def _dead_pid() -> int:
    """The id of a process that has exited (and was reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_what_killed_writers_of_this_host_left(tmp_path):
    """A writer killed with SIGKILL leaves its temporary file (and a fetch its wheel folder):
    the next sweep removes those of this host's dead processes, and nothing else."""
    host = atomic.owner_tag().split("~")[0]
    dead = _dead_pid()
    gone = tmp_path / f".plan.yaml.{host}~{dead}.abcd1234.partial"
    gone_dir = tmp_path / f".wheels.{host}~{dead}.abcd1234.partial"
    mine = tmp_path / f".plan.yaml.{atomic.owner_tag()}.abcd1234.partial"
    other_host = tmp_path / f".plan.yaml.elsewhere~{dead}.abcd1234.partial"
    legacy_new = tmp_path / ".plan.yaml.abcd1234.partial"
    legacy_old = tmp_path / ".old.yaml.abcd1234.partial"
    kept_file = tmp_path / "plan.yaml"
    for p in (gone, mine, other_host, legacy_new, legacy_old, kept_file):
        p.write_text("x")
    gone_dir.mkdir()
    (gone_dir / "a.whl").write_bytes(b"w")
    old = time.time() - atomic.LEGACY_AGE_S - 60
    os.utime(legacy_old, (old, old))
    assert sorted(atomic.sweep(tmp_path)) == sorted([gone, gone_dir, legacy_old])
    assert all(p.exists() for p in (mine, other_host, legacy_new, kept_file))


def test_kill_9_mid_write_leaves_the_old_file_and_nothing_after_the_next_start(tmp_path):
    """``replaced`` killed outright mid-write: the target keeps its old bytes, and the cache's
    first use in the next process (``catalog.cache_dir``) removes the half-written file."""
    target = tmp_path / "plans" / "p.yaml"
    target.parent.mkdir()
    target.write_text("old\n")
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from strata.common.atomic import replaced\n"
        "with replaced(Path(sys.argv[1]), 'w') as f:\n"
        "    f.write('new, half'); f.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(target)])
    assert done.returncode == -signal.SIGKILL
    assert target.read_text() == "old\n"
    assert len(list(target.parent.glob(".p.yaml.*.partial"))) == 1
    env = {**os.environ, "STRATA_CACHE": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-c", "from strata.common.catalog import cache_dir; cache_dir()"],
        env=env, check=True,
    )  # fmt: skip
    assert sorted(p.name for p in target.parent.iterdir()) == ["p.yaml"]
