"""Start-up bandwidth probe and epoch agreement over r2comm's control plane, under mpiexec.

    mpiexec -n N python tests/probe_worker.py SCENARIO [key=value ...]

probe     the probe measured every rail to the ring neighbours, seeded the engine's rates of
          every peer, sent its bytes on every rail to the neighbours; a message pinned to rail k goes on rail k; rail_state() (over the
          control plane) is identical on every rank and healthy; prints PROBE ms=<slowest rank>
epoch     (R2COMM_REPLAN=1) the agreed epoch is identical on every rank after every operation,
          without the bootstrap communicator; it changes when the last rank loses NIC 1, the
          ranks then plan for the state with that NIC down, and again once it is back
broken    (R2COMM_REPLAN=1, n >= 3) ranks 0 and 1 lose every rail between them: the next
          epoch check still agrees (flooding through rank 2), the state shows the broken pair
          and the allreduces are routed around it
smallrates  (2 ranks) 8-byte messages whose acks a stopped peer delays leave the rails' rates
          unmeasured; 1 MiB allreduces that follow on loopback rails send no hedge copies
slowhedge  rail 1 seeded 4x slower: no hedge copies on loopback by default; copies with
          R2COMM_HEDGE=2 (expect=copies)
netns     (in the testbed) prints every probe rate, RATE <rank> <peer> <rail> <bytes/s>, the
          slowest rank's probe time and the agreed state's degraded ranks
Rank 0 prints "OK <scenario> <count>" at the end."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from mpi_worker import WORLD, check, data, reduce_ref, main  # noqa: E402


class NoBootstrap:
    """Stands in for the bootstrap mpi4py communicator: collectives on it are a test failure
    (the agreement must go through r2comm); everything else is forwarded."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("allgather", "allreduce", "bcast", "Allgather", "Allreduce", "Bcast",
                    "barrier", "Barrier", "gather", "alltoall"):
            def refuse(*a, **k):
                raise AssertionError(f"bootstrap communicator used: {name}")
            return refuse
        return getattr(self._real, name)


def rail_rows(comm):
    return comm.channel.engine.rail_stats()


