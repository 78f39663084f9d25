"""Hierarchical plans in the emulated cluster (r2comm.testbed, root): the hosts are network
namespaces, so the host keys differ without R2COMM_HOST, and the inter-host messages cross
tbf-shaped NICs. tests/hier_worker.py with netns=1: topology and every collective exact, and a
NIC of host 0 failing mid-collective with bit-identical results."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r2comm.testbed import Fabric, TestbedError, kill_job
from r2comm.testbed import _iproute as iproute

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

WORKER = str(Path(__file__).parent / "hier_worker.py")
TAG = f"hi{os.getpid() % 100000}"
JOB_TIMEOUT = 150


@pytest.fixture(scope="module")
def netns_ok():
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces")
    try:
        iproute.tool("ip")
        iproute.tool("tc")
    except TestbedError as exc:
        pytest.skip(str(exc))


def _job(fab, n, scenario, **kw):
    argv = [sys.executable, WORKER, scenario, "netns=1", f"hosts={fab.hosts}"] + \
        [f"{k}={v}" for k, v in kw.items()]
    p = fab.mpiexec(n, argv, env={"R2COMM_ALGO": ""}, timeout=JOB_TIMEOUT,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True)
    try:
        out, _ = p.communicate(timeout=JOB_TIMEOUT + 30)
    except subprocess.TimeoutExpired:
        kill_job(p)
        out, _ = p.communicate(timeout=30)
        pytest.fail(f"{scenario} did not finish:\n{out[-4000:]}")
    assert p.returncode == 0, f"{scenario} failed (rc {p.returncode}):\n{out[-6000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, out[-4000:]
    return int(lines[-1].split()[2]), out


@pytest.mark.parametrize("hosts,n", [(2, 4), (3, 6)])
def test_hierarchical_collectives_in_the_testbed(netns_ok, hosts, n):
    fab = Fabric(hosts=hosts, nics=2, rate="1gbit", tag=TAG).up()
    try:
        count, out = _job(fab, n, "topology")
        assert count >= 300 * n
        assert "'hierarchical': True" in out and "'allreduce': 'hierarchical'" in out
        if hosts == 2:
            count, out = _job(fab, n, "failover", count=(4 << 20) // 4 + 7)
            assert len([ln for ln in out.splitlines() if "bit-identical" in ln]) == 2
    finally:
        fab.down()
    assert not [x for x in iproute.netns_names() if x.startswith(f"r2tb-{TAG}-")]
