"""``strata profile --link HOST``: the link between this host and HOST as a cluster plan uses it,
measured over MLX's ring backend (two ranks: this process and one on HOST).

Latency: batches of round trips of a 4-byte message, each batch's mean round trip halved (one
way); bandwidth: a message of :data:`BANDWIDTH_BYTES` sent one way and a 4-byte answer, the
answer's one-way latency taken off. Each figure is the median of :data:`SAMPLES` measurements,
with their spread. On HOST a loopback address, the second rank is a child process; otherwise the
command to start it there is printed (as for a cluster plan's ranks: ``executor.ranks``).
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.common.schemas import ClusterLink, Figure
from strata.executor.ranks import (
    JOIN_TIMEOUT_S,
    RING_PORT,
    Rendezvous,
    address_towards,
    announce,
    free_port,
    is_local,
    join_ring,
    watch_parent,
)

SAMPLES = 7
"""Measurements per figure (the median is kept)."""

ROUND_TRIPS = 50
"""Round trips per latency measurement."""

BANDWIDTH_BYTES = 64 << 20
"""Bytes of one bandwidth measurement's message."""


def _ring(address: str) -> list[list[str]]:
    if is_local(address):
        return [[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]
    import socket

    try:
        there = socket.gethostbyname(address)
    except OSError as e:
        raise StrataError(f"--link {address}: the address does not resolve ({e})") from None
    here = address_towards(there)  # what the other host can reach (not a loopback name)
    return [[f"{here}:{RING_PORT}"], [f"{there}:{RING_PORT + 1}"]]


def measure_link(address: str, names: tuple[str, str]) -> ClusterLink:
    """Measure the link to ``address`` (module docstring) as a link between hosts ``names``.

    Raises:
        StrataError: the other rank did not join or failed (names it).
    """
    hosts = _ring(address)
    meet = Rendezvous("127.0.0.1" if is_local(address) else "0.0.0.0")
    ready = f"{hosts[0][0].rpartition(':')[0]}:{meet.port}"
    cmd = [sys.executable, "-m", "strata", "rank", "--link", "--rank", "1"]
    cmd += ["--ring", json.dumps(hosts, separators=(",", ":")), "--ready", ready]
    child = None
    if is_local(address):
        child = subprocess.Popen([*cmd, "--child"], stdin=subprocess.DEVNULL)
    else:
        shown = " ".join(shlex.quote(c) for c in cmd[1:])
        print(f"start the other rank on {address}: python {shown}", file=sys.stderr)

    def alive() -> None:
        if child is not None and child.poll() is not None:
            raise StrataError(f"the rank on {address} exited with status {child.returncode}")

    try:
        try:
            meet.wait({1}, JOIN_TIMEOUT_S, lambda _: f"the rank on {address}", alive)
        finally:
            meet.close()
        lat, bw = _measure(join_ring(hosts, 0), 0)
    except RuntimeError as e:  # the ring's own failures
        raise StrataError(f"the link to {address} failed: {e}") from None
    finally:
        if child is not None:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
    today = datetime.date.today().isoformat()
    how = f"strata profile --link {address}: MLX {mx.__version__} ring backend, {today}"
    return ClusterLink(
        hosts=list(names),
        bandwidth_bytes_s=_figure(
            bw, f"{BANDWIDTH_BYTES >> 20} MiB one way less the answer's latency, {how}"
        ),
        latency_s=_figure(lat, f"half the mean of {ROUND_TRIPS} 4-byte round trips, {how}"),
    )


def _figure(values: list[float], how: str) -> Figure:
    med = float(np.median(values))
    spread = (max(values) - min(values)) / med if med > 0 else 0.0
    return Figure(
        value=med, source="measured", how=how, samples=len(values), spread=round(spread, 3)
    )


def _measure(group, rank: int) -> tuple[list[float], list[float]]:
    """Both ranks' side of the measurement; rank 0 returns (one-way latencies in s, bandwidths
    in bytes/s), rank 1 answers."""
    peer = 1 - rank
    small = mx.zeros((1,), dtype=mx.int32)
    big = mx.zeros((BANDWIDTH_BYTES,), dtype=mx.uint8)
    mx.eval(small, big)

    def send(x: mx.array) -> None:
        mx.eval(mx.distributed.send(x, peer, group=group, stream=mx.cpu))

    def recv(x: mx.array) -> None:
        mx.eval(mx.distributed.recv_like(x, peer, group=group, stream=mx.cpu))

    lat, bw = [], []
    for _ in range(SAMPLES + 1):  # the first of each is a warm-up
        t0 = time.perf_counter()
        for _ in range(ROUND_TRIPS):
            if rank == 0:
                send(small)
                recv(small)
            else:
                recv(small)
                send(small)
        lat.append((time.perf_counter() - t0) / ROUND_TRIPS / 2)
    one_way = float(np.median(lat[1:]))
    for _ in range(SAMPLES + 1):
        t0 = time.perf_counter()
        if rank == 0:
            send(big)
            recv(small)
        else:
            recv(big)
            send(small)
        bw.append(BANDWIDTH_BYTES / max(time.perf_counter() - t0 - one_way, 1e-9))
    return lat[1:], bw[1:]


def answer_link(hosts: list[list[str]], ready: str, child: bool) -> None:
    """Rank 1 of :func:`measure_link` (``strata rank --link``): ``ready`` is rank 0's
    rendezvous."""
    if child:
        watch_parent()
    announce(ready, 1)
    try:
        _measure(join_ring(hosts, 1), 1)
    except RuntimeError as e:
        raise StrataError(f"the link to rank 0 failed: {e}") from None
