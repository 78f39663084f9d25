"""Topology: which ranks share a host, and how many rails (NICs) each host has.

Built from one label per rank (the host keys gathered at bootstrap, r2comm.control.hostid, or a
RailState's `hosts`): hosts are numbered in order of their lowest rank, and a rank's local rank
is its index among its host's ranks (in rank order). Pure data, the same on every rank.

A topology is *hierarchical* when it has several hosts and some host runs several ranks: then
the planner offers the hierarchical schedules (hierarchical.py), which keep the traffic between
local ranks on the host and move each byte across the NICs once."""
from dataclasses import dataclass
from functools import cached_property

from .state import RailState, DEFAULT_BW

# bytes/s between two ranks of one host, for pricing plans before anything was measured (the
# static plans): loopback TCP moves 2-5 GB/s per pair here, shared memory more; what matters is
# that it is well above a NIC (DEFAULT_BW per rail)
INTRA_BW = 8e9


@dataclass(frozen=True)
class Topology:
    host_of: tuple                 # host index of every rank
    rails: tuple = ()              # rails (NICs) of every host, () when unknown

    @classmethod
    def from_labels(cls, labels, rails=None):
        """labels: one hashable per rank (equal = same host); rails: rails of every *rank*
        (a host gets the most any of its ranks lists), or None."""
        index, host_of = {}, []
        for lab in labels:
            if lab not in index:
                index[lab] = len(index)
            host_of.append(index[lab])
        per_host = ()
        if rails is not None:
            if len(rails) != len(host_of):
                raise ValueError(f"{len(rails)} rail counts for {len(host_of)} ranks")
            per = [0] * len(index)
            for r, k in enumerate(rails):
                per[host_of[r]] = max(per[host_of[r]], int(k))
            per_host = tuple(per)
        return cls(tuple(host_of), per_host)

    @classmethod
    def from_state(cls, state):
        """The topology of a RailState (its hosts; rails: its nrails on every host)."""
        if hasattr(state, "host_indices"):            # NicRailState: already numbered
            host_of = tuple(state.host_indices())
            return cls(host_of, (state.nrails,) * (max(host_of, default=-1) + 1))
        t = cls.from_labels(state.hosts)
        return cls(t.host_of, (state.nrails,) * t.nhosts)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def n(self):
        return len(self.host_of)

    @cached_property
    def nhosts(self):
        return max(self.host_of, default=-1) + 1

    @cached_property
    def _hosts(self):
        out = [[] for _ in range(self.nhosts)]
        for r, h in enumerate(self.host_of):
            out[h].append(r)
        return out

    @property
    def hosts(self):
        """Ranks of every host, in rank order (a list of lists; computed once, O(n))."""
        return self._hosts

    @cached_property
    def max_local(self):
        """The most ranks any host runs."""
        return max((len(rs) for rs in self._hosts), default=0)

    def local_rank(self, rank):
        return self._hosts[self.host_of[rank]].index(rank)

    def local_size(self, rank):
        return len(self._hosts[self.host_of[rank]])

    @property
    def regular(self):
        """Every host runs the same number of ranks."""
        return len({len(rs) for rs in self._hosts}) <= 1

    @property
    def hierarchical(self):
        """Several hosts, and some host runs several ranks."""
        return self.nhosts > 1 and self.nhosts < self.n

    def fingerprint(self):
        return (self.host_of, self.rails)

    def describe(self, rank=None):
        """A dict for people and comm.topology(): hosts (ranks of each), rails per host, and
        with `rank` that rank's host, local rank and local size."""
        d = {"nhosts": self.nhosts, "hosts": self.hosts,
             "rails_per_host": list(self.rails) if self.rails else None,
             "regular": self.regular, "hierarchical": self.hierarchical}
        if rank is not None:
            d.update(rank=rank, host=self.host_of[rank], local_rank=self.local_rank(rank),
                     local_size=self.local_size(rank))
        return d

    def default_state(self, nrails=None, bw=DEFAULT_BW, intra_bw=INTRA_BW):
        """The RailState plans are priced on before anything is measured: every NIC at `bw`
        per rail, ranks of one host at `intra_bw` (spread over the rails)."""
        k = nrails if nrails is not None else (min(self.rails) if self.rails else 1)
        k = max(1, int(k))
        st = RailState.uniform(self.n, k, bw, hosts=list(self.host_of))
        for a in range(self.n):
            for b in range(self.n):
                if a != b and self.host_of[a] == self.host_of[b]:
                    for j in range(k):
                        st.link[(a, b, j)] = (True, float(intra_bw) / k)
        return st
