"""Closed-form α-β prices of the allreduce candidates (and, collective(), of the other
collectives' flat and hierarchical plans), from a host-level summary of the rails.

choose() (planner/__init__.py) prices every candidate here instead of building every rank's
schedule and running cost.py's message-level model over them: a price costs O(H) or less once
the summary (Net) is made, and Net is made once per rail state (or topology) in O(n), with no
pair loop. cost.py stays the reference: tests/test_planner_scale.py checks that both pick the
same algorithm on small cases, with costs within a few percent, and that the choice is within
3% of the best candidate in the simulator's replay (r2comm/sim).

Every price is max(chain, volume) where, for h dependent hops of messages of m bytes over a
bottleneck bandwidth b, with α per message and the engine's chunk c:
    chain  = h·(α + min(c, m)/b) + max(m - c, 0)/b     (the first chunk walks every hop,
                                                         the rest streams behind it)
    volume = V/B + h·α                                   (the busiest NIC or link's bytes)

Adding a candidate (as the degraded-server tree fold, below): write `price(net, nbytes)` -> seconds
and `build(rank, net, nbytes, itemsize, eager)` -> Schedule, and register it:
    price.register(price.Candidate("tree_fold", applies, price_fn, build_fn))
`applies(coll, net)` says when it is offered. choose() then compares it with the others,
planner.build() builds it for one rank when it wins, and R2COMM_ALGO may force it by name
(planner.allreduce_algos() lists the registered names): nothing else to change."""
import functools
import math
from dataclasses import dataclass
from typing import Callable

from .overlap import hides_latency

INF = math.inf


