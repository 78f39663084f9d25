"""Schedules of the rooted block collectives (Gather, Scatter), the vector collectives (Gatherv,
Scatterv, Allgatherv, Alltoallv, Reduce_scatter with counts) and the prefix reductions (Scan,
Exscan): one rank's schedule from its layout, in bytes.

A layout is a tuple that holds what this rank knows of the call (MPI's arguments):
  gather, scatter           (block,)                         every rank's share, equal
  gatherv, scatterv         root: (sizes, displs); others: (size,)   the root alone knows all
                            (others: (size, sizes) where the caller learnt them: a relay)
  allgatherv                (sizes, displs)                  sizes alike on every rank
  alltoallv                 (ssizes, sdispls, rsizes, rdispls)       this rank's own
                            (+ every rank's ssizes, row by row, where learnt: a relay)
  reduce_scatter            (sizes,)                         alike on every rank
  scan, exscan              (nbytes,)
Algorithms (O(n) messages at most on a rank, as the counts themselves): gather/scatter and
their v-forms go straight to/from the root (only the root knows every size, so no rank could
forward another's block); allgatherv is the ring of allgather with blocks of their own sizes;
alltoallv exchanges directly with every peer; reduce_scatter is the reduce-scatter ring over
blocks of their own sizes; scan and exscan pass the running prefix along the chain 0 -> 1 ->
... -> n-1 (exscan sends it twice: once as the next rank's result, once to fold its own input
into). IN_PLACE calls (separate=False) never read SEND: the engine has no send buffer then."""
from .price import Net, chain, volume
from .routing import relay
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_REV
from .state import DEFAULT_ALPHA, DEFAULT_BW, DEFAULT_CHUNK
from .topology import INTRA_BW
from ..errors import R2commNetworkError

KINDS = ("gather", "scatter", "gatherv", "scatterv", "allgatherv", "alltoallv",
         "reduce_scatter", "scan", "exscan")
SHARED = ("gather", "scatter", "allgatherv", "reduce_scatter", "scan", "exscan")
NAMES = {"gatherv": "Gatherv", "scatterv": "Scatterv", "alltoallv": "Alltoallv"}


def shared_shape(coll, layout):
    """(bytes for the call descriptor's count, the part of the layout every rank holds alike):
    what the engine compares between ranks (plans.descriptor)."""
    if coll in ("gather", "scatter", "scan", "exscan"):
        return layout[0], layout[0]
    if coll in ("allgatherv", "reduce_scatter"):
        return 0, layout[0]
    return 0, ""


def _owned(n, eager):
    return n <= eager


def rooted(coll, rank, n, layout, root, eager, separate):
    """Gather(v) into root's WORK, or Scatter(v) out of root's SEND, directly. A root's layout
    may end with a flag: its own block stays where it is (Scatter with IN_PLACE)."""
    s = Schedule("direct")
    gather = coll in ("gather", "gatherv")
    keep_own = False
    if coll in ("gather", "scatter"):
        sizes = [layout[0]] * n
        displs = [i * layout[0] for i in range(n)]
        keep_own = len(layout) > 1 and layout[1]
    elif rank == root:
        sizes, displs = layout[0], layout[1]
        keep_own = len(layout) > 2 and layout[2]
    else:
        sizes = displs = None
    if rank != root:
        mine = layout[0] if sizes is None else sizes[rank]
        if gather:
            s.send(root, 0, SEND if separate else WORK, 0, mine, owned=_owned(mine, eager))
        else:
            s.recv(root, 0, WORK, 0, mine, COPY)
        return s
    for k in range(1, n):
        peer = (root + k) % n
        if gather:
            s.recv(peer, 0, WORK, displs[peer], sizes[peer], COPY)
        else:
            s.send(peer, 0, SEND, displs[peer], sizes[peer], owned=_owned(sizes[peer], eager))
    if separate and not keep_own and sizes[root]:    # its own block (IN_PLACE: already there)
        if gather:
            s.pre.append((WORK, displs[root], SEND, 0, sizes[root]))
        else:
            s.pre.append((WORK, 0, SEND, displs[root], sizes[root]))
    return s


