"""GPU benchmark of the device-buffer path (run by scripts/gpu-check.sh on a GPU machine).

    python scripts/gpu_bench.py [--mib 64] [--iters 10] [--out FILE]

Starts 2 ranks itself (subprocesses meeting through a DirStore: no MPI needed) on loopback
rails and times a float32 allreduce of --mib MiB, every result checked against numpy:
    numpy        host numpy arrays (the target's reference: "the same collective on host arrays")
    pipelined    cupy arrays through the staging pipeline, reductions on the GPU
    pipe-host    cupy arrays through the pipeline, reductions in the engine (R2COMM_GPU_REDUCE=host)
    whole        the old path: cupy.asnumpy of the whole buffer, host allreduce, copy back
then, on rank 0, the GPU reduction kernels' throughput per dtype (2 blocks of --mib MiB).
Prints one JSON object per line (and appends them to --out)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def emit(out, rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def timed(fn, iters, sync):
    fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


class _StandinCupy:
    """--standin: the harness on the host stand-in device (a dry run of this script without a
    GPU; its numbers mean nothing)."""

    def __init__(self):
        from r2comm.gpu.standin import HostBackend
        self.be = HostBackend()

    def asarray(self, a):
        return self.be.array(a)

    def empty_like(self, a):
        return self.be.array(a.data)

    def asnumpy(self, a):
        self.be.sync(self.be.default_stream)
        return a.data.copy()

    def fill(self, a, v):
        a.data[:] = v

    def set(self, a, h):
        a.data[:] = h

    def sync(self):
        self.be.sync(self.be.default_stream)


class _Cupy:
    def __init__(self):
        import cupy
        self.cp = cupy

    def asarray(self, a):
        return self.cp.asarray(a)

    def empty_like(self, a):
        return self.cp.empty_like(a)

    def asnumpy(self, a):
        return self.cp.asnumpy(a)

    def fill(self, a, v):
        a.fill(v)

    def set(self, a, h):
        a.set(h)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()


def rank_main(rank, size, store_dir, args):
    import numpy as np
    import r2comm
    from r2comm.control.bootstrap_store import DirStore
    from r2comm.gpu import pipeline
    dev = _StandinCupy() if args.standin else _Cupy()
    comm = r2comm.Communicator.from_store(DirStore(store_dir), rank, size, timeout=120)
    n = args.mib * (1 << 20) // 4
    host_in = np.full(n, rank + 1, np.float32)
    host_in[::7] = rank * 3
    want = sum(np.full(n, k + 1, np.float32) for k in range(size))
    want[::7] = sum(k * 3 for k in range(size))
    h_out = np.empty_like(host_in)
    d_in = dev.asarray(host_in)
    d_out = dev.empty_like(d_in)
    nosync = lambda: None                                     # noqa: E731
    res = {}

    def run_numpy():
        comm.Allreduce(host_in, h_out)
    res["numpy"] = timed(run_numpy, args.iters, nosync)
    assert np.array_equal(h_out, want)

    def run_pipe():
        comm.Allreduce(d_in, d_out)
    sync = dev.sync
    for mode in ("device", "host"):
        comm._cfg.gpu_reduce = mode
        dev.fill(d_out, 0)
        res["pipelined" if mode == "device" else "pipe-host"] = timed(run_pipe, args.iters, sync)
        assert np.array_equal(dev.asnumpy(d_out), want), mode
    comm._cfg.gpu_reduce = "device"
    sweep = {}
    seg0 = comm._cfg.gpu_segment
    for seg in (1 << 20, 4 << 20, 16 << 20):             # the segment size, on both ranks alike
        for mode in ("device", "host"):
            comm._cfg.gpu_segment, comm._cfg.gpu_reduce = seg, mode
            sweep[(seg, mode)] = timed(run_pipe, max(3, args.iters // 2), sync)
            assert np.array_equal(dev.asnumpy(d_out), want), (seg, mode)
    comm._cfg.gpu_segment, comm._cfg.gpu_reduce = seg0, "device"

    def run_whole():                                        # the old _gpu_staged
        h = dev.asnumpy(d_in)
        comm.Allreduce(r2comm.IN_PLACE, h)
        dev.set(d_out, h)
    res["whole"] = timed(run_whole, args.iters, sync)
    assert np.array_equal(dev.asnumpy(d_out), want)
    if rank == 0:
        nbytes = n * 4
        for name, (med, best) in res.items():
            emit(args.out, {"bench": "allreduce", "path": name, "mib": args.mib, "ranks": size,
                            "median_ms": round(med * 1e3, 3), "best_ms": round(best * 1e3, 3),
                            "algbw_GBps": round(nbytes / med / 1e9, 3),
                            "vs_numpy": round(med / res["numpy"][0], 3)})
        for (seg, mode), (med, best) in sweep.items():
            emit(args.out, {"bench": "allreduce_segment_sweep", "segment": seg, "reduce": mode,
                            "mib": args.mib, "median_ms": round(med * 1e3, 3),
                            "vs_numpy": round(med / res["numpy"][0], 3)})
        emit(args.out, {"bench": "gpu_info", "standin": bool(args.standin),
                        **{k: v for k, v in comm.gpu_info().items() if k != "pools"}})
        be = list(pipeline._contexts.values())[0].backend
        s = be.new_stream()
        blk = args.mib << 20
        src = be.empty(2 * blk)
        dst = be.empty(blk)
        if args.standin:
            src[:] = 0x3C
        else:                                               # finite values in every dtype
            import cupy
            cupy.cuda.runtime.memset(src.ptr, 0x3C, 2 * blk)
        for dt in ("float32", "float16", "bfloat16", "float64", "int32", "int8"):
            isz = 2 if dt == "bfloat16" else np.dtype(dt).itemsize
            cnt = blk // isz
            for op in ("SUM", "MAX"):
                def red():
                    be.reduce(dst, 0, src, [0, blk], cnt, op, dt, s)
                med, best = timed(red, args.iters, lambda: be.synchronize(be.record(s), 60))
                emit(args.out, {"bench": "gpu_reduce", "standin": bool(args.standin),
                                "dtype": dt, "op": op, "mib": args.mib,
                                "median_ms": round(med * 1e3, 4),
                                "GBps_moved": round(3 * blk / med / 1e9, 1)})
    comm.Free()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--store", default="")
    ap.add_argument("--standin", action="store_true",
                    help="dry run on the host stand-in device (no GPU; numbers mean nothing)")
    args = ap.parse_args()
    if args.rank >= 0:
        return rank_main(args.rank, 2, args.store, args)
    store = tempfile.mkdtemp(prefix="r2comm-gpu-bench-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--store", store,
                               "--mib", str(args.mib), "--iters", str(args.iters),
                               "--out", args.out] + (["--standin"] if args.standin else []),
                              env=env) for r in range(2)]
    rc = 0
    for p in procs:
        try:
            rc |= p.wait(timeout=float(os.environ.get("R2COMM_BENCH_TIMEOUT", "240")))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 124
    for p in procs:
        if p.poll() is None:
            p.kill()
    sys.exit(rc)


if __name__ == "__main__":
    main()
