"""The planner at scale (issue 32): the double-binary-tree hierarchical allreduce exact under
adversarial interleavings, one rank's plan built alone and fast, the closed-form prices against
cost.py's model, and the choice against the simulator's replay."""
import itertools
import time

import numpy as np
import pytest

from r2comm import planner
from r2comm.planner import hierarchical, price
from r2comm.planner.topology import Topology

from test_planner import inputs, check_allreduce, consistent
from test_hierarchical import exact_both_ways, regular, tid, UNEVEN

MB = 1 << 20
TREE_TOPOS = [regular(3, 2), regular(4, 3), regular(5, 2), regular(7, 1 + 1), regular(3, 4, True),
              Topology.from_labels(UNEVEN[1]), Topology.from_labels(UNEVEN[3]),
              Topology.from_labels([0, 0, 1, 2, 3, 3, 4])]


@pytest.mark.parametrize("topo", TREE_TOPOS, ids=tid)
def test_tree_allreduce_exact(topo):
    n = topo.n
    pols = itertools.cycle(("random", "skew", "fifo"))
    for count in (1, 7, 101):
        for op, (dtype, eager) in zip(("SUM", "PROD", "MAX"), (("int32", 0), ("float64", 1 << 20),
                                                               ("uint8", 64))):
            isz = np.dtype(dtype).itemsize
            sc = [hierarchical.tree_allreduce(r, topo, count * isz, isz, eager) for r in range(n)]
            assert consistent(sc) and all(s.fills_work for s in sc)
            xs = inputs(f"tree{tid(topo)}{count}{op}", n, count, dtype, op)
            exact_both_ways(sc, xs, op, isz, count, next(pols))


def test_tree_allreduce_bits_fixed_by_the_schedule():
    topo = regular(5, 3)
    n, count = topo.n, 203
    xs = inputs("treebits", n, count, "float32", exact=False)
    sc = [hierarchical.tree_allreduce(r, topo, count * 4, 4, 0) for r in range(n)]
    first = None
    for seed, pol in enumerate(("random", "skew", "fifo", "random")):
        y = check_allreduce(sc, xs, "SUM", exact=False, chunk=8 * (seed + 1), seed=seed,
                            policy=pol)
        first = y.tobytes() if first is None else first
        assert y.tobytes() == first


def test_tree_units_each_host_an_inner_node_of_one_tree_at_most():
    for H in range(2, 70):
        u = price.tree_units(H)
        assert max(u) <= 4 and len(u) == H
        inner0 = {p for p in range(H) if 2 * p + 1 < H}
        inner1 = {H - 1 - q for q in range(H) if 2 * q + 1 < H}
        assert not inner0 & inner1


@pytest.mark.parametrize("topo", [regular(2, 3), regular(3, 4), Topology.from_labels(UNEVEN[1])],
                         ids=tid)
def test_resized_hierarchical_plan_equals_a_fresh_build(topo):
    """A later size of a size class reuses the plan's structure (hierarchical.resize): the same
    schedule as built from scratch for that size."""
    n = topo.n
    for old, new, eager in ((4000, 4004, 0), (1 << 20, (1 << 20) + 400, 64 << 10),
                            (900, 960, 64)):
        for r in range(n):
            a = hierarchical.allreduce(r, topo, old, 4, eager)
            b = hierarchical.resize(a, topo, old, new, 4, eager)
            want = hierarchical.allreduce(r, topo, new, 4, eager)
            assert b.msgs == want.msgs and b.deps == want.deps


def _sweep(points):
    """sweep.case of each point -> (rows, rows by (hosts, nics, loss, bytes))."""
    from r2comm.sim import sweep
    pts = [sweep.case(*c) for c in points]
    return pts, {(r["hosts"], r["nics"], r["loss"], r["bytes"]): r for r in pts}


NAMED = ((24, 2, 1.0, 1024 * MB), (16, 8, 1.0, 256 * MB))     # the two cases


def _heavy(c):
    """A point whose exact replay takes seconds of CPU (1 GiB, 256 MiB over 16 hosts and more:
    2-30 s each): the slow tier's full grids and test_named_cases_replay keep them."""
    return c[3] >= 1024 * MB or (c[0] >= 16 and c[3] >= 256 * MB)


