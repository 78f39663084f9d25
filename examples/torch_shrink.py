"""Lose a rank, not the job: DDP training on 4 CPU ranks in which one rank SIGKILLs itself in
the middle of a step's backward (inside DDP's gradient allreduce), and the 3 survivors revoke,
agree, shrink (r2comm.torch.shrink), rebuild DDP on the new group, redo the interrupted step and
train on. The launcher restarts the killed rank; the new process joins (r2comm.torch.join) as
the survivors grow the group back to 4 (r2comm.torch.grow) at the first step where it is ready
(waiting for it at step --regrow-by at the latest), receives the model and optimiser state from
rank 0, and the 4 train on to the end. A reference then replays the same world sizes with no
failure (4 ranks up to the kill's step; rank 0 saves the model and optimiser state there; a
fresh 3-rank job loads it and runs to the growth's step and saves; a fresh 4-rank job loads
that and runs the rest) and the losses are compared bit for bit.

    python examples/torch_shrink.py                    # both runs, compared (exit 1 if unequal)
    python examples/torch_shrink.py --steps 12 --kill-step 5 --victim 1 --regrow-by 8
    python examples/torch_shrink.py --regrow-by -1     # shrink only: the 3 go on to the end

Not torchrun: its elastic agent stops every worker when one dies. The launcher here starts the
ranks as subprocesses and hosts the TCPStore they meet through (so the store outlives any rank),
as MPICH's `mpiexec -disable-auto-cleanup` would let survivors live on too.

Each rank's batch is a function of (step, its rank in the current world) only; the model starts
from one seed. The losses printed are the mean of the ranks' losses (an all_reduce)."""
import argparse
import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

DIM, HIDDEN, BATCH = 32, 64, 16


def say(line):
    """Print one line in one write: the ranks share the launcher's stdout."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


# -- one rank ------------------------------------------------------------------------------------
def batch(step, rank):
    import torch
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    y = (x[:, :8].sum(1, keepdim=True) * 0.5).tanh() + 0.1 * torch.randn(BATCH, 1, generator=g)
    return x, y


def model_and_optimiser():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


class Hook:
    """DDP's comm hook: torch's allreduce hook, and the victim's SIGKILL at its kill step in the
    second bucket's call (after the first bucket's allreduce went out), or the first where a
    step has one bucket."""

    def __init__(self, pg, store, kill_step=None):
        self.pg, self.store, self.kill_step = pg, store, kill_step
        self.step, self.calls, self.per_step = -1, 0, 1

    def new_step(self, step):
        if self.step >= 0:
            self.per_step = max(self.calls, 1)
        self.step, self.calls = step, 0

    def run(self, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        if self.step == self.kill_step and self.calls == min(1, self.per_step - 1):
            self.store.set("killed_at", repr(time.time()))
            say(f"[shrink] rank {self.pg.rank()}: SIGKILL in step {self.step}'s backward "
                f"(gradient bucket {self.calls})")
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        return default_hooks.allreduce_hook(self.pg, bucket)


def wrap(model, pg, hook):
    from torch.nn.parallel import DistributedDataParallel as DDP
    hook.pg = pg
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.01)   # several buckets per step
    ddp.register_comm_hook(hook, comm_hook)
    return ddp


def comm_hook(state, bucket):
    """DDP's comm hook (state: the Hook)."""
    return state.run(bucket)


def train_step(ddp, opt, pg, step):
    """One step on group pg; the mean loss over its ranks."""
    import torch
    import torch.distributed as dist
    x, y = batch(step, pg.rank())
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=pg)
    return (mean / pg.size()).item()


GROW_PREFIX = "grow-1"        # names the growth on the store (a fresh prefix per growth)


def share_state(model, opt, pg):
    """Rank 0's model and optimiser state (SGD's momentum buffers) to every rank of pg: a
    broadcast per tensor, in place."""
    import torch
    import torch.distributed as dist
    for t in model.state_dict().values():
        dist.broadcast(t, 0, group=pg)
    for p in model.parameters():
        buf = opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        dist.broadcast(buf, 0, group=pg)


def grow_now(pg, store, step, args):
    """Whether the survivors grow back before step `step`: the replacement is ready (rank 0
    looks at the store; at step --regrow-by it waits for it), told to all by a broadcast."""
    import torch
    import torch.distributed as dist
    if args.regrow_by < 0 or pg.size() == args.world:
        return False
    flag = torch.zeros(1, dtype=torch.int32)
    if pg.rank() == 0:
        if step >= args.regrow_by:
            store.wait(["rejoin_ready"], datetime.timedelta(seconds=60))
        flag[0] = int(store.check(["rejoin_ready"]))
    dist.broadcast(flag, 0, group=pg)
    return bool(flag.item())


