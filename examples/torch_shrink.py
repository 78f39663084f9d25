"""Lose a rank, not the job: DDP training on 4 CPU ranks in which one rank SIGKILLs itself in
the middle of a step's backward (inside DDP's gradient allreduce), and the 3 survivors revoke,
agree, shrink (r2comm.torch.shrink), rebuild DDP on the new group, redo the interrupted step and
train on to the end. A reference then replays the same world sizes with no failure (4 ranks up
to the step of the kill; rank 0 saves the model and optimiser state there; a fresh 3-rank job
loads it and runs the rest) and the losses are compared bit for bit.

    python examples/torch_shrink.py                    # both runs, compared (exit 1 if unequal)
    python examples/torch_shrink.py --steps 12 --kill-step 5 --victim 1

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


def rank_main(args):
    import torch
    import torch.distributed as dist
    import r2comm
    import r2comm.torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("r2comm", store=store, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=30))
    pg = dist.group.WORLD
    model, opt = model_and_optimiser()
    if args.load:
        state = torch.load(args.load)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    kill = args.kill_step if args.rank == args.victim else None
    hook = Hook(pg, store, kill)
    ddp = wrap(model, pg, hook)
    losses, step, first_after = {}, args.first, None
    while step < args.last:
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
    if not args.load and args.kill_step >= 0:
        # a survivor: skip the exit handlers, whose close of the r2comm world waits up to 10 s
        # for the sends to the dead rank to drain (README, Limits)
        sys.stdout.flush()
        os._exit(0)
    return 0


# -- the launcher --------------------------------------------------------------------------------
def launch(world, extra, deadline):
    """Start `world` ranks of this script (a TCPStore hosted here); their exit codes."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ)
    env.setdefault("R2COMM_TIMEOUT", "30")          # every wait of the ranks is bounded
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               "--world", str(world), "--port", str(store.port), *extra],
                              env=env) for r in range(world)]
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
    ap.add_argument("--timeout", type=float, default=240.0, help="the whole example's bound (s)")
    # a rank's own arguments (the launcher passes them)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--last", type=int)
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.rank is not None:
        if args.last is None:
            args.last = args.steps
        return rank_main(args)

    deadline = time.monotonic() + args.timeout
    n, k, v = args.ranks, args.kill_step, args.victim
    if not (0 <= k < args.steps and 0 <= v < n and n >= 2):
        ap.error("need 0 <= kill-step < steps, 0 <= victim < ranks, ranks >= 2")
    if v == 0:
        ap.error("the victim is not rank 0 here (rank 0 prints the losses)")
    common = ["--steps", str(args.steps), "--victim", str(v)]
    with tempfile.TemporaryDirectory(prefix="r2comm-shrink-") as tmp:
        out = {name: os.path.join(tmp, name + ".json") for name in ("fail", "ref1", "ref2")}
        say(f"[shrink] run 1: {n} ranks, rank {v} dies in step {k}; the survivors shrink "
            f"to {n - 1} and go on")
        t0 = time.monotonic()
        codes = launch(n, common + ["--kill-step", str(k), "--out", out["fail"]], deadline)
        fail_s = time.monotonic() - t0
        want = [0] * n
        want[v] = -signal.SIGKILL
        if codes != want:
            say(f"[shrink] run 1: exit codes {codes}, expected {want}")
            return 1
        say(f"[shrink] reference: {n} ranks for steps 0..{k - 1}, then a fresh {n - 1}-rank "
            f"job from rank 0's saved state, no failure")
        state = os.path.join(tmp, "state.pt")
        codes = launch(n, common + ["--kill-step", "-1", "--last", str(k), "--save", state,
                                    "--out", out["ref1"]], deadline)
        if codes != [0] * n:
            say(f"[shrink] reference part 1: exit codes {codes}")
            return 1
        codes = launch(n - 1, common + ["--kill-step", "-1", "--first", str(k), "--load",
                                        state, "--out", out["ref2"]], deadline)
        if codes != [0] * (n - 1):
            say(f"[shrink] reference part 2: exit codes {codes}")
            return 1
        got, got_digest = _read(out["fail"])
        (ref1, _), (ref2, ref_digest) = _read(out["ref1"]), _read(out["ref2"])
        ref = {**ref1, **ref2}
    say(f"[shrink] run 1 took {fail_s:.1f} s")
    say("[shrink] step  world  run 1 loss           reference loss")
    for s in range(args.steps):
        a, b = got.get(s), ref.get(s)
        mark = "" if a == b else "   <- DIFFERENT"
        show = lambda e: f"{e[0]}  {float.fromhex(e[1]):.10f}" if e else "-"   # noqa: E731
        say(f"[shrink] {s:4d}  {show(a):>20}  {show(b)[3:] if b else '-':>14}{mark}")
    same = got == ref and len(got) == args.steps and all(got[s][0] == (n if s < k else n - 1)
                                                         for s in range(args.steps))
    say(f"[shrink] final model and optimiser state: run 1 {got_digest}, reference "
        f"{ref_digest}")
    say(f"[shrink] losses after the shrink equal the reference's bit for bit: {same}; "
        f"same final state: {got_digest == ref_digest}")
    return 0 if same and got_digest == ref_digest else 1


def _read(path):
    """({step: (world size, loss in hex)}, the final state's digest or None)."""
    with open(path) as f:
        data = json.load(f)
    digest = data.pop("digest", None)
    return {int(s): tuple(v) for s, v in data.items()}, digest


if __name__ == "__main__":
    sys.exit(main())