def test_choice_within_3_percent_of_the_best_replay():
    """Issue 32 item 4, over a sample of hosts 3-24, NICs 2-8, loss 1/8-1 of one NIC, sizes
    1 MiB-1 GiB (the issue's two cases, the grid's corners and 12 random points, less the
    heaviest replays, _heavy: 1 GiB, 256 MiB over 16 hosts and more; the slow full grids below
    and test_named_cases_replay keep them; the two named cases' choice is checked here), judged
    by the exact
    replay: the chosen plan's replay is within 3% of the best candidate's at every point of this
    sample (1.000 at each since the per-pair rail weights of the direct schedule). At 24 hosts x
    2 NICs, 1 GiB, a NIC down, the tree fold (22.707 ms) was chosen before the direct schedule
    was offered up to 32 hosts, direct (22.649 ms) since; the weighted direct schedule at 16
    hosts x 8 NICs, 256 MiB, a NIC down (1.417 ms; tree fold 1.642, ring 2.044, degraded 2.362)."""
    from r2comm.sim import sweep
    pts, _ = _sweep([c for c in sweep.grid(12) if not _heavy(c)])
    assert max(r["ratio"] for r in pts) <= 1.03, max(pts, key=lambda r: r["ratio"])
    # the two cases, chosen as their replays showed (test_named_cases_replay replays
    # them: 34 s of CPU)
    for c, want in zip(NAMED, (("treefold", "direct"), ("direct",))):
        got = sweep.point(*c)[3]
        assert got in want, (c, got)


@pytest.mark.slow
def test_named_cases_replay():
    """The issue's two cases replayed exactly: at 24 hosts x 2 NICs, 1 GiB, a NIC down, the
    chosen plan within 0.3% of the best candidate; at 16 x 8, 256 MiB, direct."""
    _, by = _sweep(list(NAMED))
    at24 = by[NAMED[0]]
    assert at24["chosen"] in ("treefold", "direct") and at24["ratio"] <= 1.003, at24
    assert by[NAMED[1]]["chosen"] == "direct" and by[NAMED[1]]["ratio"] <= 1.03


@pytest.mark.parametrize("H,K,loss,algo,sizes", [
    (3, 2, 0.125, "ring", (2, 5, 8)), (3, 8, 0.25, "ring", (2, 8, 24)),
    (3, 8, 0.25, "direct", (1, 4, 8, 14)), (8, 2, 0.125, "direct", (1,)),
    (12, 2, 0.125, "direct", (8,)), (6, 8, 1.0, "direct", (8,)), (24, 2, 0.125, "direct", (8,))])
def test_price_where_the_steps_hide_their_latency(H, K, loss, algo, sizes):
    """Where a step's message is on the wire before the next step's first chunk is ready
    (price.hides_latency), the ring's and the direct schedule's prices equal the exact replay
    within 1% (before: every step's α on top of the bytes, and for the ring no last
    acknowledgement: ring 0.82-1.29 x the replay at these points, direct 1.02-1.33 x)."""
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    fab = _sweep_fabric(H, K, 1.0 - loss)
    st = fab.state()
    for mb in sizes:
        nb, eager = mb * MB, Config().eager
        got = planner.evaluate("allreduce", H, nb, 4, st, eager=eager)[algo]
        sc = planner.build_all("allreduce", H, nb, 4, eager=eager, algo=algo, state=st)
        t = Cluster(fab).run_schedules(sc)["time_s"]
        assert got == pytest.approx(t, rel=0.01), (mb, got, t)


def test_ring_with_a_slow_link_fed_by_faster_ones_keeps_its_latencies():
    """4 hosts x 2 NICs at 10 Gbit/s, a NIC of the last host down, 3 MiB (tests/planner_worker's
    live case): a step on the slow link is still on the wire when the fast links have the next
    step's first chunk ready, so its latencies are not hidden (ring replay 4.58 ms, volume +
    hops·α 3.93, the chain + α 3.80): the degraded schedule (3.85 ms, exact) is chosen."""
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    from r2comm.sim.fabric import Fabric
    fab = Fabric(4, 2, 1.25e9, 1, 1.0, 25e-6)
    fab.down(3, 1)
    st, nb, eager = fab.state(), 786437 * 4, Config().eager
    assert not price.ring_hides_latency(price.Net.from_state(st), nb)
    costs = planner.evaluate("allreduce", 4, nb, 4, st, eager=eager)
    replay = {a: Cluster(fab).run_schedules(planner.build_all(
        "allreduce", 4, nb, 4, eager=eager, algo=a, state=st))["time_s"] for a in costs}
    chosen = price.cheapest(costs)
    assert chosen == "degraded" and replay[chosen] <= 1.03 * min(replay.values()), (costs, replay)


