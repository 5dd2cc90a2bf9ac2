"""The processes of a cluster plan: rank 0 starts the other ranks, they join MLX's ring, rank 0
watches them.

Rank ``i`` runs stage ``i`` (``strata.common.cluster``). Rank 0 is the process of ``strata run``,
``serve`` or ``bench``; it starts every rank whose host is this machine (address 127.0.0.1,
localhost or this host's name) as a child process, ``python -m strata rank PLAN --rank i``, and
for every other host prints the command to start that rank there by hand (attach mode). Each
rank, once loaded, says so to rank 0's :class:`Rendezvous` (at most :data:`JOIN_TIMEOUT_S`
seconds, naming the ranks still missing); then all join the ring
(``mx.distributed.init(backend="ring")``, the hostfile in ``MLX_HOSTFILE``: one ``["ip:port"]``
per rank). Where every host is this machine the ranks listen on free ports of 127.0.0.1; else
on each host's address, a rank on another host on :data:`RING_PORT` + its rank. A rank's
rendezvous connection stays open as its doorbell (:func:`wait_bell`).

No orphans: a child ignores Ctrl-C (rank 0 stops it), exits when rank 0 goes (Linux's parent
death signal, and a thread that checks its parent every :data:`PARENT_CHECK_S`), and rank 0 kills
the children it started when it stops or when one of them dies. Every rank also exits when the
ring breaks (MLX's ring raises on a lost connection: ``executor.pipeline``) or its doorbell
closes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from strata.common.errors import StrataError
from strata.common.schemas import Plan, StagePlan
from strata.common.yamlio import to_yaml

JOIN_TIMEOUT_S = 600.0
"""Seconds rank 0 waits for the other ranks to load their stages and join the ring."""

RING_PORT = 52100
"""A rank on another host listens on this port plus its rank (local ranks take free ports)."""

PARENT_CHECK_S = 0.5
"""Seconds between a child rank's checks that rank 0 still runs."""

STOP_WAIT_S = 3.0
"""Seconds rank 0 gives a child to exit after the stop message, before it kills it."""

DEATH_WAIT_S = 1.5
"""Seconds rank 0 waits, after a ring operation failed, for a child's exit to name the rank
that died (the failure may be seen first by a rank next to it)."""

NEIGHBOUR_STOPPED = 3
"""A rank's exit status when it stopped because a neighbour or rank 0 did (a ``ClusterError``):
rank 0 names a rank that died otherwise first (:meth:`RankSet.dead`)."""

LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}

_joined = False
"""Whether this process joined a ring (``mx.distributed.init`` forms the group once)."""


