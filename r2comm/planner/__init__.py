"""Planner: chooses an algorithm per operation and size and builds its schedule.

Pure Python and socket-free, so tests and a simulator can use it directly.

Without a RailState the planner is static (ring / recursive doubling by size). With one
(`state=`, the same on every rank) it is bandwidth-aware: build() prices every candidate with the
cost model (cost.py) and routes around broken pairs (routing.py); "degraded" (degraded.py) keeps a
slow host off the critical path.

Hosts. With a topology (topology.py: which ranks share a host, `topo=` without a RailState; a
RailState's `hosts` with one) where several hosts run several ranks, the hierarchical schedules
(hierarchical.py) are candidates too, for allreduce, allgather, reduce_scatter_block and bcast:
without a RailState the static flat plan and the hierarchical one are priced on the topology's
default state (NICs at DEFAULT_BW per rail, local pairs at topology.INTRA_BW) and the cheaper one
is used; with a RailState, choose() prices them among the other candidates. algo "hierarchical"
forces it where the topology allows one (otherwise the flat plan is used), "flat" excludes it."""
from . import algorithms, cost, degraded, hierarchical, routing
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_REV, REDUCE_SEND, REDUCE_SEND_REV
from .state import RailState, PartitionedError
from .topology import Topology

ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "rabenseifner", "degraded", "ring_rerouted",
                   "hierarchical", "flat")
GENERIC_ALGOS = ("hierarchical", "flat")               # mean something for every collective
STATE_ALGOS = ("degraded", "ring_rerouted")            # need a RailState
DEFAULT_EAGER = 64 << 10
PAIR_RD_MAX = 256 << 10     # 2 ranks: recursive doubling up to here (measured crossover)


HALVING_MAX = 8 << 20       # one host, 4+ ranks: recursive halving/doubling up to here


def halving_allreduce(n, nbytes, eager):
    """Static rule for the ranks of one host, above latency_allreduce's range: with a power-of-two
    count of 4 or more, recursive halving/doubling (Rabenseifner) rather than the ring: the
    same bytes in 2·log2(n) steps instead of 2(n-1). See bench/NOTES.md for the measurement."""
    return n >= 4 and not n & (n - 1) and eager < nbytes <= HALVING_MAX


def latency_allreduce(n, nbytes, eager):
    """Static rule: recursive doubling for small messages, ring above. With 2 ranks both move
    the same bytes and recursive doubling needs one step instead of two, so it wins further
    up: on loopback 74 vs 101 us at 256 KiB, 201 vs 179 us at 512 KiB (ring ahead)."""
    return nbytes <= (max(eager, PAIR_RD_MAX) if n == 2 else eager)
_CACHE = {}
_CACHE_MAX = 128


def allreduce(rank, n, nbytes, itemsize, eager, algo="", state=None, separate_send=False):
    if algo not in ("", *ALLREDUCE_ALGOS):
        raise ValueError(f"R2COMM_ALGO={algo!r}: allreduce algorithms are {ALLREDUCE_ALGOS}")
    if state is not None:
        return build("allreduce", rank, n, nbytes, itemsize, 0, eager, algo, state, separate_send)
    if algo in STATE_ALGOS:
        raise ValueError(f"allreduce algorithm {algo!r} needs the rail state (state=RailState)")
    if algo == "recursive_doubling" or (not algo and latency_allreduce(n, nbytes, eager)):
        return algorithms.allreduce_rd(rank, n, nbytes, itemsize, separate_send, eager)
    if algo == "rabenseifner" and not n & (n - 1):     # other sizes: the ring
        return algorithms.allreduce_halving(rank, n, nbytes, itemsize, eager)
    return algorithms.allreduce_ring(rank, n, nbytes, itemsize, eager)


def _static(coll, rank, n, nbytes, itemsize, root, eager, algo, separate_send=False):
    if algo in GENERIC_ALGOS:                          # no topology here: the flat plan
        algo = ""
    if coll == "allreduce":
        return allreduce(rank, n, nbytes, itemsize, eager, algo, separate_send=separate_send)
    if coll == "barrier":
        return algorithms.allreduce_rd(rank, n, 0, 1)
    if coll == "bcast":
        return algorithms.bcast_tree(rank, n, nbytes, root, eager)
    if coll == "reduce":
        return algorithms.reduce_tree(rank, n, nbytes, root, eager)
    if coll == "allgather":
        return algorithms.allgather_ring(rank, n, nbytes, eager)
    if coll == "reduce_scatter_block":
        return algorithms.reduce_scatter_ring(rank, n, nbytes, itemsize, eager)
    if coll == "alltoall":
        return algorithms.alltoall_direct(rank, n, nbytes, eager)
    raise ValueError(f"no schedule for {coll!r}")