class Net:
    """Host-level summary of a RailState (or of a Topology's default state): what the closed
    forms need, made in O(n) without looking at pairs of hosts."""

    def __init__(self, host_of, hbw, intra_bw, alpha, chunk, state=None, ring_bw=None,
                 degraded=(), rank_bw=None, hosts=None):
        self.host_of = list(host_of)
        self.n = len(self.host_of)
        if hosts is None:                              # {host label: its ranks}
            hosts = {}
            for r, h in enumerate(self.host_of):
                hosts.setdefault(h, []).append(r)
        self.hosts = list(hosts.values())             # ranks of each host, in order of first rank
        self.hidx = {h: i for i, h in enumerate(hosts)}
        self.H = len(self.hosts)
        self.S = max((len(rs) for rs in self.hosts), default=1)
        self.hbw = list(hbw)                           # NIC bandwidth of every host (index order)
        self.intra = float(intra_bw)
        self.alpha, self.chunk = float(alpha), int(chunk)
        self.state = state
        self.degraded = list(degraded)                 # slow ranks (RailState.degraded_ranks)
        self.rank_bw = rank_bw
        self.ring_bw = ring_bw if ring_bw is not None else self._ring_bw()
        self._levels = {}

    @classmethod
    def from_topology(cls, topo, nic_bw, intra_bw, alpha, chunk):
        k = max(1, min(topo.rails) if topo.rails else 1)
        return cls(topo.host_of, [k * nic_bw] * topo.nhosts, intra_bw, alpha, chunk)

    @classmethod
    def from_state(cls, state):
        """The summary of a RailState: host NIC figures (host_bw), the ranks' local pair
        bandwidth, the identity ring's slowest link."""
        hl = state.host_list()
        hbw = [state.host_bw(h) for h in hl]
        hosts = {h: state.host_ranks(h) for h in hl}
        intra = INF
        for rs in hosts.values():
            if len(rs) > 1:
                intra = min(intra, state.pair_bw(rs[0], rs[1]))
        ring = _ring_bw(state)
        return cls(state.hosts, hbw, intra if intra < INF else 0.0, state.alpha, state.chunk,
                   state, ring, state.degraded_ranks(), state.rank_bw, hosts)

    def degraded_split(self):
        """(full-ring fraction, slowest degraded rank's bandwidth, median healthy rank's) of
        degraded.py's split, computed once."""
        if getattr(self, "_split", None) is None:
            from .degraded import split_fraction
            bad = set(self.degraded)
            per_host = [(self.rank_bw(rs[0]), len(rs)) for rs in self.hosts]   # per host
            bad_hosts = {self.hidx[self.host_of[r]] for r in bad}
            b_d = min(per_host[i][0] for i in bad_hosts)
            ok = sorted(per_host[i] for i in range(self.H) if i not in bad_hosts)
            mid, b_ok = (sum(c for _, c in ok) - 1) // 2, None    # the median healthy rank's
            for v, c in ok:
                if mid < c:
                    b_ok = v
                    break
                mid -= c
            self._split = (split_fraction(self.n, len(bad), b_d, b_ok), b_d, b_ok)
        return self._split

    def rail_penalty(self):
        """direct.rail_penalty() of the state, computed once: how much longer a healthy rank's
        traffic with a slow rank keeps its busiest rail than its NICs' share (0 healthy)."""
        if getattr(self, "_rail_pen", None) is None:
            from .direct import rail_penalty
            bad = set(self.degraded)
            ok = next(([r] for r in range(self.n) if r not in bad), [])
            self._rail_pen = rail_penalty(self.state, ok, sorted(bad)) \
                if self.state is not None else 0.0
        return self._rail_pen

    # -- helpers ---------------------------------------------------------------------------------
    def bw_of(self, r):
        """Bandwidth of rank r towards another host: its host's NICs shared by its ranks."""
        i = self.hidx[self.host_of[r]]
        return self.hbw[i] / len(self.hosts[i])

    def link(self, a, b):
        """Bandwidth between ranks a and b as the closed forms see it."""
        if self.state is not None:
            return self.state.pair_bw(a, b)
        if self.host_of[a] == self.host_of[b]:
            return self.intra
        return min(self.hbw[self.hidx[self.host_of[a]]], self.hbw[self.hidx[self.host_of[b]]])

    def _ring_bw(self):
        n = self.n
        if n <= 1:
            return INF
        return min(self.link(r, (r + 1) % n) for r in range(n))

    def ring_host_bw(self):
        """Bandwidth a flat ring's busiest host NIC gives one ring edge: hbw over the ring
        edges leaving the host (1 when its ranks are consecutive)."""
        out = [0] * self.H
        for r in range(self.n):
            p = (r + 1) % self.n
            if self.host_of[r] != self.host_of[p]:
                out[self.hidx[self.host_of[r]]] += 1
        return min((self.hbw[i] / c for i, c in enumerate(out) if c), default=INF)

    def ring_figures(self, order):
        """(the bottleneck bytes/s of a ring in `order`: its slowest edge, or a host's NICs
        shared by the ring edges leaving it; the number of its edges between hosts)."""
        n = len(order)
        out = [0] * self.H
        b = INF
        for i in range(n):
            r, p = order[i], order[(i + 1) % n]
            b = min(b, self.link(r, p))
            if self.host_of[r] != self.host_of[p]:
                out[self.hidx[self.host_of[r]]] += 1
        b = min(b, min((self.hbw[i] / c for i, c in enumerate(out) if c), default=INF))
        return b, sum(out)

    def host_index_array(self):
        """The host index of every rank, as a numpy array (made once)."""
        if getattr(self, "_hi_arr", None) is None:
            import numpy as np
            self._hi_arr = np.array([self.hidx[h] for h in self.host_of], dtype=np.int64)
        return self._hi_arr

    def rd_levels(self, members=None):
        """[(bottleneck bytes/s of one rank's message)] per recursive-doubling level over the
        largest power of two: the host whose ranks send the most over its NICs at that level."""
        n = self.n
        if n in self._levels:
            return self._levels[n]
        import numpy as np
        p2 = 1 << (n.bit_length() - 1)
        hi = np.array([self.hidx[h] for h in self.host_of[:p2]])
        hbw = np.array(self.hbw, dtype=float)
        idx = np.arange(p2)
        out, d = [], 1
        while d < p2:
            cross = hi != hi[idx ^ d]
            if cross.any():
                cnt = np.bincount(hi[cross], minlength=self.H)
                used = cnt > 0
                b = float((hbw[used] / cnt[used]).min())
                b = min([b] + [x for x in (self.link(r, r ^ d) for r in (0, p2 - 1)) if x > 0])
            else:
                b = self.intra if self.intra > 0 else INF
            out.append(b)
            d *= 2
        self._levels[n] = out
        return out


