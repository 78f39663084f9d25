"""Planner schedules on the real engine under mpiexec (tests/planner_worker.py): the degraded
AllReduce and rings re-ranked / relayed around broken pairs, checked against numpy and bit for
bit across ranks; with n >= 3 a pair loses every rail for real and the planner, fed the engines'
live rail state, routes around it."""
import os

import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.mpi
WORKER = os.path.join(ROOT, "tests", "planner_worker.py")
CASES = 6           # sizes/dtypes per algorithm in the worker (CASES)


def scenario(n, name, timeout=60, **kw):
    rc, out = run_mpi(n, [WORKER, name] + [f"{k}={v}" for k, v in kw.items()], timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {name} ")]
    assert lines, f"{name}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_degraded_allreduce_on_the_engine(n):
    """n >= 3: the weighted direct schedule too, exact on the engine; the last rank then loses
    NIC 1 for real; the live state shows its host at β = 0.5 and the planner picks the
    degraded AllReduce for the large message."""
    count, out = scenario(n, "degraded")
    live = [ln for ln in out.splitlines() if ln.startswith("LIVE ")]
    assert count == (4 * CASES + (CASES if n > 2 else 0) + 2 + len(live)) * n
    if n >= 3:
        assert len(live) == CASES and "chose degraded -> degraded" in live[-1]


@pytest.mark.parametrize("n", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_rerouted_and_relayed_rings_on_the_engine_and_a_real_broken_pair(n):
    count, out = scenario(n, "rerouted")
    assert count == (3 * CASES + CASES) * n
    live = [ln for ln in out.splitlines() if ln.startswith("LIVE ")]
    assert len(live) == CASES
    big = live[-1]
    assert ("ring_rerouted" in big) if n == 4 else ("+relay" in big)   # n=3: no Hamiltonian ring
    assert "AUTO [('ok', " in out


@pytest.mark.parametrize("n", [3, 4])
def test_direct_rail_weights_on_the_engine(n):
    """The weighted direct schedule's per-pair rail weights (the last rank's NIC 1 at 1/4):
    every case exact on the engine, and each healthy rank's bytes to each healthy peer split
    over the two rails as the plan declares, every pair within 0.05 in one same try (the
    worker judges whole tries, never a pair on its best one); a declared rail that fails hard
    mid-operation leaves the result exact."""
    count, out = scenario(n, "railsplit")
    assert count == (CASES + 2) * n
    split = [ln for ln in out.splitlines() if ln.startswith("SPLIT ")]
    assert len(split) == (n - 1) * (n - 2), out[-3000:]
    assert all(float(ln.split()[3]) > 0.55 for ln in split), split     # declared: more on rail 1
    tries = {ln.rsplit("(try ", 1)[1] for ln in split}
    assert len(tries) == 1, split                                       # one try, every pair
    assert all(abs(float(ln.split()[5]) - float(ln.split()[3])) < 0.05 for ln in split), split


def test_two_ranks_without_a_rail_are_refused():
    count, _ = scenario(2, "rerouted")
    assert count == 2
