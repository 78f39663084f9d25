"""Fault-injection scenarios (run by mpi_worker.py under mpiexec).

random     trials of (collective, size, faults): 1 or 2 rails failed hard or silently, on random
           ranks, at a random byte offset of the traffic (0 = before the first chunk); every
           result compared bit for bit with the fault-free answer
partition  one rank loses every rail: every rank must raise R2commNetworkError within a bound
flap       a rail flaps (fail/restore every few ms) under a stream of allreduces
signals    a rank is stopped/continued and signalled: every progress thread keeps running
integrity  R2COMM_INTEGRITY=mac: collectives exact at several sizes; a frame altered on the
           wire fails its rail over, the result stays exact
slowloris  clients trickle a handshake into every listener while a rail fails and comes back
stall      a rank is stopped (SIGSTOP) for seconds mid-stream, then continued: no rail fails,
           results stay exact, the others record peer_stalled / peer_resumed for it
sigkill    a rank is killed (SIGKILL) mid-stream: every survivor raises, within a bound
"""
import time

import numpy as np
from mpi4py import MPI

import r2comm
from r2comm import SUM, MAX
from r2comm._core import testing
from mpi_worker import WORLD, wait_rails_up, data, reduce_ref, check, expect, same_everywhere

COLLS = ["allreduce", "allreduce", "bcast", "allgather", "reduce_scatter", "alltoall",
         "sendrecv", "nonblocking", "reduce", "gather", "gatherv", "scatterv", "allgatherv",
         "alltoallv", "reduce_scatter_v", "scan", "exscan"]


