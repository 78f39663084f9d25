"""r2comm.sim: the flow-level event engine, the replay of the planner's schedules (against the
pure-Python executor of tests/test_planner.py), failover timing, FabricState against RailState,
the ring-order shortcut, and a 256-host run. No MPI, no sockets."""
import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from r2comm import planner
from r2comm.config import Config
from r2comm.planner import routing
from r2comm.planner.schedule import WORK, SEND
from r2comm.planner.state import RailState
from r2comm.sim.cluster import Cluster, SimStall
from r2comm.sim.fabric import Fabric, FabricState
from r2comm.sim.flows import FlowSim, maxmin_rates

from test_planner import inputs, reference, run_allreduce

MB = 1 << 20
CFG = Config()


# -- the event engine ---------------------------------------------------------------------------
def test_two_flows_on_one_link_get_half_each():
    sim = FlowSim([100.0], max_links=2)
    done = {}
    for name in ("a", "b"):
        sim.add([(0, 1.0)], 100.0, done.__setitem__, name, None)
    assert sim.rates() == {0: 50.0, 1: 50.0}
    sim.run()
    assert sim.now == pytest.approx(2.0)
    assert set(done) == {"a", "b"}


def test_max_min_with_unequal_bottlenecks():
    # link 0 (cap 10): flows 0, 1; link 1 (cap 4): flows 1, 2  ->  1 and 2 get 2, flow 0 gets 8
    r = maxmin_rates(np.array([[0, -1], [0, 1], [1, -1]]), np.ones((3, 2)), np.array([10.0, 4.0]))
    assert r == pytest.approx([8.0, 2.0, 2.0])
    # a striped flow (half on each link) against a flow on link 0 alone
    r = maxmin_rates(np.array([[0, 1], [0, -1]]), np.array([[0.5, 0.5], [1.0, 0]]),
                     np.array([10.0, 10.0]))
    assert r == pytest.approx([20.0 / 3, 20.0 / 3])
    # a dead link stops its flows only
    r = maxmin_rates(np.array([[0, -1], [1, -1]]), np.ones((2, 2)), np.array([0.0, 5.0]))
    assert r == pytest.approx([0.0, 5.0])


def test_bytes_are_conserved():
    rng = random.Random(1)
    sim = FlowSim([rng.uniform(1, 10) for _ in range(6)], max_links=3)
    want = np.zeros(6)
    total = 0.0
    for i in range(40):
        links = rng.sample(range(6), rng.randint(1, 3))
        coefs = [rng.uniform(0.2, 1.0) for _ in links]
        size = rng.uniform(1, 50)
        t = rng.uniform(0, 5)
        sim.at(t, sim.add, list(zip(links, coefs)), size, lambda: None)
        for l, c in zip(links, coefs):
            want[l] += c * size
        total += size
    sim.at(2.0, sim.set_capacity, 3, 0.5)          # a capacity change half way
    sim.run()
    assert not sim.busy()
    assert sim.delivered == pytest.approx(total)
    assert sim.bytes_on_links() == pytest.approx(want)


# -- replaying the planner's schedules ----------------------------------------------------------
def _replay_data(scheds, xs, fabric, faults=(), **kw):
    bufs = []
    for x, s in zip(xs, scheds):
        send = x.view(np.uint8).copy()
        work = np.full(send.size, 0xA5, np.uint8) if s.fills_work else send.copy()
        bufs.append({WORK: work, SEND: send})
    cl = Cluster(fabric, **kw)
    for f in faults:
        cl.fault_at(*f)
    res = cl.run_schedules(scheds, data=bufs, dtype=xs[0].dtype)
    return [b[WORK].view(xs[0].dtype) for b in bufs], res, cl


@pytest.mark.parametrize("n,algo,slow", [(3, "ring", None), (4, "recursive_doubling", None),
                                         (5, "degraded", 1), (4, "degraded", 3),
                                         (5, "ring_rerouted", None)])
