"""A real NIC failure at scale's shape, in the netns testbed (issue 39): 4 hosts x 2 NICs, 2 ranks a
host, a stream of exact allreduces, `ip link set nic1 down` on host 3: every rank adopts the
same new epoch at the same call, counts that host's NICs one fewer
(topology()["rails_up_per_host"]), without any replan() call, within 2 s; then `ip link set
up`, and back (tests/nicfacts_worker.py realdown). The slow tier runs it 10 times."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r2comm.testbed import Fabric, kill_job

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

WORKER = str(Path(__file__).parent / "nicfacts_worker.py")
TAG = f"nf{os.getpid() % 100000}"
ENV = {"R2COMM_RAIL_TIMEOUT_MS": "300", "R2COMM_PROBE_MS": "50", "R2COMM_PROBE_MAX_MS": "500",
       "R2COMM_PROBE": "0"}
ADOPT_S = 2.0


def _write(path, obj):
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _wait(path, proc, limit):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"the job ended early:\n{proc.communicate()[0][-4000:]}"
        assert time.monotonic() - t0 < limit, f"no {path.name} within {limit} s"
        time.sleep(0.02)


def run_once(fab, tmp_path, k=0):
    marker = tmp_path / f"facts{k}.json"
    argv = [sys.executable, WORKER, "realdown", "netns=1", f"marker={marker}", "victim=3",
            "rail=1"]
    p = fab.mpiexec(8, argv, env=ENV, timeout=120, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait(marker, p, 60)
        time.sleep(0.3)
        fab.nic_down(3, 1)
        _write(Path(str(marker) + ".down"), {"t": time.time()})
        _wait(Path(str(marker) + ".seen"), p, 40)
        fab.nic_up(3, 1)
        _write(Path(str(marker) + ".up"), {"t": time.time()})
        out, _ = p.communicate(timeout=90)
    except BaseException:
        kill_job(p)
        raise
    finally:
        fab.nic_up(3, 1)
    assert p.returncode == 0 and "OK realdown" in out, out[-6000:]
    rows = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("FACTS ")]
    assert len(rows) == 8, out[-3000:]
    assert all(r["rails_up_down"] == [2, 2, 2, 1] for r in rows), rows
    assert len({json.dumps(r["calls"], sort_keys=True) for r in rows}) == 1, rows
    assert max(r["adopt_s"] for r in rows) < ADOPT_S, [(r["adopt_s"], r["facts_at"]) for r in rows]
    return rows


@pytest.fixture(scope="module")
def fab4(netns_ok):
    fab = Fabric(hosts=4, nics=2, rate="1gbit", tag=TAG).up()
    yield fab
    fab.down()


def test_real_nic_down_adopted_by_every_rank(fab4, tmp_path):
    rows = run_once(fab4, tmp_path)
    print("adopt_s", sorted(r["adopt_s"] for r in rows), "back_s", sorted(r["back_s"] for r in rows))
    print(rows[0]["facts_at"])


@pytest.mark.slow
def test_real_nic_down_ten_runs(fab4, tmp_path):
    adopt = []
    for k in range(10):
        adopt += [r["adopt_s"] for r in run_once(fab4, tmp_path, k)]
    print("adopt_s over 10 runs: median", sorted(adopt)[len(adopt) // 2], "max", max(adopt))