def _uneven(cnt, n):
    """Counts of their own per rank and displacements in reverse rank order (issue 41)."""
    counts = [max(cnt // n, 1) + 3 * k for k in range(n)]
    displs, at = [0] * n, 0
    for k in reversed(range(n)):
        displs[k] = at
        at += counts[k]
    return counts, displs, at


def run_vector(comm, coll, cnt, case, rng):
    """One vector or prefix collective (issue 41) on inputs seeded by `case`, checked."""
    n, r = comm.size, comm.rank
    counts, displs, total = _uneven(cnt, n)
    root = int(rng.integers(n))
    if coll == "gather":
        out = np.empty(counts[0] * n, "int32") if r == root else None
        comm.Gather(data(case, r, counts[0], "int32", SUM), out, root)
        if r == root:
            check(np.array_equal(out, np.concatenate([data(case, k, counts[0], "int32", SUM)
                                                      for k in range(n)])), case)
    elif coll == "gatherv":
        out = np.full(total, -1, "int32")
        comm.Gatherv(data(case, r, counts[r], "int32", SUM),
                     [out, counts, displs, None] if r == root else None, root)
        if r == root:
            for k in range(n):
                check(np.array_equal(out[displs[k]:displs[k] + counts[k]],
                                     data(case, k, counts[k], "int32", SUM)), case)
    elif coll == "scatterv":
        src = np.concatenate([data(case, k, counts[k], "float64", SUM) for k in range(n)])
        sd = [sum(counts[:k]) for k in range(n)]
        out = np.empty(counts[r], "float64")
        comm.Scatterv([src, counts, sd, None] if r == root else None, out, root)
        check(np.array_equal(out, data(case, r, counts[r], "float64", SUM)), case)
    elif coll == "allgatherv":
        out = np.full(total, -1, "int32")
        comm.Allgatherv(data(case, r, counts[r], "int32", SUM), [out, counts, displs, None])
        for k in range(n):
            check(np.array_equal(out[displs[k]:displs[k] + counts[k]],
                                 data(case, k, counts[k], "int32", SUM)), case)
    elif coll == "alltoallv":
        sc = [counts[(r + j) % n] for j in range(n)]            # r sends counts[r+j] to j
        rc = [counts[(j + r) % n] for j in range(n)]
        x = data(case, r, sum(sc), "int32", SUM)
        out = np.empty(sum(rc), "int32")
        comm.Alltoallv([x, sc, None, None], [out, rc, None, None])
        for j in range(n):
            theirs = data(case, j, sum(counts[(j + k) % n] for k in range(n)), "int32", SUM)
            lo = sum(counts[(j + k) % n] for k in range(r))
            got = out[sum(rc[:j]):sum(rc[:j]) + rc[j]]
            check(np.array_equal(got, theirs[lo:lo + rc[j]]), case)
    elif coll == "reduce_scatter_v":
        out = np.empty(counts[r], "float64")
        comm.Reduce_scatter(data(case, r, total, "float64", SUM), out, counts, SUM)
        lo = sum(counts[:r])
        check(np.array_equal(out, reduce_ref(case, n, total, "float64", SUM)[lo:lo + counts[r]]),
              case)
    else:                                                  # scan, exscan
        x = data(case, r, cnt, "int64", SUM)
        out = np.full(cnt, 7, "int64")
        (comm.Scan if coll == "scan" else comm.Exscan)(x, out, SUM)
        upto = r + 1 if coll == "scan" else r
        if upto:
            check(np.array_equal(out, sum(data(case, k, cnt, "int64", SUM)
                                          for k in range(upto))), case)
    return 1


def run_collective(comm, coll, nbytes, case, rng):
    """Run one collective on inputs seeded by `case`, check it, return checks done."""
    n, r = comm.size, comm.rank
    cnt = max(nbytes // 4, 1)
    if coll in ("gather", "gatherv", "scatterv", "allgatherv", "alltoallv", "reduce_scatter_v",
                "scan", "exscan"):
        return run_vector(comm, coll, cnt, case, rng)
    if coll == "allreduce":
        x = data(case, r, cnt, "float32", SUM)
        y = np.empty_like(x)
        comm.Allreduce(x, y, SUM)
        check(np.array_equal(y, reduce_ref(case, n, cnt, "float32", SUM)), case)
        same_everywhere(y, case)
    elif coll == "bcast":
        root = int(rng.integers(n))
        b = data(case, root, cnt, "int32", SUM) if r == root else np.zeros(cnt, "int32")
        comm.Bcast(b, root)
        check(np.array_equal(b, data(case, root, cnt, "int32", SUM)), case)
    elif coll == "reduce":
        root = int(rng.integers(n))
        out = np.empty(cnt, "int32") if r == root else None
        comm.Reduce(data(case, r, cnt, "int32", MAX), out, MAX, root)
        if r == root:
            check(np.array_equal(out, reduce_ref(case, n, cnt, "int32", MAX)), case)
    elif coll == "allgather":
        c = max(cnt // n, 1)
        out = np.empty(c * n, "int32")
        comm.Allgather(data(case, r, c, "int32", SUM), out)
        check(np.array_equal(out, np.concatenate([data(case, k, c, "int32", SUM)
                                                  for k in range(n)])), case)
    elif coll == "reduce_scatter":
        c = max(cnt // n, 1)
        out = np.empty(c, "float64")
        comm.Reduce_scatter_block(data(case, r, c * n, "float64", SUM), out, SUM)
        check(np.array_equal(out, reduce_ref(case, n, c * n, "float64", SUM)[r * c:(r + 1) * c]),
              case)
    elif coll == "alltoall":
        c = max(cnt // n, 1)
        out = np.empty(c * n, "int32")
        comm.Alltoall(data(case, r, c * n, "int32", SUM), out)
        check(np.array_equal(out, np.concatenate([data(case, k, c * n, "int32", SUM)[r * c:(r + 1) * c]
                                                  for k in range(n)])), case)
    elif coll == "sendrecv":
        out = np.empty(cnt, "int32")
        comm.Sendrecv(data(case, r, cnt, "int32", SUM), (r + 1) % n, 3, out, (r - 1) % n, 3)
        check(np.array_equal(out, data(case, (r - 1) % n, cnt, "int32", SUM)), case)
    elif coll == "nonblocking":
        reqs, outs = [], []
        for k in range(3):
            x = data(f"{case}-{k}", r, cnt, "int32", SUM)
            outs.append(np.empty_like(x))
            reqs.append(comm.Iallreduce(x, outs[-1], SUM))
        b = data(case, 0, cnt, "float32", SUM) if r == 0 else np.zeros(cnt, "float32")
        reqs.append(comm.Ibcast(b, 0))
        r2comm.Request.Waitall(reqs[::-1])
        for k in range(3):
            check(np.array_equal(outs[k], reduce_ref(f"{case}-{k}", n, cnt, "int32", SUM)), case)
        check(np.array_equal(b, data(case, 0, cnt, "float32", SUM)), case)
    return 1


def sc_random(comm, args):
    n, r = comm.size, comm.rank
    seed, trials = int(args.get("seed", 1)), int(args.get("trials", 30))
    nrails = len(comm.rails)
    struck = detected = missed = injected = checks = skipped = 0
    t_start = time.monotonic()
    for t in range(trials):
        rng = np.random.default_rng([seed, t])          # same plan on every rank
        coll = str(rng.choice(COLLS))
        nbytes = int(rng.choice([8, 4096, 200_000, 1_000_000, 2_500_000]))
        nfail = 1 if rng.random() < 0.65 or nrails < 3 else 2
        rails = rng.permutation(nrails)[:nfail]
        plan = []
        for k in range(nfail):
            frank = int(rng.integers(n))
            mode = str(rng.choice(["hard", "silent"]))
            # a byte offset within what that rank sends on one rail: 0 strikes before the
            # first chunk, offsets near the end strike in the last chunk
            per_rail = max(nbytes * 2 // max(nrails, 1), 1)
            after = int(rng.choice([0, int(rng.integers(per_rail)), max(per_rail - 100, 0)]))
            plan.append((frank, int(rails[k]), mode, after))
        before = len(comm.events)
        # inject only when every rank sees every rail up, so that each pair keeps a rail
        healthy = WORLD.allreduce(1 if wait_rails_up(comm, 3.0) else 0, op=MPI.MIN)
        skipped += 1 - healthy
        for frank, rail, mode, after in plan:
            if frank == r and healthy:
                comm.fail_rail(rail, mode, after_bytes=after)
                injected += 1
        checks += run_collective(comm, coll, nbytes, f"rt-{seed}-{t}", rng)
        evs = comm.events[before:]
        mine = [e for e in evs if e["kind"] == "rail_failed" and e["detector"] == r]
        detected += 1 if mine else 0
        hits = [e for e in evs if e["kind"] == "fault_struck"]
        struck += 1 if hits else 0
        failed = {(e["peer"], e["rail"]) for e in evs if e["kind"] == "rail_failed"}
        # a hard fault shuts the connection down: the rank that injected it sees its rail fail
        missed += sum(1 for e in hits if e["info"] == "hard" and (e["peer"], e["rail"]) not in failed)
        for frank, rail, mode, after in plan:
            if frank == r and healthy:
                comm.restore_rail(rail)
        WORLD.Barrier()
    struck, detected, missed, injected = (WORLD.allreduce(v)
                                          for v in (struck, detected, missed, injected))
    if r == 0:
        print(f"FAULTS injected={injected} struck_trials={struck} detected_trials={detected} "
              f"missed_hard={missed} trials={trials} skipped={skipped} "
              f"seconds={time.monotonic() - t_start:.1f}", flush=True)
    # bilateral awareness: every locally detected failure was told to the peer and acked
    evs = comm.events
    notified = sum(1 for e in evs if e["kind"] == "notify_sent")
    acked = sum(1 for e in evs if e["kind"] == "notify_acked")
    check(acked >= notified * 0.9, f"notifications acknowledged: {acked} of {notified}")
    return checks


def sc_partition(comm, args):
    """Rank 1 loses every rail mid-collective; every rank raises within the bound."""
    r = comm.rank
    mode = args.get("mode", "hard")
    x = np.ones(2_000_000, "float32")
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    WORLD.Barrier()            # everyone is done with that one (its acks included) first
    if r == 1:
        for rail in range(len(comm.rails)):
            comm.fail_rail(rail, mode, after_bytes=100_000)
    t0 = time.monotonic()
    exc = expect(r2comm.R2commNetworkError, lambda: [comm.Allreduce(x, y) for _ in range(50)],
                 f"partition ({mode})")
    took = time.monotonic() - t0
    check(took < 10, f"partition detected in {took:.1f} s")
    check("rail" in str(exc), f"message names the cause: {exc}")
    flags = WORLD.allgather((type(exc).__name__, round(took, 2)))
    if r == 0:
        print(f"PARTITION {mode} {flags}", flush=True)
    return 1


def sc_flap(comm, args):
    """A rail that flaps: fail and restore in a loop while allreduces stream; all exact."""
    n, r = comm.size, comm.rank
    ops = int(args.get("ops", 60))
    flaps = 0
    case = "flap"
    x = data(case, r, 500_000, "float32", SUM)
    ref = reduce_ref(case, n, 500_000, "float32", SUM)
    y = np.empty_like(x)
    every = int(args.get("every", 5))          # toggle every few operations (not on a clock,
    down = False                               # so the count of flaps does not depend on speed)
    for i in range(ops):
        if r == 1 and i % every == 0:
            if down:
                comm.restore_rail(0)
            else:
                comm.fail_rail(0, "hard" if flaps % 2 else "silent")
                flaps += 1
            down = not down
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), f"flap op {i}")
    if r == 1:
        comm.restore_rail(0)
    flaps = WORLD.allreduce(flaps)
    if r == 0:
        print(f"FLAPS {flaps}", flush=True)
    check(flaps >= 3, "the rail flapped")
    return ops


def sc_envfault(comm, args):
    """R2COMM_FAULT (set by the test) fails a rail of an unmodified loop of allreduces."""
    n, r = comm.size, comm.rank
    x = data("env", r, 300_000, "int32", SUM)
    ref = reduce_ref("env", n, 300_000, "int32", SUM)
    y = np.empty_like(x)
    ops = 0
    t_end = WORLD.bcast(time.time() + float(args.get("seconds", 1.5)), root=0)
    while WORLD.allreduce(time.time() < t_end, op=MPI.LAND):
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), "allreduce under R2COMM_FAULT")
        ops += 1
    failed = WORLD.allreduce(sum(1 for e in comm.events if e["kind"] == "rail_failed"))
    if r == 0:
        print(f"ENVFAULT ops={ops} rail_failed={failed}", flush=True)
    check(failed >= 1, "the fault from R2COMM_FAULT struck")
    return ops


def sc_peerdeath(comm, args):
    """Rank 1 dies (exits without a word) mid-stream: every survivor raises
    R2commNetworkError within a bound instead of hanging. Survivors report and exit at once,
    since MPI itself cannot finalize with a dead rank."""
    import os
    import sys
    r = comm.rank
    x = np.ones(1_000_000, "float32")
    y = np.empty_like(x)
    for _ in range(3):
        comm.Allreduce(x, y)
    if r == 1:
        os._exit(0)
    t0 = time.monotonic()
    exc = expect(r2comm.R2commNetworkError, lambda: [comm.Allreduce(x, y) for _ in range(100)],
                 "peer death")
    took = time.monotonic() - t0
    check(took < 10, f"peer death noticed in {took:.1f} s")
    # one write: the survivors finish together, and print() (unbuffered under
    # PYTHONUNBUFFERED) writes the text and its newline separately, which interleaved two lines
    sys.stdout.flush()
    os.write(1, f"OK peerdeath rank={r} took={took:.2f} {type(exc).__name__}: {exc}\n".encode())
    os._exit(0)


def sc_autoreplan(comm, args):
    """R2COMM_REPLAN: rank n-1 loses NIC 1; at the next agreed boundary every rank switches
    to the degraded-server allreduce, and results stay exact."""
    n, r = comm.size, comm.rank
    cnt = 2_097_152          # 8 MiB: at 3 MB one NIC down prices the ring and the degraded
    ref = reduce_ref("auto", n, cnt, "int32", SUM)   # schedule within 1% (planner/price.py)
    x = data("auto", r, cnt, "int32", SUM)
    y = np.empty_like(x)
    before = comm.schedule("allreduce", cnt * 4, 4).algo
    if r == n - 1:
        comm.fail_rail(1, "hard")
    algos = set()
    for i in range(12):
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), f"allreduce {i} after NIC loss")
        algos.add(comm.schedule("allreduce", cnt * 4, 4).algo)
    after = comm.schedule("allreduce", cnt * 4, 4).algo
    agreed = WORLD.allgather(after)
    check(len(set(agreed)) == 1, f"all ranks chose the same schedule: {agreed}")
    if r == 0:
        print(f"AUTOREPLAN before={before} after={after} beta={comm.channel.plan_state.beta():.2f}", flush=True)
    # the static plan: the ring, or recursive halving for 4 ranks of one host (8 MiB)
    flat = "rabenseifner" if n == 4 and comm.topology()["nhosts"] == 1 else "ring"
    check(before == flat and after.startswith("degraded"), f"switched {before} -> {after}")
    return 12


def sc_hedge(comm, args):
    """A rail's path goes silent under a long deadline: its stuck chunks are copied to the other
    rail (hedged) and the operations finish long before the deadline, exactly; the deadline
    still declares the rail dead afterwards (the copies delivered elsewhere count as ghosts).
    The fault holds between ranks 0 and 1 only: a silent fault of the whole NIC is a NIC fact,
    announced and failed within milliseconds (nicwatch), which may beat any hedge."""
    n, r = comm.size, comm.rank
    case = "hedge"
    x = data(case, r, 2_000_000, "float32", SUM)
    ref = reduce_ref(case, n, 2_000_000, "float32", SUM)
    y = np.empty_like(x)
    for _ in range(4):                         # the rails' rates get measured
        comm.Allreduce(x, y)
    deadline_s = float(args.get("deadline_ms", 4000)) / 1e3
    WORLD.Barrier()
    if r == 0:
        comm.fail_rail(0, "silent", peer=1)
    t0 = time.monotonic()
    for _ in range(3):
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), "hedged allreduce result")
    took = time.monotonic() - t0
    check(took < deadline_s / 2, f"3 operations over a silent rail took {took:.2f} s, the "
          f"deadline is {deadline_s:.1f} s: the stuck chunks were not hedged")
    hedged = WORLD.allreduce(sum(ra.bytes_hedged for ra in comm.rails))
    check(hedged > 0, "no bytes were hedged")
    until = time.monotonic() + 3 * deadline_s
    while r < 2 and time.monotonic() < until and comm.rails[0].state == "up":
        time.sleep(0.02)
    check(r >= 2 or comm.rails[0].state != "up", "the silent rail was never declared failed")
    if r == 0:
        print(f"HEDGE took={took:.3f} hedged={hedged}", flush=True)
    return 3


