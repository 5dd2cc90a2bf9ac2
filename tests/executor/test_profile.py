"""Hardware profiles: the shipped ones load and are sane; measuring this machine works."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from strata.common.errors import StrataError
from strata.common.schemas import Figure, HardwareProfile
from strata.common.yamlio import read_yaml, write_yaml
from strata.executor import profile as prof

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def _profile_files() -> list[Path]:
    # profiles/ may also hold model descriptions: keep the files that say they are hardware.
    return sorted(p for p in PROFILES.glob("*.yaml") if "\nbackend:" in p.read_text())


EXPECTED = {
    "dev-linux-cpu",
    "m1-max-32gb",
    "m1-max-64gb",
    "m4-max-128gb",
    "m3-max-48gb",
    "m3-ultra-256gb",
    "m3-ultra-512gb",
    "h200-host",
}


def _figures(p: HardwareProfile) -> dict[str, Figure]:
    return {
        "os_reserve_bytes": p.os_reserve_bytes,
        "gpu.working_set_bytes": p.gpu.working_set_bytes,
        "gpu.memory_bandwidth_bytes_s": p.gpu.memory_bandwidth_bytes_s,
        "gpu.compute_flops_s": p.gpu.compute_flops_s,
        "ram.capacity_bytes": p.ram.capacity_bytes,
        "ram.host_to_device_bytes_s": p.ram.host_to_device_bytes_s,
        "nvme.read_bytes_s": p.nvme.read_bytes_s,
    }


def test_all_expected_profiles_are_shipped():
    assert EXPECTED <= {p.stem for p in _profile_files()}


@pytest.mark.parametrize("path", _profile_files(), ids=lambda p: p.stem)
def test_shipped_profile_loads_and_is_sane(path: Path):
    p = read_yaml(path, HardwareProfile)
    assert p.name == path.stem
    for key, fig in _figures(p).items():
        assert fig.value > 0, key
        assert len(fig.how) > 10, key
    # The working set and the reserve fit in RAM on unified machines; a discrete GPU has its own.
    if p.unified_memory:
        assert p.gpu.working_set_bytes.value <= p.ram.capacity_bytes.value
    assert p.os_reserve_bytes.value < p.ram.capacity_bytes.value
    assert p.nvme.block_bytes % 4096 == 0
    if p.backend == "cpu":
        assert p.compute_dtype == "float32"
    if p.backend == "cuda":
        assert not p.unified_memory


@pytest.mark.parametrize("path", _profile_files(), ids=lambda p: p.stem)
def test_shipped_profile_is_canonical_yaml(path: Path, tmp_path: Path):
    """Shipped files are exactly what write_yaml writes, so that they diff cleanly."""
    out = tmp_path / path.name
    write_yaml(read_yaml(path, HardwareProfile), out)
    assert out.read_bytes() == path.read_bytes()


def test_dev_profile_is_measured():
    p = read_yaml(PROFILES / "dev-linux-cpu.yaml", HardwareProfile)
    assert p.backend == "cpu" and p.unified_memory
    assert p.nvme.read_bytes_s.source == "measured"
    assert p.gpu.memory_bandwidth_bytes_s.source == "measured"


def test_anchor_machine_uses_published_disk_figure():
    p = read_yaml(PROFILES / "m1-max-32gb.yaml", HardwareProfile)
    assert p.nvme.read_bytes_s.value == pytest.approx(5.1e9)
    assert p.backend == "metal" and p.unified_memory


# --------------------------------------------------------------------------- measuring


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> tuple[HardwareProfile, Path]:
    d = tmp_path_factory.mktemp("disk")
    return prof.measure_profile(d, "t", quick=True), d


def test_measure_profile_quick(quick_profile, tmp_path: Path):
    p, disk = quick_profile
    assert p.name == "t"
    assert p.nvme.read_bytes_s.source == "measured"
    assert p.nvme.read_bytes_s.value > 0
    assert p.ram.capacity_bytes.value > 0
    assert p.gpu.compute_flops_s.value > 0
    assert not list(disk.iterdir()), "the read-test file was left behind"
    out1, out2 = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_yaml(p, out1)
    write_yaml(read_yaml(out1, HardwareProfile), out2)
    assert out1.read_bytes() == out2.read_bytes()


def test_measured_figures_are_medians_with_their_spread(quick_profile):
    """Every timed figure says how many samples its median came from and how far apart they were;
    the median lies within them, so the spread bounds how far it is from any one sample."""
    p, _ = quick_profile
    sz = prof._sizes(p.backend, quick=True)
    least = {
        "nvme.read_bytes_s": prof.DISK_PASSES,
        "gpu.memory_bandwidth_bytes_s": sz.samples,
        "gpu.compute_flops_s": 3,
        "gpu.decode_matvec_flops_s": sz.samples,
        "gpu.decode_batch_flops_s": sz.samples,
        "gpu.op_overhead_s": sz.samples,
        "ram.host_to_device_bytes_s": sz.samples,
    }
    figs = {**_figures(p), "gpu.decode_matvec_flops_s": p.gpu.decode_matvec_flops_s}
    figs["gpu.decode_batch_flops_s"] = p.gpu.decode_batch_flops_s
    figs["gpu.op_overhead_s"] = p.gpu.op_overhead_s
    for key, n in least.items():
        fig = figs[key]
        assert fig.samples is not None and fig.samples >= n, key
        assert fig.spread is not None and 0 <= fig.spread < 100, key
        assert "median" in fig.how, key
    # Stated, not measured: no samples.
    assert p.os_reserve_bytes.samples is None and p.ram.capacity_bytes.samples is None


def test_rate_is_the_median_and_its_spread():
    r = prof.Rate.of([4.0, 1.0, 2.0, 100.0, 3.0])
    assert r.median == 3.0  # the outlier does not move it
    assert r.spread == pytest.approx((100.0 - 1.0) / 3.0)
    f = r.figure("how")
    assert (f.value, f.samples, f.source) == (3.0, 5, "measured")
    assert f.spread == pytest.approx(33.0)
    assert prof.Rate.of([2.0, 2.0]).spread == 0


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, float("inf")]])
def test_rate_without_usable_samples_is_a_clear_error(bad):
    with pytest.raises(StrataError, match="no usable samples .* re-run the profile"):
        prof.Rate.of(bad)


def test_fast_calls_are_grouped_into_samples_of_the_shortest_length():
    calls = []
    secs, per_sample = prof._time_calls(lambda: calls.append(1), 3, 0.002, warmups=2)
    assert len(secs) == 3 and per_sample > 1
    assert len(calls) == 2 + 1 + 3 * per_sample  # warm-ups, the timing call, the samples
    assert all(s > 0 for s in secs)


def test_os_reserve_rule():
    gib = 1 << 30
    assert prof.os_reserve_bytes(8 * gib) == 2 * gib
    assert prof.os_reserve_bytes(64 * gib) == 64 * gib // 10


def _write(path: Path, n: int) -> Path:
    path.write_bytes(os.urandom(n))
    return path


def test_read_sequential_reads_a_file(tmp_path: Path):
    f = _write(tmp_path / "f.bin", 1 << 20)
    r = prof.read_sequential(f, 1 << 20, block_bytes=256 << 10, queue_depth=3)
    assert r.bytes_read == 1 << 20 and r.seconds > 0 and r.bytes_s > 0


def test_short_file_is_a_clear_error(tmp_path: Path):
    f = _write(tmp_path / "short.bin", 3 * 65536)
    with pytest.raises(StrataError, match="short read .* got 0 of 65536 bytes"):
        prof.read_sequential(f, 4 * 65536, block_bytes=65536, queue_depth=1)


def test_a_short_preadv_is_continued(tmp_path: Path, monkeypatch):
    """Direct I/O may legally return fewer bytes than asked: the disk test reads on from there
    (``direct_io.pread_into``) and counts every byte once."""
    f = _write(tmp_path / "f.bin", 1 << 20)
    real = os.preadv
    cut = []

    def short(fd, bufs, offset):
        n = real(fd, bufs, offset)
        if offset == 512 << 10 and not cut:
            cut.append(offset)
            return n - 4096
        return n

    monkeypatch.setattr(os, "preadv", short)
    got = prof.read_sequential(f, 1 << 20, block_bytes=256 << 10, queue_depth=2)
    assert cut and got.bytes_read == 1 << 20


def test_bad_block_size_is_refused(tmp_path: Path):
    f = _write(tmp_path / "f.bin", 1 << 20)
    with pytest.raises(StrataError, match="multiple of 4096"):
        prof.read_sequential(f, 1 << 20, block_bytes=1000)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
def test_refused_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch):
    """tmpfs and some overlays refuse O_DIRECT with EINVAL: read buffered, and say so."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    nvme = prof.measure_disk(tmp_path, read_bytes=1 << 20, block_bytes=256 << 10, queue_depth=2)
    assert nvme.read_bytes_s.source == "measured"
    assert "POSIX_FADV_DONTNEED" in nvme.read_bytes_s.how
    assert "NOT direct I/O" in nvme.read_bytes_s.how
    assert not list(tmp_path.iterdir())


