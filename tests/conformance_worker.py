"""Run by tests/test_mpi_conformance.py under mpiexec: MPI semantics as mpi4py users write them
(issue 41), each scenario checked against numpy on every rank; prints `OK <scenario> <checks>`.

    mpiexec -n N python tests/conformance_worker.py SCENARIO

counts     a block collective's [buf, count, type] count is one rank's share (Alltoall, Allgather,
           Gather, Scatter, Reduce_scatter_block): was read as the total
proc_null  MPI.PROC_NULL (MPICH's -1) sends and receives nothing: was r2comm.ANY_SOURCE
in_place   mpi4py's own MPI.IN_PLACE (and None) is in place: was a 0-byte uint8 buffer
vector     Gather/Scatter, Gatherv/Scatterv/Allgatherv/Alltoallv/Reduce_scatter with uneven
           counts and scattered displacements, blocking and I-forms, complex and bool data
scan       Scan/Exscan (+ I-forms, IN_PLACE) for several dtypes and ops
p2p        to self, Ssend/Issend, Sendrecv_replace/Isendrecv(_replace), persistent requests,
           Probe/Iprobe/Improbe/Mprobe from other ranks and from self
refusals   what is left out raises R2commArgumentError naming the alternative, on every rank
"""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402

world = MPI.COMM_WORLD
CHECKS = [0]


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {world.Get_rank()}: {what}")
    CHECKS[0] += 1


def expect(exc_type, fn, words=""):
    try:
        fn()
    except exc_type as exc:
        check(words in str(exc), f"{exc_type.__name__} without {words!r}: {exc}")
        return exc
    raise AssertionError(f"rank {world.Get_rank()}: no {exc_type.__name__} ({words})")


def sc_counts(comm):
    r, n = comm.rank, comm.size
    s = np.array([100 * r + k for k in range(2 * n)], np.int32)
    out = np.full(2 * n, -1, np.int32)
    comm.Alltoall([s, 2, MPI.INT], [out, 2, MPI.INT])
    check(out.tolist() == [100 * k + 2 * r + j for k in range(n) for j in range(2)],
          f"Alltoall with counts: {out.tolist()}")
    g = np.full(3 * n + 1, -1, np.float64)        # one element more than the counts cover
    comm.Allgather([np.full(5, r, np.float64), 3, MPI.DOUBLE], [g, 3, MPI.DOUBLE])
    check(g[:-1].tolist() == [float(k) for k in range(n) for _ in range(3)] and g[-1] == -1,
          f"Allgather with counts: {g.tolist()}")
    root = n - 1
    gb = np.full(2 * n + 2, -1, np.int16)
    comm.Gather([np.full(4, r, np.int16), 2, MPI.SHORT], [gb, 2, MPI.SHORT], root=root)
    if r == root:
        check(gb.tolist() == [k for k in range(n) for _ in range(2)] + [-1, -1],
              f"Gather with counts: {gb.tolist()}")
    sb = np.arange(3 * n + 3, dtype=np.int64)
    rb = np.full(4, -1, np.int64)
    comm.Scatter([sb, 3, MPI.INT64_T], [rb, 3, MPI.INT64_T], root=0)
    check(rb.tolist() == [3 * r, 3 * r + 1, 3 * r + 2, -1], f"Scatter with counts: {rb.tolist()}")
    x = np.arange(2 * n + 2, dtype=np.float32) + r      # two elements past the blocks
    y = np.full(2, -1, np.float32)
    comm.Reduce_scatter_block([x, 2, MPI.FLOAT], [y, MPI.FLOAT], MPI.SUM)
    ref = sum(np.arange(2 * n, dtype=np.float32) + k for k in range(n))[2 * r:2 * r + 2]
    check(np.array_equal(y, ref), f"Reduce_scatter_block with counts: {y.tolist()}")


