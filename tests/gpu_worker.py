"""Multi-rank scenarios of the device-buffer staging pipeline, run under mpiexec by
tests/test_gpu_staging.py (host stand-in device: r2comm/gpu/standin.py) and tests/test_gpu.py
(cupy on a real GPU, scenarios named cupy_*).

    mpiexec -n N python tests/gpu_worker.py SCENARIO [key=value ...]

Every result is checked against numpy on every rank, and for bit-identity across ranks."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, PROD, MIN, MAX, IN_PLACE  # noqa: E402
from r2comm.gpu import bfloat16  # noqa: E402
from r2comm.gpu import pipeline  # noqa: E402
from r2comm.gpu.backend import reduce_blocks, bf16_to_f32, f32_to_bf16  # noqa: E402
from r2comm.gpu.standin import HostBackend, DeviceError  # noqa: E402
from mpi_worker import WORLD, data, reduce_ref, same_everywhere, check, expect, main  # noqa: E402

OPS = [SUM, PROD, MIN, MAX]


class Dev:
    """The device under test: the stand-in, or cupy (the cupy_* scenarios)."""

    def __init__(self, kind="standin", **kw):
        self.kind = kind
        if kind == "standin":
            self.be = HostBackend(**kw)
        else:
            import cupy
            self.cp = cupy

    def put(self, a, stream=None):
        if self.kind == "standin":
            return self.be.array(a, stream=stream)
        return self.cp.asarray(a)

    def empty(self, n, dtype):
        if self.kind == "standin":
            return self.be.array(np.full(n, 7, dtype))
        return self.cp.full(n, 7, dtype)

    def put_bf16(self, bits):
        if self.kind == "standin":
            return bfloat16(self.be.array(bits, dtype="bfloat16"))
        return bfloat16(self.cp.asarray(bits))

    def zeros_bf16(self, n):
        if self.kind == "standin":
            return bfloat16(self.be.zeros(n, "bfloat16"))
        return bfloat16(self.cp.zeros(n, self.cp.uint16))

    def get(self, x):
        if self.kind == "standin":
            self.be.sync(self.be.default_stream)
            return np.array(getattr(x, "array", x).data)
        return self.cp.asnumpy(getattr(x, "array", x))


def _sizes(n):
    # element counts: tiny, not a multiple of anything, several segments (4 KiB segments)
    return [1, 3, n * 5 + 1, 4096, 9000]


def run_all_collectives(comm, dev, dtypes=("int32", "float32", "float16", "uint8", "int64",
                                           "float64")):
    """Every collective on device buffers, exact against numpy and the same on every rank."""
    n, r = comm.size, comm.rank
    cnt = 0
    for dt in dtypes:
        for count in _sizes(n):
            for op in OPS:
                case = f"ar-{dt}-{count}-{op.name}"
                x = dev.put(data(case, r, count, dt, op))
                y = dev.empty(count, dt)
                comm.Allreduce(x, y, op)
                got = dev.get(y)
                check(np.array_equal(got, reduce_ref(case, n, count, dt, op)), case)
                same_everywhere(got, case)
                # in place, non-blocking
                z = dev.put(data(case, r, count, dt, op))
                comm.Iallreduce(IN_PLACE, z, op).Wait()
                check(np.array_equal(dev.get(z), got), case + " in place")
                cnt += 2
            # reduce to a root, in place on the root
            op = SUM
            root = count % n
            case = f"red-{dt}-{count}"
            x = dev.put(data(case, r, count, dt, op))
            if r == root:
                y = dev.empty(count, dt)
                comm.Reduce(x, y, op, root=root)
                check(np.array_equal(dev.get(y), reduce_ref(case, n, count, dt, op)), case)
                y2 = dev.put(data(case, r, count, dt, op))
                comm.Reduce(IN_PLACE, y2, op, root=root)
                check(np.array_equal(dev.get(y2), reduce_ref(case, n, count, dt, op)), case)
            else:
                comm.Reduce(x, None, op, root=root)
                comm.Reduce(x, None, op, root=root)
            cnt += 2
            # bcast
            case = f"bc-{dt}-{count}"
            b = dev.put(data(case, r, count, dt, SUM))
            comm.Bcast(b, root=root)
            check(np.array_equal(dev.get(b), data(case, root, count, dt, SUM)), case)
            cnt += 1
            # allgather (and in place)
            case = f"ag-{dt}-{count}"
            x = dev.put(data(case, r, count, dt, SUM))
            g = dev.empty(n * count, dt)
            comm.Allgather(x, g)
            want = np.concatenate([data(case, k, count, dt, SUM) for k in range(n)])
            check(np.array_equal(dev.get(g), want), case)
            g2 = np.full(n * count, 7, dt)
            g2[r * count:(r + 1) * count] = data(case, r, count, dt, SUM)
            g2 = dev.put(g2)
            comm.Allgather(IN_PLACE, g2)
            check(np.array_equal(dev.get(g2), want), case + " in place")
            cnt += 2
            # reduce_scatter_block (and in place)
            for op in (SUM, MAX):
                case = f"rs-{dt}-{count}-{op.name}"
                x = dev.put(data(case, r, n * count, dt, op))
                o = dev.empty(count, dt)
                comm.Reduce_scatter_block(x, o, op)
                full = reduce_ref(case, n, n * count, dt, op)
                check(np.array_equal(dev.get(o), full[r * count:(r + 1) * count]), case)
                x2 = dev.put(data(case, r, n * count, dt, op))
                comm.Reduce_scatter_block(IN_PLACE, x2, op)
                check(np.array_equal(dev.get(x2)[:count], full[r * count:(r + 1) * count]),
                      case + " in place")
                cnt += 2
            # alltoall
            case = f"a2a-{dt}-{count}"
            x = dev.put(data(case, r, n * count, dt, SUM))
            o = dev.empty(n * count, dt)
            comm.Ialltoall(x, o).Wait()
            want = np.concatenate([data(case, k, n * count, dt, SUM)[r * count:(r + 1) * count]
                                   for k in range(n)])
            check(np.array_equal(dev.get(o), want), case)
            cnt += 1
    return cnt


def sc_standin_collectives(comm, args):
    dev = Dev("standin")
    cnt = run_all_collectives(comm, dev)
    info = comm.gpu_info()
    check(info["path"] == "staged-pipelined" and info["gpudirect"] is False, f"gpu_info {info}")
    check(all(ra.gpu_path == "staged-pipelined" for ra in comm.rails), "Rail.gpu_path")
    pool = [p for p in info["pools"] if p["backend"] == "host-standin"][0]
    # the pool is reused: pinned memory was allocated once per slot, however many segments
    check(dev.be.pinned_allocs == pool["allocated"] + pool["oversize"], f"pool {pool}")
    check(pool["allocated"] <= pool["slots"], f"pool {pool}")
    check(info["segments"] > 4 * info["calls"] // 3, f"few segments: {info}")
    if r2comm.communicator.Config.from_env().gpu_reduce == "device":
        check(info["device_reductions"] > 0 and dev.be.reductions > 0, "no device reductions")
    else:
        check(dev.be.reductions == 0, "device reductions in host mode")
    check(dev.be.active == 0, "a copy still runs")
    print(f"rank {comm.rank} pool {pool} calls {info['calls']} segments {info['segments']} "
          f"reductions {dev.be.reductions}", flush=True)
    return cnt


def sc_standin_twinwrap(comm, args):
    """Device-buffer calls run on hidden twin communicators whose id carries a 6-bit
    generation: the id comes back after 2**30 device calls, its twin sequence restarting at 0
    while the engine last saw it near 2**32. The device call number and the sequence are set
    (the same on every rank: a private test hook; both, so that the scenario means the same to
    code that numbered twins by the sequence) so that calls cross 2**24 (a new twin), start a
    third twin (twin 0's Python object is dropped), then cross 2**30 (twin 0 made again, its id
    reused), then, on a Dup, 2**32 (the host sequence wraps), with a host collective after each
    phase: every result exact."""
    n, r = comm.size, comm.rank
    dev = Dev("standin")
    cnt = 0
    d = comm.Dup()
    for c, start in ((comm, 2**24 - 2), (comm, 2**25 + 5), (comm, 2**30 - 2), (d, 2**32 - 2)):
        c.channel.seek_seq(start)
        # the next device call's number (with seek_seq, to cross wraps): the test's own reach
        pipeline._of(c).calls = start & (2**30 - 1) & pipeline._CALLS_MASK
        for i in range(4):
            case = f"tw-{start}-{i}"
            x = dev.put(data(case, r, 5000, "int32", SUM))
            y = dev.empty(5000, "int32")
            c.Allreduce(x, y, SUM)
            check(np.array_equal(dev.get(y), reduce_ref(case, n, 5000, "int32", SUM)), case)
            cnt += 1
        h = np.zeros(1, np.int64)
        c.Allreduce(np.array([r], np.int64), h, SUM)
        check(h[0] == n * (n - 1) // 2, f"host allreduce after {start}")
        cnt += 1
    calls = pipeline.device_calls(d)
    check(d.channel.next_call == 3 and calls == 2, f"the counters did not wrap: {d.channel.next_call} {calls}")
    d.Free()
    return cnt


def sc_standin_overlap(comm, args):
    """Slow copies (stand-in copy engine): segment k+1's device-to-host copy runs while segment
    k's collective is on the wire, and several calls are in flight at once."""
    dev = Dev("standin", copy_delay=float(args.get("delay", 0.004)))
    n, r = comm.size, comm.rank
    count = 16 * 1024                                   # 64 KiB of float32: 16 segments of 4 KiB
    case = "overlap"
    x = dev.put(data(case, r, count, "float32", SUM))
    y = dev.empty(count, "float32")
    req = comm.Iallreduce(x, y, SUM)
    req.Wait()
    check(np.array_equal(dev.get(y), reduce_ref(case, n, count, "float32", SUM)), case)
    p = req.pipeline
    net_done = {k: t for (what, k, t) in p.timeline if what == "net_done"}
    net_post = {k: t for (what, k, t) in p.timeline if what == "net_post"}
    d2h = sorted(t0 for (kind, _, t0, _) in dev.be.log if kind == "d2h")
    h2d = sorted(t0 for (kind, _, t0, _) in dev.be.log if kind == "h2d")
    nseg = len(p.segs)
    check(nseg >= 8, f"only {nseg} segments")
    overlapped = sum(1 for k in range(nseg - 1) if d2h[k + 1] < net_done[k])
    check(overlapped >= nseg // 2, f"copies did not overlap the wire: {overlapped} of {nseg - 1}")
    # and host-to-device copies of early segments ran before later segments were posted
    check(h2d[0] < net_post[nseg - 1], "no h2d before the last segment went on the wire")
    # several calls in flight, waited in reverse order
    reqs, outs = [], []
    for i in range(4):
        c = f"inflight{i}"
        xi = dev.put(data(c, r, 3000 + i, "int32", SUM))
        yi = dev.empty(3000 + i, "int32")
        reqs.append(comm.Iallreduce(xi, yi, SUM))
        outs.append((c, yi))
    for q in reversed(reqs):
        q.Wait()
    for c, yi in outs:
        check(np.array_equal(dev.get(yi), reduce_ref(c, n, yi.size, "int32", SUM)), c)
    check(dev.be.max_active >= 2, f"copies never ran concurrently (max {dev.be.max_active})")
    print(f"rank {r} segments {nseg} overlapped {overlapped} max_active {dev.be.max_active}",
          flush=True)
    return 2


def sc_standin_streams(comm, args):
    """Stream semantics: the collective orders itself after work queued on the array's stream,
    the stream= argument, or the current stream; the result is in place when the request
    completes and visible to work queued on the stream afterwards."""
    dev = Dev("standin", copy_delay=0.002)
    be = dev.be
    n, r = comm.size, comm.rank
    count = 5000
    cnt = 0
    want = reduce_ref("streams", n, count, "int32", SUM)
    for how in ("stream_arg", "current", "array"):
        s = be.new_stream()
        x = be.zeros(count, "int32")
        y = be.zeros(count, "int32")
        vals = data("streams", r, count, "int32", SUM)

        def produce(x=x, vals=vals):
            time.sleep(0.05)                  # a slow kernel writes the input
            x.data[:] = vals
        be.launch(s, produce)
        if how == "stream_arg":
            comm.Allreduce(x, y, SUM, stream=s)
        elif how == "current":
            with be.use_stream(s):
                comm.Allreduce(x, y, SUM)
        else:
            x.stream = s
            y.stream = s
            comm.Allreduce(x, y, SUM)
        # complete means in place: read at once, no synchronisation
        check(np.array_equal(y.data, want), f"{how}: result not in place at completion")
        # work queued on the stream afterwards sees it
        z = np.zeros(count, np.int32)
        be.launch(s, lambda: z.__setitem__(slice(None), y.data))
        be.sync(s)
        check(np.array_equal(z, want), f"{how}: later stream work missed the result")
        cnt += 1
    # non-blocking: a slow producer on the stream, the request completes after it
    s = be.new_stream()
    x = be.zeros(count, "int32")
    y = be.zeros(count, "int32")
    be.launch(s, lambda: (time.sleep(0.05), x.data.__setitem__(slice(None),
                                                               data("streams", r, count,
                                                                    "int32", SUM))))
    req = comm.Iallreduce(x, y, SUM, stream=s)
    req.Wait()
    check(np.array_equal(y.data, want), "non-blocking on a stream")
    # a stream= for host buffers is refused
    expect(r2comm.R2commArgumentError,
           lambda: comm.Allreduce(np.zeros(4, np.float32), np.zeros(4, np.float32), stream=s),
           "stream= with host buffers")
    comm.Barrier()
    return cnt + 1


def sc_standin_errors(comm, args):
    """A collective failing mid-pipeline raises from Wait on every rank, leaves no copy
    running, and the next call works."""
    n, r = comm.size, comm.rank
    count = 12 * 1024                                   # 48 KiB of int32: 12 segments
    want = reduce_ref("err", n, count, "int32", SUM)
    cnt = 0
    # 1. a device error (copy #7 of rank 1 fails)
    dev = Dev("standin", fail_copy_at=7 if r == 1 else None, copy_delay=0.001)
    x = dev.put(data("err", r, count, "int32", SUM))
    y = dev.empty(count, "int32")
    req = comm.Iallreduce(x, y, SUM)
    if r == 1:
        exc = expect(DeviceError, req.Wait, "device error on rank 1")
    else:
        exc = expect(r2comm.R2commError, req.Wait, "rank 1's device error seen here")
        check("rank 1" in str(exc), f"peer not named: {exc}")
    p = req.pipeline
    check(dev.be.active == 0 and p.ctx.sd.pending() == 0 and p.ctx.sh.pending() == 0,
          "copies still running after Wait raised")
    check(p.ctx.pool.in_use == 0, "slots not returned")
    cnt += 1
    # the next call works on every rank
    y = dev.empty(count, "int32")
    comm.Allreduce(x, y, SUM)
    check(np.array_equal(dev.get(y), want), "call after a device error")
    cnt += 1
    # 2. a mismatch mid-pipeline: rank 0 passes more segments than the others
    extra = 4096 * 3 if r == 0 else 0
    x = dev.put(np.ones(count + extra, np.int32))
    y = dev.empty(count + extra, "int32")
    expect(r2comm.R2commError, lambda: comm.Allreduce(x, y, SUM), "mismatch mid-pipeline")
    check(dev.be.active == 0, "copies still running after a mismatch")
    x = dev.put(data("err", r, count, "int32", SUM))
    y = dev.empty(count, "int32")
    comm.Allreduce(x, y, SUM)
    check(np.array_equal(dev.get(y), want), "call after a mismatch")
    cnt += 2
    # 3. a bad argument on rank 1: it raises locally, the others raise R2commPeerError
    x = dev.put(data("err", r, count, "int32", SUM))
    y = dev.empty(count, "int32")
    if r == 1:
        expect(r2comm.R2commArgumentError, lambda: comm.Allreduce(x, y, "XOR"), "bad op")
    else:
        exc = expect(r2comm.R2commPeerError, lambda: comm.Allreduce(x, y, SUM), "peer's bad op")
        check("rank 1" in str(exc), f"peer not named: {exc}")
    comm.Allreduce(x, y, SUM)
    check(np.array_equal(dev.get(y), want), "call after a bad argument")
    cnt += 2
    # 4. a timeout: rank 0 alone calls; its Wait raises R2commTimeout and nothing stays running
    if r == 0:
        req = comm.Iallreduce(x, y, SUM)
        expect(r2comm.R2commTimeout, lambda: req.Wait(0.5), "timeout")
        check(dev.be.active == 0 and req.pipeline.ctx.pool.in_use == 0, "after a timeout")
    cnt += 1
    return cnt


def sc_standin_failover(comm, args):
    """A rail fails mid-collective: every device-buffer collective completes bit-exact."""
    dev = Dev(args.get("dev", "standin"))
    n, r = comm.size, comm.rank
    count = int(args.get("count", 1 << 20))             # 4 MiB of float32
    cnt = 0
    for i, mode in enumerate(("hard", "silent")):
        case = f"fo-{mode}"
        x = dev.put(data(case, r, count, "float32", SUM))
        y = dev.empty(count, "float32")
        if r == 1:
            comm.fail_rail(0, mode, after_bytes=count)      # about a quarter in
        comm.Allreduce(x, y, SUM)
        got = dev.get(y)
        check(np.array_equal(got, reduce_ref(case, n, count, "float32", SUM)), case)
        same_everywhere(got, case)
        g = dev.empty(n * count, "float32")
        comm.Allgather(x, g)
        check(np.array_equal(dev.get(g), np.concatenate(
            [data(case, k, count, "float32", SUM) for k in range(n)])), case + " allgather")
        fails = [e for e in comm.events if e["kind"] == "rail_failed"]
        if r == 1 and mode == "hard":     # a silent one may be hedged around before its deadline
            check(len(fails) >= 1, f"{case}: no rail failure recorded")
        if mode == "hard" and os.environ.get("R2COMM_REPLAN"):
            # the NIC's fact may reach the epoch checks only after the calls above: small
            # calls until the plans switch (every rank switches at the same call, so every
            # rank leaves the loop at the same one), before the NIC comes back
            small_x, small_y = dev.put(np.ones(4, "float32")), dev.empty(4, "float32")
            for _ in range(2000):
                if comm.epoch >= 1:
                    break
                comm.Allreduce(small_x, small_y, SUM)
                time.sleep(0.005)
            check(comm.epoch >= 1, f"no re-planning while NIC 0 of rank 1 is down "
                  f"(epoch {comm.epoch})")
            cnt += 1
        if r == 1:
            comm.restore_rail(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(ra.state == "up" for ra in comm.rails):
            time.sleep(0.05)
        WORLD.Barrier()
        cnt += 2
    if os.environ.get("R2COMM_REPLAN"):
        check(comm.epoch >= 1, f"no re-planning after the rail failures (epoch {comm.epoch})")
    return cnt


def sc_standin_big(comm, args):
    """A call with more segments than its sequence numbers allow grows its segments beyond the
    pool's slots (memory of their own, counted as oversize) and stays exact."""
    dev = Dev("standin")
    n, r = comm.size, comm.rank
    count = 2 << 20                                     # 8 MiB of float32, 4 KiB segments
    x = dev.put(data("big", r, count, "float32", SUM))
    y = dev.empty(count, "float32")
    req = comm.Iallreduce(x, y, SUM)
    req.Wait()
    check(np.array_equal(dev.get(y), reduce_ref("big", n, count, "float32", SUM)), "big")
    check(len(req.pipeline.order) <= 256, f"{len(req.pipeline.order)} net steps")
    pool = req.pipeline.ctx.pool
    check(pool.oversize > 0 and pool.made <= pool.nslots and pool.in_use == 0, "oversize slots")
    return 1


def sc_standin_lowprec(comm, args):
    """float16 and bfloat16 reductions on the (stand-in) device: the same bits as the reference
    reduction in rank order, on every rank, and within tolerance of a float64 reference."""
    dev = Dev(args.get("dev", "standin"))
    n, r = comm.size, comm.rank
    count = 20001
    cnt = 0
    for dt in ("float16", "bfloat16"):
        for op in (SUM, MAX, PROD):
            rng = [np.random.default_rng([k, 7]) for k in range(n)]
            vals = [g.uniform(0.5, 1.5, count) for g in rng]
            if dt == "float16":
                mine = vals[r].astype(np.float16)
                blocks = [v.astype(np.float16) for v in vals]
                x = dev.put(mine)
                y = dev.empty(count, "float16")
                comm.Allreduce(x, y, op)
                got = dev.get(y)
                exact = reduce_blocks([b.view(np.uint8) for b in blocks], op.name, "float16")
                got64 = got.astype(np.float64)
                ref64 = {"SUM": np.sum, "MAX": np.max, "PROD": np.prod}[op.name](
                    np.stack([b.astype(np.float64) for b in blocks]), axis=0)
                tol = 2e-3 * n
            else:
                blocks = [f32_to_bf16(v.astype(np.float32)) for v in vals]
                x = dev.put_bf16(blocks[r])
                y = dev.zeros_bf16(count)
                comm.Allreduce(x, y, op)
                got = dev.get(y)
                exact = reduce_blocks([b.view(np.uint8) for b in blocks], op.name, "bfloat16")
                got64 = bf16_to_f32(got).astype(np.float64)
                ref64 = {"SUM": np.sum, "MAX": np.max, "PROD": np.prod}[op.name](
                    np.stack([bf16_to_f32(b).astype(np.float64) for b in blocks]), axis=0)
                tol = 1.6e-2 * n
            check(np.array_equal(got.view(np.uint16), exact.view(np.uint16)),
                  f"{dt} {op.name}: not the rank-order reduction")
            same_everywhere(got, f"{dt} {op.name}")
            err = np.max(np.abs(got64 - ref64) / np.abs(ref64))
            check(err < tol, f"{dt} {op.name}: relative error {err} >= {tol}")
            cnt += 1
    return cnt


# -- on a GPU (tests/test_gpu.py) -------------------------------------------------------------------
def sc_cupy_collectives(comm, args):
    import cupy
    dev = Dev("cupy")
    cnt = run_all_collectives(comm, dev)
    info = comm.gpu_info()
    check(info["backend"] == "cupy" and info["path"] == "staged-pipelined", f"{info}")
    # a CUDA tensor-like producer on a non-default stream is also covered by cupy_streams
    del cupy
    return cnt


def sc_cupy_streams(comm, args):
    """Arrays produced on non-default streams: the collective orders itself after the work
    queued there (stream=, the current stream, a raw stream handle), and later work on the
    stream sees the result."""
    import cupy
    n, r = comm.size, comm.rank
    count = 1 << 22
    want = reduce_ref("cstreams", n, count, "float32", SUM)
    host = data("cstreams", r, count, "float32", SUM)
    cnt = 0
    for how in ("stream_arg", "current", "handle", "nonblocking"):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = cupy.zeros(count, cupy.float32)
            for _ in range(50):                     # keep the stream busy before the input lands
                x = x * 1.0
            x[...] = cupy.asarray(host)
            y = cupy.zeros(count, cupy.float32)
        if how == "stream_arg":
            comm.Allreduce(x, y, SUM, stream=s)
        elif how == "current":
            with s:
                comm.Allreduce(x, y, SUM)
        elif how == "handle":
            comm.Allreduce(x, y, SUM, stream=s.ptr)
        else:
            comm.Iallreduce(x, y, SUM, stream=s).Wait()
        with s:
            z = y * 1.0                             # queued after: sees the result
        s.synchronize()
        check(np.array_equal(cupy.asnumpy(z), want), f"cupy stream {how}")
        cnt += 1
    return cnt


SCENARIOS = {k[3:]: v for k, v in globals().items() if k.startswith("sc_")}

if __name__ == "__main__":
    main(SCENARIOS, default_timeout=60)
