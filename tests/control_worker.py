"""The control plane's tree allgather (control.py, issue 31) on the real engine: run by
tests/test_control_mpi.py under mpiexec.

    python control_worker.py SCENARIO [key=value ...]

same       tree and flood give the same table, rail_state() agrees, only tree peers connected
updown     a tree pair's rails all fail (for real: engine.faults.inject) as the parent starts the down
           phases; that call and the ones after agree on every rank, nobody flooded
partition  half of the ranks cut off: every rank raises, twice, within the timeout
argerr     a local argument error reaches every rank without new connections
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control import tree as control  # noqa: E402
from mpi_worker import WORLD, check, main  # noqa: E402


def row_of(rank, k):
    return np.array([rank, 3.5 * rank + k, -k, 1e300 if rank % 2 else -0.0])


def table_of(n, k):
    return np.array([row_of(r, k) for r in range(n)])


def connected(comm):
    """The ranks this rank holds any connection to (a rail or the control connection)."""
    eng = comm.channel.engine
    out = set()
    for p in range(comm.size):
        if p != comm.rank:
            nr = len(eng.rail_stats()[p])
            if any(eng.links.link_state(p, k) != "idle" for k in range(nr + 1)):
                out.add(p)
    return out


def same_on_every_rank(value, what):
    got = WORLD.allgather(value)
    check(all(g == got[0] for g in got), f"{what} differs between ranks: {got}")


def sc_same(comm, args):
    """Tree calls first: afterwards a rank holds connections to its start-up peers and tree
    peers only (at most 4 of those); then the flood agrees with the tree, call by call."""
    n, me = comm.size, comm.rank
    start = connected(comm)
    ctl = control.plane(comm.channel)
    tables = [control.allgather(ctl, row_of(me, k)) for k in range(3)]
    fingerprints = [comm.rail_state().fingerprint() for _ in range(2)]
    WORLD.Barrier()
    peers = connected(comm)
    tree = control.tree_peers(me, n)
    check(len(tree) <= 4 and peers <= start | tree,
          f"connected to {sorted(peers)}: start-up {sorted(start)}, tree {sorted(tree)}")
    same_on_every_rank(fingerprints, "rail_state()")
    for k in range(3):
        check(np.array_equal(tables[k], table_of(n, k)), f"tree call {k}: {tables[k]}")
        flood = control.flood(ctl, row_of(me, k))
        check(np.array_equal(flood, tables[k]), f"flood call {k} differs from the tree's")
    if me == 0:
        print(f"PEERS start {sorted(start)} tree {sorted(tree)}", flush=True)
    return 1


def sc_updown(comm, args):
    """Tree `tree` (A or B) pair (parent of `child`, child): in the second allgather the
    parent fails every rail to the child (`mode` hard or silent) as its down phases start
    (after the child's up message arrived). That call and four more (allgathers and rail_state()) end with the same
    table on every rank, the broken pair shows in the rail state, and no rank flooded (it
    would have connected every peer)."""
    n, me = comm.size, comm.rank
    child = int(args["child"])
    parents = control.control_trees(n)[0 if args.get("tree", "A") == "A" else 1]
    parent = parents[child]
    start = connected(comm)
    ctl = control.plane(comm.channel)
    struck = []

    def hook(plane, call, phase):
        # (this plane's calls only: the plan-switch rounds run allgathers of their own)
        if plane is ctl and call == 1 and phase == control.DOWN_A and plane.rank == parent:
            for k in range(len(comm.rails)):
                comm.fail_rail(k, args.get("mode", "hard"), peer=child)   # (one engine)
            struck.append(time.monotonic())
    control.on_phase = hook
    try:
        results = [control.allgather(ctl, row_of(me, k)).tolist() for k in range(4)]
    finally:
        control.on_phase = None
    check(bool(struck) == (me == parent), "the fault struck where it should")
    for k, got in enumerate(results):
        check(np.array_equal(got, table_of(n, k)), f"call {k}: {got}")
    same_on_every_rank(results, "allgather results")
    states = []
    deadline = time.monotonic() + 20
    while True:
        st = comm.rail_state()
        states.append(st.fingerprint())
        late = WORLD.allreduce(time.monotonic() > deadline, op=MPI.LOR)
        if (min(parent, child), max(parent, child)) in st.broken_pairs() or late:
            break
    check(st.broken_pairs() == [(min(parent, child), max(parent, child))],
          f"rail state: {st.describe()}")
    same_on_every_rank(states, "rail_state()")
    WORLD.Barrier()
    peers = connected(comm)
    check(peers <= start | control.tree_peers(me, n), f"rank flooded: connected {sorted(peers)}")
    if me == 0:
        print(f"UPDOWN pair {parent}-{child} tree {args.get('tree', 'A')}: {len(states)} "
              f"rail_state calls", flush=True)
    return 1


def sc_partition(comm, args):
    """Every pair connected (an alltoall), then ranks n/2.. fail every rail to everyone: two
    allgathers raise R2commNetworkError on every rank, each well within the timeout."""
    n, me = comm.size, comm.rank
    x = np.arange(n, dtype=np.float64)
    y = np.empty_like(x)
    comm.Alltoall(x, y)
    ctl = control.plane(comm.channel)
    WORLD.Barrier()
    if me >= n // 2:
        for k in range(len(comm.rails)):
            comm.fail_rail(k, "hard")
    outcomes = []
    for k in range(2):
        t0 = time.monotonic()
        try:
            control.allgather(ctl, row_of(me, k))
            outcomes.append(("ok", time.monotonic() - t0))
        except r2comm.R2commNetworkError:
            outcomes.append(("raised", time.monotonic() - t0))
    got = WORLD.allgather(outcomes)
    limit = float(args.get("limit", 15))
    check(all(o[0] == "raised" and o[1] < limit for r in got for o in r), f"outcomes: {got}")
    if me == 0:
        print(f"PARTITION slowest {max(o[1] for r in got for o in r):.2f} s", flush=True)
    return 1


def sc_argerr(comm, args):
    """Ring plans (R2COMM_ALGO=ring): rank 4 passes a read-only receive buffer. It raises an
    argument error, every other rank R2commPeerError within 5 s (the abort relayed along the
    ring's connections), and nobody connected a new peer (the telling once connected every
    peer); the next allreduce works."""
    n, me = comm.size, comm.rank
    x = np.ones(1 << 14, np.float32)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    WORLD.Barrier()
    start = connected(comm)
    bad = y
    if me == 4:
        bad = np.empty_like(x)
        bad.flags.writeable = False
    t0 = time.monotonic()
    try:
        comm.Allreduce(x, bad)
        got = "no error"
    except r2comm.R2commError as exc:
        got = type(exc).__name__ if me == 4 or "rank 4" in str(exc) else repr(exc)
    rows = WORLD.allgather((got, time.monotonic() - t0))
    check(rows[4][0] == "R2commBufferError" and
          all(g == "R2commPeerError" for r, (g, _) in enumerate(rows) if r != 4), f"{rows}")
    check(max(t for _, t in rows) < 5, f"took {rows}")
    WORLD.Barrier()
    check(connected(comm) == start, f"connected {sorted(connected(comm))}, was {sorted(start)}")
    comm.Allreduce(x, y)
    check(np.all(y == n), "the allreduce after the error")
    return 1


SCENARIOS = {"same": sc_same, "updown": sc_updown, "partition": sc_partition,
             "argerr": sc_argerr}


if __name__ == "__main__":
    main(SCENARIOS, dump_after=150)
