"""Multi-rank worker for tests/test_torch_backend.py: the r2comm torch.distributed backend
against Gloo in the same job.

Launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: env:// rendezvous, TCPStore) or by
mpiexec (PMI_RANK/PMI_SIZE from MPICH's launcher and a FileStore at $R2T_STORE; no MPI_Init).
`python torch_worker.py SCENARIO` prints `OK SCENARIO <checks>` on rank 0 when every check
passed on every rank, and exits non-zero otherwise."""
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm.torch  # noqa: E402,F401  (registers "r2comm")
from r2comm.errors import (R2commArgumentError, R2commError, R2commMismatchError,  # noqa: E402
                           R2commTimeout)

warnings.filterwarnings("ignore", category=FutureWarning)   # all_gather_into_tensor's new name
R = dist.ReduceOp
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def init():
    timeout = datetime.timedelta(seconds=float(os.environ.get("R2T_TIMEOUT", "60")))
    if "RANK" in os.environ:                                  # torchrun: env://
        dist.init_process_group("r2comm", timeout=timeout)
    else:                                                     # mpiexec: a FileStore
        rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
        dist.init_process_group("r2comm", init_method="file://" + os.environ["R2T_STORE"],
                                rank=rank, world_size=size, timeout=timeout)
    assert dist.get_backend() == "r2comm", dist.get_backend()
    return dist.get_rank(), dist.get_world_size()


class Checker:
    def __init__(self, rank, gloo):
        self.rank, self.count, self.notes = rank, 0, set()
        self.gloo = gloo          # the same ranks under Gloo: the reference

    def equal(self, got, want, what, exact=True):
        self.count += 1
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(f"rank {self.rank} {what}: {got.dtype}{tuple(got.shape)} != "
                                 f"{want.dtype}{tuple(want.shape)}")
        if exact:
            a = got.contiguous().view(-1)
            b = want.contiguous().view(-1)
            if got.dtype.is_floating_point:      # bitwise, as integers of the same width
                width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
                a, b = a.view(width), b.view(width)
            if not torch.equal(a, b):
                raise AssertionError(f"rank {self.rank} {what}: {got.tolist()} != {want.tolist()}")
        else:
            tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                                       msg=lambda m: f"rank {self.rank} {what}: {m}")


def data(rank, dtype, case, n=7, lo=0, hi=4, shape=None):
    """The same small-integer tensor for (rank, dtype, case) on every rank: sums, products,
    minima and maxima of it are exact in every dtype, so r2comm and Gloo agree bitwise."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * case + 3)
    t = torch.randint(lo, hi, (n,) if shape is None else shape, generator=g)
    return t.bool() if dtype == torch.bool else t.to(dtype)


def ref_reduce(tensors, op, dtype):
    """A local reference for dtypes/ops Gloo lacks, in float64/int64."""
    if dtype == torch.bool:
        stack = torch.stack([t.to(torch.uint8) for t in tensors])
        out = stack.amax(0) if op in (R.SUM, R.MAX) else stack.amin(0)
        return out.bool()
    stack = torch.stack([t.double() if dtype.is_floating_point else t.long() for t in tensors])
    out = {R.SUM: lambda s: s.sum(0), R.PRODUCT: lambda s: s.prod(0),
           R.MIN: lambda s: s.amin(0), R.MAX: lambda s: s.amax(0),
           R.AVG: lambda s: s.sum(0) / len(tensors)}[op](stack)
    return out.to(dtype)


def gloo_or(fn, fallback, ck, what):
    """Gloo's result, or the local reference where Gloo does not support the case."""
    try:
        return fn()
    except RuntimeError as exc:
        ck.notes.add(f"{what}: local reference ({str(exc).splitlines()[0][:60]})")
        return fallback()


