#!/usr/bin/env python3
"""Degraded-server allreduce in the netns testbed (issue 5 figures).

    sudo .venv/bin/python bench/testbed_degraded.py [--hosts 3] [--rate 500mbit] [--mib 64]

H hosts x 2 NICs at a fixed rate, one rank per host. Once the job runs, NIC 1 of the last host
is taken down for real (ip link set down), or with --slow F shaped to F x the rate (tc tbf);
after the engines detect it, the job times a 64 MiB float32 allreduce with
  ring       the static ring; the engine's striping already moves the lost NIC's share onto
             the surviving NIC ("balance"), but the degraded host stays on the critical path
  replanned  the schedule the planner picks for the agreed rail state (comm.replan()):
             the degraded-server allreduce when its predicted time is lower
and compares both with the lower bound T* = (N/B)·max(1/β, 2(p−1)/(p−1+β)), β = 1/2 (one of
two equal NICs left; (1 + F)/2 with --slow F). T* is given twice: from the nominal tbf rate B, and from the goodput the
fabric really delivers. tbf counts frame headers (under 1% at the testbed's 9000-byte MTU, ~4.5%
at 1500) and TCP needs some headroom, so the nominal T* is out of reach by a few per cent: the
job also times the degraded host's bare traffic (it sends N/(p-1)
bytes to every healthy host and receives as much from each, all at once, no reductions); when
the 1/β term of T* dominates, as it does here, that exchange time is T* at the real goodput.
Every result is checked against numpy. Writes
bench/out/testbed_degraded.json.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def rank_main(args):
    import numpy as np
    from mpi4py import MPI
    import r2comm
    from r2comm.planner import cost
    from testbed_failover import rank_job     # (this folder)

    world, comm, x, ref, y = rank_job(args.mib)
    r, n = comm.rank, comm.size
    count = x.size
    comm.Allreduce(x, y)
    marker = os.path.join(args.out, ".degraded_ready")
    if r == 0:
        open(marker, "w").close()
    # the launcher takes NIC 1 of the last host down (or slows it) now; wait (a bounded, agreed
    # number of rounds) until the degraded host and a peer have noticed (a slowed NIC: until the
    # launcher says it is shaped; the engines measure its rate as the ring runs on it)
    shaped = os.path.join(args.out, ".degraded_shaped")
    for _ in range(150):
        if args.slow:
            if world.allreduce(1 if os.path.exists(shaped) else 0) == n:
                break
        elif world.allreduce(1 if any(ra.state != "up" for ra in comm.rails) else 0) >= 2:
            break
        time.sleep(0.2)
    results = {}

    def timed(label, reps):
        ts = []
        for _ in range(reps):
            world.Barrier()
            t = time.perf_counter()
            comm.Allreduce(x, y)
            ts.append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
            assert np.array_equal(y, ref), label
        ts.sort()
        results[label] = {"median_s": ts[len(ts) // 2], "all_s": ts,
                          "algo": comm.schedule("allreduce", count * 4, 4).algo}

    def exchange(reps):
        """The degraded host's bare traffic: N/(n-1) to and from every healthy host at once."""
        d, part = n - 1, (count * 4) // (n - 1)
        sb = np.ones(part, np.uint8)
        rb = [np.empty(part, np.uint8) for _ in range(n)]
        ts = []
        for _ in range(reps):
            world.Barrier()
            t = time.perf_counter()
            if r == d:
                reqs = [q for h in range(n - 1)
                        for q in (comm.Isend(sb, h, 5), comm.Irecv(rb[h], h, 5))]
            else:
                reqs = [comm.Isend(sb, d, 5), comm.Irecv(rb[d], d, 5)]
            r2comm.Request.Waitall(reqs)
            ts.append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
        ts.sort()
        return {"median_s": ts[len(ts) // 2], "all_s": ts, "bytes_each_way": part * (n - 1)}

    timed("ring", args.reps)                       # static plans (no rail state)
    if args.slow and args.warm_pairs:
        # the ring measures the slowed NIC only on the pairs it uses; the others keep the
        # start-up probe's rate (README Limits: when a slowed NIC is seen); the bare exchange
        # gives every pair with the slowed host a fresh rate
        exchange(1)
    state = comm.replan()                           # agreed: every rank calls it here
    if r == 0:
        print("[degraded] agreed state:", state.describe(), "nic Mbit/s:",
              {h: [round(state.nic_bw(h, k) * 8e-6) for k in range(2)] for h in state.host_list()},
              "schedule:", comm.schedule("allreduce", count * 4, 4).algo, flush=True)
    sent0 = comm.channel.engine.rail_stats()
    timed("replanned", args.reps)
    sent1 = comm.channel.engine.rail_stats()
    # per rank: what the probe measured, and the bytes each (peer, rail) carried while the
    # replanned schedule ran, with the engine's measured rate at the end (for slow runs)
    pr = comm.probe_result
    diag = world.gather({"probe": {f"{q}:{k}": v for (q, k), v in (pr.rates.items() if pr else [])},
                         "replanned": {f"{q}:{k}": [sent1[q][k][1] - sent0[q][k][1], sent1[q][k][7],
                                                      sent1[q][k][8] - sent0[q][k][8]]
                                       for q in sent1 for k in range(len(sent1[q]))}}, root=0)
    bare = exchange(args.reps)
    # T* from the fabric: a healthy host has 2 NICs at --rate, the degraded one 1 (beta = 1/2,
    # what the fabric was built with; the planner's own estimate is recorded beside it)
    from r2comm.testbed.fabric import _rate_bps
    bw = 2 * _rate_bps(args.rate) / 8
    beta = (1 + args.slow) / 2
    tstar = cost.lower_bound(count * 4, bw, beta, n)
    # the same bound at the goodput the degraded host really gave the bare exchange
    goodput = bare["bytes_each_way"] / bare["median_s"]          # bytes/s through its NICs
    tstar_eff = cost.lower_bound(count * 4, goodput / beta, beta, n)
    if r == 0:
        out = {"hosts": n, "rate": args.rate, "slow": args.slow, "mtu": args.mtu,
               "mib": args.mib, "beta": beta,
               "beta_planner": state.beta(), "host_bw_Bps": bw, "T_star_s": tstar,
               "nic_goodput_Bps": goodput, "T_star_goodput_s": tstar_eff,
               "exchange": bare, "results": results, "diag": diag}
        name = f"testbed_degraded_slow{args.slow:g}.json" if args.slow else "testbed_degraded.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(out, f, indent=1)
        print(f"[degraded] p={n} beta={beta:.2f} (planner: {state.beta():.2f}) "
              f"B={bw * 8 / 1e9:.2f} Gbit/s per host N={args.mib} MiB  T*={tstar * 1e3:.0f} ms; "
              f"NIC goodput {goodput * 8 / 1e6:.0f} Mbit/s -> T*(goodput)={tstar_eff * 1e3:.0f} ms",
              flush=True)
        for label, res in results.items():
            print(f"[degraded] {label:10s} {res['algo']:22s} median {res['median_s'] * 1e3:7.0f} ms"
                  f"  = {res['median_s'] / tstar:.2f} x T*  = {res['median_s'] / tstar_eff:.2f} "
                  "x T*(goodput)", flush=True)
    comm.Free()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slow", type=float, default=0.0,
                    help="NIC 1 of the last host at this fraction of --rate (0: taken down)")
    ap.add_argument("--warm-pairs", action="store_true",
                    help="with --slow: one bare exchange with the slowed host before replan()")
    ap.add_argument("--mtu", type=int, default=None, help="rail MTU (default: the testbed's)")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    from r2comm.testbed import Fabric
    os.makedirs(args.out, exist_ok=True)
    marker = os.path.join(args.out, ".degraded_ready")
    shaped = os.path.join(args.out, ".degraded_shaped")
    for path in (marker, shaped):
        if os.path.exists(path):
            os.remove(path)
    from r2comm.testbed.fabric import RAIL_MTU
    args.mtu = args.mtu or RAIL_MTU
    with Fabric(hosts=args.hosts, nics=2, rate=args.rate, tag="degr", mtu=args.mtu) as fab:
        p = fab.mpiexec(args.hosts, [sys.executable, os.path.abspath(__file__), "--rank",
                                     "--hosts", str(args.hosts), "--rate", args.rate,
                                     "--mib", str(args.mib), "--reps", str(args.reps),
                                     "--slow", str(args.slow),
                                     *(["--warm-pairs"] if args.warm_pairs else []),
                                     "--mtu", str(args.mtu),
                                     "--out", args.out],
                        env={"R2COMM_RAIL_TIMEOUT_MS": "500"}, timeout=600)
        deadline = time.time() + 120
        while not os.path.exists(marker) and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if args.slow:
            from r2comm.testbed.fabric import _rate_bps
            fab.degrade(args.hosts - 1, 1, int(_rate_bps(args.rate) * args.slow))
            open(shaped, "w").close()
        else:
            fab.nic_down(args.hosts - 1, 1)
        rc = p.wait()
    sys.exit(rc)


if __name__ == "__main__":
    main()
