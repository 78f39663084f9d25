"""Multi-rank worker for tests/test_torch_modern.py: the modern PyTorch stack (FSDP2, DeviceMesh,
DTensor, tensor parallel, functional collectives and torch.compile, object collectives,
comm hooks, Join, dropped works) on the backend named by $R2T_BACKEND ("gloo" or "r2comm"),
each compared with the same computation on Gloo groups over the same ranks, in the same job.

Launched by torchrun (env:// rendezvous). `python torch_modern_worker.py JOB` runs the checks
of JOB; each check prints `CHECK <name> pass|fail <detail>` on rank 0 (a check fails when it
fails on any rank), then `DONE JOB <passed>/<total>`; the exit code is non-zero if any failed.
A check that cannot finish (a deadlock) is reported by a deadline, then the process exits."""
import datetime
import gc
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm.torch  # noqa: E402,F401  (registers "r2comm")

warnings.filterwarnings("ignore")
BACKEND = os.environ.get("R2T_BACKEND", "r2comm")
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("R2T_TIMEOUT", "60")))
R = dist.ReduceOp


# ---------------------------------------------------------------- helpers

def bits(t):
    """A tensor's bytes as integers of the same width: equal bits, not just equal values."""
    t = t.detach().contiguous().view(-1)
    if t.dtype.is_floating_point:
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a, b, what):
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
    if not torch.equal(bits(a), bits(b)):
        raise AssertionError(f"{what}: {a.flatten()[:8].tolist()} != {b.flatten()[:8].tolist()}")


def same_losses(ours, ref, what):
    if ours != ref:           # python floats from .item(): compares every bit of the value
        raise AssertionError(f"{what}: losses {ours} != reference {ref}")


def gloo_world():
    """A Gloo group over every rank: the reference for the backend under test."""
    return dist.new_group(backend="gloo")


def gloo_mesh_2d(rows, cols):
    """A 2-D DeviceMesh ("dp", "tp") built from Gloo groups: rows x cols, rank = r * cols + c."""
    from torch.distributed.device_mesh import DeviceMesh
    rank = dist.get_rank()
    dp_mine = tp_mine = None
    for c in range(cols):                           # every rank creates every group, in order
        g = dist.new_group([r * cols + c for r in range(rows)], backend="gloo")
        if rank % cols == c:
            dp_mine = g
    for r in range(rows):
        g = dist.new_group([r * cols + c for c in range(cols)], backend="gloo")
        if rank // cols == r:
            tp_mine = g
    mesh = torch.arange(rows * cols).view(rows, cols)
    return DeviceMesh.from_group([dp_mine, tp_mine], "cpu", mesh=mesh, mesh_dim_names=("dp", "tp"))


def pairs(ctx):
    """(ours, Gloo's) groups of ranks {0,1}, {2,3}, ...: float sums of two values do not depend
    on the order of reduction, so training in them is bitwise equal to Gloo's (with four
    ranks float32 sums may differ from Gloo's in the last bit)."""
    if "pair" not in ctx:
        rank, size = dist.get_rank(), dist.get_world_size()
        ctx["pair"], _ = dist.new_subgroups(group_size=2)
        for first in range(0, size, 2):
            g = dist.new_group([first, first + 1], backend="gloo")
            if rank // 2 == first // 2:
                ctx["gloo_pair"] = g
    return ctx["pair"], ctx["gloo_pair"]


def trained_in_pairs(ctx, train, seconds, what):
    """(train(our pair group), train(Gloo's pair group)): ours first, bounded in time."""
    pair, gloo_pair = pairs(ctx)
    ours = run_with_deadline(lambda: train(pair), seconds, what)
    return ours, train(gloo_pair)


def same_params(ours, ref, what):
    for i, (a, b) in enumerate(zip(ours, ref)):
        same_bits(a, b, f"{what} param {i}")


def same_run(ours, ref, what):
    """(losses, parameters) of our run and Gloo's: equal bit for bit."""
    same_losses(ours[0], ref[0], what)
    same_params(ours[1], ref[1], what)


