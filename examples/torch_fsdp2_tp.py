"""FSDP2 x tensor-parallel training on r2comm (or Gloo), CPU, synthetic data: the modern stack.

    torchrun --nproc-per-node 4 examples/torch_fsdp2_tp.py                  # r2comm, 2 x 2 mesh
    torchrun --nproc-per-node 4 examples/torch_fsdp2_tp.py --backend gloo   # the same on Gloo
    R2COMM_RAILS=127.0.0.1,127.0.0.2 torchrun --nproc-per-node 4 \\
        examples/torch_fsdp2_tp.py --fail-step 10 --restore-step 20         # a NIC fails, returns

An ordinary FSDP2 + TP script: a DeviceMesh ("dp", "tp") over the world (tp = --tp consecutive
ranks, the ranks of one host under torchrun; dp across hosts), an MLP whose Linear pairs are
column- and row-parallel over "tp" (parallelize_module), the whole model fully_shard-ed over
"dp". `import r2comm.torch` is the only r2comm line (it registers the backend), plus the optional
fault injection, which takes rank 1's rail 0 down for real before --fail-step and brings it back
before --restore-step. Rank 0 prints each step's mean loss and time and, at the end, a digest of
the loss curve: runs with the same settings print the same digest when their losses are bitwise
identical. --json PATH has rank 0 write the run (per-step losses and times, the digest; also when
a collective fails, with the error) for bench/testbed_torch.py."""
import argparse
import datetime
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def build(mesh, width, depth):
    """The MLP: `depth` pairs of (column-parallel Linear, ReLU, row-parallel Linear) over "tp",
    then fully_shard per pair and at the root over "dp"; SGD with momentum."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
              for _ in range(depth)]
    model = nn.Sequential(*blocks)
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="r2comm", choices=("r2comm", "gloo"))
    p.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="samples per data-parallel rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail-step", type=int, default=-1, help="rank 1 fails its rail 0 here")
    p.add_argument("--restore-step", type=int, default=-1, help="... and restores it here")
    p.add_argument("--timeout", type=float, default=None, help="seconds a collective may take")
    p.add_argument("--json", default=None, help="rank 0 writes the run here")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    args = p.parse_args()

    if args.backend == "r2comm":
        import r2comm.torch  # noqa: F401  (registers the backend)
    from torch.distributed.device_mesh import init_device_mesh
    kw = {"timeout": datetime.timedelta(seconds=args.timeout)} if args.timeout else {}
    dist.init_process_group(args.backend, **kw)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if size % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide {size} ranks")
    mesh = init_device_mesh("cpu", (size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model, opt = build(mesh, args.width, args.depth)
    nparams = args.depth * (4 * args.width ** 2 + 3 * args.width)    # the unsharded model's
    comm = r2comm.torch.communicator() if args.backend == "r2comm" else None
    if rank == 0:
        print(f"[fsdp] {args.backend}: {size} ranks, mesh dp {size // args.tp} x tp {args.tp}, "
              f"{nparams / 1e6:.2f} M parameters, batch {args.batch} per dp rank", flush=True)
    losses, times, ends = [], [], []
    record = {"backend": args.backend, "ranks": size, "tp": args.tp, "width": args.width,
              "depth": args.depth, "batch": args.batch, "params": nparams, "steps": args.steps,
              "losses": losses, "step_s": times, "step_end": ends, "error": None}
    try:
        train(args, model, opt, comm, mesh, rank, losses, times, ends)
    except Exception as exc:  # a collective failed or timed out: keep what was measured
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if rank == 0 and args.json:
            write_json(args.json, record, comm)
        raise
    steady = sorted(times[2:]) or times
    if rank == 0:
        digest = write_json(args.json, record, comm) if args.json else _digest(losses)
        print(f"[fsdp] done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; step time median "
              f"{steady[len(steady) // 2] * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
              f"loss-curve digest {digest}", flush=True)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


def _digest(losses):
    return hashlib.sha256(" ".join(v.hex() for v in losses).encode()).hexdigest()[:16]


def write_json(path, record, comm):
    """Rank 0's record (with the loss digest and its view of the rails and events) -> digest."""
    record["loss_hex"] = [v.hex() for v in record["losses"]]
    record["digest"] = _digest(record["losses"])
    if comm is not None:
        kinds = {}
        for e in comm.events:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        record["event_kinds"] = kinds
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return record["digest"]


def train(args, model, opt, comm, mesh, rank, losses, times, ends):
    dp = mesh.get_local_rank("dp")
    gen = torch.Generator().manual_seed(1234 + dp)       # the same data across one tp group
    target = torch.randn(args.width, args.width, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        if comm is not None and rank == 1 and step == args.fail_step:
            print(f"[fsdp] rank 1: taking rail 0 down before step {step}", flush=True)
            comm.fail_rail(0, "hard")
        if comm is not None and rank == 1 and step == args.restore_step:
            print(f"[fsdp] rank 1: bringing rail 0 back before step {step}", flush=True)
            comm.restore_rail(0)
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.tanh(x @ target / args.width ** 0.5)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        times.append(time.perf_counter() - t0)
        ends.append(time.time())
        losses.append(mean.item())
        if rank == 0 and not args.quiet:
            print(f"[fsdp] step {step:3d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
