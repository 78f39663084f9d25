"""Bandwidth-aware planner schedules (degraded AllReduce, re-ranked and relayed rings) run on the
real r2comm engine under mpiexec.

    mpiexec -n N python tests/planner_worker.py SCENARIO [key=value ...]

degraded   degraded-server AllReduce for a RailState with a slow host, several split fractions,
           dtypes, ops and sizes (up to several engine chunks); then for real (n >= 3): the
           last rank loses its NIC 1, the live state shows its host at half bandwidth, and
           the planner's choice (degraded for large messages) runs
rerouted   re-ranked ring and relayed ring / recursive doubling for a RailState with broken pairs,
           then for real: rank 0 loses every rail to rank 1, the RailState is built from the
           engines' live rail_stats() (allgathered), the planner routes around the broken pair
           and the collective still completes (n >= 3)
railsplit  the weighted direct AllReduce with per-pair rail weights (n >= 3): exact, and the
           engine's striping follows the declared weights
Each rank checks its result against numpy and that all ranks hold the same bits; rank 0 prints
"OK <scenario> <count>" at the end.

Schedules are posted with run_schedule(), a local copy of what Channel.start does (the
hook channel.py would need is Channel.run_schedule(sched, recvbuf, sendbuf, op))."""
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, PROD, MIN, MAX, planner  # noqa: E402
from r2comm.planner import degraded  # noqa: E402
from r2comm.planner.schedule import WORK, SEND  # noqa: E402
from r2comm.planner.state import RailState  # noqa: E402
from mpi_worker import WORLD, data, reduce_ref, check, same_everywhere, main  # noqa: E402


def run_schedule(comm, sched, recvbuf, sendbuf=None, op=SUM, coll="allreduce", members=None):
    """Post `sched` (this rank's Schedule, ranks of `comm`) on comm's engine and wait: what
    Channel.start does for a planned collective. Every rank must call it in the same
    order (it takes the next sequence number). members: the communicator ranks the operation
    involves (default all; a relayed schedule may leave out a peer it cannot reach)."""
    from r2comm._core.engine import Plan, Buffer, memcopy
    from r2comm.ops import as_op, dtype_code
    from r2comm.request import Request
    chan = comm.channel
    chan.check()
    op = as_op(op)
    gm = chan.global_ranks()
    from r2comm.front.plans import send_rail_weights
    msgs = [(k, gm[p], st, b, off, n, mode, own) for (k, p, st, b, off, n, mode, own) in sched.msgs]
    plan = Plan(msgs, sched.deps, sched.algo, None, send_rail_weights(sched, sched.msgs))
    comm._world.links.connect_for({m[1] for m in msgs})   # as the communicator (issue 31)
    work = recvbuf
    send = recvbuf if sendbuf is None else sendbuf
    scratch = np.empty(sched.scratch, np.uint8) if sched.scratch else None
    keep, ptr = [None, None, None], [0, 0, 0]
    for i, (obj, writable) in enumerate(((work, True), (send, False), (scratch, True))):
        if obj is not None:
            keep[i] = Buffer(obj, writable)
            ptr[i] = keep[i].ptr
    pre = ([] if sendbuf is None else [(WORK, 0, SEND, 0, recvbuf.nbytes)]) + sched.pre
    for (db, do, sb, so, n) in pre:
        if n:
            memcopy(ptr[db] + do, ptr[sb] + so, n)
    dtc = dtype_code(recvbuf.dtype)
    count = zlib.crc32(f"{coll}|{recvbuf.nbytes}|{dtc}|{op.code}|0|{sched.algo}|{comm.size}".encode())
    seq = chan.next_seq()
    mem = list(gm) if members is None else [gm[m] for m in sorted(members)]
    oid = chan.engine.post(plan, ptr[0], ptr[1], ptr[2], dtc, op.code, chan.comm_id, seq, count,
                           comm.timeout, mem)
    posts = [p for p in sched.post if p[4]]

    def finish():
        for (db, do, sb, so, n) in posts:
            memcopy(ptr[db] + do, ptr[sb] + so, n)
    Request(chan, oid, keep, finish if posts else None).Wait()


def peers_of(sched, me):
    return {m[1] for m in sched.msgs} | {me}


def allreduce_case(comm, sched_fn, case, cnt, dtype, op, members=None):
    n, r = comm.size, comm.rank
    isz = np.dtype(dtype).itemsize
    sched = sched_fn(cnt * isz, isz)
    x = data(case, r, cnt, dtype, op)
    y = np.full_like(x, 7)
    run_schedule(comm, sched, y, x, op, members=peers_of(sched, r) if members == "used" else None)
    check(np.array_equal(y, reduce_ref(case, n, cnt, dtype, op)), f"{case} ({sched.algo})")
    same_everywhere(y, case)
    return sched


