"""Multi-rank worker for tests/test_torch_backend.py: the r2comm torch.distributed backend
against Gloo in the same job.

Launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: env:// rendezvous, TCPStore) or by
mpiexec (PMI_RANK/PMI_SIZE from MPICH's launcher and a FileStore at $R2T_STORE; no MPI_Init).
`python torch_worker.py SCENARIO` prints `OK SCENARIO <checks>` on rank 0 when every check
passed on every rank, and exits non-zero otherwise."""
import collections
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm.torch  # noqa: E402,F401  (registers "r2comm")
from r2comm.errors import (R2commArgumentError, R2commBufferError,  # noqa: E402
                           R2commClosedError, R2commError, R2commMismatchError, R2commTimeout)

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
    # a synchronous call on some ranks, asynchronous on the others: the same call
    for i, n in enumerate((2, 3000)):
        t = data(rank, torch.float32, 70 + i, n=n)
        if rank % 2:
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
        ck.equal(t, ref_reduce([data(r, torch.float32, 70 + i, n=n) for r in range(size)],
                               R.SUM, torch.float32), f"sync with async, {n} floats",
                 exact=False)
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
    comm = r2comm.torch.communicator()
    comm.timeout = 2.0
    if rank == 0:
        w = dist.irecv(torch.empty(4), src=size - 1, tag=99)
        t0 = time.monotonic()
        try:
            w.wait()
        except R2commTimeout as exc:          # r2comm's class, and torch's as well
            assert isinstance(exc, dist.DistBackendError) and isinstance(exc, RuntimeError), \
                type(exc).__mro__
            assert "timed out" in str(exc), str(exc)
            assert isinstance(exc.__cause__, R2commTimeout)
            ck.count += 1
            assert time.monotonic() - t0 < 30
        else:
            raise AssertionError("irecv without a sender: no R2commTimeout")
    comm.timeout = 30.0
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
    dist.barrier()
    # a group whose communicator was freed: an error raised at the call is torch's type too
    sub = dist.new_group(list(range(size)))
    r2comm.torch.communicator(sub).Free()
    for call, what in ((lambda: dist.all_reduce(torch.ones(3), group=sub), "all_reduce"),
                       (lambda: dist.all_reduce(torch.ones(3), group=sub, async_op=True).wait(),
                        "async all_reduce"),
                       (lambda: dist.broadcast(torch.ones(3), 0, group=sub), "broadcast"),
                       (lambda: dist.all_gather_into_tensor(torch.empty(3 * size), torch.ones(3),
                                                            group=sub), "all_gather")):
        try:
            call()
        except R2commClosedError as exc:
            assert isinstance(exc, dist.DistBackendError), (what, type(exc).__mro__)
            assert isinstance(exc.__cause__, R2commClosedError), what
            ck.count += 1
        else:
            raise AssertionError(f"{what} on a freed group: no R2commClosedError")
    dist.barrier()


