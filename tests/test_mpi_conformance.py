"""MPI semantics as mpi4py users write them (issue 41): tests/conformance_worker.py's scenarios
under mpiexec at 2 and 3 ranks, and the pieces underneath them without processes (markers,
vector buffer specifications, the vector and prefix schedules).

The first three scenarios are the silent wrong results of issue 41; each fails on the code
before it (run there, they stop at an AssertionError naming the wrong data):
  counts     Alltoall([s, 2, MPI.INT], [r, 2, MPI.INT]): rank 1 got [1, 101, -1, -1]
  proc_null  Recv(buf, MPI.PROC_NULL, 5) received rank 1's real message [7, 7, 7, 7]
  in_place   Reduce_scatter_block(MPI.IN_PLACE, x_uint8) left x as it was: [0, 1, 2, 3]"""
import os

import numpy as np
import pytest
from mpi4py import MPI

import r2comm
from r2comm.front import args
from r2comm.front.buffers import as_vector
from r2comm.errors import R2commArgumentError, R2commBufferError
from r2comm.planner import cost, vector
from r2comm.planner.state import RailState

from conftest import ROOT, run_mpi

SHM_OK = True
WORKER = os.path.join(ROOT, "tests", "conformance_worker.py")


def run_conformance(n, scenario, env=None):
    _, out = run_mpi(n, [WORKER, scenario], timeout=180, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, f"{scenario}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2])


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["counts", "proc_null", "in_place"])
def test_no_silent_wrong_result(scenario):
    """Issue 41's three silent wrong results, each checked against numpy on every rank."""
    assert run_conformance(2, scenario) >= 9


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("scenario", ["vector", "scan", "p2p", "refusals"])
def test_mpi_semantics(n, scenario):
    """The calls issue 41 adds, checked on every rank (3 ranks: uneven rings and chains)."""
    assert run_conformance(n, scenario) > 10


@pytest.mark.mpi
def test_semantics_over_tcp_rails():
    """The same over NIC rails only (no shared memory): vector collectives and p2p."""
    env = {"R2COMM_SHM": "0"}
    assert run_conformance(3, "vector", env) > 100
    assert run_conformance(2, "p2p", env) > 10


def test_markers_never_collide():
    """r2comm's ANY_SOURCE / PROC_NULL differ from each other and from MPICH's (-1 PROC_NULL,
    -2 ANY_SOURCE, -3 ROOT) and Open MPI's (-1 ANY_SOURCE, -2 PROC_NULL, -4 ROOT)."""
    assert len({r2comm.ANY_SOURCE, r2comm.PROC_NULL, -1, -2, -3, -4}) == 6
    assert args.is_any_source(MPI.ANY_SOURCE) and args.is_proc_null(MPI.PROC_NULL)
    assert not args.is_any_source(MPI.PROC_NULL) and not args.is_proc_null(MPI.ANY_SOURCE)
    assert args.is_in_place(MPI.IN_PLACE) and args.is_in_place(None) and \
        args.is_in_place(r2comm.IN_PLACE) and not args.is_in_place(np.zeros(0))


def test_vector_specifications():
    """mpi4py's forms of a vector buffer: counts, displacements, neither, one count."""
    a = np.arange(10, dtype=np.int32)
    arr, c, d = as_vector([a, [1, 2, 3], [0, 4, 7], MPI.INT], True, "b", 3)
    assert (c, d) == ([1, 2, 3], [0, 4, 7]) and np.shares_memory(arr, a)
    assert as_vector([a, ([1, 2], [5, 0]), MPI.INT], False, "b", 2)[1:] == ([1, 2], [5, 0])
    assert as_vector([a, MPI.INT], False, "b", 3)[1:] == ([4, 3, 3], [0, 4, 7])
    assert as_vector([a, 2], False, "b", 3)[1:] == ([2, 2, 2], [0, 2, 4])
    assert as_vector(a, False, "b", 2)[1:] == ([5, 5], [0, 5])
    with pytest.raises(R2commBufferError, match="does not lie"):
        as_vector([a, [5, 6], [0, 5], MPI.INT], False, "b", 2)
    with pytest.raises(R2commBufferError, match="one per rank"):
        as_vector([a, [1, 2, 3], None, MPI.INT], False, "b", 2)
    with pytest.raises(R2commArgumentError, match="derived MPI datatype"):
        t = MPI.INT.Create_vector(2, 1, 2).Commit()
        try:
            as_vector([a, [1, 1], [0, 1], t], False, "b", 2)
        finally:
            t.Free()


