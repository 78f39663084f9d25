"""Planner on measured rail rates (no sockets): the NIC model of RailState.from_rail_stats,
the noise threshold, priors for unmeasured rails, the loopback ("scale") mode, and the probe's
pairing schedule."""
import itertools
import random

import pytest

from r2comm import planner
from r2comm.planner.state import RailState, snap_rates, measured_figures, MEASURE_NOISE
from r2comm.control.bandwidth import pair_rate, partners, ring_rounds, rounds, slots

GBIT = 125e6          # bytes/s of 1 Gbit/s


def stats_for(n, nrails, rate, noise=0.0, seed=0, down=(), weight=1.0):
    """stats[r] = {peer: [(state, weight, rate)]}: rate(r, p, k) bytes/s with multiplicative
    noise in [1 - noise, 1] (interference only slows transfers down), `down` = {(r, k)}:
    rank r's NIC k is gone (down towards every peer, both ends)."""
    rng = random.Random(seed)
    out = []
    for r in range(n):
        d = {}
        for p in range(n):
            if p == r:
                continue
            rows = []
            for k in range(nrails):
                if (r, k) in down or (p, k) in down:
                    rows.append(("down", weight, 0.0))
                else:
                    rows.append(("up", weight, rate(r, p, k) * (1 - noise * rng.random())))
            d[p] = rows
        out.append(d)
    return out


def uniform_rate(r, p, k):
    return GBIT


def test_snap_rates_bands():
    got = snap_rates({"a": 100.0, "b": 90.0, "c": 75.0, "d": 10.0, "e": 12.0})
    assert got["a"] == got["b"] == got["c"] == 90.0        # median of the top band
    assert got["d"] == got["e"] == 11.0                    # their own band
    assert snap_rates({"a": 1.0, "b": 0.5}, noise=0.0) == {"a": 1.0, "b": 0.5}
    assert snap_rates({}) == {}


@pytest.mark.parametrize("seed", range(20))
def test_noisy_equal_rails_are_equal_and_nothing_is_degraded(seed):
    n = 4
    st = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, uniform_rate, 0.3, seed))
    bws = {bw for _, bw in st.link.values()}
    assert len(bws) == 1                                  # noise snapped away entirely
    assert st.healthy() and st.beta() == 1.0 and st.degraded_ranks() == []
    assert st.degraded_tol == MEASURE_NOISE
    uni = RailState.uniform(n, 2, bw=bws.pop())
    for nbytes in (4 << 10, 64 << 20):                    # plans as on a uniform state
        assert planner.choose("allreduce", n, nbytes, 4, st) == \
            planner.choose("allreduce", n, nbytes, 4, uni)
    assert len(st.measured) == n * (n - 1) * 2


@pytest.mark.parametrize("seed", range(10))
def test_a_100mbit_nic_shows_up_through_noise(seed):
    n = 4

    def rate(r, p, k):                  # rank 3's NIC 1 (and every link through it) at 100 Mbit
        return GBIT / 10 if k == 1 and 3 in (r, p) else GBIT
    st = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, rate, 0.3, seed))
    assert st.degraded_ranks() == [3]
    assert 0.5 < st.beta() < 0.6                         # (1 + 0.1) / 2, within the noise
    assert 7 < st.rail_bw(0, 3, 0) / st.rail_bw(0, 3, 1) < 14
    assert st.rail_bw(0, 1, 1) == st.rail_bw(0, 1, 0)    # the healthy NICs stay equal
    # a degraded-server plan: the weighted direct one sizes its blocks for the pair's rails
    assert planner.choose("allreduce", n, 64 << 20, 4, st) in ("degraded", "direct")


@pytest.mark.parametrize("seed", range(10))
def test_a_lost_nic_halves_its_host_exactly(seed):
    n = 4
    st = RailState.from_rail_stats(list(range(n)),
                                   stats_for(n, 2, uniform_rate, 0.3, seed, down={(2, 1)}))
    assert st.beta() == 0.5 and st.degraded_ranks() == [2] and not st.healthy()
    assert st.usable_rails(2, 0) == [0]


def test_threshold_only_below_07_of_the_best():
    n = 4

    def rate_for(f):
        return lambda r, p, k: GBIT * f if k == 1 and 3 in (r, p) else GBIT
    mild = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, rate_for(0.75)))
    assert mild.healthy() and mild.beta() == 1.0          # within the noise band: equal
    half = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, rate_for(0.5)))
    assert half.beta() == pytest.approx(0.75) and half.degraded_ranks() == []   # host at 0.75
    slow = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, rate_for(0.2)))
    assert slow.beta() == pytest.approx(0.6) and slow.degraded_ranks() == [3]   # host at 0.6


