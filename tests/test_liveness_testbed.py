"""A host cut off the network, on real (veth) NICs: the failure detector declares its rank dead,
every survivor raises within the bound (issue 31), and the survivors shrink it away and go on
(issue 44).

The netns testbed, 4 hosts x 1 rail NIC plus the management network (the control address), one
rank per host streaming exact allreduces (tests/isolate_worker.py) with
R2COMM_PEER_TIMEOUT_MS=30000, so that only the failure detector can end them within 5 s. Host 3
is isolated (Fabric.isolate: its rail and management switch ports down): its process runs on,
but nothing it sends arrives and nothing refuses, so no connection error tells the others."""
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

WORKER = str(Path(__file__).parent / "isolate_worker.py")
TAG = f"iso{os.getpid()}"
BOUND = 5.0


@pytest.fixture(scope="module")
def fab(netns_ok):
    with Fabric(hosts=4, nics=1, rate="1gbit", tag=TAG) as fabric:
        yield fabric
    assert not [n for n in iproute.netns_names() if n.startswith(f"r2tb-{TAG}-")]


def test_isolated_host_declared_dead_and_every_survivor_raises(fab, tmp_path):
    victim = 3
    proc = fab.mpiexec(4, [sys.executable, WORKER, str(tmp_path)], timeout=90,
                       env={"R2COMM_PEER_TIMEOUT_MS": "30000"}, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
    cut_at = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists(), "the job never got warm"
        time.sleep(0.5)
        cut_at = time.time()
        fab.isolate(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(
                (tmp_path / f"rank{r}.json").exists() for r in range(4) if r != victim) < 3:
            time.sleep(0.05)
    finally:
        fab.reconnect(victim)
        kill_job(proc)
        text, _ = proc.communicate(timeout=20)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in range(4) if r != victim and (tmp_path / f"rank{r}.json").exists()]
    assert len(rows) == 3, text[-4000:]
    late = sorted(row["raised_at"] - cut_at for row in rows)
    print(f"\nisolated host: survivors raised {', '.join(f'{t:.2f}' for t in late)} s after the cut")
    for row in rows:
        assert row["error"] == "R2commNetworkError", (row, text[-3000:])
        assert 0 < row["raised_at"] - cut_at < BOUND, row
        assert str(victim) in row["dead"], row
        assert row["inexact"] == 0 and row["ops"] > 0, row
        # issue 44: the survivors shrank the cut-off host away and go on, exactly
        assert row["shrunk"].get("members") == [0, 1, 2] and row["shrunk"]["exact"], row
    print(f"isolated host: shrunk away {max(row['shrunk']['at'] for row in rows) - cut_at:.2f} s "
          f"after the cut")
