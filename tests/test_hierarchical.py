"""Topology and hierarchical schedules (r2comm/planner/topology.py, hierarchical.py) without
sockets: every collective run by tests/test_planner.py's executor under adversarial
interleavings on 1-3 hosts x 1-4 ranks per host (and uneven hosts), exact against numpy and bit
for bit across ranks; the planner's choice (cost model, forcing); a host that lost a NIC; and
the simulator replaying the same schedules (r2comm.sim)."""
import itertools

import numpy as np
import pytest

from r2comm import planner
from r2comm.config import Config
from r2comm.planner import cost, hierarchical, routing
from r2comm.planner.schedule import WORK, SEND
from r2comm.planner.state import RailState
from r2comm.planner.topology import Topology, INTRA_BW
from r2comm.sim.cluster import Cluster
from r2comm.sim.fabric import Fabric

from test_planner import (execute, inputs, reference, run_allreduce, check_allreduce,
                          consistent)

MB = 1 << 20
OPS = ("SUM", "PROD", "MIN", "MAX")
# (hosts, ranks per host): every combination of 1-3 hosts x 1-4 ranks per host
REGULAR = [(h, l) for h in (1, 2, 3) for l in (1, 2, 3, 4)]
UNEVEN = [[0, 0, 0, 1], [0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 2, 2],
          [0, 1, 0, 1, 1]]                         # the last: hosts interleaved in rank order