def scenario_collectives(rank, size, ck):
    gloo = ck.gloo
    case = 0
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    for dtype in DTYPES:
        for op in ops + ([R.AVG] if dtype in FLOATS else []):
            case += 1
            hi = 3 if op == R.PRODUCT else 4
            lo = 1 if op == R.PRODUCT else 0
            t = data(rank, dtype, case, lo=lo, hi=hi)
            ours = t.clone()
            dist.all_reduce(ours, op=op)
            everyone = [data(r, dtype, case, lo=lo, hi=hi) for r in range(size)]

            def with_gloo():
                g = t.clone()
                if op == R.AVG:                       # Gloo has no AVG: SUM / size
                    dist.all_reduce(g, op=R.SUM, group=gloo)
                    return g / size
                dist.all_reduce(g, op=op, group=gloo)
                return g
            want = gloo_or(with_gloo, lambda: ref_reduce(everyone, op, dtype), ck,
                           f"allreduce {dtype} {op}")
            # AVG of small integers: a quotient, exact only when the division is
            ck.equal(ours, want, f"allreduce {dtype} {op}", exact=op != R.AVG)
        # broadcast from the last rank
        case += 1
        b = data(rank, dtype, case)
        dist.broadcast(b, src=size - 1)
        ck.equal(b, data(size - 1, dtype, case), f"broadcast {dtype}")
        # reduce to rank 1 % size (non-roots keep their input)
        for op in (R.SUM, R.MAX):
            case += 1
            t = data(rank, dtype, case)
            root = 1 % size
            ours = t.clone()
            dist.reduce(ours, dst=root, op=op)
            if rank == root:
                ck.equal(ours, ref_reduce([data(r, dtype, case) for r in range(size)], op, dtype),
                         f"reduce {dtype} {op}")
        # all_gather (list) and all_gather_into_tensor
        case += 1
        t = data(rank, dtype, case)
        outs = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(outs, t)

        def ag_gloo():
            outs = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(outs, t, group=gloo)
            return outs
        g_outs = gloo_or(ag_gloo, lambda: [data(r, dtype, case) for r in range(size)], ck,
                         f"all_gather {dtype}")
        for i in range(size):
            ck.equal(outs[i], g_outs[i], f"all_gather {dtype} [{i}]")
        big = torch.empty(size * t.numel(), dtype=dtype)
        dist.all_gather_into_tensor(big, t)
        ck.equal(big, torch.cat(g_outs), f"all_gather_into_tensor {dtype}")
        # reduce_scatter (list) and reduce_scatter_tensor
        for op in (R.SUM, R.MAX):
            case += 1
            ins = [data(rank, dtype, case * 10 + j) for j in range(size)]
            out = torch.empty_like(ins[0])
            dist.reduce_scatter(out, [x.clone() for x in ins], op=op)
            want = ref_reduce([data(r, dtype, case * 10 + rank) for r in range(size)], op, dtype)

            def rs_gloo():
                o = torch.empty_like(ins[0])
                dist.reduce_scatter(o, [x.clone() for x in ins], op=op, group=gloo)
                return o
            ck.equal(out, gloo_or(rs_gloo, lambda: want, ck, f"reduce_scatter {dtype}"),
                     f"reduce_scatter {dtype} {op}")
            out2 = torch.empty_like(ins[0])
            dist.reduce_scatter_tensor(out2, torch.cat(ins), op=op)
            ck.equal(out2, want, f"reduce_scatter_tensor {dtype} {op}")
        # all_to_all (list, equal) and all_to_all_single (equal and uneven)
        case += 1
        ins = [data(rank, dtype, case * 10 + j, n=3) for j in range(size)]
        outs = [torch.empty_like(ins[0]) for _ in range(size)]
        dist.all_to_all(outs, ins)
        for j in range(size):
            ck.equal(outs[j], data(j, dtype, case * 10 + rank, n=3), f"all_to_all {dtype} [{j}]")
        flat = torch.cat(ins)
        out = torch.empty_like(flat)
        dist.all_to_all_single(out, flat)

        def a2a_gloo():
            o = torch.empty_like(flat)
            dist.all_to_all_single(o, flat, group=gloo)
            return o
        ck.equal(out, gloo_or(a2a_gloo, lambda: torch.cat(outs), ck, f"all_to_all_single {dtype}"),
                 f"all_to_all_single {dtype}")
        # uneven: rank r sends (r + j) % 3 rows of width 2 to rank j
        case += 1
        isp = [(rank + j) % 3 for j in range(size)]
        osp = [(j + rank) % 3 for j in range(size)]
        src = data(rank, dtype, case, shape=(sum(isp), 2))
        out = torch.empty((sum(osp), 2), dtype=dtype)
        dist.all_to_all_single(out, src, osp, isp)

        def uneven_gloo():
            o = torch.empty((sum(osp), 2), dtype=dtype)
            dist.all_to_all_single(o, src, osp, isp, group=gloo)
            return o

        def uneven_ref():
            parts = []
            for j in range(size):
                s = data(j, dtype, case, shape=(sum((j + k) % 3 for k in range(size)), 2))
                start = sum((j + k) % 3 for k in range(rank))
                parts.append(s[start:start + (j + rank) % 3])
            return torch.cat(parts)
        ck.equal(out, uneven_ref(), f"all_to_all_single uneven {dtype}")
        ck.equal(out, gloo_or(uneven_gloo, uneven_ref, ck, f"a2a uneven {dtype}"),
                 f"all_to_all_single uneven {dtype} (gloo)")
        # send/recv around the ring
        case += 1
        if size > 1:
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            got = torch.empty(5, dtype=dtype)
            reqs = [dist.isend(data(rank, dtype, case, n=5), nxt, tag=7),
                    dist.irecv(got, prv, tag=7)]
            for r in reqs:
                r.wait()
            ck.equal(got, data(prv, dtype, case, n=5), f"send/recv {dtype}")
    # non-contiguous tensors: a transposed matrix and a strided slice
    m = data(rank, torch.float32, 999, shape=(4, 6)).t()
    g = m.clone()
    dist.all_reduce(m)
    dist.all_reduce(g, group=gloo)
    ck.equal(m, g, "allreduce transposed")
    base = data(rank, torch.int32, 998, shape=(4, 6))
    view = base[:, ::2]
    dist.all_reduce(view)
    want = ref_reduce([data(r, torch.int32, 998, shape=(4, 6)) for r in range(size)], R.SUM,
                      torch.int32)
    ck.equal(base[:, ::2], want[:, ::2], "allreduce strided slice")
    ck.equal(base[:, 1::2], data(rank, torch.int32, 998, shape=(4, 6))[:, 1::2],
             "strided slice leaves the rest alone")
    # random floats: tolerance (the reduction orders differ)
    for dtype in FLOATS:
        x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)).to(dtype)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        ck.equal(a, b, f"allreduce random {dtype}", exact=False)
    # a large message (several chunks) and a sub-group
    big = torch.randint(0, 100, (300_000,), generator=torch.Generator().manual_seed(rank))
    a, b = big.clone(), big.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    ck.equal(a, b, "allreduce 2.4 MB int64")
    members = list(range(1, size)) if size > 2 else [0, 1]
    sub = dist.new_group(members)
    gsub = dist.new_group(members, backend="gloo")
    if rank in members:
        a = data(rank, torch.float64, 555)
        b = a.clone()
        dist.all_reduce(a, group=sub)
        dist.all_reduce(b, group=gsub)
        ck.equal(a, b, "new_group allreduce")
        c = data(rank, torch.int64, 556)
        dist.broadcast(c, group_src=0, group=sub)
        ck.equal(c, data(members[0], torch.int64, 556), "new_group broadcast")
    dist.barrier()