def sc_proc_null(comm):
    r, n = comm.rank, comm.size
    if r == 1:
        comm.Send(np.full(4, 7, np.int32), 0, 5)     # a real message with the same tag
    if r == 0:
        buf = np.full(4, -1, np.int32)
        st = MPI.Status()
        comm.Recv(buf, MPI.PROC_NULL, 5, st)
        check(buf.tolist() == [-1] * 4, f"Recv from MPI.PROC_NULL wrote {buf.tolist()}")
        check(st.source == MPI.PROC_NULL and st.tag == MPI.ANY_TAG and st.Get_count(MPI.BYTE) == 0,
              f"PROC_NULL status {st.source} {st.tag}")
        comm.Recv(buf, 1, 5)                           # the real one is still there
        check(buf.tolist() == [7] * 4, f"the real message: {buf.tolist()}")
    check(len({r2comm.ANY_SOURCE, r2comm.PROC_NULL, -1, -2, -3, -4}) == 6,
          "r2comm's markers collide with MPICH's or Open MPI's")
    comm.Send(np.ones(3), MPI.PROC_NULL, 1)
    comm.Isend(None, r2comm.PROC_NULL).Wait()
    comm.Recv(None, r2comm.PROC_NULL)
    out = np.full(3, -1.0)
    comm.Sendrecv(np.ones(3), MPI.PROC_NULL, 0, out, MPI.PROC_NULL, 0)
    check(out.tolist() == [-1.0] * 3, "Sendrecv with PROC_NULL wrote")
    comm.Sendrecv_replace(out, MPI.PROC_NULL, 0, MPI.PROC_NULL, 0)
    check(comm.Iprobe(MPI.PROC_NULL) is True, "Iprobe(PROC_NULL)")
    # a ring where the ends talk to PROC_NULL (MPI's open chain)
    right = r + 1 if r + 1 < n else MPI.PROC_NULL
    left = r - 1 if r > 0 else MPI.PROC_NULL
    got = np.full(2, -5, np.int64)
    comm.Sendrecv(np.full(2, r, np.int64), right, 9, got, left, 9)
    check(got.tolist() == ([-5, -5] if r == 0 else [r - 1] * 2), f"open chain: {got.tolist()}")
    comm.Barrier()


def sc_in_place(comm):
    r, n = comm.rank, comm.size
    x = (np.arange(2 * n, dtype=np.uint8) + r).astype(np.uint8)
    comm.Reduce_scatter_block(MPI.IN_PLACE, x, MPI.SUM)
    total = sum(np.arange(2 * n, dtype=np.uint8) + k for k in range(n)).astype(np.uint8)
    want = np.concatenate([total[2 * r:2 * r + 2], (np.arange(2 * n, dtype=np.uint8) + r)[2:]])
    check(x.tolist() == want.tolist(), f"Reduce_scatter_block(MPI.IN_PLACE): {x.tolist()}")
    y = np.arange(5, dtype=np.float64) * (r + 1)
    comm.Allreduce(MPI.IN_PLACE, y, MPI.SUM)
    check(np.allclose(y, np.arange(5) * sum(range(1, n + 1))), f"Allreduce(MPI.IN_PLACE): {y}")
    comm.Allreduce(None, y, MPI.MAX)                  # None: mpi4py's in place too
    check(np.allclose(y, np.arange(5) * sum(range(1, n + 1))), "Allreduce(None)")
    g = np.full(3 * n, -1.0)
    g[3 * r:3 * r + 3] = r
    comm.Allgather(MPI.IN_PLACE, g)
    check(g.tolist() == [float(k) for k in range(n) for _ in range(3)], f"Allgather: {g}")
    a = np.array([10 * r + k for k in range(n)], np.int32)
    comm.Alltoall(MPI.IN_PLACE, a)
    check(a.tolist() == [10 * k + r for k in range(n)], f"Alltoall(IN_PLACE): {a.tolist()}")
    red = np.full(4, r + 1, np.int64)
    comm.Reduce(MPI.IN_PLACE if r == 0 else red, red if r == 0 else None, MPI.PROD, 0)
    if r == 0:
        check(red.tolist() == [int(np.prod(np.arange(1, n + 1)))] * 4, f"Reduce: {red}")


def _vbuf(n, counts, gap, dtype):
    """A buffer with the blocks in reverse order and `gap` unused elements between them."""
    displs, at = [0] * n, 0
    for k in reversed(range(n)):
        displs[k] = at
        at += counts[k] + gap
    return np.full(at, -1, dtype), displs