def scenario_modern(rank, size, ck):
    """What torch's own machinery needs of a backend: group names and descriptions, functional
    collectives eager and under torch.compile, a DeviceMesh with DTensor (scatter), sub-groups
    destroyed and made again; each result compared with Gloo's."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    world = dist.group.WORLD
    assert world.group_name and isinstance(world.group_name, str)
    assert dist.get_backend(world) == "r2comm"
    # (torch's ProcessGroup answers sequence numbers for its own backends only: the
    # backend's own count, as Gloo's)
    backend = r2comm.torch.native_backend()
    before = backend._get_sequence_number_for_group()
    dist.barrier()
    assert backend._get_sequence_number_for_group() == before + 1
    ck.count += 1
    t = data(rank, torch.float32, 1, n=8)
    want = t.clone()
    dist.all_reduce(want, group=ck.gloo)
    ck.equal(fc.all_reduce(t, "sum", world).wait(), want, "funcol all_reduce")
    gathered = torch.empty(size * 8)
    dist.all_gather_into_tensor(gathered, t, group=ck.gloo)
    ck.equal(fc.all_gather_tensor(t, 0, world).wait(), gathered, "funcol all_gather_tensor")
    big = data(rank, torch.float32, 2, n=8 * size)
    rs = torch.empty(8)
    dist.reduce_scatter_tensor(rs, big.clone(), group=ck.gloo)
    ck.equal(fc.reduce_scatter_tensor(big, "sum", 0, world).wait(), rs, "funcol reduce_scatter")
    ck.equal(torch.cat(fc.all_gather_into_tensor_coalesced([t, t * 2], world)),
             torch.cat([gathered, gathered * 2]), "funcol all_gather coalesced")

    def step(x):
        y = fc.all_reduce(x * 2, "sum", world)
        return fc.all_gather_tensor(y + 1, 0, world)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    ck.equal(compiled(t), step(t).wait(), "torch.compile(aot_eager) funcol")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    assert mesh.get_group("dp").group_name
    full = data(0, torch.float32, 3, shape=(2 * size, 3))
    dt = distribute_tensor(full, mesh, [Shard(0)])            # scatter from rank 0
    ck.equal(dt.to_local(), full[2 * rank:2 * rank + 2], "DTensor Shard(0) local part")
    ck.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full, "DTensor redistribute")
    for _ in range(3):                                          # made, used, destroyed
        sub = dist.new_group(list(range(size)))
        x = t.clone()
        dist.all_reduce(x, group=sub)
        ck.equal(x, want, f"sub-group {sub.group_name} all_reduce")
        dist.destroy_process_group(sub)
    assert world.group_name in dist.distributed_c10d._world.pg_names.values()


def _counted_step(rank, size, group):
    """One step of collectives on `group` under CommDebugMode and torch's profiler: (the
    counts by op, the c10d ops the profiler saw, the results)."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.profiler import ProfilerActivity, profile
    mode = CommDebugMode()
    res = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        t = data(rank, torch.float32, 41, n=4 * size)
        dist.all_reduce(t, group=group)
        res["all_reduce"] = t.clone()
        out = torch.empty(4 * size * size)
        dist.all_gather_into_tensor(out, t, group=group)
        res["all_gather_into_tensor"] = out
        rs = torch.empty(4)
        dist.reduce_scatter_tensor(rs, t.clone(), group=group)
        res["reduce_scatter_tensor"] = rs
        for op in (R.BAND, R.BOR, R.BXOR):
            ints = data(rank, torch.int32, 42, n=3 * size, hi=16)
            got = torch.empty(3, dtype=torch.int32)
            dist.reduce_scatter_tensor(got, ints, op=op, group=group)
            res[f"reduce_scatter_tensor {op}"] = got
        b = t.clone() if rank == 0 else torch.zeros_like(t)
        dist.broadcast(b, 0, group=group)
        res["broadcast"] = b
        lst = [torch.empty(4 * size) for _ in range(size)]
        dist.all_gather(lst, t, group=group)
        res["all_gather"] = torch.cat(lst)
        a2a = torch.empty(4 * size)
        dist.all_to_all_single(a2a, t, group=group)
        res["all_to_all_single"] = a2a
        res["funcol all_reduce"] = fc.all_reduce(t, "sum", group).wait()
        dist.barrier(group=group)
    counts = {str(k): v for k, v in mode.get_comm_counts().items()}
    seen = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            seen[e.name] = seen.get(e.name, 0) + 1
    return counts, seen, res


def scenario_debug_counts(rank, size, ck):
    """CommDebugMode's counts and the profiler's c10d ops of one step (all_reduce,
    all_gather(_into_tensor), reduce_scatter_tensor with SUM and BAND/BOR/BXOR, broadcast,
    all_to_all_single, a functional all_reduce, barrier) equal Gloo's for the same step, and so
    do the results; then an FSDP2 step (two micro-batches, gradient accumulation) counts as
    many all_gathers and reduce_scatters on both."""
    ours, gloo = _counted_step(rank, size, dist.group.WORLD), _counted_step(rank, size, ck.gloo)
    print(f"COUNTS rank {rank} r2comm {ours[0]} gloo {gloo[0]}", flush=True)
    assert ours[0] == gloo[0], (ours[0], gloo[0])
    assert ours[0].get("c10d.allreduce_") == 1 and ours[0].get("c10d._allgather_base_") == 1 \
        and ours[0].get("c10d._reduce_scatter_base_") == 4, ours[0]
    assert ours[1] == gloo[1] and ours[1].get("c10d::allreduce_"), (ours[1], gloo[1])
    ck.count += 2
    for what, want in gloo[2].items():
        ck.equal(ours[2][what], want, f"counted step: {what}")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    def fsdp_counts(group):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 8))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        g = torch.Generator().manual_seed(7 + rank)
        counts = {}
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            mode = CommDebugMode()          # (one per forward: its module tracker's state)
            with mode:
                model(torch.randn(4, 16, generator=g)).sum().backward()
            for k, v in mode.get_comm_counts().items():
                counts[f"{micro}:{k}"] = v
        grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
        return counts, grads
    (c_ours, g_ours), (c_gloo, g_gloo) = fsdp_counts(dist.group.WORLD), fsdp_counts(ck.gloo)
    print(f"FSDP2 COUNTS rank {rank} r2comm {c_ours} gloo {c_gloo}", flush=True)
    assert c_ours == c_gloo and sum(c_ours.values()) > 0, (c_ours, c_gloo)
    ck.count += 1
    ck.equal(g_ours, g_gloo, "FSDP2 accumulated gradients", exact=False)