def _replay(scheds, work, send):
    """Deliver every message of `scheds` (one per rank) between numpy byte buffers, in an
    order the dependencies allow, with SUM reductions: the data the engine would produce."""
    from r2comm.planner.schedule import WORK, SEND, SCRATCH, COPY
    n = len(scheds)
    bufs = [{WORK: work[r], SEND: send[r], SCRATCH: np.zeros(scheds[r].scratch, np.uint8)}
            for r in range(n)]
    for r, s in enumerate(scheds):
        for db, do, sb, so, k in s.pre:
            bufs[r][db][do:do + k] = bufs[r][sb][so:so + k]
    done = [set() for _ in range(n)]
    for _ in range(10 * sum(len(s.msgs) for s in scheds) + 1):     # bounded
        progress = False
        for r, s in enumerate(scheds):
            for i, m in enumerate(s.msgs):
                if m[0] != "recv" or i in done[r]:
                    continue
                peer, step = m[1], m[2]
                j = next(j for j, x in enumerate(scheds[peer].msgs)
                         if x[0] == "send" and x[1] == r and x[2] == step)
                ready = all(a in done[peer] for a, b in scheds[peer].deps if b == j) and \
                    all(a in done[r] for a, b in s.deps if b == i)
                if not ready:
                    continue
                sm = scheds[peer].msgs[j]
                data = bufs[peer][sm[3]][sm[4]:sm[4] + sm[5]].view(np.int64)
                dst = bufs[r][m[3]][m[4]:m[4] + m[5]].view(np.int64)
                dst[:] = data if m[6] == COPY else dst + data
                done[r].add(i)
                done[peer].add(j)
                progress = True
        if not progress:
            break
    assert all(len(done[r]) == len(s.msgs) for r, s in enumerate(scheds)), "stuck"
    for r, s in enumerate(scheds):
        for db, do, sb, so, k in s.post:
            bufs[r][db][do:do + k] = bufs[r][sb][so:so + k]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_vector_schedules_move_the_right_data(n):
    """Every rank's allgatherv / reduce_scatter / scan / exscan / gatherv schedule, replayed
    message by message: the bytes each rank ends with are MPI's answer."""
    counts = [(k % 3) + 1 for k in range(n)]
    sizes = tuple(8 * c for c in counts)
    displs = tuple(8 * sum(counts[:k]) for k in range(n))
    total = sum(counts)
    # allgatherv: each rank's block in place
    work = [np.zeros(8 * total, np.uint8) for _ in range(n)]
    for r in range(n):
        work[r][displs[r]:displs[r] + sizes[r]].view(np.int64)[:] = r + 1
    sc = vector.build_all("allgatherv", n, [(sizes, displs)] * n, separate=False)
    _replay(sc, work, [None] * n)
    want = np.repeat(np.arange(1, n + 1), counts)
    assert all((w.view(np.int64) == want).all() for w in work)
    # reduce_scatter with counts (SUM)
    send = [np.full(total, r + 1, np.int64).view(np.uint8) for r in range(n)]
    work = [np.zeros(sizes[r], np.uint8) for r in range(n)]
    sc = vector.build_all("reduce_scatter", n, [(sizes,)] * n)
    _replay(sc, work, send)
    assert all((work[r].view(np.int64) == n * (n + 1) // 2).all() for r in range(n))
    for kind in ("scan", "exscan"):
        send = [np.full(3, r + 1, np.int64).view(np.uint8) for r in range(n)]
        work = [np.full(3, -1, np.int64).view(np.uint8) for r in range(n)]
        _replay(vector.build_all(kind, n, [(24,)] * n), work, send)
        for r in range(n):
            got = work[r].view(np.int64)
            want = (r + 1) * (r + 2) // 2 if kind == "scan" else r * (r + 1) // 2
            assert (got == (want if kind == "scan" or r else -1)).all(), (kind, r, got)
    layouts = [(sizes, displs) if r == 0 else (sizes[r],) for r in range(n)]
    send = [np.full(counts[r], r + 1, np.int64).view(np.uint8) for r in range(n)]
    work = [np.zeros(8 * total, np.uint8) for r in range(n)]
    _replay(vector.build_all("gatherv", n, layouts), work, send)
    assert (work[0].view(np.int64) == np.repeat(np.arange(1, n + 1), counts)).all()


def test_vector_schedules_are_priced_and_relayed():
    """With a rail state the schedules carry a price; a broken pair is relayed, Gatherv's too
    once a non-root rank's layout holds every size (vcoll.py learns them first), and refused
    (on every rank alike) where it does not."""
    n = 4
    st = RailState.uniform(n, 2, 1e9)
    s = vector.build("allgatherv", 1, n, ((800,) * n, tuple(800 * k for k in range(n))), 0,
                     0, False, state=st)
    assert s.cost > 0
    assert vector.build("scan", 2, n, (4096,), 0, 0, True, state=st).cost > \
        vector.build("scan", 2, n, (64,), 0, 0, True, state=st).cost
    broken = st.copy().break_pair(1, 2)
    s = vector.build("scan", 1, n, (64,), 0, 0, True, state=broken)
    assert all(broken.working(1, m[1]) for m in s.msgs), "a message crosses the broken pair"
    from r2comm.errors import R2commNetworkError
    with pytest.raises(R2commNetworkError, match="does not know every size"):
        vector.build("gatherv", 3, n, (64,), 0, 0, True, state=broken)
    s = vector.build("gatherv", 1, n, (64, (8, 64, 16, 24)), 2, 0, True, state=broken)
    assert all(broken.working(1, m[1]) for m in s.msgs) and s.algo.endswith("+relay")
    scheds = vector.build_all("alltoallv", n, [((8,) * n, tuple(8 * k for k in range(n)),
                                                (8,) * n, tuple(8 * k for k in range(n)))] * n)
    assert cost.predict(scheds, st) > 0
