"""Issue 32 item 2: the rail state agreed through per-rank summaries (planner.agree): each rank
contributes O(rails + changes) numbers, and the agreed NicRailState is the one the dense gather
(every rank's row per peer and rail) gives, compacted."""
import random

import numpy as np
import pytest

from r2comm import planner
from r2comm.planner import agree
from r2comm.planner.state import RailState

GBIT = 1.25e8


def healthy(hosts, nrails, rate=10 * GBIT, seed=0, jitter=0.2):
    """Every rank's rail_stats-like rows {peer: [(state, weight, rate), ...]}, noisy rates."""
    rnd = random.Random(seed)
    n = len(hosts)
    return [{p: [["up", 1.0, rate * (1 - jitter * rnd.random())] for _ in range(nrails)]
             for p in range(n) if p != r} for r in range(n)]


def nic_down(stats, hosts, host, k):
    for r, d in enumerate(stats):
        for p, rows in d.items():
            if (hosts[r] == host) != (hosts[p] == host):
                rows[k][0] = "down"
    return stats


def pair_down(stats, a, b, k):
    stats[a][b][k][0] = stats[b][a][k][0] = "down"
    return stats


def slow_nic(stats, hosts, host, k, factor):
    for r, d in enumerate(stats):
        for p, rows in d.items():
            if (hosts[r] == host) != (hosts[p] == host):
                rows[k][2] *= factor
    return stats


def as_engine(stats_r, n):
    """One rank's rows as Engine.rail_stats() gives them (global rank -> rows, the state in
    row[0], the weight in row[5], the rate in row[7])."""
    return {p: [(st, 0, 0, 0, 0, w, 0, rate) for st, w, rate in rows]
            for p, rows in stats_r.items()}


def dense(stats, hosts, rates, **kw):
    """The old path: every rank's rows allgathered, RailState.gather(compact=True)."""
    n = len(hosts)
    frozen = [{p: [tuple(x) for x in rows] for p, rows in d.items()} for d in stats]
    return RailState.gather(lambda mine: frozen, 0, list(range(n)), as_engine(stats[0], n),
                            hosts, rates=rates, compact=True, **kw)


def summaries(stats, hosts, nrails, rates, rail_bw=None):
    n = len(hosts)
    labels = list(hosts) if len(set(hosts)) > 1 else list(range(n))
    return [agree.summarise({p: [tuple(x) for x in rows] for p, rows in stats[r].items()}, r,
                            labels, nrails, rates, rail_bw) for r in range(n)]


def both_paths(stats, hosts, nrails, rates, **kw):
    """The agreed state computed directly from the summaries (None where that path does not
    apply) and through the rebuilt per-rank stats."""
    sums = summaries(stats, hosts, nrails, rates, kw.get("rail_bw"))
    table, excs = np.array([s[0] for s in sums]), [s[1] for s in sums]
    fast = agree.direct_state(table, excs, hosts, nrails, rates=rates, **kw)
    slow = RailState.from_rail_stats(hosts, agree.rebuild(table, excs, hosts, nrails,
                                                          kw.get("rail_bw"), rates),
                                     rates=rates, **kw).compact()
    return fast, slow


def agreed(stats, hosts, nrails, rates, rank=0, **kw):
    """The new path on `rank`, its exchange fed by every rank's own summary."""
    n = len(hosts)
    sums = summaries(stats, hosts, nrails, rates, kw.get("rail_bw"))

    def exchange(fixed, exc):
        assert np.array_equal(fixed, sums[rank][0])
        return np.array([s[0] for s in sums]), [s[1] for s in sums]
    return agree.agree_state(exchange, rank, list(range(n)), as_engine(stats[rank], n), hosts,
                           nrails, rates=rates, **kw)


def same(a, b):
    """Equal NicRailStates: the same NIC table, local bandwidth, exceptions, hence plans."""
    assert a.nic == b.nic
    assert a.intra_bw == b.intra_bw
    assert a.exceptions == b.exceptions
    assert a.degraded_tol == b.degraded_tol
    assert a.fingerprint() == b.fingerprint()


HOSTS = [h for h in "abcd" for _ in range(2)]          # 4 hosts x 2 ranks