def test_unmeasured_rails_get_the_declared_prior_at_the_measured_scale():
    n = 3
    stats = stats_for(n, 2, uniform_rate)
    for r in range(n):                                    # rail 1 just came back: no rate yet
        for p in stats[r]:
            stats[r][p][1] = ("up", 1.0, 0.0)
    st = RailState.from_rail_stats(list(range(n)), stats)
    assert st.rail_bw(0, 1, 1) == st.rail_bw(0, 1, 0) == GBIT
    declared = RailState.from_rail_stats(list(range(n)), stats, rail_bw=[1.0, 0.25])
    assert declared.rail_bw(0, 1, 1) == pytest.approx(GBIT / 4)
    nothing = RailState.from_rail_stats(list(range(n)), stats_for(n, 2, lambda r, p, k: 0.0),
                                        nominal_bw=1e9)
    assert nothing.rail_bw(0, 1, 0) == 1e9 and nothing.degraded_tol == 0.02


def test_links_inside_a_host_are_rated_apart_from_the_nic():
    hosts = ["a", "a", "b", "b"]

    def rate(r, p, k):                   # inside a host: loopback speed, not the NIC's
        return 20 * GBIT if hosts[r] == hosts[p] else GBIT
    st = RailState.from_rail_stats(hosts, stats_for(4, 2, rate, 0.2, 3))
    assert st.rail_bw(0, 1, 0) == pytest.approx(20 * GBIT, rel=0.25)
    assert st.rail_bw(0, 2, 0) == pytest.approx(GBIT, rel=0.25)
    assert st.nic_bw("a", 0) == st.nic_bw("b", 0) and st.beta() == 1.0
    fig = measured_figures(hosts, st.measured)
    assert fig[(0, 0, True)] > 10 * fig[(0, 0, False)]


def test_loopback_scale_mode_ignores_differences_between_rails():
    n = 4
    rng = random.Random(7)
    wild = stats_for(n, 2, lambda r, p, k: GBIT * rng.uniform(0.25, 1.0))   # up to 4x apart
    nic = RailState.from_rail_stats(list(range(n)), wild)
    scale = RailState.from_rail_stats(list(range(n)), wild, rates="scale")
    assert len({bw for _, bw in scale.link.values()}) == 1 and scale.healthy()
    assert scale.degraded_tol == 0.02 and scale.beta() == 1.0
    assert 0.25 * GBIT < scale.rail_bw(0, 1, 0) < GBIT
    lost = stats_for(n, 2, uniform_rate, 0.5, 1, down={(3, 1)})
    assert RailState.from_rail_stats(list(range(n)), lost, rates="scale").beta() == 0.5
    declared = RailState.from_rail_stats(list(range(n)), wild, rates="declared", nominal_bw=2e9)
    assert {bw for _, bw in declared.link.values()} == {2e9}
    assert nic.measured == scale.measured
    with pytest.raises(ValueError):
        RailState.from_rail_stats(list(range(n)), wild, rates="guess")


def test_gathered_measured_state_is_identical_on_every_rank():
    n = 3
    stats = stats_for(n, 2, uniform_rate, 0.3, 5)
    members = [4, 7, 9]
    views = []
    for r in range(n):
        rows = {members[p]: [(st, 0, 0, 0, 0, w, 0, rate) for (st, w, rate) in rs]
                for p, rs in stats[r].items()}
        seen = []
        views.append(RailState.gather(lambda mine: seen.append(mine) or stats, r, members,
                                      rows, ["same"] * n))
        assert seen[0] == stats[r]                       # what each rank contributes
    assert all(v.fingerprint() == views[0].fingerprint() for v in views)


@pytest.mark.parametrize("n", range(1, 10))
def test_probe_rounds_meet_every_pair_once(n):
    rr = rounds(n)
    pairs = [p for rnd in rr for p in rnd]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for rnd in rr:
        ranks = [x for p in rnd for x in p]
        assert len(ranks) == len(set(ranks))              # a rank in one pair per round
    assert len(rr) == (0 if n < 2 else (n - 1 if n % 2 == 0 else n))



@pytest.mark.parametrize("n", range(1, 12))
def test_probe_slots_time_each_ring_edge_once(n):
    """Issue 31: the probe times the ring's edges, in 2 rounds (3 for odd n) of disjoint
    pairs, so each rank meets its two ring neighbours (partners) and nobody else."""
    rr = ring_rounds(n)
    pairs = [p for rnd in rr for p in rnd]
    edges = sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n)} if n > 1 else set())
    assert sorted(pairs) == edges
    for rnd in rr:
        ranks = [x for p in rnd for x in p]
        assert len(ranks) == len(set(ranks))              # a rank in one pair per round
    assert len(rr) <= 3
    for me in range(n):
        met = sorted({b if a == me else a for a, b in pairs if me in (a, b)})
        assert met == partners(n, me)
    one_machine = slots(n, ["h"] * n)
    assert sorted(p for s in one_machine for p in s) == sorted(pairs)
    if n > 2:
        assert all(len(s) == 1 for s in one_machine)
    assert slots(n, list(range(n))) == rr


def test_probe_pair_rate_is_the_slower_nic():
    assert pair_rate([10.0, 4.0], [6.0, 8.0], 0) == 6.0
    assert pair_rate([10.0, 4.0], [6.0, 8.0], 1) == 4.0
    assert pair_rate([10.0, 0.0], [6.0, 8.0], 1) == 0.0     # unmeasured: no figure
    assert pair_rate([10.0], [6.0, 8.0], 1) == 0.0