def build(coll, rank, n, nbytes, itemsize, root, eager, algo="", state=None,
          separate_send=False, topo=None):
    """Schedule for one rank. nbytes is the per-rank message size (a block for the
    block-wise collectives). With a RailState the schedule is re-planned for it: algo ""
    picks the cheapest candidate (choose()), and messages over broken pairs are relayed.
    separate_send: the send buffer is not the result buffer (not IN_PLACE), which lets some
    schedules read their input from it instead of a copy (Schedule.fills_work).
    topo: the Topology (used without a RailState; a RailState carries its own hosts)."""
    if state is None:
        if coll == "allreduce" and not algo and topo is not None and topo.nhosts == 1 and \
                halving_allreduce(n, nbytes, eager):
            algo = "rabenseifner"
        if topo is not None and algo in ("", "hierarchical") and \
                hierarchical.applicable(coll, topo):
            scheds = build_topo(coll, n, nbytes, itemsize, root, eager, algo, topo,
                                separate_send)
        else:
            return _static(coll, rank, n, nbytes, itemsize, root, eager, algo, separate_send)
    else:
        scheds = build_all(coll, n, nbytes, itemsize, root, eager, algo, state, separate_send)
    s = scheds[rank]
    return Schedule(s.algo, list(s.msgs), list(s.deps), s.scratch, list(s.pre), list(s.post),
                    s.cost, s.fills_work)


def build_topo(coll, n, nbytes, itemsize, root=0, eager=DEFAULT_EAGER, algo="", topo=None,
               separate_send=False):
    """Every rank's schedule without a RailState but with a hierarchical Topology: the static
    flat plan or the hierarchical one, whichever costs less on topo.default_state() (algo
    "hierarchical": that one). Each gets .cost; cached like build_all."""
    if topo.n != n:
        raise ValueError(f"the topology describes {topo.n} ranks, the communicator has {n}")
    key = ("topo", coll, n, nbytes, itemsize, root, eager, algo, topo.fingerprint(),
           separate_send)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    hier = [hierarchical.build(coll, r, topo, nbytes, itemsize, root, eager) for r in range(n)]
    st = _CACHE.get(("default_state", topo.fingerprint()))
    if st is None:
        st = _CACHE[("default_state", topo.fingerprint())] = topo.default_state()
    th = cost.predict(hier, st)
    scheds = hier
    if algo != "hierarchical":
        flat = [_static(coll, r, n, nbytes, itemsize, root, eager, "", separate_send)
                for r in range(n)]
        tf = cost.predict(flat, st)
        if th >= tf * (1 - 1e-9):
            scheds, th = flat, tf
    for s in scheds:
        s.validate()
        s.cost = th
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = scheds
    return scheds


def _candidate(coll, n, nbytes, itemsize, root, eager, algo, state, separate_send=False):
    """Every rank's schedule for one named algorithm, relayed around broken pairs."""
    if algo == "hierarchical" and hierarchical.applicable(coll, Topology.from_state(state)):
        topo = Topology.from_state(state)
        sc = [hierarchical.build(coll, r, topo, nbytes, itemsize, root, eager) for r in range(n)]
    elif coll == "allreduce" and algo == "degraded":
        deg = state.degraded_ranks()
        ok = [r for r in range(n) if r not in deg]
        kw = dict(degraded=deg, frac=degraded.state_fraction(state),
                  order_all=routing.best_ring_order(state),
                  order_ok=routing.best_ring_order(state, ok) if ok else None)
        sc = [degraded.allreduce_degraded(r, n, nbytes, itemsize, eager, state, **kw)
              for r in range(n)]
    elif coll == "allreduce" and algo == "ring_rerouted":
        order = routing.best_ring_order(state)
        sc = [routing.allreduce_ring_ordered(r, order, nbytes, itemsize, eager) for r in range(n)]
    elif coll == "allreduce" and algo in ("", "ring") and not (
            algo == "" and latency_allreduce(n, nbytes, eager)):
        sc = [routing.allreduce_ring_ordered(r, list(range(n)), nbytes, itemsize, eager, "ring")
              for r in range(n)]
    elif coll == "allreduce" and algo == "":
        sc = [algorithms.allreduce_rd(r, n, nbytes, itemsize, separate_send, eager)
              for r in range(n)]
    else:
        sc = [_static(coll, r, n, nbytes, itemsize, root, eager, algo, separate_send)
              for r in range(n)]
    return routing.relay(sc, state)


