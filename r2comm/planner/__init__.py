"""Planner: chooses an algorithm per operation and size and builds its schedule.

Pure Python and socket-free, so tests and a simulator can use it directly."""
from . import algorithms
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_REV

ALLREDUCE_ALGOS = ("ring", "recursive_doubling")


def allreduce(rank, n, nbytes, itemsize, eager, algo=""):
    if algo not in ("", *ALLREDUCE_ALGOS):
        raise ValueError(f"R2COMM_ALGO={algo!r}: allreduce algorithms are {ALLREDUCE_ALGOS}")
    if algo == "recursive_doubling" or (not algo and nbytes <= eager):
        return algorithms.allreduce_rd(rank, n, nbytes, itemsize)
    return algorithms.allreduce_ring(rank, n, nbytes, itemsize, eager)


def build(coll, rank, n, nbytes, itemsize, root, eager, algo=""):
    """Schedule for one rank. nbytes is the per-rank message size (a block for the
    block-wise collectives)."""
    if coll == "allreduce":
        return allreduce(rank, n, nbytes, itemsize, eager, algo)
    if coll == "barrier":
        return algorithms.allreduce_rd(rank, n, 0, 1)
    if coll == "bcast":
        return algorithms.bcast_tree(rank, n, nbytes, root, eager)
    if coll == "reduce":
        return algorithms.reduce_tree(rank, n, nbytes, root, eager)
    if coll == "allgather":
        return algorithms.allgather_ring(rank, n, nbytes, eager)
    if coll == "reduce_scatter_block":
        return algorithms.reduce_scatter_ring(rank, n, nbytes, itemsize, eager)
    if coll == "alltoall":
        return algorithms.alltoall_direct(rank, n, nbytes, eager)
    raise ValueError(f"no schedule for {coll!r}")
