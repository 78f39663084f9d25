"""Bootstrap without MPI: StoreComm (mpi4py's bootstrap calls over a set/get/add/wait store),
DirStore, torch's TCPStore, and Communicator.from_store in a real multi-process job."""
import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT
from r2comm.control.bootstrap_store import DirStore, StoreComm, MAX, SUM, UNDEFINED
from r2comm.errors import R2commArgumentError, R2commTimeout

SHM_OK = True           # run and passing over shared memory between local ranks (conftest)


def _ranks(n, fn):
    """fn(rank) in n threads; their results (exceptions re-raised), bounded in time."""
    out, errs = [None] * n, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:       # handed to the test
            errs.append(exc)
    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    if errs:
        raise errs[0]
    return out


def _collectives(make_store, n=3):
    def rank(r):
        c = StoreComm(make_store(r), r, n, "job", timeout=20)
        res = {"gather": c.allgather(r * 10), "bcast": c.bcast(f"from{r}", root=n - 1),
               "max": c.allreduce(r, op=MAX), "sum": c.allreduce(r + 1, op=SUM)}
        c.Barrier()
        sub = c.Split(UNDEFINED if r == 0 else 7, key=-r)
        res["sub"] = None if sub is None else (sub.rank, sub.size, sub.allgather(r))
        d = c.Dup()
        res["dup"] = d.allgather(r)
        return res
    return _ranks(n, rank)


def test_storecomm_over_dirstore(tmp_path):
    res = _collectives(lambda r: DirStore(tmp_path, timeout=20))
    for r, x in enumerate(res):
        assert x["gather"] == [0, 10, 20]
        assert x["bcast"] == "from2"
        assert x["max"] == 2 and x["sum"] == 6
        assert x["dup"] == [0, 1, 2]
    assert res[0]["sub"] is None
    assert res[1]["sub"] == (1, 2, [2, 1]) and res[2]["sub"] == (0, 2, [2, 1])


def test_storecomm_over_torch_tcpstore():
    torch_dist = pytest.importorskip("torch.distributed", reason="torch is not installed")
    import datetime
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                 wait_for_workers=False)
    port = server.port
    stores = {0: server}

    def make(r):
        if r not in stores:
            stores[r] = torch_dist.TCPStore("127.0.0.1", port, None, False,
                                            datetime.timedelta(seconds=30))
        return stores[r]
    res = _collectives(make)
    assert [x["gather"] for x in res] == [[0, 10, 20]] * 3
    assert res[1]["sub"] == (1, 2, [2, 1])


def test_storecomm_timeout_and_arguments(tmp_path):
    c = StoreComm(DirStore(tmp_path), 0, 2, "lonely", timeout=0.3)
    with pytest.raises(R2commTimeout, match="rank 0/2"):
        c.allgather(1)                      # rank 1 never comes
    with pytest.raises(R2commArgumentError):
        StoreComm(DirStore(tmp_path), 2, 2)
    with pytest.raises(R2commArgumentError, match="set"):
        StoreComm(object(), 0, 1)
    with pytest.raises(R2commArgumentError, match="op"):
        StoreComm(DirStore(tmp_path), 0, 1).allreduce(1, op="XOR")


def test_dirstore_add_is_atomic(tmp_path):
    s = DirStore(tmp_path, timeout=20)
    _ranks(4, lambda r: [s.add("counter", 1) for _ in range(25)])
    assert int(s.get("counter")) == 100


@pytest.mark.parametrize("n", [2, 3])
def test_communicator_from_store_without_mpi(n, tmp_path):
    """Communicator.from_store over a DirStore: ranks started by a plain launcher (here
    subprocess), collectives, Split, Dup and object calls; MPI never initialised."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = os.path.join(ROOT, "tests", "store_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(n), str(tmp_path / "st")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(n)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish in 120 s")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK store {r}" in out, out[-3000:]
