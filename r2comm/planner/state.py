"""RailState: what the planner knows about the cluster's rails, as plain data.

    hosts[r]              the host (any hashable label) rank r runs on
    link[(r, p, k)]       (up, bytes/s) of rank r's rail k as seen towards peer p

A rail k between ranks a and b is usable when both ends report it up; its bandwidth is the
smaller of the two ends' figures. A pair is *broken* when it has no usable rail at all (traffic
between them must be relayed or avoided); the rank graph is *partitioned* when the working pairs
do not connect every rank (then no schedule exists).

Every rank must plan from the same RailState (e.g. allgathered), since schedules are computed
independently on each rank and must match. Everything here is deterministic.

Measured bandwidths. The engines measure every (rank, peer, rail) as the sender sees it
(start-up probe, then acknowledgements; rail_stats() row[7]). from_rail_stats(rates=...) uses
them in one of three ways:
  "nic"       (real NICs, the netns testbed) a model of NICs, not pairs, that believes only
              large differences, since measurements are noisy (rails sharing a switch or CPUs
              measure 10-30% apart although equal, and an online figure also depends on the
              load the schedule put on the rail):
               1. rank r's NIC k gets the best rate r measured on rail k towards a peer on
                  another host (interference only slows a transfer down; peers on r's own host
                  are rated apart, since those links do not use the NIC);
               1b. a *slow pair* (a, b, k): a measured a -> b on rail k below (1 - noise) x
                  a's own best on rail k (a's NIC k is fast, the link is not). Since a link is
                  as fast as the slower of its NICs, such reports bound b's NIC k: when every
                  peer on another host that b itself measured fast on rail k (not a slow pair
                  of b's) reported (., b, k) slow, b's best is contradicted by those very pairs
                  (a stale start-up probe on a pair that now carries traffic) and b's NIC k
                  gets min(b's best, the reported rates). If b measured some peer fast that did
                  not report it, the slow pair is taken as a path problem or noise and b's NIC
                  keeps its best (a slow path alone is not believed: per-pair online rates
                  depend on the load the schedule put on them, so no per-pair exception is
                  made from a rate; down pairs still are). So a slow NIC stays hidden where b
                  still holds a stale fast probe figure towards a peer that did not report it
                  (a pair that carried no traffic since the NIC slowed down).
               2. rail k's typical figure is the (upper) median over the ranks' NICs k; rails
                  whose typical figures lie within a factor (1 - noise) of the fastest rail's
                  count as equal (snap_rates);
               3. a NIC at or above (1 - noise) x its rail's typical figure gets exactly that
                  figure; only a NIC below it (a 100 Mbit NIC beside 1 Gbit ones) keeps its own
                  (slow NICs snapped among themselves);
               4. a link is as fast as the slower of its two NICs (a rail-optimised fabric);
               5. a host is degraded only below (1 - noise) of the best host (degraded_tol).
              So equal rails come out exactly equal, a lost NIC halves a 2-NIC host exactly,
              noise cannot make the planner switch, and a rate-limited NIC shows up.
  "scale"     (loopback rails: one device, so differences between "rails" are CPU scheduling,
              up to several times apart, not bandwidth) only the overall scale is measured:
              every link gets its declared relative bandwidth times the median measured rate
              per unit of declared bandwidth.
  "declared"  measurements ignored: declared relative bandwidth times nominal_bw.
A rail without a measurement (0: not yet measured, or just restored) gets its declared relative
bandwidth (R2COMM_RAIL_BW, else its engine weight) times the median measured rate per unit of
declared bandwidth, or times nominal_bw when nothing was measured at all."""
from dataclasses import dataclass, field


def connected_components(n, linked):
    """Components of the graph on ranks 0..n-1 whose edges are the pairs with linked(a, b),
    as sorted lists of ranks, in order of their lowest rank."""
    seen, comps = set(), []
    for s in range(n):
        if s in seen:
            continue
        comp, todo = [], [s]
        seen.add(s)
        while todo:
            a = todo.pop()
            comp.append(a)
            for b in range(n):
                if b not in seen and b != a and linked(a, b):
                    seen.add(b)
                    todo.append(b)
        comps.append(sorted(comp))
    return comps

DEFAULT_BW = 1.25e9          # bytes/s of one rail (10 Gbit/s) when nothing better is known
DEFAULT_ALPHA = 25e-6        # seconds of latency per message (TCP round trip / 2 + engine)
DEFAULT_CHUNK = 512 << 10    # the engine's chunk size (R2COMM_CHUNK_SIZE default)
MEASURE_NOISE = 0.3          # relative noise of measured rates (see the module docstring)


