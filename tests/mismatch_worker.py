"""Mismatched collective calls (issue 17 item 3), run under mpiexec by tests/test_mismatch.py.

    mpiexec -n 3 python tests/mismatch_worker.py SCENARIO [sizes=8,4096,...] [bound=5]

Each case runs on a fresh Dup of the communicator with a long operation timeout (30 s), so a
case that fell back to the timeout cannot pass the time bound. Every rank must raise within
`bound` seconds, with a message that names both calls. Rank 0 prints each case's slowest rank
("TIME <case> <seconds>") and "OK <scenario> <count>"."""
import os
import re
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpi_worker  # noqa: E402
from mpi_worker import WORLD, check, expect  # noqa: E402
import r2comm  # noqa: E402

OP_TIMEOUT = 30.0


def _sizes(args):
    return [int(x) for x in args.get("sizes", "8,4096,131072,1048576").split(",")]


def _case(comm, what, bound, fn):
    """Run fn(dup) on every rank at once; return (exception, seconds) of this rank and report
    the slowest rank's time."""
    d = comm.Dup()
    d.timeout = OP_TIMEOUT
    WORLD.Barrier()
    t0 = time.monotonic()
    exc = fn(d)
    dt = time.monotonic() - t0
    worst = WORLD.allreduce(dt, op=MPI.MAX)
    msgs = WORLD.gather(f"{type(exc).__name__}: {exc}" if exc is not None else "-")
    if WORLD.rank == 0:
        print(f"TIME {what} {worst:.3f}", flush=True)
        for i, m in enumerate(msgs):
            print(f"  rank {i}: {m}", flush=True)
    check(dt < bound, f"{what}: rank {WORLD.rank} took {dt:.2f} s (bound {bound} s)")
    return d, exc