def sc_vector(comm):
    r, n = comm.rank, comm.size
    counts = [k + 1 for k in range(n)]
    for dtype in (np.int32, np.float64, np.complex128, np.bool_):
        def val(k, c):
            return (np.arange(c) % 2 == 0) if dtype is np.bool_ else \
                (np.arange(c) + 10 * k).astype(dtype) * (1 + (1j if dtype is np.complex128 else 0))
        mine = np.ascontiguousarray(val(r, counts[r]))
        for nb in (False, True):
            root = (1 if nb else 0) % n
            buf, displs = _vbuf(n, counts, 2, dtype)
            rb = [buf, (counts, displs), None] if r == root else None
            req = comm.Igatherv(mine, rb, root) if nb else comm.Gatherv(mine, rb, root)
            if nb:
                req.Wait()
            if r == root:
                for k in range(n):
                    check(np.array_equal(buf[displs[k]:displs[k] + counts[k]], val(k, counts[k])),
                          f"Gatherv {dtype.__name__} block {k}")
                check((buf[displs[0] + counts[0]:] == np.full(1, -1, dtype)).all(), "Gatherv gap")
            out = np.zeros(counts[r], dtype)
            if r == root:
                src, displs = _vbuf(n, counts, 1, dtype)
                for k in range(n):
                    src[displs[k]:displs[k] + counts[k]] = val(k, counts[k])
                sb = [src, counts, displs, None]
            else:
                sb = None
            if nb:
                comm.Iscatterv(sb, out, root).Wait()
            else:
                comm.Scatterv(sb, out, root)
            check(np.array_equal(out, val(r, counts[r])), f"Scatterv {dtype.__name__}")
            buf, displs = _vbuf(n, counts, 1, dtype)
            if nb:
                comm.Iallgatherv(mine, [buf, counts, displs, None]).Wait()
            else:
                comm.Allgatherv(mine, [buf, counts, displs, None])
            for k in range(n):
                check(np.array_equal(buf[displs[k]:displs[k] + counts[k]], val(k, counts[k])),
                      f"Allgatherv {dtype.__name__} block {k}")
        # alltoallv: rank r sends (r + j + 1) elements to rank j
        sc = [r + j + 1 for j in range(n)]
        rc = [j + r + 1 for j in range(n)]
        sbuf, sd = _vbuf(n, sc, 1, dtype)
        for j in range(n):
            sbuf[sd[j]:sd[j] + sc[j]] = val(100 * r + j, sc[j])
        rbuf, rd = _vbuf(n, rc, 2, dtype)
        comm.Alltoallv([sbuf, sc, sd, None], [rbuf, rc, rd, None])
        for j in range(n):
            check(np.array_equal(rbuf[rd[j]:rd[j] + rc[j]], val(100 * j + r, rc[j])),
                  f"Alltoallv {dtype.__name__} from {j}")
    # Gather / Scatter (equal blocks), complex data, I-forms
    g = np.zeros(2 * n, np.complex64)
    comm.Igather(np.full(2, r + 1j, np.complex64), g if r == 0 else None, 0).Wait()
    if r == 0:
        check(g.tolist() == [k + 1j for k in range(n) for _ in range(2)], f"Igather {g}")
    s = np.zeros(3, np.complex64)
    comm.Iscatter(np.repeat(np.arange(n) + 2j, 3).astype(np.complex64) if r == n - 1 else None,
                  s, n - 1).Wait()
    check(s.tolist() == [r + 2j] * 3, f"Iscatter {s}")
    # Reduce_scatter with counts, with and without IN_PLACE, SUM and PROD of complex numbers
    total = sum(counts)
    for op in (MPI.SUM, MPI.PROD, MPI.MAX):
        for dtype in (np.float64, np.int16, np.complex64):
            if dtype is np.complex64 and op == MPI.MAX:
                continue
            x = (np.arange(total) % 3 + r + 1).astype(dtype)
            ref = x.copy()
            for k in range(n):
                other = (np.arange(total) % 3 + k + 1).astype(dtype)
                if k != r:
                    ref = ref + other if op == MPI.SUM else ref * other if op == MPI.PROD \
                        else np.maximum(ref, other)
            lo = sum(counts[:r])
            out = np.full(counts[r], -9, dtype)
            comm.Reduce_scatter(x, out, counts, op)
            check(np.allclose(out, ref[lo:lo + counts[r]]), f"Reduce_scatter {op} {dtype}")
            y = x.copy()
            comm.Ireduce_scatter(MPI.IN_PLACE, y, counts, op).Wait()
            check(np.allclose(y[:counts[r]], ref[lo:lo + counts[r]]) and
                  np.array_equal(y[counts[r]:], x[counts[r]:]), f"Ireduce_scatter in place {op}")
    out = np.zeros(counts[r], np.float32)
    comm.Reduce_scatter(np.ones(total, np.float32), out)      # counts from every recvbuf
    check((out == n).all(), "Reduce_scatter without counts")


