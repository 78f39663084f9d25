"""Tree-fold AllReduce: a degraded-server schedule whose pipeline depth grows like log(H).

The degraded schedule (degraded.py) folds the slow ranks into a ring of the healthy ranks: the
slow rank streams a block to each of the m healthy ranks at once, each at 1/m of its rate, so
nothing returns before it has sent everything, and the result comes back late: replay/T* =
1 + m·c/N (c the chunk), 2.0 at 512 hosts. Here the m healthy ranks (in `order_ok`, indices
0..m-1) form two binary trees, each carrying half of the buffer:

  tree 0   the in-order binary tree over positions = indices: position 0 is the root and has
           a single child (the largest power of two below m); position p >= 1 with lowest set
           bit l has the children p - l/2 and the first of p + l/2, p + l/4, ... below m; odd
           positions are leaves.
  tree 1   the same tree over other positions: index i at (a·i + 1) mod m for the smallest odd
           a coprime to m that puts every interior rank of tree 0 on a leaf of tree 1 and
           shares no pair of ranks with tree 0 (second_tree). Sharing no pair matters: the
           engine sends one pair's messages in one queue, so two trees over one pair serialise
           (the rotation or reversal of NCCL's double tree shares about m/4 pairs, and replays at
           1.11-1.26 x the bound instead of 1.01). Odd m: the trees over the first m - 1 ranks,
           with the last one inserted between each root and its single child.
  fold     every degraded rank sends its half to each tree's root, which reduces it in after its
           child (ascending rank) and returns the result to it while it goes down the tree.

So every healthy rank sends and receives at most 4 half-buffers (2N), a root 3 (1.5N: the
link to a degraded host may use fewer rails, so the root's other traffic must leave room), a
degraded rank N. In each tree the partial sums flow up (a rank reduces its children in, left
then right, and sends the sum up) and the result flows down, chunk-pipelined by the engine's
chunk-level dependencies: a chunk crosses about 2·log2(m) + 2 hops, and there are 4(m - 1) + 4k
messages in all (2,044 at 512 hosts against the degraded schedule's 522,242). Each element is
reduced by one fixed expression tree, then only copied: every rank holds identical bits.

frac > 0 puts that fraction of the buffer on a ring over every rank, concurrently (as in
degraded.py); the planner uses frac = 0: in the replay the ring and the trees slow each other
down (1.09-1.15 x T* with one NIC at 7/8, against 1.07-1.15 for the trees alone).

treefold_time() is the closed form: the busiest NIC's bytes over its rate plus the trees'
pipeline fill."""
import functools
import itertools
import math

from .algorithms import blocks
from .degraded import slow_and_healthy, split_fraction, volumes
from .routing import ring_region
from .schedule import Schedule, WORK, COPY, REDUCE

FILL_CHUNKS = 1.0           # pipeline fill per tree hop, in chunk times at a healthy NIC's rate
HIDDEN_LATENCIES = 3        # of the fill's 2·depth + 2 hops' latencies, the replay overlaps this
                            # many (replay with α = 25 µs minus with α = 0: 2·depth - 1 α at 8-64
                            # hosts, 8-256 MiB, a NIC down or at 1/2 or 7/8; bench/SIM.md)
MIN_HEALTHY = 4             # offered() from this many healthy ranks on
PREFER_MARGIN = 0.02        # preferred() when its closed form is this much below the degraded's


# ---------------------------------------------------------------------------------------------
# the trees (positions 0..m-1)
def _lowbit(p):
    return p & -p


