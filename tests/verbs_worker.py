"""One rank of a job on verbs rails (run by `python -m r2comm.testbed rdma-run`, which sets
R2COMM_RANK, R2COMM_SIZE, R2COMM_STORE_DIR and R2COMM_TRANSPORT=verbs in each guest; or under
mpiexec where this machine has an RDMA device).

    verbs_worker.py SCENARIO [key=value ...]

Every scenario checks its results bit for bit and prints `OK scenario rank detail` or raises.
  collectives   every collective (several sizes, dtypes and ops) exact against numpy
  fault         a stream of allreduces twice: fault-free, then with rail R failed at op F
                (mode=qp: the QP moved to error on one rank; mode=link: the host test cuts the
                link when the marker file says so, and restores it); results of the two runs
                must be bitwise equal; reports the pause and the events
  partition     every rail to the other host cut during an allreduce: both ranks raise
                R2commNetworkError within the peer deadline
  bw            allreduce and one-way Send/Recv throughput at SIZE (for the figures)
  regcache      zero-copy sends from registered user memory: arrays freed and allocated again
                (the same addresses come back), overwritten between sends, more of them than
                the cache holds (R2COMM_VERBS_REG_CACHE), then the same with zero-copy off;
                every result exact, both passes equal
Common arguments: rails=0+1 (which of the host's rails), transport=tcp|verbs, watchdog=S,
pool=1 (print `POOL rank {json}`: the devices' slot pools while connected and after Free).
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

import r2comm
from r2comm._core import testing
from r2comm.control.bootstrap_store import DirStore


def comm_from_env(**kw):
    if "R2COMM_STORE_DIR" not in os.environ:      # under mpiexec (a real RDMA device here)
        return r2comm.Communicator(**kw)
    rank, size = int(os.environ["R2COMM_RANK"]), int(os.environ["R2COMM_SIZE"])
    store = DirStore(os.environ["R2COMM_STORE_DIR"], timeout=120)
    return r2comm.Communicator.from_store(store, rank, size, **kw)


def data(rank, n, dtype, salt=0):
    rng = np.random.default_rng(1000 * rank + salt)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def check(what, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or \
            got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
        raise AssertionError(f"{what}: results differ at {bad[:8]} (of {got.nbytes} bytes)")


def seq_sum(arrays):
    """The reference of a float reduction: exact for integers; for floats r2comm's schedule
    fixes the order, so the comparison is with a tolerance computed in float64."""
    return np.sum(np.stack(arrays).astype(np.float64), axis=0)


def collectives(comm, args):
    rank, size = comm.rank, comm.size
    assert all(r.transport == "verbs" and r.device for r in comm.rails), comm.rails
    ncheck = 0
    sizes = [int(v) for v in args.get("sizes", "1,1000,300001,2000003").split(",")]
    for n in sizes:
        for dt in (np.int32, np.float64):
            x = data(rank, n, dt)
            y = np.empty_like(x)
            comm.Allreduce(x, y, op=r2comm.SUM)
            ref = [data(r, n, dt) for r in range(size)]
            if dt == np.int32:
                check(f"allreduce int32 {n}", y, np.sum(np.stack(ref), axis=0).astype(dt))
            else:
                assert np.allclose(y, seq_sum(ref), rtol=1e-12, atol=1e-9), f"allreduce f64 {n}"
                # every rank has the same bits
                dig = comm.allgather(hashlib.sha256(y.tobytes()).hexdigest())
                assert len(set(dig)) == 1, f"allreduce f64 {n}: ranks differ"
            ncheck += 1
        x = data(rank, n, np.int64)
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=r2comm.MAX)
        check(f"allreduce max {n}", y, np.max(np.stack([data(r, n, np.int64) for r in range(size)]), axis=0))
        b = data(size - 1, n, np.float32) if rank == size - 1 else np.zeros(n, np.float32)
        comm.Bcast(b, root=size - 1)
        check(f"bcast {n}", b, data(size - 1, n, np.float32))
        r = np.zeros(n, np.int32)
        comm.Reduce(data(rank, n, np.int32), r, op=r2comm.SUM, root=0)
        if rank == 0:
            check(f"reduce {n}", r, np.sum(np.stack([data(q, n, np.int32) for q in range(size)]), axis=0).astype(np.int32))
        g = np.empty(n * size, np.int16)
        comm.Allgather(data(rank, n, np.int16), g)
        check(f"allgather {n}", g, np.concatenate([data(q, n, np.int16) for q in range(size)]))
        m = (n // size + 1) * size
        rs = np.empty(m // size, np.int32)
        comm.Reduce_scatter_block(data(rank, m, np.int32), rs, op=r2comm.SUM)
        full = np.sum(np.stack([data(q, m, np.int32) for q in range(size)]), axis=0).astype(np.int32)
        check(f"reduce_scatter {m}", rs, full[rank * (m // size):(rank + 1) * (m // size)])
        a = np.empty(m, np.uint8)
        comm.Alltoall(data(rank, m, np.uint8), a)
        want = np.concatenate([data(q, m, np.uint8)[rank * (m // size):(rank + 1) * (m // size)]
                               for q in range(size)])
        check(f"alltoall {m}", a, want)
        ncheck += 6
    # non-blocking, completed in reverse order
    reqs, outs = [], []
    for i in range(4):
        x = data(rank, 50_000 + i, np.int32, salt=i)
        outs.append(np.empty_like(x))
        reqs.append(comm.Iallreduce(x, outs[-1]))
    for i in reversed(range(4)):
        reqs[i].Wait(timeout=60)
        check(f"iallreduce {i}", outs[i], np.sum(np.stack([data(q, 50_000 + i, np.int32, salt=i)
                                                           for q in range(size)]), axis=0).astype(np.int32))
    # point to point around the ring
    x = data(rank, 700_001, np.float32)
    y = np.empty_like(x)
    comm.Sendrecv(x, (rank + 1) % size, 5, y, (rank - 1) % size, 5)
    check("sendrecv", y, data((rank - 1) % size, 700_001, np.float32))
    comm.Barrier()
    sent = [r.bytes_sent for r in comm.rails]
    assert all(s > 0 for s in sent), f"a rail carried nothing: {sent}"
    return f"{ncheck + 6} checks, rails {[(r.device, r.bytes_sent) for r in comm.rails]}"


def _stream(comm, n, ops, salt, hook=None):
    outs, times = [], []
    for i in range(ops):
        if hook is not None:
            hook(i)
        x = data(comm.rank, n, np.float32, salt=salt + i)
        y = np.empty_like(x)
        t0 = time.monotonic()
        comm.Allreduce(x, y)
        times.append(time.monotonic() - t0)
        outs.append(hashlib.sha256(y.tobytes()).hexdigest())
    return outs, times


def fault(comm, args):
    n = int(args.get("n", 1 << 20))
    ops = int(args.get("ops", 40))
    at = int(args.get("at", 10))
    rail = int(args.get("rail", 0))
    mode = args.get("mode", "qp")
    who = int(args.get("who", 1))
    marker = args.get("marker", "")
    ref, _ = _stream(comm, n, ops, 0)
    comm.Barrier()

    def hook(i):
        if i == at and comm.rank == who and mode == "qp":
            comm.fail_rail(rail, "hard")        # the QP goes to error, its socket closes
        if i == at and comm.rank == 0 and mode == "link":
            with open(marker + ".down", "w") as f:
                f.write("go")                   # the host test cuts the link now
            deadline = time.monotonic() + 60
            while not os.path.exists(marker + ".cut") and time.monotonic() < deadline:
                time.sleep(0.05)
    got, times = _stream(comm, n, ops, 0, hook)
    assert got == ref, f"results differ from the fault-free run at ops " \
                       f"{[i for i in range(ops) if got[i] != ref[i]]}"
    events = [e for e in comm.events]
    failed = [e for e in events if e["kind"] == "rail_failed"]
    assert failed, f"no rail failure was seen: {events}"
    restored = None
    if mode == "link" and comm.rank == 0:
        with open(marker + ".up", "w") as f:
            f.write("go")
    if args.get("failback") == "1":
        if mode == "qp" and comm.rank == who:
            comm.restore_rail(rail)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            comm.Barrier()
            x = data(comm.rank, 1 << 18, np.int32)
            y = np.empty_like(x)
            comm.Allreduce(x, y)
            # the ranks decide together: one that saw its rails up and left the loop while
            # the other went round again would call a different collective (seen once)
            if all(comm.allgather(all(r.state == "up" for r in comm.rails))):
                restored = time.monotonic()
                break
            time.sleep(0.1)
        ok = comm.allgather(restored is not None)
        assert all(ok), f"rails not all back up: {comm.rails}"
        # the restored rail carries traffic again: allreduces of 4 MiB (several chunks per
        # message, so they stripe; a stream of single-chunk messages rightly goes all to the
        # rail measured fastest, and the restored rail, measured slow under load just after
        # its re-admission, could then carry nothing for as long as that stream lasts)
        before = comm.rails[rail].bytes_sent
        extra, t_end = 0, time.monotonic() + 20
        while True:
            _stream(comm, max(n, 1 << 20), 3, 500 + extra)
            extra += 3
            carried = comm.allgather(comm.rails[rail].bytes_sent > before)
            if any(carried) or time.monotonic() > t_end:
                break
        assert any(carried), f"restored rail carries nothing in {extra} ops: {comm.rails} " \
                             f"{testing.debug_state(comm.channel.engine)}"
    pause = max(times) - sorted(times)[len(times) // 2]
    return (f"{ops} ops bitwise equal to the fault-free run; slowest op {max(times) * 1e3:.0f} ms "
            f"(median {sorted(times)[len(times) // 2] * 1e3:.0f} ms, pause {pause * 1e3:.0f} ms); "
            f"failures {[(e['rail'], e['peer'], e['cause']) for e in failed][:4]}; "
            f"restored={restored is not None}")


def partition(comm, args):
    """All rails to the other host cut while an allreduce waits: R2commNetworkError on both
    ranks within the peer deadline (plus detection), then the links come back."""
    marker = args["marker"]
    x = data(comm.rank, 100_000, np.int32)
    y = np.empty_like(x)
    comm.Allreduce(x, y)                       # healthy first
    if comm.rank == 0:
        with open(marker + ".down", "w") as f:
            f.write("go")
        deadline = time.monotonic() + 60
        while not os.path.exists(marker + ".cut") and time.monotonic() < deadline:
            time.sleep(0.05)
    t0 = time.monotonic()
    try:
        comm.Allreduce(x, y)
    except r2comm.R2commNetworkError as exc:
        took = time.monotonic() - t0
        bound = float(os.environ.get("R2COMM_PEER_TIMEOUT_MS", "1500")) / 1e3 + 30
        assert took < bound, f"raised after {took:.1f} s (bound {bound:.0f} s)"
        if comm.rank == 0:
            with open(marker + ".up", "w") as f:
                f.write("go")
        return f"R2commNetworkError after {took:.1f} s: {str(exc)[:160]}"
    finally:
        if comm.rank == 0 and not os.path.exists(marker + ".up"):
            with open(marker + ".up", "w") as f:
                f.write("go")
    raise AssertionError("the allreduce across a partition did not raise")


def bw(comm, args):
    n = int(args.get("size", 8 << 20))
    reps = int(args.get("reps", 5))
    x = np.ones(n // 4, np.float32)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    comm.Barrier()
    t0 = time.monotonic()
    for _ in range(reps):
        comm.Allreduce(x, y)
    ar = (time.monotonic() - t0) / reps
    zcopy = args.get("zcopy", "1") != "0"
    for d in comm._world.boot.rail_devices or []:
        d.zcopy = zcopy                   # zcopy=0: the sender copies into the bounce slots
    buf = np.ones(n, np.uint8)
    if comm.rank == 0:                    # warm-up: registers buf (zero-copy) on first use
        comm.Send(buf, 1, 6)
    elif comm.rank == 1:
        comm.Recv(buf, 0, 6)
    comm.Barrier()
    st0 = comm.reg_cache
    t0, c0 = time.monotonic(), time.process_time()
    for _ in range(reps):
        if comm.rank == 0:
            comm.Send(buf, 1, 7)
        elif comm.rank == 1:
            comm.Recv(buf, 0, 7)
    cpu = time.process_time() - c0
    comm.Barrier()
    p2p = (time.monotonic() - t0) / reps
    st = comm.reg_cache
    res = {"size": n, "allreduce_s": ar, "p2p_s": p2p, "p2p_mbit": n * 8 / p2p / 1e6,
           "busbw_mbit": n * 8 * 2 * (comm.size - 1) / comm.size / ar / 1e6,
           "zcopy": zcopy, "cpu_s_per_gib": cpu / (n * reps) * (1 << 30)}
    if st is not None and st0 is not None:
        res["zcopy_bytes"] = st["zcopy_bytes"] - st0["zcopy_bytes"]
        res["copy_bytes"] = st["copy_bytes"] - st0["copy_bytes"]
    return json.dumps(res)


def _regcache_pass(comm, iters, n, keep):
    """ITERS rounds of Allreduce (int32: exact) and a Send/Recv from rank 0 to 1 of freshly
    allocated arrays, the previous round's freed first (so their addresses come back), each
    send repeated after overwriting the buffer; KEEP arrays stay alive in a ring (evictions).
    Returns (digest of every result, addresses seen again)."""
    rank, size = comm.rank, comm.size
    h = hashlib.sha256()
    seen, reused, ring = set(), 0, []
    for i in range(iters):
        x = data(rank, n, np.int32, salt=i)
        y = np.empty_like(x)
        if x.ctypes.data in seen:
            reused += 1
        seen.add(x.ctypes.data)
        for again in range(2):
            if again:
                x[:] = data(rank, n, np.int32, salt=1000 + i)   # the same pages, new bytes
            comm.Allreduce(x, y)
            want = sum(data(r, n, np.int32, salt=(1000 if again else 0) + i).astype(np.int64)
                       for r in range(size)).astype(np.int32)
            check(f"allreduce round {i}.{again}", y, want)
            h.update(y.tobytes())
            if rank == 0:
                comm.Send(x, 1, 5)
            elif rank == 1:
                comm.Recv(y, 0, 5)
                check(f"send round {i}.{again}", y,
                      data(0, n, np.int32, salt=(1000 if again else 0) + i))
                h.update(y.tobytes())
        ring.append(x)
        if len(ring) > keep:
            ring.pop(0)
        del x, y
    return h.hexdigest(), reused


def regcache(comm, args):
    iters, n, keep = int(args.get("iters", 12)), int(args.get("n", 262144)), int(args.get("keep", 3))
    st0 = comm.reg_cache
    assert st0 is not None, "verbs rails without a registration cache"
    d_zc, reused = _regcache_pass(comm, iters, n, keep)
    st = comm.reg_cache
    assert st["zcopy_bytes"] > 0 and st["zcopy_sends"] > 0, st
    assert st["registered"] >= iters and st["deregistered"] >= iters - keep - 1, st
    assert st["refused"] == 0, st
    devs = comm._world.boot.rail_devices
    for d in devs:                        # the same pass through the bounce slots only
        d.zcopy = False
    before = comm.reg_cache
    d_copy, _ = _regcache_pass(comm, iters, n, keep)
    after = comm.reg_cache
    for d in devs:
        d.zcopy = True
    assert after["zcopy_bytes"] == before["zcopy_bytes"], (before, after)
    assert after["copy_bytes"] > before["copy_bytes"], (before, after)
    assert d_zc == d_copy, "zero-copy and bounce passes differ"
    return (f"digest {d_zc[:16]} equal reused={reused} zcopy={st['zcopy_bytes']} "
            f"copy={st['copy_bytes']} registered={st['registered']} "
            f"deregistered={st['deregistered']} live={st['live']}")


def watchdog(comm, seconds):
    """After SECONDS (0: never) print the engine's events and tables, then exit 3: a hung job
    says where it hung instead of being killed silently by rdma-run's timeout."""
    if seconds <= 0:
        return
    import threading

    def fire():
        try:
            import faulthandler             # where every thread is (first: the rest may block)
            faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
            sys.stdout.flush()
            for ev in comm.events:
                print(f"EVENT {comm.rank} {ev['kind']} peer {ev['peer']} rail {ev['rail']}: "
                      f"{ev['info'][:200]}", flush=True)
            print(f"STATE {comm.rank} {testing.debug_state(comm.channel.engine)}", flush=True)
        finally:
            os._exit(3)
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def main():
    scenario = sys.argv[1]
    args = dict(a.split("=", 1) for a in sys.argv[2:])
    if "transport" in args:              # e.g. TCP on the same guests, for comparison
        os.environ["R2COMM_TRANSPORT"] = args["transport"]
    kw = {}
    if "rails" in args:                  # a subset of the host's rails, by index
        mine = os.environ["R2COMM_RAILS"].split(",")
        kw["rails"] = [mine[int(k)] for k in args["rails"].split("+")]
    comm = comm_from_env(**kw)
    watchdog(comm, float(args.get("watchdog", 0)))
    try:
        detail = {"collectives": collectives, "fault": fault, "bw": bw,
                  "partition": partition, "regcache": regcache}[scenario](comm, args)
        print(f"OK {scenario} {comm.rank} {detail}", flush=True)
    except BaseException:
        for ev in comm.events:
            print(f"EVENT {comm.rank} {ev['t']:.3f} {ev['kind']} peer {ev['peer']} rail "
                  f"{ev['rail']} cause {ev['cause']}: {ev['info']}", flush=True)
        raise
    finally:
        live = pool_stats() if args.get("pool") == "1" else None
        rank = comm.rank
        comm.Free()
    if live is not None:
        print(f"POOL {rank} {json.dumps({'live': live, 'closed': pool_stats()})}", flush=True)


def pool_stats():
    from r2comm.transport import verbs as verbs_rails
    return verbs_rails.pinned_stats()


if __name__ == "__main__":
    main()