def test_replay_moves_the_same_bytes_as_the_executor(n, algo, slow):
    fab = Fabric(n, 2, 1e6, alpha=1e-5)
    nic = [[1e6, 1e6] for _ in range(n)]
    if slow is not None:
        nic[slow][1] = 0.0                        # a host that lost a NIC
    if algo == "ring_rerouted":
        nic[0][0] = nic[2][1] = 0.0               # hosts 0 and 2: no common rail
    st = FabricState(list(range(n)), nic)
    xs = inputs(f"sim{n}{algo}", n, 997, "int32")
    scheds = planner.build_all("allreduce", n, xs[0].nbytes, 4, algo=algo, state=st)
    want = run_allreduce(scheds, xs, chunk=256, seed=3)
    ref = reference(xs, "SUM", xs[0].dtype)
    for seg in (1, 3, None):
        cfg = Config()
        cfg.chunk_size = 256
        got, res, cl = _replay_data(scheds, xs, fab, segments=seg, cfg=cfg)
        for r in range(n):
            assert got[r].tobytes() == want[r].tobytes(), (seg, r)
        assert np.array_equal(got[0], ref)
        assert res["bytes_sent"] == [s.bytes_sent() for s in scheds]
        assert res["time_s"] > 0


def test_replay_with_a_failure_still_moves_the_same_bytes():
    n = 4
    fab = Fabric(n, 2, 1e6, alpha=1e-5)
    xs = inputs("simfail", n, 40_000, "float32", exact=False)
    scheds = planner.build_all("allreduce", n, xs[0].nbytes, 4, algo="ring", state=fab.state())
    want = run_allreduce(scheds, xs, chunk=CFG.chunk_size, seed=1)
    healthy = Cluster(Fabric(n, 2, 1e6, alpha=1e-5)).run_schedules(scheds)["time_s"]
    got, res, cl = _replay_data(scheds, xs, fab, faults=[(0.3 * healthy, "down", 2, 1)])
    for r in range(n):
        assert got[r].tobytes() == want[r].tobytes()
    assert cl.resent > 0
    assert res["time_s"] > healthy


def test_silent_failure_mid_transfer_waits_for_the_deadline():
    """2 hosts x 2 NICs at 125 MB/s, 64 MiB recursive doubling (each rank sends 64 MiB); NIC 0
    of host 1 goes silent at 0.1 s. Without hedging the unacknowledged window on the dead rail
    (min(R2COMM_WINDOW, rate x R2COMM_WINDOW_MS)) waits for R2COMM_RAIL_TIMEOUT_MS, then goes on
    the other rail; the rest of the dead rail's share moved there at once."""
    N, bw, tf = 64 * MB, 125e6, 0.1
    fab = Fabric(2, 2, bw, alpha=0.0)
    sc = planner.build_all("allreduce", 2, N, 4, algo="recursive_doubling", state=fab.state())
    assert Cluster(Fabric(2, 2, bw, alpha=0.0)).run_schedules(sc)["time_s"] == \
        pytest.approx(N / (2 * bw))
    cl = Cluster(fab, hedge=False)
    cl.fault_at(tf, "down", 1, 0)
    res = cl.run_schedules(sc)
    rem = N - tf * 2 * bw
    stuck = min(CFG.window, bw * CFG.window_ms / 1e3)
    deadline = CFG.rail_timeout_ms / 1e3
    assert tf + (rem - stuck) / bw < tf + deadline          # the rest was done before it
    assert res["time_s"] == pytest.approx(tf + deadline + stuck / bw, rel=1e-6)
    assert cl.resent == pytest.approx(2 * stuck)            # both directions cross NIC 1:0
    assert [e[1] for e in cl.log] == ["down", "rerouted", "rail_failed"]
    # with hedging (the engine's default) the stuck chunks go after the quiet limit instead
    cl = Cluster(Fabric(2, 2, bw, alpha=0.0))
    cl.fault_at(tf, "down", 1, 0)
    t2 = cl.run_schedules(sc)["time_s"]
    assert t2 == pytest.approx(tf + (rem) / bw, rel=1e-6)   # one rail carries all that is left


