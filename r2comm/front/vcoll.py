"""Gather, Scatter, the vector collectives (Gatherv, Scatterv, Allgatherv, Alltoallv,
Reduce_scatter with counts) and the prefix reductions (Scan, Exscan), with their I-forms: a part
of Communicator's mpi4py face (a mixin of it). Each checks its arguments as mpi4py reads them
(buffers.py: a block collective's count is one rank's share; a vector buffer is [buf, counts,
displs, datatype] or a shorter form, in elements), then runs through the engine like every other
collective (Channel.start with a layout: planner/vector.py's schedules, with failover)."""
import numpy as np

from .args import check_root, check_apart, is_in_place, IN_PLACE, device_args
from .buffers import as_array, as_vector
from ..errors import R2commArgumentError, R2commBufferError
from ..ops import SUM, as_op, dtype_code, reduce_code


def _same_type(a, b, what):
    if a.dtype != b.dtype:
        raise R2commArgumentError(f"{what}: sendbuf dtype {a.dtype} != recvbuf dtype {b.dtype}")


def _byte_layout(counts, displs, itemsize):
    return (tuple(c * itemsize for c in counts), tuple(d * itemsize for d in displs))


def _root_block(what, whole, own, own_sends, size):
    """The root's side of Gather (own_sends: `own` is the sendbuf) and Scatter (`own` is the
    recvbuf): `whole` holds `size` equal blocks and `own` (None where IN_PLACE) is one of them,
    of the same type, apart in memory. Returns a block's bytes."""
    whole_name, own_name = ("recvbuf", "sendbuf") if own_sends else ("sendbuf", "recvbuf")
    if whole.nbytes % size:
        raise R2commBufferError(f"{what}: {whole_name} of {whole.nbytes} bytes is not "
                                f"{size} equal blocks")
    block = whole.nbytes // size
    if own is not None:
        send, recv = (own, whole) if own_sends else (whole, own)
        _same_type(send, recv, what)
        if own.nbytes != block:
            raise R2commBufferError(f"{what}: {whole_name} must hold {size} x {own_name} "
                                    f"({own.nbytes} bytes), got {whole.nbytes} bytes")
        check_apart(send, recv, what)
    return block


