#!/usr/bin/env python3
"""Lose a rank on the netns testbed (issue 44): SIGKILL of one host's rank to the survivors'
first allreduce on the shrunk communicator, phase by phase, over real (veth) NICs.

    sudo .venv/bin/python bench/testbed_shrink.py [--hosts 4] [--nics 2] [--runs 3]

--hosts hosts x --nics NICs at --rate, one rank per host, each started by this script in its
host's namespace (`python -m r2comm.testbed exec --host H`) and bootstrapped through a DirStore
(no MPI: MPICH's mpiexec -disable-auto-cleanup still killed the survivors in some runs here,
silently, so the launcher would have been measured too). The ranks loop 64 KiB allreduces; the last
host's rank SIGKILLs itself 50 ms after its 50th (inside a later one). Every survivor then:
detect (its allreduce raises), Revoke, Agree, Shrink, the first allreduce on the shrunk
communicator (checked exact). Per run, each phase ends when the last survivor ended it (one
machine: one clock for every namespace); medians over --runs jobs in one fabric. Writes
--out/testbed_shrink.json."""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
PHASES = ("detect", "revoke", "agree", "shrink", "first allreduce")


def rank_main(args):
    import numpy as np
    import r2comm
    from r2comm.control.bootstrap_store import DirStore
    store = DirStore(os.path.join(args.out, f"shrink.store.{args.run}"), timeout=60)
    comm = r2comm.Communicator.from_store(store, args.rank_of, args.hosts, timeout=20)
    victim = comm.size - 1
    x, y = np.ones(1 << 14, np.float32), np.empty(1 << 14, np.float32)
    for i in range(1000000):
        if comm.rank == victim and i == 50:
            def die():
                with open(os.path.join(args.out, f"shrink.kill.{args.run}"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(0.05, die).start()
        try:
            comm.Allreduce(x, y)
        except r2comm.R2commError:
            break
    t = {"detect": time.time()}
    mark = os.path.join(args.out, f"shrink.mark{comm.rank}.{args.run}")
    with open(mark, "w") as f:
        f.write("detected")
    comm.Revoke()
    t["revoke"] = time.time()
    comm.Agree(1)
    t["agree"] = time.time()
    with open(mark, "w") as f:
        f.write("agreed")
    new = comm.Shrink()
    t["shrink"] = time.time()
    out = np.empty(4, np.int64)
    new.Allreduce(np.full(4, comm.rank, np.int64), out)
    t["first allreduce"] = time.time()
    t["exact"] = bool(out[0] == sum(new.channel.global_ranks()))
    t["members"] = new.channel.global_ranks()
    with open(os.path.join(args.out, f"shrink.rank{comm.rank}.{args.run}.json"), "w") as f:
        json.dump(t, f)
    new.Barrier()                          # every survivor wrote its file before any exits
    os._exit(0)


def launch(fab, args, run):
    """One job: a process per host, in its namespace; returns their Popens."""
    return [subprocess.Popen([sys.executable, "-m", "r2comm.testbed", "exec", "--fabric", fab.tag,
                              "--host", str(h), "--", sys.executable, os.path.abspath(__file__),
                              "--rank", "--rank-of", str(h), "--hosts", str(args.hosts),
                              "--run", str(run), "--out", args.out],
                             env=dict(os.environ, PYTHONPATH=ROOT, R2COMM_PROBE="0"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for h in range(args.hosts)]


def one_run(fab, args, run):
    for f in os.listdir(args.out):
        if f.startswith("shrink.") and (f.endswith(f".{run}.json") or f == f"shrink.kill.{run}"):
            os.remove(os.path.join(args.out, f))
    shutil.rmtree(os.path.join(args.out, f"shrink.store.{run}"), ignore_errors=True)
    procs = launch(fab, args, run)
    text = ""
    for p in procs:
        try:
            text += p.communicate(timeout=120)[0][-2000:]
        except subprocess.TimeoutExpired:
            p.kill()
            text += p.communicate(timeout=10)[0][-2000:]
    if not os.path.exists(os.path.join(args.out, f"shrink.kill.{run}")):
        raise RuntimeError(f"run {run}: the victim never died:\n{text[-3000:]}")
    with open(os.path.join(args.out, f"shrink.kill.{run}")) as f:
        t_kill = float(f.read())
    recs = []
    for r in range(args.hosts - 1):
        try:
            with open(os.path.join(args.out, f"shrink.rank{r}.{run}.json")) as f:
                recs.append(json.load(f))
        except OSError:
            raise RuntimeError(f"run {run}: survivor {r} wrote nothing:\n{text[-3000:]}") \
                from None
    if not all(rec["exact"] and rec["members"] == list(range(args.hosts - 1)) for rec in recs):
        raise RuntimeError(f"run {run}: a survivor's shrunk allreduce or members were wrong: "
                           f"{recs}")
    out, prev = {}, 0.0
    for k in PHASES:
        end = max(rec[k] for rec in recs) - t_kill
        out[k], prev = end - prev, end
    out["total"] = prev
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rank-of", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--nics", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.rank:
        return rank_main(args)
    from r2comm.testbed import Fabric
    with Fabric(hosts=args.hosts, nics=args.nics, rate=args.rate,
                tag=f"sk{os.getpid() % 10000}") as fab:
        runs = [one_run(fab, args, k) for k in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in PHASES + ("total",)}
    res = {"hosts": args.hosts, "nics": args.nics, "rate": args.rate, "runs": runs,
           "median": med}
    with open(os.path.join(args.out, "testbed_shrink.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k in range(args.runs):
        shutil.rmtree(os.path.join(args.out, f"shrink.store.{k}"), ignore_errors=True)
    print(f"SIGKILL of 1 of {args.hosts} ranks (one per host, {args.nics} x {args.rate} NICs), "
          f"medians over {args.runs} jobs (ms since the kill; each phase ends when the last "
          f"survivor ended it)")
    for k in PHASES + ("total",):
        print(f"{k:<18}{med[k] * 1e3:>10.1f}   runs: "
              + " ".join(f"{r[k] * 1e3:.1f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