CASES = [(1, "int32", SUM), (7, "int64", MAX), (1000, "float32", SUM), (999, "float16", PROD),
         (4097, "float64", MIN), ((3 << 20) // 4 + 5, "float32", SUM)]   # the last: many chunks


def sc_degraded(comm, args):
    n, r = comm.size, comm.rank
    count = 0
    slow = int(args.get("slow", n - 1))
    st = RailState.uniform(n, 2)
    st.scale_host(slow, float(args.get("beta", 0.3)))
    if n > 2:
        check(st.degraded_ranks() == [slow], f"degraded rank seen: {st.describe()}")
    for frac in (None, 0.0, 0.4, 0.75):
        for cnt, dtype, op in CASES:
            def fn(nbytes, isz, frac=frac):
                return degraded.allreduce_degraded(r, n, nbytes, isz, comm.channel.config.eager, st,
                                                   frac=frac, degraded=[slow])
            s = allreduce_case(comm, fn, f"deg-{frac}-{cnt}-{dtype}", cnt, dtype, op)
            check(s.algo == "degraded", s.algo)
            count += 1
    # the weighted direct schedule (planner/direct.py) on the engine, every case exact
    for cnt, dtype, op in CASES if n > 2 else []:
        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "direct", st)
        s = allreduce_case(comm, fn, f"direct-{cnt}-{dtype}", cnt, dtype, op)
        check(s.algo == "direct", s.algo)
        count += 1
    # through the planner's interface, as communicator.py would call it
    for cnt, dtype, op in CASES[2:4]:
        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager,
                                 "degraded" if n > 2 else "", st)
        allreduce_case(comm, fn, f"deg-build-{cnt}", cnt, dtype, op)
        count += 1
    comm.Barrier()
    if n < 3 or args.get("real", "1") == "0":
        return count
    # for real: the last rank loses its NIC 1 (to every peer): its host has half the bandwidth
    if r == n - 1:
        comm.fail_rail(1, "hard")
    live = wait_state(comm, lambda st: st.degraded_ranks() == [n - 1])
    check(live.degraded_ranks() == [n - 1] and live.beta() == 0.5, f"live: {live.describe()}")
    for cnt, dtype, op in CASES:
        isz = np.dtype(dtype).itemsize
        algo = planner.choose("allreduce", n, cnt * isz, isz, live, eager=comm.channel.config.eager)

        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "", live)
        s = allreduce_case(comm, fn, f"live-deg-{cnt}-{dtype}", cnt, dtype, op)
        if r == 0:
            print(f"LIVE {cnt}x{dtype}: chose {algo} -> {s.algo}", flush=True)
        count += 1
    comm.Barrier()
    return count


def live_state(comm):
    """The rail state of the NIC facts every rank holds, agreed over r2comm's control plane (the
    same on every rank)."""
    return comm.rail_state()


def wait_state(comm, cond, limit=15):
    """Poll the live state until cond(state) (decided alike on every rank)."""
    deadline = time.monotonic() + limit
    while True:
        st = live_state(comm)
        late = WORLD.allreduce(time.monotonic() > deadline, op=MPI.LOR)
        if cond(st) or late:
            return st
        time.sleep(0.05)


