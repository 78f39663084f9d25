"""Degraded-server AllReduce: keep a slow host (bandwidth βB, β < 1) off the critical path.

The buffer is split at element granularity into
  part A (fraction x): a ring allreduce over every rank (2(n-1)/n of it crosses each NIC);
  part B (1 - x):      a ring allreduce among the healthy ranks H only, into which each
                       degraded rank d folds its contribution: d sends block j of part B to the
                       healthy rank that finishes block j of the healthy ring (which reduces it in
                       after its own ring contributions, in a fixed order of d), and gets the
                       final block j back from it. Both exchanges are chunk-pipelined.
Parts A and B run concurrently. Every element is reduced by exactly one chain (ring order, then
the degraded ranks in ascending rank order) and then only copied, so every rank holds identical
bits, and the order never depends on arrival times.

Bytes per element of the buffer crossing a NIC in each direction, with a = 2(n-1)/n, m = |H|,
k = |D| (degraded ranks), c = (2(m-1) + k)/m:
    degraded rank:  V_d(x) = a·x + (1 - x)
    healthy rank:   V_h(x) = a·x + c·(1 - x)
so the time is N·max(V_d(x)/b_d, V_h(x)/b_h) (b_d, b_h: the slowest degraded / healthy rank's
bandwidth). split_fraction() minimises that over x in [0, 1]: x = 1 (plain ring) when healthy,
x -> 0 as β -> 0, where the time approaches N/(βB), the lower bound's 1/β term."""
from .routing import ring_region, owner_block, best_ring_order
from .schedule import Schedule, WORK, COPY, REDUCE


def volumes(x, n, k):
    """(V_d, V_h): bytes per buffer byte through a degraded / healthy rank's NIC, each way."""
    m = n - k
    a = 2.0 * (n - 1) / n
    c = (2.0 * (m - 1) + k) / m
    return a * x + (1 - x), a * x + c * (1 - x)


def split_fraction(n, k, b_deg, b_ok):
    """Fraction x of the buffer that goes round the full ring, minimising
    max(V_d(x)/b_deg, V_h(x)/b_ok) (both linear in x: the optimum is an end point or the point
    where the degraded and the healthy ranks finish together)."""
    if k <= 0 or k >= n or n <= 2 or b_deg >= b_ok:
        return 1.0
    if b_deg <= 0:
        return 0.0

    def t(x):
        vd, vh = volumes(x, n, k)
        return max(vd / b_deg, vh / b_ok)
    cands = [0.0, 1.0]
    vd0, vh0 = volumes(0.0, n, k)
    vd1, vh1 = volumes(1.0, n, k)
    g0, g1 = vd0 / b_deg - vh0 / b_ok, vd1 / b_deg - vh1 / b_ok
    if g0 != g1:
        x = g0 / (g0 - g1)
        if 0.0 < x < 1.0:
            cands.append(x)
    best = min(t(x) for x in cands)
    return max(x for x in cands if t(x) <= best * (1 + 1e-12))   # ties: closer to the ring


def state_fraction(state, n=None):
    """split_fraction() for a RailState's degraded ranks and bandwidths: the slowest degraded
    rank against the median healthy one. Healthy ranks differ only within the state's noise
    tolerance (more would make them degraded), and measured rates under-read a NIC that the
    last operations did not keep busy; the minimum of them, used before, once made a healthy
    host of the testbed look 20% slow, which moved 40% of the buffer onto the degraded host's
    full ring and cost 1.42x T* instead of 1.06x."""
    n = state.n if n is None else n
    deg = state.degraded_ranks()
    ok = [r for r in range(n) if r not in deg]
    if not deg or not ok:
        return 1.0
    bw_ok = sorted(state.rank_bw(r) for r in ok)
    return split_fraction(n, len(deg), min(state.rank_bw(r) for r in deg),
                          bw_ok[(len(bw_ok) - 1) // 2])


def slow_and_healthy(n, state=None, degraded=None):
    """(the slow ranks, sorted: `degraded`, or the state's degraded ranks; the other ranks)."""
    if degraded is None:
        degraded = state.degraded_ranks() if state is not None else []
    deg = sorted(set(degraded))
    return deg, [r for r in range(n) if r not in deg]


def allreduce_degraded(rank, n, nbytes, itemsize, eager, state=None, frac=None, degraded=None,
                       order_all=None, order_ok=None, algo="degraded"):
    """This rank's schedule. degraded: the slow ranks (default state.degraded_ranks()); frac: the
    full-ring fraction (default from the state's bandwidths); order_all / order_ok: ring orders
    over all ranks / the healthy ranks (default: re-ranked around broken pairs by the state)."""
    s = Schedule(algo)
    if n == 1:
        return s
    deg, ok = slow_and_healthy(n, state, degraded)
    if frac is None:
        frac = state_fraction(state, n) if state is not None and deg and ok else 1.0
    if not deg or not ok:
        frac = 1.0
    if order_all is None:
        order_all = best_ring_order(state) if state is not None else list(range(n))
    if order_ok is None and ok:
        order_ok = best_ring_order(state, ok) if state is not None else ok
    count = nbytes // itemsize
    ca = min(count, max(0, int(round(frac * count))))
    cb = count - ca
    if ca:                                              # part A: the full ring
        own = ca * itemsize // n <= eager
        ring_region(s, order_all, rank, 0, ca, itemsize, step0=0, own=own)
    if not cb:
        return s
    m = len(order_ok)
    boff = ca * itemsize
    sb = 2 * n                                          # steps of the healthy ring
    sf = 4 * n                                          # steps of the degraded exchange
    own = cb * itemsize // m <= eager
    if rank in ok:
        def fold(s, prev, off, ln):
            for d in deg:                               # fixed order: ascending rank
                ri = s.recv(d, sf, WORK, off, ln, REDUCE)
                s.dep(prev, ri)
                prev = ri
            for d in deg:
                si = s.send(d, sf + 1, WORK, off, ln, owned=own)
                s.dep(prev, si)
            return prev
        ring_region(s, order_ok, rank, boff, cb, itemsize, step0=sb, own=own, fold=fold)
    else:
        from .algorithms import blocks
        blk = [(boff + o, ln) for o, ln in blocks(cb, m, itemsize)]
        for h in order_ok:
            off, ln = blk[owner_block(order_ok, h)]
            si = s.send(h, sf, WORK, off, ln, owned=own)
            ri = s.recv(h, sf + 1, WORK, off, ln, COPY)
            s.dep(si, ri)          # never overwrite what is still being sent
    return s