def sc_scan(comm):
    r, n = comm.rank, comm.size
    for dtype in (np.int32, np.uint8, np.float32, np.float64, np.complex128):
        for op, f in ((MPI.SUM, np.add), (MPI.PROD, np.multiply), (MPI.MIN, np.minimum),
                      (MPI.MAX, np.maximum)):
            if dtype is np.complex128 and op in (MPI.MIN, MPI.MAX):
                continue
            vals = [(np.arange(6) % 4 + k + 1).astype(dtype) for k in range(n)]
            pre = [vals[0]]
            for k in range(1, n):
                pre.append(f(pre[-1], vals[k]).astype(dtype))
            out = np.zeros(6, dtype)
            comm.Scan(vals[r], out, op)
            check(np.allclose(out, pre[r]), f"Scan {dtype} {op}: {out} vs {pre[r]}")
            buf = vals[r].copy()
            comm.Iscan(MPI.IN_PLACE, buf, op).Wait()
            check(np.allclose(buf, pre[r]), f"Iscan in place {dtype} {op}")
            out = np.full(6, 77, dtype)
            comm.Exscan(vals[r], out, op)
            check(np.allclose(out, pre[r - 1]) if r else (out == 77).all(),
                  f"Exscan {dtype} {op}: {out}")
            buf = vals[r].copy()
            comm.Iexscan(None, buf, op).Wait()
            if r:
                check(np.allclose(buf, pre[r - 1]), f"Iexscan in place {dtype} {op}")
    big = np.full(300_000, r + 1, np.float64)          # several chunks per message
    out = np.empty_like(big)
    comm.Scan(big, out)
    check((out == (r + 1) * (r + 2) / 2).all(), "Scan of 2.4 MB")


def sc_p2p(comm):
    r, n = comm.rank, comm.size
    # to self: send first, receive first, Ssend completes at the match, ANY_SOURCE takes it
    a = np.arange(5, dtype=np.int64)
    comm.Send(a, r, 3)
    b = np.zeros(5, np.int64)
    st = MPI.Status()
    comm.Recv(b, MPI.ANY_SOURCE, MPI.ANY_TAG, st)
    check(b.tolist() == a.tolist() and st.source == r and st.tag == 3, "Send/Recv to self")
    rq = comm.Irecv(b, r, 4)
    comm.Send(a * 2, r, 4)
    rq.Wait()
    check(b.tolist() == (a * 2).tolist(), "Irecv before Send to self")
    sreq = comm.Issend(a, r, 6)
    check(bool(sreq) and not sreq.Test(), "Issend to self completed before a receive")
    check(comm.Iprobe(MPI.ANY_SOURCE, 6, st) and st.source == r and st.Get_count(MPI.BYTE) == 40,
          "Iprobe of a message to self")
    comm.Recv(b, r, 6)
    check(sreq.Test() and not sreq and sreq == MPI.REQUEST_NULL, "Issend after the receive")
    expect(r2comm.R2commTruncateError, lambda: (comm.Send(a, r, 8), comm.Recv(b[:2], r, 8)))
    # Ssend/Issend and Sendrecv_replace over the ring
    right, left = (r + 1) % n, (r - 1) % n
    x = np.full(7, r, np.float32)
    got = np.zeros(7, np.float32)
    rr = comm.Irecv(got, left, 1)
    comm.Ssend(x, right, 1)
    rr.Wait()
    check((got == left).all(), "Ssend over the ring")
    buf = np.full(9, r, np.int16)
    comm.Sendrecv_replace(buf, right, 2, left, 2)
    check((buf == left).all(), "Sendrecv_replace")
    buf = np.full(9, r, np.int16)
    comm.Isendrecv_replace(buf, right, 2, left, 2).Wait()
    check((buf == left).all(), "Isendrecv_replace")
    got = np.zeros(3, np.complex64)
    comm.Isendrecv(np.full(3, r + 1j, np.complex64), right, 4, got, left, 4).Wait()
    check((got == left + 1j).all(), "Isendrecv of complex64")
    flags = np.zeros(4, np.bool_)
    comm.Sendrecv(np.array([r % 2 == 0] * 4), right, 5, flags, left, 5)
    check(flags.tolist() == [left % 2 == 0] * 4, "Sendrecv of bool")
    # persistent requests, started several times
    sbuf, rbuf = np.zeros(4, np.int32), np.zeros(4, np.int32)
    sreq = comm.Send_init(sbuf, right, 11)
    rreq = comm.Recv_init(rbuf, left, 11)
    for it in range(3):
        sbuf[:] = 10 * r + it
        r2comm.Prequest.Startall([rreq, sreq])
        i = r2comm.Prequest.Waitany([rreq, sreq])
        j = r2comm.Prequest.Waitany([rreq, sreq])
        check({i, j} == {0, 1} and r2comm.Prequest.Waitany([rreq, sreq]) == r2comm.UNDEFINED,
              "Waitany over persistent requests")
        check((rbuf == 10 * left + it).all(), f"persistent run {it}: {rbuf}")
    sreq.Free()
    rreq.Free()
    check(sreq == MPI.REQUEST_NULL and rreq == r2comm.REQUEST_NULL, "freed persistent requests")
    # probes of messages from another rank
    comm.Barrier()
    if r == 0:
        for k in range(1, n):
            comm.Send(np.full(3 + k, k, np.float64), k, 20 + k)
        comm.Send(np.arange(4, dtype=np.int32), 1, 30)
    else:
        st = MPI.Status()
        comm.Probe(0, MPI.ANY_TAG, st)
        check(st.source == 0 and st.tag == 20 + r and st.Get_count(MPI.BYTE) == 8 * (3 + r),
              f"Probe: {st.source} {st.tag}")
        msg = comm.Mprobe(MPI.ANY_SOURCE, 20 + r)
        out = np.zeros(3 + r, np.float64)
        msg.Recv(out)
        check((out == r).all(), "Mprobe + Recv")
        if r == 1:
            m = None
            for _ in range(20000):                    # bounded: the message is on its way
                m = comm.Improbe(0, 30)
                if m is not None:
                    break
            check(m is not None, "Improbe found nothing")
            got = np.zeros(4, np.int32)
            check(not comm.Iprobe(0, 30), "Improbe left the message to other receives")
            m.Irecv(got).Wait()
            check(got.tolist() == [0, 1, 2, 3], "Improbe + Irecv")
    comm.Barrier()