def rank_main(args):
    import torch
    import torch.distributed as dist
    import r2comm
    import r2comm.torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    model, opt = model_and_optimiser()
    if args.join:
        # the restarted rank: tell the survivors, join their growth, take rank 0's state
        store.set("rejoin_ready", repr(time.time()))
        pg = r2comm.torch.join(store, prefix=GROW_PREFIX, timeout=30, store_timeout=120)
        first = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(first, 0, group=pg)
        share_state(model, opt, pg)
        say(f"[shrink] the replacement joined as rank {pg.rank()} of {pg.size()}, state "
            f"received; it trains from step {first.item()}")
        args.first = int(first.item())
    else:
        dist.init_process_group("r2comm", store=store, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=30))
        pg = dist.group.WORLD
    if args.load:
        state = torch.load(args.load)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    kill = args.kill_step if args.rank == args.victim else None
    hook = Hook(pg, store, kill)
    ddp = wrap(model, pg, hook)
    losses, step, first_after = {}, args.first, None
    while step < args.last:
        if grow_now(pg, store, step, args):
            del ddp
            t0 = time.monotonic()
            pg = r2comm.torch.grow(store, 1, prefix=GROW_PREFIX, store_timeout=120)
            grown_s = time.monotonic() - t0
            dist.broadcast(torch.tensor([step], dtype=torch.int64), 0, group=pg)
            share_state(model, opt, pg)
            if pg.rank() == 0:
                ready = float(store.get("rejoin_ready").decode())
                say(f"[shrink] grown back to {pg.size()} before step {step}: grow {grown_s:.3f} "
                    f"s, with the state {time.monotonic() - t0:.3f} s ({time.time() - ready:.3f}"
                    f" s after the replacement was ready)")
            ddp = wrap(model, pg, hook)
        hook.new_step(step)
        try:
            loss = train_step(ddp, opt, pg, step)
        except RuntimeError as exc:
            # a collective failed: R2commNetworkError / R2commRevokedError (torch's
            # DistNetworkError / DistBackendError), which DDP's backward wraps in a
            # RuntimeError. shrink() below raises (DistBackendError) where no rank died.
            say(f"[shrink] rank {pg.rank()}: step {step} failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
            failed = True
        else:
            failed = False
        if failed:
            del ddp                            # its reducer's hooks go with it
            t0 = time.monotonic()
            old_rank = pg.rank()
            pg = r2comm.torch.shrink(pg)
            shrink_s = time.monotonic() - t0
            say(f"[shrink] rank {old_rank} -> {pg.rank()} of {pg.size()}: shrunk in "
                f"{shrink_s * 1e3:.0f} ms (world ranks left: {dist.get_process_group_ranks(pg)})")
            ddp = wrap(model, pg, hook)
            first_after = step
            continue                           # redo the interrupted step
        if pg.rank() == 0:
            losses[step] = (pg.size(), loss.hex())
            say(f"[shrink] step {step:3d}  world {pg.size()}  loss {loss:.6f}")
            if step == first_after:
                killed_at = float(store.get("killed_at").decode())
                say(f"[shrink] kill -> step {step} done on the shrunk group: "
                    f"{time.time() - killed_at:.3f} s")
        step += 1
    if pg.rank() == 0:
        if args.save:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
        # the final model and optimiser state's digest (the last part's rank 0 writes it)
        digest = hashlib.sha256()
        for t in list(model.state_dict().values()) + [
                opt.state_dict()["state"][i]["momentum_buffer"]
                for i in sorted(opt.state_dict()["state"])]:
            digest.update(t.detach().contiguous().numpy().tobytes())
        losses["digest"] = digest.hexdigest()[:16]
        with open(args.out, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()
    if args.kill_step >= 0 and pg.size() < args.world:
        # a survivor that did not grow back: skip the exit handlers, whose close of the r2comm
        # world (it holds the dead rank) waits up to 10 s for the sends to it to drain (README,
        # Limits); grow() freed that world otherwise
        sys.stdout.flush()
        os._exit(0)
    return 0


# -- the launcher --------------------------------------------------------------------------------
def launch(world, extra, deadline, restart=None):
    """Start `world` ranks of this script (a TCPStore hosted here); their exit codes. With
    `restart` (a rank), a replacement (--join) is started once that rank is gone; its exit
    code comes last."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ)
    env.setdefault("R2COMM_TIMEOUT", "30")          # every wait of the ranks is bounded
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               "--world", str(world), "--port", str(store.port), *extra],
                              env=env) for r in range(world)]
    if restart is not None:
        while procs[restart].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--join",
                                       "--world", str(world), "--port", str(store.port),
                                       *extra], env=env))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(timeout=10))
    return codes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--regrow-by", type=int, default=8,
                    help="the step by which the survivors grow back (-1: they do not)")
    ap.add_argument("--timeout", type=float, default=240.0, help="the whole example's bound (s)")
    # a rank's own arguments (the launcher passes them)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--join", action="store_true")
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--last", type=int)
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.rank is not None or args.join:
        if args.last is None:
            args.last = args.steps
        return rank_main(args)

    deadline = time.monotonic() + args.timeout
    n, k, v, g = args.ranks, args.kill_step, args.victim, args.regrow_by
    if not (0 <= k < args.steps and 0 <= v < n and n >= 2):
        ap.error("need 0 <= kill-step < steps, 0 <= victim < ranks, ranks >= 2")
    if v == 0:
        ap.error("the victim is not rank 0 here (rank 0 prints the losses)")
    if g >= 0 and not k < g < args.steps:
        ap.error("need kill-step < regrow-by < steps (or regrow-by -1)")
    common = ["--steps", str(args.steps), "--victim", str(v), "--regrow-by", str(g)]
    with tempfile.TemporaryDirectory(prefix="r2comm-shrink-") as tmp:
        fail_out = os.path.join(tmp, "fail.json")
        say(f"[shrink] run 1: {n} ranks, rank {v} dies in step {k}; the survivors shrink "
            f"to {n - 1} and go on" + ("" if g < 0 else
                                      f"; a replacement grows them back to {n} "
                                      f"(by step {g})"))
        t0 = time.monotonic()
        codes = launch(n, common + ["--kill-step", str(k), "--out", fail_out], deadline,
                       restart=None if g < 0 else v)
        fail_s = time.monotonic() - t0
        want = [0] * (n if g < 0 else n + 1)
        want[v] = -signal.SIGKILL
        if codes != want:
            say(f"[shrink] run 1: exit codes {codes}, expected {want}")
            return 1
        got, got_digest = _read(fail_out)
        # the reference: the world sizes run 1 had, in parts, each from the last one's state
        parts = _parts([got[s][0] for s in sorted(got)])
        say("[shrink] reference, no failure: " + "; ".join(
            f"{size} ranks for steps {a}..{b - 1}" for size, a, b in parts) +
            " (each part a fresh job from the last one's saved state)")
        ref, ref_digest, state = {}, None, None
        for i, (size, a, b) in enumerate(parts):
            out, nxt = os.path.join(tmp, f"ref{i}.json"), os.path.join(tmp, f"state{i}.pt")
            codes = launch(size, common + ["--kill-step", "-1", "--regrow-by", "-1",
                                           "--first", str(a), "--last", str(b), "--save", nxt,
                                           "--out", out] + (["--load", state] if state else []),
                           deadline)
            if codes != [0] * size:
                say(f"[shrink] reference part {i + 1}: exit codes {codes}")
                return 1
            part, ref_digest = _read(out)
            ref.update(part)
            state = nxt
    say(f"[shrink] run 1 took {fail_s:.1f} s")
    say("[shrink] step  world  run 1 loss           reference loss")
    for s in range(args.steps):
        a, b = got.get(s), ref.get(s)
        mark = "" if a == b else "   <- DIFFERENT"
        show = lambda e: f"{e[0]}  {float.fromhex(e[1]):.10f}" if e else "-"   # noqa: E731
        say(f"[shrink] {s:4d}  {show(a):>20}  {show(b)[3:] if b else '-':>14}{mark}")
    sizes = [got[s][0] for s in range(args.steps)] if len(got) == args.steps else []
    grown = [s for s in range(k + 1, args.steps) if sizes and sizes[s] == n]
    shape = sizes[:k] == [n] * k and (sizes[k:] == [n - 1] * (args.steps - k) if g < 0 else
                                      grown and grown[0] <= g and
                                      sizes[k:] == [n - 1] * (grown[0] - k) +
                                      [n] * (args.steps - grown[0]))
    same = got == ref and bool(shape)
    say(f"[shrink] final model and optimiser state: run 1 {got_digest}, reference "
        f"{ref_digest}")
    say(f"[shrink] losses after the shrink equal the reference's bit for bit: {same}; "
        f"same final state: {got_digest == ref_digest}")
    return 0 if same and got_digest == ref_digest else 1


def _parts(sizes):
    """[(world size, first step, end step)] of a run whose step s had world size sizes[s]."""
    parts = []
    for s, size in enumerate(sizes):
        if parts and parts[-1][0] == size:
            parts[-1] = (size, parts[-1][1], s + 1)
        else:
            parts.append((size, s, s + 1))
    return parts


def _read(path):
    """({step: (world size, loss in hex)}, the final state's digest or None)."""
    with open(path) as f:
        data = json.load(f)
    digest = data.pop("digest", None)
    return {int(s): tuple(v) for s, v in data.items()}, digest


if __name__ == "__main__":
    sys.exit(main())