def test_fail_back_after_probe_and_flapping_backs_off():
    fab = Fabric(2, 2, 125e6, alpha=0.0)
    cl = Cluster(fab)
    cl.fault_at(0.0, "hard", 0, 1)
    cl.fault_at(0.05, "up", 0, 1)
    cl.fault_at(0.3, "hard", 0, 1)                 # fails again soon after coming back
    cl.fault_at(0.31, "up", 0, 1)
    cl.idle_until(2.0)
    ev = [(round(t, 4), w) for t, w, h, k, v in cl.log if w in ("rail_failed", "rail_restored")]
    p = CFG.probe_ms / 1e3
    assert ev[0] == (0.002, "rail_failed") and ev[1] == (round(0.002 + p, 4), "rail_restored")
    assert ev[2][1] == "rail_failed" and ev[3] == (round(ev[2][0] + 2 * p, 4), "rail_restored")


def test_pair_without_rails_raises_after_the_peer_timeout():
    fab = Fabric(2, 1, 125e6)
    cl = Cluster(fab)
    cl.fault_at(0.01, "hard", 1, 0)
    sc = planner.build_all("allreduce", 2, 64 * MB, 4, algo="ring", state=fab.state())
    with pytest.raises(SimStall, match="PEER_TIMEOUT"):
        cl.run_schedules(sc)


def test_backup_nic_policy_is_slower_than_rebalancing():
    n, K, N = 4, 4, 64 * MB
    times = {}
    for pol in ("r2comm", "backup"):
        fab = Fabric(n, K, 125e6, alpha=0.0)
        fab.down(1, 0)
        cl = Cluster(fab, policy=pol)
        cl.view.avoid[1][0] = cl.view.failed[1][0] = True
        cl.changed()
        sc = planner.build_all("allreduce", n, N, 4, algo="ring", state=Fabric(n, K, 125e6).state())
        times[pol] = cl.run_schedules(sc)["time_s"]
    ring = 2 * (n - 1) / n * N
    assert times["r2comm"] == pytest.approx(ring / (3 * 125e6), rel=0.02)    # 3 NICs left
    assert times["backup"] == pytest.approx(ring / (K * 125e6 / 2), rel=0.02)  # 2 shares, 1 NIC


# -- the planner's view --------------------------------------------------------------------------
def test_fabric_state_answers_like_rail_state():
    n, K, bw = 6, 3, 1e9
    fs = FabricState(list(range(n)), [[bw] * K for _ in range(n)])
    rs = RailState.uniform(n, K, bw)
    fs.nic[2][1] = 0.0
    rs.fail_rail(2, 1)
    fs.nic[4] = [0.25 * bw] * K
    rs.scale_host(4, 0.25)
    fs.nic[5] = [0.0, bw, 0.0]
    rs.fail_rail(5, 0).fail_rail(5, 2)
    fs.nic[1] = [bw, 0.0, 0.0]
    rs.fail_rail(1, 1).fail_rail(1, 2)
    fs = FabricState(fs.hosts, fs.nic)
    for a in range(n):
        for b in range(n):
            assert fs.pair_bw(a, b) == rs.pair_bw(a, b)
            for k in range(K):
                assert fs.rail_bw(a, b, k) == rs.rail_bw(a, b, k)
    for h in range(n):
        assert fs.host_bw(h) == rs.host_bw(h)
    assert fs.broken_pairs() == rs.broken_pairs() == [(1, 5), (2, 5)]
    assert fs.degraded_ranks() == rs.degraded_ranks()
    for nbytes in (4096, 8 * MB):
        assert planner.evaluate("allreduce", n, nbytes, 4, fs) == \
            pytest.approx(planner.evaluate("allreduce", n, nbytes, 4, rs))