def sc_rerouted(comm, args):
    n, r = comm.size, comm.rank
    count = 0
    st = RailState.uniform(n, 2)
    broken = [(0, 1)] + ([(2, 3)] if n >= 5 else [])
    for a, b in broken:
        st.break_pair(a, b)
    if n < 3:                        # two ranks without a working rail: nothing to route over
        try:
            planner.choose("allreduce", n, 1 << 20, 4, st)
        except planner.PartitionedError:
            return 1
        raise AssertionError("a partitioned pair was planned for")
    for algo in ("ring_rerouted", "ring", "recursive_doubling"):
        for cnt, dtype, op in CASES:
            def fn(nbytes, isz, algo=algo):
                return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, algo, st)
            s = allreduce_case(comm, fn, f"rr-{algo}-{cnt}-{dtype}", cnt, dtype, op)
            check(not any(tuple(sorted((r, m[1]))) in broken for m in s.msgs),
                  f"{s.algo} talks over a broken pair")
            count += 1
    comm.Barrier()
    if args.get("real", "1") == "0":
        return count
    # for real: rank 0 loses every rail to rank 1
    nrails = len(comm.rails)
    if r == 0:
        for k in range(nrails):
            comm.fail_rail(k, "hard", peer=1)
    stt = wait_state(comm, lambda st: st.broken_pairs() == [(0, 1)])
    check(stt.broken_pairs() == [(0, 1)], f"live state sees the broken pair: {stt.describe()}")
    check(not stt.partitioned(), "not partitioned")
    for cnt, dtype, op in CASES:
        isz = np.dtype(dtype).itemsize
        algo = planner.choose("allreduce", n, cnt * isz, isz, stt, eager=comm.channel.config.eager)

        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "", stt)
        s = allreduce_case(comm, fn, f"live-{cnt}-{dtype}", cnt, dtype, op, members="used")
        check(r > 1 or 1 - r not in {m[1] for m in s.msgs}, f"{s.algo} uses the dead pair")
        if r == 0:
            print(f"LIVE {cnt}x{dtype}: chose {algo} -> {s.algo}", flush=True)
        count += 1
    # the Communicator's own plans follow the pair's facts by themselves (issue 39): relayed
    # around the dead pair, exact, at one call on every rank; a static plan would need it
    x = np.arange(1000, dtype="float32") + r
    y = np.empty_like(x)
    try:
        comm.Iallreduce(x, y).Wait(timeout=10)
        got = "ok" if np.array_equal(y, n * np.arange(1000, dtype="float32") +
                                     n * (n - 1) // 2) else "wrong"
    except r2comm.R2commError as exc:
        got = type(exc).__name__
    got = WORLD.allgather((got, comm.epoch, comm.channel.plan_state is not None and
                           comm.channel.plan_state.broken_pairs() == [(0, 1)]))
    check(all(g == (got[0][0], got[0][1], True) for g in got) and got[0][0] == "ok" and
          got[0][1] >= 1, f"the plans relay around the dead pair by themselves: {got}")
    if r == 0:
        print(f"AUTO {got}", flush=True)
    WORLD.Barrier()
    return count


def sent_per_rail(comm, peer):
    """Bytes this rank's engine sent to communicator rank `peer` per rail, hedge copies aside."""
    rows = comm._world.engine.rail_stats()[comm.channel.world_rank(peer)]
    return [row[1] - row[8] for row in rows]


def sc_railsplit(comm, args):
    """The weighted direct schedule with rail weights (n >= 3): the last rank's NIC 1 at 1/4
    (a RailState: loopback rails are equal), so the healthy pairs declare more on rail 1;
    every case exact, and for a large message each healthy rank's bytes to each healthy peer
    split over the rails as declared (within 0.05, every pair in one same try); then rank 0's favoured rail fails hard
    during one and the result is still exact."""
    n, r = comm.size, comm.rank
    st = RailState.uniform(n, 2)
    for q in range(n - 1):
        st.set_link(q, n - 1, 1, bw=st.rail_bw(q, n - 1, 1) / 4)
    check(st.degraded_ranks() == [n - 1], st.describe())
    count = 0
    for cnt, dtype, op in CASES:
        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "direct", st)
        s = allreduce_case(comm, fn, f"split-{cnt}-{dtype}", cnt, dtype, op)
        check(s.algo == "direct" and (r == n - 1) == (not s.rail_weights), s.rail_weights)
        count += 1
    cnt = 8 << 20                                   # 32 MiB of float32: many chunks per pair
    healthy = [q for q in range(n - 1) if q != r]

    def big(nbytes, isz):
        return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "direct", st)
    # up to five tries: the engine passes a declared rail by while its acks are late (a rank
    # descheduled for 20 ms on a loaded machine), and the split then drifts past 0.05 (seen:
    # 0.687 for 0.636, 1 run in ~10 under pytest). Every try is exact. A try passes only as a
    # whole: every rank's every healthy pair within 0.05 in that same try (one try is judged,
    # never each pair on its best try); the tries stop at the first that passes
    for attempt in range(5):
        before = {q: sent_per_rail(comm, q) for q in healthy}
        s = allreduce_case(comm, big, f"split-big-{attempt}", cnt, "float32", SUM)
        lines, off = [], []
        for q in healthy if r != n - 1 else []:
            got = [a - b for a, b in zip(sent_per_rail(comm, q), before[q])]
            share, want = got[1] / sum(got), s.rail_weights[q][1]
            lines.append(f"SPLIT {r}->{q} want {want:.3f} got {share:.3f} (try {attempt})")
            if abs(share - want) >= 0.05:
                off.append(lines[-1])
        total_off = WORLD.allreduce(len(off))
        if total_off == 0:
            break
    for ln in sum(WORLD.gather(lines, root=0) or [], []):
        print(ln, flush=True)
    check(total_off == 0, f"rail 1's share off the declared one by 0.05 or more in each of "
          f"{attempt + 1} tries ({total_off} pairs in the last); this rank's: " + "; ".join(off))
    count += 1
    # rank 0's rail 1 (the one its healthy pairs favour) fails hard in the middle of the next
    # one: its chunks move to rail 0 and the result is still exact
    if r == 0:
        comm.fail_rail(1, "hard", after_bytes=4 << 20)
    allreduce_case(comm, big, "split-fail", cnt, "float32", SUM)
    if r == 0:
        rows = comm._world.engine.rail_stats()
        check(any(rows[comm.channel.world_rank(q)][1][6] > 0 for q in range(1, n)),
              f"rank 0's rail 1 did not fail: {rows}")
    count += 1
    comm.Barrier()
    return count


SCENARIOS = {"degraded": sc_degraded, "rerouted": sc_rerouted, "railsplit": sc_railsplit}


if __name__ == "__main__":
    main(SCENARIOS, dump_after=120)
