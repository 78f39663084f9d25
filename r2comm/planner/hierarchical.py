"""Hierarchical collectives: traffic between ranks of one host stays on the host, and each byte
crosses the NICs once.

  allreduce       intra-host ring reduce-scatter into S slices (S = the most ranks any host
                  runs; local rank i of a host with L ranks ends holding the slices j with
                  j % L == i), then per slice j a ring allreduce among the ranks holding it, one
                  per host (local rank j of every host when every host runs S ranks: rail-
                  optimised), then an intra-host ring allgather. Any topology (hosts may run
                  different numbers of ranks).
  allgather       inter-host ring allgather among the ranks with the same local rank, then an
                  intra-host ring allgather of what they gathered. Hosts with equal rank counts.
  reduce_scatter  intra-host ring reduce-scatter (local rank i ends with the host's partial
                  sums of the blocks of every host's local rank i), then an inter-host ring
                  reduce-scatter among the ranks with the same local rank. Equal rank counts.
  bcast           binomial tree among one rank per host (the root on its host), then a binomial
                  tree inside every host from that rank; chunk-pipelined. Any topology.

Per rank, the NICs of a host carry 2(H-1)/H of the buffer for an allreduce of H hosts, against
2(n-1)/n for a flat ring over all n ranks: 1.0 against 1.5 on 2 hosts x 2 ranks.

Every buffer region is reduced by one chain fixed by the schedule (intra-host ring order, then
the inter-host ring order) and afterwards only copied, so every rank ends with the same bits,
and a run with rail failures (the engine re-sends chunks, the schedule does not change) ends
with the bits of the fault-free run.

Regions. Dependencies join messages of equal length chunk by chunk, so every phase cuts the
buffer into the same regions: for the allreduce, slice j split into H sub-blocks (region
j*H + b); a ring "block" is a list of regions, each its own message, with step
base + ring step * (number of regions) + region id (unique per pair and direction).

Rails. The schedule names peers, not rails: the engine stripes every message over all rails the
two ranks have in common, weighted by their measured rates. Ranks of one host share the host's
NICs (every rank lists all of them), so after a NIC of one host fails, the chunks of that host's
inter-host messages (those in flight are re-sent) go on its surviving NICs without a new
schedule, and the reduction order, hence every bit, stays the same. The planner prices a
degraded host through the RailState (host_bw), like any other schedule."""
from .algorithms import blocks, binomial_tree
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_SEND

HIER_COLLS = ("allreduce", "allgather", "reduce_scatter_block", "bcast")
MAX_STEP = 1 << 23            # routing.RELAY_STEP0: relayed messages use the steps above


def applicable(coll, topo, algo="hierarchical"):
    """True when `coll` has a hierarchical schedule for `topo` (several hosts, some host with
    several ranks; allgather and reduce_scatter also need equal rank counts per host); algo
    "hierarchical_tree" (allreduce only): the tree between hosts, whose steps never overflow."""
    if coll not in HIER_COLLS or not topo.hierarchical:
        return False
    if coll in ("allgather", "reduce_scatter_block") and not topo.regular:
        return False
    if coll == "allreduce" and algo != "hierarchical":
        return algo in ("", "hierarchical_tree") or _steps(coll, topo) < MAX_STEP
    return _steps(coll, topo) < MAX_STEP


def _steps(coll, topo):
    hosts = topo.hosts
    H, S = len(hosts), max(len(h) for h in hosts)
    if coll == "allreduce":
        return (2 * (S - 1) + 2 * (H - 1)) * S * H
    if coll in ("allgather", "reduce_scatter_block"):
        return (S - 1 + H - 1) * topo.n + topo.n
    return 2


def _ring_rs(s, order, me, blk, step0, stride, own, last, from_send=False, buf=WORK):
    """Ring reduce-scatter among `order` (ranks) over ring blocks blk[b] = [(rid, off, len)]:
    block b is reduced along the ring from order[b] on and is final at order[b-1] (the rank at
    position p ends with block (p+1) % n). Message steps: step0 + ring step * stride + rid.
    last: {rid: message that last wrote region rid on this rank}; sends and reductions of a
    region wait for it (chunk by chunk), and each reduction becomes the region's new last.
    from_send: the input is read from SEND (first send, and the other operand of every
    reduction), so WORK needs no copy of it."""
    n = len(order)
    if n <= 1:
        return last
    pos = order.index(me)
    right, left = order[(pos + 1) % n], order[(pos - 1) % n]
    for st in range(n - 1):
        sb, rb = (pos - st) % n, (pos - st - 1) % n
        for rid, off, ln in blk[sb]:
            src = SEND if from_send and st == 0 else buf
            si = s.send(right, step0 + st * stride + rid, src, off, ln, owned=own(ln))
            s.dep(last.get(rid), si)
        for rid, off, ln in blk[rb]:
            ri = s.recv(left, step0 + st * stride + rid, buf, off, ln,
                        REDUCE_SEND if from_send else REDUCE)
            s.dep(last.get(rid), ri)
            last[rid] = ri
    return last