def test_choice_at_the_8_mib_points_the_latencies_misranked():
    """The two grid(40) points above 1.03 before (3 hosts x 2 NICs, a NIC at 7/8, 8 MiB: direct
    chosen at 1.152 x the ring's replay; 3 x 8, a NIC at 3/4, 8 MiB: recursive doubling at 1.039
    x direct's): the best replay chosen at both."""
    from r2comm.sim import sweep
    a = sweep.case(3, 2, 0.125, 8 * MB)
    b = sweep.case(3, 8, 0.25, 8 * MB)
    assert a["chosen"] == "ring" and a["ratio"] == 1.0, a
    assert b["chosen"] == "direct" and b["ratio"] == 1.0, b


@pytest.mark.slow
def test_choice_within_3_percent_of_the_best_replay_full_grid():
    """The same over grid(40) (58 points, about 3 minutes of CPU): every choice within 3% of the
    best replay (worst 1.002). The two 8 MiB points that were above (3 hosts x 2 NICs, loss 1/8:
    1.152, direct chosen, ring best; 3 x 8, loss 1/4: 1.039, recursive doubling chosen, direct
    best) came from prices that counted every dependent step's α on top of the bytes where the
    replay hides it: a ring's or the direct schedule's step short enough to be on the wire
    before the next step's first chunk is ready (price.hides_latency) is now priced as the
    chain plus the last acknowledgement, exact in the replay (bench/SIM.md)."""
    from r2comm.sim import sweep
    pts, by = _sweep(sweep.grid(40))
    assert max(r["ratio"] for r in pts) <= 1.03, max(pts, key=lambda r: r["ratio"])
    assert by[(3, 2, 0.125, 8 * MB)]["chosen"] == "ring"
    assert by[(3, 8, 0.25, 8 * MB)]["chosen"] == "direct"


@pytest.mark.slow
def test_choice_within_3_percent_of_the_best_replay_at_32_to_128_hosts():
    """Issue 32 item 4 beyond grid()'s 3-24 hosts: sweep.big_grid() (32, 64 and 128 hosts x 2
    or 8 NICs, a NIC down or at 7/8, 8, 64 and 256 MiB; 36 points, candidates priced above 1.6x
    the chosen one's replay not replayed): every choice within 3% of the best replay."""
    from r2comm.sim import sweep
    pts, _ = _sweep(sweep.big_grid())
    assert max(r["ratio"] for r in pts) <= 1.03, max(pts, key=lambda r: r["ratio"])


def _sweep_fabric(H, K, slow_rate, alpha=25e-6):
    from r2comm.sim.fabric import Fabric
    from r2comm.sim.predict import EFFICIENCY
    fab = Fabric(H, K, 50e9, 1, EFFICIENCY, alpha)
    fab.degrade(H - 1, 0, slow_rate)
    return fab


@pytest.mark.parametrize("H,slow_rate", [(8, 0.0), (17, 0.0), (33, 0.0), (64, 0.0), (33, 0.5),
                                         (24, 0.875)])
def test_treefold_price_against_replay(H, slow_rate):
    """The tree fold's closed-form price (price.treefold) against its exact replay: within 3%
    (2 NICs, NIC 0 of the last host down or at a fraction of its rate, 256 MiB, α = 25 µs in
    the price and the fabric); with a NIC down the planner chooses it above direct.MAX_RANKS
    hosts (the weighted direct schedule, offered up to there, replays within 1.05 of T*)."""
    from r2comm.planner.direct import MAX_RANKS
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    fab = _sweep_fabric(H, 2, slow_rate)
    st = fab.state()
    nb, eager = 256 * MB, Config().eager
    got = planner.evaluate("allreduce", H, nb, 4, st, eager=eager)["treefold"]
    sc = [planner.build("allreduce", r, H, nb, 4, 0, eager, algo="treefold", state=st)
          for r in range(H)]
    t = Cluster(fab).run_schedules(sc)["time_s"]
    assert got == pytest.approx(t, rel=0.03), (got, t)
    if slow_rate == 0.0:              # at 8 hosts both are within 1.5% of T*
        want = ("treefold",) if H > MAX_RANKS else ("treefold", "degraded", "direct")
        assert planner.choose("allreduce", H, nb, 4, st, eager=eager) in want