def test_missing_disk_dir_is_a_clear_error(tmp_path: Path):
    with pytest.raises(StrataError, match="no such folder"):
        prof.measure_disk(tmp_path / "nope", read_bytes=1 << 20)


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_disk_dir_is_a_clear_error(tmp_path: Path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(StrataError, match="not writable"):
            prof.measure_disk(d, read_bytes=1 << 20)
    finally:
        d.chmod(0o700)


def test_test_file_is_removed_when_the_read_fails(tmp_path: Path, monkeypatch):
    def boom(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", boom)
    with pytest.raises(StrataError, match="Input/output error"):
        prof.measure_disk(tmp_path, read_bytes=1 << 20, block_bytes=256 << 10, queue_depth=2)
    assert not list(tmp_path.iterdir())


def test_empty_name_is_refused(tmp_path: Path):
    with pytest.raises(StrataError, match="name is empty"):
        prof.measure_profile(tmp_path, " ", quick=True)


def test_op_overhead_rounds_pool_their_samples():
    probe = prof.OpOverheadProbe(blocks=1, max_steps=1 + 2 * 2 + 1 + 2 * 2)
    probe.round(2, 2, warmup_steps=1)
    probe.round(2, 2)
    fig = probe.figure(2, 2)
    assert fig.samples == 4 and fig.value > 0 and "2 round(s)" in fig.how
    with pytest.raises(StrataError, match="ran past its 10 steps"):
        probe.round(1, 1)
