"""Tensor-parallel style decoding on r2comm: per token, per layer, an allreduce of the hidden
state across the ranks; a NIC fails mid-stream. Prints per-token latency p50/p99 before, during
and after the failure.

    R2COMM_RAILS=127.0.0.1,127.0.0.2 torchrun --nproc-per-node 2 examples/torch_tp_serving.py
    python -m r2comm.testbed torchrun --nproc-per-node 1 -- examples/torch_tp_serving.py \\
        --no-inject          # on the testbed, take a NIC down from another shell instead

Each rank holds a 1/size column shard of every layer's weight (a row-parallel linear layer, as
in Megatron-style tensor parallelism): the partial outputs are summed by an allreduce of
batch x hidden floats (--hidden 2048, --batch 4: 32 KiB) per layer. With injection (default)
rank 1 fails its rail 0 for real at token --fail-token and restores it at --restore-token; the
phases are: before the failure, while the rail is down, after it is back. Rank 0 prints a
checksum of the outputs: a run with a failure prints the same one as a run without. With
--no-inject, rank 0 prints "[serve] at token N" when it reaches --fail-token and
--restore-token (and "[serve] mark N " every --mark-every tokens), so whoever takes the NIC
down can follow the stream; --json PATH has rank 0
write every token's start time and latency (bench/testbed_torch.py splits the phases by the
times of the real fault)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="r2comm")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--fail-token", type=int, default=100)
    p.add_argument("--restore-token", type=int, default=200)
    p.add_argument("--no-inject", action="store_true", help="no fail_rail (testbed: nic-down)")
    p.add_argument("--mark-every", type=int, default=0,
                   help="with --no-inject, rank 0 also prints '[serve] mark N ' every N tokens")
    p.add_argument("--json", default=None, help="rank 0 writes per-token times here")
    args = p.parse_args()
    if args.backend == "r2comm":
        import r2comm.torch  # noqa: F401
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = r2comm.torch.communicator() if args.backend == "r2comm" else None
    torch.manual_seed(rank)
    shard = args.hidden // size
    weights = [torch.randn(shard, args.hidden) / args.hidden ** 0.5 for _ in range(args.layers)]
    h = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(7))
    lat, starts, outs = [], [], []
    for tok in range(args.tokens):
        if comm is not None and not args.no_inject and rank == 1:
            if tok == args.fail_token:
                comm.fail_rail(0, "hard")
            if tok == args.restore_token:
                comm.restore_rail(0)
        if args.no_inject and rank == 0 and tok in (args.fail_token, args.restore_token):
            print(f"[serve] at token {tok}", flush=True)
        if args.no_inject and rank == 0 and args.mark_every and tok % args.mark_every == 0:
            print(f"[serve] mark {tok} ", flush=True)
        starts.append(time.time())
        t0 = time.perf_counter()
        x = h
        for w in weights:
            part = x[:, rank * shard:(rank + 1) * shard] @ w      # row-parallel: partial sums
            dist.all_reduce(part)
            x = torch.tanh(part)
        lat.append(time.perf_counter() - t0)
        outs.append(x[0, :4].clone())
        h = x
    dist.barrier()
    phases = {"before": lat[10:args.fail_token],
              "during": lat[args.fail_token:args.restore_token],
              "after": lat[args.restore_token:]}
    if rank == 0:
        kib = args.batch * args.hidden * 4 / 1024
        print(f"[serve] {args.backend}: {size} ranks, {args.layers} layers x allreduce of "
              f"{kib:g} KiB per token, {args.tokens} tokens", flush=True)
        base = pct(phases["before"], 99)
        for name, xs in phases.items():
            if xs:
                print(f"[serve] {name:>6}: p50 {pct(xs, 50) * 1e3:7.2f} ms   p99 "
                      f"{pct(xs, 99) * 1e3:7.2f} ms   (p99 {pct(xs, 99) / base - 1:+.1%} vs "
                      f"before)", flush=True)
        digest = torch.stack(outs).double().sum().item()
        print(f"[serve] output checksum {digest.hex()}", flush=True)
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump({"backend": args.backend, "ranks": size, "layers": args.layers,
                           "allreduce_bytes": args.batch * args.hidden * 4,
                           "tokens": args.tokens, "fail_token": args.fail_token,
                           "restore_token": args.restore_token, "token_start": starts,
                           "token_s": lat, "checksum": digest.hex()}, f)
            os.replace(args.json + ".tmp", args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
