"""A NIC failure in a real job (issue 39): announced as a fact about (host, NIC), applied by every
rank to every pair through that NIC (connected or not), and the plans re-planned at one agreed
call on every rank by default, without any replan() call; then the NIC comes back. Ranks on
emulated hosts (R2COMM_HOST), loopback rails (tests/nicfacts_worker.py). The same on real
NICs in the netns testbed: tests/test_nic_facts_testbed.py."""
import json
import os

import pytest

from conftest import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nicfacts_worker.py")
FAST = {"R2COMM_RAIL_TIMEOUT_MS": "300", "R2COMM_PROBE_MS": "50", "R2COMM_PROBE_MAX_MS": "500"}


def _rows(out):
    return [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("FACTS ")]


@pytest.mark.mpi
@pytest.mark.parametrize("n,per_host", [(8, 2), (6, 1)])
def test_nic_failure_adopted_by_every_rank_at_one_call(n, per_host):
    """The last host's NIC 1 goes dark under a stream of skewed Iallreduce bursts: every rank
    switches to epoch 1 at the same call, counts that host's NICs one fewer, shows the rail
    down towards every rank of that host (also one it never connected), does not try it on a
    first use, and every result is exact; when the NIC comes back, epoch 2 at one call."""
    rc, out = run_mpi(n, [WORKER, "nicdown", f"per_host={per_host}"], timeout=150, env=FAST)
    rows = _rows(out)
    assert len(rows) == n and "OK nicdown" in out, out[-3000:]
    assert len({json.dumps(r["calls"], sort_keys=True) for r in rows}) == 1
    assert all(r["epoch_down"] == 1 and r["epoch_up"] == 2 for r in rows), rows
    assert all(r["alltoall_s"] < 3.0 for r in rows), rows     # no connect timeout on the rail


@pytest.mark.mpi
def test_replan_off_keeps_the_plans_but_not_the_dead_nic():
    """R2COMM_REPLAN=0: the fact still reaches every rank and keeps every pair off the NIC, the
    plans stay (epoch 0) until every rank calls replan()."""
    rc, out = run_mpi(6, [WORKER, "noreplan", "per_host=2"], timeout=90,
                      env=dict(FAST, R2COMM_REPLAN="0"))
    assert "OK noreplan" in out, out[-3000:]