def scenario_shrink_abort(rank, size, ck):
    """dist.shrink_group: the backend says supports_shrinking; the ranks that stay (all but
    the last) make a group without it, whose all_reduce sums their tensors only and whose
    calls run on r2comm; the excluded rank takes no part. Then a group's abort(): a Work in
    flight (its peer never joins) ends at once with torch's error type (DistBackendError,
    R2commClosedError) instead of waiting for the timeout, and a later call on the group
    raises at the call. (The abort's group is made before the shrink: on torch 2.14 a
    new_group made after a shrink_group did not meet on the excluded rank, which waited for
    store keys the others never wrote; 2.10 and 2.13 met.)"""
    parent = dist.new_group(list(range(size)))
    sub = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=60))
    assert r2comm.torch.native_backend(parent).supports_shrinking
    ck.count += 1
    if rank < size - 1:
        small = dist.shrink_group([size - 1], group=parent)
        assert small.size() == size - 1 and small.rank() == rank, (small.size(), small.rank())
        assert dist.get_backend(small) == "r2comm", dist.get_backend(small)
        c = r2comm.torch.communicator(small)       # the shrunk group's own Communicator
        assert c.size == size - 1 and c.rank == rank and c is not r2comm.torch.communicator(parent)
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t, group=small)
        ck.equal(t, torch.full((5,), float(sum(range(1, size)))), "all_reduce on the shrunk group")
        dist.destroy_process_group(small)
    else:
        ck.count += 1                  # (the excluded rank: nothing to check)
    dist.barrier(group=ck.gloo)
    if rank == 0:
        w = dist.all_reduce(torch.ones(3), group=sub, async_op=True)   # nobody joins it
        time.sleep(0.5)
        t0 = time.monotonic()
        sub.abort()
        try:
            w.wait()
        except dist.DistBackendError as exc:
            assert isinstance(exc, R2commClosedError), type(exc).__mro__
        else:
            raise AssertionError("a Work of an aborted group ended without an error")
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        try:
            dist.all_reduce(torch.ones(3), group=sub)
        except dist.DistBackendError as exc:
            assert isinstance(exc, R2commClosedError), type(exc).__mro__
        else:
            raise AssertionError("a call on an aborted group did not raise")
    ck.count += 2
    dist.barrier(group=ck.gloo)


