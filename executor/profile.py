"""Measure this machine into a :class:`~strata.common.schemas.HardwareProfile`.

Each number is a :class:`~strata.common.schemas.Figure` that says how it was obtained. A measured
rate is the median of several timed samples (``Figure.samples``), taken after untimed warm-up
calls, each sample long enough (tens of milliseconds) to time reliably; ``Figure.spread`` is
``(max - min) / median`` of those samples. The median, not the best or the mean: one disturbed
sample (another program, a page-fault storm, a slow scheduler moment of a virtual machine) moves
neither it nor the next run's figure much. What is measured, and how (units: bytes, bytes/s,
FLOP/s, seconds):

- memory: host RAM from ``psutil.virtual_memory().total``; the device working set from MLX
  (Metal's ``max_recommended_working_set_size``, CUDA's free device memory) or, on the CPU backend,
  RAM less the OS reserve;
- OS reserve: :func:`os_reserve_bytes`, a stated rule (not a measurement);
- disk: a real sequential read of a freshly written random file on the disk that holds the models,
  with direct I/O (``O_DIRECT`` on Linux, ``F_NOCACHE`` on macOS) into page-aligned buffers, at a
  stated block size and queue depth (threads issuing ``os.preadv`` in parallel);
- device memory bandwidth: MLX float32 sums over a large array;
- compute: MLX matmuls at a prefill-like and a decode-like shape; the profile's figure is the
  prefill-like one (see :func:`measure_matmul_flops`); and the decode kernel itself, a 4-bit
  quantized matrix-vector product (:func:`measure_decode_matvec`);
- per-operation overhead: seconds per op of a decode step of tiny llama blocks
  (:func:`measure_op_overhead`);
- host-to-device copy: ``mx.array(numpy_array)`` + ``mx.eval``, which is how the executor moves
  RAM-tier weights into MLX arrays.

Progress goes to stderr. The default profile takes well under a minute on a 2-core machine;
``quick=True`` shrinks every test and takes fewer, single-call samples (for unit tests, about a
second; its figures are rough).
"""

from __future__ import annotations