def _ring_bw(state):
    """The slowest working pair of the ring in rank order (a broken one is relayed). On a state
    held per host and NIC (host_indices()) the pairs between hosts are figured on arrays from
    their NICs, and only the pairs with an exception and one pair inside a host are asked: the
    others answer alike."""
    n = state.n
    if n <= 1:
        return INF
    hi = state.host_indices() if hasattr(state, "host_indices") else None
    if hi is None:
        ask = range(n)
    else:                           # the pairs between hosts on arrays, host pair by pair
        import numpy as np
        h = np.array(hi)
        nxt = np.roll(h, -1)
        odd = {a if b == a + 1 else b for (a, b, _k) in state.exceptions
               if b == a + 1 or (a, b) == (0, n - 1)}          # ring pairs with an exception
        cut = np.array([r for r in np.nonzero(h != nxt)[0].tolist() if r not in odd], dtype=int)
        nic = np.array(state.nic, dtype=float)
        x, y = nic[h[cut]], nic[nxt[cut]]
        bws = np.where((x > 0) & (y > 0), np.minimum(x, y), 0.0).sum(axis=1).tolist()
        ask = sorted(odd) + np.nonzero(h == nxt)[0][:1].tolist()
        return min((v for v in bws + [state.pair_bw(r, (r + 1) % n) for r in ask] if v > 0),
                   default=0.0)
    return min((v for v in (state.pair_bw(r, (r + 1) % n) for r in ask) if v > 0), default=0.0)


def chain(hops, m, b, alpha, c):
    """Seconds for the first chunk of m bytes to walk `hops` hops at b, the rest behind it."""
    if hops <= 0 or m <= 0:
        return hops * alpha
    if b <= 0:
        return INF
    return hops * (alpha + min(c, m) / b) + max(m - c, 0) / b


def volume(v, b, hops, alpha):
    return (v / b if b > 0 else INF) + hops * alpha