def scenarios():
    yield "healthy", healthy(HOSTS, 2)
    yield "nic down", nic_down(healthy(HOSTS, 2, seed=1), HOSTS, "c", 1)
    yield "pair rail down", pair_down(healthy(HOSTS, 2, seed=2), 1, 6, 0)
    yield "slow rail", slow_nic(healthy(HOSTS, 2, seed=3), HOSTS, "b", 0, 0.1)
    st = healthy(HOSTS, 2, seed=4)
    st[3][5][1][2] = 0.0                                 # not measured yet
    st[5][3][1][2] = 0.0
    del st[7][0]                                         # no rows towards one peer
    st[2][6] = st[2][6][:1]                              # one rail only towards another
    yield "unmeasured and missing", st
    st = pair_down(nic_down(healthy(HOSTS, 2, seed=5), HOSTS, "a", 0), 2, 7, 1)
    yield "nic and pair down", slow_nic(st, HOSTS, "d", 1, 0.25)


@pytest.mark.parametrize("rates", ["nic", "declared"])
@pytest.mark.parametrize("name,stats", list(scenarios()), ids=[s[0] for s in scenarios()])
def test_agreed_state_equals_dense_gather_compacted(name, stats, rates):
    want = dense(stats, HOSTS, rates)
    for rank in (0, 5):
        same(agreed(stats, HOSTS, 2, rates, rank=rank), want)
    fast, slow = both_paths(stats, HOSTS, 2, rates)
    same(slow, want)
    if name != "unmeasured and missing":         # a missing rail: the rebuild path only
        same(fast, want)
    if name != "healthy" and (rates, name) != ("declared", "slow rail"):
        assert not want.healthy()           # declared: a slow rate is not believed


def test_agreed_state_with_declared_rail_bandwidths():
    stats = slow_nic(healthy(HOSTS, 3, seed=6), HOSTS, "a", 2, 0.1)
    for rates in ("nic", "declared"):
        same(agreed(stats, HOSTS, 3, rates, rail_bw=[1.0, 2.0, 1.0]),
             dense(stats, HOSTS, rates, rail_bw=[1.0, 2.0, 1.0]))


def test_scale_mode_on_one_machine():
    """Loopback ("scale"): every rank its own host. Equal to the dense gather when each rank's
    rails measure alike; with wild rates the scale is a median of per-rank medians, inside the
    measured range, and the plans stay healthy."""
    one = ["node"] * 6
    even = healthy(one, 2, seed=7, jitter=0.0)
    same(agreed(even, one, 2, "scale"), dense(even, one, "scale"))
    lost = nic_down(healthy(one, 2, seed=8, jitter=0.0), list(range(6)), 4, 1)
    a = agreed(lost, one, 2, "scale")
    same(a, dense(lost, one, "scale"))
    assert a.beta() == 0.5
    wild = healthy(one, 2, seed=9, jitter=0.9)
    a, d = agreed(wild, one, 2, "scale"), dense(wild, one, "scale")
    assert a.healthy() and d.healthy() and a.exceptions == d.exceptions == {}
    vals = [x[2] for s in wild for rows in s.values() for x in rows]
    bw = a.nic[0][0]
    assert min(vals) <= bw <= max(vals) and a.nic == [[bw] * 2 for _ in range(6)]
    assert abs(bw / d.nic[0][0] - 1) < 0.3
    x = planner.build("allreduce", 0, 6, 64 << 20, 4, 0, 64 << 10, state=a)
    y = planner.build("allreduce", 0, 6, 64 << 20, 4, 0, 64 << 10, state=d)
    assert x.algo == y.algo


