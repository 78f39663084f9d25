#!/usr/bin/env python3
"""A short NIC flap under a stream of allreduces in the netns testbed (issue 18's flap, small).

    sudo .venv/bin/python bench/testbed_flap.py [--rate 500mbit] [--mib 4] [--down-s 0.3]

2 hosts x 2 NICs at --rate, one rank per host. The ranks run back-to-back float32 allreduces
of --mib MiB for --seconds; --flap-at seconds in, this script takes host 1's NIC 0 down
(`ip link set nic0 down` in its namespace) for --down-s, then up, like bench/testbed_torch.py's
flap, --flaps times, --gap s apart. Each rank records every op's end time and duration and, per op, rail 0's state, its
measured rate and its TCP view (retransmits), then the engine's events. A slow op is one over
1.5x the median of the ops before the flap. Writes --out/testbed_flap.json; prints the ops
around the flap and the events.
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
SLOW = 1.5


def rank_main(args):
    import numpy as np
    from testbed_failover import rank_job     # (this folder)
    world, comm, x, ref, y = rank_job(args.mib)
    eng = comm.channel.engine
    peer = 1 - comm.rank
    wrong = 0
    for _ in range(3):
        comm.Allreduce(x, y)
    world.Barrier()
    if comm.rank == 0:
        open(os.path.join(args.out, ".flap_ready"), "w").close()
    ops = []
    t_end = time.time() + args.seconds
    while len(ops) < 5000:
        t0 = time.time()
        comm.Allreduce(x, y)
        t1 = time.time()
        wrong += not np.array_equal(y, ref)
        rows = eng.rail_stats()[peer]
        ops.append({"t0": t0, "t1": t1, "s": t1 - t0,
                    "rails": [(r[0], r[7], r[1], r[3], r[8]) for r in rows]})
        # every rank runs the same number of ops: rank 0 decides when to stop (bounded: 5000)
        if len(ops) % 8 == 0:
            stop = world.bcast(time.time() >= t_end if comm.rank == 0 else None, root=0)
            if stop:
                break
    res = {"rank": comm.rank, "ops": ops, "events": comm.events, "wrong": wrong}
    with open(os.path.join(args.out, f"testbed_flap.rank{comm.rank}.json"), "w") as f:
        json.dump(res, f)
    comm.Free()
    return 1 if wrong else 0


def analyse(args, flaps):
    recs = [json.load(open(os.path.join(args.out, f"testbed_flap.rank{r}.json"))) for r in (0, 1)]
    ops = recs[0]["ops"]
    t_first = flaps[0][0]
    before = [o["s"] for o in ops if o["t1"] < t_first]
    base = median(before) if before else float("nan")
    out = {"rate": args.rate, "mib": args.mib, "down_s": args.down_s, "healthy_median_s": base,
           "slow_factor": SLOW, "wrong": recs[0]["wrong"] + recs[1]["wrong"], "flaps": []}
    for k, (t0, t1) in enumerate(flaps):
        t_next = flaps[k + 1][0] if k + 1 < len(flaps) else float("inf")
        # the ops that ended after the NIC went down, up to the next flap (at most 1.5 s)
        win = [o for o in ops if t0 <= o["t1"] < min(t_next, t0 + 1.5) and o["s"] > 0]
        slow = [o for o in win if o["s"] > SLOW * base]
        rest = {r["rank"]: [(e["kind"], round(e["t"] - t0, 4)) for e in r["events"]
                            if t0 - 0.05 <= e["t"] < t_next and e["kind"] in
                            ("rail_failed", "rail_restored")] for r in recs}
        out["flaps"].append({"t": [t0, t1], "slow_ops": len(slow),
                             "slow_time_s": sum(o["s"] for o in slow),
                             "extra_s": sum(o["s"] - base for o in win if o["s"] > base),
                             "ms": [round(o["s"] * 1e3, 1) for o in win[:16]],
                             "rail_events": rest})
    out["max_slow_ops"] = max(f["slow_ops"] for f in out["flaps"])
    out["ops"] = [{"dt0": round(o["t0"] - t_first, 4), "ms": round(o["s"] * 1e3, 1),
                   "rails": o["rails"]} for o in ops]
    out["events"] = {r["rank"]: [{**e, "t_rel": round(e["t"] - t_first, 4)} for e in r["events"]]
                     for r in recs}
    with open(os.path.join(args.out, "testbed_flap.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--flap-at", type=float, default=1.5)
    ap.add_argument("--down-s", type=float, default=0.3)
    ap.add_argument("--flaps", type=int, default=2, help="flaps, --gap s apart (the torch "
                    "bench's two are ~1.4 s apart)")
    ap.add_argument("--gap", type=float, default=1.4)
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    return rank_main(args) if args.rank else drive(args)


def drive(args):
    """The driver: the fabric, the job, the flaps, then the analysis of what the ranks wrote."""
    from r2comm.testbed import Fabric
    from testbed_failover import fresh_marker, wait_marker
    marker = fresh_marker(args.out, ".flap_ready")
    with Fabric(hosts=2, nics=2, rate=args.rate, tag=f"fl{os.getpid() % 10000}") as fab:
        p = fab.mpiexec(2, [sys.executable, os.path.abspath(__file__), "--rank",
                            "--rate", args.rate, "--mib", str(args.mib),
                            "--seconds", str(args.seconds), "--out", args.out],
                        timeout=args.seconds + 60)
        wait_marker(marker, p, 60)
        time.sleep(args.flap_at)
        flaps = []
        for k in range(args.flaps):
            if k:
                time.sleep(max(0.0, flaps[-1][0] + args.gap - time.time()))
            t0 = time.time()
            fab.nic_down(1, 0)
            time.sleep(args.down_s)
            t1 = time.time()
            fab.nic_up(1, 0)
            flaps.append((t0, t1))
        rc = p.wait(timeout=args.seconds + 90)
    if os.path.exists(marker):
        os.remove(marker)
    if rc:
        print(f"[flap] job failed: rc {rc}")
        return rc
    out = analyse(args, flaps)
    for k, f in enumerate(out["flaps"]):
        print(f"[flap] flap {k + 1}: ops {f['ms']} ms; rail events {f['rail_events']}")
    print(f"[flap] healthy {out['healthy_median_s'] * 1e3:.1f} ms; slow ops (> {SLOW}x) per flap: "
          f"{[f['slow_ops'] for f in out['flaps']]}, extra ms "
          f"{[round(f['extra_s'] * 1e3) for f in out['flaps']]}; wrong {out['wrong']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