def allgatherv_ring(rank, n, sizes, displs, eager):
    """The allgather ring, block b of sizes[b] bytes at displs[b] of WORK (this rank's block
    already in place)."""
    s = Schedule("ring")
    right, left = (rank + 1) % n, (rank - 1) % n
    prev = None
    for st in range(n - 1):
        sb, rb = (rank - st) % n, (rank - st - 1) % n
        si = s.send(right, st, WORK, displs[sb], sizes[sb], owned=_owned(sizes[sb], eager))
        s.dep(prev, si)
        prev = s.recv(left, st, WORK, displs[rb], sizes[rb], COPY)
    return s


def alltoallv_direct(rank, n, layout, eager, separate):
    """Every peer's block straight from SEND to its WORK; this rank's own block copied."""
    ssz, sdp, rsz, rdp = layout[:4]
    s = Schedule("direct")
    for k in range(1, n):
        peer = (rank + k) % n
        s.send(peer, 0, SEND, sdp[peer], ssz[peer], owned=_owned(ssz[peer], eager))
    for k in range(1, n):
        peer = (rank - k) % n
        s.recv(peer, 0, WORK, rdp[peer], rsz[peer], COPY)
    if ssz[rank]:
        s.pre.append((WORK, rdp[rank], SEND, sdp[rank], ssz[rank]))
    return s


def reduce_scatter_ring(rank, n, sizes, eager, separate):
    """The reduce-scatter ring over a scratch copy of the input, block b of sizes[b] bytes;
    rank r's block ends in WORK at 0."""
    displs, at = [], 0
    for c in sizes:
        displs.append(at)
        at += c
    s = Schedule("ring")
    s.scratch = at
    s.pre.append((SCRATCH, 0, SEND if separate else WORK, 0, at))
    right, left = (rank + 1) % n, (rank - 1) % n
    prev = None
    for st in range(n - 1):
        sb, rb = (rank - st - 1) % n, (rank - st - 2) % n
        si = s.send(right, st, SCRATCH, displs[sb], sizes[sb], owned=_owned(sizes[sb], eager))
        s.dep(prev, si)
        prev = s.recv(left, st, SCRATCH, displs[rb], sizes[rb], REDUCE)
    s.post.append((WORK, 0, SCRATCH, displs[rank], sizes[rank]))
    return s


def scan_chain(rank, n, nbytes, eager, separate):
    """Inclusive prefix: WORK = input, then the left neighbour's prefix folded in (incoming op
    own), then passed on to the right."""
    s = Schedule("chain")
    if separate:
        s.pre.append((WORK, 0, SEND, 0, nbytes))
    ri = s.recv(rank - 1, 0, WORK, 0, nbytes, REDUCE_REV) if rank > 0 else None
    if rank < n - 1:
        si = s.send(rank + 1, 0, WORK, 0, nbytes, owned=_owned(nbytes, eager))
        s.dep(ri, si)
    return s


def exscan_chain(rank, n, nbytes, eager, separate):
    """Exclusive prefix: rank r's WORK gets the prefix of ranks 0..r-1 (step 0; rank 0's WORK is
    left as it is, as MPI leaves it undefined); the prefix with its own input folded in goes on
    to r + 1 (step 1 carries the prefix a second time, into the next rank's SCRATCH)."""
    s = Schedule("chain")
    src = SEND if separate else WORK
    if rank == 0:
        if n > 1:
            s.send(1, 0, src, 0, nbytes, owned=_owned(nbytes, eager))
            if n > 2:
                s.send(1, 1, src, 0, nbytes, owned=_owned(nbytes, eager))
        return s
    if rank < n - 1:                       # the prefix to pass on: SCRATCH = prefix op input
        s.scratch = nbytes
        s.pre.append((SCRATCH, 0, src, 0, nbytes))
    s.recv(rank - 1, 0, WORK, 0, nbytes, COPY)
    if rank < n - 1:
        ri = s.recv(rank - 1, 1, SCRATCH, 0, nbytes, REDUCE_REV)
        for step in ((0, 1) if rank + 1 < n - 1 else (0,)):
            si = s.send(rank + 1, step, SCRATCH, 0, nbytes, owned=_owned(nbytes, eager))
            s.dep(ri, si)
    return s


def _one(coll, rank, n, layout, root, eager, separate):
    if coll in ("gather", "scatter", "gatherv", "scatterv"):
        return rooted(coll, rank, n, layout, root, eager, separate)
    if coll == "allgatherv":
        return allgatherv_ring(rank, n, layout[0], layout[1], eager)
    if coll == "alltoallv":
        return alltoallv_direct(rank, n, layout, eager, separate)
    if coll == "reduce_scatter":
        return reduce_scatter_ring(rank, n, layout[0], eager, separate)
    if coll == "scan":
        return scan_chain(rank, n, layout[0], eager, separate)
    if coll == "exscan":
        return exscan_chain(rank, n, layout[0], eager, separate)
    raise ValueError(f"no vector schedule for {coll!r}")