import datetime
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
from strata.common.errors import StrataError
from strata.common.op_counts import OPS_PER_UNIT, OVERLAPPED_BACKENDS
from strata.common.schemas import Figure, GPUTier, HardwareProfile, NVMeTier, RAMTier
from strata.common.sizes import format_size
from strata.executor.direct_io import (
    ALIGN,
    drop_from_page_cache,
    open_uncached,
    pread_into,
    set_nocache,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_READ_BYTES = 1 * GiB
"""Size of the disk read test file, bytes: large enough that per-request latency is amortized
and a shared disk's moments of contention average out (the lent machines' virtual disks gave
1.3-2.4 GB/s over 256 MiB reads minutes apart)."""
DISK_PASSES = 3
"""Reads of the disk test file; the figure is their median (the typical rate a plan will see)."""
DEFAULT_BLOCK_BYTES = 4 * MiB
"""Read size of the disk test, bytes: the order of one streamed tensor slice (a few MiB)."""
DEFAULT_QUEUE_DEPTH = 4
"""Reads in flight during the disk test: the executor's default number of prefetch I/O threads."""


_QUICK_READ_BYTES = 8 * MiB
_QUICK_BLOCK_BYTES = 1 * MiB
_QUICK_QUEUE_DEPTH = 2


def _say(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def _today() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()


def _gbs(bytes_s: float) -> str:
    return f"{bytes_s / 1e9:.2f} GB/s"


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Rate:
    """Several measurements of one quantity (a rate such as bytes/s, or seconds per op) and
    the figure they give: their median, with their spread."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values) -> Rate:
        """The measurements ``values`` (at least one).

        Raises:
            StrataError: no values, or one that is not a positive finite number (a timer that
                did not advance).
        """
        vals = tuple(float(v) for v in values)
        if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
            raise StrataError(
                f"a profile measurement gave no usable samples ({vals}); re-run the profile"
            )
        return cls(vals)

    @property
    def median(self) -> float:
        """The figure: the median, which one disturbed sample (another program, a page-fault
        storm, a slow scheduler episode) does not move, unlike the mean or the best."""
        return float(statistics.median(self.values))

    @property
    def spread(self) -> float:
        """``(max - min) / median``: 0 for identical samples; 0.1 means the samples span 10%."""
        return (max(self.values) - min(self.values)) / self.median

    def figure(self, how: str) -> Figure:
        """A measured :class:`Figure` of the median, with the sample count and the spread."""
        return Figure(
            value=self.median,
            source="measured",
            how=how,
            samples=len(self.values),
            spread=round(self.spread, 4),
        )


def _time_calls(fn, samples: int, min_sample_s: float, warmups: int = 1) -> tuple[list[float], int]:
    """Seconds per call of ``fn``, one value per timed sample, and the calls per sample.

    ``warmups`` untimed calls come first (kernel compilation, the allocator's first buffers,
    first-touch page faults), then one more call is timed to choose how many calls a sample
    makes so that it lasts at least ``min_sample_s`` seconds (a sample of a few microseconds is
    timer and scheduler noise); each of the ``samples`` samples is then that many calls, timed
    together and divided by the count.
    """
    for _ in range(warmups):
        fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    calls = max(1, min(10_000, math.ceil(min_sample_s / max(one, 1e-9))))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return out, calls


def _rate(work: float, fn, samples: int, min_sample_s: float) -> tuple[Rate, int]:
    """``work`` (bytes, FLOP) per second of ``fn`` over the samples of :func:`_time_calls`, and
    the calls per sample."""
    secs, calls = _time_calls(fn, samples, min_sample_s)
    return Rate.of(work / s if s > 0 else 0.0 for s in secs), calls  # 0: refused, one line


def _stats(rate: Rate, fmt) -> str:
    """'median X of N samples (min-max, spread S)' for ``how``, ``fmt`` formatting one value."""
    return (
        f"median {fmt(rate.median)} of {len(rate.values)} samples "
        f"({fmt(min(rate.values))}-{fmt(max(rate.values))}, spread {rate.spread:.0%})"
    )


# --------------------------------------------------------------------------- memory


def os_reserve_bytes(total_bytes: int) -> int:
    """Memory left to the OS and other programs, bytes: ``max(2 GiB, 10% of RAM)``.

    The 10% follows vLLM's default ``gpu_memory_utilization=0.9`` (it leaves a tenth of the memory
    it manages to everything else); the 2 GiB floor is an assumption: an idle OS session plus this
    Python process with MLX loaded, which on small machines is more than a tenth of RAM.
    """
    return max(2 * GiB, total_bytes // 10)


RESERVE_RULE = (
    "rule max(2 GiB, 10% of RAM): 10% as vLLM's default gpu_memory_utilization=0.9 leaves, "
    "2 GiB floor assumed for the OS session and this process"
)


def detect_backend() -> str:
    """The MLX backend of this machine: ``"metal"``, ``"cuda"`` or ``"cpu"``."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def device_info(backend: str) -> dict:
    """MLX's device info for the default device (``mx.device_info`` in MLX 0.32; older MLX had
    only ``mx.metal.device_info``)."""
    import mlx.core as mx

    info: dict = {}
    dev = mx.gpu if backend in ("metal", "cuda") else mx.cpu
    if hasattr(mx, "device_info"):
        info.update(mx.device_info(dev))
    if backend == "metal" and "max_recommended_working_set_size" not in info:
        info.update(mx.metal.device_info())
    return info


def working_set(backend: str, total_ram: int, reserve: int, info: dict) -> Figure:
    """The device working set, bytes, and how it was obtained.

    Raises:
        StrataError: MLX reports no memory size for the GPU (an MLX build this code does not know).
    """
    date = _today()
    if backend == "metal":
        if "max_recommended_working_set_size" not in info:
            raise StrataError(
                "MLX reports no working-set size for the Metal GPU; upgrade mlx (0.32+) and re-run"
            )
        v = int(info["max_recommended_working_set_size"])
        return Figure(
            value=v,
            source="measured",
            how=f"MLX device_info max_recommended_working_set_size (Metal's "
            f"recommendedMaxWorkingSetSize, {v / total_ram:.0%} of RAM), {date}",
        )
    if backend == "cuda":
        # free, not total: the CUDA context and other processes already hold part of the card.
        key = "free_memory" if "free_memory" in info else "total_memory"
        if key not in info:
            raise StrataError(
                "MLX reports no memory size for the CUDA device; upgrade mlx (0.32+) and re-run"
            )
        v = int(info[key])
        return Figure(
            value=v, source="measured", how=f"MLX mx.device_info(mx.gpu)['{key}'], {date}"
        )
    return Figure(
        value=total_ram - reserve,
        source="derived",
        how="host RAM less the OS reserve: MLX's CPU backend computes in host RAM",
    )


# --------------------------------------------------------------------------- disk


@dataclass(frozen=True)
class ReadResult:
    """One timed sequential read of a file."""

    bytes_read: int
    seconds: float
    direct: bool
    """True when the page cache was bypassed (O_DIRECT or F_NOCACHE), False for the buffered
    fallback after dropping the file from the page cache."""
    method: str
    """How the file was opened, for the profile's ``how``."""

    @property
    def bytes_s(self) -> float:
        """Read bandwidth, bytes/s."""
        return self.bytes_read / self.seconds


def read_sequential(
    path: Path,
    nbytes: int,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
) -> ReadResult:
    """Read the first ``nbytes`` of ``path`` with direct I/O and time it.

    ``queue_depth`` threads each own one page-aligned buffer of ``block_bytes`` and read every
    ``queue_depth``-th block with ``os.preadv`` (which releases the GIL), so that ``queue_depth``
    reads of neighbouring blocks are in flight at once: a sequential stream at that depth.

    Args:
        path: the file to read.
        nbytes: bytes to read; a multiple of ``block_bytes``.
        block_bytes: bytes per read, a multiple of 4096.
        queue_depth: reads in flight (threads), >= 1.

    Returns:
        Bytes read, seconds taken, whether the page cache was bypassed, and the method.

    Raises:
        StrataError: bad sizes, the file cannot be opened, a read fails, or a read returns fewer
            bytes than asked (a short read: the file is shorter than ``nbytes``).
    """
    if block_bytes < ALIGN or block_bytes % ALIGN:
        raise StrataError(f"block size {block_bytes} B is not a multiple of 4096; pass e.g. 4 MiB")
    if nbytes <= 0 or nbytes % block_bytes:
        raise StrataError(
            f"read size {nbytes} B is not a positive multiple of the block size {block_bytes} B"
        )
    if queue_depth < 1:
        raise StrataError(f"queue depth {queue_depth} must be at least 1")
    try:
        fd, direct, method = open_uncached(path)
    except OSError as e:
        raise StrataError(f"cannot open {path} for the read test: {e.strerror}") from None
    nblocks = nbytes // block_bytes
    depth = min(queue_depth, nblocks)
    bufs = [mmap.mmap(-1, block_bytes) for _ in range(depth)]

    def reader(t: int) -> None:
        with memoryview(bufs[t]) as mv:
            for i in range(t, nblocks, depth):
                off = i * block_bytes
                try:
                    n = pread_into(fd, mv, off)
                except OSError as e:
                    raise StrataError(
                        f"read of {path} at byte {off} failed: {e.strerror}"
                    ) from None
                if n != block_bytes:
                    raise StrataError(
                        f"short read of {path} at byte {off}: got {n} of {block_bytes} bytes "
                        f"(the file is shorter than the {nbytes} bytes asked for, or the disk "
                        "failed); check the file and the disk, then re-run"
                    )

    try:
        with ThreadPoolExecutor(max_workers=depth) as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(reader, t) for t in range(depth)]
            for f in futures:
                f.result()  # re-raises a reader's StrataError here
            seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    return ReadResult(bytes_read=nbytes, seconds=seconds, direct=direct, method=method)


def _write_random_file(path: Path, nbytes: int, chunk: int = 4 * MiB) -> None:
    # Random bytes: a compressing or deduplicating filesystem must store (and read back) each one.
    rng = np.random.default_rng()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if sys.platform == "darwin":
            set_nocache(fd)  # keep the written pages out of the unified buffer cache
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            data = rng.bytes(n)
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
            done += n
        os.fsync(fd)
        drop_from_page_cache(fd)
    finally:
        os.close(fd)


def _mount_of(path: Path) -> str:
    """'device (fstype) at mountpoint' for the filesystem holding ``path``, for ``how``."""
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    for part in psutil.disk_partitions(all=True):
        if Path(part.mountpoint) == p:
            return f"{part.device} ({part.fstype}) at {p}"
    return f"the filesystem at {p}"


def _check_disk_dir(disk_dir: Path, nbytes: int) -> None:
    if not disk_dir.is_dir():
        raise StrataError(
            f"{disk_dir}: no such folder; pass the folder that holds (or will hold) the model files"
        )
    if not os.access(disk_dir, os.W_OK | os.X_OK):
        raise StrataError(
            f"{disk_dir} is not writable; pass a writable folder on the disk that holds the models"
        )
    free = shutil.disk_usage(disk_dir).free
    if free < nbytes + 64 * MiB:
        raise StrataError(
            f"{disk_dir} has {format_size(free)} free, the read test needs {format_size(nbytes)}; "
            "free some space or pass a smaller read size"
        )