def summary_size(n, nrails=8, per_host=8, down=True):
    """The most numbers any rank contributes, n ranks, NIC 3 of host 1 down (ranks on host 1,
    on host 0 and on the last host looked at: every other rank is like one of them)."""
    hosts = [r // per_host for r in range(n)]
    out = 0
    for r in (0, per_host, n - 1):
        mine = {p: [("down" if down and k == 3 and (hosts[r] == 1) != (hosts[p] == 1)
                     else "up", 1.0, 1e9) for k in range(nrails)] for p in range(n) if p != r}
        out = max(out, agree.row_size(*agree.summarise(mine, r, hosts, nrails)))
    return out


def test_contribution_grows_with_rails_and_changes_not_ranks():
    """The old gather_rails row was n x K x 3 numbers per rank (12,288 at n=512, K=8)."""
    assert summary_size(64) == summary_size(512) == 2 * 8 * agree.FIELDS + 1 + 8 * agree.EXC_FIELDS
    assert summary_size(64, down=False) == summary_size(512, down=False) == 2 * 8 * agree.FIELDS + 1
    # one more pair rail down adds one exception on each of its two ranks
    hosts = [r // 8 for r in range(64)]
    mine = {p: [("up", 1.0, 1e9)] * 8 for p in range(64) if p != 0}
    mine[40] = [("down", 1.0, 0.0)] + [("up", 1.0, 1e9)] * 7
    fixed, exc = agree.summarise(mine, 0, hosts, 8)
    assert exc.tolist() == [[40, 0, 0.0, 1.0, 0.0, 0.0]] and fixed[-1] == 1


def test_received_summaries_are_validated():
    hosts = list(range(4))
    st = healthy(hosts, 2)
    sums = [agree.summarise(st[r], r, hosts, 2) for r in range(4)]
    table = np.array([s[0] for s in sums])
    excs = [s[1] for s in sums]
    bad = table.copy()
    bad[1, -1] = 2.5
    with pytest.raises(ValueError, match="counts"):
        agree.rebuild(bad, excs, hosts, 2)
    bad = table.copy()
    bad[2, 0] = 7.0
    with pytest.raises(ValueError, match="malformed"):
        agree.rebuild(bad, excs, hosts, 2)
    with pytest.raises(ValueError, match="shape"):
        agree.rebuild(table[:, :-2], excs, hosts, 2)
    best = table[1, 3]                      # rank 1's best rate on rail 0 towards others
    for row in ([9, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0], [2, 5, 0, 1, 0, 0], [2, 0, 0.5, 1, 0, 0],
                [2, 0, 0, 1, 1, 0], [2, 0, np.nan, 1, 0, 0], [2, 0, 1, 1, 0, 1e6],
                [2, 0, 1, 1, 1, -1.0], [2, 0, 1, 1, 1, best], [2, 0, 0, 1, 0]):
        excs2 = list(excs)
        excs2[1] = np.array([row], np.float64)
        with pytest.raises(ValueError):
            agree.rebuild(table, excs2, hosts, 2)
        with pytest.raises(ValueError):
            agree.direct_state(table, excs2, hosts, 2)


def random_stats(rnd, hosts, nrails):
    """Noisy rates, a few NICs down or slow, a few pairs' rails down or unmeasured, a rank
    whose NIC reads apart from its host mate's."""
    stats = healthy(hosts, nrails, seed=rnd.random(), jitter=0.25)
    labels = sorted(set(hosts))
    for _ in range(rnd.randrange(3)):
        nic_down(stats, hosts, rnd.choice(labels), rnd.randrange(nrails))
    for _ in range(rnd.randrange(3)):
        slow_nic(stats, hosts, rnd.choice(labels), rnd.randrange(nrails), rnd.choice((0.1, 0.5)))
    n = len(hosts)
    for _ in range(rnd.randrange(4)):
        a, b = rnd.sample(range(n), 2)
        pair_down(stats, a, b, rnd.randrange(nrails))
    for _ in range(rnd.randrange(3)):
        a, b = rnd.sample(range(n), 2)
        stats[a][b][rnd.randrange(nrails)][2] = 0.0
    if rnd.random() < 0.5:
        r, k = rnd.randrange(n), rnd.randrange(nrails)
        for p, rows in stats[r].items():
            rows[k][2] *= 0.05
    return stats


@pytest.mark.parametrize("seed", range(40))
def test_direct_state_equals_dense_on_random_faults(seed):
    """The summaries give the dense gather's compacted state, computed without going over
    every pair (where it applies: checked to apply on most of these)."""
    rnd = random.Random(seed)
    per = rnd.choice((1, 2, 3))
    hosts = [h for h in range(rnd.randrange(2, 6)) for _ in range(per)]
    nrails = rnd.randrange(1, 4)
    stats = random_stats(rnd, hosts, nrails)
    for rates in ("nic", "declared"):
        want = dense(stats, hosts, rates)
        fast, slow = both_paths(stats, hosts, nrails, rates)
        same(slow, want)
        if fast is not None:
            same(fast, want)
        elif rates == "declared":
            pytest.fail("the direct path applies to every declared state without missing rails")


MBIT = 1.25e5                                           # bytes/s


def rows_of(rows):
    """{rank: {(peer, rail): Mbit/s}} -> rail_stats-like rows in bytes/s."""
    return [{p: [["up", 1.0, row[(p, k)] * MBIT] for k in range(2)]
             for p in sorted({p for p, _ in row})} for _, row in sorted(rows.items())]


# bench/testbed_degraded.py --hosts 3 --slow 0.5: NIC 1 of host 2 shaped to 250 Mbit/s after
# start-up; the ring measured it on the pairs it sent on, (0, 2, 1) and (2, 1, 1) kept the
# start-up probe's rate.
SLOWED = {0: {(1, 0): 677, (1, 1): 643, (2, 0): 496, (2, 1): 495},
          1: {(0, 0): 473, (0, 1): 507, (2, 0): 468, (2, 1): 282},
          2: {(0, 0): 492, (0, 1): 291, (1, 0): 475, (1, 1): 514}}


@pytest.mark.parametrize("rates", ["nic"])
def test_slowed_nic_seen_from_the_pairs_that_measured_it(rates):
    """Host 2's own best on rail 1 (514, a stale probe towards rank 1) is contradicted by rank
    1, whose rail 1 measured 282 towards it: the agreed NIC is the reported rate (the old
    state kept 514 and beta 1.0). Every path gives the same state."""
    hosts = [0, 1, 2]
    stats = rows_of(SLOWED)
    want = dense(stats, hosts, rates)
    fast, slow = both_paths(stats, hosts, 2, rates)
    for st in (fast, slow, agreed(stats, hosts, 2, rates, rank=2)):
        same(st, want)
    assert 280 * MBIT <= want.nic[2][1] <= 292 * MBIT
    assert want.nic[2][0] == want.nic[0][0] == want.nic[0][1] == want.nic[1][1]
    assert want.beta() < 0.85
    assert want.host_bw(2) < want.host_bw(0) == want.host_bw(1)
    assert want.degraded_hosts() == []                   # 0.78 > 1 - MEASURE_NOISE
    assert RailState.from_rail_stats(hosts, stats, noise=0.2).compact().degraded_hosts() == [2]
    # rank 1 reports its slow pair towards rank 2 (one exception), the others report none
    sums = summaries(stats, hosts, 2, rates)
    assert [len(e) for _, e in sums] == [0, 1, 1]
    assert sums[1][1].tolist() == [[2, 1, 1.0, 1.0, 1.0, 282 * MBIT]]


def test_one_slow_pair_is_not_taken_for_a_slow_nic():
    """A slow path between ranks 1 and 3 on rail 1, both NICs measured fast towards the other
    hosts: no NIC is lowered, the state stays healthy."""
    hosts = list(range(4))
    stats = healthy(hosts, 2, rate=GBIT, seed=11, jitter=0.1)
    stats[1][3][1][2] = stats[3][1][1][2] = 0.3 * GBIT
    want = dense(stats, hosts, "nic")
    fast, slow = both_paths(stats, hosts, 2, "nic")
    same(fast, want)
    same(slow, want)
    assert want.beta() == 1.0 and want.healthy() and want.exceptions == {}
    assert len(set(v for row in want.nic for v in row)) == 1
    # the same pair slow on one side only (a stale fast figure on the other): still a path
    stats[3][1][1][2] = GBIT
    one_sided = dense(stats, hosts, "nic")
    same(both_paths(stats, hosts, 2, "nic")[0], one_sided)
    assert one_sided.healthy() and len(set(v for row in one_sided.nic for v in row)) == 1


def test_slow_nic_summary_grows_with_its_peers_not_with_ranks():
    """Every rank of another host reports the slowed NIC's ranks: per_host exceptions each,
    at 64 and at 512 ranks alike; the slowed host's ranks report nothing new."""
    def size(n, per_host=8, nrails=4):
        hosts = [r // per_host for r in range(n)]
        out = []
        for r in (0, per_host, n - 1):
            mine = {p: [("up", 1.0, 1e8 if k == 3 and (hosts[r] == 1) != (hosts[p] == 1)
                         else 1e9) for k in range(nrails)] for p in range(n) if p != r}
            out.append(agree.row_size(*agree.summarise(mine, r, hosts, nrails)))
        return out
    fixed = 2 * 4 * agree.FIELDS + 1
    assert size(64) == size(512) == [fixed + 8 * agree.EXC_FIELDS, fixed, fixed + 8 * agree.EXC_FIELDS]