def sc_probe(comm, args):
    n, r = comm.size, comm.rank
    res = comm.probe_result
    check(res is not None, "the probe ran")
    nrails = len(comm.rails)
    partners = {(r - 1) % n, (r + 1) % n} - {r}          # issue 31: the ring neighbours
    want = {(p, k) for p in partners for k in range(nrails)}
    check(set(res.rates) == want and not res.skipped, f"every rail to the partners measured: {res}")
    check(all(v > 1e6 for v in res.rates.values()), f"plausible rates {res.rates}")
    check(len(res.nic_rates) == nrails and all(v > 1e6 for v in res.nic_rates),
          f"NIC rates {res.nic_rates}")
    stats = rail_rows(comm)
    for p in range(n):
        if p != r:
            for k in range(nrails):
                row = stats[p][k]
                check(row[7] > 0, f"engine rate of peer {p} rail {k} seeded: {row}")
                if p in partners:
                    check(row[1] >= res.nbytes, f"the probe sent its bytes on rail {k} to {p}: {row}")
    slowest = WORLD.allreduce(res.seconds, op=MPI.MAX)
    if r == 0:
        print(f"PROBE ms={slowest * 1e3:.1f} nbytes={res.nbytes} rates_GBps="
              + ",".join(f"{p}/{k}:{v / 1e9:.2f}" for (p, k), v in sorted(res.rates.items())),
              flush=True)
    # a pinned message uses its rail (every chunk placed there; hedge copies aside)
    count = 1
    size = 4 << 20
    buf = np.ones(size, np.uint8)
    for k in range(nrails):
        if r in (0, 1):
            peer = 1 - r
            before = rail_rows(comm)[peer]
            if r == 0:
                comm.Send(buf, 1, tag=5, rail=k)
            else:
                comm.Recv(buf, 0, tag=5)
            after = rail_rows(comm)[peer]
            if r == 0:
                sent = [a[1] - b[1] - ((a[8] - b[8]) if len(a) > 8 else 0)
                        for a, b in zip(after, before)]
                check(sent[k] >= size, f"pinned to rail {k}: bytes per rail {sent}")
                check(sum(sent) - sent[k] < size // 20, f"pinned to rail {k}: {sent}")
            count += 1
        WORLD.Barrier()
    st = comm.rail_state()
    fps = WORLD.allgather(st.fingerprint())
    check(all(f == fps[0] for f in fps), "rail_state() identical on every rank")
    check(st.healthy() and st.beta() == 1.0, f"healthy loopback state: {st.describe()}")
    # held per host and NIC (issue 39): no per-pair table, no exception on a healthy job
    check(len(st.nic) == n and all(len(row) == nrails for row in st.nic) and not st.exceptions
          and not st.link, f"a per-host-and-NIC state: {st.describe()}")
    return count


def agreed(comm, what):
    eps = WORLD.allgather(comm.epoch)
    check(len(set(eps)) == 1, f"{what}: epochs differ between ranks: {eps}")
    return eps[0]


def allreduce_checked(comm, i, cnt=200_000):
    n, r = comm.size, comm.rank
    x = data(f"ep{i}", r, cnt, "int32", r2comm.SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    check(np.array_equal(y, reduce_ref(f"ep{i}", n, cnt, "int32", r2comm.SUM)), f"result {i}")


def until_epoch_above(comm, e, label, limit=15.0, start=0):
    """Run checked allreduces until the agreed epoch exceeds e (bounded; the stop decision is
    taken alike on every rank)."""
    deadline = time.monotonic() + limit
    i = start
    while True:
        allreduce_checked(comm, i)
        i += 1
        ep = agreed(comm, f"{label} op {i}")
        late = WORLD.allreduce(time.monotonic() > deadline, op=MPI.LOR)
        if ep > e or late:
            return ep, i
        time.sleep(0.01)


def sc_epoch(comm, args):
    n, r = comm.size, comm.rank
    check(comm.channel.config.replan_every == 1, "run with R2COMM_REPLAN=1")
    check(comm.epoch == 0, "epoch 0 before the first operation")
    real = comm._mpi
    comm._mpi = NoBootstrap(real)
    try:
        allreduce_checked(comm, 0)
        e1 = agreed(comm, "first operation")
        check(e1 == 0 and comm.channel.plan_state is None, f"first check: epoch {e1}, static plans")
        for i in range(1, 4):
            allreduce_checked(comm, i)
            check(agreed(comm, f"op {i}") == 0, "no change, no new epoch")
        if r == n - 1:
            comm.fail_rail(1, "hard")
        e2, i = until_epoch_above(comm, e1, "after NIC loss", start=4)
        check(e2 > e1, f"the epoch changed after the NIC loss ({e1} -> {e2})")
        st = comm.channel.plan_state
        check(st is not None and not st.healthy(), "plans follow the degraded state")
        if n >= 3:
            check(st.degraded_ranks() == [n - 1], f"degraded: {st.describe()}")
        if r == n - 1:
            comm.restore_rail(1)
        e3, i = until_epoch_above(comm, e2, "after restore", start=i)
        check(e3 > e2, f"the epoch changed again once the NIC was back ({e2} -> {e3})")
    finally:
        comm._mpi = real
    if r == 0:
        print(f"EPOCHS {e1} {e2} {e3} ops={i}", flush=True)
    return 3


def sc_broken(comm, args):
    n, r = comm.size, comm.rank
    check(n >= 3 and comm.channel.config.replan_every == 1, "n >= 3, R2COMM_REPLAN=1")
    allreduce_checked(comm, 0)
    e1 = agreed(comm, "first")
    nrails = len(comm.rails)
    if r == 0:
        for k in range(nrails):
            comm.fail_rail(k, "hard", peer=1)
    # both ends see the pair without a rail, and every rank holds the pair's facts (the lower
    # rank announces them: nicwatch.py), before the next operation
    from r2comm.control import facts
    keys = [facts.pair_key(0, 1, k) for k in range(nrails)]
    deadline = time.monotonic() + 10
    while True:
        rows = rail_rows(comm)
        mine = all(row[0] == "down" for row in rows[1 - r]) if r in (0, 1) else True
        mine = mine and all(comm._world.facts.level(key) == 0 for key in keys)
        if WORLD.allreduce(0 if mine else 1) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    real = comm._mpi
    comm._mpi = NoBootstrap(real)
    try:
        t = time.monotonic()
        allreduce_checked(comm, 1)              # the check floods around the broken pair
        took = time.monotonic() - t
    finally:
        comm._mpi = real
    e2 = agreed(comm, "after the broken pair")
    st = comm.channel.plan_state
    check(e2 > e1 and st is not None and st.broken_pairs() == [(0, 1)],
          f"epoch {e1} -> {e2}, state {None if st is None else st.describe()}")
    for i in range(2, 5):
        allreduce_checked(comm, i)
    if r == 0:
        print(f"BROKEN epoch {e1}->{e2} first op {took:.2f}s algo="
              f"{comm.schedule('allreduce', 800_000, 4).algo}", flush=True)
    return 4


def sc_netns(comm, args):
    res = comm.probe_result
    check(res is not None, "probe ran")
    mine = [f"RATE {comm.rank} {p} {k} {v:.0f}" for (p, k), v in sorted(res.rates.items())]
    lines = WORLD.gather((mine, res.seconds), root=0)
    st = comm.rail_state()
    if comm.rank == 0:
        for ls, _ in lines:
            for ln in ls:
                print(ln, flush=True)
        print(f"PROBE ms={max(t for _, t in lines) * 1e3:.0f}", flush=True)
        print(f"STATE degraded={st.degraded_ranks()} beta={st.beta():.3f} {st.describe()}",
              flush=True)
    return 1


def sc_smallrates(comm, args):
    """A small chunk says nothing about its rail's bandwidth, however long its ack takes:
    rank 1 is stopped (SIGSTOP) while rank 0 sends it 8 bytes pinned to each rail, for 20 ms
    on rail 0 and 60 ms on rail 1, as a busy host delays acks. No rail gets a measured rate
    (before the fix: ~80 B/s), and the 1 MiB allreduces that follow on the alike loopback
    rails send no hedge copies (in the benchmark, rates of 0.1 and 0.8 MB/s read this way
    had the tail hedge copy 512 KiB chunks: 1.7 GB of copies, 0.75x MPI's speed at 1 MiB)."""
    import signal
    r = comm.rank
    check(comm.size == 2, "two ranks")
    pids = WORLD.allgather(os.getpid())
    buf = np.zeros(8, np.uint8)
    for k, stop_s in enumerate((0.02, 0.06)[:len(comm.rails)]):
        WORLD.Barrier()
        if r == 0:
            os.kill(pids[1], signal.SIGSTOP)
            try:
                time.sleep(0.005)
                req = comm.Isend(buf + k + 1, 1, tag=k, rail=k)
                time.sleep(stop_s)
            finally:
                os.kill(pids[1], signal.SIGCONT)
            req.Wait()
        else:
            comm.Recv(buf, 0, tag=k)
            check(np.all(buf == k + 1), "pinned message")
        WORLD.Barrier()
        time.sleep(0.01)                       # the (delayed) ack is back at rank 0
    rates = [row[7] for peer in rail_rows(comm).values() for row in peer[:len(comm.rails)]]
    check(all(v == 0 for v in rates), f"rates measured from 8-byte messages: {rates}")
    hedged0 = sum(ra.bytes_hedged for ra in comm.rails)
    cnt = 1 << 18                              # 1 MiB of int32
    for i in range(30):
        allreduce_checked(comm, i, cnt)
        WORLD.Barrier()
    hedged = WORLD.allreduce(sum(ra.bytes_hedged for ra in comm.rails) - hedged0)
    check(hedged == 0, f"{hedged} bytes hedged between healthy loopback rails")
    return 1


def sc_slowhedge(comm, args):
    """Rail 1 is seeded as 4x slower than rail 0 (as a probe could read loopback rails that
    share the CPUs). On loopback-only rails the default hedges quiet rails only, so no copies
    are sent; with R2COMM_HEDGE=2 the 'slow' rail's tail chunks are copied (expect=copies)."""
    n, r = comm.size, comm.rank
    hedged0 = sum(ra.bytes_hedged for ra in comm.rails)
    cnt = 1 << 20                              # 4 MiB of int32
    for i in range(10):
        for p in range(n):                     # again each time: acks re-measure the rails
            if p != r:                         # (windows of one chunk: both rails get some)
                comm.channel.engine.tuning.set_rail_rate(p, 0, 4e6)
                comm.channel.engine.tuning.set_rail_rate(p, 1, 1e6)
        WORLD.Barrier()
        allreduce_checked(comm, i, cnt)
    hedged = WORLD.allreduce(sum(ra.bytes_hedged for ra in comm.rails) - hedged0)
    if args.get("expect") == "copies":
        check(hedged > 0, "R2COMM_HEDGE=2: a rail seeded 4x slower was never hedged")
    else:
        check(hedged == 0, f"{hedged} bytes hedged on loopback rails by their seeded rates")
    return 1


SCENARIOS = {"probe": sc_probe, "epoch": sc_epoch, "broken": sc_broken, "netns": sc_netns,
             "smallrates": sc_smallrates, "slowhedge": sc_slowhedge}


if __name__ == "__main__":
    main(SCENARIOS, dump_after=120)