def sc_signals(comm, args):
    """Signals interrupt the engine's epoll_wait (EINTR; a stopped and continued process gets
    it even without a handler): rank 1 is stopped and continued (SIGSTOP/SIGCONT) and gets
    SIGUSR1 with a Python handler, several times. Every rank's progress thread must still run:
    eager messages that rank 0 sends while rank 1 only sleeps are acknowledged by rank 1's
    progress thread alone, rank 0's engine drains, and collectives stay exact."""
    import os
    import signal
    import threading
    n, r = comm.size, comm.rank
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    pids = WORLD.allgather(os.getpid())
    for k in range(4):
        WORLD.Barrier()
        if r == 0:
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(0.01)
            os.kill(pids[1], signal.SIGCONT)
            os.kill(pids[1], signal.SIGUSR1)
        time.sleep(0.02)
        WORLD.Barrier()
    alive = [t.name for t in threading.enumerate() if t.name == "r2comm-progress"]
    check(alive, "the progress thread ended after a signal")
    buf = np.arange(16, dtype=np.int32)
    if r == 0:
        reqs = [comm.Isend(buf, 1, tag=7) for _ in range(5)]
        for q in reqs:
            q.Wait()
        drained = comm.channel.engine.drain(3.0)      # rank 1 sleeps: its progress thread must ack
        check(drained, "eager sends to rank 1 never acknowledged while it slept")
        WORLD.Barrier()
    elif r == 1:
        time.sleep(1.0)
        WORLD.Barrier()
        out = np.empty_like(buf)
        for _ in range(5):
            comm.Recv(out, 0, tag=7)
            check(np.array_equal(out, buf), "eager message after signals")
    else:
        WORLD.Barrier()
    cnt = 300_000
    x = data("sig", r, cnt, "int32", SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    check(np.array_equal(y, reduce_ref("sig", n, cnt, "int32", SUM)), "allreduce after signals")
    if r == 1:
        check(len(got) == 4, f"SIGUSR1 handled {len(got)} times")
    return 1


def fail_then_failback(comm, x, y, ref):
    """Rank 1 fails rail 0 for 5 exact allreduces, then restores it; allreduces go on until
    every rank sees the rail up (bounded 20 s). (allreduces run, seconds from the restore to
    the rail up everywhere, or None)."""
    n, ops = comm.size, 0
    if comm.rank == 1:
        comm.fail_rail(0, "hard")
    for _ in range(5):
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), "allreduce with rail 0 failed")
        ops += 1
    WORLD.Barrier()
    if comm.rank == 1:
        comm.restore_rail(0)
    t0 = time.monotonic()
    for _ in range(2000):                               # bounded: ~20 s at most
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), "allreduce during fail-back")
        ops += 1
        if WORLD.allreduce(int(comm.rails[0].state == "up")) == n:
            return ops, time.monotonic() - t0
        if time.monotonic() - t0 > 20:
            break
        time.sleep(0.01)
    return ops, None


