"""RailState: what the planner knows about the cluster's rails, as plain data.

    hosts[r]              the host (any hashable label) rank r runs on
    link[(r, p, k)]       (up, bytes/s) of rank r's rail k as seen towards peer p

A rail k between ranks a and b is usable when both ends report it up; its bandwidth is the
smaller of the two ends' figures. A pair is *broken* when it has no usable rail at all (traffic
between them must be relayed or avoided); the rank graph is *partitioned* when the working pairs
do not connect every rank (then no schedule exists).

Every rank must plan from the same RailState (e.g. allgathered), since schedules are computed
independently on each rank and must match. Everything here is deterministic."""
from dataclasses import dataclass, field

DEFAULT_BW = 1.25e9          # bytes/s of one rail (10 Gbit/s) when nothing better is known
DEFAULT_ALPHA = 25e-6        # seconds of latency per message (TCP round trip / 2 + engine)
DEFAULT_CHUNK = 256 << 10    # the engine's chunk size (R2COMM_CHUNK_SIZE default)


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
    def from_rail_stats(cls, hosts, stats, rail_bw=None, nominal_bw=DEFAULT_BW, **kw):
        """Build from what every rank's engine reports, gathered on every rank.

        stats[r] = {peer: [(state, weight), ...] per rail} (e.g. the (row[0], row[5]) of
        Engine.rail_stats() rows, keyed by communicator rank); rail_bw[k] is rail k's relative
        bandwidth (R2COMM_RAIL_BW) and nominal_bw the bytes/s of a rail of weight 1."""
        n = len(hosts)
        nrails = max((len(rows) for s in stats for rows in s.values()), default=0)
        st = cls(list(hosts), nrails, {}, **kw)
        for r in range(n):
            for p, rows in stats[r].items():
                for k, (state, weight) in enumerate(rows):
                    rel = rail_bw[k] if rail_bw and k < len(rail_bw) else (weight or 1.0)
                    st.link[(r, p, k)] = (state == "up", float(rel) * nominal_bw)
        return st

    @classmethod
    def gather(cls, allgather, rank, members, rail_stats, hosts, rail_bw=None,
               nominal_bw=DEFAULT_BW, **kw):
        """The live RailState of a communicator, identical on every rank (collective).

        allgather: e.g. mpi_comm.allgather; rank: this rank in the communicator; members: the
        global rank of each communicator rank; rail_stats: Engine.rail_stats() (keyed by
        global rank, rows (state, sent, recv, resent, inflight, weight, failures)); hosts: the
        host name of each communicator rank. When every rank reports the same host (one test
        machine) each rank is taken as its own host, so NIC loss still shows as a slow host."""
        g2c = {g: i for i, g in enumerate(members)}
        me = members[rank]
        mine = {g2c[g]: [(row[0], row[5]) for row in rows]
                for g, rows in rail_stats.items() if g in g2c and g != me}
        stats = allgather(mine)
        hosts = list(hosts) if len(set(hosts)) > 1 else list(range(len(members)))
        return cls.from_rail_stats(hosts, stats, rail_bw, nominal_bw, **kw)

    def copy(self):
        return RailState(list(self.hosts), self.nrails, dict(self.link), self.alpha, self.chunk,
                         self.degraded_tol)

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

    def working(self, a, b):
        return a != b and self.pair_bw(a, b) > 0

    def neighbours(self, a):
        return [b for b in range(self.n) if self.working(a, b)]

    def components(self):
        """Connected components of the graph of working pairs (sorted lists of ranks)."""
        seen, comps = set(), []
        for s in range(self.n):
            if s in seen:
                continue
            comp, todo = [], [s]
            seen.add(s)
            while todo:
                a = todo.pop()
                comp.append(a)
                for b in self.neighbours(a):
                    if b not in seen:
                        seen.add(b)
                        todo.append(b)
            comps.append(sorted(comp))
        return comps

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

    def describe(self):
        return (f"RailState({self.n} ranks on {len(self.host_list())} hosts, {self.nrails} rails, "
                f"beta={self.beta():.3g}, degraded={self.degraded_ranks()}, "
                f"broken={self.broken_pairs()})")
