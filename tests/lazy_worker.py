"""Connections made on first use (issue 31): run by tests/test_lazy_connect.py under mpiexec.

    python lazy_worker.py SCENARIO [key=value ...]

Each scenario checks inside the job and prints `OK SCENARIO n` on rank 0 when every rank
passed (a failed check raises, so mpiexec fails). Connections are read from the engine
(link_state: up / down / idle) and the process's fds (/proc/self/fd)."""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import r2comm

CTRL = 0xFFFF


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {what}")


def fds():
    return len(os.listdir("/proc/self/fd")) - 1


def states(comm, peer):
    """[state of each data rail, then the control connection] to global rank `peer`."""
    eng = comm.channel.engine
    nr = len(eng.rail_stats()[peer])
    return [eng.links.link_state(peer, k) for k in range(nr + 1)]


def connected(comm):
    """The global ranks this rank holds any connection to."""
    return sorted(p for p in range(comm.size) if p != comm.rank
                  and any(s != "idle" for s in states(comm, p)))


def plan_peers(comm, *plans):
    """Global ranks the given plans (comm.schedule(...) schedules) send to or receive from."""
    return {comm.channel.world_rank(m[1]) for sched in plans for m in sched.msgs}


def ring(args):
    """A ring allreduce connects the ring neighbours only (O(1) connections and fds whatever
    n); allgather and bcast then connect exactly the peers their plans use."""
    w = MPI.COMM_WORLD
    f0 = fds()
    comm = r2comm.Communicator(w)
    n, me = comm.size, comm.rank
    x = np.arange(1 << 18, dtype=np.float32) + me
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    check(np.array_equal(y, np.arange(1 << 18, dtype=np.float32) * n + n * (n - 1) / 2),
          "allreduce result")
    check(comm.schedule("allreduce", x.nbytes, 4).algo == "ring", "not a ring allreduce")
    peers = connected(comm)
    nbrs = sorted({(me - 1) % n, (me + 1) % n})
    check(peers == nbrs, f"after a ring allreduce connected to {peers}, not just {nbrs}")
    check(all(s == "up" for p in peers for s in states(comm, p)), "a neighbour's rail not up")
    row = {"rank": me, "peers": peers, "fds_ring": fds() - f0}
    g = np.full(4096, me, np.int32)
    out = np.empty(4096 * n, np.int32)
    comm.Allgather(g, out)
    check(np.array_equal(out, np.repeat(np.arange(n, dtype=np.int32), 4096)), "allgather")
    b = np.full(1000, me, np.float64)
    comm.Bcast(b, root=1)
    check(np.all(b == 1), "bcast")
    used = plan_peers(comm, comm.schedule("allreduce", x.nbytes, 4), comm.schedule("allgather", g.nbytes, 4),
                      comm.schedule("bcast", b.nbytes, 8, root=1)) | set(nbrs)
    tree = [(me - 1) // 2] if me else []  # the Bcast's agreement: a binary tree in rank order
    tree += [c for c in (2 * me + 1, 2 * me + 2) if c < n]
    used |= set(tree)
    w.Barrier()                           # every rank's plans are connected, and no rank has
    row["mix_peers"] = connected(comm)    # reached Free (its barrier connects more) until all read
    w.Barrier()
    extra = sorted(set(row["mix_peers"]) - used)
    check(row["mix_peers"] == sorted(used), f"connected to {row['mix_peers']}, the plans use "
          f"{sorted(used)}; the others: {[(p, states(comm, p)) for p in extra]}, events "
          f"{[(e['kind'], e.get('peer')) for e in comm.events[-8:]]}")
    rows = w.gather(row, root=0)
    comm.Free()
    if me == 0:
        print("LAZY " + json.dumps(rows), flush=True)
        print(f"OK ring {n}", flush=True)


def far(args):
    """Point-to-point to a peer no plan used (send, receive and ANY_SOURCE), then alltoall:
    each connects what it uses; simultaneous connects of both ends leave one connection."""
    w = MPI.COMM_WORLD
    comm = r2comm.Communicator(w)
    n, me = comm.size, comm.rank
    half = n // 2
    partner = (me + half) % n                     # not a ring neighbour for n >= 6
    check(partner not in ((me - 1) % n, (me + 1) % n), "n too small for this scenario")
    check(all(s == "idle" for s in states(comm, partner)), "far partner connected at start-up")
    f0 = fds()                            # (before the barrier: the partner may connect first)
    w.Barrier()
    # both ends need the pair at once: each posts its receive and its send together
    buf = np.empty(1 << 16, np.float64)
    rr = comm.Irecv(buf, partner, tag=7)
    sr = comm.Isend(np.full(1 << 16, float(me), np.float64), partner, tag=7)
    sr.Wait()
    rr.Wait()
    check(np.all(buf == partner), "far send/receive data")
    check(all(s == "up" for s in states(comm, partner)), f"far partner: {states(comm, partner)}")
    grown = fds() - f0
    nconn = len(states(comm, partner))
    check(grown == nconn, f"connecting both ways at once left {grown} fds, not one socket per "
          f"connection ({nconn})")
    ev = [e for e in comm.events if e["kind"] in ("rail_failed", "rail_never_up")]
    check(not ev, f"failures while connecting: {ev}")
    stats = comm.channel.engine.rail_stats()[partner]
    check(all(row[6] == 0 for row in stats), f"a rail replaced or failed: {stats}")
    w.Barrier()
    # ANY_SOURCE: rank 0 receives from a rank it never connected to (the sender connects)
    src = 2 if n > 4 else 1
    if me == 0:
        check(all(s == "idle" for s in states(comm, src)) or src in ((me - 1) % n, (me + 1) % n),
              "ANY_SOURCE sender connected before")
        st = r2comm.Status()
        got = np.empty(8, np.int64)
        comm.Recv(got, r2comm.ANY_SOURCE, tag=9, status=st)
        check(st.source == src and np.all(got == 42), f"ANY_SOURCE got {st.source} {got}")
    elif me == src:
        comm.Send(np.full(8, 42, np.int64), 0, tag=9)
    w.Barrier()
    # alltoall: connects every peer
    s = np.repeat(np.arange(n, dtype=np.int32) + 100 * me, 16)
    r = np.empty_like(s)
    comm.Alltoall(s, r)
    check(np.array_equal(r, np.repeat(np.arange(n, dtype=np.int32) * 100 + me, 16)), "alltoall")
    check(connected(comm) == [p for p in range(n) if p != me], "alltoall did not connect all")
    comm.Free()
    if me == 0:
        print(f"OK far {n}", flush=True)


def dead_nic(args):
    """Rank 0's rail 1 towards rank `far` is dark when rank 0 first needs that peer (an
    R2COMM_FAULT start=1 with restore_ms): the first use comes up on rail 0 (exact data), the
    rail starts down with rail_never_up on rank 0, and once the fault is lifted it is probed
    back and carries a message pinned to it."""
    w = MPI.COMM_WORLD
    comm = r2comm.Communicator(w)
    n, me = comm.size, comm.rank
    far = int(args.get("far", 2))
    if me in (0, far):
        other = far if me == 0 else 0
        check(all(s == "idle" for s in states(comm, other)), "connected before first use")
    w.Barrier()                           # (before either end uses the pair)
    t0 = time.monotonic()
    if me in (0, far):
        data = np.arange(1 << 15, dtype=np.float64)
        if me == 0:
            comm.Send(data, far, tag=1)
        else:
            got = np.empty_like(data)
            comm.Recv(got, 0, tag=1)
            check(np.array_equal(got, data), "first-use data")
        st = states(comm, other)
        check(st[0] == "up" and st[-1] == "up", f"rail 0 / control not up: {st}")
        if me == 0:
            check(st[1] == "down", f"rail 1 to the dark peer is {st[1]}")
            ev = [e for e in comm.events if e["kind"] == "rail_never_up"]
            check(len(ev) == 1 and ev[0]["peer"] == far and ev[0]["rail"] == 1,
                  f"rail_never_up events: {ev}")
            check("first use" in ev[0]["info"], ev[0]["info"])
        # the fault is lifted (restore_ms): either end's probe brings the rail back
        deadline = time.monotonic() + float(args.get("restore_wait", 15))
        while states(comm, other)[1] != "up" and time.monotonic() < deadline:
            time.sleep(0.05)
        check(states(comm, other)[1] == "up", f"rail 1 never came back: {states(comm, other)}")
    w.Barrier()                           # (the counters read before anything is sent)
    if me in (0, far):
        other = far if me == 0 else 0
        data = np.arange(1 << 15, dtype=np.float64)
        before = comm.channel.engine.rail_stats()[other][1][1 if me == 0 else 2]
    w.Barrier()
    if me in (0, far):
        if me == 0:
            comm.Send(data, far, tag=2, rail=1)
        else:
            got = np.empty_like(data)
            comm.Recv(got, 0, tag=2)
            check(np.array_equal(got, data), "data after fail-back")
        after = comm.channel.engine.rail_stats()[other][1][1 if me == 0 else 2]
        check(after - before >= data.nbytes, f"rail 1 carried {after - before} bytes")
        if me == 0:
            print(f"RESTORED {time.monotonic() - t0:.2f}", flush=True)
    w.Barrier()
    comm.Free()
    if me == 0:
        print(f"OK dead_nic {n}", flush=True)


def mismatch(args):
    """Rank 3 calls a ring allreduce with another count: every rank raises
    R2commMismatchError at once with the same report naming rank 3's call, also the ranks that
    hold no connection to the ranks that detected it (the abort and the judge's verdict are
    relayed along the plan's connections)."""
    w = MPI.COMM_WORLD
    comm = r2comm.Communicator(w, timeout=30)
    me = comm.rank
    cnt = (1 << 14) + (8 if me == 3 else 0)
    x = np.ones(cnt, np.float32)
    y = np.empty_like(x)
    t0 = time.monotonic()
    try:
        comm.Allreduce(x, y)
        got = ("no error", "")
    except r2comm.R2commError as exc:
        got = (type(exc).__name__, str(exc))
    took = time.monotonic() - t0
    rows = w.allgather((got, took))
    kinds = {g[0] for g, _ in rows}
    check(kinds == {"R2commMismatchError"}, f"errors {[g[0] for g, _ in rows]}")
    # two ranks may detect the mismatch at once (each from its own neighbour's frame): every
    # rank still raises with the same report, the judge's verdict (README Limits)
    check(all("rank 3 called Allreduce(float32 x 16392, SUM)" in g[1] for g, _ in rows),
          f"messages: {[g[1] for g, _ in rows]}")
    check(len({g[1] for g, _ in rows}) == 1, f"messages differ: {[g[1] for g, _ in rows]}")
    check(max(t for _, t in rows) < 5, f"took {[round(t, 2) for _, t in rows]} s")
    comm.Free()
    if me == 0:
        print(f"OK mismatch {comm.size}", flush=True)


if __name__ == "__main__":
    scenario = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    {"ring": ring, "far": far, "dead_nic": dead_nic, "mismatch": mismatch}[scenario](kw)