def sc_slowloris(comm, args):
    """Clients (from this test, to this rank's own listening ports on 127.0.0.x) trickle one
    byte of a plausible HELLO every half second into every listener, reconnecting whenever they
    are cut off, while rank 1 fails rail 0 and restores it. Fail-back must still happen within
    its normal bound and events must keep reaching on_event."""
    import socket
    import struct
    import threading
    n, r = comm.size, comm.rank
    links = comm._world.links
    stop = threading.Event()
    hello = struct.pack("!4sH", b"R2CH", 1) + bytes(38)      # looks right, never completes

    def trickle(addr):
        end = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < end:
            try:
                s = socket.create_connection(addr, timeout=2)
            except OSError:
                stop.wait(0.1)
                continue
            try:
                for i in range(len(hello)):
                    if stop.wait(0.5):
                        break
                    s.send(hello[i:i + 1])
            except OSError:
                pass                                    # cut off: connect again
            finally:
                s.close()
    attackers = [threading.Thread(target=trickle, args=(lst.getsockname(),), daemon=True)
                 for lst in comm._world.boot.listeners for _ in range(2)]
    for t in attackers:
        t.start()
    delivered = []
    comm.on_event(lambda ev: delivered.append(ev["kind"]))
    time.sleep(1.0)                                     # the clients are inside handshakes
    x = data("slow", r, 200_000, "float32", SUM)
    ref = reduce_ref("slow", n, 200_000, "float32", SUM)
    y = np.empty_like(x)
    ops, took = fail_then_failback(comm, x, y, ref)
    for _ in range(200):                                # events reach on_event (bounded 2 s)
        if "rail_restored" in delivered:
            break
        time.sleep(0.01)
    for _ in range(400):                                # a 2 s handshake deadline cuts them
        if len(links.rejected) >= 1:
            break
        time.sleep(0.01)
    stop.set()
    for t in attackers:
        t.join(3)
    cut = len(links.rejected)
    took_max = WORLD.allreduce(took if took is not None else 1e9, op=MPI.MAX)
    evs_ok = WORLD.allreduce(int("rail_failed" in delivered and "rail_restored" in delivered))
    cut_min = WORLD.allreduce(cut, op=MPI.MIN)
    if r == 0:
        print(f"SLOWLORIS failback_s={took_max:.2f} ops={ops} rejected_min={cut_min}", flush=True)
    check(took_max < 5.0, f"fail-back under a slowloris took {took_max} s")
    check(evs_ok == n, f"events delivered to on_event: {delivered}")
    check(cut_min >= 1, "the trickling connections were cut off at the handshake deadline")
    return ops


