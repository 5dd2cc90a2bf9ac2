"""The planner's CBC dies with the planner (Linux, PR_SET_PDEATHSIG): a planning process killed
outright (SIGKILL, the OOM killer) must not leave CBC searching with nobody to read its answer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="a child's parent-death signal is Linux's"
)

SOLVER = "_TiedCBC"  # the planner's CBC runner (strata.planner.ilp)

CHILD = """
import operator, random, sys
import pulp
from strata.planner import ilp

# A market split instance (Cornuejols and Dawande): a few equality rows over binary variables,
# which branch and bound cannot settle in minutes; CBC is still searching when this dies.
rng = random.Random(7)
n, m = 40, 5
a = [[rng.randrange(100) for _ in range(n)] for _ in range(m)]
prob = pulp.LpProblem("market_split", pulp.LpMinimize)
x = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(n)]
over = [pulp.LpVariable(f"o{i}", lowBound=0) for i in range(m)]
under = [pulp.LpVariable(f"u{i}", lowBound=0) for i in range(m)]
prob += pulp.lpSum(over) + pulp.lpSum(under)
for i in range(m):
    row = pulp.lpSum(a[i][j] * x[j] for j in range(n))
    prob += row + under[i] - over[i] == sum(a[i]) // 2
solver = operator.attrgetter(sys.argv[1])(ilp)(msg=False, timeLimit=120, logPath=sys.argv[2])
prob.solve(solver)
"""


def _cbc_of(planner: subprocess.Popen, timeout_s: float) -> psutil.Process:
    parent = psutil.Process(planner.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if planner.poll() is not None:
            raise AssertionError(f"the planner exited early: {planner.stderr.read().decode()}")
        for child in parent.children(recursive=True):
            try:
                if child.name().startswith("cbc"):
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no CBC process under the planner within {timeout_s} s")


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_planner_leaves_no_cbc_behind(tmp_path):
    planner = subprocess.Popen(
        [sys.executable, "-c", CHILD, SOLVER, str(tmp_path / "cbc.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    cbc = None
    try:
        cbc = _cbc_of(planner, timeout_s=30)
        time.sleep(0.3)  # CBC is reading the model and searching
        assert _running(cbc), "CBC finished before the planner was killed: the test proves nothing"
        planner.send_signal(signal.SIGKILL)
        planner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _running(cbc) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(cbc), "CBC kept running after its planner was killed"
    finally:
        if planner.poll() is None:
            planner.kill()
            planner.wait()
        if cbc is not None and _running(cbc):
            cbc.kill()  # the test failed: leave nothing behind