def scenario_async(rank, size, ck):
    """Many operations in flight at once, waited for in reverse and shuffled order."""
    works, expect = [], []
    for i in range(8):
        t = data(rank, torch.int64, i, n=1000 * (i + 1))
        works.append(dist.all_reduce(t, async_op=True))
        expect.append((t, ref_reduce([data(r, torch.int64, i, n=1000 * (i + 1))
                                      for r in range(size)], R.SUM, torch.int64)))
    b = data(rank, torch.float32, 50)
    works.append(dist.broadcast(b, src=0, async_op=True))
    expect.append((b, data(0, torch.float32, 50)))
    out = torch.empty(size * 5, dtype=torch.int32)
    works.append(dist.all_gather_into_tensor(out, data(rank, torch.int32, 51, n=5),
                                             async_op=True))
    expect.append((out, torch.cat([data(r, torch.int32, 51, n=5) for r in range(size)])))
    order = list(reversed(range(len(works))))
    order = order[1::2] + order[0::2]
    for i in order:
        assert works[i].wait() is True
        assert works[i].is_completed()
        ck.equal(*expect[i], f"async op {i}")
    # futures complete by themselves (what DDP relies on)
    t = data(rank, torch.float64, 60)
    fut = dist.all_reduce(t, async_op=True).get_future()
    res = fut.wait()
    ck.equal(res[0], ref_reduce([data(r, torch.float64, 60) for r in range(size)], R.SUM,
                                torch.float64), "future value")


def scenario_errors(rank, size, ck):
    """Bad arguments raise R2commArgumentError at the call; a mismatch between ranks and a
    timeout surface from Work.wait() as r2comm's exceptions."""
    for bad, what in ((lambda: dist.all_reduce(torch.ones(3), op=R.BAND), "BAND"),
                      (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG),
                       "integer AVG"),
                      (lambda: dist.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)),
                       "float8 SUM")):
        try:
            bad()
        except R2commArgumentError:
            ck.count += 1
        else:
            raise AssertionError(f"{what}: no R2commArgumentError")
    dist.barrier()
    # a receive nobody answers: R2commTimeout from wait(), within the communicator's timeout
    pg = dist.distributed_c10d._get_default_group()
    pg.comm.timeout = 2.0
    if rank == 0:
        w = dist.irecv(torch.empty(4), src=size - 1, tag=99)
        t0 = time.monotonic()
        try:
            w.wait()
        except R2commTimeout:
            ck.count += 1
            assert time.monotonic() - t0 < 30
        else:
            raise AssertionError("irecv without a sender: no R2commTimeout")
    pg.comm.timeout = 30.0
    dist.barrier()
    # ranks that disagree on the size: R2commMismatchError (or a timeout) from wait()
    t = torch.ones(100 if rank == 0 else 200)
    w = dist.all_reduce(t, async_op=True)
    try:
        w.wait()
    except (R2commMismatchError, R2commTimeout) as exc:
        assert isinstance(exc, R2commError)
        ck.count += 1
        ck.notes.add(f"mismatch: {type(exc).__name__}")
    else:
        raise AssertionError("mismatched allreduce: no error from Work.wait()")