def scenario_newcolls(rank, size, ck):
    """gather, scatter, the object forms, all_gather_coalesced, coalesced tensor forms,
    BAND/BOR/BXOR, sparse all_reduce, recv without src, barrier(device_ids),
    batch_isend_irecv: each against Gloo in the same job."""
    gloo = ck.gloo
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        root = size - 1
        t = data(rank, dtype, 10)
        outs = [torch.empty_like(t) for _ in range(size)] if rank == root else None
        gouts = [torch.empty_like(t) for _ in range(size)] if rank == root else None
        dist.gather(t, outs, dst=root)
        dist.gather(t, gouts, dst=root, group=gloo)
        if rank == root:
            for i in range(size):
                ck.equal(outs[i], gouts[i], f"gather {dtype} from {i}")
        src = [data(i, dtype, 11) for i in range(size)] if rank == 0 else None
        o, g = torch.empty_like(t), torch.empty_like(t)
        dist.scatter(o, src, src=0)
        dist.scatter(g, src, src=0, group=gloo)
        ck.equal(o, g, f"scatter {dtype}")
    objs = [None] * size if rank == 0 else None
    dist.gather_object({"rank": rank, "x": [rank] * rank}, objs, dst=0)
    if rank == 0:
        assert objs == [{"rank": r, "x": [r] * r} for r in range(size)], objs
        ck.count += 1
    got = [None]
    dist.scatter_object_list(got, [f"to {r}" for r in range(size)] if rank == 0 else None,
                             src=0)
    assert got[0] == f"to {rank}", got
    ck.count += 1
    ins = [data(rank, torch.float32, 12, n=3), data(rank, torch.float32, 13, shape=(2, 5))]
    outs = [[torch.empty_like(i) for i in ins] for _ in range(size)]
    gouts = [[torch.empty_like(i) for i in ins] for _ in range(size)]
    dist.all_gather_coalesced(outs, ins)
    dist.all_gather_coalesced(gouts, ins, group=gloo)
    for r in range(size):
        for k in range(2):
            ck.equal(outs[r][k], gouts[r][k], f"all_gather_coalesced {r}.{k}")
    a, b = data(rank, torch.float32, 14, n=4), data(rank, torch.float32, 15, n=4)
    oa, ob = torch.empty(4 * size), torch.empty(4 * size)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(oa, a)
        dist.all_gather_into_tensor(ob, b)
    cm.wait()
    ck.equal(oa, torch.cat([data(r, torch.float32, 14, n=4) for r in range(size)]), "coalesced ag")
    ck.equal(ob, torch.cat([data(r, torch.float32, 15, n=4) for r in range(size)]), "coalesced ag 2")
    for dtype in (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool):
        for op in (R.BAND, R.BOR, R.BXOR):
            t = data(rank, dtype, 16, hi=16 if dtype != torch.bool else 2)
            ours, theirs = t.clone(), t.clone()
            dist.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op, group=gloo)
            ck.equal(ours, theirs, f"all_reduce {op} {dtype}")
            red = t.clone()
            dist.reduce(red, dst=0, op=op)
            if rank == 0:
                ck.equal(red, theirs, f"reduce {op} {dtype}")
    idx = torch.tensor([[rank, (rank + 1) % 4, 3]])
    sp = torch.sparse_coo_tensor(idx, torch.tensor([1.0 + rank, 2.0, 3.0]), (4,))
    ours, theirs = sp.clone(), sp.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    ck.equal(ours.to_dense(), theirs.to_dense(), "sparse all_reduce")
    sp2 = torch.sparse_coo_tensor(torch.tensor([[rank], [1]]), torch.tensor([[5.0, rank]]),
                                  (size, 3, 2))
    ours, theirs = sp2.clone(), sp2.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    ck.equal(ours.to_dense(), theirs.to_dense(), "sparse all_reduce (hybrid)")
    dist.barrier(device_ids=[0])
    ck.count += 1
    t = torch.full((3,), float(rank))
    if rank:                          # every rank to 0, received without src; 0 answers each
        dist.send(t + 10, dst=0, tag=5)
        src = dist.recv(t, tag=6)
        assert src == 0, src
        ck.equal(t, torch.full((3,), 20.0 + rank), "recv without src (the answer)")
    else:
        srcs = []
        for _ in range(size - 1):
            src = dist.recv(t, tag=5)                       # any source
            ck.equal(t, torch.full((3,), 10.0 + src), "recv without src")
            srcs.append(src)
            dist.send(t + 10, dst=src, tag=6)
        assert sorted(srcs) == list(range(1, size)), srcs
    if size % 2 == 0:                 # sub-groups of a sub-group (new_subgroups(group=))
        half = dist.new_group(list(range(size)))
        mine, _ = dist.new_subgroups(group_size=size // 2, group=half)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        first = rank - rank % (size // 2)
        ck.equal(t, torch.tensor([float(sum(range(first, first + size // 2)))]),
                 "new_subgroups(group=) all_reduce")
        objs = [None] * (size // 2) if rank == first else None
        dist.gather_object(rank * 10, objs, dst=first, group=mine)
        if rank == first:
            assert objs == [r * 10 for r in range(first, first + size // 2)], objs
            ck.count += 1
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    send, recv = torch.full((4,), float(rank)), torch.empty(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt),
                                   dist.P2POp(dist.irecv, recv, prv)])
    for r in reqs:
        r.wait()
    ck.equal(recv, torch.full((4,), float(prv)), "batch_isend_irecv ring")


def scenario_futures(rank, size, ck):
    """Future callbacks that start a collective and wait for it inside the callback (nested
    futures, as PowerSGD does), then DDP with the PowerSGD hook: equal to Gloo's."""
    t = data(rank, torch.float32, 20)

    def nested(fut):
        inner = fut.value()[0] * 2
        res = dist.all_reduce(inner, async_op=True).get_future().wait()[0]
        deeper = dist.all_reduce(res.clone(), async_op=True).get_future()
        return deeper.wait()[0] + 1
    outer = dist.all_reduce(t.clone(), async_op=True).get_future().then(nested)
    got = outer.wait()
    want = t.clone()
    dist.all_reduce(want, group=ck.gloo)
    want = want * 2
    dist.all_reduce(want, group=ck.gloo)
    dist.all_reduce(want, group=ck.gloo)
    ck.equal(got, want + 1, "nested futures", exact=False)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def powersgd_run(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 8))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, min_compression_rate=0.5,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return model
    ours, theirs = powersgd_run(None), powersgd_run(ck.gloo)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        ck.equal(p.detach(), q.detach(), f"PowerSGD DDP parameter {n}", exact=False)


def scenario_dropped(rank, size, ck):
    """300 async all_reduces dropped without a wait (as DDP's Join-aware forward may):
    the group keeps each operation's tensors alive until it ended; no crash, and the results
    the tensors still show are the sums."""
    import gc
    keep = []
    for i in range(300):
        n = 1 + (i * 37) % 5000
        t = torch.full((n,), float(rank + i))
        dist.all_reduce(t, async_op=True)             # Work dropped at once
        if i % 10 == 0:
            keep.append((i, n, t))
        del t
        if i % 50 == 0:
            gc.collect()
    dist.barrier()
    pg = dist.distributed_c10d._get_default_group()
    backend = r2comm.torch.native_backend()
    assert backend.pending_works > 0                     # some still in flight here
    pg._wait_for_pending_works()                         # torch's name for "complete them all"
    for i, n, t in keep:
        ck.equal(t, torch.full((n,), float(sum(r + i for r in range(size)))), f"dropped {i}")
    assert backend.pending_works == 0, backend.pending_works


def scenario_lean(rank, size, ck):
    """Synchronous small all_reduces (the native backend's copy-and-reduce path) on memory
    that changes under the same address: tensors freed and reallocated in other dtypes and
    sizes, views at an offset, a storage swapped by set_(), 300 tensors; a negative view ends
    as on Gloo (torch's dispatcher gives the backend a resolved copy)."""
    want = sum(r + 1 for r in range(size))
    for i in range(40):
        dt = (torch.float32, torch.int32, torch.float64, torch.uint8)[i % 4]
        t = torch.full((1 + i % 5,), rank + 1, dtype=dt)
        dist.all_reduce(t)
        ck.equal(t, torch.full((1 + i % 5,), want, dtype=dt), f"reallocated {i} {dt}")
        del t
    base = torch.zeros(8)
    for off in range(4):
        v = base[off:off + 3]
        v.fill_(rank + 1)
        dist.all_reduce(v, op=R.MAX)
        ck.equal(v, torch.full((3,), float(size)), f"view at offset {off}")
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    t.set_(torch.full((2,), float(rank + 2)).untyped_storage())
    dist.all_reduce(t, op=R.AVG)
    ck.equal(t, torch.full((2,), (want + size) / size), "storage swapped by set_")
    many = [torch.full((2,), float(rank + 1)) for _ in range(300)]
    for k in range(2):
        for m in many:
            dist.all_reduce(m)
    ck.equal(many[7], torch.full((2,), float(want * size)), "300 tensors twice")
    for _ in range(2):
        # (torch's dispatcher hands every backend a resolved copy of a negative view and does
        # not write it back: the view keeps its values, on Gloo as here)
        neg = torch._neg_view(torch.full((2,), float(rank + 1)))
        dist.all_reduce(neg)
        theirs = torch._neg_view(torch.full((2,), float(rank + 1)))
        dist.all_reduce(theirs, group=ck.gloo)
        ck.equal(neg.resolve_neg(), theirs.resolve_neg(), "a negative view, as on Gloo")
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    ck.equal(t, torch.full((2,), float(want)), "after the negative view")
    _lean_ops_and_paths(rank, size, ck)
    _past_storage(rank, size, ck)


def _past_storage(rank, size, ck):
    """Tensors that reach past their storage (resized under them, as FSDP frees a parameter's):
    all_reduce (lean-sized, probe-sized, an offset view, a freed storage) and broadcast raise
    R2commBufferError at the call on every rank instead of reading and writing past the
    allocation, and the next all_reduce lines up. Old code: the 16,000-float one was copied
    from its 8-byte storage by the helper's probe, then reduced in place past it."""
    def shrunk(n, keep):
        t = torch.full((n,), float(rank + 1))
        t.untyped_storage().resize_(keep)
        return t
    base = torch.full((16,), float(rank + 1))
    cases = {"16000 floats, 8 bytes": shrunk(16000, 8), "5 floats, 8 bytes": shrunk(5, 8),
             "freed": shrunk(4, 0), "offset view": base[8:]}
    base.untyped_storage().resize_(40)
    calls = {"all_reduce": dist.all_reduce, "broadcast": lambda t: dist.broadcast(t, src=0)}
    for what, t in cases.items():
        for call, fn in calls.items():
            try:
                fn(t)
            except R2commBufferError as exc:
                assert "past its storage" in str(exc), exc
            else:
                raise AssertionError(f"{call} of a tensor past its storage ({what}) ran")
        good = torch.full((3,), float(rank + 1))
        dist.all_reduce(good)
        ck.equal(good, torch.full((3,), float(sum(r + 1 for r in range(size)))),
                 f"after the refused {what}")


class _Sub(torch.Tensor):
    """A tensor subclass (not a plain tensor class)."""


def _lean_ops_and_paths(rank, size, ck):
    """Every dtype and op of the synchronous path against a local reference, with rank 1's
    calls asynchronous (the synchronous call matches them), and tensors of other shapes (a
    tensor subclass, autograd, not contiguous, large: in place, no copy)."""
    dtypes = [torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8]
    for case, dt in enumerate(dtypes):
        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX) + ((R.AVG,) if dt.is_floating_point else ()):
            t = data(rank, dt, case, n=5, lo=0, hi=3)
            ref = ref_reduce([data(r, dt, case, n=5, lo=0, hi=3) for r in range(size)], op, dt)
            if rank == 1:
                dist.all_reduce(t, op=op, async_op=True).wait()
            else:
                dist.all_reduce(t, op=op)
            ck.equal(t, ref, f"lean {dt} {op}", exact=op != R.AVG)
    ck.count += 1
    cases = {"subclass": torch.full((3,), float(rank + 1)).as_subclass(_Sub),
             "autograd": torch.full((3,), float(rank + 1), requires_grad=True),
             "strided": torch.full((6,), float(rank + 1))[::2],
             "large": torch.full((70000,), float(rank + 1))}
    for what, t in cases.items():
        with torch.no_grad():
            dist.all_reduce(t)
        ck.equal(t.detach(), torch.full(t.shape, float(sum(r + 1 for r in range(size)))),
                 f"general path: {what}")


def scenario_group_timeout(rank, size, ck):
    """A sub-group's own timeout (1 s) bounds its operations, not the world's; the error is
    torch's DistBackendError saying "timed out", and r2comm's R2commTimeout."""
    sub = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=1))
    dist.barrier(group=sub)
    ck.count += 1
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.barrier(group=sub)                      # nobody else comes
        except dist.DistBackendError as exc:
            took = time.monotonic() - t0
            assert isinstance(exc, R2commTimeout) and "timed out" in str(exc), repr(exc)
            assert took < 10, took
            ck.notes.add(f"sub-group barrier raised after {took:.1f} s")
            ck.count += 1
        else:
            raise AssertionError("barrier without peers: no error")


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
    comm = r2comm.torch.communicator() if group is None else None
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
    events = [e for e in r2comm.torch.communicator().events
              if e["kind"] != "up"]
    total = torch.tensor([len(events)])
    dist.all_reduce(total)                    # failover events of every rank
    if rank == 0:                             # one write: lines of other ranks cannot split it
        kinds = collections.Counter(e["kind"] for e in events)
        sys.stdout.write("LOSSES " + " ".join(v.hex() for v in losses) +
                         f"\nEVENTS {int(total.item())}\nEVENT_KINDS rank 0 {dict(kinds)} "
                         f"{[e['info'] for e in events[:4]]}\n")
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
    if scenario not in ("errors", "group_timeout"):
        dist.destroy_process_group()
    os._exit(0)   # the errors scenario may leave operations to peers behind


if __name__ == "__main__":
    main()
