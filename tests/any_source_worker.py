"""Receives from any source (r2comm.ANY_SOURCE), run under mpiexec by tests/test_any_source.py.

    mpiexec -n N python tests/any_source_worker.py anysrc

Every rank but 0 sends tagged messages to rank 0, which receives them with ANY_SOURCE (and
some with a named source in between) and checks sources, tags, contents and the order of
each sender's messages; prints "OK anysrc <count>" on rank 0."""
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import r2comm  # noqa: E402
from mpi_worker import check, expect, main  # noqa: E402

WORLD = MPI.COMM_WORLD
ANY = r2comm.ANY_SOURCE
BIG = 300001          # over the eager size and many chunks: its send waits for the receiver


def payload(src, i, size):
    """Message i of rank src: its words say who sent it and which one it is."""
    a = np.full(size, src * 1000 + i, "int32")
    a[-1] = i
    return a


def got(buf, st, size):
    """(source, index) of a received message, checked against its status and its contents."""
    src, i = st.source, int(buf[size - 1])
    check(st.count == size * 4, f"status count {st.count} for a message of {size} words")
    check(np.array_equal(buf[:size], payload(src, i, size)), f"contents of message {i} of {src}")
    check(st.tag == src * 10 + i % 10, f"status tag {st.tag} of message {i} from {src}")
    return src, i


def recv(comm, size, source=ANY, tag=r2comm.ANY_TAG):
    buf = np.zeros(max(size, BIG), "int32")
    st = r2comm.Status()
    comm.Recv(buf, source, tag, status=st)
    return got(buf, st, size)


def send(comm, i, size):
    r = comm.rank
    comm.Send(payload(r, i, size), 0, tag=r * 10 + i % 10)


def unexpected_all_senders(comm, k):
    """k messages from every other rank, all stored before rank 0 posts a receive: each
    sender's arrive in order; a named-source receive in between takes that sender's next."""
    n, r = comm.size, comm.rank
    if r:
        for i in range(k):
            send(comm, i, BIG if i == 1 else 5)
        WORLD.Barrier()
        return 0
    WORLD.Barrier()
    nxt = {s: 0 for s in range(1, n)}
    for j in range((n - 1) * k):
        named = j == 2
        size = lambda s: BIG if nxt[s] == 1 else 5   # noqa: E731
        if named:
            src, i = recv(comm, size(n - 1), source=n - 1)
            check(src == n - 1, "named-source receive among any-source ones")
        else:
            # the message's size is unknown here: receive into a big buffer, size from status
            buf = np.zeros(BIG, "int32")
            st = r2comm.Status()
            comm.Recv(buf, ANY, status=st)
            src, i = got(buf, st, st.count // 4)
        check(i == nxt[src], f"message {i} of rank {src} came before message {nxt[src]}")
        nxt[src] += 1
    check(all(v == k for v in nxt.values()), f"every message received once: {nxt}")
    return 1


def arrival_order(comm):
    """Stored messages go to any-source receives in the order they arrived, whoever sent."""
    n, r = comm.size, comm.rank
    order = list(range(n - 1, 0, -1))          # the highest rank's message arrives first
    for s in order:
        if r == s:
            send(comm, 20, BIG)                 # returns once rank 0 holds all of it
        WORLD.Barrier()
    if r:
        return 0
    seen = [recv(comm, BIG)[0] for _ in order]
    check(seen == order, f"any-source receives took {seen}, arrival order was {order}")
    return 1


def posted_before_arrival(comm):
    """Receives posted before anything arrived: the earlier-posted of an any-source and a
    named-source receive takes a message both want, either way round."""
    r = comm.rank
    if r == 0:
        bufs = [np.zeros(BIG, "int32") for _ in range(5)]
        sts = [r2comm.Status() for _ in range(5)]
        reqs = [comm.Irecv(bufs[0], ANY, status=sts[0]),
                comm.Irecv(bufs[1], 1, status=sts[1]),
                comm.Irecv(bufs[2], ANY, status=sts[2]),
                comm.Irecv(bufs[3], 1, status=sts[3]),
                comm.Irecv(bufs[4], ANY, status=sts[4])]
    WORLD.Barrier()
    steps = [(1, 30), (1, 31), (2, 32), (1, 33), (1, 34)]
    for s, i in steps:
        if r == s:
            send(comm, i, BIG)
        WORLD.Barrier()
    if r:
        return 0
    r2comm.Request.Waitall(reqs)
    res = [got(b, st, BIG) for b, st in zip(bufs, sts)]
    check(res == steps, f"posted receives took {res}, expected {steps}")
    return 1


def tag_skips_and_cancel(comm):
    """An any-source receive with a tag passes over stored messages of other tags; one that
    timed out takes nothing afterwards; a send to ANY_SOURCE is refused."""
    r = comm.rank
    expect(r2comm.R2commArgumentError,
           lambda: comm.Send(np.zeros(1, "int32"), ANY), "Send to ANY_SOURCE")
    if r == 0:
        expect(r2comm.R2commTimeout, lambda: comm.Irecv(np.zeros(8, "int32"), ANY).Wait(0.3),
               "any-source receive that nothing matches")
    WORLD.Barrier()
    for s in (1, 2):
        if r == s:
            send(comm, 40 + s, 5)              # tags 11+... : rank 1 tag 11, rank 2 tag 22
        WORLD.Barrier()
    if r:
        return 0
    src, i = recv(comm, 5, tag=2 * 10 + 2)
    check((src, i) == (2, 42), f"tagged any-source receive took {(src, i)}")
    src, i = recv(comm, 5)
    check((src, i) == (1, 41), f"then the other message: {(src, i)}")
    return 1


def truncated(comm):
    """A message larger than the any-source receive's buffer fails that receive only; the
    sender's next message goes to the next receive."""
    r = comm.rank
    if r == 1:
        send(comm, 50, 64)
        send(comm, 51, 5)
    if r:
        return 0
    expect(r2comm.R2commTruncateError, lambda: comm.Recv(np.zeros(8, "int32"), ANY),
           "any-source receive of a larger message")
    src, i = recv(comm, 5)
    check((src, i) == (1, 51), f"the message after the truncated one: {(src, i)}")
    return 1


def sc_anysrc(comm, args):
    count = 0
    for fn in (lambda c: unexpected_all_senders(c, int(args.get("k", 6))), arrival_order,
               posted_before_arrival, tag_skips_and_cancel, truncated):
        count += fn(comm)
        WORLD.Barrier()
    return count


if __name__ == "__main__":
    main({"anysrc": sc_anysrc})