def tiny_model():
    """R2T_WIDTH sets the hidden width (32: 1.7 K parameters, every bucket one small chunk)."""
    torch.manual_seed(0)
    w = int(os.environ.get("R2T_WIDTH", "32"))
    return torch.nn.Sequential(torch.nn.Linear(16, w), torch.nn.Tanh(),
                               torch.nn.Linear(w, w), torch.nn.Tanh(), torch.nn.Linear(w, 4))


def train(group, steps, rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(tiny_model(), process_group=group,
                bucket_cap_mb=float(os.environ.get("R2T_BUCKET_MB", "0.005")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    # R2T_FAIL="a:b": rank 1 fails its rail 0 for real (hard) before step a, restores it before b
    fail = [int(v) for v in os.environ.get("R2T_FAIL", "-1:-1").split(":")]
    comm = dist.distributed_c10d._get_default_group().comm if group is None else None
    # R2T_GATE="DIR:a,b": before steps a and b rank 0 prints "GATE a" and waits (bounded) for
    # DIR/go.a, so that a test acting on the testbed between steps is never overtaken by output lag
    gate_dir, _, gate_steps = os.environ.get("R2T_GATE", "").partition(":")
    gates = {int(v) for v in gate_steps.split(",") if v}
    for step in range(steps):
        if rank == 0 and step in gates:
            print(f"GATE {step}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(gate_dir, f"go.{step}")):
                assert time.monotonic() < deadline, f"nobody opened gate {step}"
                time.sleep(0.02)
        if comm is not None and rank == 1 and step == fail[0]:
            comm.fail_rail(0, "hard")
        if comm is not None and rank == 1 and step == fail[1]:
            comm.restore_rail(0)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, group=group)
        losses.append(reduced.item())
        if os.environ.get("R2T_PRINT_STEPS") and rank == 0:
            sent = " ".join(str(r.bytes_sent) for r in comm.rails) if comm is not None else ""
            print(f"STEP {step} {sent}", flush=True)   # the test injects failures between steps
        time.sleep(float(os.environ.get("R2T_STEP_SLEEP", "0")))
    return model.module, losses


def scenario_ddp(rank, size, ck):
    steps = int(os.environ.get("R2T_STEPS", "6"))
    m_r2, losses = train(None, steps, rank, size)
    if os.environ.get("R2T_NO_GLOO") != "1":
        m_gl, _ = train(ck.gloo, steps, rank, size)
        for (n, p), q in zip(m_r2.named_parameters(), m_gl.parameters()):
            ck.equal(p.detach(), q.detach(), f"DDP parameter {n}", exact=False)
    events = [e for e in dist.distributed_c10d._get_default_group().comm.events
              if e["kind"] != "up"]
    total = torch.tensor([len(events)])
    dist.all_reduce(total)                    # failover events of every rank
    if rank == 0:                             # one write: lines of other ranks cannot split it
        sys.stdout.write("LOSSES " + " ".join(v.hex() for v in losses) +
                         f"\nEVENTS {int(total.item())}\n")
        sys.stdout.flush()


def main():
    scenario = sys.argv[1]
    rank, size = init()
    no_gloo = os.environ.get("R2T_NO_GLOO") == "1"
    ck = Checker(rank, None if no_gloo else dist.new_group(backend="gloo"))
    globals()["scenario_" + scenario](rank, size, ck)
    counts = torch.tensor([ck.count])
    dist.all_reduce(counts, op=R.MIN, group=ck.gloo)
    if rank == 0:
        for n in sorted(ck.notes):
            print("NOTE", n)
        print(f"OK {scenario} {int(counts.item())}", flush=True)
    if scenario != "errors":
        dist.destroy_process_group()
    os._exit(0)   # the errors scenario may leave operations to peers behind


if __name__ == "__main__":
    main()
