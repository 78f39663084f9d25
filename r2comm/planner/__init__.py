"""Planner: chooses an algorithm per operation and size and builds its schedule.

Pure Python and socket-free, so tests and a simulator can use it directly.

Without a RailState the planner is static (ring / recursive doubling by size). With one
(`state=`, the same on every rank) it is bandwidth-aware: build() prices every candidate of every
collective in closed form (price.py) and builds only the calling rank's schedule; messages over
broken pairs are relayed (routing.py: up to RELAY_ALL_MAX ranks over every rank's schedules,
priced by cost.py; above, per rank). "degraded" (degraded.py) keeps a slow host off the critical
path, and "treefold" (treefold.py) does so with a pipeline depth of log H; both are chosen where
they cost least.

Hosts. With a topology (topology.py: which ranks share a host, `topo=` without a RailState; a
RailState's `hosts` with one) where several hosts run several ranks, the hierarchical schedules
(hierarchical.py) are candidates too, for allreduce, allgather, reduce_scatter_block and bcast:
without a RailState the static flat plan and the hierarchical one are priced on the topology's
default state (NICs at DEFAULT_BW per rail, local pairs at topology.INTRA_BW) and the cheaper one
is used; with a RailState, choose() prices them among the other candidates. algo "hierarchical"
forces it where the topology allows one (otherwise the flat plan is used), "flat" excludes it."""
import math

from . import algorithms, cost, degraded, hierarchical, price, routing
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_REV, REDUCE_SEND, REDUCE_SEND_REV
from .state import NicRailState, RailState, PartitionedError
from .topology import Topology, INTRA_BW
from .state import DEFAULT_BW, DEFAULT_ALPHA, DEFAULT_CHUNK

ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "rabenseifner", "degraded", "ring_rerouted",
                   "hierarchical", "hierarchical_tree", "flat", "treefold", "direct")
HIER_ALGOS = ("hierarchical", "hierarchical_tree")
GENERIC_ALGOS = ("hierarchical", "flat")               # mean something for every collective
STATE_ALGOS = ("degraded", "ring_rerouted", "treefold", "direct")   # need a RailState
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


def clear_caches():
    """Forget every plan, choice, price net and template this process cached, and empty every
    functools cache of the planner's modules (second_tree, tree_units, ...): the next plan is
    cold."""
    for cache in (_CACHE, _CHOICE, _NETS, _TEMPLATES):
        cache.clear()
    for fn in lru_caches():
        fn.cache_clear()


def lru_caches():
    """Every functools cache (lru_cache, cache) defined in the planner's modules."""
    import sys
    out = []
    for name, mod in sorted(sys.modules.items()):
        if mod is None or not (name == __name__ or name.startswith(__name__ + ".")):
            continue
        for obj in vars(mod).values():
            if callable(getattr(obj, "cache_clear", None)) and \
                    getattr(obj, "__module__", None) == name and obj not in out:
                out.append(obj)
    return out


_CACHE_MAX = 128
_CHOICE = {}                # size class -> (algorithm, how to build it): planner.build's plans
_CHOICE_MAX = 4096
_NETS = {}                  # fingerprint -> price.Net


def allreduce_algos():
    """The allreduce algorithms R2COMM_ALGO may force: ALLREDUCE_ALGOS (the built-in ones) and
    every candidate registered with price.register since (so a new candidate needs nothing
    else)."""
    return ALLREDUCE_ALGOS + tuple(n for n in price.REGISTRY if n not in ALLREDUCE_ALGOS)


def _check_forced(coll, algo):
    if coll == "allreduce" and algo not in ("", *allreduce_algos()):
        raise ValueError(f"R2COMM_ALGO={algo!r}: allreduce algorithms are {allreduce_algos()}")


def allreduce(rank, n, nbytes, itemsize, eager, algo="", state=None, separate_send=False):
    _check_forced("allreduce", algo)
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


def size_class(n, nbytes, eager):
    """Sizes that get the same plan structure: a quarter of an octave of nbytes, and the same
    side of every threshold a static rule or an owned (eager) message depends on."""
    q = int(4 * math.log2(nbytes)) if nbytes > 0 else -1
    return (q, nbytes <= eager, nbytes // max(n, 1) <= eager, latency_allreduce(n, nbytes, eager),
            halving_allreduce(n, nbytes, eager))


