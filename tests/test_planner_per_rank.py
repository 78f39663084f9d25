"""Issue 39: every collective planned per rank on a rail state (this rank's schedule only, the
plan chosen by closed-form prices), the relays of broken pairs per rank, point-to-point routes
per host, cold caches, and the degraded test at tolerance 0.02 (a host that lost 1 of 8 NICs)."""
import random

import pytest

from r2comm import planner
from r2comm.planner import cost, price, routing
from r2comm.planner.state import NicRailState, RailState
from r2comm.planner.topology import INTRA_BW, DEFAULT_BW

from test_planner import consistent, check_allreduce, inputs

MB = 1 << 20
COLLS = (("allreduce", 4096), ("allreduce", 4 * MB), ("allgather", 64 << 10),
         ("reduce_scatter_block", 64 << 10), ("bcast", 4 * MB), ("reduce", 4 * MB),
         ("alltoall", 4096), ("barrier", 0))


def nic_state(H, G, K=8, slow=0.0, tol=0.02, intra=INTRA_BW):
    """H hosts x G ranks, K NICs at DEFAULT_BW, NIC 3 % K of host H // 2 at `slow` of it."""
    nic = [[DEFAULT_BW] * K for _ in range(H)]
    nic[H // 2][3 % K] = slow * DEFAULT_BW
    return NicRailState([r // G for r in range(H * G)], nic, intra, degraded_tol=tol)


def _states():
    dense = RailState.uniform(6, 2, hosts=[0, 0, 1, 1, 2, 2])
    dense.fail_rail(2, 1)
    dense.fail_rail(3, 1)
    slow_pair = RailState.uniform(5, 1, bw=1e9)
    slow_pair.set_link(0, 1, 0, bw=1e8)                 # ring_rerouted, priced in closed form
    exc = nic_state(3, 2, K=2, slow=1.0)
    exc.set_link(0, 1, 0, bw=1e6)                       # a slow path inside host 0
    return [nic_state(4, 2), nic_state(4, 2, slow=0.5), nic_state(6, 1, K=2),
            nic_state(3, 4, K=2, slow=1.0), dense, slow_pair, exc]


@pytest.mark.parametrize("st", _states(), ids=lambda s: f"{type(s).__name__}{s.n}")
def test_per_rank_plan_equals_every_rank_plan(st):
    """No pair broken: each rank's build() is exactly the schedule build_all() gives it for the
    algorithm chosen, for every collective, and the choice is choose()'s."""
    n = st.n
    for coll, nb in COLLS:
        for root in ((0, n - 1) if coll in ("bcast", "reduce") else (0,)):
            planner.clear_caches()
            mine = [planner.build(coll, r, n, nb, 4, root, 64 << 10, state=st) for r in range(n)]
            algo = mine[0].algo
            assert {s.algo for s in mine} == {algo}, coll
            assert consistent(mine)
            want = planner.choose(coll, n, nb, 4, st, root, 64 << 10)
            every = planner.build_all(coll, n, nb, 4, root, 64 << 10, want, st)
            assert every[0].algo == algo, (coll, want, algo)
            for r in range(n):
                a, b = mine[r], every[r]
                assert (a.msgs, a.deps, a.scratch, a.pre, a.post, a.fills_work) == \
                    (b.msgs, b.deps, b.scratch, b.pre, b.post, b.fills_work), (coll, r)
            assert mine[0].cost == pytest.approx(
                planner.evaluate(coll, n, nb, 4, st, root, 64 << 10)[want])


@pytest.mark.parametrize("slow", [0.0, 0.5])
def test_first_plans_at_1024_ranks_build_no_other_rank(monkeypatch, slow):
    """128 hosts x 8 ranks, a NIC down or at half its rate: the first plan of every collective
    on a cold planner neither builds every rank's schedules nor runs cost.py's model."""
    st = nic_state(128, 8, slow=slow)

    def refuse(*a, **kw):
        raise AssertionError("every rank's schedules built or priced")
    for mod, name in ((planner, "build_all"), (planner, "_candidate"), (cost, "predict"),
                      (cost, "analyse"), (routing, "relay")):
        monkeypatch.setattr(mod, name, refuse)
    for coll, nb in COLLS:
        planner.clear_caches()
        s = planner.build(coll, 5, st.n, nb, 4, 0, 64 << 10, state=st)
        assert s.msgs and s.cost > 0 or coll == "barrier", coll


def test_clear_caches_leaves_every_functools_cache_empty():
    """The lru caches of treefold.py, price.py and direct.py (and any other planner module's)
    are empty after clear_caches(): the next plan is cold."""
    import importlib
    import pkgutil
    from r2comm.planner import direct, treefold
    st = nic_state(8, 1, K=2)
    planner.build("allreduce", 0, 8, 64 * MB, 4, 0, 64 << 10, algo="treefold", state=st)
    price.tree_units(9)
    direct._shares((1.0, 2.0, 2.0), (0,))
    treefold.max_degree(40, 2)
    found = []
    for m in pkgutil.iter_modules(planner.__path__):
        mod = importlib.import_module(f"r2comm.planner.{m.name}")
        found += [f for f in vars(mod).values() if hasattr(f, "cache_info")]
    assert {f.__name__ for f in found} >= {"second_tree", "_inverse", "max_degree",
                                           "tree_units", "_shares"}
    assert any(f.cache_info().currsize for f in found)
    planner.clear_caches()
    assert [f.__name__ for f in found if f.cache_info().currsize] == []


def test_losing_one_of_eight_nics_reaches_the_tree_fold():
    """A NIC announced down (or at half its rate) makes its host degraded at tolerance 0.02: at
    64 hosts x 8 NICs the planner picks the tree fold, priced 8-14% below the ring (the ring
    passes the slow host: 2(n-1)/n N at 7/8 of its rate or less) and far below recursive
    doubling; at the measurement-noise tolerance (0.3) the same state counted as healthy and
    got a ring-type plan (replayed at 1.25 T*: issue 39)."""
    for slow in (0.0, 0.5):
        st = nic_state(64, 1, slow=slow)
        assert st.degraded_ranks() == [32]
        costs = planner.evaluate("allreduce", 64, 256 * MB, 4, st)
        assert planner.choose("allreduce", 64, 256 * MB, 4, st) == "treefold"
        assert costs["treefold"] < 0.95 * min(costs["ring"], costs["recursive_doubling"])
        s = planner.build("allreduce", 7, 64, 256 * MB, 4, 0, 64 << 10, state=st)
        assert s.algo == "treefold"
        loose = nic_state(64, 1, slow=slow, tol=0.3)
        assert not loose.degraded_ranks()
        assert planner.choose("allreduce", 64, 256 * MB, 4, loose) in ("ring",
                                                                       "recursive_doubling")


@pytest.mark.parametrize("H", [32, pytest.param(64, marks=pytest.mark.slow)])
def test_one_of_eight_nics_down_replays_within_5_percent_of_the_bound(H):
    """The plan build() picks (not forced) with one NIC of 8 down, replayed exactly: within
    1.05 T* (bench/SIM.md: the weighted direct schedule up to 32 hosts, the tree fold above,
    1.038 at 64 hosts)."""
    from r2comm.sim import sweep
    r = sweep.bound_case(H, 0.0, nics=8)
    assert r["chosen"] in ("direct", "treefold") and r["ratio"] <= 1.05, r


# (hosts, ranks per host, NICs, loss of NIC 0 of the last host, NIC rate, collective, bytes):
# points where the topology path's old closed forms chose the plan that replays slower (the
# hierarchical allgather priced as its two phases one after the other, 1.43-1.52x; the
# hierarchical bcast's root NIC shared by log2 H children, flat chosen at 2.2-2.7x)
CHOICE_POINTS = ((2, 2, 8, 0.0, 1.25e9, "allgather", 4 * MB),
                 (3, 4, 8, 1.0, 1.25e9, "allgather", 4 * MB),
                 (4, 2, 2, 1.0, 1.25e9, "bcast", 4 * MB),
                 (3, 4, 2, 1.0, 1.25e9, "bcast", 4 * MB))


@pytest.mark.parametrize("point", CHOICE_POINTS, ids=lambda p: f"{p[5]}-{p[0]}x{p[1]}")
def test_collective_choice_against_the_replay(point):
    """Flat or hierarchical, chosen by price.collective(): within 5% of the faster one's exact
    replay (over 1,008 points of 2-16 hosts x 2-8 ranks: allgather 1.000 worst, as cost.py's
    choice; reduce_scatter 1.124, as cost.py's; bcast 1.188 against cost.py's 1.380)."""
    from r2comm.sim import sweep
    r = sweep.collective_case(*point)
    assert r["ratio"] <= 1.05, r


def _broken_state(rng, H, G, K):
    nic = [[DEFAULT_BW] * K for _ in range(H)]
    a, b = rng.sample(range(H), 2)
    nic[a][0] = 0.0                               # hosts a and b share no NIC
    for k in range(1, K):
        nic[b][k] = 0.0
    st = NicRailState([r // G for r in range(H * G)], nic, INTRA_BW)
    if rng.random() < 0.5:
        x, y = rng.sample(range(H * G), 2)
        st.set_link(x, y, rng.randrange(K), up=False)
    return st


def test_relay_of_one_rank_equals_its_share_of_the_relay_of_all():
    """routing.relay_rank(): each rank's relayed schedule from the schedules of the ranks with
    a broken pair alone equals relay() over every rank's."""
    rng = random.Random(39)
    for trial in range(12):
        st = _broken_state(rng, rng.randint(3, 6), rng.randint(1, 3), rng.choice((2, 3)))
        assert st.has_broken_pairs() and not st.partitioned()
        n = st.n
        senders = st.broken_ranks()
        for coll, algo in (("allreduce", "ring"), ("allreduce", "recursive_doubling"),
                           ("allgather", ""), ("bcast", ""), ("alltoall", "")):
            def one(r):
                return planner._static(coll, r, n, 4096, 4, 0, 0, algo)
            every = routing.relay([one(r) for r in range(n)], st)
            for r in range(n):
                got = routing.relay_rank(r, one, senders, st)
                assert (got.algo, got.msgs, got.deps, got.scratch) == \
                    (every[r].algo, every[r].msgs, every[r].deps, every[r].scratch), (trial, r)


def test_broken_pairs_above_64_ranks_relayed_per_rank(monkeypatch):
    """12 hosts x 8 ranks, two hosts with no common NIC: each rank's plan is relayed from the
    broken ranks' schedules alone (no build_all, no cost.py), uses no broken pair, and the set
    computes the allreduce exactly."""
    st = NicRailState([r // 8 for r in range(96)],
                      [[0.0, DEFAULT_BW]] + [[DEFAULT_BW] * 2] * 10 + [[DEFAULT_BW, 0.0]],
                      INTRA_BW)
    assert st.broken_ranks() == list(range(8)) + list(range(88, 96))

    def refuse(*a, **kw):
        raise AssertionError("every rank's schedules built or priced")
    monkeypatch.setattr(planner, "build_all", refuse)
    monkeypatch.setattr(cost, "predict", refuse)
    planner.clear_caches()
    got = {}
    for algo in ("", "ring", "treefold"):
        sc = got[algo] = [planner.build("allreduce", r, 96, 97 * 4, 4, 0, 0, algo, st)
                          for r in range(96)]
        assert consistent(sc) and not routing.uses_broken_pair(sc, st)
        assert sc[0].algo.endswith("+relay") or algo != "ring", sc[0].algo   # (95 -> 0)
        check_allreduce(sc, inputs(f"relay96-{algo}", 96, 97, "int32"), chunk=64, seed=1)
    monkeypatch.undo()
    for algo, sc in got.items():                  # what relay() over every rank's gives
        every = planner.build_all("allreduce", 96, 97 * 4, 4, 0, 0, algo, st)
        assert [(s.algo, s.msgs, s.deps) for s in sc] == [(s.algo, s.msgs, s.deps) for s in every]


def test_route_searches_per_host_not_per_pair(monkeypatch):
    """A point-to-point route on a NicRailState asks no rank for its neighbours (an O(n) scan,
    O(n^2) per search) and equals the route over the same state held per pair."""
    rng = random.Random(7)
    st = _broken_state(rng, 5, 2, 2)
    dense = st.to_dense()
    pairs = [(a, b) for a in range(st.n) for b in range(st.n) if a != b]
    want = {p: routing.route(dense, *p) for p in pairs}

    def refuse(*a, **kw):
        raise AssertionError("a rank's neighbours listed")
    monkeypatch.setattr(NicRailState, "neighbours", refuse)
    assert {p: routing.route(st, *p) for p in pairs} == want
    big = nic_state(1024, 8, K=2)                 # host 512's NIC 1 down
    big.nic[0] = [0.0, DEFAULT_BW]                # host 0 shares no NIC with host 512
    big = big.copy()
    assert len(routing.route(big, 3, 512 * 8 + 5)) == 3


def test_host_level_queries_answer_like_the_per_pair_state():
    """Random NicRailStates (hosts 1-6 x 1-3 ranks, 1-3 NICs, NICs down or slow, no local
    bandwidth, exceptions that break or mend pairs): broken ranks and peers, components, hop
    distances and routes under relay load equal those of the same state held per pair."""
    rng = random.Random(1)
    for trial in range(250):
        H, G, K = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 3)
        nic = [[rng.choice([0.0, 1e9, 1e9, 5e8]) for _ in range(K)] for _ in range(H)]
        st = NicRailState([h for h in range(H) for _ in range(G)], nic,
                          rng.choice([0.0, 8e9, 8e9]))
        n = st.n
        for _ in range(rng.randint(0, 3) if n > 1 else 0):
            a, b = rng.sample(range(n), 2)
            st.set_link(a, b, rng.randrange(K), up=rng.random() < 0.5,
                        bw=rng.choice([1e8, 2e9]))
        dense = st.to_dense()
        assert st.broken_ranks() == dense.broken_ranks(), trial
        assert st.components() == dense.components(), trial
        assert all(st.broken_peers(a) == dense.broken_peers(a) for a in range(n)), trial
        for b in range(n):
            hops, want = routing._hops(st, b), routing._hops(dense, b)
            assert {r: hops.get(r) for r in range(n)} == {r: want.get(r) for r in range(n)}
        if dense.partitioned() or n < 2:
            continue
        for _ in range(4):
            a, b = rng.sample(range(n), 2)
            load = {r: rng.choice([0, 100, 200]) for r in rng.sample(range(n), rng.randint(0, n))}
            assert routing.route(st, a, b, 100, dict(load)) == \
                routing.route(dense, a, b, 100, dict(load)), (trial, a, b)
