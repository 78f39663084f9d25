"""One rank of a job on the netns testbed whose host is cut off the network mid-stream
(tests/test_liveness_testbed.py, issue 31).

usage: isolate_worker.py OUT
Every rank streams exact allreduces; once all are warm rank 0 writes OUT/ready and the test
isolates one host (Fabric.isolate: rails and management down at the switch). Each rank writes
OUT/rank<r>.json when its stream ends: when and how it raised, when its failure detector
learned of a dead rank and which, and whether every result before was exact. A rank whose file
is written waits (bounded) for the others' and exits without MPI_Finalize. Before it writes
its file, a rank revokes the communicator, shrinks it (issue 44) and records the survivors it
holds and whether an allreduce on them was exact."""
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402


def main():
    out = sys.argv[1]
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)     # hydra's warning to the survivors
    world = MPI.COMM_WORLD
    comm = r2comm.Communicator(world)
    r, n = comm.rank, comm.size
    x = np.full(1 << 16, r + 1, dtype=np.float32)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    world.Barrier()
    if r == 0:
        open(os.path.join(out, "ready"), "w").close()
    exc, inexact, ops = None, 0, 0
    deadline = time.monotonic() + 40
    try:
        while time.monotonic() < deadline:
            comm.Allreduce(x, y)
            ops += 1
            inexact += int(y[0] != n * (n + 1) / 2 or y[-1] != y[0])
    except r2comm.R2commError as e:
        exc = e
    t_raise = time.time()
    det = comm._world.liveness        # the test reads the detector's view (tests may)
    dead = {}
    until = time.monotonic() + 3
    while time.monotonic() < until and not dead and det is not None:
        dead = {str(k): v for k, v in det.dead().items()}
        time.sleep(0.02)
    row = {"rank": r, "raised_at": t_raise, "error": type(exc).__name__ if exc else None,
           "message": str(exc)[:500], "dead": dead, "ops": ops, "inexact": inexact}
    # issue 44: the survivors go on without the cut-off host (Revoke, Shrink, an allreduce)
    comm.timeout = 10.0
    try:
        comm.Revoke()
        new = comm.Shrink()
        members = new.channel.global_ranks()
        new.Allreduce(x, y)
        want = sum(g + 1 for g in members)
        row["shrunk"] = {"members": members, "at": time.time(),
                         "exact": bool(y[0] == want and y[-1] == want)}
    except r2comm.R2commError as e:
        row["shrunk"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    tmp = os.path.join(out, f"rank{r}.tmp")
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, os.path.join(out, f"rank{r}.json"))
    until = time.monotonic() + 20
    while time.monotonic() < until and sum(
            os.path.exists(os.path.join(out, f"rank{k}.json")) for k in range(n)) < n - 1:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