def _remember(key, value):
    if len(_CHOICE) >= _CHOICE_MAX:
        _CHOICE.clear()
    _CHOICE[key] = value
    return value


def build(coll, rank, n, nbytes, itemsize, root, eager, algo="", state=None,
          separate_send=False, topo=None):
    """Schedule for one rank. nbytes is the per-rank message size (a block for the
    block-wise collectives). With a RailState the schedule is re-planned for it: algo ""
    picks the cheapest candidate (choose()), and messages over broken pairs are relayed.
    separate_send: the send buffer is not the result buffer (not IN_PLACE), which lets some
    schedules read their input from it instead of a copy (Schedule.fills_work).
    topo: the Topology (used without a RailState; a RailState carries its own hosts).

    Only this rank's schedule is built (in time proportional to its length), for every
    collective, wherever no pair is broken or above RELAY_ALL_MAX ranks (then relayed from the
    schedules of the ranks with a broken pair alone): the algorithm is chosen by the
    closed-form prices of price.py, once per size class (size_class()) of the arguments, so a
    new size of a known class only builds."""
    if state is None:
        if coll == "allreduce" and not algo and topo is not None and topo.nhosts == 1 and \
                halving_allreduce(n, nbytes, eager):
            algo = "rabenseifner"
        if topo is not None and algo in ("", *HIER_ALGOS) and \
                hierarchical.applicable(coll, topo, algo):
            if topo.n != n:
                raise ValueError(f"the topology describes {topo.n} ranks, the communicator "
                                 f"has {n}")
            key = ("topo", coll, n, itemsize, root, eager, algo, topo.fingerprint(),
                   separate_send, size_class(n, nbytes, eager))
            name = _CHOICE.get(key)
            if name is None:
                name = _remember(key, _choose_topo(coll, n, nbytes, root, eager, algo, topo))
            s = _build_or_resize(key + (rank, name), coll, rank, name, n, nbytes, itemsize, root,
                                 eager, separate_send, topo)
            s.cost = _topo_price(coll, name, n, nbytes, root, eager, topo)
            return s
        return _static(coll, rank, n, nbytes, itemsize, root, eager, algo, separate_send)
    _check_forced(coll, algo)
    if state.n != n:
        raise ValueError(f"RailState describes {state.n} ranks, the communicator has {n}")
    broken = state.has_broken_pairs()
    if broken and n <= RELAY_ALL_MAX:
        return build_all(coll, n, nbytes, itemsize, root, eager, algo, state,
                         separate_send)[rank].copy()
    net = _net(state)
    key = ("state", coll, n, itemsize, root, eager, algo, net.key, separate_send,
           size_class(n, nbytes, eager))
    name = _CHOICE.get(key)
    if name is None:
        if broken:
            state.check_connected()
        name = _remember(key, _choose_state(coll, n, nbytes, root, algo, state, net))
    topo = _state_topo(state) if name in HIER_ALGOS else None
    if broken:
        s = routing.relay_rank(rank, lambda r: _build_rank(
            coll, r, name, n, nbytes, itemsize, root, eager, separate_send, topo, state),
            _broken_ranks(state, net), state).validate()
    else:
        s = _build_or_resize(key + (rank, name), coll, rank, name, n, nbytes, itemsize, root,
                             eager, separate_send, topo, state)
    s.cost = _state_price(coll, name, net, nbytes, root, state)
    return s


RELAY_ALL_MAX = 64          # ranks: with a broken pair, up to here every rank's schedules are
                            # relayed and priced by cost.py (build_all); above, this rank's
                            # alone (routing.relay_rank), the plan chosen by the closed forms,
                            # which do not price the relays


def _broken_ranks(state, net):
    """state.broken_ranks(), found once per state summary."""
    out = getattr(net, "broken_ranks", None)
    if out is None:
        out = net.broken_ranks = state.broken_ranks()
    return out


