#!/usr/bin/env python3
"""Lose a rank, not the job (issue 44): what it costs, phase by phase.

    python bench/shrink.py --ranks 16 --runs 5

Each run starts RANKS processes on this host (tests/shrink_worker.py, bootstrapped through a
DirStore: no MPI, so survivors live on) that loop 8 KiB allreduces; one rank (a different one
each run) SIGKILLs itself 0.5 s in, inside an allreduce. Every survivor then: detect (its
allreduce raises), Revoke, Agree, Shrink, and the first allreduce on the shrunk communicator.
Per run, each phase ends when the LAST survivor ended it (times since the kill, across
processes by the wall clock of this one host); the table gives the medians over runs, once
with R2COMM_SHM=0 (TCP between the ranks) and once by default (shared memory).

Then the model: the agreement's message delays and peers per rank without failures, from the
protocol itself (r2comm.control.recovery.Agreement in lockstep rounds: a pure function of n),
at 16, 1,024 and 8,192 ranks. Shrink is one agreement plus local work (its plans are made on
first use), so its rounds are the agreement's."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from r2comm.control import recovery  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "shrink_worker.py")
PHASES = (("detect", "t_detect"), ("revoke", "t_revoke"), ("agree", "t_agree"),
          ("shrink", "t_shrink"), ("first allreduce", "t_first"))


def one_run(n, victim, env, limit=120):
    d = tempfile.mkdtemp(prefix="r2shrink")
    try:
        with open(os.path.join(d, "plan.json"), "w") as f:
            json.dump({"timeout": 20, "rounds": [{"coll": "allreduce",
                                                  "victims": [[victim, "coll", 0.5]]}]}, f)
        procs = [subprocess.Popen([sys.executable, WORKER, d, str(r), str(n)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for r in range(n)]
        until = time.monotonic() + limit
        for p in procs:
            try:
                p.wait(max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        with open(os.path.join(d, f"kill.{victim}")) as f:
            t_kill = float(f.read())
        recs = []
        for r in range(n):
            if r == victim:
                continue
            with open(os.path.join(d, f"res.{r}.json")) as f:
                res = json.load(f)
            if not res.get("done"):
                raise RuntimeError(f"rank {r} did not finish: {res}")
            recs.append(res["rounds"][0])
        out, prev = {}, 0.0
        for name, key in PHASES:
            end = max(rec[key] for rec in recs) - t_kill
            out[name] = end - prev
            prev = end
        out["total"] = prev
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def model(n):
    """(message delays to the last decision, most peers of a rank) of one agreement over n
    ranks without failures, the machines run in lockstep rounds."""
    m = {r: recovery.Agreement(n, r, -1, 0, (), call=0) for r in range(n)}
    peers = {r: set() for r in range(n)}
    frontier = []
    for r in range(n):
        frontier += [(r, d, x) for d, x in m[r].start()]
    rounds = 0
    while frontier and not all(a.decided for a in m.values()):
        rounds += 1
        nxt = []
        for src, dst, x in frontier:
            peers[src].add(dst)
            nxt += [(dst, d, y) for d, y in m[dst].receive(src, x)]
        frontier = nxt
    return rounds, max(len(p) for p in peers.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="16,1024,8192")
    args = ap.parse_args()
    base = dict(os.environ, R2COMM_PROBE="0")
    cols = {}
    for label, extra in (("R2COMM_SHM=0", {"R2COMM_SHM": "0"}), ("default (shm)", {})):
        runs = [one_run(args.ranks, 1 + (i * 5) % (args.ranks - 1), dict(base, **extra))
                for i in range(args.runs)]
        cols[label] = {k: statistics.median(r[k] for r in runs)
                       for k in [p for p, _ in PHASES] + ["total"]}
        cols[label]["max total"] = max(r["total"] for r in runs)
    print(f"SIGKILL of 1 of {args.ranks} ranks on loopback, medians over {args.runs} runs "
          f"(ms; each phase ends when the last survivor ended it)")
    print(f"{'phase':<20}" + "".join(f"{c:>16}" for c in cols))
    for k in [p for p, _ in PHASES] + ["total", "max total"]:
        print(f"{k:<20}" + "".join(f"{cols[c][k] * 1e3:>16.1f}" for c in cols))
    print("\nagreement model (no failure): message delays, most peers of one rank")
    for n in (int(x) for x in args.model.split(",")):
        rounds, peers = model(n)
        print(f"  n = {n:>5}: {rounds:>3} message delays (4 x tree depth {n.bit_length() - 1}),"
              f" {peers} peers")


if __name__ == "__main__":
    main()
