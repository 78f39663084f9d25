"""DDP training of a small transformer language model on r2comm (or Gloo), CPU, synthetic tokens.

    torchrun --nproc-per-node 4 examples/torch_ddp_lm.py                    # r2comm
    torchrun --nproc-per-node 4 examples/torch_ddp_lm.py --backend gloo     # the same on Gloo
    R2COMM_RAILS=127.0.0.1,127.0.0.2 torchrun --nproc-per-node 4 \\
        examples/torch_ddp_lm.py --fail-step 10 --restore-step 20           # a NIC fails, returns

The script is an ordinary DDP training loop: `import r2comm.torch` is the only r2comm line
(it registers the backend), plus the optional fault injection, which takes rank 1's rail 0 down
for real (its connections are shut) before --fail-step and brings it back before
--restore-step. The tokens follow a noisy affine rule (next = (a * token + b) mod vocab with
some random tokens), so the loss falls. Rank 0 prints each step's loss and time, then the
mean step time and a digest of the whole loss curve: runs with the same settings print the same
digest when their losses are bitwise identical (r2comm keeps its reduction order through
failures). --json PATH has rank 0 write the run as JSON (per-step losses and times, the
digest; written also when a collective fails, with the error), for benchmark drivers such as
bench/testbed_torch.py."""
import argparse
import datetime
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = {  # name: (vocab, d_model, heads, layers, ff, seq)
    "tiny": (512, 64, 2, 2, 256, 32),
    "small": (2048, 128, 4, 4, 512, 64),
    "base": (4096, 256, 4, 4, 1024, 128),
}


class LM(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        x = self.body(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def batch(gen, n, seq, vocab):
    """Sequences of the rule next = (a * t + b) % vocab, 10% of tokens replaced at random."""
    a = 5 if vocab % 5 else 7
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    cols = [start]
    for _ in range(seq):
        cols.append((cols[-1] * a + 3) % vocab)
    toks = torch.cat(cols, 1)
    noise = torch.rand(toks.shape, generator=gen) < 0.1
    toks = torch.where(noise, torch.randint(0, vocab, toks.shape, generator=gen), toks)
    return toks[:, :-1], toks[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="r2comm", help="r2comm (default) or gloo")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP gradient bucket (MiB)")
    p.add_argument("--fail-step", type=int, default=-1, help="rank 1 takes its rail 0 down")
    p.add_argument("--restore-step", type=int, default=-1, help="... and brings it back")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may take (init_process_group's timeout)")
    p.add_argument("--json", default=None, help="rank 0 writes the run here")
    args = p.parse_args()

    if args.backend == "r2comm":
        import r2comm.torch  # noqa: F401  (registers the backend)
    kw = {"timeout": datetime.timedelta(seconds=args.timeout)} if args.timeout else {}
    dist.init_process_group(args.backend, **kw)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    vocab, d, heads, layers, ff, seq = SIZES[args.size]
    torch.manual_seed(0)
    model = DDP(LM(vocab, d, heads, layers, ff, seq), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    nparams = sum(p.numel() for p in model.parameters())
    comm = r2comm.torch.communicator() if args.backend == "r2comm" else None
    if rank == 0:
        rails = f", {len(comm.rails)} rail(s) per rank" if comm is not None else ""
        print(f"[lm] {args.backend}: {size} ranks{rails}, {nparams / 1e6:.2f} M parameters "
              f"({nparams * 4 / 2**20:.1f} MiB of gradients per step, buckets of "
              f"{args.bucket_mb:g} MiB), {args.batch} x {seq} tokens per rank", flush=True)
    gen = torch.Generator().manual_seed(1234 + rank)
    losses, times, ends = [], [], []
    record = {"backend": args.backend, "size": args.size, "ranks": size, "batch": args.batch,
              "seq": seq, "bucket_mb": args.bucket_mb, "params": nparams,
              "grad_bytes": nparams * 4, "steps": args.steps, "losses": losses,
              "step_s": times, "step_end": ends, "error": None}
    try:
        train(args, model, opt, comm, gen, rank, size, vocab, seq, losses, times, ends)
    except Exception as exc:  # a collective failed or timed out: keep what was measured
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if rank == 0 and args.json:
            write_json(args.json, record, losses, comm)
        raise
    steady = sorted(times[2:]) or times
    digest = hashlib.sha256(" ".join(v.hex() for v in losses).encode()).hexdigest()[:16]
    if rank == 0:
        print(f"[lm] done: loss {losses[0]:.4f} -> {losses[-1]:.4f} (uniform would be "
              f"{math.log(vocab):.2f}); step time mean {sum(steady) / len(steady) * 1e3:.1f} ms, "
              f"median {steady[len(steady) // 2] * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
              f"loss-curve digest {digest}", flush=True)
        if args.json:
            write_json(args.json, record, losses, comm)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


def write_json(path, record, losses, comm):
    record["loss_hex"] = [v.hex() for v in losses]
    record["digest"] = hashlib.sha256(" ".join(record["loss_hex"]).encode()).hexdigest()[:16]
    if comm is not None:  # rank 0's view of its rails and of the failover events
        record["rails"] = [{"address": r.address, "state": r.state, "failures": r.failures,
                            "bytes_sent": r.bytes_sent} for r in comm.rails]
        kinds = {}
        for e in comm.events:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        record["event_kinds"] = kinds
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def train(args, model, opt, comm, gen, rank, size, vocab, seq, losses, times, ends):
    for step in range(args.steps):
        if comm is not None and rank == 1 and step == args.fail_step:
            print(f"[lm] rank 1: taking rail 0 down before step {step}", flush=True)
            comm.fail_rail(0, "hard")
        if comm is not None and rank == 1 and step == args.restore_step:
            print(f"[lm] rank 1: bringing rail 0 back before step {step}", flush=True)
            comm.restore_rail(0)
        x, y = batch(gen, args.batch, seq, vocab)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= size
        times.append(time.perf_counter() - t0)
        ends.append(time.time())
        losses.append(mean.item())
        if rank == 0 and not args.quiet:
            print(f"[lm] step {step:3d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
