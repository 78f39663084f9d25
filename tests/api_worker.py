"""Run by tests/test_api_inputs.py under mpiexec: collectives and point-to-point calls with
mpi4py buffer specifications, checked against numpy on every rank."""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402

world = MPI.COMM_WORLD
comm = r2comm.Communicator(world, timeout=30)
r, n = comm.rank, comm.size
x = np.arange(16, dtype=np.float32) + r
y = np.zeros(16, np.float32)
comm.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)
assert np.array_equal(y, sum(np.arange(16, dtype=np.float32) + k for k in range(n)))
# count and displacement: only elements 4..11 take part, the rest stay untouched
y[:] = -7
comm.Allreduce([x, (8, 4), MPI.FLOAT], [y, (8, 4), MPI.FLOAT], op=MPI.MAX)
assert np.array_equal(y[4:12], np.arange(4, 12, dtype=np.float32) + n - 1) and (y[:4] == -7).all() \
    and (y[12:] == -7).all()
# raw bytes typed by the spec
raw = bytearray(np.full(4, r + 1, np.int64).tobytes())
comm.Allreduce(r2comm.IN_PLACE, [raw, MPI.INT64_T], op=MPI.PROD)
assert np.frombuffer(raw, np.int64).tolist() == [int(np.prod(np.arange(1, n + 1)))] * 4
b = np.full(5, r, np.int32)
comm.Bcast([b, 3, MPI.INT], root=1)
assert b.tolist() == [1, 1, 1, r, r]
g = np.zeros(n * 2, np.float64)
comm.Allgather([np.full(2, r, np.float64), MPI.DOUBLE], [g, MPI.DOUBLE])
assert g.tolist() == [float(k) for k in range(n) for _ in range(2)]
if r == 0:
    comm.Send([np.arange(6, dtype=np.int16), (3, 3), MPI.SHORT], 1, tag=5)
elif r == 1:
    got = np.zeros(3, np.int16)
    comm.Recv([got, MPI.SHORT], 0, tag=5)
    assert got.tolist() == [3, 4, 5]
# a bad spec raises the same clear error on every rank
try:
    comm.Allreduce([x, 99, MPI.FLOAT], [y, MPI.FLOAT])
except r2comm.R2commBufferError as exc:
    assert "count 99" in str(exc)
else:
    raise AssertionError("oversized count accepted")
comm.Barrier()
ok = world.allreduce(1)
if r == 0:
    print(f"OK specs {ok}", flush=True)
comm.Free()
