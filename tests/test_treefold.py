"""The tree-fold AllReduce (r2comm/planner/treefold.py): tree structure, exactness in the
schedule executor of tests/test_planner.py under adversarial interleavings, bit-identical
results, the replay against T* and the closed form, the planner offering and choosing it, and
a multi-rank run on the real engine (tests/treefold_worker.py)."""
import os

import numpy as np
import pytest

from conftest import ROOT, run_mpi
from test_planner import check_allreduce, check_float_bits_identical, consistent, degraded_state, \
    inputs
from r2comm import planner
from r2comm.planner import cost, treefold
from r2comm.planner.treefold import (tree_children, tree_parent, tree_depth, tree_depth_fast,
                                     tree_depth_links, tree_links, tree_root, degrees,
                                     max_degree)

MB = 1 << 20


def _reference_tree(m):
    """Parent of every position, from the definition: position 0 over the in-order tree of
    1..m-1 whose root is the position with the most trailing zero bits."""
    par = {0: None}

    def build(lo, hi, parent):
        if lo < hi:
            top = max(range(lo, hi), key=lambda p: p & -p)
            par[top] = parent
            build(lo, top, top)
            build(top + 1, hi, top)
    build(1, m, 0)
    return par


def test_tree_matches_its_definition():
    for m in range(1, 300):
        par = _reference_tree(m)
        for p in range(m):
            assert tree_parent(p, m) == par[p]
            assert sorted(tree_children(p, m)) == sorted(q for q in range(m) if par[q] == p)
            if p % 2:
                assert not tree_children(p, m)            # odd positions are leaves
        assert len(tree_children(0, m)) == min(1, m - 1)  # the root has a single child
        assert tree_depth(m) == (m - 1).bit_length()


def _pair_sets(m):
    out = []
    for t in (0, 1):
        pairs = set()
        for i in range(m):
            par, kids = tree_links(t, i, m)
            for c in kids:
                assert tree_links(t, c, m)[0] == i            # links agree both ways
            if par is not None:
                pairs.add(frozenset((i, par)))
        assert len(pairs) == m - 1                            # a spanning tree
        out.append(pairs)
    return out


@pytest.mark.parametrize("ms", [range(1, 130), (255, 256, 511, 512, 1023)])
def test_two_trees_share_no_pair_and_load_every_rank_at_most_2n(ms):
    """From 8 healthy ranks on: no pair of ranks in both trees (their messages would share
    one queue), at most 4 half-buffers each way per rank, 3 at each root (which also talks
    to the degraded rank), roots on different ranks, depth log2(m) + 1 or 2."""
    for m in ms:
        t0, t1 = _pair_sets(m)
        deg = degrees(m, 1)
        assert max(deg) == max_degree(m, 1) <= (4 if m >= 3 else 3)
        assert tree_depth_links(m) == tree_depth_fast(m) <= (m - 1).bit_length() + 1
        for k in (2, 3):
            assert max(degrees(m, k)) == max_degree(m, k)
        if m >= 8:
            roots = (tree_root(0, m), tree_root(1, m))
            assert not t0 & t1
            assert roots[0] != roots[1] and deg[roots[0]] == deg[roots[1]] == 3


@pytest.mark.parametrize("n,factor", [(2, 0.5), (3, 0.1), (4, 0.5), (5, 0.85), (8, 0.5),
                                      (9, 0.1), (12, 0.5)])
