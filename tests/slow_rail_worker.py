"""Run by tests/test_slow_rail.py inside the netns fabric: allreduces before and after the test
degrades NIC 1 to a tenth of NIC 0's rate; prints the traffic share per rail and checks results."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402

world = MPI.COMM_WORLD
comm = r2comm.Communicator(world, timeout=60)
marker = sys.argv[1]
x = np.arange(2 << 20, dtype=np.float32) % 1000
ref = x * comm.size
y = np.empty_like(x)
for phase in ("healthy", "degraded"):
    if phase == "degraded":
        if comm.rank == 0:
            open(marker, "w").close()
        time.sleep(1.5)                      # the test degrades NIC 1 now
        world.Barrier()
        for _ in range(2):                   # a couple of operations to measure the new rate
            comm.Allreduce(x, y)
    b0 = [ra.bytes_sent for ra in comm.rails]
    t = time.perf_counter()
    for _ in range(6):
        comm.Allreduce(x, y)
        assert np.array_equal(y, ref)
    dt = (time.perf_counter() - t) / 6
    d = [ra.bytes_sent - b for ra, b in zip(comm.rails, b0)]
    if comm.rank == 0:
        print(f"PHASE {phase} ms={dt * 1e3:.0f} share1={d[1] / sum(d):.3f} "
              f"hedged={[ra.bytes_hedged for ra in comm.rails]}", flush=True)
comm.Free()
