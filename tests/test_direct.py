"""The weighted direct AllReduce (r2comm/planner/direct.py): exact in the schedule executor,
blocks sized to the ranks' bandwidths (and the rails' unequal shares), priced in closed form
near its replay, and chosen by the planner where a NIC is partly slow at 3-16 hosts (issue 32
item 3)."""
import numpy as np
import pytest

from r2comm import planner
from r2comm.planner import cost, direct
from tests.test_planner import check_exact_cases, check_float_bits_identical, degraded_state, \
    run_allreduce, reference

MB = 1 << 20


@pytest.mark.parametrize("n", [3, 4, 5, 7])
@pytest.mark.parametrize("factor", [0.0, 0.3, 0.75])
def test_direct_computes_the_reduction_exactly(n, factor):
    st = degraded_state(n, slow=(n - 1,), factor=factor) if factor else \
        degraded_state(n, slow=(n - 1,), factor=1.0).fail_rail(n - 1, 1)
    sc, xs, isz = check_exact_cases(
        lambda r, nb, isz: direct.allreduce_direct(r, n, nb, isz, 0, st), n, "direct")
    outs = run_allreduce(sc, xs, "MIN", chunk=3 * isz, seed=4, in_place=True)   # in place
    assert all(np.array_equal(y, reference(xs, "MIN", xs[0].dtype)) for y in outs)


def test_direct_bits_identical_on_random_floats_and_several_slow_hosts():
    check_float_bits_identical("direct", 6, "float-direct")


def test_block_sizes_reach_the_bound_without_a_rail_penalty():
    """With g = 0 the blocks give T = max(N/b_d, 2(n-1)N/Σb), the bound T*; the slow rank owns
    less, and nothing when N/b_d dominates."""
    N = 1000.0
    for n, beta in ((3, 0.75), (4, 0.625), (8, 0.9), (3, 0.3)):
        bws = [1.0] * (n - 1) + [beta]
        sizes, T = direct.block_sizes(N, bws, 0.0, [n - 1])
        assert sum(sizes) == pytest.approx(N)
        assert T == pytest.approx(cost.lower_bound(N, 1.0, beta, n), rel=1e-6)
        assert sizes[-1] < sizes[0]
        if 1 / beta > 2 * (n - 1) / (n - 1 + beta):
            assert sizes[-1] == 0.0


def test_rail_penalty_moves_bytes_off_the_slow_ranks_peers():
    """The pair (healthy, slow) stripes 2:1 over 2 rails with one NIC at half rate: g = 1/3,
    and the blocks sized for it finish sooner on those rails than the host-level ones."""
    st = degraded_state(3, slow=(2,), factor=1.0)
    st.set_link(0, 2, 1, bw=st.rail_bw(0, 2, 1) / 2).set_link(1, 2, 1, bw=st.rail_bw(1, 2, 1) / 2)
    assert st.degraded_ranks() == [2]
    g = direct.rail_penalty(st, [0, 1], [2])
    assert g == pytest.approx(1 / 3)
    bws = [st.rank_bw(r) for r in range(3)]
    host, _ = direct.block_sizes(1e6, bws, 0.0, [2])
    rail, _ = direct.block_sizes(1e6, bws, g, [2])
    assert direct.finish_time(1e6, rail, bws, g, [2]) < \
        0.99 * direct.finish_time(1e6, host, bws, g, [2])


@pytest.mark.parametrize("H,rate,limit", [(3, 0.5, 1.01), (4, 0.5, 1.01), (8, 0.5, 1.02),
                                          (3, 0.25, 1.01), (4, 0.25, 1.01), (8, 0.25, 1.02),
                                          (16, 0.25, 1.03), (3, 0.875, 1.01), (8, 0.875, 1.02),
                                          (16, 0.875, 1.02), (8, 0.0, 1.02)])
def test_planner_chooses_direct_near_the_bound_with_a_slow_nic(H, rate, limit):
    """Issue 32 item 3 at small host counts (2 x 400 Gbit/s NICs, 256 MiB, the last host's NIC
    partly slow, exact replay / T*): the planner picks the weighted direct schedule, whose
    healthy pairs stripe over their rails as the slow host's traffic leaves them free. Before
    the rail weights 1.08-1.12 at 3-4 hosts with a NIC at 1/4 or 1/2 and 1.064 at 8 (the pairs
    with the slow host overload the healthy hosts' full-rate rails); before the direct
    schedule 1.22-1.45 at 3-4 hosts (ring, degraded or tree fold). What is left above 1 is the
    slow rank's stall, (n-1) chunks at its rate (bench/SIM.md)."""
    from r2comm.sim import sweep
    r = sweep.bound_case(H, rate)
    assert r["chosen"] == "direct" and r["ratio"] <= limit, r


@pytest.mark.parametrize("H,rate,chosen", [(24, 0.875, "direct"), (24, 0.0, "direct"),
                                            (32, 0.875, "direct"), (32, 0.0, "treefold")])