def _works(d, what):
    """The communicator lines up again: a correct Allreduce gives the exact sum everywhere."""
    n, r = d.size, d.rank
    y = np.empty(5, "int64")
    d.Allreduce(np.full(5, r + 1, "int64"), y)
    check((y == n * (n + 1) // 2).all(), f"{what}: Allreduce afterwards gave {y}")


def sc_all_roots(comm, args):
    """Every rank calls Bcast with itself as root."""
    bound, count = float(args.get("bound", 5)), 0
    for nbytes in _sizes(args):
        n4 = nbytes // 4
        what = f"all_roots {nbytes} B"
        buf = np.full(n4, comm.rank, "float32")
        d, exc = _case(comm, what, bound, lambda d: expect(
            r2comm.R2commMismatchError, lambda: d.Bcast(buf, root=d.rank), what))
        msg = str(exc)
        check(msg.count(f"Bcast(float32 x {n4}, root=") == 2, f"{what}: names both calls: {msg}")
        check((buf == comm.rank).all(), f"{what}: own data kept")
        _works(d, what)
        count += 1
    return count


def sc_allreduce_vs_bcast(comm, args):
    """Rank 0 calls Allreduce, the others Bcast (root 0, then root 1) on the same buffers."""
    bound, count = float(args.get("bound", 5)), 0
    for root in (0, 1):
        for nbytes in _sizes(args):
            n4 = nbytes // 4
            what = f"allreduce_vs_bcast root={root} {nbytes} B"
            x, y = np.ones(n4, "float32"), np.ones(n4, "float32")

            def call(d):
                if d.rank == 0:
                    return expect(r2comm.R2commMismatchError, lambda: d.Allreduce(x, y), what)
                return expect(r2comm.R2commMismatchError, lambda: d.Bcast(y, root=root), what)
            d, exc = _case(comm, what, bound, call)
            msg = str(exc)
            check(f"Allreduce(float32 x {n4}, SUM)" in msg and
                  f"Bcast(float32 x {n4}, root={root})" in msg, f"{what}: names both calls: {msg}")
            _works(d, what)
            count += 1
    return count


def sc_small_buffer(comm, args):
    """Rank 1 passes a receive buffer that is too small: it raises R2commBufferError, every
    other rank an R2commError naming rank 1 and its error; the next Allreduce works."""
    bound, count = float(args.get("bound", 5)), 0
    for nbytes in _sizes(args):
        n4 = nbytes // 4
        what = f"small_buffer {nbytes} B"
        x = np.ones(n4, "float32")
        y = np.empty(n4 // 2 if comm.rank == 1 else n4, "float32")

        def call(d):
            if d.rank == 1:
                return expect(r2comm.R2commBufferError, lambda: d.Allreduce(x, y), what)
            return expect(r2comm.R2commError, lambda: d.Allreduce(x, y), what)
        d, exc = _case(comm, what, bound, call)
        msg = str(exc)
        if comm.rank != 1:
            check(isinstance(exc, r2comm.R2commPeerError), f"{what}: {type(exc).__name__}: {msg}")
            check("rank 1 " in msg and "R2commBufferError" in msg and "Allreduce" in msg,
                  f"{what}: names rank 1 and its error: {msg}")
        _works(d, what)
        count += 1
    return count


def sc_order(comm, args):
    """Rank 0 issues Iallreduce then Allreduce, the others Allreduce then Iallreduce, same
    sizes: blocking and non-blocking collectives never match each other (MPI), so every rank
    raises R2commMismatchError (no rank completes with a wrong pairing)."""
    bound, count = float(args.get("bound", 5)), 0
    for nbytes in _sizes(args):
        n4 = nbytes // 4
        what = f"order {nbytes} B"
        a, b = np.full(n4, 1, "float32"), np.empty(n4, "float32")
        c, e = np.full(n4, 2, "float32"), np.empty(n4, "float32")

        def call(d):
            if d.rank == 0:
                req = d.Iallreduce(a, b)
                exc = expect(r2comm.R2commMismatchError, lambda: d.Allreduce(c, e), what)
                expect(r2comm.R2commMismatchError, req.Wait, what + " (the Iallreduce)")
                return exc
            return expect(r2comm.R2commMismatchError, lambda: d.Allreduce(c, e), what)
        d, exc = _case(comm, what, bound, call)
        msg = str(exc)
        check(f"Iallreduce(float32 x {n4}, SUM)" in msg and f"called Allreduce(float32 x {n4}, SUM)"
              in msg, f"{what}: names both calls: {msg}")
        count += 1          # the call counts now differ between ranks: d is not used again
    return count


def sc_other_kinds(comm, args):
    """More pairs that used to pass or hang silently at small sizes: Reduce roots that differ,
    Bcast dtypes that differ at equal byte counts, Barrier against Bcast; each then lines up."""
    bound, count = float(args.get("bound", 5)), 0
    r = comm.rank
    cases = [
        ("reduce roots", lambda d: d.Reduce(np.ones(2, "float32"), np.empty(2, "float32"),
                                            root=0 if r else 1), "Reduce(float32 x 2, SUM, root="),
        ("bcast dtypes", lambda d: d.Bcast(np.zeros(2, "float32" if r else "int32"), root=0),
         "Bcast(int32 x 2, root=0)"),
        ("barrier vs bcast", lambda d: d.Barrier() if r == 2 else d.Bcast(np.zeros(2, "int8")),
         "Barrier()"),
        ("ibcast vs bcast", lambda d: d.Ibcast(np.zeros(2, "int8")).Wait() if r == 1 else
         d.Bcast(np.zeros(2, "int8")), "Ibcast(int8 x 2, root=0)"),
    ]
    for what, fn, needle in cases:
        d, exc = _case(comm, what, bound, lambda d: expect(r2comm.R2commMismatchError,
                                                           lambda: fn(d), what))
        check(needle in str(exc), f"{what}: {needle!r} not in {exc}")
        _works(d, what)
        count += 1
    return count


def _detectors(comm, since, own):
    """The ranks whose own report of a mismatch reached this rank after event `since` (the
    aborts and verdicts it received, and its own error before a verdict replaced it)."""
    texts = [ev["info"] for ev in comm.events if ev["index"] >= since and ev["kind"] == "abort"]
    return {int(m) for t in texts + [own] for m in re.findall(r"detected by rank (\d+)", t)}


def sc_racing_detectors(comm, args):
    """Several ranks detect one mismatch at once, each from its own neighbour's frame, in
    `rounds` rounds (R2COMM_ALGO=ring): rank 3 passes another count to a ring allreduce
    (ranks 3 and 4 detect), ranks 1 and 4 pass two other counts (four detectors), every rank
    calls Bcast as its own root (every rank detects). Every rank raises R2commMismatchError
    within `bound` seconds with the same message, and the next Allreduce works. Rank 0 prints
    "RACES <rounds with two detectors or more> <rounds>"."""
    bound, rounds = float(args.get("bound", 5)), int(args.get("rounds", 12))
    r, n4 = comm.rank, 1 << 12
    variants = [
        ("rank 3 odd", lambda d: d.Allreduce(np.ones(n4 + (8 if r == 3 else 0), "float32"),
                                             np.empty(n4 + (8 if r == 3 else 0), "float32"))),
        ("ranks 1 and 4 odd", lambda d: d.Allreduce(
            np.ones(n4 + {1: 8, 4: 16}.get(r, 0), "float32"),
            np.empty(n4 + {1: 8, 4: 16}.get(r, 0), "float32"))),
        ("all roots", lambda d: d.Bcast(np.zeros(n4, "float32"), root=d.rank)),
    ]
    races = count = 0
    for i in range(rounds):
        what, fn = variants[i % len(variants)]
        what = f"round {i} ({what})"
        since = comm.events[-1]["index"] + 1 if comm.events else 0
        d, exc = _case(comm, what, bound, lambda d: expect(r2comm.R2commMismatchError,
                                                           lambda: fn(d), what))
        msgs = WORLD.allgather(str(exc))
        check(len(set(msgs)) == 1, f"{what}: the ranks raised different messages: {msgs}")
        seen = set().union(*WORLD.allgather(_detectors(comm, since, str(exc))))
        races += len(seen) >= 2
        _works(d, what)
        count += 1
    if WORLD.rank == 0:
        print(f"RACES {races} {rounds}", flush=True)
    return count


SCENARIOS = {"racing_detectors": sc_racing_detectors, "all_roots": sc_all_roots, "allreduce_vs_bcast": sc_allreduce_vs_bcast,
             "small_buffer": sc_small_buffer, "order": sc_order, "other_kinds": sc_other_kinds}


if __name__ == "__main__":
    mpi_worker.main(SCENARIOS, default_timeout=OP_TIMEOUT)