def _mean_bytes(layout):
    first = layout[0]
    return sum(first) // max(len(first), 1) if isinstance(first, tuple) else first


def price(coll, net, nbytes, root=0):
    """Closed-form seconds (price.py's α-β terms) of these schedules, nbytes a rank's (mean)
    share: the root's link carries n-1 shares for the rooted ones, the ring n-1 steps for
    allgatherv and reduce_scatter, every NIC n-1 shares for alltoallv, and the chain n-1
    dependent hops for the scans."""
    n, a, c = net.n, net.alpha, net.chunk
    if n <= 1:
        return 0.0
    if coll in ("gather", "scatter", "gatherv", "scatterv"):
        b = net.hbw[net.hidx[net.host_of[root]]] if net.hbw else net.intra
        return volume((n - 1) * nbytes, b, 1, a)
    bmin = min(net.hbw) if net.hbw else net.intra
    if coll in ("allgatherv", "reduce_scatter"):
        b = min(net.ring_bw, net.ring_host_bw())
        return max(chain(n - 1, nbytes, b, a, c), volume((n - 1) * nbytes, b, n - 1, a))
    if coll == "alltoallv":
        return volume((n - 1) * nbytes, bmin, n - 1, a)
    return chain(n - 1, nbytes * (2 if coll == "exscan" else 1), bmin, a, c)


def _contiguous(sizes):
    out, at = [], 0
    for c in sizes:
        out.append(at)
        at += c
    return tuple(out)


def _layouts(coll, rank, n, layout, root):
    """Every rank's layout (as far as a relay needs: the sizes; others' offsets made up), or
    None where this rank's layout does not hold every size (a Gatherv, Scatterv or Alltoallv
    whose caller did not learn them)."""
    if coll in SHARED:
        return [layout] * n
    if coll in ("gatherv", "scatterv"):
        sizes = layout[0] if rank == root else (layout[1] if len(layout) > 1 else None)
        if sizes is None:
            return None
        return [(tuple(sizes), _contiguous(sizes)) if r == root else (sizes[r],)
                for r in range(n)]
    if len(layout) < 5:
        return None
    rows = layout[4]
    out = []
    for j in range(n):
        col = tuple(rows[i][j] for i in range(n))
        out.append((tuple(rows[j]), _contiguous(rows[j]), col, _contiguous(col)))
    return out


def needs_sizes(coll):
    """Whether a relayed `coll` needs sizes its caller may not hold (vcoll.py learns them)."""
    return coll not in SHARED


def build(coll, rank, n, layout, root, eager, separate, state=None, topo=None):
    """This rank's schedule of `coll` (one of KINDS) for its `layout`, priced (.cost) where a
    RailState or a Topology is given. Under a state with a pair that has no working rail, it is
    relayed around that pair (routing.relay over every rank's schedule): for Gatherv, Scatterv
    and Alltoallv the layout must then hold every rank's sizes (vcoll.py gathers them first
    under such a state), else R2commNetworkError (on every rank alike: the state is the same)."""
    if state is not None and state.has_broken_pairs():
        every = _layouts(coll, rank, n, layout, root)
        if every is None:
            raise R2commNetworkError(
                f"{NAMES[coll]}: some ranks share no working rail, and this rank does not know "
                f"every size of the {NAMES[coll]} to relay it (the rail state changed at this "
                "call); call it again")
        every[rank] = layout
        s = relay([_one(coll, r, n, every[r], root, eager, separate) for r in range(n)],
                  state)[rank]
    else:
        s = _one(coll, rank, n, layout, root, eager, separate)
    net = None
    if state is not None:
        net = Net.from_state(state)
    elif topo is not None and topo.n == n:
        net = Net.from_topology(topo, DEFAULT_BW, INTRA_BW, DEFAULT_ALPHA, DEFAULT_CHUNK)
    if net is not None:
        s.cost = price(coll, net, _mean_bytes(layout), root)
    return s.validate()


def build_all(coll, n, layouts, root=0, eager=0, separate=True):
    """Every rank's schedule (layouts: one per rank), for tests and the simulator."""
    return [_one(coll, r, n, layouts[r], root, eager, separate).validate() for r in range(n)]
