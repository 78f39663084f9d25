"""The fd limit at start-up (run under mpiexec, with a lowered RLIMIT_NOFILE, by
tests/test_fdlimit.py).

    mpiexec -n N python tests/fdlimit_worker.py SCENARIO [key=value ...]

raise     every rank creates a Communicator, runs an allreduce and prints
          "FDLIMIT <json>": its soft/hard RLIMIT_NOFILE before and after, the fds it holds.
hog       rank `rank` first opens fds (/dev/null): with room=K until K are left below its limit,
          with fill=F until it holds about F x its limit counting the connections it will open;
          then every rank creates
          a Communicator and prints "FDLIMIT <json>" with what came of it: "ok" (and an
          allreduce's result) or the error's class and message. high=F: every rank first
          holds fds up to number F, so its connections get numbers past it.
alltoall  every rank creates a Communicator (which connects its ring neighbours only); then
          rank `rank` opens fds until `room` are left below its limit, and every rank runs an
          Alltoall, which connects every peer on first use: "FDLIMIT <json>" with its outcome
          (class, message, seconds); then rank `rank` closes those fds and every rank runs the
          Alltoall again (its outcome and exactness in "again").
Prints "OK <scenario> <count>" on rank 0."""
import json
import logging
import os
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control import fdlimit  # noqa: E402

WORLD = MPI.COMM_WORLD


class Capture(logging.Handler):
    """Keeps the messages of r2comm's warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def allreduce_ok(comm):
    x = np.arange(1000, dtype=np.float64) + comm.rank
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    n = comm.size
    return bool(np.array_equal(y, np.arange(1000) * n + n * (n - 1) / 2))


def scenario_raise(args):
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    comm = r2comm.Communicator(WORLD)
    row = {"rank": comm.rank, "before": before,
           "after": resource.getrlimit(resource.RLIMIT_NOFILE),
           "raised": fdlimit.raise_soft_limit(), "fds": fdlimit.open_fds(),
           "exact": allreduce_ok(comm)}
    comm.Free()
    return row


def scenario_hog(args):
    hog, fill = int(args.get("rank", 1)), float(args.get("fill", 0))
    room = int(args.get("room", 0))
    held = []
    while "high" in args and (not held or held[-1] < int(args["high"])):
        held.append(os.open(os.devnull, os.O_RDONLY))
    if WORLD.rank == hog:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # fill: about that share of the limit once the connections (n-1 peers x (2 rails +
        # control), 3 listeners) are open; room: leave that many fds below the limit now
        extra = (int(fill * limit) - 3 * WORLD.size - 3 if fill else limit - room) \
            - fdlimit.open_fds()
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(extra)]
    cap = Capture()
    logging.getLogger("r2comm").addHandler(cap)
    row = {"rank": WORLD.rank, "extra": len(held)}
    try:
        comm = r2comm.Communicator(WORLD, timeout=30)
    except r2comm.R2commError as exc:
        row.update(outcome=type(exc).__name__, message=str(exc))
    else:
        row.update(outcome="ok", exact=allreduce_ok(comm))
        comm.Free()
    row["warnings"] = [m for m in cap.lines if "file descriptors" in m]
    for fd in held:
        os.close(fd)
    return row


def alltoall_outcome(comm):
    """{outcome, message, seconds, exact} of one Alltoall of 4 float64 per peer."""
    n = comm.size
    x = np.arange(n * 4, dtype=np.float64) + 1000 * comm.rank
    y = np.full(n * 4, -1.0)
    t0 = time.monotonic()
    try:
        comm.Alltoall(x, y)
    except r2comm.R2commError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - t0}
    want = np.concatenate([np.arange(4) + 4 * comm.rank + 1000 * src for src in range(n)])
    return {"outcome": "ok", "exact": bool(np.array_equal(y, want)),
            "seconds": time.monotonic() - t0}


def scenario_alltoall(args):
    hog, room = int(args.get("rank", 1)), int(args["room"])
    comm = r2comm.Communicator(WORLD, timeout=30)
    cap = Capture()
    logging.getLogger("r2comm").addHandler(cap)
    held = []
    if WORLD.rank == hog:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(limit - room - fdlimit.open_fds())]
    WORLD.Barrier()
    row = {"rank": comm.rank, **alltoall_outcome(comm)}
    for fd in held:
        os.close(fd)
    WORLD.Barrier()
    row["again"] = alltoall_outcome(comm)
    row["warnings"] = [m for m in cap.lines if "file descriptors" in m]
    comm.Free()
    return row


def main():
    scenario = sys.argv[1]
    args = dict(a.split("=", 1) for a in sys.argv[2:])
    row = {"raise": scenario_raise, "hog": scenario_hog, "alltoall": scenario_alltoall}[scenario](args)
    rows = WORLD.gather(row, root=0)
    if WORLD.rank == 0:
        for r in rows:
            print("FDLIMIT " + json.dumps(r), flush=True)
        print(f"OK {scenario} {len(rows)}", flush=True)


if __name__ == "__main__":
    main()
