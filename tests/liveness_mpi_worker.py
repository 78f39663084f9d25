"""A 16-rank job on loopback where one rank is killed (tests/test_liveness.py, issue 31).

usage: liveness_mpi_worker.py OUT VICTIM
Every rank runs a stream of allreduces; rank 0 SIGKILLs rank VICTIM. Each survivor writes one
line to OUT/rank<r>.txt: when its allreduce raised, the error, when its failure detector
learned of the death, and the engine's peer_lost event for the victim. Rank 0 writes the kill
time to OUT/killed.txt. Survivors then exit at once (MPI cannot finalize with a dead rank)."""
import json
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402


def main():
    out, victim = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)     # hydra's warning to the survivors
    world = MPI.COMM_WORLD
    comm = r2comm.Communicator(world, rails=["127.0.0.1", "127.0.0.2"])
    r = comm.rank
    pids = world.allgather(os.getpid())
    x = np.full(1 << 16, r + 1, dtype=np.float32)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    assert y[0] == comm.size * (comm.size + 1) / 2
    world.Barrier()
    if r == 0:
        def killer():
            time.sleep(0.5)
            t = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            with open(os.path.join(out, "killed.txt"), "w") as f:
                f.write(f"{t:.6f}\n")
        threading.Thread(target=killer, daemon=True).start()
    exc = None
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            comm.Allreduce(x, y)
    except r2comm.R2commError as e:
        exc = e
    t_raise = time.time()
    det = comm._world.liveness
    learned = None
    lost = []
    until = time.monotonic() + 6
    while time.monotonic() < until and (learned is None or not lost):
        learned = det.dead().get(victim) if det is not None else None
        lost = [e["info"] for e in comm.events if e["kind"] == "peer_lost" and e["peer"] == victim]
        time.sleep(0.02)
    row = {"rank": r, "raised_at": t_raise, "error": type(exc).__name__ if exc else None,
           "message": str(exc), "learned_at": learned, "peer_lost": lost[:1],
           "sent": dict(det.sent) if det is not None else {}}
    tmp = os.path.join(out, f"rank{r}.tmp")
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, os.path.join(out, f"rank{r}.txt"))
    # hydra kills every rank once one exits without finalizing: each waits for the others' lines
    until = time.monotonic() + 15
    while time.monotonic() < until and not all(
            os.path.exists(os.path.join(out, f"rank{k}.txt")) for k in range(comm.size)
            if k != victim):
        time.sleep(0.02)
    os._exit(0)


if __name__ == "__main__":
    main()