def sgd_losses(model, steps, loss_of, lr=0.05):
    """`steps` SGD steps on loss_of(model, step); the losses, as floats."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full_params(model):
    return [p.full_tensor() for p in model.parameters()]


def square_loss(seed_of):
    """loss_of for sgd_losses: mean square of the output on batch(seed_of(step))."""
    def loss_of(model, step):
        out = model(batch(seed_of(step))[0])
        return (out * out).mean()
    return loss_of


def mlp(seed, width=16, depth=2):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def batch(seed, n=8, width=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, 4, generator=g)


def poll(fut, seconds, what):
    """Wait for a torch Future with a deadline (Future.wait has none)."""
    end = time.monotonic() + seconds
    while not fut.done():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not complete after {seconds} s (deadlock)")
        time.sleep(0.005)
    return fut.value()


# ---------------------------------------------------------------- FSDP2 / mesh / DTensor / TP

def train_fsdp(mesh, mp, steps=4):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = mlp(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    def loss_of(model, step):
        x, y = batch(100 * mesh.get_local_rank() + step)
        return nn.functional.mse_loss(model(x).float(), y)
    return sgd_losses(model, steps, loss_of), full_params(model)


def check_fsdp2(ctx, mp):
    """FSDP2 over the 2-rank "dp" dimension of a 2x2 mesh (two rows train side by side)."""
    ours = train_fsdp(ctx["mesh"]["dp"], mp)
    same_run(ours, train_fsdp(ctx["gloo_mesh"]["dp"], mp), "fsdp2")


def check_dtensor_redistribute(ctx):
    from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,
                                          distribute_tensor)
    mesh, rank = ctx["mesh"], dist.get_rank()
    torch.manual_seed(7)
    full = torch.randn(8, 6)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    same_bits(d.to_local(), full.chunk(2, 0)[mesh.get_local_rank(0)]
              .chunk(2, 1)[mesh.get_local_rank(1)], "distribute_tensor Shard(0),Shard(1)")
    for placements in ([Replicate(), Shard(0)], [Shard(1), Replicate()],
                       [Replicate(), Replicate()]):
        d = d.redistribute(mesh, placements)
        same_bits(d.full_tensor(), full, f"redistribute {placements}")
    local = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    p = DTensor.from_local(local, mesh, [Partial(), Partial()])
    got = p.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    want = torch.arange(12, dtype=torch.float32).view(3, 4) * sum(range(1, 5))
    same_bits(got, want, "Partial,Partial -> Replicate,Replicate")
    s = p.redistribute(mesh, [Shard(0), Partial()]).redistribute(mesh, [Replicate(), Replicate()])
    same_bits(s.to_local(), want, "Partial -> Shard(0) -> Replicate")


def tp_model(mesh):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def train_tp(mesh, steps=3):
    model = tp_model(mesh)
    losses = sgd_losses(model, steps, square_loss(lambda step: step))  # same input on every TP rank
    return losses, full_params(model)


def check_tp(ctx):
    """parallelize_module (Colwise + Rowwise) over "tp": equal to Gloo, and to the plain model."""
    ours = train_tp(ctx["mesh"]["tp"])
    same_run(ours, train_tp(ctx["gloo_mesh"]["tp"]), "tp")
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    x, _ = batch(0)
    want = plain(x)
    got = tp_model(ctx["mesh"]["tp"])(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def train_fsdp_tp(mesh, steps=3):
    from torch.distributed.fsdp import fully_shard
    model = tp_model(mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh.get_local_rank(0)                              # data parallel over "dp"
    return sgd_losses(model, steps, square_loss(lambda step: 10 * dp + step)), full_params(model)


def check_fsdp_tp(ctx):
    """FSDP2 over "dp" x tensor parallel over "tp" on the 2x2 mesh, equal to Gloo's bitwise."""
    ours = train_fsdp_tp(ctx["mesh"])
    same_run(ours, train_fsdp_tp(ctx["gloo_mesh"]), "fsdp x tp")