def test_treefold_computes_the_reduction_exactly(n, factor):
    st = degraded_state(n, slow=(n // 2,), factor=factor)
    for frac in (None, 0.0, 0.4):
        for count, dtype, op in ((1, "int32", "SUM"), (4 * n + 3, "int64", "MAX"),
                                 (103, "float32", "SUM"), (250, "float16", "PROD"),
                                 (77, "float64", "MIN")):
            isz = np.dtype(dtype).itemsize
            sc = [treefold.allreduce_treefold(r, n, count * isz, isz, 0, st, frac=frac)
                  for r in range(n)]
            assert consistent(sc)
            xs = inputs(f"tf-{n}-{count}-{dtype}", n, count, dtype, op)
            for seed, pol in ((1, "random"), (2, "skew"), (3, "fifo")):
                check_allreduce(sc, xs, op, chunk=5 * isz, seed=seed, policy=pol)


def test_treefold_bits_identical_on_random_floats_and_several_slow_hosts():
    check_float_bits_identical("treefold", 7, "float-tf")


def test_treefold_messages_grow_linearly():
    """About 4 messages per healthy rank per tree half: 2,000-odd at 512 hosts, against the
    degraded schedule's ~2H² (522,242 at 512 hosts, bench/SIM.md)."""
    H = 512
    msgs = sum(len(treefold.allreduce_treefold(r, H, 256 * MB, 4, 0, degraded=[H - 1]).msgs)
               for r in range(H)) // 2
    assert msgs == 2 * 2 * (H - 1)               # every tree edge, up and down, both trees
    assert msgs < 2100


def _replay(H, nic_rate=0.0, nbytes=256 * MB):
    from r2comm.config import Config
    from r2comm.sim.cluster import Cluster
    from r2comm.sim.fabric import Fabric
    from r2comm.sim.predict import EFFICIENCY
    fab = Fabric(H, 2, 50e9, 1, EFFICIENCY, 0.0)
    if nic_rate == 0:
        fab.down(H - 1, 1)
    else:
        fab.degrade(H - 1, 1, nic_rate)
    st = fab.state()
    sc = [treefold.allreduce_treefold(r, H, nbytes, 4, Config().eager, st) for r in range(H)]
    t = Cluster(fab).run_schedules(sc)["time_s"]
    bw = 2 * 50e9 * EFFICIENCY
    beta = (1 + nic_rate) / 2
    return t, cost.lower_bound(nbytes, bw, beta, H), treefold.treefold_time(
        H, nbytes, beta * bw, bw, chunk=Config().chunk_size)


@pytest.mark.parametrize("H,nic_rate,limit", [(8, 0.0, 1.02), (17, 0.0, 1.02),
                                               (33, 0.0, 1.02), (33, 0.875, 1.05)])
def test_replay_near_the_bound_and_the_closed_form(H, nic_rate, limit):
    """256 MiB, 2 NICs per host, the last host's NIC 1 down or at 7/8: the degraded schedule
    replays at 1 + (H-1)c/N (1.031 at 17 hosts, 1.0625 at 33) whatever the loss; the tree fold
    within 2% of T* with the NIC down (8 hosts: 7 healthy, the odd case), 5% at 7/8 (there the
    healthy hosts carry 2N against T*'s 2(H-1)N/(H-1+β)), and its closed form within 3% of
    the replay."""
    t, tstar, closed = _replay(H, nic_rate)
    assert t / tstar <= limit
    assert abs(closed / t - 1) <= 0.03


def test_treefold_preferred_where_the_degraded_schedule_stalls():
    """treefold.preferred(): the tree fold's closed form is 2% below the degraded schedule's
    (with its stall of m·c/N) at 33 hosts, not at 4 (3 healthy hosts: not offered) nor at 9
    with 256 MiB (the two within 2%). The planner chooses it on its own (price.py's candidate
    "treefold"; test_planner_scale: within 1.05 of T* at 128 and 512 hosts): unforced, every
    rank's schedule at 33 hosts is the tree fold, and at 4 hosts it is not offered."""
    N = 256 * MB
    for n, want in ((4, False), (9, False), (33, True)):
        st = degraded_state(n, slow=(n - 1,), factor=0.5)
        assert treefold.state_preferred(st, N) is want
    st = degraded_state(33, slow=(32,), factor=0.5)
    for rank in (0, 16, 32):                        # no algorithm named: the planner's choice
        assert planner.build("allreduce", rank, 33, N, 4, 0, 64 << 10, "", state=st).algo == \
            "treefold"
    st4 = degraded_state(4, slow=(3,), factor=0.5)
    assert planner.build("allreduce", 0, 4, N, 4, 0, 64 << 10, "", state=st4).algo != "treefold"
    # small messages: the degraded schedule's stall m·c/N is large, the trees' fill too
    assert treefold.preferred(33, 1, 4 * MB, 1e9, 2e9) is True
    assert treefold.degraded_time(33, N, 1e9, 2e9) == pytest.approx(
        N / 1e9 * (1 + 32 * (512 << 10) / N))


@pytest.mark.mpi
@pytest.mark.parametrize("n,extra", [(3, {}), (4, {}), (6, {"slow": 2, "slow2": 5})])
def test_treefold_on_the_engine(n, extra):
    worker = os.path.join(ROOT, "tests", "treefold_worker.py")
    rc, out = run_mpi(n, [worker, "treefold"] + [f"{k}={v}" for k, v in extra.items()],
                      timeout=120)
    lines = [ln for ln in out.splitlines() if ln.startswith("OK treefold ")]
    assert lines, out[-3000:]
    assert int(lines[-1].split()[2]) == (3 * 6 + 4) * n
