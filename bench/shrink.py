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
first use), so its rounds are the agreement's.

Then growing back (tests/grow_worker.py): one rank dies, the survivors shrink, a replacement
process this script launches once the victim is gone joins (Communicator.Grow / join through
the job's store), and rank 0 sends it --state-mib MiB of model state.

Against it, in the same run: restarting the job instead (RANKS - 1 fresh processes on this
host: interpreter, imports, a DirStore bootstrap, each rank reading a --ckpt-mib checkpoint of
the model from disk, the first allreduce), without what a real restart adds before that (the
scheduler noticing the failure, resubmitting, queueing: minutes) and with the checkpoint in
this host's page cache (just written), not on shared storage: a lower bound of a restart."""
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
RESTART = "restart + reload"
PHASES = (("detect", "t_detect"), ("revoke", "t_revoke"), ("agree", "t_agree"),
          ("shrink", "t_shrink"), ("first allreduce", "t_first"))


def wait_bounded(procs, until):
    """Wait for every process until time.monotonic() `until`; kill those still running."""
    for p in procs:
        try:
            p.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def one_run(n, victim, env, limit=120):
    d = tempfile.mkdtemp(prefix="r2shrink")
    try:
        with open(os.path.join(d, "plan.json"), "w") as f:
            json.dump({"timeout": 20, "rounds": [{"coll": "allreduce",
                                                  "victims": [[victim, "coll", 0.5]]}]}, f)
        procs = [subprocess.Popen([sys.executable, WORKER, d, str(r), str(n)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for r in range(n)]
        wait_bounded(procs, time.monotonic() + limit)
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


def restart_rank(d, rank, size, ckpt):
    """One rank of the restarted job (run as `shrink.py --restart-rank D RANK SIZE CKPT`): the
    imports, a DirStore bootstrap, the checkpoint read from disk, the first allreduce; writes
    the wall clock at the end to D/restart.<rank>."""
    import numpy as np
    import r2comm
    from r2comm.control.bootstrap_store import DirStore
    comm = r2comm.Communicator.from_store(DirStore(os.path.join(d, "store"), timeout=60),
                                          rank, size, timeout=20)
    state = np.load(ckpt)                     # every rank reloads the whole model (DDP)
    x = np.full(2048, float(state[0]), np.float32)
    comm.Allreduce(x, np.empty_like(x))
    with open(os.path.join(d, f"restart.{rank}"), "w") as f:
        f.write(repr(time.time()))
    os._exit(0)


def restart_run(n, env, ckpt, limit=120):
    """Seconds from launching a fresh job of n ranks (the survivors' count) to the last rank's
    first allreduce, each rank reading the checkpoint `ckpt`: a restart from a checkpoint on
    the same host, without the scheduler's detection and resubmission (minutes in practice)."""
    d = tempfile.mkdtemp(prefix="r2restart")
    try:
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--restart-rank",
                                   d, str(r), str(n), ckpt], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for r in range(n)]
        wait_bounded(procs, time.monotonic() + limit)
        ends = []
        for r in range(n):
            with open(os.path.join(d, f"restart.{r}")) as f:
                ends.append(float(f.read()))
        return max(ends) - t0
    finally:
        shutil.rmtree(d, ignore_errors=True)


GROW_WORKER = os.path.join(ROOT, "tests", "grow_worker.py")
GROW_PHASES = ("kill -> shrunk", "replacement launched", "grown (all joined)",
               "state received")


def grow_run(n, env, state_mib, limit=120):
    """One kill-and-grow-back cycle of n ranks (tests/grow_worker.py): seconds from the kill to
    the survivors' shrunk communicator, to the replacement's launch (this script starts it
    once the victim is gone, as a job manager would), to the grown communicator on every rank,
    and to the model state (state_mib MiB, a Bcast from rank 0) on every rank."""
    d = tempfile.mkdtemp(prefix="r2grow")
    try:
        with open(os.path.join(d, "plan.json"), "w") as f:
            json.dump({"cycles": [1], "timeout": 20, "state": state_mib << 17}, f)

        def spawn(*args):
            return subprocess.Popen([sys.executable, GROW_WORKER, d, str(n), *map(str, args)],
                                    env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        procs = [spawn("start", r) for r in range(n)]
        until = time.monotonic() + limit
        while not os.path.exists(os.path.join(d, "kill.0")) and time.monotonic() < until:
            time.sleep(0.005)
        t_launch = time.time()
        procs.append(spawn("join", 0))
        wait_bounded(procs, until)
        with open(os.path.join(d, "kill.0")) as f:
            t_kill = float(f.read())
        recs = []
        for tag in [str(r) for r in range(n) if r != 1] + ["j0"]:
            with open(os.path.join(d, f"res.{tag}.json")) as f:
                res = json.load(f)
            if not res.get("done"):
                raise RuntimeError(f"{tag} did not finish: {res}")
            recs.append(res["cycles"][0] if res["cycles"] else res)
        ends = [max(rec.get("t_shrunk", 0.0) for rec in recs), t_launch,
                max(rec["t_grown"] for rec in recs), max(rec["t_state"] for rec in recs)]
        return {name: end - t_kill for name, end in zip(GROW_PHASES, ends)}
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
    ap.add_argument("--state-mib", type=int, default=64,
                    help="the model state a replacement receives after growing back (MiB)")
    ap.add_argument("--ckpt-mib", type=int, default=256,
                    help="the model checkpoint a restarted job reads (MiB, float32)")
    ap.add_argument("--restart-rank", nargs=4, metavar=("DIR", "RANK", "SIZE", "CKPT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.restart_rank:
        d, r, n, ckpt = args.restart_rank
        restart_rank(d, int(r), int(n), ckpt)
    base = dict(os.environ, R2COMM_PROBE="0")
    import numpy as np
    ckdir = tempfile.mkdtemp(prefix="r2ckpt")
    ckpt = os.path.join(ckdir, "model.npy")
    np.save(ckpt, np.random.default_rng(0).standard_normal(args.ckpt_mib << 18,
                                                           dtype=np.float32))
    cols = {}
    try:
        for label, extra in (("R2COMM_SHM=0", {"R2COMM_SHM": "0"}), ("default (shm)", {})):
            env = dict(base, **extra)
            runs = [one_run(args.ranks, 1 + (i * 5) % (args.ranks - 1), env)
                    for i in range(args.runs)]
            restarts = [restart_run(args.ranks - 1, env, ckpt) for _ in range(args.runs)]
            cols[label] = {k: statistics.median(r[k] for r in runs)
                           for k in [p for p, _ in PHASES] + ["total"]}
            cols[label]["max total"] = max(r["total"] for r in runs)
            cols[label][RESTART] = statistics.median(restarts)
            grows = [grow_run(args.ranks, env, args.state_mib) for _ in range(args.runs)]
            for k in GROW_PHASES:
                cols[label][k] = statistics.median(g[k] for g in grows)
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    print(f"SIGKILL of 1 of {args.ranks} ranks on loopback, medians over {args.runs} runs "
          f"(ms; each phase ends when the last survivor ended it)")
    print(f"{'phase':<20}" + "".join(f"{c:>16}" for c in cols))
    for k in [p for p, _ in PHASES] + ["total", "max total"]:
        print(f"{k:<20}" + "".join(f"{cols[c][k] * 1e3:>16.1f}" for c in cols))
    print(f"\nagainst a restart (in the same run, median): a fresh job of {args.ranks - 1} ranks "
          f"launched, bootstrapped, each reading a {args.ckpt_mib} MiB checkpoint, to its first "
          f"allreduce (no scheduler detection or resubmission counted)")
    print(f"{RESTART:<20}" + "".join(f"{cols[c][RESTART] * 1e3:>16.1f}" for c in cols))
    print(f"{'restart / shrink':<20}" +
          "".join(f"{cols[c][RESTART] / cols[c]['total']:>15.1f}x" for c in cols))
    print(f"\ngrow back (tests/grow_worker.py): kill -> shrink -> a replacement launched once "
          f"the victim is gone joins (Grow/join) -> {args.state_mib} MiB of model state from "
          f"rank 0; times since the kill, medians")
    for k in GROW_PHASES:
        print(f"{k:<20}" + "".join(f"{cols[c][k] * 1e3:>16.1f}" for c in cols))
    print("\nagreement model (no failure): message delays, most peers of one rank")
    for n in (int(x) for x in args.model.split(",")):
        rounds, peers = model(n)
        print(f"  n = {n:>5}: {rounds:>3} message delays (4 x tree depth {n.bit_length() - 1}),"
              f" {peers} peers")


if __name__ == "__main__":
    main()