def _choose_state(coll, n, nbytes, root, algo, state, net):
    """The algorithm build() runs on a state with no broken pair: `algo` where it names one
    that applies, else the cheapest candidate by its closed-form price (price.py)."""
    if coll == "allreduce":
        if algo in ("", "flat") or (algo in HIER_ALGOS and net.H in (1, n)):
            return price.cheapest(_allreduce_prices(net, nbytes, flat_only=algo == "flat",
                                                    state=state))
        return algo
    hier = hierarchical.applicable(coll, _state_topo(state))
    if algo == "hierarchical" or (algo == "" and not hier):
        return "hierarchical" if hier else "flat"
    if algo == "flat":
        return "flat"
    return price.cheapest({a: price.collective(coll, a, net, nbytes, root)
                           for a in ("flat", "hierarchical")})


def _state_price(coll, name, net, nbytes, root, state):
    """Closed-form seconds of the named plan (a schedule's .cost)."""
    if coll == "allreduce":
        return _allreduce_prices(net, nbytes, names=(name,), state=state).get(name, 0.0)
    return price.collective(coll, name, net, nbytes, root)


_TEMPLATES = {}             # size class + rank -> (nbytes, Schedule) of the long schedules


def _build_or_resize(key, coll, rank, name, n, nbytes, itemsize, root, eager, separate_send,
                     topo, state=None):
    """_build_rank(), or for a hierarchical allreduce of a size class already built on this
    rank, that schedule moved to the new size's regions (hierarchical.resize: no rebuilding)."""
    if coll == "allreduce" and name == "hierarchical":
        hit = _TEMPLATES.get(key)
        if hit is not None:
            s = hierarchical.resize(hit[1], topo, hit[0], nbytes, itemsize, eager)
            if s is not None:
                return s.validate()
    s = _build_rank(coll, rank, name, n, nbytes, itemsize, root, eager, separate_send, topo,
                    state).validate()
    if coll == "allreduce" and name == "hierarchical":
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[key] = (nbytes, s)
    return s


def _state_topo(state):
    """Topology.from_state(), made once per state object."""
    derived = getattr(state, "derived", None)      # (a RailState's; any other state: none)
    t = None if derived is None else derived.get("topology")
    if t is None:
        t = Topology.from_state(state)
        if derived is not None:
            derived["topology"] = t
    return t


def _net(state):
    """price.Net of a RailState, made once per fingerprint."""
    fp = state.fingerprint()
    net = _NETS.get(fp)
    if net is None:
        if len(_NETS) >= 64:
            _NETS.clear()
        net = _NETS[fp] = price.Net.from_state(state)
        net.key = fp
    return net


def _topo_net(topo):
    key = ("topo", topo.fingerprint())
    net = _NETS.get(key)
    if net is None:
        if len(_NETS) >= 64:
            _NETS.clear()
        net = _NETS[key] = price.Net.from_topology(topo, DEFAULT_BW, INTRA_BW, DEFAULT_ALPHA,
                                                   DEFAULT_CHUNK)
        net.key = key
    return net


def _allreduce_prices(net, nbytes, names=None, flat_only=False, state=None):
    """{name: closed-form seconds} of the allreduce candidates (`names` only, where given);
    with `state` (no pair broken) also ring_rerouted where _needs_reroute(state)."""
    costs = price.prices("allreduce", net, nbytes, names)
    if state is not None and (names is None or "ring_rerouted" in names) and \
            _needs_reroute(state):
        costs["ring_rerouted"] = price.ring(net, nbytes, _reroute_order(state, net))
    if flat_only:
        costs = {a: c for a, c in costs.items() if a not in HIER_ALGOS} or costs
    return costs


def _static_name(coll, n, nbytes, eager):
    """The name of the static flat plan _static() builds."""
    if coll != "allreduce":
        return "flat"
    return "recursive_doubling" if latency_allreduce(n, nbytes, eager) else "ring"


def _topo_price(coll, name, n, nbytes, root, eager, topo):
    net = _topo_net(topo)
    if coll == "allreduce":
        return _allreduce_prices(net, nbytes, names=(name,)).get(name, math.inf)
    return price.collective(coll, name, net, nbytes, root)


