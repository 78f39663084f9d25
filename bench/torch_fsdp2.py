#!/usr/bin/env python3
"""FSDP2 training step time on r2comm's torch backend against Gloo, in one torchrun job
(2 ranks on this host, CPU): the same small MLP, fully_shard per layer and at the root, once on
a DeviceMesh over the r2comm default group and once on one over a Gloo group of the same ranks,
trained side by side on the same batches.

    python bench/torch_fsdp2.py [--nproc 2] [--steps 30] [--width 1024] [--depth 4] [--json FILE]

Steps alternate between the two models, the first one turning from step to step; each step
(forward, backward: FSDP2's all-gathers and reduce-scatters, optimizer) is timed alone on
rank 0 after a barrier of its own group. The first --warmup steps are not counted. Reported:
each backend's median step, the median over steps of the pair's ratio r2comm / Gloo, and
whether the two runs' losses are bitwise equal (with 2 ranks a float sum does not depend on
the order of reduction). A benchmark, not a test."""
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


def model(width, depth, seed=0):
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def sharded(mesh, width, depth):
    """The model, fully_shard-ed per Linear and at the root over mesh, with its optimizer."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    m = model(width, depth)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.SGD(m.parameters(), lr=0.01)


def batch(rank, step, n, width):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, width, generator=g), torch.randn(n, 16, generator=g)


def one_step(m, opt, x, y):
    import torch.nn as nn
    loss = nn.functional.mse_loss(m(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def worker(args):
    """Run under torchrun: print `FSDP2 {json}` on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    import r2comm.torch  # noqa: F401  (registers "r2comm")
    torch.set_num_threads(1)
    dist.init_process_group("r2comm")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    meshes = {"r2comm": init_device_mesh("cpu", (size,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    groups = {"r2comm": None, "gloo": gloo}
    runs = {b: sharded(mesh, args.width, args.depth) for b, mesh in meshes.items()}
    losses, times = {b: [] for b in runs}, {b: [] for b in runs}
    names = list(runs)
    for step in range(args.warmup + args.steps):
        x, y = batch(rank, step, args.batch, args.width)
        for b in (names if step % 2 == 0 else names[::-1]):
            dist.barrier(group=groups[b])
            t0 = time.perf_counter()
            loss = one_step(*runs[b], x, y)
            took = time.perf_counter() - t0
            losses[b].append(loss)
            if step >= args.warmup:
                times[b].append(took)
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    if rank == 0:
        print("FSDP2 " + json.dumps({"step_s": times, "losses": losses, "params": params}),
              flush=True)
    dist.destroy_process_group()


def run_job(args, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=args.job_timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FSDP2 ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"FSDP2 job failed (rc {p.returncode}):\n{p.stdout[-3000:]}")
    return json.loads(lines[-1][6:])


def summary(got):
    """Medians, the paired ratio and the losses' equality of a worker's result."""
    t = got["step_s"]
    return {"r2comm_median_s": statistics.median(t["r2comm"]),
            "gloo_median_s": statistics.median(t["gloo"]),
            "ratio": statistics.median(a / b for a, b in zip(t["r2comm"], t["gloo"])),
            "losses_equal": got["losses"]["r2comm"] == got["losses"]["gloo"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--job-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the step times and losses here")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch
    from r2comm.control.ports import free_port
    load0, start = os.getloadavg()[0], time.monotonic()
    got = run_job(args, free_port())
    s = summary(got)
    print(f"FSDP2, {args.nproc} ranks, MLP {args.depth}x{args.width} ({got['params']} parameters, "
          f"{got['params'] * 4 >> 20} MiB float32), batch {args.batch}, {args.steps} steps")
    print(f"r2comm {s['r2comm_median_s'] * 1e3:.1f} ms/step, gloo {s['gloo_median_s'] * 1e3:.1f} "
          f"ms/step, r2comm/gloo {s['ratio']:.2f}; losses bitwise equal: {s['losses_equal']}")
    if args.json:
        argv = sys.argv[1:]
        env = {k: os.environ[k] for k in ("R2COMM_SHM",) if k in os.environ}
        doc = {"bench": "torch_fsdp2", "time": time.time(), "host": socket.gethostname(),
               "command": "".join(f"{k}={v} " for k, v in env.items())
               + "python bench/torch_fsdp2.py " + shlex.join(argv),
               "argv": argv, "env": env, "nproc": args.nproc, "steps": args.steps,
               "warmup": args.warmup, "width": args.width, "depth": args.depth,
               "batch": args.batch, "params": got["params"], "torch": torch.__version__,
               "loadavg": [load0, os.getloadavg()[0]], "seconds": time.monotonic() - start,
               "step_s": got["step_s"], "losses": got["losses"], "summary": s}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if s["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
