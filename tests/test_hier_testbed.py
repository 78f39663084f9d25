"""Hierarchical plans in the emulated cluster (r2comm.testbed, root): the hosts are network
namespaces, so the host keys differ without R2COMM_HOST, and the inter-host messages cross
tbf-shaped NICs. tests/hier_worker.py with netns=1: topology and every collective exact, and a
NIC of host 0 failing mid-collective with bit-identical results; tests/fabric_worker.py's
stream of hierarchical allreduces while `ip link set nic0 down` hits host 1 for real."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r2comm.testbed import Fabric, kill_job
from r2comm.testbed import _iproute as iproute

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

WORKER = str(Path(__file__).parent / "hier_worker.py")
TAG = f"hi{os.getpid() % 100000}"
JOB_TIMEOUT = 150



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


@pytest.mark.parametrize("hosts,n", [pytest.param(2, 4, marks=pytest.mark.slow), (3, 6)])
def test_hierarchical_collectives_in_the_testbed(netns_ok, hosts, n):
    fab = Fabric(hosts=hosts, nics=2, rate="1gbit", tag=TAG).up()
    try:
        count, out = _job(fab, n, "topology")
        assert count >= 300 * n
        assert "'hierarchical': True" in out and "'allreduce': 'hierarchical'" in out
        if hosts == 2:
            count, out = _job(fab, n, "failover")
            assert len([ln for ln in out.splitlines() if "bit-identical" in ln]) == 2
    finally:
        fab.down()
    assert not [x for x in iproute.netns_names() if x.startswith(f"r2tb-{TAG}-")]


def test_real_nic_down_under_a_hierarchical_stream(netns_ok, tmp_path):
    """4 MiB hierarchical allreduces (forced) stream for 3.5 s; 1 s in, host 1's NIC 0 goes
    down (ip link). Every result is checked exactly by the worker, rail 0 fails on the ranks,
    rail 1 carries on, and no rank takes it for a stalled process."""
    fab = Fabric(hosts=2, nics=2, rate="500mbit", tag=TAG).up()
    marker = tmp_path / "stream.json"
    env = {"R2COMM_RAIL_TIMEOUT_MS": "300", "R2COMM_PROBE_MS": "50",
           "R2COMM_PROBE_MAX_MS": "400", "R2COMM_ALGO": "hierarchical"}
    argv = [sys.executable, str(Path(__file__).parent / "fabric_worker.py"), "stream",
            "seconds=3.5", f"marker={marker}", "expect=fail", "rail=0"]
    try:
        p = fab.mpiexec(4, argv, env=env, timeout=40, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert marker.exists(), "the stream did not start"
            t0 = json.loads(marker.read_text())["t0"]
            time.sleep(max(0.0, t0 + 1.0 - time.time()))
            fab.nic_down(1, 0)
            out, _ = p.communicate(timeout=60)
        finally:
            kill_job(p)
            fab.nic_up(1, 0)
    finally:
        fab.down()
    assert p.returncode == 0 and "OK stream " in out, out[-6000:]
    rows = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines()
            if ln.startswith("STREAM ")]
    assert len(rows) == 4 and len({r["ops"] for r in rows}) == 1
    for row in rows:
        assert 0 in row["failed_rails"] and row["rails"][1][0] == "up", row
        assert not row["kinds"].get("peer_stalled"), row
    assert any(row["causes"] for row in rows if row["rank"] in (2, 3)), rows
