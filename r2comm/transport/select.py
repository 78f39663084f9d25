"""What the communicator asks of a job's transports, by name: one JobTransports object per job
(for_job), built from the bootstrap outcome, answers which peers share this host's memory
links, how many data rails each peer has, the rail-deadline floor of the transport, the
registration cache of zero-copy sends, and the per-rail summaries. The communicator and its
world never name a transport; this asks the kinds' objects (r2comm.transport: LOCAL for the
local peers, the NIC kind bootstrap decided for the rails) and branches on no kind's name."""
from . import LOCAL, kind_of, rails


class JobTransports:
    """The transports of one job, seen from this rank (boot: bootstrap.run's outcome)."""

    def __init__(self, boot, cfg):
        self.boot = boot
        self.cfg = cfg
        self.kind = boot.transport              # the NIC rails' kind (its name)
        self.nic = kind_of(self.kind)
        self.local = LOCAL

    def prepare(self):
        """Before the engine: clean up what crashed jobs left (shared-memory segments)."""
        for k in (self.local, self.nic):
            k.prepare(self.cfg)

    def min_rail_timeout_ms(self):
        """The shortest rail deadline the NIC rails tolerate (0: no floor; a verbs queue pair
        retransmits a lost packet only after its local ACK timeout: a shorter deadline would
        fail healthy rails)."""
        return self.nic.min_rail_timeout_ms()

    def is_local(self, peer):
        """This rank reaches global rank `peer` through a local link (no NIC)."""
        return self.local.is_local(self.boot.endpoints, self.boot.rank, peer)

    def local_peers(self):
        """The global ranks this rank reaches through local links."""
        return self.local.local_peers(self.boot.endpoints, self.boot.rank)

    def data_rails(self):
        """The number of data links to every global rank (0 for itself), for the engine."""
        me, eps = self.boot.rank, self.boot.endpoints
        return [0 if j == me else 1 if self.is_local(j) else
                min(len(self.boot.rail_addrs), len(ep["rails"])) for j, ep in enumerate(eps)]

    def attach(self, engine):
        """Tell the engine which links are memory links (NIC faults do not apply to them)."""
        for j in self.local_peers():
            engine.links.set_shm_peer(j)

    def registration_cache(self):
        """The NIC kind's cache that registers user memory for zero-copy sends, or None where
        sends always copy."""
        return self.nic.registration_cache(self.boot, self.cfg)

    def nic_rails(self, engine, peers):
        """This rank's rails.Rail per NIC rail, summed over global ranks `peers` (the memory
        links' peers left out)."""
        remote = [g for g in peers if g != self.boot.rank and not self.is_local(g)]
        return rails.summarize(rails.rail_stats(engine), remote, self.boot.rail_addrs, self.kind,
                               self.boot.rail_devices)

    def memory_links(self, engine, peers):
        """{i: {"state", "bytes_sent", "bytes_recv", "failures", "transport"}} of the memory
        links to `peers` (global ranks; i: the index in peers)."""
        stats = rails.rail_stats(engine)
        kinds = engine.links.transports()
        out = {}
        for i, g in enumerate(peers):
            if g != self.boot.rank and self.is_local(g):
                row = stats[g][0]
                out[i] = {"state": row.state, "bytes_sent": row.bytes_sent,
                          "bytes_recv": row.bytes_recv, "failures": row.failures,
                          "transport": kinds[g][0]}
        return out

    def rail_stats(self, engine, nrails):
        """engine.rail_stats() where a memory link shows as `nrails` working rails: the planner
        then prices a local pair at least like a healthy remote one (never as a pair that lost
        NICs), and NIC failures elsewhere never touch it."""
        stats = engine.rail_stats()
        for g in list(stats):
            if self.is_local(g):
                stats[g] = stats[g][:1] * nrails
        return stats


def for_job(boot, cfg):
    """The JobTransports of this job."""
    return JobTransports(boot, cfg)
