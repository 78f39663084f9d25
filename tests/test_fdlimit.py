"""File descriptors at start-up (issue 31): the soft RLIMIT_NOFILE is raised to the hard
limit, a rank near its limit is warned about, one over it fails start-up on every rank with
R2commResourceError (not EMFILE in some connection attempt). The jobs really run several
ranks, launched with a lowered limit (tests/fdlimit_worker.py does the checks inside)."""
import json
import os
import shutil
import socket
import sys
import threading
import time

import pytest

from conftest import run_mpi, ROOT
from r2comm.control import fdlimit

WORKER = f"{ROOT}/tests/fdlimit_worker.py"


PRLIMIT = shutil.which("prlimit")     # util-linux: every rank starts under the lowered limit


def _job(n, scenario, soft, hard, env=None, **kw):
    if PRLIMIT is None:
        pytest.fail("prlimit (util-linux) not found: it sets the ranks' RLIMIT_NOFILE")
    argv = [f"--nofile={soft}:{hard}", sys.executable, WORKER, scenario]
    rc, out = run_mpi(n, argv + [f"{k}={v}" for k, v in kw.items()], timeout=90,
                      executable=PRLIMIT, env=env)
    assert f"OK {scenario} {n}" in out, out[-4000:]
    return [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines()
            if ln.startswith("FDLIMIT ")]


@pytest.mark.mpi
def test_soft_limit_raised_to_hard():
    """Launched with soft 256 / hard 2048: every rank runs with soft = hard = 2048 once its
    Communicator is built, and holds what its connections need (3 ranks, 2 rails)."""
    rows = _job(3, "raise", 256, 2048)
    assert len(rows) == 3
    for r in rows:
        assert r["before"] == [256, 2048], r
        assert r["after"] == [2048, 2048], r
        assert r["raised"] == [256, 2048, 2048], r
        assert r["exact"] and r["fds"] < 256, r


@pytest.mark.mpi
def test_over_the_limit_fails_on_every_rank():
    """Rank 1 has 6 fds left below its limit of 192 (soft = hard), fewer than its listeners and
    connections need: every rank raises R2commResourceError with the same message, naming rank
    1, the limit and `ulimit -n`, before any connection is tried."""
    rows = _job(4, "hog", 192, 192, rank=1, room=6)
    assert len(rows) == 4
    msgs = {r["message"] for r in rows if r["outcome"] == "R2commResourceError"}
    assert len(msgs) == 1 and all(r["outcome"] == "R2commResourceError" for r in rows), rows
    msg = msgs.pop()
    assert "rank 1 " in msg and "limit of 192" in msg and "ulimit -n" in msg, msg


@pytest.mark.mpi
def test_near_the_limit_warns_and_runs():
    """Rank 2 fills about 90% of its limit (counting the connections it will open): the job
    starts and computes exactly, and rank 0 warns once, naming rank 2, the limit and
    `ulimit -n` (rank 2 may warn too, of its own first uses)."""
    rows = _job(4, "hog", 200, 200, rank=2, fill=0.9)
    assert all(r["outcome"] == "ok" and r["exact"] for r in rows), rows
    warned = rows[0]["warnings"]
    assert len(warned) == 1 and "rank 2 " in warned[0], rows[0]
    assert "limit of 200" in warned[0] and "ulimit -n" in warned[0], warned
    assert not any(r["warnings"] for r in rows if r["rank"] in (1, 3)), rows
    # rank 2's own first uses (the allreduce's peers beyond the ring) warn it as well
    assert all("after connecting" in m for m in rows[2]["warnings"]), rows[2]


@pytest.mark.mpi
def test_first_use_over_the_limit_fails_on_every_rank_at_once():
    """After start-up (ring neighbours connected) rank 2 holds all but 10 fds of its limit of
    400; an Alltoall then needs every peer (6 ranks, 2 rails, no shared memory). Rank 2 raises
    R2commResourceError naming its limit and `ulimit -Hn` before it connects anything, every
    other rank R2commPeerError carrying that message, all within a second or so (before: EMFILE
    in some attempts, then "rank r is unreachable" after the 5 s connect timeout). With the fds
    freed the next Alltoall is exact on every rank: the sequence stayed in step."""
    rows = _job(6, "alltoall", 400, 400, env={"R2COMM_SHM": "0"}, rank=2, room=10)
    assert len(rows) == 6
    for r in rows:
        want = "R2commResourceError" if r["rank"] == 2 else "R2commPeerError"
        assert r["outcome"] == want, r
        assert "rank 2: connecting to" in r["message"] and "limit of 400" in r["message"], r
        assert "ulimit -Hn" in r["message"], r
        assert r["seconds"] < 4.0, r
        assert r["again"]["outcome"] == "ok" and r["again"]["exact"], r