def train_failover(mesh, steps, fail_at=-1, restore_at=-1, width=256, gate=None):
    """FSDP2 over "dp" x TP over "tp" (as check_fsdp_tp, wider: 0.5 MiB of parameters); rank 1
    fails its rail 0 for real ("hard") before step fail_at and restores it before restore_at.
    The losses of every step, reduced over the world."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    comm = r2comm.torch.communicator()
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        if gate is not None:
            gate(step)
        if dist.get_rank() == 1 and step == fail_at:
            comm.fail_rail(0, "hard")
        if dist.get_rank() == 1 and step == restore_at:
            comm.restore_rail(0)
        x, _ = batch(10 * mesh.get_local_rank(0) + step, n=16, width=width)
        out = model(x)
        loss = (out * out).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, group=AGREE)
        losses.append(reduced.item())
    return losses


def wait_gate(step):
    """R2T_GATE="DIR:a,b": before steps a and b rank 0 prints "GATE a" and waits (bounded) for
    DIR/go.a, so that the test changes the testbed's links between the same two steps in every
    run; the other ranks wait for rank 0 in a Gloo barrier."""
    gate_dir, _, steps = os.environ.get("R2T_GATE", "").partition(":")
    if step not in {int(v) for v in steps.split(",") if v}:
        return
    if dist.get_rank() == 0:
        print(f"GATE {step}", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(gate_dir, f"go.{step}")):
            assert time.monotonic() < deadline, f"nobody opened gate {step}"
            time.sleep(0.02)
    dist.barrier(group=AGREE)


def check_testbed_run(ctx):
    """FSDP x TP (check_failover's model) for R2T_STEPS steps with the gates of R2T_GATE (the
    test takes a NIC down and up there); rank 0 prints the losses and the failover events."""
    comm = r2comm.torch.communicator()
    steps = int(os.environ.get("R2T_STEPS", "14"))
    losses = train_failover(ctx["mesh"], steps, gate=wait_gate)
    events = torch.tensor([len([e for e in comm.events if e["kind"] != "up"])])
    dist.all_reduce(events, group=AGREE)
    if dist.get_rank() == 0:
        sys.stdout.write("LOSSES " + " ".join(v.hex() for v in losses) +
                         f"\nEVENTS {int(events.item())}\n")
        sys.stdout.flush()


def check_failover(ctx):
    """Two rails (R2COMM_RAILS): FSDP x TP training with rank 1's rail 0 failed at step 4 and
    restored at step 10 has the fault-free run's losses, bitwise; the failure happened."""
    comm = r2comm.torch.communicator()
    before = len([e for e in comm.events if e["kind"] != "up"])
    clean = train_failover(ctx["mesh"], 14)
    faulty = train_failover(ctx["mesh"], 14, fail_at=4, restore_at=10)
    events = torch.tensor([len([e for e in comm.events if e["kind"] != "up"]) - before])
    dist.all_reduce(events, group=AGREE)
    same_losses(faulty, clean, "FSDP x TP through a rail failure")
    assert events.item() > 0, "no failover event: the rail failure did not happen"
    if dist.get_rank() == 0:
        print(f"NOTE failover: {int(events.item())} failover events, losses "
              + " ".join(v.hex() for v in clean[:3]) + " ...", flush=True)


def mesh_context():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"mesh": mesh, "gloo_mesh": gloo_mesh_2d(2, 2)}


# ---------------------------------------------------------------- collectives

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.AVG]


def small_ints(rank, dtype, case, n=9):
    g = torch.Generator().manual_seed(1000 * rank + case)
    t = torch.randint(0, 4, (n,), generator=g)
    return t.bool() if dtype == torch.bool else t.to(dtype)


def outcome(fn):
    """('ok', tensor) or ('error', first line of the exception)."""
    try:
        return "ok", fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return "error", str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__


def check_reduce_ops(ctx):
    """Every ReduceOp x dtype: where Gloo reduces, ours is equal bitwise; where Gloo raises,
    ours raises too or (AVG, which Gloo lacks) equals the quotient of Gloo's SUM."""
    gloo, rank, size = ctx["gloo"], dist.get_rank(), dist.get_world_size()
    mismatches, case, extra = [], 0, []
    for dtype in DTYPES:
        for op in OPS:
            case += 1
            t = small_ints(rank, dtype, case)

            def run(group, t=t, op=op):
                x = t.clone()
                dist.all_reduce(x, op=op, group=group)
                return x
            ours, ref = outcome(lambda: run(None)), outcome(lambda: run(gloo))
            if op == R.AVG and ref[0] == "error" and dtype.is_floating_point:
                ref = "ok", run_sum_div(t, gloo, size)
            elif ref[0] == "error" and ours[0] == "ok":     # a case Gloo lacks: exact reference
                ref = outcome(lambda: local_reduce([small_ints(r, dtype, case)
                                                    for r in range(size)], op, dtype))
                extra.append(f"{dtype} {op}")
            if ours[0] != ref[0]:
                mismatches.append(f"{dtype} {op}: ours {ours[0]} ({ours[1] if ours[0] == 'error' else ''}) gloo {ref[0]}")
            elif ours[0] == "ok":
                try:
                    if op == R.AVG:
                        torch.testing.assert_close(ours[1], ref[1])
                    else:
                        same_bits(ours[1], ref[1], f"{dtype} {op}")
                except AssertionError as exc:
                    mismatches.append(str(exc)[:150])
    if mismatches:
        raise AssertionError(f"{len(mismatches)} cases differ from Gloo: " + "; ".join(mismatches[:12]))
    if extra and rank == 0:
        print(f"NOTE reduce_ops_x_dtypes: {len(extra)} cases Gloo rejects, ours exact: "
              + ", ".join(extra), flush=True)