def _choose_topo(coll, n, nbytes, root, eager, algo, topo):
    """Without a RailState: the static flat plan or a hierarchical one, by their closed-form
    prices on the topology's default figures (algo "hierarchical": one of those)."""
    names = [a for a in HIER_ALGOS if hierarchical.applicable(coll, topo, a)] \
        if coll == "allreduce" else ["hierarchical"]
    if algo in HIER_ALGOS and coll == "allreduce":
        names = [algo] if algo == "hierarchical_tree" else names
    elif algo == "":
        names = [_static_name(coll, n, nbytes, eager)] + names
    costs = {a: _topo_price(coll, a, n, nbytes, root, eager, topo) for a in names}
    costs = {a: c for a, c in costs.items() if c < math.inf}
    return price.cheapest(costs) if costs else names[0]


def _build_rank(coll, rank, name, n, nbytes, itemsize, root, eager, separate_send, topo,
                state=None):
    """One rank's schedule of the named algorithm (no pair broken)."""
    if name == "hierarchical_tree":
        return hierarchical.tree_allreduce(rank, topo, nbytes, itemsize, eager)
    if name == "hierarchical":
        return hierarchical.build(coll, rank, topo, nbytes, itemsize, root, eager)
    cand = price.REGISTRY.get(name)
    if cand is not None and cand.build is not None:
        return cand.build(rank, _net(state) if state is not None else _topo_net(topo), nbytes,
                          itemsize, eager)
    if coll == "allreduce" and name == "degraded":
        deg = state.degraded_ranks()
        ok = [r for r in range(n) if r not in deg]
        return degraded.allreduce_degraded(
            rank, n, nbytes, itemsize, eager, state, degraded=deg,
            frac=degraded.state_fraction(state), order_all=_ring_order(state),
            order_ok=_ring_order(state, ok))
    if coll == "allreduce" and name == "ring":
        return routing.allreduce_ring_ordered(rank, list(range(n)), nbytes, itemsize, eager,
                                              "ring")
    if coll == "allreduce" and name == "ring_rerouted":
        return routing.allreduce_ring_ordered(rank, _reroute_order(state, _net(state)), nbytes,
                                              itemsize, eager)
    if coll == "allreduce" and name == "recursive_doubling":
        return algorithms.allreduce_rd(rank, n, nbytes, itemsize, separate_send, eager)
    if coll == "allreduce" and name == "rabenseifner" and not n & (n - 1):
        return algorithms.allreduce_halving(rank, n, nbytes, itemsize, eager)
    return _static(coll, rank, n, nbytes, itemsize, root, eager,
                   "" if name in ("flat", "rabenseifner") else name, separate_send)


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
    if algo in HIER_ALGOS and hierarchical.applicable(coll, Topology.from_state(state)):
        topo = Topology.from_state(state)
        if coll == "allreduce" and algo == "hierarchical_tree":
            sc = [hierarchical.tree_allreduce(r, topo, nbytes, itemsize, eager) for r in range(n)]
        else:
            sc = [hierarchical.build(coll, r, topo, nbytes, itemsize, root, eager)
                  for r in range(n)]
    elif coll == "allreduce" and algo in price.REGISTRY and \
            price.REGISTRY[algo].build is not None:
        net = _net(state)
        sc = [price.REGISTRY[algo].build(r, net, nbytes, itemsize, eager) for r in range(n)]
    elif coll == "allreduce" and algo == "degraded":
        deg = state.degraded_ranks()
        ok = [r for r in range(n) if r not in deg]
        kw = dict(degraded=deg, frac=degraded.state_fraction(state),
                  order_all=_ring_order(state),
                  order_ok=_ring_order(state, ok) if ok else None)
        sc = [degraded.allreduce_degraded(r, n, nbytes, itemsize, eager, state, **kw)
              for r in range(n)]
    elif coll == "allreduce" and algo == "ring_rerouted":
        order = _reroute_order(state, _net(state))
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


RING_SEARCH_MAX = 64     # ranks: above, rings follow rank order (no Hamiltonian search)