def measure_disk(
    disk_dir: Path,
    *,
    read_bytes: int = DEFAULT_READ_BYTES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
) -> NVMeTier:
    """Direct-I/O sequential read bandwidth of the disk holding ``disk_dir``, bytes/s.

    Writes a random test file of ``read_bytes`` (rounded up to a whole number of blocks) in
    ``disk_dir``, fsyncs it and drops it from the page cache, reads it ``DISK_PASSES`` times with
    :func:`read_sequential` (direct I/O: every pass comes from the disk), and deletes it (also on
    failure). The figure is the passes' mean bandwidth.

    Raises:
        StrataError: ``disk_dir`` is missing, not writable or too full; the test file cannot be
            written; or the read fails or comes back short.
    """
    nbytes = max(1, math.ceil(read_bytes / block_bytes)) * block_bytes
    disk_dir = Path(disk_dir)
    _check_disk_dir(disk_dir, nbytes)
    path = disk_dir / f".strata-readtest-{os.getpid()}.bin"
    where = _mount_of(disk_dir)
    try:
        _say(f"disk: writing a {format_size(nbytes)} random test file in {disk_dir}")
        try:
            _write_random_file(path, nbytes)
        except OSError as e:
            raise StrataError(
                f"cannot write the {format_size(nbytes)} read-test file in {disk_dir}: "
                f"{e.strerror}; free space there or pass another folder on the model disk"
            ) from None
        _say(f"disk: reading it back, {format_size(block_bytes)} blocks, queue depth {queue_depth}")
        runs = [
            read_sequential(path, nbytes, block_bytes=block_bytes, queue_depth=queue_depth)
            for _ in range(DISK_PASSES)
        ]
    finally:
        path.unlink(missing_ok=True)
    r = runs[0]
    rate = Rate.of([x.bytes_s for x in runs])
    _say(f"disk: {_gbs(rate.median)} ({r.method}, spread {rate.spread:.0%})")
    how = (
        f"sequential read of a {format_size(nbytes)} random file on {where}, "
        f"{r.method}, os.preadv into page-aligned buffers, {format_size(block_bytes)} blocks, "
        f"queue depth {queue_depth} (threads), median of {len(runs)} passes "
        f"({', '.join(_gbs(x.bytes_s) for x in runs)}), {_today()}"
    )
    if not r.direct:
        how += "; NOT direct I/O, so the figure may differ from the raw disk's"
    return NVMeTier(
        read_bytes_s=rate.figure(how),
        block_bytes=block_bytes,
        queue_depth=queue_depth,
    )


# --------------------------------------------------------------------------- MLX measurements