def _ring_ag(s, order, me, blk, step0, stride, own, last, shift, buf=WORK):
    """Ring allgather among `order`: the rank at position p holds block (p + shift) % n;
    afterwards every rank holds every block. Sends wait for the region's last writer."""
    n = len(order)
    if n <= 1:
        return last
    pos = order.index(me)
    right, left = order[(pos + 1) % n], order[(pos - 1) % n]
    for st in range(n - 1):
        sb, rb = (pos + shift - st) % n, (pos + shift - st - 1) % n
        for rid, off, ln in blk[sb]:
            si = s.send(right, step0 + st * stride + rid, buf, off, ln, owned=own(ln))
            s.dep(last.get(rid), si)
        for rid, off, ln in blk[rb]:
            last[rid] = s.recv(left, step0 + st * stride + rid, buf, off, ln, COPY)
    return last


def _owned(eager):
    return lambda ln: ln <= eager


def allreduce_regions(topo, nbytes, itemsize):
    """{region id: (byte offset, length)} of allreduce()'s regions (non-empty only)."""
    hosts = topo.hosts
    H, S = len(hosts), topo.max_local
    reg = {}
    for j, (so, sl) in enumerate(blocks(nbytes // itemsize, S, itemsize)):
        for b, (o, ln) in enumerate(blocks(sl // itemsize, H, itemsize)):
            if ln:
                reg[j * H + b] = (so + o, ln)
    return reg


def resize(sched, topo, old_nbytes, nbytes, itemsize, eager):
    """allreduce()'s schedule for nbytes made from the one for old_nbytes (same rank and
    topology) by moving its messages to the new regions, or None where the regions differ in
    number (a size too small to give every region an element). O(messages), no rebuilding."""
    old = allreduce_regions(topo, old_nbytes, itemsize)
    new = allreduce_regions(topo, nbytes, itemsize)
    if len(old) != len(new) or len(new) != topo.max_local * topo.nhosts:
        return None
    where = {old[rid][0]: new[rid] for rid in old}
    msgs = []
    for k, p, st, buf, off, ln, mode, own in sched.msgs:
        o, n = where[off]
        msgs.append((k, p, st, buf, o, n, mode, n <= eager))
    return sched.copy(msgs=msgs)


def part_regions(count, slices, parts, itemsize):
    """{slice j x parts + part b: (byte offset, length)} of the non-empty parts when `count`
    elements are cut into `slices` slices, each cut into `parts` parts."""
    reg = {}
    for j, (so, sl) in enumerate(blocks(count, slices, itemsize)):
        for b, (o, ln) in enumerate(blocks(sl // itemsize, parts, itemsize)):
            if ln:
                reg[j * parts + b] = (so + o, ln)
    return reg


def allreduce(rank, topo, nbytes, itemsize, eager=0):
    """This rank's hierarchical allreduce (see the module docstring). Reads the input from
    SEND (fills_work): every byte of WORK is written by a reduction or a copy."""
    s = Schedule("hierarchical")
    hosts = topo.hosts
    H, n = len(hosts), topo.n
    if n <= 1:
        return s
    s.fills_work = True
    S = max(len(rs) for rs in hosts)
    count = nbytes // itemsize
    reg = part_regions(count, S, H, itemsize)       # rid -> (off, len), non-empty only
    nreg = S * H
    own = _owned(eager)
    h = topo.host_of[rank]
    mine = hosts[h]
    L, i = len(mine), mine.index(rank)

    def slice_regions(j, subs=range(H)):
        return [(j * H + b, *reg[j * H + b]) for b in subs if j * H + b in reg]
    # ring block b of the host's ring: the slices j with j % L == (b - 1) % L, so that the rank
    # at ring position p (local rank p) ends with the slices j % L == p
    intra = [[x for j in range(S) if j % L == (b - 1) % L for x in slice_regions(j)]
             for b in range(L)]
    last = {}
    _ring_rs(s, mine, rank, intra, 0, nreg, own, last, from_send=True)
    base = (S - 1) * nreg
    for j in range(S):
        if j % L != i:
            continue
        group = [rs[j % len(rs)] for rs in hosts]     # one rank per host, in host order
        # ring block b: sub-block (b - 1) % H, so the rank of host g ends with sub-block g
        inter = [slice_regions(j, [(b - 1) % H]) for b in range(H)]
        _ring_rs(s, group, rank, inter, base, nreg, own, last, from_send=L == 1)
        _ring_ag(s, group, rank, inter, base + (H - 1) * nreg, nreg, own, last, shift=1)
    _ring_ag(s, mine, rank, intra, base + 2 * (H - 1) * nreg, nreg, own, last, shift=1)
    return s


def _tree_region(s, at, p, H, rid, region, step, own, last, from_send):
    """One region through a binary tree of H positions (heap order: the children of p are 2p+1
    and 2p+2; at(q) is the rank at position q): reduced up to position 0 (this rank's value,
    then its children's in order), then copied back down. Chunk-pipelined both ways."""
    off, ln = region
    kids = [c for c in (2 * p + 1, 2 * p + 2) if c < H]
    fresh = from_send and rid not in last              # WORK does not hold the input yet
    prev = last.get(rid)
    for c in kids:
        ri = s.recv(at(c), step, WORK, off, ln, REDUCE_SEND if fresh else REDUCE)
        s.dep(prev, ri)
        prev, fresh = ri, False
    if p:
        si = s.send(at((p - 1) // 2), step, SEND if fresh else WORK, off, ln, owned=own(ln))
        s.dep(prev, si)
        ri = s.recv(at((p - 1) // 2), step + 1, WORK, off, ln, COPY)
        s.dep(si, ri)                                  # the partial sum has left first
        prev = ri
    for c in kids:
        s.dep(prev, s.send(at(c), step + 1, WORK, off, ln, owned=own(ln)))
    last[rid] = prev


def tree_allreduce(rank, topo, nbytes, itemsize, eager=0):
    """The allreduce with a double binary tree between hosts: intra-host ring reduce-scatter
    into S slices (as allreduce()), then per slice, among the ranks holding it (one per host),
    each half of the slice through its own binary tree of the hosts (tree 0 in host order, tree 1
    in reverse order, so that a host is an inner node of at most one of them and every host
    moves about one slice each way), then the intra-host ring allgather. log2(H) dependent steps
    between hosts instead of the ring's 2(H-1), and O(S) messages per rank at any host count.
    Every region is reduced by one chain the schedule fixes (the host ring, then the tree) and
    then only copied: bitwise the same on every rank."""
    s = Schedule("hierarchical_tree")
    hosts = topo.hosts
    H, n = len(hosts), topo.n
    if n <= 1:
        return s
    s.fills_work = True
    S = topo.max_local
    count = nbytes // itemsize
    reg = part_regions(count, S, 2, itemsize)
    nreg = 2 * S
    own = _owned(eager)
    h = topo.host_of[rank]
    mine = hosts[h]
    L, i = len(mine), mine.index(rank)

    def slice_regions(j):
        return [(2 * j + t, *reg[2 * j + t]) for t in (0, 1) if 2 * j + t in reg]
    intra = [[x for j in range(S) if j % L == (b - 1) % L for x in slice_regions(j)]
             for b in range(L)]
    last = {}
    _ring_rs(s, mine, rank, intra, 0, nreg, own, last, from_send=True)
    base = max(S - 1, 1) * nreg
    for j in range(S):
        if j % L != i:
            continue
        group = [rs[j % len(rs)] for rs in hosts]     # one rank per host, in host order
        for t in (0, 1):
            rid = 2 * j + t
            if rid not in reg:
                continue
            at = group.__getitem__ if t == 0 else (lambda q, g=group: g[H - 1 - q])
            _tree_region(s, at, h if t == 0 else H - 1 - h, H, rid, reg[rid], base + 2 * rid,
                         own, last, from_send=L == 1)
    _ring_ag(s, mine, rank, intra, base + 2 * nreg, nreg, own, last, shift=1)
    return s


def allgather(rank, topo, block, eager=0):
    """recvbuf (WORK) holds n blocks, this rank's already in place. Hosts with equal rank
    counts: inter-host ring among equal local ranks, then the intra-host ring."""
    s = Schedule("hierarchical")
    hosts = topo.hosts
    H, n = len(hosts), topo.n
    if n <= 1 or not block:
        return s
    own = _owned(eager)
    h = topo.host_of[rank]
    mine = hosts[h]
    L, i = len(mine), mine.index(rank)
    reg = lambda r: (r, r * block, block)             # noqa: E731
    last = {}
    group = [rs[i] for rs in hosts]
    _ring_ag(s, group, rank, [[reg(rs[i])] for rs in hosts], 0, n, own, last, shift=0)
    intra = [[reg(rs[b]) for rs in hosts] for b in range(L)]
    _ring_ag(s, mine, rank, intra, (H - 1) * n, n, own, last, shift=0)
    return s


def reduce_scatter(rank, topo, block, itemsize, eager=0):
    """Rank r gets block r of the reduction of every rank's n blocks (SEND), over a scratch
    copy. Hosts with equal rank counts."""
    s = Schedule("hierarchical")
    hosts = topo.hosts
    H, n = len(hosts), topo.n
    s.scratch = n * block
    s.pre.append((SCRATCH, 0, SEND, 0, n * block))
    s.post.append((WORK, 0, SCRATCH, rank * block, block))
    if n <= 1 or not block:
        return s
    own = _owned(eager)
    h = topo.host_of[rank]
    mine = hosts[h]
    L, i = len(mine), mine.index(rank)
    reg = lambda r: (r, r * block, block)             # noqa: E731
    last = {}
    # host ring block b: the blocks of every host's local rank (b - 1) % L, so local rank p
    # ends with the host's partial sums of the blocks of the local ranks p
    intra = [[reg(rs[(b - 1) % L]) for rs in hosts] for b in range(L)]
    _ring_rs(s, mine, rank, intra, 0, n, own, last, buf=SCRATCH)
    group = [rs[i] for rs in hosts]
    inter = [[reg(group[(b - 1) % H])] for b in range(H)]
    _ring_rs(s, group, rank, inter, (L - 1) * n, n, own, last, buf=SCRATCH)
    return s


def bcast(rank, topo, nbytes, root, eager=0):
    """Binomial tree among one rank per host (root's host first, then the host order; on
    another host the rank with the root's local rank, modulo its size), then a binomial tree
    inside each host from that rank. Every forward waits chunk by chunk for the receive."""
    s = Schedule("hierarchical")
    hosts = topo.hosts
    H = len(hosts)
    if topo.n <= 1:
        return s
    own = nbytes <= eager
    hr = topo.host_of[root]
    li = hosts[hr].index(root)
    leader = [rs[li % len(rs)] for rs in hosts]
    leader[hr] = root
    h = topo.host_of[rank]
    ri = None
    if rank == leader[h]:                             # inter-host tree among the leaders
        order = [leader[(hr + k) % H] for k in range(H)]
        parent, kids = binomial_tree(order.index(rank), H)
        if parent is not None:
            ri = s.recv(order[parent], 0, WORK, 0, nbytes, COPY)
        for c in kids:
            s.dep(ri, s.send(order[c], 0, WORK, 0, nbytes, owned=own))
    mine = hosts[h]
    L, lead = len(mine), mine.index(leader[h])
    order = [mine[(lead + k) % L] for k in range(L)]
    parent, kids = binomial_tree(order.index(rank), L)
    if parent is not None:
        ri = s.recv(order[parent], 1, WORK, 0, nbytes, COPY)
    for c in kids:
        s.dep(ri, s.send(order[c], 1, WORK, 0, nbytes, owned=own))
    return s


def build(coll, rank, topo, nbytes, itemsize, root=0, eager=0):
    """This rank's hierarchical schedule of `coll` (nbytes: the per-rank size, a block for
    allgather / reduce_scatter_block, as planner.build)."""
    if coll == "allreduce":
        return allreduce(rank, topo, nbytes, itemsize, eager)
    if coll == "allreduce_tree":
        return tree_allreduce(rank, topo, nbytes, itemsize, eager)
    if coll == "allgather":
        return allgather(rank, topo, nbytes, eager)
    if coll == "reduce_scatter_block":
        return reduce_scatter(rank, topo, nbytes, itemsize, eager)
    if coll == "bcast":
        return bcast(rank, topo, nbytes, root, eager)
    raise ValueError(f"no hierarchical schedule for {coll!r}")
