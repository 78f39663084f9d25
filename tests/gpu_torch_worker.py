"""torchrun worker for tests/test_gpu.py: the r2comm torch backend with CUDA tensors, which go
through r2comm's device pipeline (cupy views). Checks against values computed on the CPU and
that the pipeline (not the host copy) was used. Prints `OK torch_cuda <checks>` on rank 0."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm.torch  # noqa: E402,F401

dist.init_process_group("r2comm", timeout=datetime.timedelta(seconds=120))
rank, n = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
checks = 0


def inputs(k, count, dtype):
    g = torch.Generator().manual_seed(1000 * k + count)
    return torch.randint(0, 50, (count,), generator=g).to(dtype)


for dtype in (torch.float32, torch.float16, torch.int32, torch.bfloat16):
    for count in (1, 1000, 3 << 20):
        x = inputs(rank, count, dtype).to(dev)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):            # a non-default stream: torch's current one
            y = x * 1
            dist.all_reduce(y)
            z = y + 0                          # queued after the collective on that stream
        s.synchronize()
        want = sum(inputs(k, count, dtype).double() for k in range(n))
        assert torch.equal(z.cpu().double(), want), (dtype, count)
        checks += 1
        if dtype.is_floating_point:
            y = x.clone()
            dist.all_reduce(y, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            assert torch.allclose(y.cpu().double(), want / n, rtol=1e-2), (dtype, count, "avg")
            checks += 1
    b = inputs(rank, 5000, dtype).to(dev)
    dist.broadcast(b, src=1 % n)
    torch.cuda.synchronize()
    assert torch.equal(b.cpu(), inputs(1 % n, 5000, dtype))
    out = torch.empty(n * 777, dtype=dtype, device=dev)
    dist.all_gather_into_tensor(out, inputs(rank, 777, dtype).to(dev))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.cat([inputs(k, 777, dtype) for k in range(n)]))
    rs = torch.empty(999, dtype=dtype, device=dev)
    dist.reduce_scatter_tensor(rs, inputs(rank, n * 999, dtype).to(dev))
    torch.cuda.synchronize()
    full = sum(inputs(k, n * 999, dtype).double() for k in range(n))
    assert torch.equal(rs.cpu().double(), full[rank * 999:(rank + 1) * 999])
    a2a = torch.empty(n * 64, dtype=dtype, device=dev)
    dist.all_to_all_single(a2a, inputs(rank, n * 64, dtype).to(dev))
    torch.cuda.synchronize()
    assert torch.equal(a2a.cpu(), torch.cat([inputs(k, n * 64, dtype)[rank * 64:(rank + 1) * 64]
                                             for k in range(n)]))
    checks += 4
info = r2comm.torch.communicator().gpu_info()
assert info["backend"] == "cupy" and info["calls"] >= checks, info
tot = torch.tensor([checks])
dist.all_reduce(tot)
if rank == 0:
    print(f"OK torch_cuda {int(tot)} {info}", flush=True)
dist.destroy_process_group()