@pytest.mark.mpi
def test_first_use_near_the_limit_warns_and_runs():
    """Rank 2 holds all but 40 fds of its limit of 400 when an Alltoall connects every peer:
    the connections fit, the result is exact everywhere, and rank 2 (only) warns once, naming
    the limit and `ulimit -Hn`."""
    rows = _job(6, "alltoall", 400, 400, env={"R2COMM_SHM": "0"}, rank=2, room=40)
    for r in rows:
        assert r["outcome"] == "ok" and r["exact"], r
        assert len(r["warnings"]) == (r["rank"] == 2), r
    warned = rows[2]["warnings"][0]
    assert "limit of 400" in warned and "ulimit -Hn" in warned, warned


@pytest.mark.mpi
def test_shared_memory_set_up_past_fd_1024():
    """Every rank holds fds up to 1100 before it starts, so its links get numbers past 1024:
    the shared-memory set-up's wait for the peer's answer polls (select() raised ValueError
    there and start-up failed with "disconnected groups")."""
    rows = _job(3, "hog", 2048, 2048, env={"R2COMM_SHM": "1"}, rank=-1, high=1100)
    assert all(r["outcome"] == "ok" and r["exact"] for r in rows), rows


@pytest.fixture
def high_fds():
    """Holds /dev/null open on every fd up to 1100, so new sockets get numbers past 1024 (where
    select() fails); the soft limit is raised as r2comm does."""
    from r2comm.control import fdlimit
    if fdlimit.raise_soft_limit()[1] < 1200:
        pytest.fail(f"this machine's hard RLIMIT_NOFILE is below 1200: {fdlimit.raise_soft_limit()}")
    held = []
    while not held or held[-1] < 1100:
        held.append(os.open(os.devnull, os.O_RDONLY))
    yield
    for fd in held:
        os.close(fd)


def test_handshake_waits_work_past_fd_1024(high_fds):
    """With the limit raised a rank may hold fds >= 1024: the handshake's wait (tcp.accept) and
    the verbs queue-pair exchange's (verbs_rails) poll instead of select()."""
    from r2comm.transport import verbs as verbs_rails
    from r2comm.transport import tcp
    secret = os.urandom(32)
    lst = tcp.listen("127.0.0.1")
    got = {}

    def acceptor():
        try:
            got["ok"] = tcp.accept(lst, secret, 1, 5.0, 500)
        except Exception as exc:             # reported below
            got["err"] = repr(exc)
    t = threading.Thread(target=acceptor)
    t.start()
    fd, cid = tcp.connect("127.0.0.1", lst.getsockname()[1], None, secret, 0, 1, 0, 5.0, 500)
    t.join(10)
    assert "err" not in got and got["ok"][0] == 0 and got["ok"][3] == cid, got
    assert fd > 1024 and got["ok"][2] > 1024
    os.close(fd)
    os.close(got["ok"][2])
    lst.close()
    a, b = socket.socketpair()
    assert a.fileno() > 1024
    threading.Timer(0.1, b.sendall, (b"qp-address",)).start()
    assert verbs_rails._recv_exact(a, 10, time.monotonic() + 5) == b"qp-address"
    a.close()
    b.close()


def _endpoints(n, per_host, rails=2, shm_on=True):
    """Bootstrap-like endpoints: `per_host` ranks per host, `rails` NICs each."""
    return [{"rails": [("127.0.0.1", 1)] * rails, "host_key": f"h{r // per_host}",
             "shm": f"k{r // per_host}" if shm_on else None} for r in range(n)]


@pytest.mark.parametrize("transport,per_rail", [("tcp", 1), ("verbs", 3)])
def test_start_up_model_is_ring_neighbours_local_peers_and_detector(transport, per_rail):
    """What a rank holds after start-up does not grow with n (issue 31: plans connect the rest
    on first use): 2 ring neighbours x (2 rails + control) + the detector, at 8 ranks as at
    1,024 (the full-mesh count grew 3 per peer); local peers count 2 each (doorbell, control)."""
    remote = 2 * (2 * per_rail + 1) + fdlimit.DETECTOR_FDS
    for n in (3, 8, 1024):
        assert fdlimit.connection_fds(_endpoints(n, 1), 1, transport) == remote, n
    # 4 ranks per host: rank 5's local peers are 4, 6, 7 (4 and 6 also its ring neighbours)
    eps = _endpoints(64, 4)
    assert fdlimit.connection_fds(eps, 5, transport) == 3 * 2 + fdlimit.DETECTOR_FDS
    # rank 4: local 5, 6, 7 and remote ring neighbour 3
    assert fdlimit.connection_fds(eps, 4, transport) == 3 * 2 + (2 * per_rail + 1) + \
        fdlimit.DETECTOR_FDS
    assert fdlimit.connection_fds(_endpoints(1, 1), 0, transport) == 0
