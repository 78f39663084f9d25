"""Per-call time of an 8-byte all_reduce through the torch backend against the same
Communicator's Allreduce on numpy, in one torchrun job (2 ranks, one host).

    torchrun --nproc-per-node 2 bench/torch_small_call.py [--iters 3000] [--rounds 5]

Rounds alternate the two paths; each call is timed alone and each round reports the median
call (robust to the scheduling hiccups of a shared host), the report the median over rounds
(rank 0 prints it). A benchmark, not a test."""
import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import r2comm.torch  # noqa: F401  (registers "r2comm")


def per_call(fn, iters):
    """The median time of one call, in microseconds."""
    clock = time.perf_counter
    took = []
    dist.barrier()
    for _ in range(iters):
        t0 = clock()
        fn()
        took.append(clock() - t0)
    return statistics.median(took) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("r2comm")
    comm = dist.group.WORLD.comm
    arr = np.ones(2, dtype=np.float32)
    out = np.empty_like(arr)
    t = torch.ones(2, dtype=torch.float32)
    paths = {"numpy Communicator.Allreduce": lambda: comm.Allreduce(arr, out),
             "torch dist.all_reduce": lambda: dist.all_reduce(t)}
    for fn in paths.values():
        per_call(fn, 200)                       # warm-up
    times = {k: [] for k in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            times[name].append(per_call(fn, args.iters))
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:32s} median {v:7.2f} us/call  rounds {[round(x, 2) for x in times[k]]}")
        ratio = med["torch dist.all_reduce"] / med["numpy Communicator.Allreduce"]
        print(f"ratio torch/numpy {ratio:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