# -- the candidates' prices ---------------------------------------------------------------------
def ring(net, nbytes, order=None):
    """2(n-1) dependent steps of N/n bytes: max(chain, volume), the volume with every step's
    latency (a later step's chunks go ahead of an earlier step's tail), except where the
    steps hide them (ring_hides_latency()): the chain and the last acknowledgement.
    order: the ring's order of the ranks (ring_rerouted; default rank order)."""
    n = net.n
    if n <= 1:
        return 0.0
    h = 2 * (n - 1)
    m = nbytes / n
    if order is None:
        b = min(net.ring_bw, net.ring_host_bw())
        cross = min(h, 2 * (n - 1) * net.H // n) if 1 < net.H < n else h   # hops between hosts
    else:
        b, edges = net.ring_figures(order)
        cross = h if net.H == n else min(h, 2 * (n - 1) * edges // n)
    ch = chain(cross, m, b, net.alpha, net.chunk)
    if h > cross and net.intra > 0:
        ch += (h - cross) * (net.alpha + min(net.chunk, m) / net.intra)
    if ring_hides_latency(net, nbytes, b):
        return max(ch, 2 * (n - 1) / n * nbytes / b) + net.alpha
    return max(ch, volume(2 * (n - 1) / n * nbytes, b, h, net.alpha))


def ring_hides_latency(net, nbytes, b=None):
    """Whether ring()'s steps hide their latencies: a ring between hosts (no step inside a
    host, whose links the closed form does not time per step) whose steps are more than a
    chunk long (one chunk: chain and volume are equal) and short enough for hides_latency() on
    the slowest link (b: its bytes/s, default the rank-order ring's), fed by the fastest host's
    NICs (a slow host's link lags its neighbours'). The replay then takes the chain plus the
    last acknowledgement, exactly (3 hosts x 2 NICs, a NIC at 7/8, 2-8 MiB: 174.0 µs at 8 MiB
    against 224.0 with every latency; bench/SIM.md)."""
    n = net.n
    if n <= 1 or net.H != n or not net.hbw:
        return False
    m = nbytes / n
    if b is None:
        b = min(net.ring_bw, net.ring_host_bw())
    return m > net.chunk and hides_latency(m, b, net.alpha, net.chunk, max(net.hbw))


def recursive_doubling(net, nbytes):
    """Levels over the largest power of two (each moves the whole buffer over that level's
    bottleneck, chunk-pipelined from level to level); the ranks above it hand their input over
    first and get the result back (one more hop on the chain: the hand-over overlaps)."""
    n = net.n
    if n <= 1:
        return 0.0
    lv = net.rd_levels()
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    bs = list(lv)
    if rem and net.link(n - 1, n - 1 - p2) > 0:          # (a broken pair: relayed)
        bs.append(net.link(n - 1, n - 1 - p2))
    bmin = min(bs) if bs else INF
    c, a = net.chunk, net.alpha
    ch = sum(a + min(c, nbytes) / b for b in bs) + max(nbytes - c, 0) / bmin
    # levels inside a host use their own links, those between hosts share the NICs
    nic = sum(nbytes / b for b in bs if b != net.intra)
    local = max((nbytes / b for b in bs if b == net.intra), default=0.0)
    return max(ch, max(nic, local) + len(bs) * a)


def rabenseifner(net, nbytes):
    n = net.n
    if n <= 1 or n & (n - 1):
        return INF
    lv = net.rd_levels()              # lv[j]: pairs at distance 2^j
    L = len(lv)
    t = 0.0
    for k in range(L):                # halving level k (and its allgather mirror): distance
        t += 2 * (net.alpha + nbytes / (1 << (k + 1)) / lv[L - 1 - k])   # n/2^(k+1), N/2^(k+1)
    return t


def _hier_intra(net, nbytes):
    """(hops, seconds of bandwidth) of the intra-host ring reduce-scatter + allgather."""
    L = net.S
    if L <= 1:
        return 0, 0.0
    b = net.intra if net.intra > 0 else INF
    return 2 * (L - 1), 2 * (L - 1) / L * nbytes / b


def _intra_chain(net, hops, m):
    """Seconds the first chunk of m bytes spends on `hops` hops inside a host."""
    if hops <= 0:
        return 0.0
    return hops * (net.alpha + (min(net.chunk, m) / net.intra if net.intra > 0 else 0.0))


def hierarchical(net, nbytes):
    """Intra-host ring, a ring per slice between hosts (rail rings), intra-host ring."""
    H, S = net.H, net.S
    if H <= 1:
        return INF
    hi, ti = _hier_intra(net, nbytes)
    bmin = min(net.hbw)
    if net.state is not None:
        bmin = min(bmin, net.ring_bw * S)           # the ring's links between hosts
    hops = hi + 2 * (H - 1)
    m = nbytes / (S * H)
    v = 2 * (H - 1) / H * nbytes
    return max(chain(2 * (H - 1), m, bmin, net.alpha, net.chunk) + _intra_chain(net, hi, m),
               max(v / bmin, ti) + hops * net.alpha)


@functools.lru_cache(maxsize=64)
def tree_units(H):
    """Per tree position, the larger of (bytes in, bytes out) of both trees of the double
    binary tree (hierarchical.tree_allreduce), in units of half a slice."""
    def role(p):
        kids = sum(1 for c in (2 * p + 1, 2 * p + 2) if c < H)
        return kids + (1 if p else 0) if kids else 1
    return tuple(role(p) + role(H - 1 - p) for p in range(H))


def tree_depth(H):
    return max(0, (H).bit_length() - 1)


def hierarchical_tree(net, nbytes):
    """Intra-host ring, a double binary tree per slice between hosts, intra-host ring."""
    H, S = net.H, net.S
    if H <= 1:
        return INF
    hi, ti = _hier_intra(net, nbytes)
    units = tree_units(H)
    tv = max(u * nbytes / 2 / b if b > 0 else INF for u, b in zip(units, net.hbw))
    d = tree_depth(H)
    m = nbytes / (2 * S)
    b = min(net.hbw)                  # a chunk alone on the pair: the NICs' rate
    hops = hi + 2 * d
    return max(chain(2 * d, m, b, net.alpha, net.chunk) + _intra_chain(net, hi, m),
               max(tv, ti) + hops * net.alpha)


def degraded(net, nbytes):
    """degraded.py's split: part A a ring over all ranks, part B a ring among the healthy ranks
    with the slow ranks folded in; both run together. The fold stalls by m·c at the slow rank's
    rate (it streams its m blocks at once, nothing returns before the first chunk of every
    block arrived: 1 + m·c/N with x = 0, exact in the replay, bench/SIM.md); with a ring part
    the two parts slow each other down by fold_factor(x)."""
    from .degraded import volumes
    st, n = net.state, net.n
    deg = net.degraded
    k = len(deg)
    if st is None or not deg or k >= n or n <= 2:
        return INF
    m = n - k
    x, b_d, b_ok = net.degraded_split()
    vd, vh = volumes(x, n, k)
    vh += net.rail_penalty() * k * (1 - x) / m     # its fold's blocks to and from the slow ranks
    tv = nbytes * max(vd / b_d, vh / b_ok)
    if x < 1:                       # the fold's stall: a chunk of each of m blocks first
        tv += m * min(net.chunk, (1 - x) * nbytes / m) / b_d
    hops_a = 2 * (n - 1) if x > 0 else 0
    hops_b = 2 * (m - 1) + k + 1 if x < 1 else 0
    hops = max(hops_a, hops_b)
    ch = max(chain(hops_a, x * nbytes / n, b_d, net.alpha, net.chunk),
             chain(hops_b, (1 - x) * nbytes / m, b_d, net.alpha, net.chunk))
    return max(ch, fold_factor(x) * tv + latency_share(x) * hops * net.alpha)


def fold_factor(x):
    """How much longer the degraded schedule's bytes take than its α-β volume when a fraction
    0 < x < 1 of the buffer goes round the full ring beside the fold: the full ring moves in
    lockstep at the slow rank, whose NIC the fold's m streams share max-min fairly, so the
    healthy ranks idle at times; worst where both parts are large (small x)."""
    return 1.0 + FOLD_GAP * (1.0 - x) ** 0.8 if 0 < x < 1 else 1.0


def latency_share(x):
    """The share of its chain's per-message latencies the degraded schedule pays: its parts
    (the ring, the fold's m streams) fill each other's waits."""
    return LATENCY_SHARE_SPLIT if 0 < x < 1 else LATENCY_SHARE_FOLD


# Fitted (least squares) to the exact replay of 70 random points of hosts 3-24, NICs 2-8, loss
# 1/8-1 of one NIC, 8-256 MiB (sim/sweep.py's fabric): with a ring part this price is 0.88-1.28
# x the replay (rms 9%; the factor 1.25 on the whole price used before: about 0.84-1.55, rms
# 25%).
FOLD_GAP = 0.57
LATENCY_SHARE_SPLIT = 0.88
LATENCY_SHARE_FOLD = 0.5


def treefold(net, nbytes):
    """treefold.py's two binary trees over the healthy ranks, the slow ranks folded in at the
    roots: treefold_time() (the busiest NIC's bytes over its rate, plus 2·depth + 2 chunk
    times and 2·depth - 1 latencies of pipeline fill), the slowest degraded rank against the median
    healthy one as degraded_split() (the state's figures, not the split)."""
    from .treefold import treefold_time
    _, b_d, b_ok = net.degraded_split()
    k = len(net.degraded)
    t = treefold_time(net.n, nbytes, b_d, b_ok, k, net.chunk, net.alpha)
    return t * treefold_factor(net.n - k, b_d, b_ok)


def treefold_factor(m, b_d, b_ok):
    """The replay over the closed form with few healthy ranks and a partly slow one: the pair
    (root, slow rank) stripes its traffic over the rails in proportion to the slow rank's
    NICs, which loads the root's other rails beyond their share (bench/SIM.md: +11-25% at 5
    hosts, within 1% from 8 on)."""
    return 1.0 + TREEFOLD_SMALL_GAP if m < 7 and b_d > 0.55 * b_ok else 1.0


TREEFOLD_SMALL_GAP = 0.15


def _treefold_applies(coll, net):
    from .treefold import offered
    return coll == "allreduce" and net.state is not None and 0 < len(net.degraded) < net.n \
        and offered(net.n, len(net.degraded))


def _treefold_build(rank, net, nbytes, itemsize, eager):
    from .treefold import allreduce_treefold
    return allreduce_treefold(rank, net.n, nbytes, itemsize, eager, net.state,
                              degraded=net.degraded)


def direct(net, nbytes):
    """direct.py's weighted reduce-scatter + allgather between every pair: the busiest rank's
    busiest rail for the planned block sizes and the healthy pairs' rail weights
    (direct_time()), plus the slow rank's stall and the latencies."""
    from .direct import direct_time
    return direct_time(net.n, nbytes, net.rank_bw, sorted(net.degraded), net.state, net.chunk,
                       net.alpha)


def _direct_applies(coll, net):
    from .direct import MAX_RANKS
    return coll == "allreduce" and net.state is not None and 3 <= net.n <= MAX_RANKS and \
        net.H == net.n and 0 < len(net.degraded) < net.n and not net.state.has_broken_pairs()


def _direct_build(rank, net, nbytes, itemsize, eager):
    from .direct import allreduce_direct
    return allreduce_direct(rank, net.n, nbytes, itemsize, eager, net.state,
                            degraded=net.degraded)


@dataclass
class Candidate:
    """An allreduce algorithm choose() can pick: applies(coll, net) -> bool, price(net,
    nbytes) -> seconds, build(rank, net, nbytes, itemsize, eager) -> Schedule (None: the
    planner builds it by name)."""
    name: str
    applies: Callable
    price: Callable
    build: Callable = None


REGISTRY = {}


def register(cand):
    """Add (or replace) a candidate; choose() offers it wherever cand.applies(coll, net)."""
    REGISTRY[cand.name] = cand
    return cand


def _ar(coll, net):
    return coll == "allreduce"


def _hier(coll, net):
    return coll == "allreduce" and 1 < net.H < net.n and \
        (2 * (net.S - 1) + 2 * (net.H - 1)) * net.S * net.H < (1 << 23)   # its step numbers


def _hier_any(coll, net):
    return coll == "allreduce" and 1 < net.H < net.n


register(Candidate("ring", _ar, ring))
register(Candidate("recursive_doubling", _ar, recursive_doubling))
register(Candidate("hierarchical", _hier, hierarchical))
register(Candidate("hierarchical_tree", lambda c, net: _hier_any(c, net) and net.H >= 3,
                   hierarchical_tree))
register(Candidate("degraded", lambda c, net: _ar(c, net) and net.state is not None and
                   net.n > 2 and 0 < len(net.degraded) < net.n, degraded))
register(Candidate("treefold", _treefold_applies, treefold, _treefold_build))
register(Candidate("direct", _direct_applies, direct, _direct_build))


def prices(coll, net, nbytes, names=None):
    """{name: seconds} of the registered candidates that apply (in registration order)."""
    out = {}
    for name, c in REGISTRY.items():
        if (names is None or name in names) and c.applies(coll, net):
            out[name] = c.price(net, nbytes)
    return out


def cheapest(costs):
    """The first name whose price is within 1e-9 of the lowest (ties: the earlier one)."""
    best = min(costs.values())
    for a, c in costs.items():
        if c <= best * (1 + 1e-9):
            return a


# -- the other collectives, flat (static) plan against the hierarchical one --------------------
RS_OVERLAP = 0.75           # reduce_scatter_block, hierarchical: the shorter phase's share not
                            # hidden behind the longer one, times 1/sqrt(ranks per host) (fitted
                            # to the replay of 2-16 hosts x 2-8 ranks, bench/SIM.md)


def collective(coll, name, net, nbytes, root=0):
    """Closed-form seconds of `coll`'s static flat plan ("flat") or hierarchical plan; nbytes
    is the per-rank size (a block for allgather / reduce_scatter_block / alltoall)."""
    n, H, S, a, c = net.n, net.H, net.S, net.alpha, net.chunk
    if n <= 1:
        return 0.0
    intra = net.intra if net.intra > 0 else INF
    bmin = min(net.hbw) if net.hbw else INF
    if coll in ("allgather", "reduce_scatter_block"):
        if name != "hierarchical":
            b = min(net.ring_bw, net.ring_host_bw())
            return max(chain(n - 1, nbytes, b, a, c), volume((n - 1) * nbytes, b, n - 1, a))
        # the ring between hosts (S rings share each host's NICs) and the ring inside each
        # host run pipelined region by region: the longer phase plus the fill (allgather),
        # plus part of the shorter one for reduce_scatter (its rings between hosts wait for
        # the last step inside the host)
        t_inter = S * (H - 1) * nbytes / bmin if bmin > 0 else INF
        t_intra = (S - 1) * H * nbytes / intra
        m = min(c, nbytes)
        t = max(t_inter, t_intra) + (H + S - 2) * a + m / bmin + m / intra
        if coll == "reduce_scatter_block":
            t += RS_OVERLAP / math.sqrt(S) * min(t_inter, t_intra)
        return t
    if coll in ("bcast", "reduce"):                  # a tree, down (bcast) or up (reduce)
        out, inn, local, depth = _tree_loads(net, name, root)
        per_byte = max(max((max(out[i], inn[i]) / b if b > 0 else INF)
                           for i, b in enumerate(net.hbw) if out[i] or inn[i]) if H > 1 else 0.0,
                       local / intra)             # seconds per byte of the busiest NIC or link
        return chain(depth, nbytes, 1 / per_byte if per_byte > 0 else INF, a, c)
    if coll == "alltoall":                        # every pair one block, all at once
        t = max((len(rs) * (n - len(rs)) * nbytes / net.hbw[i] if net.hbw[i] > 0 else INF)
                for i, rs in enumerate(net.hosts)) if H > 1 else 0.0
        t = max(t, (S - 1) * nbytes / intra if S > 1 else 0.0)
        return max(chain(1, nbytes, min(bmin, intra) if H > 1 else intra, a, c), t + a)
    if coll == "barrier":                         # recursive doubling of nothing
        p2 = 1 << (n.bit_length() - 1)
        return ((p2.bit_length() - 1) + (2 if n > p2 else 0)) * a
    return 0.0


def _tree_loads(net, name, root):
    """(messages out of each host, into each host, the most one rank sends to ranks of its own
    host, depth) of bcast's tree: the binary tree over the ranks (flat: algorithms.binary_tree)
    or binomial trees among the hosts and inside each (hierarchical.bcast)."""
    n, H = net.n, net.H
    if name != "hierarchical":
        import numpy as np
        hi = net.host_index_array()
        v = np.arange(1, n)
        ha, hb = hi[((v - 1) // 2 + root) % n], hi[(v + root) % n]
        cross = ha != hb
        out = np.bincount(ha[cross], minlength=H).tolist()
        inn = np.bincount(hb[cross], minlength=H).tolist()
        ps = (v[~cross] - 1) // 2                 # tree positions sending on their host
        local = int(np.bincount(ps).max()) if len(ps) else 0
        return out, inn, local, max(1, n.bit_length() - 1)
    from .algorithms import binomial_tree
    hr = net.hidx[net.host_of[root]]
    out, inn = [0] * H, [0] * H
    for k in range(H):
        kids = binomial_tree(k, H)[1]
        out[(hr + k) % H] = len(kids)
        inn[(hr + k) % H] = 1 if k else 0
    S = net.S
    return out, inn, (S - 1).bit_length(), (H - 1).bit_length() + (S - 1).bit_length()
