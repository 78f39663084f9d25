"""Hierarchical plans on the real engine under mpiexec (tests/hier_worker.py): ranks emulate
several hosts on loopback (R2COMM_HOST set per rank before the Communicator is created), the
planner sees them in comm.topology() and plans hierarchical collectives, every collective is
exact against numpy and bit for bit what the schedule computes, and a NIC of one host failing
mid-collective leaves every result bit-identical to the fault-free run."""
import os

import pytest

from conftest import ROOT, run_mpi

SHM_OK = True           # ranks of one emulated host meet through shared memory (conftest)

pytestmark = pytest.mark.mpi
WORKER = os.path.join(ROOT, "tests", "hier_worker.py")


def scenario(n, name, env=None, timeout=120, **kw):
    rc, out = run_mpi(n, [WORKER, name] + [f"{k}={v}" for k, v in kw.items()],
                      timeout=timeout, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {name} ")]
    assert lines, f"{name}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@pytest.mark.parametrize("n,layout,force", [pytest.param(4, "0,0,1,1", False, marks=pytest.mark.slow), (4, "0,0,1,1", True),
                                            (4, "0,1,1,2", False), (3, "0,0,1", True)])
def test_every_collective_on_emulated_hosts(n, layout, force):
    env = {"R2COMM_ALGO": "hierarchical"} if force else {"R2COMM_ALGO": ""}
    count, out = scenario(n, "topology", env=env, layout=layout, force=int(force))
    assert count >= 300 * n
    top = [ln for ln in out.splitlines() if ln.startswith("TOPOLOGY ")]
    assert top and "'hierarchical': True" in top[0]
    assert "'allreduce': 'hierarchical'" in top[0]


def test_flat_forced_on_emulated_hosts():
    count, out = scenario(4, "topology", env={"R2COMM_ALGO": "flat"}, layout="0,0,1,1",
                          force="flat")
    assert count >= 300 * 4
    assert "'hierarchical': True" in out and "'allreduce': 'ring'" in out


def test_one_host_plans_flat():
    count, out = scenario(4, "topology", env={"R2COMM_ALGO": ""}, layout="0,0,0,0")
    assert count >= 300 * 4
    # flat: 4 ranks of one host take recursive halving/doubling (planner.halving_allreduce)
    assert "'hierarchical': False" in out and "'allreduce': 'rabenseifner'" in out


def test_nic_failure_of_one_host_mid_collective_bit_identical():
    count, out = scenario(4, "failover", env={"R2COMM_ALGO": ""}, hosts=2)
    assert count == 2 * 4 * 4
    lines = [ln for ln in out.splitlines() if ln.startswith("FAILOVER ")]
    assert len(lines) == 2 and all("bit-identical" in ln for ln in lines)


@pytest.mark.parametrize("n,layout", [pytest.param(6, "0,0,1,1,2,2", marks=pytest.mark.slow), (5, "0,0,1,2,2")])
def test_tree_allreduce_on_emulated_hosts(n, layout):
    """Issue 32: the double-binary-tree hierarchical allreduce (3 hosts) on the real engine,
    every collective exact (R2COMM_ALGO=hierarchical_tree forces it for the allreduces)."""
    count, out = scenario(n, "topology", env={"R2COMM_ALGO": "hierarchical_tree"},
                          layout=layout, force="tree", timeout=240)
    assert count >= 300 * n
    top = [ln for ln in out.splitlines() if ln.startswith("TOPOLOGY ")]
    assert top and "'allreduce': 'hierarchical_tree'" in top[0]
