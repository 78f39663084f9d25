#!/usr/bin/env python3
"""Time per call of torch.distributed collectives per message size, r2comm's backend against
Gloo, from separate torchrun jobs (one per backend and round; each round runs both backends,
the first one alternating from round to round), 2 ranks on this host by default.

    python bench/torch_sizes.py [--nproc 2] [--rounds 3] [--max-mib 64] [--json FILE]

Each job times all_reduce (SUM), all_gather_into_tensor and reduce_scatter_tensor (SUM) of
float32 tensors of 8 B .. --max-mib MiB (the size is the whole tensor: all_reduce's, the
gathered output, the scattered input): per size, a warm-up, then enough calls to fill about
--budget-s seconds (at least 3), rank 0's mean time per call. The table gives, per size, each
backend's median over rounds and the median over rounds of the round's ratio r2comm / Gloo.
With R2COMM_SHM unset r2comm's ranks on one host talk through shared memory; R2COMM_SHM=0 puts
them on TCP loopback like Gloo. A benchmark, not a test: the machine's load moves the numbers."""
import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
BACKENDS = ("r2comm", "gloo")


def sizes(max_mib):
    """8 B .. 256 KiB by x8, then 1 MiB .. max_mib by x4."""
    small = [8 << (3 * i) for i in range(6)]
    large = [1 << (20 + 2 * i) for i in range(8) if 1 << (20 + 2 * i) <= max_mib << 20]
    return small + large


def _call(op, nbytes, nranks):
    """A function making one call of OP on a float32 tensor of about nbytes (the whole tensor;
    at least one element per rank)."""
    import torch
    import torch.distributed as dist
    n = max(nranks, nbytes // 4)
    n -= n % nranks
    if op == "all_reduce":
        t = torch.ones(n, dtype=torch.float32)
        return lambda: dist.all_reduce(t)
    whole, part = torch.ones(n, dtype=torch.float32), torch.ones(n // nranks, dtype=torch.float32)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, part)
    return lambda: dist.reduce_scatter_tensor(part, whole)


def _time_calls(call, budget_s):
    """Mean seconds per call of `call` over about budget_s (every rank makes as many calls)."""
    import torch
    import torch.distributed as dist
    for _ in range(3):
        call()
    dist.barrier()
    t0 = time.perf_counter()
    call()
    one = time.perf_counter() - t0
    iters = torch.tensor([max(3, min(20000, int(budget_s / max(one, 1e-7))))])
    dist.broadcast(iters, 0)                # every rank makes the same number of calls
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(int(iters)):
        call()
    return (time.perf_counter() - t0) / int(iters)


def worker(backend, ops, max_mib, budget_s):
    """Run under torchrun: print `SIZES {json}` ({op: {bytes: seconds per call}}) on rank 0."""
    import torch.distributed as dist
    import r2comm.torch  # noqa: F401  (registers "r2comm")
    dist.init_process_group(backend)
    nranks = dist.get_world_size()
    result = {op: {n: _time_calls(_call(op, n, nranks), budget_s) for n in sizes(max_mib)}
              for op in ops}
    if dist.get_rank() == 0:
        print("SIZES " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def one_job(backend, args, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", backend, "--ops", ",".join(args.ops), "--max-mib", str(args.max_mib),
           "--budget-s", str(args.budget_s)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=args.job_timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SIZES ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{backend} job failed (rc {p.returncode}):\n{p.stdout[-3000:]}")
    return {op: {int(k): v for k, v in by.items()} for op, by in json.loads(lines[-1][6:]).items()}


def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_time(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def paired_ratio(runs, op, n):
    """The median over rounds of the round's r2comm / Gloo time."""
    return statistics.median(a[op][n] / b[op][n] for a, b in zip(runs["r2comm"], runs["gloo"]))


def print_table(args, runs):
    print(f"float32, {args.nproc} ranks on one host, {args.rounds} rounds of one torchrun job per "
          f"backend (R2COMM_SHM={os.environ.get('R2COMM_SHM', 'unset')})")
    for op in args.ops:
        print(f"{op}\n{'size':>8} {'r2comm':>10} {'gloo':>10} {'r2comm/gloo':>12}")
        for n in sizes(args.max_mib):
            med = {b: statistics.median(r[op][n] for r in runs[b]) for b in BACKENDS}
            print(f"{fmt_size(n):>8} {fmt_time(med['r2comm']):>10} {fmt_time(med['gloo']):>10} "
                  f"{paired_ratio(runs, op, n):>12.2f}")


def record(args, runs, orders, loads, took):
    """The JSON document of a run (what r2comm/bench/results_torchdist.py reads)."""
    import torch
    argv = sys.argv[1:]
    env = {k: os.environ[k] for k in ("R2COMM_SHM", "R2COMM_RAILS") if k in os.environ}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    return {"bench": "torch_sizes", "time": time.time(), "host": socket.gethostname(),
            "command": prefix + "python bench/torch_sizes.py " + shlex.join(argv),
            "argv": argv, "env": env, "nproc": args.nproc, "rounds": args.rounds,
            "budget_s": args.budget_s, "ops": list(args.ops), "sizes": sizes(args.max_mib),
            "torch": torch.__version__, "dtype": "float32", "order": orders, "loadavg": loads,
            "seconds": took,
            "runs": {b: [{op: {str(n): s for n, s in by.items()} for op, by in r.items()}
                         for r in runs[b]] for b in BACKENDS}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=BACKENDS)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=0.3)
    ap.add_argument("--ops", default=",".join(OPS), type=lambda s: [o for o in s.split(",") if o],
                    help="comma-separated, of " + ", ".join(OPS))
    ap.add_argument("--job-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the per-round times here")
    args = ap.parse_args()
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        ap.error(f"--ops: unknown {bad}; choose from {', '.join(OPS)}")
    if args.worker:
        return worker(args.worker, args.ops, args.max_mib, args.budget_s)
    from r2comm.control.ports import free_port
    runs, orders, loads = {b: [] for b in BACKENDS}, [], [os.getloadavg()[0]]
    start = time.monotonic()
    for i in range(args.rounds):
        order = BACKENDS if i % 2 == 0 else BACKENDS[::-1]    # both orders, in turn
        orders.append(list(order))
        for backend in order:
            runs[backend].append(one_job(backend, args, free_port()))
        loads.append(os.getloadavg()[0])
    print_table(args, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record(args, runs, orders, loads, time.monotonic() - start), f, indent=1)


if __name__ == "__main__":
    main()