def sc_integrity(comm, args):
    """With R2COMM_INTEGRITY=mac (set by the test): every collective exact at several sizes;
    then rank 0 alters one payload byte of a frame to rank 1 on rail 0 after its MAC (engine
    test hook): rank 1 reports bad_frame (MAC mismatch), the rail fails over and comes back,
    the allreduce is exact."""
    n, r = comm.size, comm.rank
    mode = comm._world.cfg.integrity
    check(mode == "mac", f"integrity mode {mode}")
    rng = np.random.default_rng(5)
    done = 0
    for nbytes in (8, 4100, 1 << 20, (3 << 20) + 12):
        for coll in COLLS:
            done += run_collective(comm, coll, nbytes, f"mac-{coll}-{nbytes}", rng)
    cnt = 1 << 20                                     # 4 MiB: 8 chunks, striped over 3 rails
    x = data("corrupt", r, cnt, "float32", SUM)
    ref = reduce_ref("corrupt", n, cnt, "float32", SUM)
    y = np.empty_like(x)
    hit = 0
    for attempt in range(10):
        if r == 0:
            testing.corrupt_next(comm.channel.engine, 1, 0)
        comm.Allreduce(x, y)
        check(np.array_equal(y, ref), f"allreduce with a frame altered on the wire ({attempt})")
        done += 1
        mine = [ev for ev in comm.events if ev["kind"] == "bad_frame"]
        hit = WORLD.allreduce(len(mine))
        if hit:
            break
    if r == 1:
        check(any(ev["peer"] == 0 and ev["rail"] == 0 and "MAC mismatch" in ev["info"]
                  for ev in comm.events if ev["kind"] == "bad_frame"),
              f"bad_frame on rank 1: {comm.events}")
    failed = WORLD.allreduce(sum(1 for ev in comm.events if ev["kind"] == "rail_failed"))
    check(failed >= 1, "the rail with the altered frame failed")
    check(wait_rails_up(comm, 20), "the rail came back")
    comm.Allreduce(x, y)
    check(np.array_equal(y, ref), "allreduce after fail-back")
    if r == 0:
        print(f"INTEGRITY mode={mode} bad_frame={hit} rail_failed={failed}", flush=True)
    return done