def tree_children(p, m):
    """Children of position p in the in-order binary tree over m positions (left first)."""
    if p == 0:
        if m <= 1:
            return []
        top = 1
        while top * 2 <= m - 1:
            top *= 2
        return [top]
    low = _lowbit(p)
    out = []
    if low >= 2:
        out.append(p - low // 2)
        half = low // 2
        while half and p + half >= m:
            half //= 2
        if half:
            out.append(p + half)
    return out


def tree_parent(p, m):
    """Parent position of p (None for the root, position 0): p + l when p is a left child
    (p / l = 1 mod 4, l its lowest set bit, and p + l < m), else p - l."""
    if p == 0:
        return None
    low = _lowbit(p)
    if (p // low) % 4 == 1 and p + low < m:
        return p + low
    return p - low


def tree_depth(m):
    """Edges on the longest root-to-leaf path of the tree over m positions."""
    depth = 0
    for p in range(m):
        d, q = 0, p
        while q:
            q = tree_parent(q, m)
            d += 1
        depth = max(depth, d)
    return depth


def _pairs(m, pos):
    """Unordered (child, parent) index pairs of the in-order tree with index i at pos[i]."""
    inv = {p: i for i, p in enumerate(pos)}
    return {frozenset((i, inv[tree_parent(pos[i], m)])) for i in range(m) if pos[i]}


def _fits(m, pos):
    """pos puts every interior rank of tree 0 on a leaf of tree 1 (at most 4 messages each
    way per rank) and shares no pair of ranks with tree 0."""
    if any(len(tree_children(i, m)) + len(tree_children(pos[i], m)) > 2 for i in range(m)):
        return False
    return not _pairs(m, list(range(m))) & _pairs(m, pos)


def _parents(m):
    """tree_parent(p, m) of every position p as an array (-1 for the root), in O(m) numpy."""
    import numpy as np
    p = np.arange(m, dtype=np.int64)
    low = p & -p
    low[0] = 1
    left = ((p // low) % 4 == 1) & (p + low < m)
    par = np.where(left, p + low, p - low)
    par[0] = -1
    return par


def _fits_fast(m, pos, par, kids):
    """_fits(m, pos) on arrays: pos (numpy), par = _parents(m), kids = children per position."""
    import numpy as np
    if (kids + kids[pos] > 2).any():
        return False
    inv = np.empty(m, dtype=np.int64)
    inv[pos] = np.arange(m)
    i1 = np.nonzero(pos)[0]                     # tree 1's pairs (i1, j1); tree 0's: (p, par[p])
    j1 = inv[par[pos[i1]]]
    return not ((par[i1] == j1) | (par[j1] == i1)).any()


@functools.lru_cache(maxsize=64)
def second_tree(m):
    """Positions in tree 1 of the indices 0..m-1 (m even): i -> (a·i + 1) mod m for the
    smallest odd a coprime to m that fits (_fits); an exhaustive search below 8 ranks; the
    rotation by one (NCCL's shift) where nothing fits (m = 2)."""
    if m < 8:
        for pos in itertools.permutations(range(m)):
            if pos[0] and _fits(m, pos):
                return tuple(pos)
    else:                           # the same test as _fits, on arrays: O(m) numpy per a
        import numpy as np
        par = _parents(m)
        kids = np.bincount(par[1:], minlength=m)
        idx = np.arange(m, dtype=np.int64)
        for a in range(3, m, 2):
            if math.gcd(a, m) == 1:
                pos = (a * idx + 1) % m
                if _fits_fast(m, pos, par, kids):
                    return tuple(pos.tolist())
    return tuple((i + 1) % m for i in range(m))


@functools.lru_cache(maxsize=64)
def _inverse(m):
    pos = second_tree(m)
    inv = [0] * m
    for i, p in enumerate(pos):
        inv[p] = i
    return tuple(inv)


def tree_links(t, i, m):
    """(parent index or None, child indices) of index i of the healthy order in tree t.
    Even m: tree 0 over positions = indices, tree 1 over second_tree(m). Odd m: the same over
    the first m - 1 indices, and index m - 1 inserted between each root and its single child
    (two messages each way in each tree, so again at most 4)."""
    if m <= 1:
        return None, []
    me = m - 1 if m % 2 else m               # ranks in the even trees
    if i == me:                              # the inserted rank (odd m)
        return (_index(t, 0, me), [_index(t, c, me) for c in tree_children(0, me)])
    p = _position(t, i, me)
    kids = [_index(t, c, me) for c in tree_children(p, me)]
    par = tree_parent(p, me)
    par = None if par is None else _index(t, par, me)
    if me < m:
        if p == 0:
            kids = [me]
        elif par == _index(t, 0, me):
            par = me
    return par, kids


def _position(t, i, me):
    return i if t == 0 else second_tree(me)[i]


def _index(t, p, me):
    return p if t == 0 else _inverse(me)[p]


def tree_root(t, m):
    """Index of tree t's root."""
    me = m - 1 if m % 2 else m
    return _index(t, 0, me) if me else 0


def degrees(m, k=1):
    """Messages each way of every healthy index (both trees), k degraded ranks at the roots."""
    me = m - 1 if m % 2 else m
    if me >= 8:                     # on arrays (the index inserted for odd m: 2 each tree)
        import numpy as np
        par = _parents(me)
        kids = np.bincount(par[1:], minlength=me)
        pos = np.array(second_tree(me), dtype=np.int64)
        ups = np.where(np.arange(me) == 0, k, 1) + np.where(pos == 0, k, 1)
        return (kids + kids[pos] + ups).tolist() + ([4] if me < m else [])
    out = []
    for i in range(m):
        d = 0
        for t in (0, 1):
            par, kids = tree_links(t, i, m)
            d += len(kids) + (1 if par is not None else k)
        out.append(d)
    return out


def tree_depth_links(m):
    """Edges on the longest root-to-leaf path of either tree (index space)."""
    depth = 0
    for t in (0, 1):
        for i in range(m):
            d, q = 0, i
            while True:
                q = tree_links(t, q, m)[0]
                if q is None:
                    break
                d += 1
            depth = max(depth, d)
    return depth


# ---------------------------------------------------------------------------------------------
# loads, fraction, closed form
@functools.lru_cache(maxsize=256)
def max_degree(m, k=1):
    """The most messages each way any healthy rank has (both trees), k degraded ranks at the
    roots (4 for m >= 3 and k = 1)."""
    return max(degrees(m, k)) if m else 0


def loads(n, k, x):
    """(V_d, V_h): bytes per buffer byte through a degraded / the busiest healthy rank's NIC,
    each way, with fraction x on the full ring and 1 - x folded into the trees."""
    a = 2.0 * (n - 1) / n
    w = max_degree(n - k, k) / 2.0
    return a * x + (1 - x), a * x + w * (1 - x)


def treefold_time(n, nbytes, b_deg, b_ok, k=1, chunk=512 << 10, alpha=0.0, frac=0.0):
    """Closed-form seconds of the tree fold on n ranks, k of them degraded at b_deg bytes/s,
    the others at b_ok: the busiest NIC's bytes over its rate, plus the trees' pipeline fill
    (2·depth + 2 hops, each a chunk at a healthy NIC's rate, and a latency for all but
    HIDDEN_LATENCIES of them) and, with a ring part, its 2(n-1) latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = n - k
    vd, vh = loads(n, k, frac)
    bw = max(vd * nbytes / b_deg, vh * nbytes / b_ok)
    hops = 2 * tree_depth_fast(m) + 2
    c = min(chunk, nbytes * (1 - frac) / 2)
    fill = hops * FILL_CHUNKS * c / b_ok + max(0, hops - HIDDEN_LATENCIES) * alpha \
        if frac < 1 else 0.0
    ring = 2 * (n - 1) * alpha if frac > 0 else 0.0
    return bw + max(fill, ring)


def tree_depth_fast(m):
    """tree_depth_links(m) in O(log m): the root's single edge plus the in-order tree under it
    (plus the rank inserted below the roots for odd m)."""
    if m <= 1:
        return 0
    me = m - 1 if m % 2 else m
    return (me - 1).bit_length() + (me < m)


def offered(n, k):
    """Whether the tree fold applies: k degraded ranks of n, and at least MIN_HEALTHY healthy
    ones (with 3, the two trees must share a pair of ranks, whose messages then queue behind
    each other on one connection: 1.38 T* in the replay at 4 hosts, against 1.006 for the
    degraded schedule)."""
    return 0 < k and n - k >= MIN_HEALTHY


def degraded_time(n, nbytes, b_deg, b_ok, k=1, chunk=512 << 10, alpha=0.0):
    """Closed-form seconds of the degraded schedule (degraded.py): its bandwidth time at its
    best split, times 1 + m·c/N (m healthy ranks, c the chunk), the stall of its fold, which
    the replay shows exactly (bench/SIM.md), plus a latency per hop of its 2m-hop chain."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    vd, vh = volumes(split_fraction(n, k, b_deg, b_ok), n, k)
    return nbytes * max(vd / b_deg, vh / b_ok) * (1 + (n - k) * chunk / nbytes) + \
        2 * (n - k) * alpha


def preferred(n, k, nbytes, b_deg, b_ok, chunk=512 << 10, alpha=0.0):
    """The tree fold instead of the degraded schedule: offered() and a closed form at least
    PREFER_MARGIN below the degraded schedule's (where they are close, the plan stays as
    before: both replay within a few percent of T* there)."""
    return offered(n, k) and treefold_time(n, nbytes, b_deg, b_ok, k, chunk, alpha) < \
        degraded_time(n, nbytes, b_deg, b_ok, k, chunk, alpha) * (1 - PREFER_MARGIN)


def state_preferred(state, nbytes):
    """preferred() for a RailState: the slowest degraded rank against the median healthy one
    (as degraded.state_fraction), the state's chunk and alpha."""
    deg, ok = slow_and_healthy(state.n, state)
    if not deg or not ok:
        return False
    bw_ok = sorted(state.rank_bw(r) for r in ok)
    return preferred(state.n, len(deg), nbytes, min(state.rank_bw(r) for r in deg),
                     bw_ok[(len(bw_ok) - 1) // 2], state.chunk, state.alpha)


# ---------------------------------------------------------------------------------------------
# the schedule
def _tree_region(s, order_ok, deg, me, t, off, ln, step, own):
    """Messages of this rank (healthy or degraded) for tree t over WORK[off:off+ln]; returns
    (the send up or None, whether this rank is a leaf of tree t)."""
    m = len(order_ok)
    if me in deg:
        root = order_ok[tree_root(t, m)]
        si = s.send(root, step, WORK, off, ln, owned=own)
        ri = s.recv(root, step + 1, WORK, off, ln, COPY)
        s.dep(si, ri)               # never overwrite what is still being sent
        return None, False
    par, kids = tree_links(t, order_ok.index(me), m)
    kids = [order_ok[c] for c in kids]
    prev = None
    for c in kids:                  # fixed order: left child, then right child
        ri = s.recv(c, step, WORK, off, ln, REDUCE)
        s.dep(prev, ri)
        prev = ri
    si = None
    if par is None:
        for d in deg:               # the root folds the degraded ranks in, ascending rank
            ri = s.recv(d, step, WORK, off, ln, REDUCE)
            s.dep(prev, ri)
            prev = ri
        outs = deg + kids
    else:
        parent = order_ok[par]
        si = s.send(parent, step, WORK, off, ln, owned=own)
        s.dep(prev, si)
        prev = s.recv(parent, step + 1, WORK, off, ln, COPY)
        s.dep(si, prev)             # the result overwrites the partial sum once it left
        outs = kids
    for c in outs:
        s.dep(prev, s.send(c, step + 1, WORK, off, ln, owned=own))
    return si, not kids and par is not None


def allreduce_treefold(rank, n, nbytes, itemsize, eager, state=None, frac=None, degraded=None,
                       order_all=None, order_ok=None, algo="treefold"):
    """This rank's schedule. degraded: the slow ranks (default state.degraded_ranks()); frac:
    the fraction of the buffer on a ring over every rank (default 0);
    order_all: the ring order over all ranks; order_ok: the healthy ranks' order (tree
    positions; default ascending)."""
    s = Schedule(algo)
    if n == 1:
        return s
    deg, ok = slow_and_healthy(n, state, degraded)
    if not deg or not ok:
        frac = 1.0
    elif frac is None:
        frac = 0.0
    if order_all is None:
        order_all = list(range(n))
    if order_ok is None:
        order_ok = ok
    count = nbytes // itemsize
    ca = min(count, max(0, int(round(frac * count))))
    if ca:                                              # part A: the full ring
        ring_region(s, order_all, rank, 0, ca, itemsize, step0=0, own=ca * itemsize // n <= eager)
    cb = count - ca
    if not cb:
        return s
    step0 = 2 * n
    for t, (o, ln) in enumerate(blocks(cb, 2, itemsize)):
        if ln:
            _tree_region(s, order_ok, deg, rank, t, ca * itemsize + o, ln, step0 + 2 * t,
                         ln <= eager)
    return s