class VectorCollectives:
    """Communicator's rooted, vector and prefix collectives (see the module doc). Where the
    plans relay around a pair of ranks with no working rail, a Gatherv, Scatterv or Alltoallv
    first tells every rank the sizes (a Bcast of the root's counts, or an Allgather of every
    rank's send counts: O(n) per rank, O(n^2) for Alltoallv), which relaying ranks need."""

    def _relays(self):
        """Whether this call's plans relay around a pair with no working rail (the state it
        runs under: a switch due at it applied first, the same on every rank)."""
        state = self._chan.plans_for_next_call()
        return state is not None and state.has_broken_pairs()

    def _learn_sizes(self, counts, root):
        """Every rank's count (elements) of a Gatherv/Scatterv whose root holds `counts`, where
        the plans relay (None elsewhere: nobody needs them)."""
        if not self._relays():
            return None
        box = np.array(counts if counts is not None else [0] * self.size, np.int64)
        self.Bcast(box, root)
        return [int(c) for c in box]

    def _vcall(self, kind, blocking, start, *args):
        """Communicator._call for these kinds: host buffers only."""
        if device_args(args):
            err = R2commArgumentError(f"{kind}: device buffers take Allreduce, Reduce, Bcast, "
                                      "Allgather, Reduce_scatter_block and Alltoall; copy them "
                                      "to host memory for this call")
            self._chan.tell_peers(err, kind, blocking)
            raise err
        return self._call(kind, blocking, start, *args)

    # -- Gather / Scatter ----------------------------------------------------------------------
    def Igather(self, sendbuf, recvbuf, root=0):
        """Start a gather; returns a Request (see Gather)."""
        return self._vcall("gather", False, self._igather, sendbuf, recvbuf, root)

    def Gather(self, sendbuf, recvbuf, root=0):
        """Every rank's `sendbuf` (the same size everywhere) lands in `recvbuf` of rank `root`,
        in rank order (recvbuf holds size x sendbuf; ignored elsewhere). IN_PLACE or None as the
        root's sendbuf: its block is already in its slot of recvbuf."""
        self._vcall("gather", True, self._igather, sendbuf, recvbuf, root)

    def _igather(self, sendbuf, recvbuf, root, _blocking=False):
        self._chan.check()
        check_root(root, self.size)
        if self.rank == root:
            r = as_array(recvbuf, True, "Gather recvbuf", self.size)
            send = None if is_in_place(sendbuf) else as_array(sendbuf, False, "Gather sendbuf")
            block = _root_block("Gather", r, send, True, self.size)
            work, dt = r, r.dtype
        else:
            if is_in_place(sendbuf):
                raise R2commArgumentError("Gather: IN_PLACE is for the root's sendbuf only")
            send = as_array(sendbuf, False, "Gather sendbuf")
            work, dt, block = None, send.dtype, send.nbytes
        return self._chan.start("gather", block, dt.itemsize, dtype_code(dt), 0, work, send,
                           root=root, layout=(block,), blocking=_blocking)

    def Iscatter(self, sendbuf, recvbuf, root=0):
        """Start a scatter; returns a Request (see Scatter)."""
        return self._vcall("scatter", False, self._iscatter, sendbuf, recvbuf, root)

    def Scatter(self, sendbuf, recvbuf, root=0):
        """Block i of `sendbuf` of rank `root` (size equal blocks; ignored elsewhere) lands in
        `recvbuf` of rank i. IN_PLACE or None as the root's recvbuf: its block stays in
        sendbuf."""
        self._vcall("scatter", True, self._iscatter, sendbuf, recvbuf, root)

    def _iscatter(self, sendbuf, recvbuf, root, _blocking=False):
        self._chan.check()
        check_root(root, self.size)
        if self.rank == root:
            s = as_array(sendbuf, False, "Scatter sendbuf", self.size)
            keep_own = is_in_place(recvbuf)
            work = None if keep_own else as_array(recvbuf, True, "Scatter recvbuf")
            block = _root_block("Scatter", s, work, False, self.size)
            send, dt, layout = s, s.dtype, (block, keep_own)
        else:
            if is_in_place(recvbuf):
                raise R2commArgumentError("Scatter: IN_PLACE is for the root's recvbuf only")
            work = as_array(recvbuf, True, "Scatter recvbuf")
            send, dt, block, layout = None, work.dtype, work.nbytes, (work.nbytes,)
        return self._chan.start("scatter", block, dt.itemsize, dtype_code(dt), 0, work, send,
                           root=root, layout=layout, blocking=_blocking)

    # -- Gatherv / Scatterv --------------------------------------------------------------------
    def Igatherv(self, sendbuf, recvbuf, root=0):
        """Start a gatherv; returns a Request (see Gatherv)."""
        return self._vcall("gatherv", False, self._igatherv, sendbuf, recvbuf, root)

    def Gatherv(self, sendbuf, recvbuf, root=0):
        """Every rank's `sendbuf` (of its own size) lands in `recvbuf` of rank `root`, rank i's
        at displs[i]: recvbuf is [buf, counts, displs, datatype] there (or a shorter form;
        counts[i] must be rank i's count) and ignored elsewhere. IN_PLACE or None as the root's
        sendbuf: its block is already in place."""
        self._vcall("gatherv", True, self._igatherv, sendbuf, recvbuf, root)

    def _igatherv(self, sendbuf, recvbuf, root, _blocking=False):
        self._chan.check()
        check_root(root, self.size)
        send = None
        if self.rank == root:
            work, counts, displs = as_vector(recvbuf, True, "Gatherv recvbuf", self.size)
            dt = work.dtype
            if not is_in_place(sendbuf):
                send = as_array(sendbuf, False, "Gatherv sendbuf")
                _same_type(send, work, "Gatherv")
                if send.size != counts[root]:
                    raise R2commBufferError(f"Gatherv: sendbuf has {send.size} elements, the "
                                            f"root's count is {counts[root]}")
                check_apart(send, work, "Gatherv")
            layout = _byte_layout(counts, displs, dt.itemsize)
        else:
            if is_in_place(sendbuf):
                raise R2commArgumentError("Gatherv: IN_PLACE is for the root's sendbuf only")
            send = as_array(sendbuf, False, "Gatherv sendbuf")
            work, dt, layout = None, send.dtype, (send.nbytes,)
        every = self._learn_sizes(counts if self.rank == root else None, root)
        if every is not None and self.rank != root:
            layout += (tuple(c * dt.itemsize for c in every),)
        return self._chan.start("gatherv", 0, dt.itemsize, dtype_code(dt), 0, work, send, root=root,
                           layout=layout, blocking=_blocking)

    def Iscatterv(self, sendbuf, recvbuf, root=0):
        """Start a scatterv; returns a Request (see Scatterv)."""
        return self._vcall("scatterv", False, self._iscatterv, sendbuf, recvbuf, root)

    def Scatterv(self, sendbuf, recvbuf, root=0):
        """Block i of the root's `sendbuf` ([buf, counts, displs, datatype] there, ignored
        elsewhere) lands in `recvbuf` of rank i (counts[i] elements). IN_PLACE or None as the
        root's recvbuf: its block stays in sendbuf."""
        self._vcall("scatterv", True, self._iscatterv, sendbuf, recvbuf, root)

    def _iscatterv(self, sendbuf, recvbuf, root, _blocking=False):
        self._chan.check()
        check_root(root, self.size)
        if self.rank == root:
            send, counts, displs = as_vector(sendbuf, False, "Scatterv sendbuf", self.size)
            dt, work, keep_own = send.dtype, None, is_in_place(recvbuf)
            if not keep_own:
                work = as_array(recvbuf, True, "Scatterv recvbuf")
                _same_type(send, work, "Scatterv")
                if work.size != counts[root]:
                    raise R2commBufferError(f"Scatterv: recvbuf has {work.size} elements, the "
                                            f"root's count is {counts[root]}")
                check_apart(send, work, "Scatterv")
            layout = _byte_layout(counts, displs, dt.itemsize) + (keep_own,)
        else:
            if is_in_place(recvbuf):
                raise R2commArgumentError("Scatterv: IN_PLACE is for the root's recvbuf only")
            work = as_array(recvbuf, True, "Scatterv recvbuf")
            send, dt, layout = None, work.dtype, (work.nbytes,)
        every = self._learn_sizes(counts if self.rank == root else None, root)
        if every is not None and self.rank != root:
            layout += (tuple(c * dt.itemsize for c in every),)
        return self._chan.start("scatterv", 0, dt.itemsize, dtype_code(dt), 0, work, send, root=root,
                           layout=layout, blocking=_blocking)

    # -- Allgatherv / Alltoallv ----------------------------------------------------------------
    def Iallgatherv(self, sendbuf, recvbuf):
        """Start an allgatherv; returns a Request (see Allgatherv)."""
        return self._vcall("allgatherv", False, self._iallgatherv, sendbuf, recvbuf)

    def Allgatherv(self, sendbuf, recvbuf):
        """Every rank's `sendbuf` (of its own size) lands in `recvbuf` of every rank, rank i's
        at displs[i]: recvbuf is [buf, counts, displs, datatype] (or a shorter form; counts
        alike on every rank). IN_PLACE or None: each rank's block is already in place."""
        self._vcall("allgatherv", True, self._iallgatherv, sendbuf, recvbuf)

    def _iallgatherv(self, sendbuf, recvbuf, _blocking=False):
        self._chan.check()
        work, counts, displs = as_vector(recvbuf, True, "Allgatherv recvbuf", self.size)
        dt, isz, send, pre = work.dtype, work.itemsize, None, []
        if not is_in_place(sendbuf):
            send = as_array(sendbuf, False, "Allgatherv sendbuf")
            _same_type(send, work, "Allgatherv")
            if send.size != counts[self.rank]:
                raise R2commBufferError(f"Allgatherv: sendbuf has {send.size} elements, this "
                                        f"rank's count is {counts[self.rank]}")
            check_apart(send, work, "Allgatherv")
            pre = [(0, displs[self.rank] * isz, 1, 0, send.nbytes)]     # WORK <- SEND
        return self._chan.start("allgatherv", 0, isz, dtype_code(dt), 0, work, send,
                           extra_pre=pre, layout=_byte_layout(counts, displs, isz),
                           blocking=_blocking)

    def Ialltoallv(self, sendbuf, recvbuf):
        """Start an alltoallv; returns a Request (see Alltoallv)."""
        return self._vcall("alltoallv", False, self._ialltoallv, sendbuf, recvbuf)

    def Alltoallv(self, sendbuf, recvbuf):
        """Block j of `sendbuf` (sendcounts[j] elements at sdispls[j]) goes to rank j, where it
        lands at rdispls[i] of `recvbuf` (i the sender): both [buf, counts, displs, datatype] or
        a shorter form. IN_PLACE or None: recvbuf is the input too (sent from a copy)."""
        self._vcall("alltoallv", True, self._ialltoallv, sendbuf, recvbuf)

    def _ialltoallv(self, sendbuf, recvbuf, _blocking=False):
        self._chan.check()
        work, rc, rd = as_vector(recvbuf, True, "Alltoallv recvbuf", self.size)
        if is_in_place(sendbuf):
            send, sc, sd = work.copy(), rc, rd
        else:
            send, sc, sd = as_vector(sendbuf, False, "Alltoallv sendbuf", self.size)
            _same_type(send, work, "Alltoallv")
            check_apart(send, work, "Alltoallv")
        isz = work.itemsize
        layout = _byte_layout(sc, sd, isz) + _byte_layout(rc, rd, isz)
        if self._relays():                  # relaying ranks need every pair's size
            rows = np.empty(self.size * self.size, np.int64)
            self.Allgather(np.array(sc, np.int64) * isz, rows)
            layout += (tuple(tuple(int(v) for v in rows[i * self.size:(i + 1) * self.size])
                             for i in range(self.size)),)
        return self._chan.start("alltoallv", 0, isz, dtype_code(work.dtype), 0, work, send,
                           layout=layout, blocking=_blocking)

    # -- Reduce_scatter with counts ------------------------------------------------------------
    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=SUM):
        """Start a reduce-scatter with counts; returns a Request (see Reduce_scatter)."""
        return self._vcall("reduce_scatter", False, self._ireduce_scatter, sendbuf, recvbuf,
                           recvcounts, op)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=SUM):
        """Reduce `sendbuf` (sum(recvcounts) elements) over all ranks with `op`; rank i receives
        its recvcounts[i] elements of the result (those after the counts of ranks before it) in
        `recvbuf`. recvcounts None: every rank's count is its recvbuf's size (found by an
        allgather). IN_PLACE or None: recvbuf holds the input, the result lands at its start."""
        self._vcall("reduce_scatter", True, self._ireduce_scatter, sendbuf, recvbuf, recvcounts,
                    op)

    def _ireduce_scatter(self, sendbuf, recvbuf, recvcounts, op, _blocking=False):
        self._chan.check()
        op = as_op(op)
        r = as_array(recvbuf, True, "Reduce_scatter recvbuf")
        in_place = is_in_place(sendbuf)
        if recvcounts is None:
            if in_place:
                raise R2commArgumentError("Reduce_scatter: IN_PLACE needs recvcounts")
            counts = np.empty(self.size, np.int64)
            self.Allgather(np.array([r.size], np.int64), counts)
            counts = [int(c) for c in counts]
        else:
            try:
                counts = [int(c) for c in recvcounts]
            except TypeError:
                raise R2commArgumentError(f"Reduce_scatter: recvcounts {recvcounts!r} is not a "
                                          "sequence of integers") from None
            if len(counts) != self.size or min(counts) < 0:
                raise R2commArgumentError(f"Reduce_scatter: recvcounts needs {self.size} counts "
                                          f">= 0, got {counts}")
        total = sum(counts)
        if in_place:
            if r.size < total:
                raise R2commBufferError(f"Reduce_scatter: recvbuf holds {r.size} elements, the "
                                        f"counts sum to {total}")
            send = None
        else:
            send = as_array(sendbuf, False, "Reduce_scatter sendbuf")
            _same_type(send, r, "Reduce_scatter")
            if send.size != total or r.size < counts[self.rank]:
                raise R2commBufferError(f"Reduce_scatter: sendbuf needs sum(recvcounts) = "
                                        f"{total} elements (has {send.size}) and recvbuf "
                                        f"{counts[self.rank]} (has {r.size})")
            check_apart(send, r, "Reduce_scatter")
        isz = r.itemsize
        return self._chan.start("reduce_scatter", 0, isz, reduce_code(r.dtype, op), op.code, r, send,
                           layout=(tuple(c * isz for c in counts),), blocking=_blocking)

    # -- Scan / Exscan -------------------------------------------------------------------------
    def Iscan(self, sendbuf, recvbuf, op=SUM):
        """Start an inclusive scan; returns a Request (see Scan)."""
        return self._vcall("scan", False, self._iscan, "scan", sendbuf, recvbuf, op)

    def Scan(self, sendbuf, recvbuf, op=SUM):
        """Inclusive prefix reduction: rank i's `recvbuf` gets sendbuf of ranks 0..i combined
        with `op`. IN_PLACE or None: recvbuf is the input."""
        self._vcall("scan", True, self._iscan, "scan", sendbuf, recvbuf, op)

    def Iexscan(self, sendbuf, recvbuf, op=SUM):
        """Start an exclusive scan; returns a Request (see Exscan)."""
        return self._vcall("exscan", False, self._iscan, "exscan", sendbuf, recvbuf, op)

    def Exscan(self, sendbuf, recvbuf, op=SUM):
        """Exclusive prefix reduction: rank i's `recvbuf` gets sendbuf of ranks 0..i-1 combined
        with `op`; rank 0's recvbuf is left as it was (MPI leaves it undefined). IN_PLACE or
        None: recvbuf is the input."""
        self._vcall("exscan", True, self._iscan, "exscan", sendbuf, recvbuf, op)

    def _iscan(self, kind, sendbuf, recvbuf, op, _blocking=False):
        self._chan.check()
        op = as_op(op)
        name = "Scan" if kind == "scan" else "Exscan"
        r = as_array(recvbuf, True, f"{name} recvbuf")
        send = None
        if not is_in_place(sendbuf):
            send = as_array(sendbuf, False, f"{name} sendbuf")
            _same_type(send, r, name)
            if send.nbytes != r.nbytes:
                raise R2commBufferError(f"{name}: sendbuf has {send.nbytes} bytes, recvbuf "
                                        f"{r.nbytes}")
            check_apart(send, r, name)
        return self._chan.start(kind, r.nbytes, r.itemsize, reduce_code(r.dtype, op), op.code, r,
                           send, layout=(r.nbytes,), blocking=_blocking)


__all__ = ["VectorCollectives", "IN_PLACE"]
