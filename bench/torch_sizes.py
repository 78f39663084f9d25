#!/usr/bin/env python3
"""all_reduce time per size, r2comm's torch backend against Gloo, from separate torchrun jobs
(one per backend and round, alternating, 2 ranks on this host by default).

    python bench/torch_sizes.py [--nproc 2] [--rounds 3] [--max-mib 64]

Each job times dist.all_reduce (SUM, float32) of 8 B .. 64 MiB: per size, a warm-up, then
enough calls to fill about --budget-s seconds (at least 3), rank 0's mean time per call. The
table gives, per size, each backend's median over rounds and the ratio r2comm / Gloo. With
R2COMM_SHM unset r2comm's ranks on one host talk through shared memory; R2COMM_SHM=0 puts
them on TCP loopback like Gloo. A benchmark, not a test: the machine's load moves the numbers."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sizes(max_mib):
    """8 B .. 256 KiB by x8, then 1 MiB .. max_mib by x4."""
    small = [8 << (3 * i) for i in range(6)]
    large = [1 << (20 + 2 * i) for i in range(8) if 1 << (20 + 2 * i) <= max_mib << 20]
    return small + large


def worker(backend, max_mib, budget_s):
    """Run under torchrun: print `SIZES {json}` (bytes -> seconds per call) on rank 0."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    import r2comm.torch  # noqa: F401  (registers "r2comm")
    dist.init_process_group(backend)
    result = {}
    for nbytes in sizes(max_mib):
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        one = time.perf_counter() - t0
        iters = torch.tensor([max(3, min(20000, int(budget_s / max(one, 1e-7))))])
        dist.broadcast(iters, 0)                # every rank makes the same number of calls
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(int(iters)):
            dist.all_reduce(t)
        result[nbytes] = (time.perf_counter() - t0) / int(iters)
    if dist.get_rank() == 0:
        print("SIZES " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def one_job(backend, nproc, max_mib, budget_s, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", backend, "--max-mib", str(max_mib), "--budget-s", str(budget_s)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SIZES ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{backend} job failed (rc {p.returncode}):\n{p.stdout[-3000:]}")
    return {int(k): v for k, v in json.loads(lines[-1][6:]).items()}


def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_time(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["r2comm", "gloo"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=0.5)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.max_mib, args.budget_s)
    from r2comm.ports import free_port
    runs = {"r2comm": [], "gloo": []}
    for _ in range(args.rounds):
        for backend in runs:
            runs[backend].append(one_job(backend, args.nproc, args.max_mib, args.budget_s,
                                         free_port()))
    print(f"all_reduce float32 SUM, {args.nproc} ranks on one host, median of {args.rounds} "
          f"jobs per backend (R2COMM_SHM={os.environ.get('R2COMM_SHM', 'unset')})")
    print(f"{'size':>8} {'r2comm':>10} {'gloo':>10} {'r2comm/gloo':>12}")
    for n in sizes(args.max_mib):
        med = {b: statistics.median(r[n] for r in runs[b]) for b in runs}
        print(f"{fmt_size(n):>8} {fmt_time(med['r2comm']):>10} {fmt_time(med['gloo']):>10} "
              f"{med['r2comm'] / med['gloo']:>12.2f}")


if __name__ == "__main__":
    main()