@pytest.mark.parametrize("H", [128, pytest.param(512, marks=pytest.mark.slow)])
def test_planner_choice_within_5_percent_of_the_bound_with_a_nic_down(H):
    """Issue 32 item 3's target: at 128 and 512 hosts x 2 NICs with one NIC down, every rank's
    schedule from planner.build() (the closed-form choice: the tree fold) replays within 1.05
    of T* (256 MiB, exact replay, no latency in the fabric; the degraded schedule, chosen
    before, gives 1.25 and 2.0)."""
    from r2comm.sim import sweep
    r = sweep.bound_case(H, 0.0)
    assert r["chosen"] == "treefold" and r["ratio"] <= 1.05, r


def _ring_replay(H, K, G, loss, nb, rate):
    """The exact replay of the ring on sweep.crosscheck()'s fabric, and whether its closed-form
    price takes the steps as hiding their latencies (price.ring_hides_latency)."""
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    from r2comm.sim.fabric import Fabric
    from r2comm.sim.predict import EFFICIENCY
    fab = Fabric(H, K, rate, G, EFFICIENCY, 25e-6, intra_bw=8e9)
    fab.degrade(H - 1, 0, 1.0 - loss)
    st = fab.state(flat=G > 1)
    sc = planner.build_all("allreduce", st.n, nb, 4, eager=Config().eager, algo="ring", state=st)
    hides = price.ring_hides_latency(price.Net.from_state(st), nb)
    return Cluster(fab, flat=G > 1).run_schedules(sc)["time_s"], hides


def test_closed_form_prices_against_cost_model_and_replay():
    """Small cases (3-6 hosts x 1-2 ranks, 2 or 8 NICs at 10 or 400 Gbit/s, NIC 0 of the last
    host at 1, 1/2 or 0 of its rate, 4 KiB-64 MiB): the ring and hierarchical prices equal
    cost.py's model over every rank's schedules within 2%, except a ring between hosts whose
    multi-chunk steps hide their latencies (price.ring_hides_latency: 4 of the 36 cases, 4 MiB
    over 4 hosts), which cost.py charges every step's α and the last acknowledgement not
    (7-14% off the replay): there the price is within 4% of the replay and nearer it than
    cost.py's. Where the two pick different algorithms, the simulator replays both, and over the
    sample the closed-form choices take no longer in total than cost.py's (the replay is the
    judge: cost.py's degraded price is the one issue 32 item 4 found too low)."""
    import random
    from r2comm.sim import sweep
    grid = list(itertools.product((3, 4, 6), (2, 8), (1, 2), (0.0, 0.5, 1.0),
                                  (4096, 256 << 10, 4 * MB, 64 * MB), (1.25e9, 50e9)))
    new_total = old_total = 0.0
    hidden = 0
    for H, K, G, loss, nb, rate in random.Random(7).sample(grid, 36):
        r = sweep.crosscheck(H, K, G, loss, nb, rate=rate)
        for a in ("ring", "hierarchical", "hierarchical_tree"):
            if a not in r["new"]:
                continue
            if a == "ring" and r["new"][a] != pytest.approx(r["old"][a], rel=0.02):
                t, hides = _ring_replay(H, K, G, loss, nb, rate)
                assert hides and r["new"][a] == pytest.approx(t, rel=0.04), (t, r)
                assert abs(r["new"][a] - t) < abs(r["old"][a] - t), (t, r)
                hidden += 1
                continue
            assert r["new"][a] == pytest.approx(r["old"][a], rel=0.02), (a, r)
        if r["replay"]:
            new_total += r["replay"][r["chosen"]]
            old_total += r["replay"][r["old_choice"]]
    assert new_total <= old_total * 1.0001, (new_total, old_total)
    assert hidden <= 6, hidden


def _dense_states():
    from r2comm.planner.state import RailState
    from test_planner_measured import stats_for
    out = [RailState.uniform(5, 2)]
    st = RailState.uniform(6, 2, hosts=[0, 0, 1, 1, 2, 2])
    st.fail_rail(0, 1)
    st.fail_rail(1, 1)
    out.append(st)
    st = RailState.uniform(5, 3)
    st.break_pair(0, 3)
    st.set_link(1, 2, 0, bw=1e8)
    out.append(st)
    st = RailState.uniform(4, 2).scale_host(2, 0.5)
    out.append(st)
    out.append(RailState.from_rail_stats([0, 0, 1, 1, 2, 2], stats_for(
        6, 2, lambda r, p, k: 1e9 if r != 3 else 3e8, 0.2, 5, down={(5, 0)})))
    out.append(regular(3, 2).default_state(nrails=2))
    return out


