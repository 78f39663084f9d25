"""Shared-memory scenarios (tests/test_shm.py), run under mpiexec.

hosts=a,b,c,... gives each rank a host name (R2COMM_HOST, set before the Communicator is made),
so one machine emulates several hosts: ranks with the same name talk through shared memory, the
others over the TCP rails. Without it every rank is on this host. Scenarios:
collectives   mpi_worker's every-collective check and point-to-point, then: the shm links are
              exactly the same-host peers, carried traffic, and nothing of it went over a NIC
              rail when every peer is local; no segment of this job is left in /dev/shm
small_shm     /dev/shm too small for every local pair's segment (a small tmpfs mounted over it
              by the test): every local pair still has a link, shared memory or TCP, at least
              one is TCP, and every collective is exact over them
kill          rank 1 is SIGKILLed mid-stream (as fault_worker's sigkill): every survivor raises
              R2commNetworkError (times written to `out` for the test to bound)
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _hosts_from_args():
    args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
    if "hosts" in args:
        rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
        names = args["hosts"].split(",")
        if rank < 0:
            from mpi4py import MPI
            rank = MPI.COMM_WORLD.Get_rank()
        os.environ["R2COMM_HOST"] = "host" + names[rank]
    return args


_ARGS = _hosts_from_args()

import numpy as np                      # noqa: E402
import r2comm                           # noqa: E402
from r2comm import SUM                  # noqa: E402
from r2comm._core import testing        # noqa: E402
import mpi_worker                       # noqa: E402
from mpi_worker import WORLD, check, data, main   # noqa: E402


def _expected_local(comm, args):
    n, r = comm.size, comm.rank
    if "hosts" not in args:
        return set(range(n)) - {r}
    names = args["hosts"].split(",")
    return {k for k in range(n) if k != r and names[k] == names[r]}


def _no_segments_left(comm):
    pids = {str(ep["pid"]) for ep in comm._world.boot.endpoints}   # (names: tag-ns-pid-...)
    left = [f for f in os.listdir("/dev/shm") if f.startswith("r2comm-") and
            f.split("-")[3:4] and f.split("-")[3] in pids]
    check(not left, f"shm segments of this job still in /dev/shm after set-up: {left}")


def sc_collectives(comm, args):
    n, r = comm.size, comm.rank
    want = _expected_local(comm, args) if os.environ.get("R2COMM_SHM", "1") != "0" else set()
    links = comm.shm_peers
    check(set(links) == want, f"rank {r}: shm peers {sorted(links)}, expected {sorted(want)}")
    check(all(v["transport"] == "shm" and v["state"] == "up" for v in links.values()),
          f"shm links not all up: {links}")
    _no_segments_left(comm)
    nic0 = sum(ra.bytes_sent for ra in comm.rails)
    count = mpi_worker.sc_collectives(comm, args)
    count += mpi_worker.sc_p2p(comm, args)
    links = comm.shm_peers
    for p in want:
        check(links[p]["bytes_sent"] > 0 and links[p]["bytes_recv"] > 0,
              f"rank {r}: no traffic on the shm link to {p}: {links[p]}")
        check(links[p]["failures"] == 0, f"shm link to {p} failed: {links[p]}")
    bells = testing.shm_bells(comm.channel.engine)        # doorbells rung, per live shm link
    check(set(bells) == want and all(b >= 0 for b in bells.values()),
          f"rank {r}: doorbell counts {bells} for shm peers {sorted(want)}")
    nic = sum(ra.bytes_sent for ra in comm.rails) - nic0
    remote = n - 1 - len(want)
    if remote == 0:
        check(nic == 0, f"rank {r}: {nic} bytes went over NIC rails with every peer local")
    else:
        check(nic > 0, f"rank {r}: no bytes over the NIC rails to {remote} remote peer(s)")
    # the planner's view (collective): a local pair has as many working rails as any pair
    st = comm.rail_state()
    check(st.healthy(), "rail state of a healthy job with shm links is healthy")
    for p in range(n):
        if p != r:
            check(len(st.usable_rails(r, p)) == st.nrails,
                  f"rank {r}: pair with {p} has {st.usable_rails(r, p)} of {st.nrails} rails")
    # a NIC fault does not touch a shared-memory link: fail every rail, the local peers still work
    if want and remote == 0:
        for k in range(len(comm.rails)):
            comm.fail_rail(k)
        x = data("after-fault", r, 1000, "float32", SUM)
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        check(np.array_equal(y, mpi_worker.reduce_ref("after-fault", n, 1000, "float32", SUM)),
              "allreduce after NIC faults")
        check(all(v["state"] == "up" for v in comm.shm_peers.values()),
              "an injected NIC fault failed a shared-memory link")
        for k in range(len(comm.rails)):
            comm.restore_rail(k)
        count += 1
    comm.Barrier()
    return count


def sc_kill(comm, args):
    """Rank 1 is SIGKILLed mid-stream (a large allreduce stream): every survivor raises
    R2commNetworkError. Rank 0 writes the kill time, each survivor its raise time, to `out`."""
    import signal
    n, r = comm.size, comm.rank
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    pids = WORLD.allgather(os.getpid())
    want = _expected_local(comm, args)
    check(set(comm.shm_peers) == want, f"shm peers {sorted(comm.shm_peers)} != {sorted(want)}")
    out = args["out"]
    if r == 0:
        with open(os.path.join(out, "pids.txt"), "w") as f:
            f.write(" ".join(map(str, pids)) + "\n")
    cnt = int(args.get("count", 250_000))
    x = data("kill", r, cnt, "float32", SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    WORLD.Barrier()
    if r == 0:
        from fault_worker import kill_soon
        kill_soon(pids[1], out)
    deadline = time.monotonic() + 30
    exc = None
    ops = 0
    try:
        while time.monotonic() < deadline:
            comm.Allreduce(x, y)
            ops += 1
    except r2comm.R2commNetworkError as e:
        exc = e
    except r2comm.R2commError as e:          # anything else is reported, and fails the test
        exc = e
    t_raise = time.time()
    lost = []
    until = time.monotonic() + 3
    while time.monotonic() < until and not lost:
        lost = [e for e in comm.events if e["kind"] == "peer_lost" and e["peer"] == 1]
        time.sleep(0.02)
    cause = lost[0].get("cause") if lost else None
    line = (f"OK kill rank={r} raised_at={t_raise:.6f} ops={ops} cause={cause} "
            f"local1={1 in want} {type(exc).__name__}: {exc}\n")
    from fault_worker import survivor_report
    survivor_report(out, r, n, line)


def sc_relink(comm, args):
    """A shared-memory link that fails (a frame corrupted on it, caught by its MAC under
    R2COMM_INTEGRITY=mac) is set up again by fail-back (a new segment): the stream goes on with
    exact results, and rail_failed then rail_restored name the link to rank 1."""
    n, r = comm.size, comm.rank
    check(1 in comm.shm_peers or r == 1, "rank 1 is a local peer")
    cnt = 300_000
    x = data("relink", r, cnt, "float32", SUM)
    ref = mpi_worker.reduce_ref("relink", n, cnt, "float32", SUM)
    y = np.empty_like(x)
    ops = 0
    for k in range(40):
        if r == 0 and k == 5:
            testing.corrupt_next(comm.channel.engine, 1, 0)
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), f"allreduce {k} exact")
        ops += 1
    time.sleep(0.3)
    comm.Barrier()
    if r in (0, 1):
        peer = 1 - r
        kinds = [(e["kind"], e["peer"], e["rail"]) for e in comm.events]
        check(("rail_failed", peer, 0) in kinds, f"rank {r}: the shm link did not fail: {kinds}")
        until = time.monotonic() + 5
        while time.monotonic() < until and comm.shm_peers[peer]["state"] != "up":
            time.sleep(0.05)
        check(comm.shm_peers[peer]["state"] == "up", f"link not back: {comm.shm_peers}")
        check(comm.channel.engine.links.transports()[peer] == ["shm"], "the link came back as shm")
        if r == 0:
            print(f"RELINK events {kinds}", flush=True)
    _no_segments_left(comm)
    return ops


def sc_small_shm(comm, args):
    """Not every local pair's segment fits in /dev/shm: those pairs' links are TCP, up, and
    carry the collectives (exact) like the shared-memory ones."""
    n, r = comm.size, comm.rank
    links = comm.shm_peers
    check(set(links) == set(range(n)) - {r}, f"rank {r}: local peers {sorted(links)}")
    check(all(v["state"] == "up" and v["transport"] in ("shm", "tcp") for v in links.values()),
          f"rank {r}: a local pair without a working link: {links}")
    count = mpi_worker.sc_collectives(comm, args)
    count += mpi_worker.sc_p2p(comm, args)
    links = comm.shm_peers
    for p, v in links.items():
        check(v["bytes_sent"] > 0 and v["bytes_recv"] > 0 and v["failures"] == 0,
              f"rank {r}: link to {p}: {v}")
    kinds = {p: v["transport"] for p, v in sorted(links.items())}
    every = comm.allgather(kinds)         # rank 0 prints them: lines of several ranks interleave
    if r == 0:
        for rank, k in enumerate(every):
            print(f"LINKS rank={rank} {k}", flush=True)
    return count


SCENARIOS = {"collectives": sc_collectives, "kill": sc_kill, "relink": sc_relink,
             "small_shm": sc_small_shm}

if __name__ == "__main__":
    main(SCENARIOS)