def _stream_until(comm, stop_flag, cases, refs, xs, limit_ops=200_000):
    """Allreduces, checked bit for bit, until rank 0 sets stop_flag (agreed through r2comm
    itself, so every rank runs the same ops). Returns (ops, longest op in s, end times)."""
    r = comm.rank
    y = np.empty_like(xs[0])
    flag, more = np.zeros(1, "int32"), np.zeros(1, "int32")
    ops, longest, ends = 0, 0.0, []
    while ops < limit_ops:
        t = time.monotonic()
        flag[0] = 1 if (r == 0 and stop_flag.is_set()) else 0
        comm.Allreduce(flag, more, MAX)
        if more[0]:
            break
        k = ops % len(xs)
        y.fill(np.float32(-1.0))                # poison: a missing chunk cannot look right
        comm.Allreduce(xs[k], y, SUM)
        longest = max(longest, time.monotonic() - t)
        ends.append(time.monotonic())
        check(np.array_equal(y, refs[k]), f"rank {r}: stream op {ops} bit-identical")
        ops += 1
    return ops, longest, ends


def sc_stall(comm, args):
    """Rank 1 is stopped (SIGSTOP) for `stop` s while a stream of allreduces runs, then
    continued (SIGCONT). Its kernel keeps acknowledging TCP, so no rail may be failed: every
    result stays exact, and the others record peer_stalled (cause peer_process) and then
    peer_resumed for rank 1. A stop that lands while no survivor has data out to rank 1 (every
    chunk sent to it already acknowledged, all waiting on its sends) gives the engine nothing to
    judge: the op just waits, exact and with no failure. That round is run once more.
    The same when `evidence` names the kernel evidence wanted and the round was told apart by
    the other (the sender had less than a window out when the deadline came)."""
    stop = float(args.get("stop", 3))
    want = args.get("evidence")

    def judged(rows):
        infos = [info for row in rows for *_, info in row["stalled"]]
        return bool(infos) and (not want or any(want in info for info in infos))
    tries = int(args.get("tries", 3))
    for attempt in range(tries):
        rows = _stall_round(comm, args, stop)
        if WORLD.bcast(judged(rows) if WORLD.rank == 0 else None) or attempt == tries - 1:
            break
        if WORLD.rank == 0:
            print(f"STALL stop={stop}: nothing (or other evidence) to judge; again", flush=True)
    if WORLD.rank == 0:
        seen = [row for row in rows if row["stalled"]]
        check(seen, f"a survivor recorded peer_stalled: {rows}")
        check(all(p == 1 and c == "peer_process" for row in seen for p, _, c, _, _ in row["stalled"]),
              f"only rank 1's process is called stalled: {rows}")
        check(all(any(p == 1 and dt >= 0.5 * stop for p, dt in row["resumed"]) for row in seen),
              f"and every one of them recorded peer_resumed for it: {rows}")
        if args.get("evidence"):                # which kernel evidence told the stall apart
            check(any(args["evidence"] in info for row in seen for *_, info in row["stalled"]),
                  f"peer_stalled cites '{args['evidence']}': {rows}")
    return 1