def candidates(coll, n, state):
    """The algorithm names choose() compares for `coll` on `state` ("flat": the static plan
    of a collective other than allreduce)."""
    hier = hierarchical.applicable(coll, Topology.from_state(state))
    if coll != "allreduce":
        return ["flat", "hierarchical"] if hier else [""]
    out = ["ring", "recursive_doubling"]
    if hier:
        out.append("hierarchical")
    if n > 2 and state.degraded_ranks() and len(state.degraded_ranks()) < n:
        out.append("degraded")
    if state.broken_pairs() or routing.ring_order(state) not in (None, list(range(n))):
        out.append("ring_rerouted")
    return out


def evaluate(coll, n, nbytes, itemsize, state, root=0, eager=DEFAULT_EAGER):
    """{algorithm: predicted seconds} over candidates(coll, n, state)."""
    return {a: build_all(coll, n, nbytes, itemsize, root, eager, a, state)[0].cost
            for a in candidates(coll, n, state)}


def choose(coll, n, nbytes, itemsize, state, root=0, eager=DEFAULT_EAGER, flat_only=False):
    """The algorithm with the lowest predicted time on `state` (ties: the earlier candidate,
    i.e. the plain ring first; flat_only: not the hierarchical one). Raises PartitionedError
    when no schedule can reach every rank."""
    if state.n != n:
        raise ValueError(f"RailState describes {state.n} ranks, the communicator has {n}")
    state.check_connected()
    costs = evaluate(coll, n, nbytes, itemsize, state, root, eager)
    if flat_only:
        costs = {a: c for a, c in costs.items() if a != "hierarchical"}
    best = min(costs.values())
    for a, c in costs.items():
        if c <= best * (1 + 1e-9):
            return a


def build_all(coll, n, nbytes, itemsize, root=0, eager=DEFAULT_EAGER, algo="", state=None,
              separate_send=False):
    """Every rank's schedule (a list indexed by rank), each with .cost = the predicted seconds
    of the whole set. Cached per (arguments, state fingerprint); callers must not modify them."""
    if state is None:
        return [_static(coll, r, n, nbytes, itemsize, root, eager, algo, separate_send)
                for r in range(n)]
    if coll == "allreduce" and algo not in ("", *ALLREDUCE_ALGOS):
        raise ValueError(f"R2COMM_ALGO={algo!r}: allreduce algorithms are {ALLREDUCE_ALGOS}")
    if state.n != n:
        raise ValueError(f"RailState describes {state.n} ranks, the communicator has {n}")
    key = (coll, n, nbytes, itemsize, root, eager, algo, state.fingerprint(), separate_send)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    state.check_connected()
    if algo == "hierarchical" and not hierarchical.applicable(coll, Topology.from_state(state)):
        algo = ""                               # no hierarchical plan here: plan flat
    if (algo == "" and len(candidates(coll, n, state)) > 1) or \
            (coll == "allreduce" and algo == "flat"):
        algo = choose(coll, n, nbytes, itemsize, state, root, eager, flat_only=algo == "flat")
        scheds = build_all(coll, n, nbytes, itemsize, root, eager, algo, state, separate_send)
    else:
        scheds = _candidate(coll, n, nbytes, itemsize, root, eager, algo, state, separate_send)
        t = cost.predict(scheds, state)
        for s in scheds:
            s.validate()
            s.cost = t
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = scheds
    return scheds


__all__ = ["build", "build_all", "build_topo", "choose", "evaluate", "candidates", "allreduce",
           "RailState", "Topology", "GENERIC_ALGOS",
           "PartitionedError", "Schedule", "ALLREDUCE_ALGOS", "WORK", "SEND", "SCRATCH", "COPY",
           "REDUCE", "REDUCE_REV", "REDUCE_SEND", "REDUCE_SEND_REV"]