def local_reduce(tensors, op, dtype):
    """The exact result of op over tensors of small integers, computed locally in int64."""
    if op == R.AVG:
        raise ValueError("no exact local average")
    stack = torch.stack([t.long() for t in tensors])
    fold = {R.SUM: lambda s: s.sum(0), R.PRODUCT: lambda s: s.prod(0),
            R.MIN: lambda s: s.amin(0), R.MAX: lambda s: s.amax(0)}
    bitwise = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
    if op in bitwise:
        out = stack[0]
        for t in stack[1:]:
            out = bitwise[op](out, t)
    else:
        out = fold[op](stack)
    if dtype == torch.bool:
        return out.bool() if op != R.SUM else out.clamp(max=1).bool()
    return out.to(dtype)


def run_sum_div(t, gloo, size):
    x = t.clone()
    dist.all_reduce(x, op=R.SUM, group=gloo)
    return x / size


def check_gather_scatter(ctx):
    gloo, rank, size = ctx["gloo"], dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        for root in range(size):
            t = small_ints(rank, dtype, 5 + root)
            outs = {}
            for name, group in (("ours", None), ("gloo", gloo)):
                lst = [torch.empty_like(t) for _ in range(size)] if rank == root else None
                dist.gather(t, lst, dst=root, group=group)
                outs[name] = lst
            if rank == root:
                for r in range(size):
                    same_bits(outs["ours"][r], outs["gloo"][r], f"gather {dtype} root {root}")
                    same_bits(outs["ours"][r], small_ints(r, dtype, 5 + root), "gather value")
            chunks = [small_ints(100 + r, dtype, root) for r in range(size)] if rank == root else None
            got = torch.empty_like(small_ints(0, dtype, 0))
            dist.scatter(got, chunks, src=root)
            same_bits(got, small_ints(100 + rank, dtype, root), f"scatter {dtype} root {root}")


def check_object_collectives(ctx):
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "name": f"r{rank}", "list": list(range(rank + 1))}
    want = [{"rank": r, "name": f"r{r}", "list": list(range(r + 1))} for r in range(size)]
    got = [None] * size
    dist.all_gather_object(got, mine)
    assert got == want, f"all_gather_object {got}"
    for root in range(size):
        g = [None] * size if rank == root else None
        dist.gather_object(mine, g, dst=root)
        if rank == root:
            assert g == want, f"gather_object {g}"
        objs = [("to", r, "x" * r) for r in range(size)] if rank == root else [None] * size
        out = [None]
        dist.scatter_object_list(out, objs if rank == root else None, src=root)
        assert out[0] == ("to", rank, "x" * rank), f"scatter_object_list {out}"
        b = [root, {"k": [1.5, None]}] if rank == root else [None, None]
        dist.broadcast_object_list(b, src=root)
        assert b == [root, {"k": [1.5, None]}], f"broadcast_object_list {b}"


def check_subgroups(ctx):
    """new_group / new_subgroups, a collective in each, destroy_process_group(subgroup), a new
    group over the same ranks afterwards; and torch's own names for each."""
    rank, size = dist.get_rank(), dist.get_world_size()
    for round_ in range(3):
        sub, subs = dist.new_subgroups(group_size=2)
        assert isinstance(sub.group_name, str) and sub.group_name, "subgroup has no name"
        t = torch.tensor([float(rank + round_)])
        dist.all_reduce(t, group=sub)
        first = rank - rank % 2
        assert t.item() == (first + round_) + (first + 1 + round_), f"round {round_}: {t}"
        evens = dist.new_group([r for r in range(size) if r % 2 == 0])
        if rank % 2 == 0:
            e = torch.tensor([1.0])
            dist.all_reduce(e, group=evens)
            assert e.item() == len(range(0, size, 2)), e
        for g in subs:
            dist.destroy_process_group(g)
        if evens is not None and evens != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(evens)
    dist.barrier()


