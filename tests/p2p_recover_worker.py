"""Point-to-point after a pair that lost messages recovers: run under mpiexec (2 ranks) by
tests/test_p2p_recover.py.

    mpiexec -n 2 python tests/p2p_recover_worker.py recover

Rank 0 fails every rail to rank 1 (hard), for real (engine.faults.inject). While the rails are down
it posts an eager send (told success: it must still arrive) and a large send (it fails when the
pair is lost); once each rank holds the other lost, both post sends that fail at once. Then
rank 0 restores the rails, and once both hold the pair up again: messages both ways match in
the order sent (named source and ANY_SOURCE, two tags, eager and large), the eager message
from before comes first, nothing is delivered twice. Prints "OK recover <count>" on rank 0."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import r2comm  # noqa: E402
from mpi_worker import WORLD, check, expect, main  # noqa: E402

BIG = 300_001            # int32 words: over the eager size, many chunks


def msg(src, i, words):
    """Message i of rank src: every word names it."""
    return np.full(words, src * 1000 + i, "int32")


def wait_for(cond, limit, what):
    """Poll cond() until true, at most `limit` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        check(time.monotonic() < deadline, f"{what} within {limit} s")
        time.sleep(0.02)


def pair_up(comm, peer):
    return comm.channel.engine.links.peer_ok(peer) and all(ra.state == "up" for ra in comm.rails)


def recv_expect(comm, src, i, words, source=None, tag=r2comm.ANY_TAG):
    """Receive the next message (from `source`, default src) and check it is message i of src."""
    buf = np.zeros(BIG + 8, "int32")
    st = r2comm.Status()
    comm.Recv(buf, src if source is None else source, tag, status=st)
    got = int(buf[0])
    check(st.source == src and st.count == words * 4 and got == src * 1000 + i
          and (buf[:words] == got).all() and not buf[words:].any(),
          f"expected message {i} of rank {src} ({words} words), got {got} "
          f"(source {st.source}, {st.count} bytes)")


def fail_the_pair(comm, peer):
    """Rank 0 fails every rail to rank 1; sends posted while down; both hold the pair lost and
    a send then fails at once on both ranks."""
    r = comm.rank
    pending = []
    if r == 0:
        for k in range(len(comm.rails)):
            comm.fail_rail(k, "hard", peer=peer)
        wait_for(lambda: all(ra.state != "up" for ra in comm.rails), 10, "rails down")
        pending.append(comm.Isend(msg(r, 1, 5), peer, tag=6))          # eager: told success
        big = comm.Isend(msg(r, 2, BIG), peer, tag=7)                   # fails once lost
        pending[0].Wait()
        expect(r2comm.R2commError, big.Wait, "a large send while every rail is down")
    wait_for(lambda: not comm.channel.engine.links.peer_ok(peer), 15, "the peer held lost")
    WORLD.Barrier()
    for i, words in ((3, BIG), (4, 5)):
        expect(r2comm.R2commNetworkError, lambda: comm.Send(msg(r, i, words), peer, tag=7),
               f"send {i} to a lost peer")
    expect(r2comm.R2commNetworkError, lambda: comm.Recv(np.zeros(5, "int32"), peer),
           "receive from a lost peer")
    WORLD.Barrier()


def restore_the_pair(comm, peer):
    if comm.rank == 0:
        for k in range(len(comm.rails)):
            comm.restore_rail(k)
    wait_for(lambda: pair_up(comm, peer), 20, "the pair up again")
    WORLD.Barrier()
    wait_for(lambda: pair_up(comm, peer), 20, "the pair up again")


def after_recovery(comm, peer):
    """Messages both ways, in the order sent; the eager one from before the failure first."""
    r = comm.rank
    sends = [(5, 7, 5), (6, 7, BIG), (7, 8, 5), (8, 7, 5)]       # (index, tag, words)
    reqs = [comm.Isend(msg(r, i, w), peer, tag=t) for i, t, w in sends]
    if r == 1:
        recv_expect(comm, 0, 1, 5, tag=6)             # sent before the failure, told success
    recv_expect(comm, peer, 5, 5, tag=7)
    recv_expect(comm, peer, 6, BIG, source=r2comm.ANY_SOURCE)
    recv_expect(comm, peer, 8, 5, tag=7)             # tag 7's next: message 7 has tag 8
    recv_expect(comm, peer, 7, 5, tag=8)
    for q in reqs:
        q.Wait()
    WORLD.Barrier()
    # nothing left over: no copy of any message arrives again
    extra = comm.Irecv(np.zeros(BIG + 8, "int32"), peer)
    expect(r2comm.R2commTimeout, lambda: extra.Wait(0.5),
           "no message left over (none delivered twice, none reported failed)")
    WORLD.Barrier()                                  # (both ranks' checks ended first)
    comm.Send(msg(r, 9, 5), peer, tag=3)
    recv_expect(comm, peer, 9, 5, tag=3)
    return 1


def sc_recover(comm, args):
    peer = 1 - comm.rank
    comm.Send(msg(comm.rank, 0, 5), peer, tag=1)                  # the pair in use first
    recv_expect(comm, peer, 0, 5, tag=1)
    WORLD.Barrier()
    fail_the_pair(comm, peer)
    restore_the_pair(comm, peer)
    return after_recovery(comm, peer)


if __name__ == "__main__":
    main({"recover": sc_recover},
         comm_kwargs={"rails": ["127.0.0.1", "127.0.0.2"]})
