"""Hierarchical against flat allreduce on the netns testbed (root): 2 hosts x 2 NICs x 2 ranks
per host, healthy and with NIC 1 of host 0 down.

    python bench/testbed_hier.py [--rate 1gbit] [--size 64M] [--rounds 5] [--iters 3] [--out DIR]

Per phase (healthy, then `ip link set nic1 down` in host 0 before the job starts) one mpiexec
job of 4 ranks runs, in the same job and interleaved round by round (order alternating), K
allreduces of SIZE float32 with the plan forced hierarchical and K with the flat plan (the
planner's flat choice at this size: the ring). Time per allreduce = the slowest rank's time for
the K / K; busbw = SIZE / time x 2(n-1)/n (nccl-tests). Every result is checked: the same bits
in every round of one plan, close to the float64 sum. Prints medians and ratios and writes
DIR/testbed_hier.json."""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def rank_main(a):
    import numpy as np
    from mpi4py import MPI
    import r2comm
    world = MPI.COMM_WORLD
    comm = r2comm.Communicator(world, timeout=120)
    n, r = comm.size, comm.rank
    topo = comm.topology()
    count = a.size // 4
    x = np.random.default_rng([7, r]).standard_normal(count).astype(np.float32)
    y = np.empty_like(x)
    ref = sum(np.random.default_rng([7, k]).standard_normal(count).astype(np.float32)
              .astype(np.float64) for k in range(n))
    times = {"hierarchical": [], "flat": []}
    algos, bits, wrong = {}, {}, 0
    for rnd in range(a.rounds + 1):                   # round 0: warm-up, not counted
        order = ("hierarchical", "flat") if rnd % 2 else ("flat", "hierarchical")
        for algo in order:
            comm.channel.config.algo = algo                     # what R2COMM_ALGO sets, switched in-job
            comm.channel._plans.clear()
            algos[algo] = comm.schedule("allreduce", x.nbytes, 4).algo
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                comm.Allreduce(x, y)
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / a.iters
            h = hash(y.tobytes())
            if bits.setdefault(algo, h) != h or not np.allclose(y, ref, rtol=1e-3, atol=1e-3):
                wrong += 1
            if rnd:
                times[algo].append(dt)
    wrong = world.allreduce(wrong)
    if r == 0:
        Path(a.json).write_text(json.dumps({"times": times, "algos": algos, "wrong": wrong,
                                            "topology": topo, "rails": [
                                                (ra.address, ra.state) for ra in comm.rails]}))
    comm.Free()


def driver(a):
    from r2comm.testbed import Fabric
    from r2comm.testbed.rates import parse_rate
    if os.geteuid() != 0:
        raise SystemExit("bench/testbed_hier.py needs root (network namespaces)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = 4
    report = {"config": {"hosts": 2, "nics": 2, "ranks_per_host": 2, "rate": a.rate,
                         "size": a.size, "rounds": a.rounds, "iters": a.iters,
                         "argv": sys.argv[1:]}, "phases": {}}
    line = parse_rate(a.rate) / 8                      # bytes/s of one NIC
    with Fabric(hosts=2, nics=2, rate=a.rate, tag=f"bh{os.getpid()}") as fab:
        for phase in ("healthy", "host0_nic1_down"):
            if phase != "healthy":
                fab.nic_down(0, 1)
            path = out / f"testbed_hier_{phase}.tmp.json"
            p = fab.mpiexec(n, [sys.executable, str(Path(__file__).resolve()), "rank",
                                "--size", str(a.size), "--rounds", str(a.rounds),
                                "--iters", str(a.iters), "--json", str(path)],
                            timeout=a.timeout)
            rc = p.wait(timeout=a.timeout + 30)
            if rc != 0:
                raise SystemExit(f"{phase}: the job failed (rc {rc})")
            res = json.loads(path.read_text())
            path.unlink()
            busbw = {k: [a.size / t * 2 * (n - 1) / n for t in v] for k, v in res["times"].items()}
            ratios = [f / h for h, f in zip(res["times"]["hierarchical"], res["times"]["flat"])]
            res.update(busbw=busbw, median_busbw={k: statistics.median(v) for k, v in busbw.items()},
                       median_ratio=statistics.median(ratios), ratios=ratios)
            report["phases"][phase] = res
    h, d = report["phases"]["healthy"], report["phases"]["host0_nic1_down"]
    # what the NICs allow: host 0's NICs must carry 2(H-1)/H = 1 x SIZE out (hierarchical) or
    # 2(n-1)/n = 1.5 x SIZE (flat ring); busbw bound = SIZE / (that / host 0's rate) x 1.5
    for res, nics in ((h, 2), (d, 1)):
        res["nic_bound_busbw"] = {"hierarchical": nics * line * 1.5, "flat": nics * line}
    report["degraded_over_healthy_hier"] = (d["median_busbw"]["hierarchical"] /
                                            h["median_busbw"]["hierarchical"])
    (out / "testbed_hier.json").write_text(json.dumps(report, indent=1))
    for name, res in report["phases"].items():
        mb = res["median_busbw"]
        print(f"{name:16s} busbw median: hierarchical {mb['hierarchical'] / 1e6:7.1f} MB/s "
              f"({res['algos']['hierarchical']}), flat {mb['flat'] / 1e6:7.1f} MB/s "
              f"({res['algos']['flat']}); flat time / hierarchical time per round "
              f"{[round(x, 3) for x in res['ratios']]} median {res['median_ratio']:.3f}; "
              f"NIC bound (line rate) hierarchical {res['nic_bound_busbw']['hierarchical'] / 1e6:.0f} MB/s; "
              f"wrong results {res['wrong']}")
    print(f"hierarchical busbw with host 0's NIC 1 down / healthy: "
          f"{report['degraded_over_healthy_hier']:.3f} (what the surviving NIC allows: 0.5)")
    print(f"# wrote {out / 'testbed_hier.json'}")


def main():
    from r2comm.sim.predict import parse_size
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    rk = sub.add_parser("rank")
    for q in (p, rk):
        q.add_argument("--size", type=parse_size, default=64 << 20)
        q.add_argument("--rounds", type=int, default=5)
        q.add_argument("--iters", type=int, default=3)
    rk.add_argument("--json", required=True)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    if a.cmd == "rank":
        rank_main(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