def sc_refusals(comm):
    r = comm.rank
    Arg = r2comm.R2commArgumentError
    expect(Arg, lambda: comm.Bsend(np.zeros(2), (r + 1) % comm.size), "Send")
    expect(Arg, lambda: comm.Ibsend(np.zeros(2), (r + 1) % comm.size), "scope")
    t = MPI.INT.Create_vector(2, 1, 2).Commit()
    expect(Arg, lambda: comm.Bcast([np.zeros(4, np.int32), 1, t], 0), "derived MPI datatype")
    t.Free()
    expect(Arg, lambda: comm.Allreduce(np.zeros(2, np.longdouble), np.zeros(2, np.longdouble)),
           "float64")
    expect(Arg, lambda: comm.Bcast(np.zeros(2, np.clongdouble), 0), "complex128")
    expect(Arg, lambda: comm.Allreduce(np.ones(3, np.bool_), np.ones(3, np.bool_), MPI.SUM),
           "uint8")
    expect(Arg, lambda: comm.Allreduce(np.ones(3, np.complex64), np.ones(3, np.complex64),
                                       MPI.MAX), "real numbers")
    inter = None
    if comm.size > 1:
        local = world.Split(r % 2, r)
        inter = local.Create_intercomm(0, world, 1 - r % 2, 7)
        expect(Arg, lambda: r2comm.Communicator(inter), "Merge")
        inter.Free()
        local.Free()
    comm.Barrier()


SCENARIOS = {"counts": sc_counts, "proc_null": sc_proc_null, "in_place": sc_in_place,
             "vector": sc_vector, "scan": sc_scan, "p2p": sc_p2p, "refusals": sc_refusals}

if __name__ == "__main__":
    name = sys.argv[1]
    comm = r2comm.Communicator(world, timeout=30)
    SCENARIOS[name](comm)
    total = world.allreduce(CHECKS[0])
    if world.Get_rank() == 0:
        print(f"OK {name} {total}", flush=True)
    comm.Free()