@pytest.mark.parametrize("dense", _dense_states(), ids=lambda s: f"{s.n}r")
def test_compact_rail_state_answers_like_the_dense_one(dense):
    """Issue 32 item 2: RailState.compact() (per host and NIC plus per-pair exceptions) keeps
    the meaning: every rail, pair and host figure, the degraded and broken sets, and the plan."""
    from r2comm.planner.state import NicRailState
    c = dense.compact()
    assert isinstance(c, NicRailState) and not c.link
    n, K = dense.n, dense.nrails
    for a in range(n):
        for b in range(n):
            for k in range(K):
                assert c.rail_bw(a, b, k) == pytest.approx(dense.rail_bw(a, b, k)), (a, b, k)
            assert c.pair_bw(a, b) == pytest.approx(dense.pair_bw(a, b))
    for h in dense.host_list():
        assert c.host_bw(h) == pytest.approx(dense.host_bw(h))
    assert c.degraded_ranks() == dense.degraded_ranks()
    assert c.broken_pairs() == dense.broken_pairs()
    assert c.has_broken_pairs() == bool(dense.broken_pairs())
    assert c.healthy() == dense.healthy() and c.beta() == pytest.approx(dense.beta())
    assert len(c.exceptions) < len(dense.link)
    for nb in (4096, 4 * MB, 64 * MB):
        assert planner.choose("allreduce", n, nb, 4, c) == planner.choose("allreduce", n, nb, 4,
                                                                          dense)
        for r in range(n):
            a = planner.build("allreduce", r, n, nb, 4, 0, 64 << 10, state=c)
            b = planner.build("allreduce", r, n, nb, 4, 0, 64 << 10, state=dense)
            assert a.msgs == b.msgs and a.deps == b.deps


def test_compact_state_size_grows_with_hosts_and_changes_not_pairs():
    from r2comm.planner.state import NicRailState
    from r2comm.planner.topology import INTRA_BW
    H, G, K = 1024, 8, 8
    nic = [[1.25e9] * K for _ in range(H)]
    nic[5][3] = 0.0
    st = NicRailState([r // G for r in range(H * G)], nic, INTRA_BW)
    st.set_link(0, 100, 2, bw=1e8)                  # one slow path: one exception
    assert len(st.exceptions) == 1 and sum(map(len, st.nic)) == H * K
    assert st.rail_bw(0, 100, 2) == 1e8 and st.rail_bw(40, 8, 3) == 0.0
    assert st.degraded_ranks() == list(range(40, 48)) and not st.has_broken_pairs()
    t0 = time.perf_counter()
    s = planner.build("allreduce", 3, H * G, 64 * MB, 4, 0, 64 << 10, state=st)
    assert time.perf_counter() - t0 < 2.0 and s.hierarchical and len(s.msgs) < 100


def test_build_follows_choose_with_a_slow_pair():
    """A slow pair (no broken one): build() re-ranks the ring as choose() does."""
    from r2comm.planner.state import RailState
    st = RailState.uniform(5, 1, bw=1e9)
    st.set_link(0, 1, 0, bw=1e8)
    want = planner.choose("allreduce", 5, 64 * MB, 4, st)
    assert want == "ring_rerouted"
    for r in range(5):
        s = planner.build("allreduce", r, 5, 64 * MB, 4, 0, 64 << 10, state=st)
        ref = planner.build_all("allreduce", 5, 64 * MB, 4, eager=64 << 10, algo=want, state=st)
        assert s.algo == want and s.msgs == ref[r].msgs


def test_a_host_level_state_does_not_search_for_a_rerouted_ring(monkeypatch):
    """8 hosts x 8 ranks, a NIC down, held per host and NIC: no ring_rerouted candidate (every
    ring passes the slowest host; the per-pair search found an order through every host eight
    times, which cost.py priced far slower, at 120 ms of a first plan: bench/RESULTS.md), so
    the first plan is the closed-form choice, no rank's schedule but this one's built. The same
    state with a slow pair exception still weighs the rerouted ring, as a dense RailState does."""
    from r2comm.bench import planner_scale as ps
    st = ps._context(8, True)["state"]
    assert "ring_rerouted" not in planner.candidates("allreduce", 64, st)
    planner.clear_caches()

    def every_rank(*a, **kw):
        raise AssertionError("built every rank's schedule")
    monkeypatch.setattr(planner, "build_all", every_rank)
    s = planner.build("allreduce", 0, 64, 64 * MB, 4, 0, 64 << 10, state=st)
    assert s.algo == "hierarchical_tree"
    monkeypatch.undo()
    st.set_link(0, 1, 0, bw=1e6)                   # a slow path inside host 0
    assert st.exceptions and "ring_rerouted" in planner.candidates("allreduce", 64, st)
