#!/usr/bin/env python3
"""A slow (degraded, not dead) rail in the netns testbed: striping by measured rate and
tail hedging, against one healthy NIC alone.

    sudo .venv/bin/python bench/testbed_slow_rail.py [--rate 1gbit] [--slow 100mbit] [--mib 16]

2 hosts x 2 NICs at --rate, one rank per host. The job times --iters back-to-back float32
allreduces of --mib MiB in these phases, every result checked against numpy:
  healthy   both NICs at --rate
  degraded  NIC 1 of both hosts shaped down to --slow (tc tbf) while the job runs; rounds
            alternate hedging on and off (engine.tuning.set_hedge) in the same job, so the two are
            compared side by side
  restored  NIC 1 given its rate back: the striping must measure it again (no slower than
            healthy)
  single    rail 1 failed on purpose (comm.fail_rail): NIC 0 alone, the baseline a slow
            rail must not fall below
Reports per phase the median op time over --reps rounds, busbw, the share of bytes sent on
NIC 1 and the bytes sent as hedge copies. Writes --out/testbed_slow_rail.json.
"""
import argparse
import json
import os
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def rank_main(args):
    import numpy as np
    from mpi4py import MPI
    from testbed_failover import rank_job     # (this folder)
    world, comm, x, ref, y = rank_job(args.mib)
    n = comm.size
    eng = comm.channel.engine
    wrong = 0

    def rounds(label, hedge, reps):
        nonlocal wrong
        out = []
        for _ in range(reps):
            eng.tuning.set_hedge(2 if hedge else 0)   # on: the default mode (late and slow rails)
            comm.Allreduce(x, y)              # settles the rail rates after a switch
            world.Barrier()
            b0 = [(ra.bytes_sent, ra.bytes_hedged) for ra in comm.rails]
            t = time.perf_counter()
            for _ in range(args.iters):
                comm.Allreduce(x, y)
                wrong += not np.array_equal(y, ref)
            dt = world.allreduce((time.perf_counter() - t) / args.iters, op=MPI.MAX)
            d = [ra.bytes_sent - b for ra, (b, _) in zip(comm.rails, b0)]
            h = sum(ra.bytes_hedged - hb for ra, (_, hb) in zip(comm.rails, b0))
            out.append({"s": dt, "share1": d[1] / max(1, sum(d)), "hedged": h / args.iters})
        s = median(r["s"] for r in out)
        res = {"phase": label, "hedge": hedge, "median_s": s,
               "busbw_GBps": (args.mib << 20) / s * 2 * (n - 1) / n / 1e9,
               "share1": median(r["share1"] for r in out),
               "hedged_bytes_per_op": median(r["hedged"] for r in out),
               "rounds_s": [r["s"] for r in out]}
        if comm.rank == 0:
            print(f"[slow] {label:9s} hedge={int(hedge)} {s * 1e3:7.1f} ms  busbw "
                  f"{res['busbw_GBps']:.3f} GB/s  share(NIC1) {res['share1']:.3f}  hedged/op "
                  f"{res['hedged_bytes_per_op'] / 1024:.0f} KiB", flush=True)
        return res

    results = [rounds("healthy", True, args.reps)]
    if comm.rank == 0:
        open(os.path.join(args.out, ".slow_ready"), "w").close()
    time.sleep(2.0)                           # the driver shapes NIC 1 down now
    world.Barrier()
    for _ in range(3):                        # the rates adapt from acknowledgements
        comm.Allreduce(x, y)
    deg = {True: [], False: []}
    for rep in range(args.reps):
        for hedge in (True, False) if rep % 2 == 0 else (False, True):
            deg[hedge].append(rounds("degraded", hedge, 1))
    for hedge in (True, False):
        rs = deg[hedge]
        s = median(r["median_s"] for r in rs)
        results.append({"phase": "degraded", "hedge": hedge, "median_s": s,
                        "busbw_GBps": (args.mib << 20) / s * 2 * (n - 1) / n / 1e9,
                        "share1": median(r["share1"] for r in rs),
                        "hedged_bytes_per_op": median(r["hedged_bytes_per_op"] for r in rs),
                        "rounds_s": [r["median_s"] for r in rs]})
    if comm.rank == 0:
        open(os.path.join(args.out, ".slow_restore"), "w").close()
    time.sleep(2.0)                           # the driver gives NIC 1 its rate back now
    world.Barrier()
    results.append(rounds("restored", True, args.reps))
    comm.fail_rail(1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(ra.state == "up" for ra in comm.rails[1:]):
        time.sleep(0.01)
    world.Barrier()
    results.append(rounds("single", True, args.reps))
    wrong = world.allreduce(wrong)
    if comm.rank == 0:
        single = results[-1]["median_s"]
        summary = {"hosts": n, "rate": args.rate, "slow": args.slow, "mib": args.mib,
                   "iters": args.iters, "reps": args.reps, "wrong_results": wrong,
                   "phases": results,
                   "degraded_vs_single": {str(r["hedge"]): single / r["median_s"]
                                          for r in results if r["phase"] == "degraded"},
                   "restored_vs_healthy": results[0]["median_s"] /
                   next(r["median_s"] for r in results if r["phase"] == "restored")}
        with open(os.path.join(args.out, "testbed_slow_rail.json"), "w") as f:
            json.dump(summary, f, indent=1)
        for r in results:
            if r["phase"] == "degraded":
                print(f"[slow] degraded hedge={int(r['hedge'])}: {single / r['median_s']:.2f}x "
                      "the speed of NIC 0 alone", flush=True)
        print(f"[slow] wrong results: {wrong}", flush=True)
    comm.Free()
    return 1 if wrong else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--slow", default="100mbit")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    if args.rank:
        sys.exit(rank_main(args))
    from r2comm.testbed import Fabric
    from testbed_failover import fresh_marker, wait_marker
    marker = fresh_marker(args.out, ".slow_ready")
    restore = fresh_marker(args.out, ".slow_restore")
    with Fabric(hosts=2, nics=2, rate=args.rate, tag="slow") as fab:
        p = fab.mpiexec(2, [sys.executable, os.path.abspath(__file__), "--rank",
                            "--rate", args.rate, "--slow", args.slow, "--mib", str(args.mib),
                            "--iters", str(args.iters), "--reps", str(args.reps),
                            "--out", args.out], timeout=400)
        wait_marker(marker, p, 120)
        fab.degrade(0, 1, args.slow)
        fab.degrade(1, 1, args.slow)
        wait_marker(restore, p, 200)
        fab.degrade(0, 1, args.rate)
        fab.degrade(1, 1, args.rate)
        rc = p.wait()
        if os.path.exists(restore):
            os.remove(restore)
    if os.path.exists(marker):
        os.remove(marker)
    sys.exit(rc)


if __name__ == "__main__":
    main()