def check_powersgd(ctx):
    """DDP with the PowerSGD hook (nested collectives in its futures): equal to Gloo's."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(group):
        model = DDP(mlp(1, width=32), process_group=group)
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(state, psgd.powerSGD_hook)

        def loss_of(model, step):
            x, y = batch(10 * dist.get_rank() + step, width=32)
            return nn.functional.mse_loss(model(x), y)
        return sgd_losses(model, 5, loss_of), [p.detach().clone() for p in model.parameters()]

    ours, ref = trained_in_pairs(ctx, train, 90, "PowerSGD training")
    same_run(ours, ref, "powersgd")


def run_with_deadline(fn, seconds, what):
    """fn() on a thread; a deadlock inside it is reported instead of hanging the job."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:      # noqa: BLE001  (re-raised on the caller's thread)
            box["error"] = exc
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        raise TimeoutError(f"{what}: not finished after {seconds} s (deadlock)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_nested_futures(ctx):
    """A .then() callback that starts another collective and waits for it; a DDP comm hook
    that does the same inside its future chain."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    second = torch.tensor([10.0 * (rank + 1)])

    def then(fut):
        dist.all_reduce(second)                  # a blocking collective inside the callback
        return fut.value()[0] + second
    fut = dist.all_reduce(t, async_op=True).get_future().then(then)
    got = poll(fut, 30, "nested future")
    total = sum(range(1, size + 1))
    assert got.item() == total + 10.0 * total, got

    from torch.nn.parallel import DistributedDataParallel as DDP

    def hook(state, bucket):
        buf = bucket.buffer()
        fut = dist.all_reduce(buf, async_op=True, group=state).get_future()

        def halve(f):
            v = f.value()[0]
            w = dist.all_reduce(torch.ones(1), async_op=True, group=state)
            w.wait()
            return v / dist.get_world_size(state)
        return fut.then(halve)

    def train(group):
        model = DDP(mlp(2), process_group=group)   # one bucket (*)
        model.register_comm_hook(group, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            x, y = batch(rank * 7 + step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    # (*) One bucket: with several buckets in flight, a callback that blocks on a collective
    # can hold every worker thread of Gloo itself (2 by default) and deadlock it.
    same_params(*trained_in_pairs(ctx, train, 60, "DDP nested-future hook"), "nested hook")


def check_join(ctx):
    """DDP under Join with uneven inputs (rank r has 3 + 2r batches), in pairs of ranks:
    equal to Gloo's bitwise."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()

    def train(group):
        model = DDP(mlp(4), process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with Join([model]):
            for step in range(3 + 2 * rank):
                x, y = batch(rank * 31 + step)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]
    same_params(*trained_in_pairs(ctx, train, 60, "Join"), "join")


def check_funcol(ctx, compile_backend=None):
    """Functional collectives (all_reduce, all_gather_tensor, reduce_scatter_tensor,
    all_to_all_single, broadcast), eager or compiled, equal to the same on a Gloo group."""
    import torch.distributed._functional_collectives as funcol
    rank, size = dist.get_rank(), dist.get_world_size()

    def body(x, group):
        a = funcol.all_reduce(x, "sum", group)
        g = funcol.all_gather_tensor(x, 0, group)
        rs = funcol.reduce_scatter_tensor(g * 2, "sum", 0, group)
        a2a = funcol.all_to_all_single(x, None, None, group)
        b = funcol.broadcast(x, 0, group)
        return [funcol.wait_tensor(t) for t in (a, g, rs, a2a, b)]
    x = torch.arange(4 * size, dtype=torch.float32) + 100 * rank
    ref = body(x, ctx["gloo"])
    world = dist.group.WORLD
    fn = body if compile_backend is None else torch.compile(body, backend=compile_backend,
                                                             fullgraph=True)
    ours = fn(x, world)
    for name, a, b in zip(("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                           "broadcast"), ours, ref):
        same_bits(a, b, f"funcol {compile_backend or 'eager'} {name}")
    if compile_backend is not None:            # coalesced forms, which torch maps to
        ours = funcol.all_gather_into_tensor_coalesced([x, x + 1], world)
        ref = funcol.all_gather_into_tensor_coalesced([x, x + 1], ctx["gloo"])
        for a, b in zip(ours, ref):
            same_bits(funcol.wait_tensor(a), funcol.wait_tensor(b), "all_gather coalesced")
        ours = funcol.reduce_scatter_tensor_coalesced([x, x * 3], "sum", [0, 0], world)
        ref = funcol.reduce_scatter_tensor_coalesced([x, x * 3], "sum", [0, 0], ctx["gloo"])
        for a, b in zip(ours, ref):
            same_bits(funcol.wait_tensor(a), funcol.wait_tensor(b), "reduce_scatter coalesced")


def check_dropped_works(ctx):
    """300 async all_reduces dropped unwaited (their tensors too), then collectives that
    check the group still computes right."""
    rank, size = dist.get_rank(), dist.get_world_size()
    for i in range(300):
        t = torch.full((1024 if i % 3 else 7,), float(rank + i))
        dist.all_reduce(t, async_op=True)              # Work and tensor dropped at once
        del t
        if i % 50 == 0:
            gc.collect()
    gc.collect()
    for i in range(5):
        t = torch.full((4096,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.all(t == sum(range(1, size + 1))).item(), t[:4]
    dist.barrier()


def check_reinit(ctx):
    """destroy_process_group() of the world, then init_process_group again on a fresh store;
    a collective in the new world."""
    rank, size = dist.get_rank(), dist.get_world_size()
    global AGREE
    path = os.path.join(os.environ["R2T_TMP"], f"reinit-store-{os.environ['MASTER_PORT']}")
    dist.barrier()
    dist.destroy_process_group()
    store = dist.FileStore(path, size)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == sum(range(1, size + 1)), t
    dist.barrier()
    AGREE = dist.new_group(backend="gloo")


def needs_mesh(check):
    """The 2x2 meshes (ours and Gloo's) made on first use, so a failure to make them fails
    only the checks that use them."""
    def run(ctx):
        if "mesh" not in ctx:
            ctx.update(mesh_context())
        return check(ctx)
    return run


# A check that deadlocks ends its job (reported, then os._exit): those come late; re-init last.
JOBS = {
    "stack": [("reduce_ops_x_dtypes", check_reduce_ops),            # 4 ranks: a 2x2 mesh
              ("gather_scatter", check_gather_scatter),
              ("object_collectives", check_object_collectives),
              ("subgroups_destroy", check_subgroups),
              ("fsdp2_fp32", needs_mesh(lambda c: check_fsdp2(c, False))),
              ("fsdp2_bf16_mixed", needs_mesh(lambda c: check_fsdp2(c, True))),
              ("dtensor_redistribute_2d", needs_mesh(check_dtensor_redistribute)),
              ("tp_parallelize_module", needs_mesh(check_tp)),
              ("fsdp_x_tp", needs_mesh(check_fsdp_tp)),
              ("funcol_eager", check_funcol),
              ("funcol_compile_aot_eager", lambda c: check_funcol(c, "aot_eager")),
              ("join_uneven_inputs", check_join),
              ("nested_futures", check_nested_futures),
              ("powersgd_hook", check_powersgd),
              ("dropped_async_works", check_dropped_works),
              ("reinit_fresh_store", check_reinit)],
    "inductor": [("funcol_compile_inductor", lambda c: check_funcol(c, "inductor"))],
    "failover": [("fsdp_tp_rail_failure", needs_mesh(check_failover))],    # r2comm, 2 rails
    "testbed": [("fsdp_tp_testbed_run", needs_mesh(check_testbed_run))],   # 2 hosts x 2 ranks
}


def agree(ok):
    """Whether the check passed on every rank (over Gloo, which a failed check leaves usable)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=R.MIN, group=AGREE)
    return bool(flag.item())


def main():
    global AGREE
    job = sys.argv[1]
    dist.init_process_group(BACKEND, timeout=TIMEOUT)
    AGREE = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    ctx = {"gloo": gloo_world()}
    os.environ.setdefault("R2T_TMP", tempfile.gettempdir())
    passed, checks = 0, JOBS[job]
    only = os.environ.get("R2T_ONLY")
    for name, fn in checks:
        if only and name not in only.split(","):
            continue
        t0 = time.monotonic()
        try:
            fn(ctx)
            ok, detail = True, ""
        except BaseException as exc:                     # noqa: BLE001  (reported per check)
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"rank {rank} {name}:\n{traceback.format_exc()[-3000:]}", file=sys.stderr,
                  flush=True)
            if isinstance(exc, TimeoutError):               # a deadlocked thread remains
                print(f"CHECK {name} fail {detail}", flush=True)
                os._exit(3)
        everyone = agree(ok)
        passed += everyone
        if rank == 0:
            print(f"CHECK {name} {'pass' if everyone else 'fail'} {time.monotonic() - t0:.1f}s "
                  f"{detail}", flush=True)
        if not everyone and name == "reinit_fresh_store":
            break
    if rank == 0:
        print(f"DONE {job} {passed}/{len(checks)}", flush=True)
    dist.barrier(group=AGREE)
    os._exit(0 if passed == len([c for c in checks if not only or c[0] in only.split(",")])
             else 1)


if __name__ == "__main__":
    main()