def is_local(address: str) -> bool:
    """Whether ``address`` is this machine (loopback, or this host's name)."""
    return address in LOCAL_NAMES or address in {socket.gethostname(), socket.getfqdn()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ring binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_hosts(stages: list[StagePlan]) -> list[list[str]]:
    """The ring's hostfile for ``stages`` (one ``["ip:port"]`` per rank): where every host is
    this machine, 127.0.0.1 and free ports; else each host's address (this machine's for a local
    one), a local rank on a free port, another host's on :data:`RING_PORT` + rank.

    Raises:
        StrataError: a host's address does not resolve.
    """
    if all(is_local(s.address) for s in stages):
        return [[f"127.0.0.1:{free_port()}"] for _ in stages]
    ips = []
    for s in stages:
        try:
            ips.append(None if is_local(s.address) else socket.gethostbyname(s.address))
        except OSError as e:
            raise StrataError(
                f"host {s.host}: address {s.address} does not resolve ({e}); fix it in the "
                "cluster file and re-plan"
            ) from None
    here = address_towards(next(ip for ip in ips if ip is not None))
    return [
        [f"{here}:{free_port()}" if ip is None else f"{ip}:{RING_PORT + i}"]
        for i, ip in enumerate(ips)
    ]


def address_towards(remote: str) -> str:
    """This machine's address on the route to ``remote`` (an IP): what a rank there can reach
    (the host name may resolve to 127.0.0.1). A UDP socket's connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        try:
            u.connect((remote, 9))
            return u.getsockname()[0]
        except OSError as e:
            raise StrataError(f"no route from this machine to {remote} ({e})") from None


def check_not_joined() -> None:
    """Refuse a second ring in this process (``mx.distributed.init`` forms one group, once).

    Raises:
        StrataError: this process joined a ring already.
    """
    if _joined:
        raise StrataError(
            "this process has run a cluster plan already, and MLX's ring backend joins once per "
            "process: run each cluster plan in a process of its own (strata bench: without "
            "--expert-cache-modes or --baseline)"
        )


def join_ring(hosts: list[list[str]], rank: int):
    """Join MLX's ring as ``rank`` of ``hosts`` (the hostfile, written to a temporary file).

    ``mx.distributed.init`` waits for every rank without a limit and holds Python's lock
    meanwhile (no thread of this process runs, no timeout can fire): call it once every rank is
    known to be ready (:class:`Rendezvous`), so that it waits a second, not forever.

    Returns:
        the global group.

    Raises:
        StrataError: the backend refused.
    """
    import mlx.core as mx

    global _joined
    check_not_joined()
    _joined = True
    fd, path = tempfile.mkstemp(prefix="strata-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), path
    try:
        return mx.distributed.init(strict=True, backend="ring")
    except Exception as e:
        raise StrataError(f"rank {rank}: MLX's ring backend failed: {e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


class Rendezvous:
    """Where the ranks past 0 say they are ready (loaded) before any rank joins the ring
    (:func:`join_ring` says why): a TCP socket of rank 0's, one line ``RANK`` per rank. Each
    connection stays open as that rank's doorbell: MLX's ring receive polls its socket without
    sleeping (a core at 100 % while it waits: measured with MLX 0.32.4), so an idle rank waits
    for a byte on its doorbell instead (:func:`wait_bell`), which also closes when rank 0 goes.

    Args:
        bind: the address to listen on (127.0.0.1 where every rank is local, else all).
    """

    def __init__(self, bind: str):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((bind, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.bells: dict[int, socket.socket] = {}
        """Each ready rank's connection, kept as its doorbell (:meth:`ring`)."""

    def wait(
        self,
        ranks: set[int],
        timeout: float,
        waiting_for: Callable[[set[int]], str],
        alive: Callable[[], None] = lambda: None,
        identity: str = "",
    ) -> None:
        """Wait until every rank of ``ranks`` said it is ready, at most ``timeout`` seconds,
        calling ``alive`` (which raises where a rank it started died) between polls. Each rank
        names the plan it loaded (:func:`plan_identity`); one that loaded another is refused.

        Raises:
            StrataError: not all ready in time (``waiting_for(missing)`` names them), or a rank
                runs another plan than ``identity``.
        """
        missing = set(ranks)
        deadline = time.monotonic() + timeout
        while missing:
            alive()
            if time.monotonic() > deadline:
                raise StrataError(
                    f"the cluster's ranks did not all start within {timeout:.0f} s; still "
                    f"waiting for {waiting_for(missing)}"
                )
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(5.0)
            try:
                words = conn.recv(256).decode().split()
                rank, theirs = int(words[0]), (words[1] if len(words) > 1 else "")
            except (OSError, ValueError, IndexError):
                conn.close()
                continue
            if theirs != identity:
                with contextlib.suppress(OSError):
                    conn.sendall(REFUSED)
                conn.close()
                raise StrataError(
                    f"rank {rank} runs another plan than this one (plan {theirs[:12] or 'none'} "
                    f"against {identity[:12]}): start it with the command printed for this plan, "
                    "with a copy of this plan file"
                )
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            missing.discard(rank)
            self.bells[rank] = conn
        for conn in self.bells.values():  # every rank may join the ring now
            with contextlib.suppress(OSError):  # one gone meanwhile fails the ring's join
                conn.sendall(GO)

    def ring(self) -> None:
        """One byte to every rank's doorbell: a header follows (:func:`wait_bell`). A rank
        that is gone is left to the ring's own error."""
        for conn in self.bells.values():
            with contextlib.suppress(OSError):
                conn.sendall(b"!")

    def close(self, bells: bool = True) -> None:
        """Stop listening; with ``bells``, hang up the doorbells too (the ranks then exit)."""
        self.sock.close()
        if bells:
            for conn in self.bells.values():
                conn.close()
            self.bells = {}


GO, REFUSED = b"+", b"?"
"""Rank 0's answer to a rank's ready line: join the ring now, or not (another plan)."""


def plan_identity(plan: Plan) -> str:
    """The sha256 of ``plan`` as written (``yamlio.to_yaml``): what a rank tells rank 0 it
    loaded, so that a rank started by hand with another plan (its stages cut elsewhere) is
    refused rather than sent rows it would compute wrongly."""
    return hashlib.sha256(to_yaml(plan).encode()).hexdigest()


def announce(
    address: str, rank: int, timeout: float = JOIN_TIMEOUT_S, identity: str = ""
) -> socket.socket:
    """Tell rank 0's :class:`Rendezvous` at ``address`` (``ip:port``) that ``rank`` is ready
    with the plan ``identity`` (:func:`plan_identity`), retrying while it is not listening yet
    (saying so once), at most ``timeout`` seconds.

    Returns:
        the connection, this rank's doorbell (:func:`wait_bell`).

    Raises:
        StrataError: rank 0 could not be reached in time, refused this rank's plan, or stopped
            before every rank was ready.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            c = socket.create_connection((host, int(port)), timeout=5.0)
            c.sendall(f"{rank} {identity}\n".encode())
            c.settimeout(None)
        except OSError as e:
            if not said:
                print(
                    f"rank {rank}: waiting for rank 0 at {address} (at most {timeout:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            if time.monotonic() > deadline:
                raise StrataError(
                    f"rank {rank}: rank 0 is not reachable at {address} ({e}); start strata "
                    "run|serve first, then this command"
                ) from None
            time.sleep(0.5)
            continue
        # Rank 0 answers once every rank is ready (then all join MLX's ring, whose join would
        # wait forever for a rank 0 that never comes), or refuses this rank's plan.
        try:
            answer = c.recv(1)
        except OSError:
            answer = b""
        if answer == GO:
            return c
        c.close()
        if answer == REFUSED:
            raise StrataError(
                f"rank {rank}: rank 0 at {address} runs another plan than this one; start this "
                "rank with a copy of the plan file rank 0 runs (the command it printed)"
            )
        raise StrataError(
            f"rank {rank}: rank 0 at {address} stopped before the ring formed; see its output"
        )


def wait_bell(bell: socket.socket) -> bool:
    """Sleep until rank 0 rings ``bell`` (:meth:`Rendezvous.ring`); False once it hung up (it
    stopped, or its process is gone)."""
    try:
        return bell.recv(1) != b""
    except OSError:
        return False


def watch_parent() -> None:
    """Exit this process when its parent (rank 0) goes: Linux's parent-death signal, and a
    daemon thread checking the parent's id elsewhere. Ctrl-C in the terminal is rank 0's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent went before the signal was set
        os._exit(1)

    def check() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=check, name="strata-parent-watch", daemon=True).start()


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    log: Path