def _ring_order(state, members=None):
    """routing.best_ring_order() for up to RING_SEARCH_MAX ranks; the members in rank order
    above that, where the search's O(n^2) pair scan is unaffordable and a host-level rail state
    leaves nothing for it to find (every ring passes the slowest host; a broken pair is
    relayed)."""
    if state.n <= RING_SEARCH_MAX:
        return routing.best_ring_order(state, members)
    return list(range(state.n)) if members is None else sorted(members)


def _reroute_order(state, net):
    """routing.best_ring_order(state): ring_rerouted's order, found once per state summary."""
    order = getattr(net, "reroute_order", None)
    if order is None:
        order = net.reroute_order = routing.best_ring_order(state)
    return order


def _needs_reroute(state):
    """Whether ring_rerouted is a candidate: up to RING_SEARCH_MAX ranks, a broken pair or a
    ring order faster than rank order. Not for a state held per host and NIC with no per-pair
    exception: every ring passes the slowest host there, and the search's per-pair figures
    miss that ranks of one host share its NICs (at 8 hosts x 8 ranks with a NIC down it found
    an order through every host eight times, priced far slower by cost.py, at 120 ms of a
    first plan)."""
    n = state.n
    if state.has_broken_pairs():
        return n <= RING_SEARCH_MAX
    if isinstance(state, NicRailState) and not state.exceptions:
        return False
    return n <= RING_SEARCH_MAX and routing.ring_order(state) not in (None, list(range(n)))


def candidates(coll, n, state):
    """The algorithm names choose() compares for `coll` on `state` ("flat": the static plan
    of a collective other than allreduce): the registered closed-form candidates that apply
    (price.REGISTRY), and ring_rerouted where a ring in rank order would cross a broken pair
    or a slower link than needed."""
    if coll != "allreduce":
        hier = hierarchical.applicable(coll, Topology.from_state(state))
        return ["flat", "hierarchical"] if hier else [""]
    out = [a for a, c in price.REGISTRY.items() if c.applies(coll, _net(state))]
    if _needs_reroute(state):
        out.append("ring_rerouted")
    return out


def evaluate(coll, n, nbytes, itemsize, state, root=0, eager=DEFAULT_EAGER):
    """{algorithm: predicted seconds} over candidates(coll, n, state): the closed-form prices
    (price.py) where no pair is broken or above RELAY_ALL_MAX ranks (the relays unpriced);
    otherwise cost.py's model over every rank's relayed schedules."""
    names = candidates(coll, n, state)
    if not state.has_broken_pairs() or n > RELAY_ALL_MAX:
        net = _net(state)
        if coll == "allreduce":
            costs = _allreduce_prices(net, nbytes, state=state)
            return {a: costs[a] for a in names if a in costs}
        return {a: price.collective(coll, a or "flat", net, nbytes, root) for a in names}
    return {a: build_all(coll, n, nbytes, itemsize, root, eager, a, state)[0].cost
            for a in names}


def choose(coll, n, nbytes, itemsize, state, root=0, eager=DEFAULT_EAGER, flat_only=False):
    """The algorithm with the lowest predicted time on `state` (ties: the earlier candidate,
    i.e. the plain ring first; flat_only: not a hierarchical one). Raises PartitionedError
    when no schedule can reach every rank."""
    if state.n != n:
        raise ValueError(f"RailState describes {state.n} ranks, the communicator has {n}")
    state.check_connected()
    costs = evaluate(coll, n, nbytes, itemsize, state, root, eager)
    if flat_only:
        costs = {a: c for a, c in costs.items() if a not in HIER_ALGOS}
    return price.cheapest(costs)


def build_all(coll, n, nbytes, itemsize, root=0, eager=DEFAULT_EAGER, algo="", state=None,
              separate_send=False):
    """Every rank's schedule (a list indexed by rank), each with .cost = the predicted seconds
    of the whole set. Cached per (arguments, state fingerprint); callers must not modify them."""
    if state is None:
        return [_static(coll, r, n, nbytes, itemsize, root, eager, algo, separate_send)
                for r in range(n)]
    _check_forced(coll, algo)
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
