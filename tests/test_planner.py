"""Bandwidth-aware planner (r2comm/planner: state, cost, degraded, routing): unit tests without
sockets, including a pure-Python executor that runs a schedule set on numpy buffers the way the
engine does (chunk-level dependencies, owned sends copied when ready, non-owned sends read the
buffer when they leave, receives applied only once their gates open) under adversarial
interleavings, to prove the new schedules compute the reduction with identical bits on every
rank."""
import heapq
import itertools
import math
import zlib

import numpy as np
import pytest

from r2comm import planner
from r2comm.planner import algorithms, cost, degraded, routing
from r2comm.planner.schedule import (WORK, SEND, SCRATCH, COPY, REDUCE,
                                     REDUCE_SEND, REDUCE_SEND_REV)
from r2comm.planner.state import RailState, PartitionedError

NP = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}
MB = 1 << 20


# ---------------------------------------------------------------------------------------------
# the executor
class ScheduleError(AssertionError):
    pass


def execute(schedules, bufs, dtype, op="SUM", chunk=64, seed=0, policy="random"):
    """Run one Schedule per rank on bufs[r] = {WORK: uint8 array, SEND: ..., } (SCRATCH is
    allocated here). Chunks are `chunk` bytes rounded down to whole elements, as in the engine.
    policy "random": any enabled action next; "skew": every message gets a random priority and
    the highest enabled action always goes first (starves some messages as long as possible);
    "fifo": in order of enabling. Raises ScheduleError on a deadlock, an unmatched message, a
    misaligned reduction or a receive overwriting data a pending send has yet to read."""
    dt = np.dtype(dtype)
    isz = dt.itemsize
    cs = max(isz, chunk - chunk % isz)
    rng = np.random.default_rng(seed)
    for r, s in enumerate(schedules):
        bufs[r][SCRATCH] = np.zeros(s.scratch, np.uint8)
        for (db, do, sb, so, ln) in s.pre:
            if ln:
                bufs[r][db][do:do + ln] = bufs[r][sb][so:so + ln].copy()
    recv_of = {}
    for r, s in enumerate(schedules):
        for i, m in enumerate(s.msgs):
            if m[0] == "recv":
                recv_of[(m[1], r, m[2])] = i
    nch = {}
    match = {}
    for r, s in enumerate(schedules):
        for i, m in enumerate(s.msgs):
            nch[(r, i)] = 1 if m[5] == 0 else -(-m[5] // cs)
            if m[0] == "send":
                key = (r, m[1], m[2])
                if key not in recv_of:
                    raise ScheduleError(f"send {key} has no receive")
                j = recv_of.pop(key)
                if schedules[m[1]].msgs[j][5] != m[5]:
                    raise ScheduleError(f"send {key}: sizes differ")
                match[(r, i)] = (m[1], j)
            elif m[6] != COPY and (m[4] % isz or m[5] % isz):
                raise ScheduleError(f"rank {r} reduces into a misaligned region {m[4]}+{m[5]}")
    if recv_of:
        raise ScheduleError(f"receives without a send: {sorted(recv_of)[:4]}")
    gate, succ = {}, {}
    for r, s in enumerate(schedules):
        for i in range(len(s.msgs)):
            gate[(r, i)] = [0] * nch[(r, i)]
            succ[(r, i)] = []
        for a, b in s.deps:
            if nch[(r, a)] != nch[(r, b)] or s.msgs[a][5] != s.msgs[b][5]:
                raise ScheduleError(f"rank {r}: dependency {a}->{b} between different sizes")
            succ[(r, a)].append((r, b))
            for c in range(nch[(r, b)]):
                gate[(r, b)][c] += 1

    def region(r, i, c):
        m = schedules[r].msgs[i]
        lo = m[4] + c * cs
        hi = m[4] + min((c + 1) * cs, m[5])
        return m[3], lo, max(lo, hi)

    prio = {k: rng.random() for k in gate}
    pool, heap, fifo = [], [], []
    counter = itertools.count()

    def enable(action):
        if policy == "random":
            pool.append(action)
        elif policy == "skew":
            heapq.heappush(heap, (-prio[action[1]], next(counter), action))
        else:
            fifo.append(action)

    def take():
        if policy == "random":
            if not pool:
                return None
            k = int(rng.integers(len(pool)))
            pool[k], pool[-1] = pool[-1], pool[k]
            return pool.pop()
        if policy == "skew":
            return heapq.heappop(heap)[2] if heap else None
        return fifo.pop(0) if fifo else None

    snap, inbox, applied, pending_reads = {}, {}, set(), {}
    done_sends = set()

    def chunk_done(k, c):
        for b in succ[k]:
            gate[b][c] -= 1
            if gate[b][c] == 0:
                opened(b, c)

    def opened(k, c):
        r, i = k
        m = schedules[r].msgs[i]
        if m[0] == "send":
            send_ready(k, c)
        elif (k, c) in inbox:
            enable(("apply", k, c))

    def send_ready(k, c):
        r, i = k
        m = schedules[r].msgs[i]
        buf, lo, hi = region(r, i, c)
        if m[7]:                                    # owned: copied now, done now
            snap[(k, c)] = bufs[r][buf][lo:hi].copy()
            done_sends.add((k, c))
            chunk_done(k, c)
        else:
            pending_reads[(k, c)] = (r, buf, lo, hi)
        enable(("tx", k, c))

    for k, g in gate.items():
        for c in range(len(g)):
            if g[c] == 0:
                r, i = k
                if schedules[r].msgs[i][0] == "send":
                    send_ready(k, c)
    total = sum(len(g) for g in gate.values())
    steps = 0
    while True:
        act = take()
        if act is None:
            break
        steps += 1
        kind, k, c = act
        r, i = k
        if kind == "tx":
            buf, lo, hi = region(r, i, c)
            data = snap.pop((k, c)) if (k, c) in snap else bufs[r][buf][lo:hi].copy()
            pending_reads.pop((k, c), None)
            dst = match[k]
            inbox[(dst, c)] = data
            if gate[dst][c] == 0:
                enable(("apply", dst, c))
            if not schedules[r].msgs[i][7]:
                enable(("ack", k, c))
        elif kind == "ack":
            done_sends.add((k, c))
            chunk_done(k, c)
        else:
            m = schedules[r].msgs[i]
            buf, lo, hi = region(r, i, c)
            for (pk, pc), (pr, pb, plo, phi) in pending_reads.items():
                if pr == r and bufs[r][pb] is bufs[r][buf] and plo < hi and lo < phi:
                    raise ScheduleError(f"rank {r}: receive {i} chunk {c} overwrites bytes "
                                        f"{lo}..{hi} of buffer {buf} before send {pk[1]} "
                                        f"chunk {pc} has read them")
            data = inbox.pop((k, c))
            dst = bufs[r][buf][lo:hi]
            if m[6] == COPY:
                dst[:] = data
            elif hi > lo:
                mine = bufs[r][SEND][lo:hi] if m[6] in (REDUCE_SEND, REDUCE_SEND_REV) else dst
                a, b = mine.view(dt), data.view(dt)
                with np.errstate(all="ignore"):
                    res = NP[op](a, b) if m[6] in (REDUCE, REDUCE_SEND) else NP[op](b, a)
                dst[:] = np.asarray(res, dt).view(np.uint8)
            applied.add((k, c))
            chunk_done(k, c)
    nrecv = sum(len(g) for (r, i), g in gate.items() if schedules[r].msgs[i][0] == "recv")
    nsend = total - nrecv
    if len(applied) != nrecv or len(done_sends) != nsend:
        raise ScheduleError(f"deadlock: {len(applied)}/{nrecv} receive chunks applied, "
                            f"{len(done_sends)}/{nsend} send chunks done after {steps} steps")
    for r, s in enumerate(schedules):
        for (db, do, sb, so, ln) in s.post:
            if ln:
                bufs[r][db][do:do + ln] = bufs[r][sb][so:so + ln].copy()
    return bufs


def inputs(case, n, count, dtype, op="SUM", exact=True):
    """Per-rank inputs; exact ones make every reduction order give the same answer."""
    out = []
    for r in range(n):
        rng = np.random.default_rng([zlib.crc32(case.encode()), r])
        if not exact:
            out.append(rng.standard_normal(count).astype(dtype))
        elif op == "PROD":
            out.append((rng.choice([1, 1, 1, 2], count) * rng.choice([1, -1], count)).astype(dtype))
        elif op == "SUM":
            out.append(rng.integers(0, 10 if np.dtype(dtype).itemsize == 1 else 200,
                                    count).astype(dtype))
        else:
            out.append(rng.integers(-50, 100, count).astype(dtype))
    return out


def reference(xs, op, dtype):
    acc = xs[0].copy()
    for x in xs[1:]:
        with np.errstate(all="ignore"):
            acc = NP[op](acc, x).astype(dtype)
    return acc


def run_allreduce(schedules, xs, op="SUM", chunk=64, seed=0, policy="random", in_place=False):
    """Like Communicator.Allreduce: WORK starts as a copy of the input unless the schedule
    says it fills WORK itself (then it starts as garbage, so a byte it misses shows up);
    in_place makes SEND and WORK one array."""
    dtype = xs[0].dtype
    bufs = []
    for x, s in zip(xs, schedules):
        send = x.view(np.uint8).copy()
        if in_place:
            work = send
        elif s.fills_work:
            work = np.full(send.size, 0xA5, np.uint8)
        else:
            work = send.copy()
        bufs.append({WORK: work, SEND: send})
    execute(schedules, bufs, dtype, op, chunk, seed, policy)
    return [b[WORK].view(dtype) for b in bufs]


def check_allreduce(schedules, xs, op="SUM", exact=True, **kw):
    outs = run_allreduce(schedules, xs, op, **kw)
    ref = reference(xs, op, xs[0].dtype)
    for r, y in enumerate(outs):
        assert y.tobytes() == outs[0].tobytes(), f"rank {r}'s bits differ from rank 0's"
    if exact:
        assert np.array_equal(outs[0], ref), "result differs from numpy"
    else:
        assert np.allclose(outs[0], ref, rtol=1e-4, atol=1e-4)
    return outs[0]


def consistent(schedules):
    """The check of test_units.test_schedules_are_consistent, over a schedule set."""
    sends, recvs = {}, {}
    for r, s in enumerate(schedules):
        s.validate()
        for kind, peer, step, buf, off, nbytes, mode, owned in s.msgs:
            assert peer != r and 0 <= peer < len(schedules) and 0 <= step < 1 << 24
            (sends if kind == "send" else recvs)[(r, peer, step) if kind == "send"
                                                 else (peer, r, step)] = nbytes
    assert sends == recvs
    return True


def degraded_state(n, slow=(1,), factor=0.25, nrails=2):
    st = RailState.uniform(n, nrails)
    for h in slow:
        st.scale_host(h, factor)
    return st


# ---------------------------------------------------------------------------------------------
# the executor itself has teeth
def test_executor_runs_the_existing_algorithms_exactly():
    for n in (2, 3, 5):
        xs = inputs(f"ex{n}", n, 37, "int32")
        for sc in ([algorithms.allreduce_ring(r, n, 37 * 4, 4) for r in range(n)],
                   [algorithms.allreduce_rd(r, n, 37 * 4, 4) for r in range(n)]):
            for pol in ("random", "skew", "fifo"):
                check_allreduce(sc, xs, chunk=12, seed=n, policy=pol)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("eager", [0, 1 << 20])
def test_allreduce_reading_the_send_buffer(n, eager):
    """Ring and (with a separate send buffer) recursive doubling read the input from SEND and
    write every byte of WORK themselves: WORK starts as garbage and the result is still exact,
    with the float operand order (bits) the same as the copy-first schedules; in place
    (SEND is WORK) the ring stays race-free and recursive doubling falls back to copies."""
    count = 41
    for dtype, op, exact in (("int32", "SUM", True), ("float32", "SUM", False),
                             ("float64", "MIN", True), ("int16", "PROD", True)):
        xs = inputs(f"send{n}{dtype}{op}", n, count, dtype, op, exact=exact)
        nb, isz = count * xs[0].itemsize, xs[0].itemsize
        ring = [algorithms.allreduce_ring(r, n, nb, isz, eager) for r in range(n)]
        rd = [algorithms.allreduce_rd(r, n, nb, isz, True, eager) for r in range(n)]
        rd_old = [algorithms.allreduce_rd(r, n, nb, isz) for r in range(n)]
        assert all(s.fills_work for s in ring + rd) and not any(s.fills_work for s in rd_old)
        assert any(m[3] == SEND for s in rd for m in s.msgs)
        for seed, pol in enumerate(("random", "skew", "fifo", "random")):
            kw = dict(chunk=3 * isz, seed=seed, policy=pol)
            got = check_allreduce(rd, xs, op, exact=exact, **kw)
            assert got.tobytes() == run_allreduce(rd_old, xs, op, **kw)[0].tobytes()
            check_allreduce(ring, xs, op, exact=exact, **kw)
            for y in run_allreduce(ring, xs, op, in_place=True, **kw):
                assert y.tobytes() == run_allreduce(ring, xs, op, **kw)[0].tobytes()
            for y in run_allreduce(rd_old, xs, op, in_place=True, **kw):
                assert y.tobytes() == got.tobytes()


def test_executor_sees_a_reduce_send_schedule_run_in_place():
    """Recursive doubling that sends straight from SEND is wrong in place (the receive
    overwrites what the send has yet to read): the executor must say so."""
    n, count = 2, 64
    xs = inputs("rdinplace", n, count, "int32")
    rd = [algorithms.allreduce_rd(r, n, count * 4, 4, True) for r in range(n)]
    with pytest.raises(ScheduleError, match="overwrites"):
        for seed in range(20):
            run_allreduce(rd, xs, chunk=8, seed=seed, policy="skew", in_place=True)


def test_executor_catches_broken_schedules():
    n = 3
    xs = inputs("broken", n, 30, "int32")
    sc = [algorithms.allreduce_ring(r, n, 120, 4) for r in range(n)]
    cut = [planner.Schedule(s.algo, list(s.msgs), [], s.scratch) for s in sc]  # no dependencies
    bad = 0
    for seed in range(20):
        try:
            check_allreduce(cut, xs, chunk=8, seed=seed, policy="skew")
        except AssertionError:
            bad += 1
    assert bad > 10
    lone = [planner.Schedule("x", [("send", 1, 0, WORK, 0, 8, COPY, False)]),
            planner.Schedule("x", [])]
    with pytest.raises(ScheduleError, match="no receive"):
        execute(lone, [{WORK: np.zeros(8, np.uint8)} for _ in range(2)], "int32")
    cyc = [planner.Schedule("x", [("recv", 1, 0, WORK, 0, 8, COPY, False),
                                  ("send", 1, 1, WORK, 0, 8, COPY, False)], [(0, 1)]),
           planner.Schedule("x", [("recv", 0, 1, WORK, 0, 8, COPY, False),
                                  ("send", 0, 0, WORK, 0, 8, COPY, False)], [(0, 1)])]
    with pytest.raises(ScheduleError, match="deadlock"):
        execute(cyc, [{WORK: np.zeros(8, np.uint8)} for _ in range(2)], "int32")
    with pytest.raises(ValueError, match="cycle"):
        cost.predict(cyc, RailState.uniform(2))


# ---------------------------------------------------------------------------------------------
# state
def test_rail_state_queries():
    st = RailState.uniform(4, nrails=2, bw=1e9)
    assert st.usable_rails(0, 1) == [0, 1] and st.pair_bw(0, 1) == 2e9
    assert st.host_bw(0) == 2e9 and st.beta() == 1.0 and not st.degraded_ranks()
    st.fail_rail(2, 1)                               # rank 2's NIC 1 is gone
    assert st.usable_rails(2, 0) == [0] and st.pair_bw(0, 2) == 1e9
    assert st.usable_rails(0, 1) == [0, 1]
    assert st.host_bw(2) == 1e9 and st.beta() == 0.5 and st.degraded_ranks() == [2]
    st.set_link(0, 3, 0, bw=0.5e9)
    assert st.pair_bw(0, 3) == 1.5e9
    assert st.broken_pairs() == [] and not st.partitioned()
    st.break_pair(1, 3)
    assert st.broken_pairs() == [(1, 3)] and not st.partitioned()
    one_sided = RailState.uniform(2, 1)
    one_sided.link[(0, 1, 0)] = (False, 1e9)         # down at one end only: unusable
    assert one_sided.broken_pairs() == [(0, 1)] and one_sided.partitioned()
    multi = RailState.uniform(4, 2, hosts=["a", "a", "b", "b"])
    assert multi.host_list() == ["a", "b"] and multi.rank_bw(0) == multi.host_bw("a") / 2
    stats = [{1: [("up", 1.0), ("down", 1.0)]}, {0: [("up", 1.0), ("up", 2.0)]}]
    live = RailState.from_rail_stats(["h0", "h1"], stats, nominal_bw=1e9)
    assert live.usable_rails(0, 1) == [0] and live.pair_bw(0, 1) == 1e9
    # gather(): engine rows keyed by global rank, allgathered; one machine -> a host per rank
    engine_rows = {10: {20: [("up", 5, 0, 0, 0, 1.0, 0), ("down", 0, 0, 0, 0, 1.0, 1)]},
                   20: {10: [("up", 5, 0, 0, 0, 1.0, 0), ("up", 0, 0, 0, 0, 1.0, 0)]}}
    mines = [{1: [("up", 1.0, 0.0), ("down", 1.0, 0.0)]}, {0: [("up", 1.0, 0.0), ("up", 1.0, 0.0)]}]
    views = []
    for r, g in enumerate((10, 20)):
        seen = []
        views.append(RailState.gather(lambda mine: seen.append(mine) or mines, r, [10, 20],
                                      engine_rows[g], ["same", "same"], nominal_bw=1e9))
        assert seen == [mines[r]]
    assert views[0].fingerprint() == views[1].fingerprint()
    assert views[0].hosts == [0, 1] and views[0].usable_rails(0, 1) == [0]


def test_rail_weights_sum_to_one_and_follow_bandwidth():
    st = RailState.uniform(3, nrails=4, bw=1e9)
    st.set_link(0, 1, 1, bw=3e9)
    st.set_link(0, 1, 2, up=False)
    w = st.rail_weights(0, 1)
    assert math.isclose(sum(w), 1.0) and w[2] == 0.0
    assert math.isclose(w[1], 3 * w[0]) and math.isclose(w[3], w[0])
    for a, b in itertools.permutations(range(3), 2):
        assert math.isclose(sum(st.rail_weights(a, b)), 1.0)
    st.break_pair(1, 2)
    assert st.rail_weights(1, 2) == [0.0] * 4


# ---------------------------------------------------------------------------------------------
# cost model
def test_lower_bound_formula():
    N, B = 1e9, 1e10
    assert cost.lower_bound(N, B, 1.0, 4) == pytest.approx(N / B * 2 * 3 / 4)
    assert cost.lower_bound(N, B, 0.1, 4) == pytest.approx(N / B * 10)
    b = 0.8
    assert cost.lower_bound(N, B, b, 8) == pytest.approx(N / B * max(1 / b, 14 / (7 + b)))
    assert cost.lower_bound(N, B, 0.5, 1) == 0.0


@pytest.mark.parametrize("n", [3, 4, 6])
def test_ring_cost_is_the_slowest_link_and_never_beats_the_bound(n):
    N = 64 * MB
    st = RailState.uniform(n, 2, bw=1e9, alpha=1e-5)
    ring = planner.build_all("allreduce", n, N, 4, algo="ring", state=st)
    t = ring[0].cost
    assert t == pytest.approx(cost.ring_time(N, n, 2e9), rel=0.02)
    assert t >= cost.lower_bound_state(N, st)
    st.fail_rail(1, 0)                                # one NIC of rank 1 down: half its links
    t2 = planner.build_all("allreduce", n, N, 4, algo="ring", state=st)[0].cost
    assert t2 == pytest.approx(cost.ring_time(N, n, 1e9), rel=0.02)
    for algo in planner.candidates("allreduce", n, st):
        sc = planner.build_all("allreduce", n, N, 4, algo=algo, state=st)
        assert sc[0].cost >= cost.lower_bound_state(N, st) * (1 - 1e-9), algo


def test_cost_prefers_latency_for_small_and_bandwidth_for_large():
    st = RailState.uniform(8, 2)
    assert planner.choose("allreduce", 8, 1024, 4, st) == "recursive_doubling"
    assert planner.choose("allreduce", 8, 64 * MB, 4, st) == "ring"
    a = cost.analyse(planner.build_all("allreduce", 8, 64 * MB, 4, algo="recursive_doubling",
                                       state=st), st)
    assert a["bottleneck"][0] in ("host egress", "host ingress", "pair")


# ---------------------------------------------------------------------------------------------
# degraded AllReduce
def test_split_fraction_follows_bandwidths():
    n, k = 6, 1
    xs = [degraded.split_fraction(n, k, beta, 1.0) for beta in np.linspace(0.05, 1.0, 40)]
    assert all(b >= a - 1e-12 for a, b in zip(xs, xs[1:])), "more bandwidth, more ring"
    assert xs[0] == 0.0 and xs[-1] == 1.0
    for beta in (0.7, 0.8, 0.9):
        x = degraded.split_fraction(n, k, beta, 1.0)
        assert 0 < x < 1
        vd, vh = degraded.volumes(x, n, k)
        assert vd / beta == pytest.approx(vh / 1.0)     # both finish together
    # proportional in bandwidth only: scaling both leaves x unchanged
    assert degraded.split_fraction(n, k, 0.8e9, 1e9) == pytest.approx(
        degraded.split_fraction(n, k, 0.8, 1.0))
    # part A + part B = the whole buffer, at element granularity
    st = degraded_state(5, factor=0.8)
    frac = degraded.state_fraction(st)
    assert 0 < frac < 1
    count = 1001
    s0 = degraded.allreduce_degraded(0, 5, count * 4, 4, 0, st)
    regions = sorted({(m[4], m[5]) for m in s0.msgs})
    covered = np.zeros(count * 4, bool)
    for off, ln in regions:
        covered[off:off + ln] = True
    assert covered.all()
    ca = int(round(frac * count))
    assert all((off + ln <= ca * 4) or off >= ca * 4 for off, ln in regions)


def test_split_fraction_ignores_one_under_read_healthy_host():
    """A healthy host measured 20% slow (within the noise tolerance, so not degraded) must not
    move the split: the split compares the degraded rank with the median healthy one."""
    st = degraded_state(4, factor=0.5)
    st.degraded_tol = 0.3                               # as for measured rates (MEASURE_NOISE)
    assert degraded.state_fraction(st) == 0.0           # beta = 1/2: all of it off the ring
    noisy = st.copy().scale_host(st.hosts[2], 0.8)        # host 1 is the degraded one
    assert noisy.degraded_ranks() == st.degraded_ranks()
    assert degraded.state_fraction(noisy) == 0.0
    # a really faster degraded host still gets a share of the full ring
    assert degraded.state_fraction(degraded_state(4, factor=0.8)) > 0


@pytest.mark.parametrize("n", [3, 4, 6])
def test_choose_degraded_when_beta_small_ring_when_healthy(n):
    N = 256 * MB
    healthy = RailState.uniform(n, 2)
    assert planner.choose("allreduce", n, N, 4, healthy) == "ring"
    slow = degraded_state(n, factor=0.25)
    assert slow.beta() == pytest.approx(0.25)
    costs = planner.evaluate("allreduce", n, N, 4, slow)
    want = planner.choose("allreduce", n, N, 4, slow)
    # a degraded-server schedule: the tree fold is offered from 4 healthy ranks on (n = 6);
    # the weighted direct one (the slow rank owning no block here) ties with the degraded one
    assert want in (("degraded", "direct") if n < 5 else ("degraded", "treefold", "direct"))
    t_star = cost.lower_bound_state(N, slow)
    assert costs[want] < costs["ring"]
    assert costs[want] <= 1.01 * t_star                # at the bound: N/(βB)
    assert costs["ring"] >= 2 * (n - 1) / n * t_star * 0.99
    mild = degraded_state(n, factor=0.99)               # within tolerance: not degraded
    assert planner.choose("allreduce", n, N, 4, mild) == "ring"
    # build() with a state and no algorithm runs what choose() picked
    s = planner.build("allreduce", 0, n, N, 4, 0, 64 << 10, state=slow)
    assert s.algo == want and s.cost == pytest.approx(costs[want])


EXACT_CASES = ((1, "int32", "SUM"), (None, "int64", "MAX"), (103, "float32", "SUM"),
               (250, "float16", "PROD"), (77, "float64", "MIN"))   # None: 4 n + 3


def check_exact_cases(build, n, tag):
    """Every rank's schedule from build(rank, nbytes, itemsize), run in the executor under
    three delivery orders for each of EXACT_CASES: consistent and exact. Returns the last
    case's (schedules, inputs, itemsize)."""
    for count, dtype, op in EXACT_CASES:
        count = 4 * n + 3 if count is None else count
        isz = np.dtype(dtype).itemsize
        sc = [build(r, count * isz, isz) for r in range(n)]
        assert consistent(sc)
        xs = inputs(f"{tag}-{n}-{count}-{dtype}", n, count, dtype, op)
        for seed, pol in ((1, "random"), (2, "skew"), (3, "fifo")):
            check_allreduce(sc, xs, op, chunk=5 * isz, seed=seed, policy=pol)
    return sc, xs, isz


def check_float_bits_identical(algo, n, tag):
    """Every rank's `algo` schedule for n ranks with slow hosts 1 and 4 (non-owned and owned
    sends): random float32 sums bit-identical on every rank under four delivery orders."""
    st = degraded_state(n, slow=(1, 4), factor=0.5)
    for eager in (0, 1 << 20):                    # non-owned and owned (copied) sends
        sc = planner.build_all("allreduce", n, 999 * 4, 4, eager=eager, algo=algo, state=st)
        assert consistent(sc) and sc[0].algo == algo
        xs = inputs(tag, n, 999, "float32", exact=False)
        for seed in range(4):
            check_allreduce(sc, xs, exact=False, chunk=24, seed=seed,
                            policy=("random", "skew")[seed % 2])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
@pytest.mark.parametrize("factor", [0.1, 0.6, 0.85])
def test_degraded_schedule_computes_the_reduction(n, factor):
    st = degraded_state(n, slow=(n // 2,), factor=factor)
    check_exact_cases(lambda r, nb, isz: degraded.allreduce_degraded(r, n, nb, isz, 0, st), n,
                      "deg")


def test_degraded_bits_identical_on_random_floats_and_several_slow_hosts():
    n = 6
    st = degraded_state(n, slow=(1, 4), factor=0.5)
    assert st.degraded_ranks() == [1, 4]
    for eager in (0, 1 << 20):                    # non-owned and owned (copied) sends
        sc = planner.build_all("allreduce", n, 999 * 4, 4, eager=eager, algo="degraded", state=st)
        assert consistent(sc)
        assert any(m[1] in (1, 4) and m[2] >= 4 * n for m in sc[0].msgs)
        xs = inputs("float-deg", n, 999, "float32", exact=False)
        for seed in range(4):
            check_allreduce(sc, xs, exact=False, chunk=24, seed=seed,
                            policy=("random", "skew")[seed % 2])


def test_degraded_moves_fewer_bytes_through_the_slow_rank():
    n, N = 5, 1000 * 4 * 5
    st = degraded_state(n, factor=0.2)
    ring = planner.build_all("allreduce", n, N, 4, algo="ring", state=st)
    deg = planner.build_all("allreduce", n, N, 4, algo="degraded", state=st)
    assert deg[1].bytes_sent() < ring[1].bytes_sent()
    assert deg[1].bytes_sent() == pytest.approx(N, rel=0.01)      # x = 0: its data once
    assert ring[1].bytes_sent() == 2 * (n - 1) * N // n


# ---------------------------------------------------------------------------------------------
# routing
def _has_ham_cycle(n, ok):
    for perm in itertools.permutations(range(1, n)):
        cyc = (0,) + perm
        if all(ok(cyc[i], cyc[(i + 1) % n]) for i in range(n)):
            return True
    return False


def test_ring_order_avoids_broken_pairs():
    rng = np.random.default_rng(5)
    found = 0
    for trial in range(60):
        n = int(rng.integers(4, 8))
        st = RailState.uniform(n, 2)
        pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
        for idx in rng.choice(len(pairs), int(rng.integers(1, n)), replace=False):
            st.break_pair(*pairs[idx])
        order = routing.ring_order(st)
        exists = _has_ham_cycle(n, st.working)
        assert (order is not None) == exists
        if order is not None:
            found += 1
            assert sorted(order) == list(range(n))
            assert routing.broken_neighbours(st, order) == []
    assert found > 30
    assert routing.ring_order(RailState.uniform(6)) == list(range(6))


def test_ring_order_prefers_fast_links():
    st = RailState.uniform(5, 1, bw=1e9)
    st.set_link(0, 1, 0, bw=1e8)                       # a slow pair: keep it off the ring
    order = routing.ring_order(st)
    assert (0, 1) not in {tuple(sorted((order[i], order[(i + 1) % 5]))) for i in range(5)}


@pytest.mark.parametrize("n", [4, 5, 6])
def test_rerouted_ring_computes_the_reduction(n):
    st = RailState.uniform(n, 2)
    st.break_pair(0, 1)
    st.break_pair(2, 3)
    assert planner.choose("allreduce", n, 64 * MB, 4, st) == "ring_rerouted"
    for count, dtype in ((1, "int32"), (10 * n + 1, "float32"), (300, "float64")):
        isz = np.dtype(dtype).itemsize
        sc = planner.build_all("allreduce", n, count * isz, isz, algo="ring_rerouted", state=st)
        assert consistent(sc)
        assert not routing.uses_broken_pair(sc, st)
        assert sc[0].algo == "ring_rerouted"           # a Hamiltonian ring: no relay needed
        xs = inputs(f"rr-{n}-{count}", n, count, dtype)
        for seed, pol in ((0, "random"), (1, "skew")):
            check_allreduce(sc, xs, chunk=3 * isz, seed=seed, policy=pol)


def test_relay_when_no_hamiltonian_ring_exists():
    n = 5
    st = RailState.uniform(n, 2)
    for b in (1, 2, 3):                                 # rank 4 only reaches rank 0: degree 1
        st.break_pair(4, b)
    assert routing.ring_order(st) is None and not st.partitioned()
    costs = planner.evaluate("allreduce", n, 64 * MB, 4, st)
    assert all(math.isfinite(c) for c in costs.values())
    for algo in ("ring", "ring_rerouted", "recursive_doubling"):
        sc = planner.build_all("allreduce", n, 203 * 4, 4, algo=algo, state=st)
        assert len({s.algo for s in sc}) == 1
        assert consistent(sc) and not routing.uses_broken_pair(sc, st)
        if algo != "recursive_doubling":               # (rank 4 only talks to rank 0 there)
            assert sc[0].algo.endswith("+relay") and sum(s.scratch for s in sc) > 0
        xs = inputs(f"relay-{algo}", n, 203, "int32")
        for seed, pol in ((0, "random"), (1, "skew"), (2, "fifo")):
            check_allreduce(sc, xs, chunk=16, seed=seed, policy=pol)


def test_multi_hop_relay():
    n = 5                                               # a path 0-1-2-3-4: 0 and 4 are 4 hops
    st = RailState.uniform(n, 1)
    for a, b in itertools.combinations(range(n), 2):
        if b - a > 1:
            st.break_pair(a, b)
    assert routing.route(st, 0, 4) == [0, 1, 2, 3, 4]
    sc = planner.build_all("allreduce", n, 64 * 8, 8, algo="recursive_doubling", state=st)
    assert consistent(sc) and not routing.uses_broken_pair(sc, st)
    check_allreduce(sc, inputs("multi", n, 64, "float64"), chunk=40, seed=3, policy="skew")


@pytest.mark.parametrize("coll", ["bcast", "reduce", "allgather", "reduce_scatter_block",
                                  "alltoall", "barrier"])
def test_relay_other_collectives(coll):
    n, block, isz = 5, 12, 4
    st = RailState.uniform(n, 2)
    st.break_pair(0, 1)
    st.break_pair(0, 3)
    st.break_pair(2, 4)
    root = 1
    nb = 0 if coll == "barrier" else block * isz
    sc = planner.build_all(coll, n, nb, isz, root=root, eager=0, state=st)
    assert consistent(sc) and not routing.uses_broken_pair(sc, st)
    xs = [np.arange(block * n, dtype=np.int32) * (r + 1) + r for r in range(n)]
    if coll == "barrier":
        execute(sc, [{WORK: np.zeros(0, np.uint8)} for _ in range(n)], "uint8", chunk=8)
        return
    bufs = []
    for r, x in enumerate(xs):
        b = {SEND: x.view(np.uint8).copy()}
        if coll == "bcast":
            w = x[:block] if r == root else np.zeros(block, np.int32)
            b = {WORK: w.view(np.uint8).copy()}
        elif coll == "reduce":
            b = {SEND: x[:block].view(np.uint8).copy(),
                 WORK: x[:block].view(np.uint8).copy() if r == root else np.zeros(0, np.uint8)}
        elif coll == "allgather":
            w = np.zeros(block * n, np.int32)
            w[r * block:(r + 1) * block] = x[:block]
            b = {WORK: w.view(np.uint8).copy(), SEND: x[:block].view(np.uint8).copy()}
        elif coll == "reduce_scatter_block":
            b[WORK] = np.zeros(block * isz, np.uint8)
        else:
            b[WORK] = np.zeros(block * n * isz, np.uint8)
        bufs.append(b)
    execute(sc, bufs, "int32", "SUM", chunk=16, seed=1, policy="skew")
    out = [b[WORK].view(np.int32) for b in bufs]
    if coll == "bcast":
        assert all(np.array_equal(o, xs[root][:block]) for o in out)
    elif coll == "reduce":
        assert np.array_equal(out[root], sum(x[:block] for x in xs))
    elif coll == "allgather":
        ref = np.concatenate([x[:block] for x in xs])
        assert all(np.array_equal(o, ref) for o in out)
    elif coll == "reduce_scatter_block":
        tot = sum(xs)
        assert all(np.array_equal(out[r], tot[r * block:(r + 1) * block]) for r in range(n))
    else:
        for r in range(n):
            ref = np.concatenate([xs[k][r * block:(r + 1) * block] for k in range(n)])
            assert np.array_equal(out[r], ref)


def test_partition_is_detected_and_refused():
    st = RailState.uniform(4, 2)
    for a in (0, 1):
        for b in (2, 3):
            st.break_pair(a, b)
    assert st.partitioned() and st.components() == [[0, 1], [2, 3]]
    with pytest.raises(PartitionedError, match="disconnected"):
        planner.choose("allreduce", 4, MB, 4, st)
    with pytest.raises(PartitionedError):
        planner.build("allreduce", 0, 4, MB, 4, 0, 0, "ring_rerouted", st)
    with pytest.raises(PartitionedError):
        routing.relay([algorithms.allreduce_ring(r, 4, 64, 4) for r in range(4)], st)
    lonely = RailState.uniform(3, 1)
    lonely.break_pair(0, 2)
    lonely.break_pair(1, 2)
    assert lonely.partitioned()
    with pytest.raises(PartitionedError):
        planner.build_all("bcast", 3, 64, 1, state=lonely)


# ---------------------------------------------------------------------------------------------
# the planner's interface
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_every_new_schedule_is_consistent(n):
    states = [RailState.uniform(n, 2), degraded_state(n, slow=(n - 1,), factor=0.3)]
    if n >= 4:
        b = RailState.uniform(n, 2)
        b.break_pair(0, n - 1)
        b.break_pair(1, 2)
        states.append(b)
    for st in states:
        for algo in planner.ALLREDUCE_ALGOS:
            for nbytes, isz in ((4000 + 8 * 13, 8), (64, 4), (0, 4)):
                assert consistent(planner.build_all("allreduce", n, nbytes, isz, algo=algo,
                                                    state=st))
        for coll in ("bcast", "reduce", "allgather", "reduce_scatter_block", "alltoall",
                     "barrier"):
            assert consistent(planner.build_all(coll, n, 100, 4, root=n // 2, state=st))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_recursive_halving_allreduce_is_exact_in_any_order(n):
    """Rabenseifner (planner/algorithms.allreduce_halving) through the executor: exact and the
    same bits on every rank, in place or not, blocks of unequal and zero length, any order
    the dependencies allow (a receive overwriting a block a send has not read fails here)."""
    for count in (37, 3, 1, 64):
        xs = inputs(f"rh{n}-{count}", n, count, "int32")
        sc = [algorithms.allreduce_halving(r, n, count * 4, 4) for r in range(n)]
        assert consistent(sc) and all(s.fills_work for s in sc)
        for pol in ("random", "skew", "fifo"):
            for in_place in (False, True):
                check_allreduce(sc, xs, chunk=8, seed=count, policy=pol, in_place=in_place)
        steps = max(len({m[2] // n for m in s.msgs}) for s in sc)
        assert steps == 2 * (n.bit_length() - 1)      # 2·log2(n) levels, the ring has 2(n-1)
        ring = [algorithms.allreduce_ring(r, n, count * 4, 4) for r in range(n)]
        assert sum(s.bytes_sent() for s in sc) == sum(s.bytes_sent() for s in ring)
    with pytest.raises(ValueError, match="power-of-two"):
        algorithms.allreduce_halving(0, 3, 100, 4)


def test_one_host_of_four_or_eight_ranks_plans_recursive_halving():
    """The static rule: ranks of one host, a power of two of 4 or more, eager < size <= 8 MiB;
    several hosts, other counts and other sizes keep their plans; forcing it on 3 ranks runs
    the ring."""
    one = planner.Topology.from_labels(["h"] * 4)
    two = planner.Topology.from_labels(["a", "a", "b", "b"])
    E = 64 << 10
    assert planner.build("allreduce", 0, 4, 1 << 20, 4, 0, E, topo=one).algo == "rabenseifner"
    assert planner.build("allreduce", 0, 8, 8 << 20, 4, 0, E,
                         topo=planner.Topology.from_labels(["h"] * 8)).algo == "rabenseifner"
    assert planner.build("allreduce", 0, 4, 16 << 20, 4, 0, E, topo=one).algo == "ring"
    assert planner.build("allreduce", 0, 4, 4096, 4, 0, E, topo=one).algo == "recursive_doubling"
    assert planner.build("allreduce", 0, 3, 1 << 20, 4, 0, E,
                         topo=planner.Topology.from_labels(["h"] * 3)).algo == "ring"
    assert planner.build("allreduce", 0, 4, 1 << 20, 4, 0, E, topo=two).algo != "rabenseifner"
    assert planner.build("allreduce", 0, 4, 1 << 20, 4, 0, E, "ring", topo=one).algo == "ring"
    assert planner.build("allreduce", 0, 3, 1 << 20, 4, 0, E, "rabenseifner").algo == "ring"


def test_without_state_nothing_changes():
    for n in (1, 3, 4):
        for r in range(n):
            assert planner.build("allreduce", r, n, 1 << 20, 4, 0, 64 << 10) == \
                algorithms.allreduce_ring(r, n, 1 << 20, 4, 64 << 10)
            assert planner.build("allreduce", r, n, 100, 4, 0, 64 << 10) == \
                algorithms.allreduce_rd(r, n, 100, 4)
            assert planner.build("bcast", r, n, 100, 1, 0, 0) == algorithms.bcast_tree(r, n, 100, 0)
    with pytest.raises(ValueError, match="needs the rail state"):
        planner.build("allreduce", 0, 4, 100, 4, 0, 0, "degraded")
    with pytest.raises(ValueError, match="allreduce algorithms"):
        planner.build("allreduce", 0, 4, 100, 4, 0, 0, "bogus", RailState.uniform(4))
    with pytest.raises(ValueError, match="ranks"):
        planner.build("allreduce", 0, 4, 100, 4, 0, 0, "", RailState.uniform(3))


def test_healthy_state_plans_the_plain_ring():
    n = 4
    st = RailState.uniform(n)
    for r in range(n):
        s = planner.build("allreduce", r, n, 1 << 20, 4, 0, 0, state=st)
        ref = algorithms.allreduce_ring(r, n, 1 << 20, 4, 0)
        assert s.algo == "ring" and s.msgs == ref.msgs and s.deps == ref.deps


def test_degraded_with_a_broken_pair_too():
    n = 5
    st = degraded_state(n, slow=(2,), factor=0.4)
    st.break_pair(0, 1)
    st.break_pair(2, 4)                                # the slow rank cannot reach rank 4
    assert planner.choose("allreduce", n, 256 * MB, 4, st) == "degraded"
    for frac in (None, 0.5):
        sc = [degraded.allreduce_degraded(r, n, 301 * 4, 4, 0, st, frac=frac) for r in range(n)]
        sc = routing.relay(sc, st)
        assert consistent(sc) and not routing.uses_broken_pair(sc, st)
        for seed, pol in ((0, "random"), (1, "skew")):
            check_allreduce(sc, inputs(f"degbr-{frac}", n, 301, "int32"), chunk=20, seed=seed,
                            policy=pol)