def _median(vals):
    vals = sorted(vals)
    return vals[len(vals) // 2]           # upper median: an actual measurement


def snap_rates(rates, noise=MEASURE_NOISE):
    """{key: rate} -> {key: snapped rate}: greedy bands from the fastest rate down, each band
    holding the rates >= (1 - noise) x its fastest, every member set to the band's median.
    Deterministic (ties broken by key order); noise = 0 leaves distinct rates alone."""
    order = sorted(rates, key=lambda k: (-rates[k], k))
    out, i = {}, 0
    while i < len(order):
        top = rates[order[i]]
        j = i
        while j < len(order) and rates[order[j]] >= (1 - noise) * top:
            j += 1
        band = sorted(rates[k] for k in order[i:j])
        m = len(band)
        med = band[m // 2] if m % 2 else 0.5 * (band[m // 2 - 1] + band[m // 2])
        for k in order[i:j]:
            out[k] = med
        i = j
    return out


def is_slow(rate, best, noise=MEASURE_NOISE):
    """A measured rate well below its rank's best on that rail: a slow pair, not noise."""
    return rate < (1 - noise) * best


def reported_nic(best, fast_peers, fast_reporters, reports):
    """Step 1b of the "nic" model: a NIC's best rate, lowered to the slowest of `reports` (the
    rates of the slow pairs reported towards it) when every one of its fast_peers (the peers
    it measured fast, a count) is among the reporters (fast_reporters, a count)."""
    if reports and fast_peers and fast_reporters == fast_peers:
        return min(best, min(reports))
    return best


def measured_figures(hosts, measured, noise=MEASURE_NOISE):
    """Steps 1-3 of the "nic" model (module docstring): {(rank, peer, rail): bytes/s}
    measured -> {(rank, rail, inside): bytes/s} per NIC (inside: the figure for the links
    within the rank's host)."""
    nic = {}
    for (r, p, k), rate in measured.items():
        key = (r, k, hosts[r] == hosts[p])
        nic[key] = max(nic.get(key, 0.0), rate)
    reports, fast = {}, {}                   # (rank, rail) -> {reporter: rate}, {fast peer}
    for (r, p, k), rate in measured.items():
        if hosts[r] != hosts[p]:
            if is_slow(rate, nic[(r, k, False)], noise):
                reports.setdefault((p, k), {})[r] = rate
            else:
                fast.setdefault((r, k), set()).add(p)
    for (b, k), rep in reports.items():
        key = (b, k, False)
        if key in nic:
            mine = fast.get((b, k), set())
            nic[key] = reported_nic(nic[key], len(mine), len(mine & rep.keys()), rep.values())
    return nic_figures(nic, noise)


def nic_figures(nic, noise=MEASURE_NOISE):
    """Steps 2-3 of the "nic" model: {(rank, rail, inside): best measured bytes/s} -> the
    figure of each NIC."""
    out = {}
    for inside in (False, True):
        mine = {key: v for key, v in nic.items() if key[2] == inside}
        if not mine:
            continue
        rails = sorted({k for (_, k, _) in mine})
        typical = snap_rates({k: _median([v for (r, kk, _), v in mine.items() if kk == k])
                              for k in rails}, noise)
        slow = {}
        for key, v in mine.items():
            if v >= (1 - noise) * typical[key[1]]:
                out[key] = typical[key[1]]
            else:
                slow[key] = v
        out.update(snap_rates(slow, noise))
    return out


def own_rows(rank, members, rail_stats):
    """This rank's {peer: [(state, weight, rate), ...]} (communicator ranks) from
    Engine.rail_stats() (keyed by global rank)."""
    g2c = {g: i for i, g in enumerate(members)}
    me = members[rank]
    return {g2c[g]: [(row[0], row[5], row[7] if len(row) > 7 else 0.0) for row in rows]
            for g, rows in rail_stats.items() if g in g2c and g != me}


class Fingerprint(tuple):
    """A state's fingerprint: a tuple that hashes once (8,192 ranks: 0.1 ms a hash, and the
    planner looks its caches up by it on every plan)."""

    def __hash__(self):
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


class PartitionedError(ValueError):
    """The working rails do not connect every rank: no schedule can reach them all."""


@dataclass
class RailState:
    hosts: list
    nrails: int
    link: dict = field(default_factory=dict)     # (rank, peer, rail) -> (up, bytes_per_s)
    alpha: float = DEFAULT_ALPHA
    chunk: int = DEFAULT_CHUNK
    degraded_tol: float = 0.02                   # a host below (1 - tol) x the best is degraded
    measured: dict = field(default_factory=dict, compare=False)  # (rank, peer, rail) -> raw B/s
    derived: dict = field(default_factory=dict, compare=False, repr=False)  # what the planner
                                                 # derives from this state once (its Topology)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def uniform(cls, n, nrails=2, bw=DEFAULT_BW, hosts=None, **kw):
        """n ranks, each on its own host unless `hosts` says otherwise, every rail up at bw."""
        hosts = list(range(n)) if hosts is None else list(hosts)
        if len(hosts) != n:
            raise ValueError(f"hosts has {len(hosts)} entries for {n} ranks")
        st = cls(hosts, nrails, {}, **kw)
        for a in range(n):
            for b in range(n):
                if a != b:
                    for k in range(nrails):
                        st.link[(a, b, k)] = (True, float(bw))
        return st

    @classmethod
    def from_rail_stats(cls, hosts, stats, rail_bw=None, nominal_bw=DEFAULT_BW,
                        noise=MEASURE_NOISE, rates="nic", **kw):
        """Build from what every rank's engine reports, gathered on every rank.

        stats[r] = {peer: [(state, weight[, rate]), ...] per rail} (e.g. the (row[0], row[5],
        row[7]) of Engine.rail_stats() rows, keyed by communicator rank). rate is the measured
        bytes/s (0 or absent: not measured); rail_bw[k] is rail k's declared relative bandwidth
        (R2COMM_RAIL_BW) and nominal_bw the bytes/s of a rail of relative bandwidth 1 when
        nothing was measured. rates: how measurements are used ("nic", "scale", "declared";
        module docstring); with "nic", degraded_tol defaults to `noise`."""
        if rates not in ("nic", "scale", "declared"):
            raise ValueError(f"rates must be 'nic', 'scale' or 'declared', not {rates!r}")
        n = len(hosts)
        nrails = max((len(rows) for s in stats for rows in s.values()), default=0)
        rel, up, measured = {}, {}, {}
        for r in range(n):
            for p, rows in stats[r].items():
                for k, rec in enumerate(rows):
                    key = (r, p, k)
                    rel[key] = float(rail_bw[k] if rail_bw and k < len(rail_bw)
                                     else (rec[1] or 1.0))
                    up[key] = rec[0] == "up"
                    rate = float(rec[2]) if len(rec) > 2 and rec[2] else 0.0
                    if up[key] and rate > 0:
                        measured[key] = rate
        if rates == "nic" and measured:
            kw.setdefault("degraded_tol", noise)
        st = cls(list(hosts), nrails, {}, measured=measured, **kw)
        nic, scale = {}, nominal_bw
        if rates == "nic" and measured:
            nic = measured_figures(hosts, measured, noise)
            scale = _median([nic[(r, k, hosts[r] == hosts[p])] / (rel[(r, p, k)] or 1.0)
                             for (r, p, k) in measured])
        elif rates == "scale" and measured:
            scale = _median([v / (rel[key] or 1.0) for key, v in measured.items()])
        for (r, p, k) in rel:
            inside = hosts[r] == hosts[p]
            ends = [nic[x] for x in ((r, k, inside), (p, k, inside)) if x in nic]
            st.link[(r, p, k)] = (up[(r, p, k)], min(ends) if ends else rel[(r, p, k)] * scale)
        return st

    @classmethod
    def gather(cls, allgather, rank, members, rail_stats, hosts, rail_bw=None,
               nominal_bw=DEFAULT_BW, rates="nic", compact=False, **kw):
        """The live RailState of a communicator, identical on every rank (collective).

        allgather: e.g. mpi_comm.allgather; rank: this rank in the communicator; members: the
        global rank of each communicator rank; rail_stats: Engine.rail_stats() (keyed by
        global rank, rows (state, sent, recv, resent, inflight, weight, failures, rate, ...));
        hosts: the host name of each communicator rank. When every rank reports the same host
        (one test machine) each rank is taken as its own host, so NIC loss still shows as a
        slow host. The measured rates (row[7]) give the bandwidths as `rates` says ("nic",
        "scale", "declared": from_rail_stats), R2COMM_RAIL_BW (rail_bw) where a rail has none."""
        stats = allgather(own_rows(rank, members, rail_stats))
        hosts = list(hosts) if len(set(hosts)) > 1 else list(range(len(members)))
        st = cls.from_rail_stats(hosts, stats, rail_bw, nominal_bw, rates=rates, **kw)
        return st.compact() if compact else st

    def copy(self):
        return RailState(list(self.hosts), self.nrails, dict(self.link), self.alpha, self.chunk,
                         self.degraded_tol, dict(self.measured))

    def compact(self):
        """The same state as a NicRailState: per host and NIC the best figure towards another
        host (nic_bw), ranks of one host at the most common local pair bandwidth, and every
        (pair, rail) that differs from that as an exception. Every query answers the same."""
        hl = self.host_list()
        hidx = {h: i for i, h in enumerate(hl)}
        nic = [[0.0] * self.nrails for _ in hl]
        local = {}
        for (a, b, k) in self.link:
            if a < b:
                v = self.rail_bw(a, b, k)
                if self.hosts[a] != self.hosts[b]:
                    for r in (a, b):
                        row = nic[hidx[self.hosts[r]]]
                        row[k] = max(row[k], v)
                else:
                    pb = self.pair_bw(a, b)
                    local[pb] = local.get(pb, 0) + 1
        intra = max(sorted(local), key=lambda v: local[v]) if local else 0.0
        out = NicRailState(self.hosts, nic, intra, self.alpha, self.chunk, self.degraded_tol)
        exc = {}
        for a in range(self.n):
            for b in range(a + 1, self.n):
                for k in range(self.nrails):
                    v = self.rail_bw(a, b, k)
                    if v != out.rail_bw(a, b, k):
                        exc[(a, b, k)] = (v > 0, v)
        out.exceptions = exc
        out.measured = dict(self.measured)
        return out

    # -- mutation (tests, simulations) -------------------------------------------------------------
    def set_link(self, a, b, rail, up=None, bw=None):
        """Change rail `rail` between a and b (both directions)."""
        for key in ((a, b, rail), (b, a, rail)):
            old_up, old_bw = self.link.get(key, (False, 0.0))
            self.link[key] = (old_up if up is None else bool(up),
                              old_bw if bw is None else float(bw))
        return self

    def fail_rail(self, rank, rail, peer=None):
        """Rank's NIC `rail` fails (towards every peer, or one)."""
        for p in range(self.n):
            if p != rank and (peer is None or p == peer):
                self.set_link(rank, p, rail, up=False)
        return self

    def break_pair(self, a, b):
        """No rail works between a and b."""
        for k in range(self.nrails):
            self.set_link(a, b, k, up=False)
        return self

    def scale_host(self, host, factor):
        """Every rail of `host` runs at `factor` of its bandwidth (a degraded NIC)."""
        for (a, b, k), (up, bw) in list(self.link.items()):
            if (self.hosts[a] == host) != (self.hosts[b] == host):
                self.link[(a, b, k)] = (up, bw * factor)
        return self

    # -- queries -----------------------------------------------------------------------------------
    @property
    def n(self):
        return len(self.hosts)

    def fingerprint(self):
        """A hashable summary: equal fingerprints plan identically."""
        return (tuple(self.hosts), self.nrails, self.alpha, self.chunk, self.degraded_tol,
                tuple(sorted(self.link.items())))

    def rail_bw(self, a, b, k):
        """Usable bandwidth of rail k between a and b (0 when down at either end)."""
        ua, ba = self.link.get((a, b, k), (False, 0.0))
        ub, bb = self.link.get((b, a, k), (False, 0.0))
        return min(ba, bb) if (ua and ub and ba > 0 and bb > 0) else 0.0

    def usable_rails(self, a, b):
        return [k for k in range(self.nrails) if self.rail_bw(a, b, k) > 0]

    def pair_bw(self, a, b):
        """Aggregate bandwidth between a and b over every usable rail (the engine stripes)."""
        return sum(self.rail_bw(a, b, k) for k in range(self.nrails))

    def rail_weights(self, a, b):
        """Share of a->b traffic each rail should carry: proportional to its usable bandwidth
        (0 for a rail down at either end); sums to 1 unless the pair is broken (all 0)."""
        bws = [self.rail_bw(a, b, k) for k in range(self.nrails)]
        tot = sum(bws)
        return [x / tot for x in bws] if tot > 0 else [0.0] * self.nrails

    def broken_pairs(self):
        """Pairs (a < b) with no common working rail."""
        return [(a, b) for a in range(self.n) for b in range(a + 1, self.n)
                if self.pair_bw(a, b) <= 0]

    def has_broken_pairs(self):
        """Some pair has no common working rail (then the planner relays)."""
        return bool(self.broken_pairs())

    def broken_ranks(self):
        """The ranks with a broken pair, ascending (the only ones whose messages get relayed)."""
        return sorted({r for p in self.broken_pairs() for r in p})

    def broken_peers(self, a):
        """The ranks rank a has no working rail with (a set)."""
        return {b for b in range(self.n) if b != a and not self.working(a, b)}

    def working(self, a, b):
        return a != b and self.pair_bw(a, b) > 0

    def neighbours(self, a):
        return [b for b in range(self.n) if self.working(a, b)]

    def components(self):
        """Connected components of the graph of working pairs (sorted lists of ranks)."""
        return connected_components(self.n, self.working)

    def partitioned(self):
        return len(self.components()) > 1

    def check_connected(self):
        comps = self.components()
        if len(comps) > 1:
            raise PartitionedError(
                "the working rails split the ranks into disconnected groups "
                f"{comps}: no schedule can reach every rank (broken pairs {self.broken_pairs()})")

    def host_ranks(self, host):
        return [r for r in range(self.n) if self.hosts[r] == host]

    def host_list(self):
        out = []
        for h in self.hosts:
            if h not in out:
                out.append(h)
        return out

    def nic_bw(self, host, k):
        """Bandwidth of `host`'s NIC k: the best usable figure on any of its off-host links
        (intra-host pairs if the host is alone)."""
        mine = self.host_ranks(host)
        others = [p for p in range(self.n) if self.hosts[p] != host] or \
            [p for p in range(self.n)]
        return max((self.rail_bw(a, p, k) for a in mine for p in others if p != a), default=0.0)

    def host_bw(self, host):
        """Aggregate bandwidth of a host (sum over its NICs), each direction."""
        return sum(self.nic_bw(host, k) for k in range(self.nrails))

    def rank_bw(self, r):
        """A rank's share of its host's bandwidth."""
        h = self.hosts[r]
        return self.host_bw(h) / len(self.host_ranks(h))

    def beta(self):
        """Degraded-host fraction: the weakest host's bandwidth over the best host's."""
        bws = [self.host_bw(h) for h in self.host_list()]
        top = max(bws, default=0.0)
        return min(bws) / top if top > 0 else 0.0

    def degraded_hosts(self):
        bws = {h: self.host_bw(h) for h in self.host_list()}
        top = max(bws.values(), default=0.0)
        return [h for h, b in bws.items() if b < (1 - self.degraded_tol) * top]

    def degraded_ranks(self):
        bad = set(self.degraded_hosts())
        return [r for r in range(self.n) if self.hosts[r] in bad]

    def healthy(self):
        """Every rail up at both ends and no degraded host: the static plans are right."""
        return all(up for up, _ in self.link.values()) and not self.degraded_hosts()

    def describe(self):
        return (f"RailState({self.n} ranks on {len(self.host_list())} hosts, {self.nrails} rails, "
                f"beta={self.beta():.3g}, degraded={self.degraded_ranks()}, "
                f"broken={self.broken_pairs()})")


class NicRailState(RailState):
    """A RailState held per host and NIC plus per-pair exceptions, not per (rank, peer, rail):
    O(H·K + changes) data for any number of ranks, with the same meaning and queries.

        nic[i][k]    bytes/s of NIC k of the i-th host (hosts in order of their lowest rank;
                     0: down); a rail between ranks of two hosts runs at the slower NIC
        intra_bw     bytes/s between two ranks of one host (spread evenly over the rails)
        exceptions   {(a, b, k): (up, bytes/s)} for one pair (a < b): a slow or broken path

    A NIC failure is a fact about one host's NIC (one entry of `nic`), a slow path one entry of
    `exceptions`: agreeing on a change moves that entry, not a table over every pair. `link`
    stays empty; rail_bw(), pair_bw(), host_bw() ... answer in O(K) or O(1)."""

    def __init__(self, hosts, nic, intra_bw=0.0, alpha=DEFAULT_ALPHA, chunk=DEFAULT_CHUNK,
                 degraded_tol=0.02, exceptions=None):
        super().__init__(list(hosts), len(nic[0]) if nic else 0, {}, alpha, chunk, degraded_tol)
        self.nic = [list(map(float, row)) for row in nic]
        self.intra_bw = float(intra_bw)
        self.exceptions = dict(exceptions or {})
        hl, hidx, hr, hi = [], {}, {}, []        # (one pass over the ranks)
        for r, h in enumerate(self.hosts):
            i = hidx.get(h)
            if i is None:
                i = hidx[h] = len(hl)
                hl.append(h)
                hr[h] = []
            hr[h].append(r)
            hi.append(i)
        if len(self.nic) != len(hl):
            raise ValueError(f"{len(self.nic)} NIC rows for {len(hl)} hosts")
        self._hl, self._hidx, self._hr, self._hi = hl, hidx, hr, hi
        self._pbw = {}
        self._top2 = []                       # per rail: the best two NIC figures (value, host)
        for k in range(self.nrails):
            col = sorted(((row[k], i) for i, row in enumerate(self.nic)), reverse=True)[:2]
            self._top2.append(col)
        self._hbw = None
        self._fp = None
        self._broken = None
        self._graph = None

    def copy(self):
        return type(self)(self.hosts, self.nic, self.intra_bw, self.alpha, self.chunk,
                          self.degraded_tol, self.exceptions)

    def fingerprint(self):
        """Made once (set_link() makes it again): equal fingerprints plan identically."""
        if self._fp is None:
            self._fp = Fingerprint(("nic", tuple(self.hosts), self.nrails, self.alpha,
                                    self.chunk, self.degraded_tol, self.intra_bw,
                                    tuple(tuple(r) for r in self.nic),
                                    tuple(sorted(self.exceptions.items()))))
        return self._fp

    def set_link(self, a, b, rail, up=None, bw=None):
        """A per-pair exception (both directions)."""
        key = (min(a, b), max(a, b), rail)
        old_up, old_bw = self.exceptions.get(key, (self._base_rail(a, b, rail) > 0,
                                                   self._base_rail(a, b, rail)))
        self.exceptions[key] = (old_up if up is None else bool(up),
                                old_bw if bw is None else float(bw))
        self._pbw.clear()
        self._fp = self._broken = self._graph = None
        return self

    def _base_rail(self, a, b, k):
        ha, hb = self._hi[a], self._hi[b]
        if ha == hb:
            return self.intra_bw / self.nrails if self.nrails else 0.0
        x, y = self.nic[ha][k], self.nic[hb][k]
        return min(x, y) if x > 0 and y > 0 else 0.0

    def rail_bw(self, a, b, k):
        if a == b:
            return 0.0
        if self.exceptions:
            e = self.exceptions.get((min(a, b), max(a, b), k))
            if e is not None:
                return e[1] if e[0] and e[1] > 0 else 0.0
        return self._base_rail(a, b, k)

    def pair_bw(self, a, b):
        if a == b:
            return 0.0
        if self.exceptions and any((min(a, b), max(a, b), k) in self.exceptions
                                   for k in range(self.nrails)):
            return sum(self.rail_bw(a, b, k) for k in range(self.nrails))
        ha, hb = self._hi[a], self._hi[b]
        if ha == hb:
            return self.intra_bw
        key = (ha, hb) if ha < hb else (hb, ha)
        v = self._pbw.get(key)
        if v is None:
            x, y = self.nic[ha], self.nic[hb]
            v = self._pbw[key] = sum(min(p, q) for p, q in zip(x, y) if p > 0 and q > 0)
        return v

    def healthy(self):
        return all(v > 0 for row in self.nic for v in row) and not self.degraded_hosts() and \
            all(up for up, _ in self.exceptions.values())

    def host_ranks(self, host):
        return list(self._hr.get(host, []))

    def host_list(self):
        return list(self._hl)

    def host_indices(self):
        """The host index of every rank (hosts numbered in order of their lowest rank)."""
        return list(self._hi)

    def nic_bw(self, host, k):
        """As RailState.nic_bw (exceptions aside): the best usable figure towards another
        host's NIC k."""
        i = self._hidx[host]
        mine = self.nic[i][k]
        if len(self._hl) == 1:
            return self.intra_bw / self.nrails if len(self._hr[host]) > 1 and self.nrails else 0.0
        if mine <= 0:
            return 0.0
        best = next((v for v, j in self._top2[k] if j != i), 0.0)
        return min(mine, best) if best > 0 else 0.0

    def host_bw(self, host):
        if self._hbw is None:
            self._hbw = self._host_bws()
        return self._hbw[host]

    def _host_bws(self):
        """{host: sum of nic_bw over its NICs}, every host at once in O(H·K)."""
        if len(self._hl) == 1:
            return {h: sum(self.nic_bw(h, k) for k in range(self.nrails)) for h in self._hl}
        tot = [0.0] * len(self._hl)
        for k in range(self.nrails):
            top = self._top2[k]
            v1, i1 = top[0]
            v2 = top[1][0] if len(top) > 1 else 0.0
            for i, row in enumerate(self.nic):
                mine = row[k]
                best = v2 if i == i1 else v1
                if mine > 0 and best > 0:
                    tot[i] += mine if mine < best else best
        return {h: tot[i] for i, h in enumerate(self._hl)}

    def rank_bw(self, r):
        h = self.hosts[r]
        return self.host_bw(h) / len(self._hr[h])

    def degraded_ranks(self):
        return sorted(r for h in self.degraded_hosts() for r in self._hr[h])

    def _masks(self):
        return [sum(1 << k for k, v in enumerate(row) if v > 0) for row in self.nic]

    def host_graph(self):
        """What HostHops needs of this state, made once (set_link() makes it again): a
        HostGraph."""
        if self._graph is None:
            self._graph = HostGraph(self)
        return self._graph

    def has_broken_pairs(self):
        if self._broken is None:
            self._broken = self._find_broken()
        return self._broken

    def _find_broken(self):
        if any(not (e[0] and e[1] > 0) for e in self.exceptions.values()):
            if self.broken_pairs():
                return True
        masks = self._masks()
        if len(set(masks)) == 1:
            return not masks[0] and len(self._hl) > 1 or \
                (self.intra_bw <= 0 and any(len(r) > 1 for r in self._hr.values()))
        distinct = sorted(set(masks))
        if any(not a & b for a in distinct for b in distinct if a != b) or 0 in distinct:
            return True
        return self.intra_bw <= 0 and any(len(r) > 1 for r in self._hr.values())

    def broken_pairs(self):
        masks = self._masks()
        H = len(masks)
        bad = [] if all(m == masks[0] for m in masks) and masks[0] else \
            [(i, j) for i in range(H) for j in range(i + 1, H) if not masks[i] & masks[j]]
        out = set()
        for i, j in bad:
            for a in self._hr[self._hl[i]]:
                for b in self._hr[self._hl[j]]:
                    out.add((min(a, b), max(a, b)))
        if self.intra_bw <= 0:
            for h in self._hl:
                rs = self._hr[h]
                out.update((a, b) for x, a in enumerate(rs) for b in rs[x + 1:])
        for (a, b, k) in self.exceptions:
            if self.pair_bw(a, b) <= 0:
                out.add((a, b))
            else:
                out.discard((a, b))
        return sorted(out)

    def neighbours(self, a):
        return [b for b in range(self.n) if b != a and self.pair_bw(a, b) > 0]

    def broken_ranks(self):
        """As RailState.broken_ranks, per host: the ranks of hosts that share no NIC with some
        other host (or, with no local bandwidth, share a host), and the ranks of the pairs an
        exception breaks; O(H + distinct NIC sets² + exceptions) unless some are broken."""
        masks = self._masks()
        by_mask = {}
        for i, m in enumerate(masks):
            by_mask.setdefault(m, []).append(i)
        bad = set()
        for m1, hs in by_mask.items():
            if not m1 and len(self._hl) > 1 or \
                    any(not m1 & m2 for m2 in by_mask if m2 != m1) or \
                    (len(hs) > 1 and not m1):
                bad.update(hs)
        out = {r for i in bad for r in self._hr[self._hl[i]]}
        if self.intra_bw <= 0:
            out.update(r for rs in self._hr.values() if len(rs) > 1 for r in rs)
        named = {x for (a, b, k) in self.exceptions for x in (a, b)}
        for r in named & out:                     # an exception may mend its broken pairs
            if not any(self.pair_bw(r, p) <= 0 for p in self._unlinked(r)):
                out.discard(r)
        for (a, b, k) in self.exceptions:
            if self.pair_bw(a, b) <= 0:
                out.update((a, b))
        return sorted(out)

    def broken_peers(self, a):
        """As RailState.broken_peers: the ranks of the hosts a shares no NIC with (its own
        host's with no local bandwidth), as exceptions leave them, and those an exception
        breaks; O(those ranks + exceptions)."""
        out = {p for p in self._unlinked(a) if self.pair_bw(a, p) <= 0}
        for (x, y, k) in self.exceptions:
            if a in (x, y) and self.pair_bw(x, y) <= 0:
                out.add(y if x == a else x)
        return out

    def _unlinked(self, r):
        """The ranks rank r shares no NIC with (its own host's with no local bandwidth)."""
        masks = self._masks()
        i = self._hi[r]
        return [p for j, m in enumerate(masks)
                if (j == i and self.intra_bw <= 0) or (j != i and not m & masks[i])
                for p in self._hr[self._hl[j]] if p != r]

    def components(self):
        """As RailState.components, from breadth-first searches per host (HostHops):
        O(H·K + exceptions) each, not O(n²)."""
        left, comps = list(range(self.n)), []
        while left:
            hops = HostHops(self, left[0])
            comps.append([r for r in left if r in hops])
            left = [r for r in left if r not in hops]
        return comps

    def to_dense(self):
        """The same state as a plain RailState (every (rank, peer, rail)): small n only."""
        st = RailState(list(self.hosts), self.nrails, {}, self.alpha, self.chunk,
                       self.degraded_tol)
        for a in range(self.n):
            for b in range(self.n):
                if a != b:
                    for k in range(self.nrails):
                        v = self.rail_bw(a, b, k)
                        st.link[(a, b, k)] = (v > 0, v)
        return st


class HostGraph:
    """A NicRailState's hosts as a graph: the ranks of each host, its NICs up (a bit mask),
    the hosts on each rail, the ranks exceptions name, each host's ranks less those (its
    *group*), and base_row(h): the bandwidth between a rank of host h and one of every host
    when no exception names them, as an array (the same sums, in the same order, as
    pair_bw)."""

    def __init__(self, state):
        import numpy as np
        self.state = state
        self.hi = state.host_indices()
        self.ranks = [state.host_ranks(h) for h in state.host_list()]
        self.masks = [sum(1 << k for k, v in enumerate(row) if v > 0) for row in state.nic]
        H = len(self.ranks)
        self.on_rail = [[i for i in range(H) if self.masks[i] >> k & 1]
                        for k in range(state.nrails)]
        self.named = {x for (p, q, _k) in state.exceptions for x in (p, q)}
        self.group = [[r for r in rs if r not in self.named] for rs in self.ranks] \
            if self.named else self.ranks
        self.nic = np.array(state.nic, dtype=float).reshape(H, state.nrails)
        self._rows = {}

    def base_row(self, h):
        import numpy as np
        row = self._rows.get(h)
        if row is None:
            mine = self.nic[h]
            row = np.zeros(len(self.ranks))
            for k in range(len(mine)):              # left to right, as pair_bw's sum
                col = self.nic[:, k]
                row = row + np.where((col > 0) & (mine[k] > 0), np.minimum(col, mine[k]), 0.0)
            row[h] = self.state.intra_bw
            row = self._rows[h] = row
        return row


class HostHops:
    """Hop distances to one rank (src) over the working pairs of a NicRailState, found per host:
    the ranks of a host that no exception names (a *group*) all have the same neighbours, so a
    breadth-first search over the groups and the few ranks that exceptions name (plus src)
    answers for every rank, in O(H·K + T·(H + T)) for T named ranks. Reads like {rank: hops}
    (`in`, [], get) and picks a rank's next hop towards src (next_hop)."""

    def __init__(self, state, src):
        self.state, self.src = state, src
        graph = self.graph = state.host_graph()
        self.hi, self.ranks, self.masks = graph.hi, graph.ranks, graph.masks
        self.intra = state.intra_bw > 0
        named = graph.named | {src}
        self.named = sorted(named)
        hs = self.hi[src]
        self.group = list(graph.group)            # src's host's group without src
        self.group[hs] = [r for r in self.group[hs] if r != src]
        H, K = len(self.ranks), state.nrails
        on_rail = graph.on_rail
        gd = [None] * H                           # hops of each host's group
        nd = {src: 0}                             # hops of each named rank
        skipped = [None] * K                      # rail expanded: None no, -1 every host on
        frontier = [("r", src)]                   # it reached, h all but host h's group
        d = 0
        while frontier:
            nxt = []

            def reach(g):
                if gd[g] is None and self.group[g]:
                    gd[g] = d + 1
                    nxt.append(("g", g))
            for kind, x in frontier:
                h = self.hi[x] if kind == "r" else x
                for k in range(K):                # groups on a rail this node's host has
                    if not self.masks[h] >> k & 1 or skipped[k] == -1:
                        continue
                    if skipped[k] is None:
                        for g in on_rail[k]:
                            if g != h:
                                reach(g)
                        skipped[k] = h if gd[h] is None and self.group[h] else -1
                    elif skipped[k] != h:
                        reach(skipped[k])
                        skipped[k] = -1
                if kind == "r" and self.intra:
                    reach(h)                      # the rest of its own host
                for v in self.named:
                    if v not in nd and self._works(kind, x, v):
                        nd[v] = d + 1
                        nxt.append(("r", v))
            frontier = nxt
            d += 1
        self.gd, self.nd = gd, nd
        self.named_set = named
        self._rows = {}                          # _towards() per host of the hop's rank
        self._gd_arr = None
        self._first = None

    def _arrays(self):
        import numpy as np
        if self._gd_arr is None:
            self._gd_arr = np.array([-1 if v is None else v for v in self.gd])
            self._first = np.array([rs[0] if rs else -1 for rs in self.group])

    def _base(self, ha, hb):
        """Whether two ranks of hosts ha and hb that no exception pairs work together."""
        return self.intra if ha == hb else bool(self.masks[ha] & self.masks[hb])

    def _works(self, kind, x, v):
        if kind == "r":
            return x != v and self.state.working(x, v)
        return self._base(x, self.hi[v])

    def get(self, r, default=None):
        if r in self.named_set:
            return self.nd.get(r, default)
        v = self.gd[self.hi[r]]
        return default if v is None else v

    def __getitem__(self, r):
        v = self.get(r)
        if v is None:
            raise KeyError(r)
        return v

    def __contains__(self, r):
        return self.get(r) is not None

    def next_hop(self, u, nbytes, load):
        """routing.route()'s next hop from u towards src: of u's working neighbours one hop
        nearer, the one that would finish its relayed bytes soonest ((load + nbytes) / the
        slower of its links to u and to src, load: {rank: bytes relayed}), ties to the lowest
        rank; src itself first. Per group on arrays: a group's candidate is its rank of least
        load (all of a group share their links), O(H + loaded ranks) a hop."""
        import numpy as np
        want = self.get(u) - 1
        if want == 0:
            return self.src                         # (the only rank at 0 hops)
        self._arrays()
        st = self.state
        bott, adj = self._towards(u)
        bl = np.zeros(len(self.group))
        first = self._first.copy()
        touched = {}
        for r, v in load.items():
            if r not in self.named_set:
                touched.setdefault(self.hi[r], []).append(r)
        for g in touched:
            bl[g], first[g] = min(((load.get(c, 0), c) for c in self.group[g] if c != u),
                                  default=(0, -1))
        score = np.where(adj & (self._gd_arr == want), (bl + nbytes) / bott, np.inf)
        best = (np.inf, None)
        m = score.min()
        if m < np.inf:
            best = (float(m), int(first[score == m].min()))
        for v in self.named:
            if self.nd.get(v) == want and u != v and st.working(u, v):
                bv = min(st.pair_bw(u, v), st.pair_bw(v, self.src)
                         if st.working(v, self.src) else st.pair_bw(u, v))
                best = min(best, ((load.get(v, 0) + nbytes) / bv, v))
        return best[1]

    def _towards(self, u):
        """(the slower of each group's links to u and to src, whether it works with u and holds
        a rank but u), as arrays over the groups, made once per host of u. Ranks of a group
        have no exception, with u or src: their links are their hosts' (HostGraph.base_row)."""
        import numpy as np
        hu = self.hi[u]
        hit = self._rows.get(hu)
        if hit is None:
            to_u = self.graph.base_row(hu)
            to_src = self.graph.base_row(self.hi[self.src])
            bott = np.where(to_src > 0, np.minimum(to_u, to_src), to_u)
            size = np.array([len(rs) for rs in self.group])
            adj = (to_u > 0) & (size > 0)
            hit = self._rows[hu] = (np.where(adj, bott, 1.0), adj)
        return hit
