"""A rank of a job bootstrapped through a directory store (r2comm.control.bootstrap_store.DirStore) with
Communicator.from_store: no MPI, no torch. argv: rank size store_dir. Prints `OK store <rank>`."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control.bootstrap_store import DirStore  # noqa: E402


def main():
    rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    comm = r2comm.Communicator.from_store(DirStore(path, timeout=60), rank, size, timeout=30)
    assert (comm.rank, comm.size) == (rank, size)
    a = np.arange(1000, dtype=np.float64) * (rank + 1)
    out = np.empty_like(a)
    comm.Allreduce(a, out)
    assert np.array_equal(out, np.arange(1000) * sum(range(1, size + 1))), out[:4]
    half = comm.Split(rank % 2, -rank)                  # key -rank: reversed order
    mine = [r for r in range(size) if r % 2 == rank % 2][::-1]
    assert half.rank == mine.index(rank) and half.size == len(mine)
    got = np.empty(half.size, np.int64)
    half.Allgather(np.array([rank]), got)
    assert got.tolist() == mine, got
    none = comm.Split(None if rank == 0 else 1)
    assert (none is None) == (rank == 0)
    dup = comm.Dup()
    b = np.array([rank], np.int32)
    dup.Bcast(b, root=size - 1)
    assert b[0] == size - 1
    assert comm.allreduce(rank, op=r2comm.MAX) == size - 1       # Python objects: the store
    assert comm.allgather(f"r{rank}") == [f"r{r}" for r in range(size)]
    assert comm.bcast({"k": rank}, root=1) == {"k": 1}
    comm.Barrier()
    assert "mpi4py.MPI" not in sys.modules, "a store bootstrap must not initialise MPI"
    comm.Free()
    print(f"OK store {rank}", flush=True)


if __name__ == "__main__":
    main()
