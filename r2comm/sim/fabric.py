"""A rail-optimised cluster: H hosts x K NICs (rail k of every host on rail switch k), G ranks per
host, an optional spine between the rail switches, and the planner's view of it.

Links (the FlowSim's resources), per host h and NIC k: tx(h, k) (NIC -> rail switch) and
rx(h, k) (rail switch -> NIC), each at the NIC's rate x `efficiency` (the achievable fraction
of line rate: TCP/IP framing, CPU); per rank: local tx/rx at `intra_bw` (ranks of one host, flat
plans only); one spine link (cross-rail traffic, e.g. a fixed backup NIC talking to the peer's
NIC k) at `spine_bw` (None: not a bottleneck). Rail switches themselves are non-blocking.

FabricState is a planner.RailState computed from per-NIC figures instead of a dict of every
(rank, peer, rail): the planner's queries give the same answers as RailState.uniform() +
fail_rail()/scale_host() would (tests check it), in O(1) per query, so the real planner runs on
hundreds of hosts."""
from ..config import Config
from ..planner.state import NicRailState, DEFAULT_ALPHA

_CFG = Config()


class FabricState(NicRailState):
    """RailState of `hosts` (one host label per rank) from per-NIC figures:
    nic[h][k] = bytes/s of host h's NIC k as the engines measure it (0: down). A rail between
    ranks on different hosts runs at the slower NIC; ranks on one host (flat plans) talk at
    intra_bw, spread evenly over the rails (planner.state.NicRailState, the engine's chunk)."""

    def __init__(self, hosts, nic, intra_bw=0.0, alpha=DEFAULT_ALPHA, chunk=None,
                 degraded_tol=0.02, exceptions=None):
        super().__init__(hosts, nic, intra_bw, alpha,
                         chunk if chunk is not None else _CFG.chunk_size, degraded_tol,
                         exceptions)

    def set_link(self, *a, **k):
        raise NotImplementedError("FabricState changes per NIC: edit .nic")


class Fabric:
    """The physical cluster. rate: bytes/s of every NIC (line rate); nic_rate[h][k] overrides it;
    efficiency: achievable fraction of line rate; alpha: seconds per message (latency);
    ranks_per_host G; intra_bw: bytes/s between ranks of one host (flat plans; also the
    intra-host phases of host-level plans); spine_bw: bytes/s of the spine (None: unlimited)."""

    def __init__(self, hosts, nics, rate, ranks_per_host=1, efficiency=1.0, alpha=25e-6,
                 intra_bw=150e9, spine_bw=None, nic_rate=None):
        if hosts < 1 or nics < 1 or ranks_per_host < 1:
            raise ValueError("hosts, nics and ranks_per_host must be >= 1")
        if rate <= 0 or not 0 < efficiency <= 1:
            raise ValueError("rate must be > 0 and efficiency in (0, 1]")
        self.H, self.K, self.G = int(hosts), int(nics), int(ranks_per_host)
        self.rate = float(rate)
        self.efficiency = float(efficiency)
        self.alpha = float(alpha)
        self.intra_bw = float(intra_bw)
        self.spine_bw = spine_bw
        self.line = [[float(rate)] * self.K for _ in range(self.H)] if nic_rate is None else \
            [list(map(float, r)) for r in nic_rate]
        self.up = [[True] * self.K for _ in range(self.H)]
        self.factor = [[1.0] * self.K for _ in range(self.H)]

    # -- link numbering -------------------------------------------------------------------------
    def tx(self, h, k):
        return 2 * (h * self.K + k)

    def rx(self, h, k):
        return 2 * (h * self.K + k) + 1

    @property
    def spine(self):
        return 2 * self.H * self.K

    def local_tx(self, rank):
        return 2 * self.H * self.K + 1 + 2 * rank

    def local_rx(self, rank):
        return 2 * self.H * self.K + 2 + 2 * rank

    def nlinks(self, nranks):
        return 2 * self.H * self.K + 1 + 2 * nranks

    def nic_capacity(self, h, k):
        """Bytes/s NIC (h, k) carries now (0 when down)."""
        return self.line[h][k] * self.factor[h][k] * self.efficiency if self.up[h][k] else 0.0

    def capacities(self, nranks):
        cap = [0.0] * self.nlinks(nranks)
        for h in range(self.H):
            for k in range(self.K):
                cap[self.tx(h, k)] = cap[self.rx(h, k)] = self.nic_capacity(h, k)
        cap[self.spine] = self.spine_bw if self.spine_bw else 1e30
        for r in range(nranks):
            cap[self.local_tx(r)] = cap[self.local_rx(r)] = self.intra_bw
        return cap

    # -- changes --------------------------------------------------------------------------------
    def down(self, h, k):
        self.up[h][k] = False

    def restore(self, h, k):
        self.up[h][k] = True

    def degrade(self, h, k, factor):
        self.factor[h][k] = float(factor)

    def copy(self):
        f = Fabric(self.H, self.K, self.rate, self.G, self.efficiency, self.alpha, self.intra_bw,
                   self.spine_bw, self.line)
        f.up = [list(r) for r in self.up]
        f.factor = [list(r) for r in self.factor]
        return f

    def state(self, flat=False, nic=None, alpha=DEFAULT_ALPHA):
        """The planner's RailState of this fabric (what the engines would measure): one rank per
        host (host-level plans), or flat: every one of the H x G ranks. nic: per-NIC figures to
        use instead of the physical ones (e.g. the engines' view)."""
        nic = nic if nic is not None else [[self.nic_capacity(h, k) for k in range(self.K)]
                                           for h in range(self.H)]
        hosts = [h for h in range(self.H) for _ in range(self.G if flat else 1)]
        return FabricState(hosts, nic, self.intra_bw if flat else 0.0, alpha=alpha)

    def describe(self):
        return {"hosts": self.H, "nics": self.K, "ranks_per_host": self.G, "rate": self.rate,
                "efficiency": self.efficiency, "alpha": self.alpha, "intra_bw": self.intra_bw,
                "spine_bw": self.spine_bw,
                "down": [[h, k] for h in range(self.H) for k in range(self.K) if not self.up[h][k]],
                "degraded": [[h, k, self.factor[h][k]] for h in range(self.H)
                             for k in range(self.K) if self.factor[h][k] != 1.0]}