def _median_seconds(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` single timed calls of ``fn`` after untimed warm-up calls."""
    return statistics.median(_time_calls(fn, repeats, 0.0)[0])


def _best_seconds(fn, repeats: int) -> float:
    """Least seconds of ``repeats`` single timed calls of ``fn`` after one untimed warm-up (the
    kernel micro-benches' measure; the profile's figures are medians of samples)."""
    fn()  # warm-up: kernel compilation, allocator caches
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_memory_bandwidth(nbytes: int, samples: int = 7, min_sample_s: float = 0.02) -> Figure:
    """Device memory read bandwidth, bytes/s: MLX float32 reductions over an array of ``nbytes``.

    The array is materialized first, so each timed reduction reads every byte once. Two forms are
    timed, a sum of everything and a column sum of a (rows, 1024) view, because MLX's kernels
    reach different rates on them (on a 2-core Linux CPU: ~8 vs ~30 GB/s); the figure is the
    faster form's median of ``samples`` samples of at least ``min_sample_s`` seconds each (see
    :func:`_time_calls`). A reduction costs what a matrix-vector product over weights costs at
    the memory bus, with negligible arithmetic.
    """
    import mlx.core as mx

    n = nbytes // 4 // 1024 * 1024
    a = mx.arange(n, dtype=mx.float32)
    mx.eval(a)
    cols = a.reshape(-1, 1024)
    full, _ = _rate(n * 4, lambda: mx.eval(mx.sum(a)), samples, min_sample_s)
    col, _ = _rate(n * 4, lambda: mx.eval(mx.sum(cols, axis=0)), samples, min_sample_s)
    best = max(full, col, key=lambda r: r.median)
    dev = mx.default_device()
    _say(f"memory: {_gbs(best.median)} ({dev}, spread {best.spread:.0%})")
    return best.figure(
        f"MLX float32 reductions over {format_size(n * 4)} on {dev}: mx.sum(all) "
        f"{_stats(full, _gbs)}; mx.sum(axis=0) of a (rows, 1024) view {_stats(col, _gbs)}; the "
        f"faster median is the figure, {_today()}"
    )


def _matmul_flops(m: int, k: int, n: int, dtype, samples: int, min_sample_s: float) -> Rate:
    import mlx.core as mx

    a = mx.random.normal((m, k)).astype(dtype)
    b = mx.random.normal((k, n)).astype(dtype)
    mx.eval(a, b)
    return _rate(2.0 * m * k * n, lambda: mx.eval(a @ b), samples, min_sample_s)[0]


def measure_matmul_flops(
    prefill: tuple[int, int, int],
    decode: tuple[int, int, int],
    dtype_name: str,
    samples: int = 5,
    min_sample_s: float = 0.02,
) -> Figure:
    """Sustained matmul throughput, FLOP/s, at a prefill-like (m x k @ k x n) shape: the median
    of ``samples`` samples of at least ``min_sample_s`` seconds (see :func:`_time_calls`).

    The decode-like shape (one row) is timed too and stated in ``how``, but it is not the figure:
    decode runs quantized matrix-vector kernels, which :func:`measure_decode_matvec` times. The
    prefill-like product is the compute ceiling that batched decode and prefill approach.
    """
    import mlx.core as mx

    dtype = getattr(mx, dtype_name)
    pf = _matmul_flops(*prefill, dtype, samples, min_sample_s)
    df = _matmul_flops(*decode, dtype, samples, min_sample_s)
    _say(
        f"compute: {pf.median / 1e9:.1f} GFLOP/s prefill-like (spread {pf.spread:.0%}), "
        f"{df.median / 1e9:.1f} GFLOP/s decode-like"
    )
    shape = "{}x{} @ {}x{}"

    def gf(v: float) -> str:
        return f"{v / 1e9:.1f} GFLOP/s"

    return pf.figure(
        f"MLX {dtype_name} matmul on {mx.default_device()}: prefill-like "
        f"{shape.format(prefill[0], prefill[1], prefill[1], prefill[2])} {_stats(pf, gf)} is the "
        f"figure; decode-like {shape.format(decode[0], decode[1], decode[1], decode[2])} "
        f"{_stats(df, gf)} is not: decode is charged by the decode matvec figure, {_today()}"
    )


MATVEC_BITS = 4
"""Bits of the decode matvec test's weights: 4-bit (Q4_0/Q4_K files) is the common decode case."""
MATVEC_GROUP = 32
"""Group size of the decode matvec test: GGUF's 32-weight blocks, as the executor repacks them."""


DECODE_BATCH_ROWS = 16
"""Rows (decoded tokens) of :func:`measure_decode_batch`: the plans' usual 16 sequences."""


def measure_decode_matvec(
    shape: tuple[int, int], dtype_name: str, samples: int = 9, min_sample_s: float = 0.02
) -> Figure:
    """Quantized matrix-vector throughput, FLOP/s: one decoded token through a 4-bit weight.

    Times ``mx.quantized_matmul`` of a [1, k] activation (``dtype_name``) with an [n, k] weight
    quantized to 4 bits in groups of 32 — the kernel every decode-step projection runs in the
    executor — and reports ``2 n k / seconds``. Depending on the machine it is bound by reading
    the weights (GPUs) or by dequantizing them (MLX's CPU kernel runs on one thread and reaches
    ~3 GFLOP/s here, far below what the memory bandwidth allows), which is why the cost model
    needs it besides the bandwidth. The weight is far larger than the last-level cache.

    Args:
        shape: (n, k) of the weight.
        dtype_name: activation dtype, e.g. ``float16``.
        samples: timed samples (see :func:`_time_calls`); their median is the figure.
        min_sample_s: shortest sample, seconds.
    """
    return _quantized_matmul_rate(shape, dtype_name, samples, min_sample_s, 1, "decode matvec")


def measure_decode_batch(
    shape: tuple[int, int], dtype_name: str, samples: int = 9, min_sample_s: float = 0.02
) -> Figure:
    """Quantized matrix product throughput for a decode batch, FLOP/s: ``DECODE_BATCH_ROWS``
    decoded tokens through a 4-bit weight in one ``mx.quantized_matmul``, as a batched decode
    step runs every projection (``2 rows n k / seconds``).

    Why it is measured: how the quantized kernel scales with rows decides what batching buys (on
    MLX's CPU backend 16 rows cost 16 single rows, on NVIDIA GPUs little more than one:
    docs/kernels.md#kernel-paths). Neither the matvec rate nor the prefill-sized matmul rate
    (``compute_flops_s``) says which.

    Args:
        shape: (n, k) of the weight.
        dtype_name: activation dtype, e.g. ``float16``.
        samples: timed samples (see :func:`_time_calls`); their median is the figure.
        min_sample_s: shortest sample, seconds.
    """
    return _quantized_matmul_rate(
        shape, dtype_name, samples, min_sample_s, DECODE_BATCH_ROWS, "decode batch"
    )


def _quantized_matmul_rate(
    shape: tuple[int, int],
    dtype_name: str,
    samples: int,
    min_sample_s: float,
    rows: int,
    what: str,
    path: str = "quantized",
) -> Figure:
    """``2 rows n k / seconds`` of a [rows, k] activation by an [n, k] 4-bit weight (groups of
    32) through the kernel path ``path`` (``executor.ops.quantized_product``; ``quantized``:
    ``mx.quantized_matmul``), the median of ``samples`` samples of evaluated calls."""
    import mlx.core as mx
    from strata.executor.ops import QuantLinear, quantized_product

    n, k = shape
    dtype = getattr(mx, dtype_name)
    w = mx.random.normal((n, k)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=MATVEC_GROUP, bits=MATVEC_BITS)
    x = mx.random.normal((rows, k)).astype(dtype)
    mx.eval(wq, scales, biases, x)
    del w
    weight = QuantLinear(wq, scales, biases, MATVEC_BITS, MATVEC_GROUP)

    def run() -> None:
        mx.eval(quantized_product(x, weight, path))

    rate, calls = _rate(2.0 * rows * n * k, run, samples, min_sample_s)
    secs = 2.0 * rows * n * k / rate.median
    wbytes = wq.nbytes + scales.nbytes + biases.nbytes
    _say(
        f"{what}: {rate.median / 1e9:.2f} GFLOP/s ({_gbs(wbytes / secs)} of weights, "
        f"spread {rate.spread:.0%})"
    )
    kernel = {
        "quantized": "MLX quantized_matmul",
        "mma": "Strata's one-row kernel (executor.cuda_qmv)"
        if rows == 1
        else "Strata's tensor-core kernel (executor.cuda_mma)",
    }.get(path, path)
    return rate.figure(
        f"{kernel} of [{rows}, {k}] {dtype_name} by a [{n}, {k}] weight "
        f"({MATVEC_BITS}-bit, groups of {MATVEC_GROUP}, {format_size(wbytes)}) on "
        f"{mx.default_device()}, {calls} calls a sample, "
        f"{_stats(rate, lambda v: f'{v / 1e9:.2f} GFLOP/s')}: {secs * 1e3:.3f} ms a call, "
        f"{_gbs(wbytes / secs)} of weights, {_today()}"
    )


DEQUANT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Row counts (tokens of one forward pass) :func:`measure_dequant_crossover` times: decode
batches up to 64 and prefill chunks up to 512 tokens (where the dense path wins on a Llama-3-8B
FFN weight on an H200: docs/kernels.md#kernel-paths)."""


def _time_kernel_paths(
    shape: tuple[int, int], dtype_name: str, row_counts, path: str, repeats: int
) -> dict[int, tuple[float, float]]:
    """Seconds of ``executor.ops.quantized_product`` on [rows, k] ``dtype_name`` activations by a
    random [n, k] 4-bit weight (groups of 32), MLX's quantized path against ``path``, one call at
    a time (each evaluated and synchronized), median of ``repeats`` after a warm-up call:
    ``{rows: (quantized s, path s)}`` for each of ``row_counts``. A path whose product is not
    MLX's (relative error over ``PATH_TOLERANCE`` of the largest element), or that raises (a
    kernel this machine cannot build), is timed as infinitely slow, so that no plan takes a
    kernel that computes wrongly or not at all on this machine."""
    import mlx.core as mx
    from strata.executor.ops import QuantLinear, quantized_product

    n, k = shape
    dtype = getattr(mx, dtype_name)
    w = mx.random.normal((n, k)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=MATVEC_GROUP, bits=MATVEC_BITS)
    mx.eval(wq, scales, biases)
    del w
    weight = QuantLinear(wq, scales, biases, MATVEC_BITS, MATVEC_GROUP)
    times: dict[int, tuple[float, float]] = {}
    for rows in row_counts:
        x = mx.random.normal((rows, k)).astype(dtype)
        mx.eval(x)
        ref = quantized_product(x, weight, "quantized").astype(mx.float32)
        try:  # a kernel this machine cannot build or run is not used, as a wrong one
            got = quantized_product(x, weight, path).astype(mx.float32)
            err = (mx.abs(got - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()
            why = f"is off by {err:.2g}"
        except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError or ValueError
            first = (str(e).splitlines() or [type(e).__name__])[0]  # a message may be empty
            err, why = math.inf, f"failed ({first[:200]})"
        if not err <= PATH_TOLERANCE:
            _say(f"warning: the {path} path's product of {rows} rows {why}: not used")
        times[rows] = (
            _median_seconds(
                lambda x=x: mx.eval(quantized_product(x, weight, "quantized")), repeats
            ),
            _median_seconds(lambda x=x: mx.eval(quantized_product(x, weight, path)), repeats)
            if err <= PATH_TOLERANCE
            else math.inf,
        )
    return times


PATH_TOLERANCE = 1e-2
"""Largest relative error (of the largest element) of a kernel path's product against MLX's
quantized matmul that :func:`_time_kernel_paths` accepts: the paths differ by float16 rounding
(about 1e-3), a wrong kernel by far more."""


def measure_dequant_crossover(
    shape: tuple[int, int], dtype_name: str, repeats: int = 5
) -> tuple[Figure, dict[int, tuple[float, float]]]:
    """The kernel path of batched quantized projections: from how many rows dequantize + dense
    matmul (``executor.ops.quantized_product``'s dense path) beats ``mx.quantized_matmul``.

    Times both, one call at a time (each evaluated and synchronized), on a [rows, k] activation
    by an [n, k] 4-bit weight (groups of 32) for each of ``DEQUANT_ROWS``. The figure is the
    smallest row count from which the dense path is faster at every larger count measured (0
    when it never is). Why it is measured: on NVIDIA, MLX's quantized matmul is slow for a few
    rows (a batch of 16 decoded tokens took 10x one token on a Llama-3-8B shape:
    docs/kernels.md#kernel-paths), while dequantizing costs a fixed pass over the weights; where the
    quantized kernel scales well (Apple, the CPU) the dense path never wins.

    One call at a time, not a chain of dependent calls: the dense path adds a kernel per
    product, which small weights pay for and do not win back, and timed call by call that launch
    cost is in the figure (a chained crossover made plans slower end to end:
    docs/kernels.md#kernel-paths).

    Args:
        shape: (n, k) of the weight.
        dtype_name: activation dtype, e.g. ``float16``.
        repeats: timed runs per point; their median counts.

    Returns:
        (the figure, {rows: (quantized seconds, dequantize + matmul seconds)}).
    """
    import mlx.core as mx

    n, k = shape
    dtype = getattr(mx, dtype_name)
    times = _time_kernel_paths(shape, dtype_name, DEQUANT_ROWS, "dense", repeats)
    wins = [r for r in DEQUANT_ROWS if times[r][1] < times[r][0]]
    crossover = 0
    for r in reversed(DEQUANT_ROWS):
        if r not in wins:
            break
        crossover = r
    table = ", ".join(f"{r}: {q * 1e6:.0f}/{d * 1e6:.0f} us" for r, (q, d) in times.items())
    _say(f"dequantize + matmul from {crossover or 'never'} rows ({table})")
    return (
        Figure(
            value=crossover,
            source="measured",
            how=f"MLX quantized_matmul vs {_dequantizer(dtype)} + matmul of [rows, {k}] "
            f"{dtype_name} by a [{n}, {k}] 4-bit weight on {mx.default_device()}, median of "
            f"{repeats} (rows: quantized/dense): {table}; the dense path from the smallest row "
            f"count after which it always wins (0: never), {_today()}",
        ),
        times,
    )


def _mma_figures(
    backend: str,
    shape,
    dtype_name: str,
    repeats: int,
    batch: Figure,
    matvec: Figure,
    samples: int = 9,
    min_sample_s: float = 0.02,
) -> dict:
    """The profile's range of Strata's own kernels, measured on CUDA (absent elsewhere), and
    the decode rates of the kernel paths the executor takes: for one row the matvec's
    (``executor.cuda_qmv``) where the range holds one row and it beats ``matvec``
    (``mx.quantized_matmul``'s rate, timed the same way), for ``DECODE_BATCH_ROWS`` rows the
    tensor-core kernel's where the range holds them and it is faster than ``batch``."""
    if backend != "cuda":
        return {"decode_batch_flops_s": batch, "decode_matvec_flops_s": matvec}
    lo, hi, times = measure_mma_rows(shape, dtype_name, repeats)
    out = {
        "mma_matmul_min_rows": lo,
        "mma_matmul_max_rows": hi,
        "decode_batch_flops_s": batch,
        "decode_matvec_flops_s": matvec,
    }
    if lo.value <= 1 <= hi.value:
        own = _quantized_matmul_rate(
            shape, dtype_name, samples, min_sample_s, 1, "decode matvec (own kernel)", "mma"
        )
        if own.value > matvec.value:
            out["decode_matvec_flops_s"] = own
    t = times.get(DECODE_BATCH_ROWS, (0.0, 0.0))[1]
    if lo.value <= DECODE_BATCH_ROWS <= hi.value and t > 0:
        n, k = shape
        rate = 2.0 * DECODE_BATCH_ROWS * n * k / t
        if rate > batch.value:
            how = (
                f"Strata's tensor-core kernel (executor.cuda_mma), which the executor takes for "
                f"{DECODE_BATCH_ROWS} rows: 2 x {DECODE_BATCH_ROWS} x {n} x {k} / {t * 1e6:.0f} us "
                f"(measure_mma_rows' median); mx.quantized_matmul gave {batch.value:.3g} FLOP/s"
            )
            out["decode_batch_flops_s"] = Figure(value=rate, source="measured", how=how)
    return out


MMA_ROWS = (1, 2, 4, 8, 16, 24, 32, 64)
"""Row counts :func:`measure_mma_rows` times: the bucketed row counts (``executor.ops.bucket_rows``)
of decode batches and short chunks that Strata's own kernels take (one row: the matvec,
``executor.cuda_qmv``; more: the tensor-core kernel, at most ``executor.cuda_mma.MAX_ROWS``)."""


def measure_mma_rows(
    shape: tuple[int, int], dtype_name: str, repeats: int = 5
) -> tuple[Figure, Figure, dict[int, tuple[float, float]]]:
    """The row counts for which Strata's own 4-bit kernels (``executor.cuda_mma``: one row the
    matvec of ``executor.cuda_qmv``, more the tensor-core matmul) beat MLX's quantized matmul,
    timed call by call like :func:`measure_dequant_crossover` (each call evaluated and
    synchronized) through ``executor.ops.quantized_product``.

    The range is the run of consecutive winning counts of ``MMA_ROWS`` that ends at the
    largest win (0, 0 when the kernel never wins or does not apply here). The profile's
    [16384, 16384] weight is used because on smaller ones the small row counts are noisy
    (timings: docs/kernels.md#kernel-paths).

    Args:
        shape: (n, k) of the weight.
        dtype_name: activation dtype, e.g. ``float16``.
        repeats: timed runs per point; their median counts.

    Returns:
        (smallest rows figure, largest rows figure, {rows: (quantized s, tensor-core s)}).
    """
    import mlx.core as mx
    from strata.executor import cuda_mma

    n, k = shape
    dtype = getattr(mx, dtype_name)
    where = f"on {mx.default_device()}, {_today()}"
    rows = [r for r in MMA_ROWS if cuda_mma.supported(r, n, k, MATVEC_BITS, MATVEC_GROUP, dtype)]
    if not rows:
        how = f"Strata's own kernels do not apply to [{n}, {k}] {dtype_name} {where}"
        off = Figure(value=0, source="measured", how=how)
        return off, off, {}
    times = _time_kernel_paths(shape, dtype_name, rows, "mma", repeats)
    lo, hi = mma_range(times)
    table = ", ".join(f"{r}: {q * 1e6:.0f}/{t * 1e6:.0f} us" for r, (q, t) in times.items())
    _say(f"Strata's own 4-bit kernels for {lo}-{hi} rows ({table})")
    how = (
        f"MLX quantized_matmul vs Strata's own kernels (executor.cuda_mma; one row: the matvec, "
        f"executor.cuda_qmv) on [rows, {k}] {dtype_name} by a [{n}, {k}] 4-bit weight {where}, "
        f"median of {repeats} (rows: quantized/Strata's): {table}; the run of winning row counts "
        f"that ends at the largest"
    )
    return (
        Figure(value=lo, source="measured", how=how),
        Figure(value=hi, source="measured", how=how),
        times,
    )


def mma_range(times: dict[int, tuple[float, float]]) -> tuple[int, int]:
    """``(lo, hi)``: the run of consecutive row counts of ``times`` (``{rows: (quantized s,
    tensor-core s)}``) where the tensor-core kernel is faster, ending at the largest such count;
    (0, 0) when it never is."""
    rows = sorted(times)
    wins = [r for r in rows if times[r][1] < times[r][0]]
    if not wins:
        return 0, 0
    hi = wins[-1]
    i = rows.index(hi)
    while i > 0 and rows[i - 1] in wins:
        i -= 1
    return rows[i], hi


def _dequantizer(dtype) -> str:
    """The dequantize kernel the dense path uses for ``dtype`` on this backend (for the record)."""
    from strata.executor import cuda_dequant

    if cuda_dequant.supported(MATVEC_BITS, MATVEC_GROUP, dtype):
        return "Strata's CUDA dequantize (executor.cuda_dequant)"
    return "mx.dequantize"


OP_BLOCK_OPS = OPS_PER_UNIT["attention"] + OPS_PER_UNIT["ffn"]
"""MLX operations in one block of :func:`measure_op_overhead`'s decode step (29): the cost
model's attention and FFN counts, which that block is built to match op for op."""


class OpOverheadProbe:
    """Decode steps of ``blocks`` tiny llama blocks, timed in rounds: :func:`measure_op_overhead`.

    The blocks (width 64, 4 heads of 16, 2 KV heads, FFN 128, 4-bit weights in groups of 32) are
    built from the ops the executor uses — RMSNorm, quantized matmuls, reshapes and transposes,
    RoPE, KV-cache writes and reads, SDPA, SiLU, residual adds: ``OP_BLOCK_OPS`` per block — each
    step evaluated and copied to the host as the executor does with its logits, at a position
    that advances every step (so the KV reads change shape as in decode). ``max_steps`` bounds
    the steps of all rounds together (the KV cache's length). ``pipelined``: each step is queued
    (``mx.async_eval``) and the one before it read, as the serving engine's pipelined steps run
    (``executor.serving``), so a step's building overlaps the device's work on the last; where
    the executor schedules blocks as they are built (MLX's CUDA backend) that is the per-op
    cost the cost model's overlapped form takes (``planner.costmodel.step_compute_s``).
    """

    def __init__(self, blocks: int, max_steps: int, pipelined: bool = False) -> None:
        import mlx.core as mx

        self.blocks = blocks
        self.pipelined = pipelined
        self._pending = None  # a pipelined step's output, read after the next is queued
        self._how = (
            "pipelined (each queued, the one before read)"
            if pipelined
            else "each evaluated and copied to the host"
        )
        self.ops = blocks * OP_BLOCK_OPS
        self.per_op: list[float] = []
        self._pos = 0
        self._max = max_steps
        d, heads, kv, hd, ff = 64, 4, 2, 16, 128

        def qweight(n: int, k: int) -> tuple:
            w = mx.quantize(
                mx.random.normal((n, k)) * 0.05, group_size=MATVEC_GROUP, bits=MATVEC_BITS
            )
            mx.eval(*w)
            return w

        def qmm(x, w):
            return mx.quantized_matmul(
                x, *w, transpose=True, group_size=MATVEC_GROUP, bits=MATVEC_BITS
            )

        wq, wk, wv, wo = qweight(d, d), qweight(kv * hd, d), qweight(kv * hd, d), qweight(d, d)
        wg, wu, wd = qweight(ff, d), qweight(ff, d), qweight(d, ff)
        norm = mx.ones((d,))
        x = mx.random.normal((1, 1, d))
        keys = [mx.zeros((1, kv, max_steps + 1, hd)) for _ in range(blocks)]
        values = [mx.zeros((1, kv, max_steps + 1, hd)) for _ in range(blocks)]
        mx.eval(norm, x, keys, values)

        def step(pos: int) -> None:
            h = x
            for i in range(blocks):
                n = mx.fast.rms_norm(h, norm, 1e-5)
                q = qmm(n, wq).reshape(1, 1, heads, hd).transpose(0, 2, 1, 3)
                k = qmm(n, wk).reshape(1, 1, kv, hd).transpose(0, 2, 1, 3)
                v = qmm(n, wv).reshape(1, 1, kv, hd).transpose(0, 2, 1, 3)
                q = mx.fast.rope(q, hd, traditional=True, base=1e4, scale=1.0, offset=pos)
                k = mx.fast.rope(k, hd, traditional=True, base=1e4, scale=1.0, offset=pos)
                keys[i][:, :, pos : pos + 1] = k
                values[i][:, :, pos : pos + 1] = v
                ks, vs = keys[i][:, :, : pos + 1], values[i][:, :, : pos + 1]
                o = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=hd**-0.5)
                h = h + qmm(o.transpose(0, 2, 1, 3).reshape(1, 1, d), wo)
                n = mx.fast.rms_norm(h, norm, 1e-5)
                g, u = qmm(n, wg), qmm(n, wu)
                h = h + qmm(g * mx.sigmoid(g) * u, wd)
            if not pipelined:
                mx.eval(h)
                np.array(h)  # the executor samples on the host
                return
            # As pipelined serving steps: this step queued, then the one before read.
            mx.async_eval(h)
            if self._pending is not None:
                np.array(self._pending)
            self._pending = h

        self._step = step

    def _next(self) -> None:
        if self._pos >= self._max:
            raise StrataError(
                f"op-overhead probe ran past its {self._max} steps; make it with more max_steps"
            )
        self._step(self._pos)
        self._pos += 1

    def round(self, samples: int, steps: int, warmup_steps: int = 1) -> None:
        """``warmup_steps`` untimed steps (compilation, allocator, MLX's worker thread after a
        pause), then ``samples`` timed samples of ``steps`` steps each, kept in ``per_op``."""
        for _ in range(warmup_steps):
            self._next()
        self._drain()
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(steps):
                self._next()
            self._drain()  # every step of the sample computed and read
            self.per_op.append((time.perf_counter() - t0) / (steps * self.ops))

    def _drain(self) -> None:
        """Read the pipelined step still queued (none when steps are not pipelined)."""
        if self._pending is not None:
            np.array(self._pending)
            self._pending = None

    def figure(self, rounds: int, steps: int) -> Figure:
        """The median seconds per op of every sample taken, as a measured :class:`Figure`."""
        import mlx.core as mx

        rate = Rate.of(self.per_op)
        _say(f"per-op overhead: {rate.median * 1e6:.2f} us (spread {rate.spread:.0%})")
        return rate.figure(
            f"decode steps of {self.blocks} tiny llama blocks (width 64, 4-bit weights) built "
            f"from the executor's MLX ops, {self._how}, on "
            f"{mx.default_device()}, in {rounds} round(s) each after warm-up steps: samples of "
            f"{steps} steps / ({steps} x {self.ops} ops), "
            f"{_stats(rate, lambda v: f'{v * 1e6:.2f} us')} per operation, {_today()}"
        )


OP_ROUNDS = 6
"""Rounds of op-overhead samples in a profile run, spread over the run (see
:func:`measure_op_overhead`): one after each of the memory, matmul, decode matvec, decode batch,
copy and disk tests."""


def measure_op_overhead(
    blocks: int = 32,
    samples: int = 12,
    steps: int = 8,
    warmup_steps: int = 4,
    rounds: int = 1,
    pipelined: bool = False,
) -> Figure:
    """Seconds per operation of a lazily built MLX decode graph: build, dispatch and launch.

    Times decode steps of :class:`OpOverheadProbe`: ``warmup_steps`` untimed steps first (kernel
    compilation, the allocator's buffers, MLX's worker thread), then ``samples`` samples of
    ``steps`` steps each (32 blocks x 8 steps is tens of milliseconds on a CPU), in ``rounds``
    rounds (the profile spreads its rounds over the whole run, between other measurements). The
    figure is the median sample divided by its ops: the typical cost. Why rounds: on a virtual
    machine, per-op costs several times higher come in episodes of up to a second or so, idle
    machine or not (docs/benchmarks.md#profile-steadiness), and a median of samples all taken in
    one such episode is that episode's figure. The work per op is nil at these sizes, so this
    is the fixed cost each operation of a decode step pays however small it is, which bounds
    small models on fast GPUs. ``pipelined``: steps queued and read one step later
    (:class:`OpOverheadProbe`).
    """
    per_round = max(1, math.ceil(samples / rounds))
    probe = OpOverheadProbe(blocks, rounds * (warmup_steps + per_round * steps), pipelined)
    for _ in range(rounds):
        probe.round(per_round, steps, warmup_steps)
    return probe.figure(rounds, steps)


def measure_host_to_device(
    nbytes: int, samples: int = 7, *, touch_on_device: bool = False, warmups: int = 2
) -> Figure:
    """Host-to-device copy bandwidth, bytes/s, on the path the executor's RAM tier takes: a
    page-locked host array copied by ``executor.pinned``'s kernel where that applies (MLX's CUDA
    backend, ``touch_on_device``), else ``mx.array(numpy_array)`` + ``mx.eval``; there, with
    ``touch_on_device`` (CUDA, whose MLX arrays behave like managed memory), the first device
    read of the new array (an ``mx.sum``) is included, since that is when the bytes cross.

    Each copy makes a new MLX array and drops it, as the executor does step after step, so MLX's
    allocator state is part of the figure: the source buffer is written before timing (its pages
    exist), and ``warmups`` untimed copies come first so that the timed ones find the allocator
    as a running executor leaves it (the first copy alone also pays for fresh destination pages,
    which made a best-of-few or single copy swing by 10x). The figure is the median of
    ``samples`` copies; ``nbytes`` should make each copy last tens of milliseconds and be
    larger than the caches (256 MiB: about 0.1 s at 2.5 GB/s).
    """
    import mlx.core as mx
    from strata.executor.pinned import pinned_for

    host = np.arange(nbytes // 4, dtype=np.float32)  # written, so its pages exist before timing
    # Where the executor reads the RAM tier from page-locked memory (MLX's CUDA backend,
    # ``executor.pinned``), that is the path measured.
    pinned = pinned_for(touch_on_device)
    if pinned is not None and not pinned.register(host):
        pinned = None

    def copy() -> None:
        if pinned is not None:
            mx.eval(pinned.to_device(host))
            return
        x = mx.array(host)
        mx.eval(x)
        if touch_on_device:
            mx.eval(mx.sum(x))

    try:
        secs, _ = _time_calls(copy, samples, 0.0, warmups=warmups)
    finally:
        if pinned is not None:
            pinned.close()
    rate = Rate.of(host.nbytes / s if s > 0 else 0.0 for s in secs)
    _say(f"host->device copy: {_gbs(rate.median)} (spread {rate.spread:.0%})")
    if pinned is not None:
        what = "a page-locked host array copied by a kernel (executor.pinned) + mx.eval"
    else:
        what = "mx.array(numpy float32) + mx.eval"
    if touch_on_device and pinned is None:
        what += " + first device read (mx.sum)"
    return rate.figure(
        f"{what} of {format_size(host.nbytes)} on {mx.default_device()} after {warmups + 1} "
        f"untimed copies, one copy a sample, {_stats(rate, _gbs)}, {_today()}"
    )


# --------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class _Sizes:
    mem_bytes: int
    copy_bytes: int
    prefill: tuple[int, int, int]
    decode: tuple[int, int, int]
    matvec: tuple[int, int]
    samples: int
    """Timed samples of each figure (the op-overhead and matvec figures take a few more: their
    samples are the shortest); the figure is their median."""
    min_sample_s: float
    """Shortest sample, seconds: a sample of a fast kernel repeats it until it lasts this long."""
    op_blocks: int
    op_steps: int
    """Blocks and decode steps a sample of :func:`measure_op_overhead`."""


def _sizes(backend: str, quick: bool) -> _Sizes:
    if quick:
        return _Sizes(16 * MiB, 16 * MiB, (64, 256, 256), (1, 512, 512), (256, 256), 3, 0.0, 4, 2)
    if backend == "cpu":
        # 256 MiB is far beyond any CPU cache and a copy of it lasts about 0.1 s; 512x2048x2048
        # (4.3 GFLOP) runs a few tenths of a second on 2 cores; a 4096x4096 4-bit matvec (9 MiB)
        # about 10 ms.
        return _Sizes(
            256 * MiB, 256 * MiB, (512, 2048, 2048), (1, 4096, 4096), (4096, 4096), 7, 0.02, 32, 8
        )
    # GPUs: 1 GiB is many times the L2 (60 MB on an H200) and long against launch overhead;
    # 4096x8192x8192 is ~550 GFLOP, about a millisecond on an H200 (a 20 ms sample repeats it);
    # the 4-bit 16384x16384 matvec weight (144 MiB) is beyond the L2.
    return _Sizes(
        1 * GiB, 256 * MiB, (4096, 8192, 8192), (1, 8192, 8192), (16384, 16384), 7, 0.02, 32, 8
    )


def _describe(backend: str, info: dict, total_ram: int) -> str:
    cpu = info.get("device_name") if backend == "cpu" else platform.processor()
    parts = [
        f"{cpu or platform.machine()}, {psutil.cpu_count(logical=True)} CPU threads",
        f"{format_size(total_ram)} RAM",
        f"{platform.system()} {platform.release()}",
    ]
    if backend == "cpu":
        parts.append("no GPU: MLX CPU backend")
    else:
        gpu = info.get("device_name", info.get("architecture", "?"))
        parts.append(f"GPU {gpu} (MLX {backend})")
    return ", ".join(parts) + f"; measured by planner.profile on {_today()}"


def measure_profile(
    disk_dir: Path,
    name: str,
    *,
    read_bytes: int = DEFAULT_READ_BYTES,
    quick: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
) -> HardwareProfile:
    """Measure this machine.

    Args:
        disk_dir: a writable folder on the disk that holds (or will hold) the model files; the
            direct-I/O read test writes and deletes a file of ``read_bytes`` there.
        name: the profile's short name, e.g. ``dev-linux-cpu``.
        read_bytes: size of the disk test, bytes (rounded up to whole blocks).
        quick: shrink every test (8 MiB disk test in 1 MiB blocks at depth 2, 16 MiB memory and
            copy tests, small matmuls): about a second, for unit tests; the figures are rough.
        block_bytes: read size of the disk test, bytes, a multiple of 4096.
        queue_depth: reads in flight during the disk test.

    Returns:
        The profile: capacities in bytes, bandwidths in bytes/s, compute in FLOP/s, each with
        its source and method.

    Raises:
        StrataError: an empty ``name``, or a disk test problem (see :func:`measure_disk`).
    """
    if not name.strip():
        raise StrataError("profile name is empty; pass a short machine name, e.g. m1-max-32gb")
    import mlx.core as mx

    t_start = time.perf_counter()
    backend = detect_backend()
    if backend in ("metal", "cuda"):
        mx.set_default_device(mx.gpu)
    info = device_info(backend)
    date = _today()
    total_ram = int(psutil.virtual_memory().total)
    reserve = os_reserve_bytes(total_ram)
    _say(f"backend {backend}; RAM {format_size(total_ram)}, OS reserve {format_size(reserve)}")

    if quick:
        read_bytes = min(read_bytes, _QUICK_READ_BYTES)
        block_bytes, queue_depth = _QUICK_BLOCK_BYTES, min(queue_depth, _QUICK_QUEUE_DEPTH)
    # The disk test runs last (the MLX timings come first, in a quiet page cache), but a bad
    # folder is refused before anything is measured.
    _check_disk_dir(Path(disk_dir), max(1, math.ceil(read_bytes / block_bytes)) * block_bytes)

    sz = _sizes(backend, quick)
    compute_dtype = "float32" if backend == "cpu" else "float16"
    # The op overhead's samples come in OP_ROUNDS rounds spread over the run (see
    # measure_op_overhead), one after each other test; the first after the memory test, since
    # the slow episodes come most often in a process's first seconds.
    per_round = math.ceil((sz.samples + 4) / OP_ROUNDS)
    first_warmup = 1 if quick else 4
    # Pipelined where the cost model overlaps a step's host work with its device work.
    probe = OpOverheadProbe(
        sz.op_blocks,
        first_warmup + (OP_ROUNDS - 1) + OP_ROUNDS * per_round * sz.op_steps,
        pipelined=backend in OVERLAPPED_BACKENDS,
    )
    memory_bw = measure_memory_bandwidth(sz.mem_bytes, sz.samples, sz.min_sample_s)
    probe.round(per_round, sz.op_steps, first_warmup)
    compute = measure_matmul_flops(
        sz.prefill, sz.decode, compute_dtype, max(3, sz.samples - 2), sz.min_sample_s
    )
    probe.round(per_round, sz.op_steps)
    matvec = measure_decode_matvec(sz.matvec, compute_dtype, sz.samples + 2, sz.min_sample_s)
    probe.round(per_round, sz.op_steps)
    batch = measure_decode_batch(sz.matvec, compute_dtype, sz.samples + 2, sz.min_sample_s)
    probe.round(per_round, sz.op_steps)
    # The CPU keeps the quantized kernel: its results are batch-invariant there (measured).
    dequant = (
        None
        if backend == "cpu"
        else measure_dequant_crossover(sz.matvec, compute_dtype, sz.samples)[0]
    )
    mma = _mma_figures(
        backend, sz.matvec, compute_dtype, sz.samples, batch, matvec, sz.samples + 2,
        sz.min_sample_s,
    )  # fmt: skip
    copy = measure_host_to_device(
        sz.copy_bytes, sz.samples, touch_on_device=backend == "cuda", warmups=1 if quick else 2
    )
    probe.round(per_round, sz.op_steps)
    nvme = measure_disk(
        Path(disk_dir), read_bytes=read_bytes, block_bytes=block_bytes, queue_depth=queue_depth
    )
    probe.round(per_round, sz.op_steps)
    gpu = GPUTier(
        working_set_bytes=working_set(backend, total_ram, reserve, info),
        memory_bandwidth_bytes_s=memory_bw,
        compute_flops_s=compute,
        op_overhead_s=probe.figure(OP_ROUNDS, sz.op_steps),
        dequant_matmul_min_rows=dequant,
        **mma,
    )
    ram = RAMTier(
        capacity_bytes=Figure(
            value=total_ram, source="measured", how=f"psutil.virtual_memory().total, {date}"
        ),
        host_to_device_bytes_s=copy,
    )
    profile = HardwareProfile(
        name=name,
        description=_describe(backend, info, total_ram),
        backend=backend,  # type: ignore[arg-type]
        # CPU and Apple GPUs share one memory; MLX's CUDA arrays live in device memory.
        unified_memory=backend != "cuda",
        # float32 on CPU: MLX's CPU float16 ran ~30x slower here. float16 on GPUs; bfloat16 is
        # an option on GPUs that have it (same speed, wider range).
        compute_dtype=compute_dtype,  # type: ignore[arg-type]
        os_reserve_bytes=Figure(value=reserve, source="derived", how=RESERVE_RULE),
        gpu=gpu,
        ram=ram,
        nvme=nvme,
    )
    _say(f"done in {time.perf_counter() - t_start:.1f} s")
    return profile