def _stall_round(comm, args, stop):
    """One stop/continue of rank 1 mid-stream on a fresh Dup (its own event list); checks that
    every result was exact and no rail failed; returns every rank's event summary (rank 0)."""
    import os
    import signal
    import threading
    comm = comm.Dup()
    n, r = comm.size, comm.rank
    cnt = int(args.get("count", 250_000))
    pids = WORLD.allgather(os.getpid())
    cases = [f"stall-{k}" for k in range(3)]
    xs = [data(c, r, cnt, "float32", SUM) for c in cases]
    refs = [reduce_ref(c, n, cnt, "float32", SUM) for c in cases]
    y = np.empty_like(xs[0])
    comm.Allreduce(xs[0], y)                    # warm-up
    WORLD.Barrier()
    finished = threading.Event()
    marks = {}
    if r == 0:
        def stopper():
            time.sleep(0.4)
            os.kill(pids[1], signal.SIGSTOP)
            marks["stop"] = time.monotonic()
            time.sleep(stop)
            os.kill(pids[1], signal.SIGCONT)
            marks["cont"] = time.monotonic()
            time.sleep(0.6)                     # the stream goes on after the stall
            finished.set()
        th = threading.Thread(target=stopper, daemon=True)
        th.start()
    ops, longest, ends = _stream_until(comm, finished, cases, refs, xs)
    if r == 0:
        th.join(5)
        after = sum(1 for t in ends if t > marks["cont"])
        check(after >= 1, "the stream went on after SIGCONT")
        check(longest >= 0.8 * stop, f"the stop struck mid-stream (longest op {longest:.2f} s)")
    evs = comm.events
    rows = WORLD.gather({"rank": r, "ops": ops, "longest": round(longest, 3),
                         "kinds": sorted({e["kind"] for e in evs}),
                         "stalled": [(e["peer"], e["rail"], e.get("cause"), round(e["dt"], 3), e["info"])
                                     for e in evs if e["kind"] == "peer_stalled"],
                         "resumed": [(e["peer"], round(e["dt"], 2)) for e in evs
                                     if e["kind"] == "peer_resumed"],
                         "failed": [(e["peer"], e["rail"], e.get("cause"), e["info"]) for e in evs
                                    if e["kind"] == "rail_failed"]})
    comm.Free()
    if r == 0:
        for row in rows:
            print(f"STALL stop={stop} {row}", flush=True)
        check(all(not row["failed"] for row in rows), f"no rail failed: {rows}")
        check(len({row["ops"] for row in rows}) == 1, "every rank ran the same ops")
    return rows


