"""Benchmark buffers with deterministic, integer-valued contents.

Every rank can compute every other rank's input from (rank, element index),
so the exact expected output of each collective is known locally without
communication.  Values stay small integers, so sums, products, min and max are
exact in every dtype (float32 included) and results are compared bit for bit.
"""
from dataclasses import dataclass
from functools import reduce

import numpy as np

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "bcast", "alltoall", "gather",
               "scatter", "allgatherv", "alltoallv", "scan")
REDUCING = ("allreduce", "reduce_scatter", "scan")
BLOCKED = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter", "allgatherv",
           "alltoallv")                 # nbytes is n blocks of the per-rank count
OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
DTYPES = ("float32", "float64", "int32", "int64")  # collectives
P2P_DTYPES = DTYPES + ("uint8",)  # uint8 only for Send/Recv: sums of it would wrap


def pattern(rank, index, dtype, op="sum"):
    """Input of `rank` at global element positions `index` (an int array)."""
    if op == "prod":  # 1s and 2s: the product over ranks stays exact
        vals = 1 + ((index + rank) % 3 == 0)
    else:
        vals = (index * 7 + rank * 13) % 97
    return vals.astype(dtype)


def reference(ranks, index, dtype, op):
    """Exact reduction over `ranks` of pattern() at `index`."""
    return reduce(OPS[op], (pattern(r, index, dtype, op) for r in ranks))


@dataclass
class Case:
    """One collective at one size on one rank: buffers plus the expected result.

    ``nbytes`` is the nccl-tests size (the larger of the send/receive buffers),
    the quantity that algbw and busbw are computed from.
    """
    kind: str
    nbytes: int
    count: int  # elements per rank-block (the per-rank count of the API call)
    send: np.ndarray
    recv: np.ndarray
    expected: np.ndarray
    root: int = 0
    is_root: bool = False
    counts: list = None   # the vector collectives' counts and displacements (elements)
    displs: list = None

    def __post_init__(self):
        # One more than the largest expected value: an element the call failed
        # to write can never match the reference.
        self.sentinel = self.expected.max() + 1 if self.expected.size else 0

    def reset(self):
        """Overwrite the output with the sentinel (the bcast root keeps its data)."""
        if not (self.kind == "bcast" and self.is_root):
            self.recv.fill(self.sentinel)

    def check(self):
        """True when the output equals the reference exactly."""
        return np.array_equal(self.recv, self.expected)

    def first_mismatch(self):
        """(index, got, want) of the first wrong element, for error messages."""
        bad = np.flatnonzero(self.recv != self.expected)
        i = int(bad[0])
        return i, self.recv[i].item(), self.expected[i].item()


def block_count(kind, nbytes, nranks, itemsize):
    """Per-rank element count for a requested nccl-tests size (at least 1)."""
    per = nranks if kind in BLOCKED else 1
    return max(1, nbytes // (itemsize * per))


def make_case(kind, nbytes, rank, nranks, dtype="float32", op="sum", root=0):
    """Allocate and fill the buffers of one collective call.

    Layouts (c = per-rank count, n = ranks), as in MPI / nccl-tests:
      allreduce       send c,   recv c      nbytes = c
      allgather       send c,   recv n*c    nbytes = n*c
      reduce_scatter  send n*c, recv c      nbytes = n*c
      bcast           buf c (send is recv)  nbytes = c
      alltoall        send n*c, recv n*c    nbytes = n*c
      gather          send c,   recv n*c (root; others none)          nbytes = n*c
      scatter         send n*c (root; others none), recv c          nbytes = n*c
      allgatherv      allgather through counts [c]*n, displs i*c
      alltoallv       alltoall through counts [c]*n, displs i*c
      scan            send c,   recv c      nbytes = c
    """
    dtype = np.dtype(dtype)
    c = block_count(kind, nbytes, nranks, dtype.itemsize)
    everyone = range(nranks)
    if kind == "allreduce":
        idx = np.arange(c)
        send, expected = pattern(rank, idx, dtype, op), reference(everyone, idx, dtype, op)
        recv, total = np.empty_like(send), c
    elif kind == "allgather":
        idx = np.arange(c)
        send = pattern(rank, idx, dtype, op)
        expected = np.concatenate([pattern(r, idx, dtype, op) for r in everyone])
        recv, total = np.empty_like(expected), nranks * c
    elif kind == "reduce_scatter":
        send = pattern(rank, np.arange(nranks * c), dtype, op)
        expected = reference(everyone, np.arange(rank * c, (rank + 1) * c), dtype, op)
        recv, total = np.empty_like(expected), nranks * c
    elif kind == "bcast":
        expected = pattern(root, np.arange(c), dtype, op)
        send = recv = expected.copy()
        total = c
    elif kind == "alltoall":
        send = pattern(rank, np.arange(nranks * c), dtype, op)
        mine = np.arange(rank * c, (rank + 1) * c)
        expected = np.concatenate([pattern(r, mine, dtype, op) for r in everyone])
        recv, total = np.empty_like(send), nranks * c
    elif kind in ("gather", "allgatherv"):
        idx = np.arange(c)
        send = pattern(rank, idx, dtype, op)
        if kind == "gather" and rank != root:
            expected = np.empty(0, dtype)
        else:
            expected = np.concatenate([pattern(r, idx, dtype, op) for r in everyone])
        recv, total = np.empty_like(expected), nranks * c
    elif kind == "scatter":
        send = pattern(rank, np.arange(nranks * c), dtype, op) if rank == root else \
            np.empty(0, dtype)
        expected = pattern(root, np.arange(rank * c, (rank + 1) * c), dtype, op)
        recv, total = np.empty_like(expected), nranks * c
    elif kind == "alltoallv":
        send = pattern(rank, np.arange(nranks * c), dtype, op)
        mine = np.arange(rank * c, (rank + 1) * c)
        expected = np.concatenate([pattern(r, mine, dtype, op) for r in everyone])
        recv, total = np.empty_like(send), nranks * c
    elif kind == "scan":
        idx = np.arange(c)
        send, expected = pattern(rank, idx, dtype, op), reference(range(rank + 1), idx, dtype, op)
        recv, total = np.empty_like(send), c
    else:
        raise ValueError(f"unknown collective {kind!r}")
    counts = [c] * nranks if kind in ("allgatherv", "alltoallv") else None
    displs = [i * c for i in range(nranks)] if counts else None
    return Case(kind, total * dtype.itemsize, c, send, recv, expected, root, rank == root,
                counts, displs)


def make_p2p(nbytes, rank, dtype="uint8"):
    """Send/receive buffers for ping-pong and streaming bandwidth between ranks 0 and 1.

    The receiver expects the other rank's pattern, so an echo or a stream that
    delivered stale or foreign bytes fails the check.
    """
    dtype = np.dtype(dtype)
    idx = np.arange(nbytes // dtype.itemsize)
    send = pattern(rank, idx, dtype)
    recv = np.empty_like(send)
    expected = pattern(1 - rank, idx, dtype) if rank in (0, 1) else send
    return Case("p2p", send.nbytes, send.size, send, recv, expected)
