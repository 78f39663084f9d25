"""One rank of an mpiexec job (tests/test_shrink.py) that loses rank 2 (SIGKILL, inside an
allreduce loop) and goes on: Revoke, Agree, Shrink over r2comm's engine alone, then an exact
allreduce on the shrunk communicator. MPICH's mpiexec must run with -disable-auto-cleanup, or
it kills the survivors. Each survivor writes DIR/ok.<rank>; argv: DIR."""
import os
import signal
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi4py import MPI  # noqa: E402
import r2comm  # noqa: E402


def main():
    d = sys.argv[1]
    # Hydra tells the survivors of a death with SIGUSR1 (-disable-auto-cleanup), whose default
    # action ends the process: a survivor that is to live on ignores it (README)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    comm = r2comm.Communicator(MPI.COMM_WORLD, timeout=20)
    for i in range(100000):
        if comm.rank == 2 and i == 20:   # (every rank is past start-up: MPI is out of the way)
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        try:
            comm.Allreduce(np.ones(1024), np.empty(1024))
        except r2comm.R2commError:
            break
    comm.Revoke()
    new = comm.Shrink()
    out = np.empty(4, np.int64)
    new.Allreduce(np.full(4, comm.rank, np.int64), out)
    with open(os.path.join(d, f"ok.{comm.rank}"), "w") as f:
        f.write(f"{new.rank} {new.size} {new.channel.comm_id} {comm.Get_agreed_failed()} {out[0]}")
    # every survivor waits for the others before it exits (an exit is a death)
    new.Barrier()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:   # the test shows why a survivor did not finish (DIR/err.<rank>)
        import traceback
        with open(os.path.join(sys.argv[1], f"err.{MPI.COMM_WORLD.Get_rank()}"), "w") as f:
            f.write(traceback.format_exc())
        raise