def sc_sigkill(comm, args):
    """Rank 1 is killed (SIGKILL) mid-stream: every survivor raises R2commNetworkError, and
    records that rank 1's process is gone (peer_lost, cause peer_process). Each survivor writes
    its wall-clock raise time to `out`/rank<r>.txt, rank 0 the kill time to `out`/killed.txt
    (the test takes the difference). Survivors then exit, since MPI cannot finalize with a
    dead rank."""
    import os
    import signal
    n, r = comm.size, comm.rank
    # hydra, once it notices a rank killed by a signal, sends SIGUSR1 and then SIGKILL to the
    # session of every other rank, even with -disable-auto-cleanup: the test starts each rank
    # under a shell that outlives it (see test_killed_process_raises_on_every_survivor)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    pids = WORLD.allgather(os.getpid())
    cnt = 250_000
    x = data("kill", r, cnt, "float32", SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    WORLD.Barrier()
    if r == 0:
        kill_soon(pids[1], args["out"])
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            comm.Allreduce(x, y)
        exc = None
    except r2comm.R2commNetworkError as e:
        exc = e
    t_raise = time.time()
    check(exc is not None, "the stream ran 30 s without an error after the kill")
    lost = []
    until = time.monotonic() + 3
    while time.monotonic() < until and not lost:
        lost = [e for e in comm.events if e["kind"] == "peer_lost" and e["peer"] == 1]
        time.sleep(0.02)
    cause = lost[0].get("cause") if lost else None
    line = f"OK sigkill rank={r} raised_at={t_raise:.6f} cause={cause} {type(exc).__name__}: {exc}\n"
    # hydra kills the survivors (SIGUSR1, then SIGKILL to their process groups) as soon as it
    # notices the death, which is when its loop next wakes up, e.g. for output: each survivor
    # writes its line to a file, and nobody writes to stdout until every survivor has (bounded)
    survivor_report(args["out"], r, n, line)


def kill_soon(pid, out, delay=0.4):
    """SIGKILL process PID after DELAY s (from a thread, while the caller goes on into a
    collective) and write the kill's wall-clock time to OUT/killed.txt."""
    import os
    import signal
    import threading
    import time

    def killer():
        time.sleep(delay)
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        with open(os.path.join(out, "killed.txt"), "w") as f:
            f.write(f"{t:.6f}\n")
    threading.Thread(target=killer, daemon=True).start()


def survivor_report(out, r, n, line, dead=1):
    """A survivor of a killed rank (DEAD) reports LINE and exits: into OUT/rank<r>.txt first,
    then, once every survivor has written its file (bounded), to stdout."""
    import os
    import sys
    import time
    with open(os.path.join(out, f"rank{r}.tmp"), "w") as f:
        f.write(line)
    os.replace(os.path.join(out, f"rank{r}.tmp"), os.path.join(out, f"rank{r}.txt"))
    until = time.monotonic() + 15
    while time.monotonic() < until and not all(
            os.path.exists(os.path.join(out, f"rank{k}.txt")) for k in range(n) if k != dead):
        time.sleep(0.02)
    sys.stdout.flush()
    os.write(1, line.encode())
    os._exit(0)


def sc_idleflood(comm, args):
    """Issue 28 item 4: a separate process floods this rank's listeners with `idle` idle
    connections from 127.0.1.x (no rank's address), renewed whenever they are cut, plus a
    trickling client per listener, while rank 1 fails rail 0 and restores it, `cycles` times
    (spanning the flood's 2 s renewal waves). Every fail-back must happen within `limit` s of
    its restore, every result exact."""
    import os
    import subprocess
    import sys
    n, r = comm.size, comm.rank
    limit = float(args.get("limit", 1.0))
    ports = [str(lst.getsockname()[1]) for lst in comm._world.boot.listeners]
    client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flood_client.py")
    flood = subprocess.Popen([sys.executable, client, "60", args.get("idle", "200"), *ports],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    links = comm._world.links
    took_all = []
    ops = 0
    try:
        time.sleep(2.5)          # the flood holds every slot it can (off its 2 s renewal waves)
        x = data("flood", r, 200_000, "float32", SUM)
        ref = reduce_ref("flood", n, 200_000, "float32", SUM)
        y = np.empty_like(x)
        for _cycle in range(int(args.get("cycles", 3))):
            done, took = fail_then_failback(comm, x, y, ref)
            ops += done
            took_all.append(took if took is not None else 1e9)
            time.sleep(0.7)
        cut = sum("to make room" in w for _, w in links.rejected)
    finally:
        out = flood.communicate("", timeout=15)[0]     # stdin closed: the flood stops
    opened = int(out.split("opened=")[1]) if "opened=" in out else 0
    took_max = WORLD.allreduce(max(took_all), op=MPI.MAX)
    cut_min = WORLD.allreduce(cut, op=MPI.MIN)
    opened_min = WORLD.allreduce(opened, op=MPI.MIN)
    if r == 0:
        print(f"IDLEFLOOD failback_s={took_max:.2f} ops={ops} evicted_min={cut_min} "
              f"opened_min={opened_min}", flush=True)
    check(took_max < limit, f"fail-back under an idle flood took {took_max} s")
    check(opened_min > int(args.get("idle", "200")), "the flood was cut and renewed")
    return ops


SCENARIOS = {"random": sc_random, "partition": sc_partition, "flap": sc_flap,
             "envfault": sc_envfault, "peerdeath": sc_peerdeath, "autoreplan": sc_autoreplan,
             "hedge": sc_hedge, "signals": sc_signals, "slowloris": sc_slowloris,
             "integrity": sc_integrity, "stall": sc_stall, "sigkill": sc_sigkill,
             "idleflood": sc_idleflood}


def comm_kwargs(args):
    """Fault scenarios run on three loopback rails, so two can fail and every pair keeps one."""
    return {"rails": args.get("rails", "127.0.0.1,127.0.0.2,127.0.0.3").split(",")}
