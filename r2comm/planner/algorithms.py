"""Collective algorithms as schedule builders: (rank, size, sizes) -> Schedule.

Reduction order is fixed by the schedule alone (never by arrival order), so results are
bitwise identical on every rank and between a faulty and a fault-free run."""
from .schedule import (Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_REV, REDUCE_SEND,
                       REDUCE_SEND_REV)


def blocks(count, n, itemsize):
    """Byte (offset, length) of n nearly equal blocks of `count` elements."""
    out = []
    for b in range(n):
        lo, hi = b * count // n, (b + 1) * count // n
        out.append((lo * itemsize, (hi - lo) * itemsize))
    return out


def allreduce_ring(rank, n, nbytes, itemsize, eager=0):
    """Ring reduce-scatter then ring allgather, pipelined chunk by chunk (bandwidth optimal).
    The input is read from SEND (first send, and the other operand of every reduction), so
    WORK needs no copy of it: each block is written once by a reduction or by the allgather."""
    s = Schedule("ring")
    if n == 1:
        return s
    s.fills_work = True
    blk = blocks(nbytes // itemsize, n, itemsize)
    right, left = (rank + 1) % n, (rank - 1) % n
    own = nbytes // n <= eager
    prev = None
    for st in range(n - 1):                       # reduce-scatter
        sb, rb = (rank - st) % n, (rank - st - 1) % n
        si = s.send(right, st, SEND if st == 0 else WORK, blk[sb][0], blk[sb][1], owned=own)
        s.dep(prev, si)
        prev = s.recv(left, st, WORK, blk[rb][0], blk[rb][1], REDUCE_SEND)
    for st in range(n - 1):                       # allgather
        sb, rb = (rank + 1 - st) % n, (rank - st) % n
        si = s.send(right, n - 1 + st, WORK, blk[sb][0], blk[sb][1], owned=own)
        s.dep(prev, si)
        prev = s.recv(left, n - 1 + st, WORK, blk[rb][0], blk[rb][1], COPY)
    return s


def allreduce_halving(rank, n, nbytes, itemsize, eager=0):
    """Rabenseifner's allreduce for a power-of-two n: reduce-scatter by recursive halving,
    then allgather by recursive doubling. It moves the ring's bytes (2(n-1)/n of the message
    per rank) in 2·log2(n) dependent steps instead of 2(n-1), which counts where every step
    waits for a peer to be scheduled (more ranks than CPUs on one host).

    The message is cut into n blocks; rank r ends the reduce-scatter owning block r. At
    halving level k the partner is r ^ (n >> (k+1)): each sends the half of its current range
    that the partner keeps and reduces the half it keeps (the first level from SEND, so WORK
    needs no copy of the input). Every message is one block, so each dependency joins two
    messages of one block (the engine's dependencies are chunk by chunk between equal
    lengths): a block's sends and receives wait for the last message that wrote it, and an
    allgather receive waits until the block's earlier send is done with it. Each block is
    reduced on one rank only, in an order the schedule fixes: bitwise the same everywhere."""
    if n & (n - 1):
        raise ValueError(f"recursive halving needs a power-of-two number of ranks, not {n}")
    s = Schedule("rabenseifner")
    if n == 1:
        return s
    s.fills_work = True
    blk = blocks(nbytes // itemsize, n, itemsize)
    own = nbytes // n <= eager
    levels = n.bit_length() - 1
    wrote = [None] * n              # the last message that wrote each block of WORK
    sent = [None] * n               # the last send that read each block
    lo, width = 0, n                # the range of blocks this rank still reduces
    for k in range(levels):
        d = width // 2
        partner = rank ^ d
        keep_lo = lo if not rank & d else lo + d
        give_lo = lo + d if not rank & d else lo
        for b in range(give_lo, give_lo + d):
            if blk[b][1]:
                sent[b] = si = s.send(partner, k * n + b, SEND if k == 0 else WORK, *blk[b],
                                      owned=own)
                s.dep(wrote[b], si)
        for b in range(keep_lo, keep_lo + d):
            if blk[b][1]:
                ri = s.recv(partner, k * n + b, WORK, *blk[b], REDUCE_SEND if k == 0 else REDUCE)
                s.dep(wrote[b], ri)
                wrote[b] = ri
        lo, width = keep_lo, d
    for j in range(levels):         # allgather: ranges double back up
        d = 1 << j
        partner = rank ^ d
        mine = range(rank & ~(d - 1), (rank & ~(d - 1)) + d)
        for b in mine:
            if blk[b][1]:
                si = s.send(partner, (levels + j) * n + b, WORK, *blk[b], owned=own)
                s.dep(wrote[b], si)
                sent[b] = si
        for b in mine:
            t = b ^ d
            if blk[t][1]:
                ri = s.recv(partner, (levels + j) * n + t, WORK, *blk[t], COPY)
                s.dep(sent[t], ri)
                s.dep(wrote[t], ri)
                wrote[t] = ri
    return s


def allreduce_rd(rank, n, nbytes, itemsize=1, separate_send=False, eager=0):
    """Recursive doubling on the largest power of two, extra ranks folded in first (latency
    optimal). Each level combines as (lower rank's value) op (higher rank's value) on both
    sides, so both hold the same bits.

    separate_send (SEND is not WORK, i.e. not IN_PLACE): the first exchange sends straight from
    SEND and reduces SEND op incoming into WORK, with no copy at all (messages over `eager` bytes
    are sent in place and wait for their acks; smaller ones are still copied, so the operation
    can end before the ack comes back); later levels send owned copies, because the same
    level's receive overwrites WORK."""
    s = Schedule("recursive_doubling")
    if n == 1:
        return s
    s.fills_work = separate_send
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    if rank >= p2:                                 # extra: hand over, get the result back
        si = s.send(rank - p2, 0, SEND if separate_send else WORK, 0, nbytes,
                    owned=not separate_send or nbytes <= eager)
        ri = s.recv(rank - p2, 1, WORK, 0, nbytes, COPY)
        s.dep(si, ri)
        return s
    prev = None
    fresh = separate_send                          # WORK does not hold a value yet
    if rank < rem:
        prev = s.recv(rank + p2, 0, WORK, 0, nbytes, REDUCE_SEND if fresh else REDUCE)
        fresh = False
    level, dist = 0, 1
    while dist < p2:
        partner = rank ^ dist
        lower = rank < partner
        if fresh:
            si = s.send(partner, 1 + level, SEND, 0, nbytes, owned=nbytes <= eager)
            ri = s.recv(partner, 1 + level, WORK, 0, nbytes,
                        REDUCE_SEND if lower else REDUCE_SEND_REV)
            fresh = False
        else:
            si = s.send(partner, 1 + level, WORK, 0, nbytes, owned=True)
            s.dep(prev, si)
            ri = s.recv(partner, 1 + level, WORK, 0, nbytes, REDUCE if lower else REDUCE_REV)
            s.dep(si, ri)
        prev = ri
        level, dist = level + 1, dist * 2
    if rank < rem:
        si = s.send(rank + p2, 1, WORK, 0, nbytes, owned=True)
        s.dep(prev, si)
    return s


def binomial_tree(v, n):
    """Binomial tree on relative ranks: (parent or None, children in ascending order)."""
    parent = None if v == 0 else v - (1 << (v.bit_length() - 1))
    kids, k = [], v.bit_length() if v else 0
    while v + (1 << k) < n:
        kids.append(v + (1 << k))
        k += 1
    return parent, kids


def binary_tree(v, n):
    """Binary tree on relative ranks in heap order: (parent or None, children in ascending
    order). Every rank talks to at most 3 peers whatever n (a binomial tree's root talks to
    log2 n), so a tree collective connects O(1) peers per rank (issue 31); depth log2 n."""
    parent = None if v == 0 else (v - 1) // 2
    return parent, [c for c in (2 * v + 1, 2 * v + 2) if c < n]


def bcast_tree(rank, n, nbytes, root, eager=0):
    """Binary tree, each chunk forwarded to both children as soon as it arrives."""
    s = Schedule("binary")
    v = (rank - root) % n
    parent, kids = binary_tree(v, n)
    ri = None
    if parent is not None:
        ri = s.recv((parent + root) % n, 0, WORK, 0, nbytes, COPY)
    for c in kids:
        si = s.send((c + root) % n, 0, WORK, 0, nbytes, owned=nbytes <= eager)
        s.dep(ri, si)
    return s


def reduce_tree(rank, n, nbytes, root, eager=0):
    """Binary tree reduce into WORK (root) or SCRATCH; children applied in a fixed order."""
    v = (rank - root) % n
    parent, kids = binary_tree(v, n)
    s = Schedule("binary")
    buf = WORK if v == 0 else (SCRATCH if kids else SEND)
    if buf == SCRATCH:
        s.scratch = nbytes
        s.pre.append((SCRATCH, 0, SEND, 0, nbytes))
    prev = None
    for c in kids:
        ri = s.recv((c + root) % n, 0, buf, 0, nbytes, REDUCE)
        s.dep(prev, ri)
        prev = ri
    if parent is not None:
        si = s.send((parent + root) % n, 0, buf, 0, nbytes, owned=nbytes <= eager)
        s.dep(prev, si)
    return s


def allgather_ring(rank, n, block, eager=0):
    """recvbuf holds n blocks; this rank's block is already in place. Step st sends block
    rank - st to the right and receives block rank - st - 1 from the left; each send waits for
    the previous step's receive (messages listed directly: 2(n-1) of them per rank)."""
    s = Schedule("ring")
    right, left = (rank + 1) % n, (rank - 1) % n
    own = block <= eager
    for st in range(n - 1):
        s.msgs += (("send", right, st, WORK, (rank - st) % n * block, block, COPY, own),
                   ("recv", left, st, WORK, (rank - st - 1) % n * block, block, COPY, False))
    s.deps = [(2 * st - 1, 2 * st) for st in range(1, n - 1)]
    return s


def reduce_scatter_ring(rank, n, block, itemsize, eager=0):
    """Ring reduce-scatter over a scratch copy of the input; rank r keeps block r."""
    s = Schedule("ring")
    s.scratch = n * block
    s.pre.append((SCRATCH, 0, SEND, 0, n * block))
    right, left = (rank + 1) % n, (rank - 1) % n
    own = block <= eager
    for st in range(n - 1):                       # (as allgather_ring: send after receive)
        s.msgs += (("send", right, st, SCRATCH, (rank - st - 1) % n * block, block, COPY, own),
                   ("recv", left, st, SCRATCH, (rank - st - 2) % n * block, block, REDUCE,
                    False))
    s.deps = [(2 * st - 1, 2 * st) for st in range(1, n - 1)]
    s.post.append((WORK, 0, SCRATCH, rank * block, block))
    return s


def alltoall_direct(rank, n, block, eager=0):
    s = Schedule("direct")
    own = block <= eager
    s.msgs = [("send", p, 0, SEND, p * block, block, COPY, own)
              for p in ((rank + k) % n for k in range(1, n))] + \
             [("recv", p, 0, WORK, p * block, block, COPY, False)
              for p in ((rank - k) % n for k in range(1, n))]
    s.pre.append((WORK, rank * block, SEND, rank * block, block))
    return s