@dataclass
class RankSet:
    """The ranks past 0 of a cluster plan as rank 0 sees them (module docstring).

    Args:
        plan_path: the plan file (children load it; other hosts need a copy at that path).
        model_path: the model file this host found (children on this host use it).
        stages: the plan's stages (``Plan.cluster.stages``).
        command: the hidden command a rank runs (``[python, -m, strata, rank]`` by default).
    """

    plan_path: Path
    model_path: Path | None
    stages: list[StagePlan]
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "strata", "rank"])
    hosts: list[list[str]] = field(default_factory=list)
    children: dict[int, _Child] = field(default_factory=dict)
    _dir: tempfile.TemporaryDirectory | None = None
    _meet: Rendezvous | None = None
    _stopping: bool = False

    def name(self, rank: int) -> str:
        """``rank N (host H at ADDRESS)``."""
        s = self.stages[rank]
        return f"rank {rank} (host {s.host} at {s.address})"

    def rank_command(self, rank: int, extra: tuple[str, ...] = ()) -> list[str]:
        """The command that starts ``rank`` (its ring hostfile inline)."""
        cmd = [*self.command, str(self.plan_path), "--rank", str(rank)]
        cmd += ["--ring", json.dumps(self.hosts, separators=(",", ":"))]
        ready = self.hosts[0][0].rpartition(":")[0]
        return [*cmd, "--ready", f"{ready}:{self._meet.port}", *extra]

    def start(self) -> None:
        """Pick the ring's ports and start every local rank past 0 as a child process; print
        the command for each rank on another host (attach mode).

        Raises:
            StrataError: an address does not resolve; a child cannot be started.
        """
        check_not_joined()
        self.hosts = ring_hosts(self.stages)
        local = all(is_local(s.address) for s in self.stages)
        self._meet = Rendezvous("127.0.0.1" if local else "0.0.0.0")
        self._dir = tempfile.TemporaryDirectory(prefix="strata-ranks-")
        for rank in range(1, len(self.stages)):
            s = self.stages[rank]
            if not is_local(s.address):
                cmd = " ".join(_quote(c) for c in self.rank_command(rank)[1:])
                print(
                    f"start {self.name(rank)} there: python {cmd} (with the plan at "
                    f"{self.plan_path} and its model)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            extra = ("--child",) + (("--model", str(self.model_path)) if self.model_path else ())
            log = Path(self._dir.name) / f"rank{rank}.log"
            try:
                with open(log, "wb") as f:
                    proc = subprocess.Popen(
                        self.rank_command(rank, extra),
                        stdin=subprocess.DEVNULL,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
            except OSError as e:
                self.stop()
                raise StrataError(f"cannot start {self.name(rank)}: {e}") from None
            self.children[rank] = _Child(rank, proc, log)

    def check_alive(self) -> None:
        """Raise if a child exited.

        Raises:
            StrataError: names the rank, its status and the last line it wrote.
        """
        dead = self.dead()
        if dead:
            raise StrataError(dead[0])

    def dead(self) -> list[str]:
        """What each child that exited said: ``rank N (host ...) exited with status S: LINE``,
        the ranks that stopped because another did (:data:`NEIGHBOUR_STOPPED`) last, else in
        rank order: the first names the rank that failed."""
        out = []
        for c in self.children.values():
            code = c.proc.poll()
            if code is None:
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            last = _last_line(c.log)
            said = f"{self.name(c.rank)} {how}" + (f": {last}" if last else "")
            out.append((code == NEIGHBOUR_STOPPED, c.rank, said))
        return [said for *_, said in sorted(out)]

    def join(self, identity: str = "", timeout: float = JOIN_TIMEOUT_S):
        """Wait for every rank to be ready with the plan ``identity`` (:class:`Rendezvous`,
        watching the children meanwhile), then join the ring as rank 0 (:func:`join_ring`).

        Raises:
            StrataError: a child died while loading (its last line), or not every rank was
                ready in time (names the ranks missing).
        """

        def waiting(missing: set[int]) -> str:
            return ", ".join(self.name(r) for r in sorted(missing))

        assert self._meet is not None  # start() made it
        try:
            self._meet.wait(
                set(range(1, len(self.stages))), timeout, waiting, self.check_alive, identity
            )
        except BaseException:
            self._meet.close()
            raise
        self._meet.close(bells=False)  # kept: the doorbells
        return join_ring(self.hosts, 0)

    def ring(self) -> None:
        """Wake the ranks: a header follows (:meth:`Rendezvous.ring`)."""
        if self._meet is not None:
            self._meet.ring()

    def explain(self, message: str) -> str:
        """A ring failure's message with the rank that died, where a child did (waits up to
        :data:`DEATH_WAIT_S` for its exit to show)."""
        deadline = time.monotonic() + DEATH_WAIT_S
        while True:
            dead = self.dead()
            if dead or not self.children or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return f"{dead[0]} ({message})" if dead else message

    def watch(self, on_dead: Callable[[str], None]) -> None:
        """Call ``on_dead`` (from a daemon thread) with the first child death's message."""

        def run() -> None:
            while not self._stopping:
                dead = self.dead()
                if dead:
                    if not self._stopping:
                        on_dead(dead[0])
                    return
                time.sleep(0.2)

        threading.Thread(target=run, name="strata-rank-watch", daemon=True).start()

    def quiet(self) -> None:
        """Rank 0 is stopping the ranks: their exits are no failure (:meth:`watch` stops)."""
        self._stopping = True

    def stop(self, wait: float = STOP_WAIT_S) -> None:
        """Wait up to ``wait`` seconds for the children to exit, then kill what is left; drop
        the logs. Safe to call twice."""
        self._stopping = True
        if self._meet is not None:
            self._meet.close()  # a rank still waiting for its doorbell sees it close
        deadline = time.monotonic() + wait
        for c in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """Kill every child at once (the ring broke: none of them can go on)."""
        self._stopping = True
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.kill()
        self.stop(0.0)


def _last_line(path: Path) -> str:
    """The last non-empty line of a child's log (without MLX's ring chatter), or ''."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [x.strip() for x in lines if x.strip() and not x.startswith("[ring]")]
    return lines[-1] if lines else ""


def _quote(s: str) -> str:
    return shlex.quote(s)
