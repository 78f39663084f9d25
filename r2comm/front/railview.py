"""Adapters between the world's view of ranks and rails and the planner's: the Topology of a
communicator's ranks and the topology() description."""
from .. import planner


def loopback_only(endpoints):
    """Every rail of these ranks' endpoints is a loopback address: one device (the CPUs),
    not several NICs."""
    # (rail addresses are dotted IPv4: 127/8 is loopback; ipaddress objects cost ~20 us each,
    # n x rails of them at start-up)
    return all(a.split(".", 1)[0] == "127" for ep in endpoints for a, _ in ep["rails"])


def host_keys(endpoints):
    """The host key of every rank's endpoint (r2comm.control.hostid; the host name for endpoints that
    predate it)."""
    return [ep.get("host_key") or ep["host"] for ep in endpoints]


def topology(endpoints, members):
    """The planner's Topology of the ranks `members` (global ranks, in communicator order)."""
    keys = host_keys(endpoints)           # once: O(n), not O(n) per member
    return planner.Topology.from_labels([keys[g] for g in members],
                                        [len(endpoints[g]["rails"]) for g in members])


def describe(topo, rank, state):
    """Communicator.topology()'s dict: topo.describe(rank), plus rails_up_per_host once the
    plans follow a rail state of the same hosts."""
    d = topo.describe(rank)
    if state is not None and topo.nhosts > 1 and \
            planner.Topology.from_labels(state.hosts).host_of == topo.host_of:
        d["rails_up_per_host"] = [sum(1 for k in range(state.nrails)
                                      if state.nic_bw(state.hosts[rs[0]], k) > 0)
                                  for rs in topo.hosts]
    return d