def test_planner_choice_within_5_percent_of_the_bound_at_24_and_32_hosts(H, rate, chosen):
    """Issue 32 item 3 at 24-32 hosts (2 x 400 Gbit/s NICs, 256 MiB, the last host's NIC at
    7/8 or down, exact replay / T*): the planner's own choice replays within 1.05 of T*. Before,
    the tree fold (direct offered up to 16 hosts) gave 1.061 at 24 hosts and 1.0504 at 32 with
    a NIC at 7/8; offering direct up to 32 with the tree fold's price counting every hop's
    latency (its replay overlaps 3 of them) would have picked direct at 32 hosts with a NIC
    down, 1.06 (the tree fold: 1.02)."""
    from r2comm.sim import sweep
    r = sweep.bound_case(H, rate)
    assert r["chosen"] == chosen and r["ratio"] <= 1.05, r


@pytest.mark.parametrize("n,factor", [(3, 0.5), (4, 0.25), (8, 0.875), (5, 0.0)])
def test_rail_weights_fill_every_healthy_rail_to_the_bound(n, factor):
    """pair_weights(): the healthy pairs put more on the rail the slow host's NIC k leaves
    free, so every rail of every rank is done by T = max(T*, N/b_d) (rail_finish_time), where
    the engine's own striping (weights as the rates) leaves the healthy ranks' full-rate rails
    later; each rank's schedule names its healthy peers' weights, and they validate."""
    st = degraded_state(n, slow=(n - 1,), factor=1.0)
    if factor:
        for r in range(n - 1):
            st.set_link(r, n - 1, 1, bw=st.rail_bw(r, n - 1, 1) * factor)
    else:
        st.fail_rail(n - 1, 1)
    bws = [st.rank_bw(r) for r in range(n)]
    sizes, T, weights = direct.plan_sizes(n, 1e6, st.rank_bw, [n - 1], st)
    bound = max(cost.lower_bound(1e6, bws[0], bws[-1] / bws[0], n), 1e6 / bws[-1])
    assert T == pytest.approx(bound, rel=1e-6)
    assert sorted(weights) == [(i, j) for i in range(n - 1) for j in range(i + 1, n - 1)]
    assert all(w[1] > w[0] for w in weights.values())     # the slow host's rail 1 is the slow one
    plain = direct.rail_finish_time(st, sizes, {})
    if factor:                      # (with the NIC down the slow rank's N/b_d is the bound)
        assert plain > 1.005 * T
    s = direct.allreduce_direct(0, n, 1 << 20, 4, 0, st).validate()
    assert set(s.rail_weights) == set(range(1, n - 1))
    assert s.rail_weights[1] == pytest.approx(weights[(0, 1)])


def test_replay_honours_declared_rail_weights():
    """The simulator stripes a pair as the schedule declares (on the rails the engines use):
    a message declared all on rail 1 takes twice as long as one over both equal rails, and a
    declared weight on a NIC that is down goes to the other rail."""
    from r2comm.planner import Schedule, WORK
    from r2comm.sim.cluster import Cluster
    from r2comm.sim.fabric import Fabric

    def replay(w, down=False):
        fab = Fabric(2, 2, 1e9, 1, 1.0, 0.0)
        if down:
            fab.down(1, 0)
        a, b = Schedule("p"), Schedule("p")
        a.send(1, 0, WORK, 0, 64 * MB)
        b.recv(0, 0, WORK, 0, 64 * MB)
        if w is not None:
            a.rail_weights[1] = w
        return Cluster(fab).run_schedules([a.validate(), b])["time_s"]
    even = replay(None)
    assert replay((0.5, 0.5)) == pytest.approx(even, rel=1e-6)
    assert replay((0.0, 1.0)) == pytest.approx(2 * even, rel=0.01)
    assert replay((0.25, 0.75)) == pytest.approx(1.5 * even, rel=0.01)
    assert replay((1.0, 0.0), down=True) == pytest.approx(replay(None, down=True), rel=1e-6)
    with pytest.raises(ValueError):
        Schedule("p", rail_weights={1: (0.7, 0.7)}).validate()


@pytest.mark.parametrize("H,K,rate", [(4, 2, 0.5), (8, 2, 0.25), (16, 4, 0.875)])
def test_direct_price_against_replay(H, K, rate):
    """price.direct within 5% of the exact replay (α = 25 µs, 256 MiB)."""
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    from tests.test_planner_scale import _sweep_fabric
    fab = _sweep_fabric(H, K, rate)
    st = fab.state()
    eager = Config().eager
    nb = 256 * MB
    got = planner.evaluate("allreduce", H, nb, 4, st, eager=eager)["direct"]
    sc = [planner.build("allreduce", r, H, nb, 4, 0, eager, algo="direct", state=st)
          for r in range(H)]
    t = Cluster(fab).run_schedules(sc)["time_s"]
    assert got == pytest.approx(t, rel=0.05), (got, t)
