"""One MPI rank's view of where the testbed put it, written to OUTDIR/rank<r>.json.

A file per rank, not stdout: mpiexec interleaves the ranks' output.
"""
import json
import os
import socket
import sys
from pathlib import Path

from mpi4py import MPI


def _owns(addr):
    """True if ADDR is local to this namespace (bind succeeds only then)."""
    with socket.socket() as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return False
    return True


comm = MPI.COMM_WORLD
rails = os.environ["R2COMM_RAILS"].split(",")
report = {"rank": comm.rank, "size": comm.size,
          "host": int(os.environ["R2COMM_TESTBED_HOST"]),
          "rails": rails, "ctrl": os.environ["R2COMM_CTRL_ADDR"],
          "netns_inode": os.stat("/proc/self/ns/net").st_ino,
          "owns_rails": all(_owns(a) for a in rails),
          "owns_ctrl": _owns(os.environ["R2COMM_CTRL_ADDR"]),
          "allreduce": comm.allreduce(comm.rank)}
Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(report))