def regular(h, l, interleave=False):
    labels = [r % h for r in range(h * l)] if interleave else [r // l for r in range(h * l)]
    return Topology.from_labels(labels)


def topologies():
    out = [regular(h, l) for h, l in REGULAR] + [regular(2, 2, True), regular(3, 2, True)]
    return out + [Topology.from_labels(x) for x in UNEVEN]


def tid(t):
    return "-".join(str(len(rs)) for rs in t.hosts) + ("i" if t.host_of != tuple(sorted(t.host_of)) else "")


# ---------------------------------------------------------------------------------------------
def test_topology_from_labels():
    t = Topology.from_labels(["b", "a", "b", "c", "a"], rails=[2, 2, 3, 1, 2])
    assert t.hosts == [[0, 2], [1, 4], [3]] and t.host_of == (0, 1, 0, 2, 1)
    assert [t.local_rank(r) for r in range(5)] == [0, 0, 1, 0, 1]
    assert [t.local_size(r) for r in range(5)] == [2, 2, 2, 1, 2]
    assert t.rails == (3, 2, 1) and t.nhosts == 3
    assert t.hierarchical and not t.regular
    d = t.describe(4)
    assert d["host"] == 1 and d["local_rank"] == 1 and d["hosts"][1] == [1, 4]
    assert d["rails_per_host"] == [3, 2, 1]
    assert not Topology.from_labels([0, 0, 0]).hierarchical        # one host
    assert not Topology.from_labels([0, 1, 2]).hierarchical        # one rank per host
    assert Topology.from_labels([0, 0, 1, 1]).regular
    st = Topology.from_labels([0, 0, 1, 1], rails=[2] * 4).default_state()
    assert st.nrails == 2 and st.pair_bw(0, 1) == pytest.approx(INTRA_BW)
    assert st.pair_bw(0, 2) == pytest.approx(2 * st.rail_bw(0, 2, 0)) and st.pair_bw(0, 2) < INTRA_BW
    assert Topology.from_state(st).host_of == (0, 0, 1, 1)


def test_applicable():
    t = Topology.from_labels([0, 0, 0, 1])
    assert hierarchical.applicable("allreduce", t) and hierarchical.applicable("bcast", t)
    assert not hierarchical.applicable("allgather", t)          # uneven hosts
    assert not hierarchical.applicable("reduce_scatter_block", t)
    assert not hierarchical.applicable("alltoall", regular(2, 2))
    assert not any(hierarchical.applicable(c, regular(1, 4)) for c in hierarchical.HIER_COLLS)
    assert not any(hierarchical.applicable(c, regular(3, 1)) for c in hierarchical.HIER_COLLS)


# ---------------------------------------------------------------------------------------------
# allreduce
def exact_both_ways(sc, xs, op, isz, count, policy):
    """The allreduce schedules sc give the exact result from a separate send buffer and in
    place, under two interleavings of `policy` with different chunk sizes."""
    check_allreduce(sc, xs, op, chunk=3 * isz, seed=count, policy=policy)
    ref = reference(xs, op, xs[0].dtype)
    for y in run_allreduce(sc, xs, op, chunk=2 * isz, seed=count + 1, policy=policy,
                           in_place=True):
        assert np.array_equal(y, ref)


@pytest.mark.parametrize("topo", topologies(), ids=tid)
def test_hierarchical_allreduce_exact(topo):
    n = topo.n
    pols = itertools.cycle(("random", "skew", "fifo"))
    for count in (1, 5, 37, 101):
        for op, (dtype, eager) in zip(OPS, (("int32", 0), ("float64", 1 << 20), ("int16", 0),
                                           ("uint8", 64))):
            isz = np.dtype(dtype).itemsize
            sc = [hierarchical.allreduce(r, topo, count * isz, isz, eager) for r in range(n)]
            assert consistent(sc)
            assert all(s.fills_work for s in sc) or n == 1
            xs = inputs(f"hier{tid(topo)}{count}{op}", n, count, dtype, op)
            exact_both_ways(sc, xs, op, isz, count, next(pols))


@pytest.mark.parametrize("topo", [regular(2, 2), regular(3, 4), Topology.from_labels(UNEVEN[1])],
                         ids=tid)
def test_hierarchical_allreduce_bits_fixed_by_the_schedule(topo):
    """Random floats: every rank holds the same bits, whatever the interleaving (the
    reduction order is the schedule's), close to numpy."""
    n, count = topo.n, 203
    xs = inputs(f"hierbits{tid(topo)}", n, count, "float32", exact=False)
    sc = [hierarchical.allreduce(r, topo, count * 4, 4, 0) for r in range(n)]
    first = None
    for seed, pol in enumerate(("random", "skew", "fifo", "random", "skew")):
        y = check_allreduce(sc, xs, "SUM", exact=False, chunk=8 * (seed + 1), seed=seed,
                            policy=pol)
        first = y.tobytes() if first is None else first
        assert y.tobytes() == first


def test_hierarchical_allreduce_moves_each_byte_over_the_nics_once():
    """Bytes leaving each host: 2(H-1)/H x N for the hierarchical plan, 2(n-1)/n x N for the
    flat ring over every rank (2 hosts x 2 ranks: 1.0 N against 1.5 N)."""
    for h, l in ((2, 2), (2, 4), (3, 2), (3, 4)):
        topo = regular(h, l)
        n = topo.n
        nb = 4 * 1200 * n
        hier = [hierarchical.allreduce(r, topo, nb, 4) for r in range(n)]
        ring = [planner.algorithms.allreduce_ring(r, n, nb, 4) for r in range(n)]

        def off_host(sc):
            out = [0] * h
            for r, s in enumerate(sc):
                for m in s.msgs:
                    if m[0] == "send" and topo.host_of[m[1]] != topo.host_of[r]:
                        out[topo.host_of[r]] += m[5]
            return out
        assert off_host(hier) == [2 * (h - 1) * nb // h] * h
        assert off_host(ring) == [2 * (n - 1) * nb // n] * h


# ---------------------------------------------------------------------------------------------
# allgather, reduce_scatter_block, bcast
def _run(coll, sc, topo, block, root, xs, seed, pol):
    n = topo.n
    bufs = []
    for r, x in enumerate(xs):
        if coll == "allgather":
            w = np.zeros(block * n, x.dtype)
            w[r * block:(r + 1) * block] = x[:block]
            bufs.append({WORK: w.view(np.uint8).copy(), SEND: x[:block].view(np.uint8).copy()})
        elif coll == "reduce_scatter_block":
            bufs.append({WORK: np.zeros(block * x.itemsize, np.uint8),
                         SEND: x.view(np.uint8).copy()})
        else:
            w = x[:block] if r == root else np.zeros(block, x.dtype)
            bufs.append({WORK: w.view(np.uint8).copy()})
    execute(sc, bufs, xs[0].dtype, "SUM", chunk=3 * xs[0].itemsize, seed=seed, policy=pol)
    return [b[WORK].view(xs[0].dtype) for b in bufs]


@pytest.mark.parametrize("coll", ["allgather", "reduce_scatter_block", "bcast"])
@pytest.mark.parametrize("topo", topologies(), ids=tid)
def test_other_hierarchical_collectives_exact(coll, topo):
    n = topo.n
    if coll != "bcast" and not topo.regular:
        return
    pols = itertools.cycle(("random", "skew", "fifo"))
    for block, dtype in ((1, "int32"), (7, "float64"), (33, "int8")):
        xs = [np.arange(block * n, dtype=np.int64).astype(dtype) * (r + 1) + r
              for r in range(n)]
        isz = xs[0].itemsize
        for root in (range(n) if coll == "bcast" else [0]):
            sc = [hierarchical.build(coll, r, topo, block * isz, isz, root, eager=8 * isz)
                  for r in range(n)]
            assert consistent(sc)
            out = _run(coll, sc, topo, block, root, xs, seed=block + root, pol=next(pols))
            if coll == "allgather":
                ref = np.concatenate([x[:block] for x in xs])
                assert all(np.array_equal(o, ref) for o in out)
            elif coll == "reduce_scatter_block":
                tot = reference(xs, "SUM", xs[0].dtype)
                for r in range(n):
                    assert np.array_equal(out[r], tot[r * block:(r + 1) * block]), r
            else:
                assert all(np.array_equal(o, xs[root][:block]) for o in out), root


def test_hierarchical_bcast_crosses_each_host_once():
    topo = regular(3, 4)
    for root in range(topo.n):
        sc = [hierarchical.bcast(r, topo, 1000, root) for r in range(topo.n)]
        into = [0] * 3
        for r, s in enumerate(sc):
            for m in s.msgs:
                if m[0] == "recv" and topo.host_of[m[1]] != topo.host_of[r]:
                    into[topo.host_of[r]] += 1
        assert sorted(into) == [0, 1, 1] and into[topo.host_of[root]] == 0


# ---------------------------------------------------------------------------------------------
# the planner's choice
def test_planner_prices_flat_against_hierarchical_without_a_state():
    topo = regular(2, 2)
    n, eager = 4, 64 << 10
    big = [planner.build("allreduce", r, n, 64 * MB, 4, 0, eager, topo=topo) for r in range(n)]
    assert all(s.hierarchical and s.cost > 0 for s in big)
    small = planner.build("allreduce", 0, n, 64, 4, 0, eager, topo=topo)
    assert small.algo == "recursive_doubling" and not small.hierarchical
    assert small.msgs == planner.algorithms.allreduce_rd(0, n, 64, 4).msgs
    # forced either way
    assert planner.build("allreduce", 0, n, 64, 4, 0, eager, "hierarchical", topo=topo).hierarchical
    flat = planner.build("allreduce", 0, n, 64 * MB, 4, 0, eager, "flat", topo=topo)
    assert flat.algo == "ring" and flat.msgs == planner.algorithms.allreduce_ring(
        0, n, 64 * MB, 4, eager).msgs
    # no topology, or one host, or one rank per host: the static plans, unchanged
    for t in (None, regular(1, 4), regular(4, 1)):
        s = planner.build("allreduce", 0, n, 64 * MB, 4, 0, eager, topo=t)
        assert s == planner.algorithms.allreduce_ring(0, n, 64 * MB, 4, eager)
    # the other collectives
    for coll in ("allgather", "reduce_scatter_block"):
        assert planner.build(coll, 0, n, 16 * MB, 4, 0, eager, topo=topo).hierarchical
        assert not planner.build(coll, 0, n, 16 * MB, 4, 0, eager, "flat", topo=topo).hierarchical
    # the flat binomial bcast from rank 1 crosses the hosts three times, the hierarchical once
    assert planner.build("bcast", 0, n, 16 * MB, 4, 1, eager, topo=topo).hierarchical
    # predicted: about 1.5x for 64 MiB on 2 hosts x 2 ranks
    st = topo.default_state()
    costs = planner.evaluate("allreduce", n, 64 * MB, 4, st)
    assert 1.4 < costs["ring"] / costs["hierarchical"] < 1.6


def test_planner_chooses_hierarchical_on_a_rail_state_and_relays_it():
    st = regular(2, 2).default_state(nrails=2)
    n = 4
    assert "hierarchical" in planner.candidates("allreduce", n, st)
    assert planner.choose("allreduce", n, 64 * MB, 4, st) == "hierarchical"
    assert planner.choose("allreduce", n, 64 * MB, 4, st, flat_only=True) == "ring"
    sc = planner.build_all("allreduce", n, 64 * MB, 4, state=st)
    assert sc[0].algo == "hierarchical"
    # every host sees the same set: ranks on their own hosts never get a hierarchical plan
    assert "hierarchical" not in planner.candidates("allreduce", n, RailState.uniform(n))
    sc = planner.build_all("allreduce", n, 64 * MB, 4, algo="hierarchical",
                           state=RailState.uniform(n))
    assert sc[0].algo == "ring"
    # a pair with no common rail: the hierarchical plan is relayed around it, still exact
    br = regular(2, 3).default_state(nrails=2)
    br.break_pair(0, 3)
    sc = planner.build_all("allreduce", 6, 4 * 301, 4, algo="hierarchical", state=br)
    assert sc[0].algo == "hierarchical+relay" and not routing.uses_broken_pair(sc, br)
    check_allreduce(sc, inputs("hierrelay", 6, 301, "int32"), chunk=16, seed=2, policy="skew")


def test_a_nic_lost_on_one_host_is_priced_and_keeps_the_schedule():
    """3 hosts x 2 ranks, host 0 loses NIC 1: the hierarchical schedule is the same (the
    engine moves host 0's inter-host chunks to NIC 0; same bits as before), the planner
    predicts about twice the time (host 0's NICs are the bottleneck), and still prefers it to
    the flat ring and to the degraded-server allreduce."""
    topo = regular(3, 2)
    st = topo.default_state(nrails=2)
    bad = st.copy()
    for r in topo.hosts[0]:
        bad.fail_rail(r, 1)
        for p in topo.hosts[0]:
            if p != r:
                bad.set_link(r, p, 1, up=True)      # local pairs do not use the NIC
    assert bad.degraded_hosts() == [0]
    nb = 64 * MB
    healthy = planner.build_all("allreduce", 6, nb, 4, algo="hierarchical", state=st)
    degraded = planner.build_all("allreduce", 6, nb, 4, algo="hierarchical", state=bad)
    assert [s.msgs for s in healthy] == [s.msgs for s in degraded]
    assert 1.8 < degraded[0].cost / healthy[0].cost < 2.2
    a = cost.analyse(degraded, bad)
    assert a["bottleneck"][0].startswith("host") and a["bottleneck"][1] == 0
    costs = planner.evaluate("allreduce", 6, nb, 4, bad)
    assert costs["hierarchical"] < min(costs["ring"], costs["degraded"])
    assert planner.choose("allreduce", 6, nb, 4, bad) == "hierarchical"


# ---------------------------------------------------------------------------------------------
# the simulator replays the planner's hierarchical schedules
def _replay(scheds, xs, fab, faults=()):
    bufs = []
    for x, s in zip(xs, scheds):
        send = x.view(np.uint8).copy()
        work = np.full(send.size, 0xA5, np.uint8) if s.fills_work else send.copy()
        bufs.append({WORK: work, SEND: send})
    cl = Cluster(fab, flat=True)
    for f in faults:
        cl.fault_at(*f)
    res = cl.run_schedules(scheds, data=bufs, dtype=xs[0].dtype)
    return [b[WORK].view(xs[0].dtype) for b in bufs], res, cl


def test_sim_replays_the_hierarchical_schedule():
    H, G = 2, 2
    fab = Fabric(H, 2, 125e6, ranks_per_host=G, alpha=1e-5, intra_bw=5e9)
    st = fab.state(flat=True)
    n = H * G
    xs = inputs("simhier", n, 300_001, "float32", exact=False)
    nb = xs[0].nbytes
    hier = planner.build_all("allreduce", n, nb, 4, state=st)
    assert hier[0].algo == "hierarchical"                 # the planner's own choice here
    ring = planner.build_all("allreduce", n, nb, 4, algo="ring", state=st)
    want = run_allreduce(hier, xs, chunk=Config().chunk_size, seed=1)
    got, res, _ = _replay(hier, xs, fab)
    assert all(g.tobytes() == want[0].tobytes() for g in got)
    assert np.allclose(got[0], reference(xs, "SUM", xs[0].dtype), rtol=1e-4, atol=1e-4)
    t_ring = Cluster(fab, flat=True).run_schedules(ring)["time_s"]
    assert 1.3 < t_ring / res["time_s"] < 1.7            # NIC bytes 1.5 N against 1.0 N
    # NIC 1 of host 0 fails a third of the way through: same bits, more time, re-sent chunks
    got2, res2, cl = _replay(hier, xs, Fabric(H, 2, 125e6, ranks_per_host=G, alpha=1e-5,
                                              intra_bw=5e9),
                             faults=[(res["time_s"] / 3, "down", 0, 1)])
    assert all(g.tobytes() == want[0].tobytes() for g in got2)
    assert res2["time_s"] > res["time_s"] and cl.resent > 0