def test_ring_order_shortcut_gives_the_searched_answer(monkeypatch):
    rng = random.Random(7)
    cases = []
    for _ in range(60):
        n = rng.randint(3, 8)
        st = RailState.uniform(n, 2, 1e9)
        for _ in range(rng.randint(0, 3)):
            st.fail_rail(rng.randrange(n), rng.randrange(2))
        if rng.random() < 0.5:
            st.scale_host(rng.randrange(n), rng.choice([0.25, 0.5]))
        if rng.random() < 0.3:
            st.break_pair(*rng.sample(range(n), 2))
        cases.append(st)
    fast = [routing.ring_order(st) for st in cases]
    hits = sum(1 for st in cases if routing._identity_is_best(
        list(range(st.n)), {(a, b): st.pair_bw(a, b) for a in range(st.n) for b in range(st.n)
                            if a != b},
        sorted({st.pair_bw(a, b) for a in range(st.n) for b in range(st.n)
                if a != b and st.pair_bw(a, b) > 0}, reverse=True), routing.SEARCH_BUDGET))
    monkeypatch.setattr(routing, "_identity_is_best", lambda *a: False)
    slow = [routing.ring_order(st) for st in cases]
    assert fast == slow
    assert hits >= 20                              # the shortcut was taken often


# -- scale and the command line ------------------------------------------------------------------
def test_256_hosts_with_a_failure_mid_collective_in_seconds():
    """256 hosts x 8 GPUs x 8 NICs (2048 GPUs): the planner's recursive doubling of 4 MiB,
    replayed chunk by chunk while NIC 3 of host 17 fails silently half way through."""
    fab = Fabric(256, 8, 50e9, ranks_per_host=8, alpha=5e-6)
    t = time.perf_counter()
    sc = planner.build_all("allreduce", 256, 4 * MB, 2, algo="recursive_doubling",
                           state=fab.state())
    healthy = Cluster(Fabric(256, 8, 50e9, ranks_per_host=8, alpha=5e-6)).run_schedules(sc)
    cl = Cluster(fab)
    cl.fault_at(healthy["time_s"] / 2, "down", 17, 3)
    res = cl.run_schedules(sc)
    took = time.perf_counter() - t
    assert res["messages"] == 256 * 8
    assert res["time_s"] > healthy["time_s"] and cl.resent > 0
    assert res["time_s"] < healthy["time_s"] + 0.1          # hedged: far below the deadline
    assert took < 60                       # ~3 s on an idle core; this machine is shared


def test_predict_cli_prints_time_and_schedule():
    out = subprocess.run([sys.executable, "-m", "r2comm.sim", "predict", "--hosts", "4",
                          "--nics", "2", "--rate", "1gbit", "--ranks-per-host", "1",
                          "--down", "3:1", "--op", "allreduce", "--bytes", "64M", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["time_s"] > 0 and d["schedule"]["algo"] == "degraded"
    bad = subprocess.run([sys.executable, "-m", "r2comm.sim", "predict", "--hosts", "4",
                          "--nics", "2", "--rate", "1gbit", "--down", "9:0", "--bytes", "1M"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "9:0" in bad.stderr


def test_workload_with_flapping_nic_and_mtbf_trace():
    from r2comm.sim import workloads as wl
    tr = wl.mtbf_trace(4, 2, 100.0, mtbf_s=50.0, mttr_s=5.0, seed=3)
    assert tr == wl.mtbf_trace(4, 2, 100.0, mtbf_s=50.0, mttr_s=5.0, seed=3)
    assert tr and all(0 <= t < 105 and k in ("down", "up") for t, k, h, n, v in tr)
    args = dict(hosts=4, nics=2, rate=125e6, efficiency=1.0, alpha=25e-6)
    steps = wl.training_steps(8 * MB, 2, 0.05)
    free = wl.Runner(Fabric(**args)).run(steps, 30)
    r = wl.Runner(Fabric(**args))
    its = r.run(steps, 30, wl.flapping(2, 1, 0.2, 1.5, 4, down_frac=0.6))
    assert len(its) == 30 and sum(its) > sum(free)
    back = [v for t, w, h, k, v in r.cl.log if w == "rail_failed"]
    assert len(back) >= 2 and back[1] > back[0]            # flapping: the probe waits longer
    assert r.replays < 30 * 2                              # unchanged ops reuse their time
