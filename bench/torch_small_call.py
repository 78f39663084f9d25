"""Per-call time of an 8-byte all_reduce through the torch backend against the same
Communicator's Allreduce on numpy, in one torchrun job (2 ranks, one host); for reference in the
same job, the group's allreduce method called directly (what the backend costs without torch's
dist.all_reduce wrapper) and Gloo's 8-byte all_reduce (a Gloo group over the same ranks).

    torchrun --nproc-per-node 2 bench/torch_small_call.py [--iters 3000] [--rounds 8] [--json FILE]

Each round runs every path, the order rotating from round to round;
each call is timed alone and a round reports the median call (robust to the scheduling hiccups
of a shared host). The report gives the median over rounds of each path and the median over
rounds of the round's ratio torch / numpy (rank 0 prints it and writes --json). A benchmark,
not a test."""
import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers torch's "fake" backend)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm.torch  # noqa: E402,F401  (registers "r2comm")

NUMPY, TORCH, GLOO = "numpy Communicator.Allreduce", "torch dist.all_reduce", "gloo dist.all_reduce"
FLOOR = "fake dist.all_reduce"       # torch's own share: its fake backend does no communication
BACKEND = "backend pg.allreduce"     # the group's method called directly: torch's wrapper left out


def per_call(fn, iters, group=None):
    """The median time of one call, in microseconds."""
    clock = time.perf_counter
    took = []
    dist.barrier(group=group)
    for _ in range(iters):
        t0 = clock()
        fn()
        took.append(clock() - t0)
    return statistics.median(took) * 1e6


def record(args, times, ratios, loads):
    """The JSON document (what r2comm/bench/results_torchdist.py reads)."""
    argv = sys.argv[1:]
    return {"bench": "torch_small_call", "time": time.time(), "host": socket.gethostname(),
            "command": f"torchrun --nproc-per-node {dist.get_world_size()} "
                       "bench/torch_small_call.py " + shlex.join(argv),
            "argv": argv, "nproc": dist.get_world_size(), "iters": args.iters,
            "rounds": args.rounds, "bytes": 8, "torch": torch.__version__, "loadavg": loads,
            "env": {k: os.environ[k] for k in ("R2COMM_SHM",) if k in os.environ},
            "rounds_us": times, "ratio_torch_numpy": ratios}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-gloo", action="store_true", help="leave Gloo's path out")
    ap.add_argument("--json", help="write the per-round medians here (rank 0)")
    args = ap.parse_args()
    dist.init_process_group("r2comm")
    comm = r2comm.torch.communicator()
    arr = np.ones(2, dtype=np.float32)
    out = np.empty_like(arr)
    t = torch.ones(2, dtype=torch.float32)
    opts = dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False
    pg = dist.group.WORLD
    paths = {NUMPY: (lambda: comm.Allreduce(arr, out), None),
             TORCH: (lambda: dist.all_reduce(t), None),
             BACKEND: (lambda: pg.allreduce([t], opts).wait(), None)}
    # torch's share of every backend's call (Python wrapper, dispatcher, Work): the same call on
    # torch's fake backend, which returns at once
    fake = dist.new_group(backend="fake")
    tf = torch.ones(2, dtype=torch.float32)
    paths[FLOOR] = (lambda: dist.all_reduce(tf, group=fake), None)
    if not args.no_gloo:
        gloo = dist.new_group(backend="gloo")
        tg = torch.ones(2, dtype=torch.float32)
        paths[GLOO] = (lambda: dist.all_reduce(tg, group=gloo), gloo)
    for fn, group in paths.values():
        per_call(fn, 200, group)                       # warm-up
    names = list(paths)
    times, loads = {k: [] for k in names}, [os.getloadavg()[0]]
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn, group = paths[name]
            times[name].append(per_call(fn, args.iters, group))
        loads.append(os.getloadavg()[0])
    ratios = [a / b for a, b in zip(times[TORCH], times[NUMPY])]
    if dist.get_rank() == 0:
        for k, v in times.items():
            print(f"{k:32s} median {statistics.median(v):7.2f} us/call  "
                  f"rounds {[round(x, 2) for x in v]}")
        print(f"ratio torch/numpy {statistics.median(ratios):.2f} (median of the rounds' ratios)")
        own = [a - b for a, b in zip(times[TORCH], times[FLOOR])]
        print(f"r2comm's share of the torch call (torch minus fake) {statistics.median(own):.2f} us;"
              f" that share / numpy {statistics.median([o / b for o, b in zip(own, times[NUMPY])]):.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record(args, times, ratios, loads), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
