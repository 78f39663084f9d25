"""The torch backend's lean-call helper (r2comm/torch/lean.py, _lean.cpp), in one process: it
builds against the installed torch, and its probe takes exactly the calls the lean all_reduce
may run (one plain, dense, contiguous CPU tensor without autograd, synchronous options),
copying the tensor's bytes to the scratch, and nothing else. Multi-rank results through it:
tests/test_torch_backend.py::test_lean_all_reduce_on_changing_memory."""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from r2comm.torch import lean  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def helper():
    module = lean.build()        # the test environment has a C++ compiler: a failure fails
    module.init(dist.AllreduceOptions)
    return module


def _opts(op=dist.ReduceOp.SUM, async_op=False):
    o = dist.AllreduceOptions()
    o.reduceOp, o.asyncOp = op, async_op
    return o


def test_probe_takes_a_plain_tensor_and_copies_it(helper):
    scratch = np.zeros(64, np.uint8)
    t = torch.arange(6, dtype=torch.float32)
    key = helper.probe([t], _opts(dist.ReduceOp.MAX), scratch.ctypes.data, scratch.nbytes)
    assert key is not None
    address, nbytes, code = key
    assert (address, nbytes) == (t.data_ptr(), 24)
    assert code & 255 == int(dist.ReduceOp.MAX)
    assert bytes(scratch[:24]) == t.numpy().tobytes() and not scratch[24:].any()
    view = t[2:4]                                   # an offset view: its own address
    assert helper.probe([view], _opts(), scratch.ctypes.data, 64)[:2] == (view.data_ptr(), 8)
    codes = {helper.probe([torch.zeros(1, dtype=d)], _opts(), scratch.ctypes.data, 64)[2] >> 8
             for d in (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                       torch.int32, torch.int64, torch.uint8)}
    assert len(codes) == 8                          # one scalar-type code per dtype


def test_probe_refuses_what_the_lean_path_does_not_cover(helper):
    scratch = np.full(64, 7, np.uint8)
    at, room = scratch.ctypes.data, scratch.nbytes
    plain = torch.ones(4)
    refused = {
        "asynchronous": ([plain], _opts(async_op=True), at, room),
        "two tensors": ([plain, plain], _opts(), at, room),
        "a tuple": ((plain,), _opts(), at, room),
        "other options": ([plain], dist.BroadcastOptions(), at, room),
        "autograd": ([torch.ones(4, requires_grad=True)], _opts(), at, room),
        "not contiguous": ([torch.ones(8)[::2]], _opts(), at, room),
        "negative view": ([torch._neg_view(torch.ones(4))], _opts(), at, room),
        "conjugate view": ([torch.ones(2, dtype=torch.complex64).conj()], _opts(), at, room),
        "sparse": ([torch.ones(4).to_sparse()], _opts(), at, room),
        "a subclass": ([torch.ones(4).as_subclass(_Sub)], _opts(), at, room),
        "empty": ([torch.ones(0)], _opts(), at, room),
        "larger than the scratch": ([torch.ones(17)], _opts(), at, room),
        "no scratch": ([plain], _opts(), 0, room),
        "meta": ([torch.ones(4, device="meta")], _opts(), at, room),
    }
    for what, args in refused.items():
        assert helper.probe(*args) is None, what
    assert (scratch == 7).all()                     # nothing copied by a refused call
    with pytest.raises(TypeError):
        helper.probe([plain], _opts())


class _Sub(torch.Tensor):
    pass


def test_probe_refuses_a_tensor_past_its_storage(helper):
    """A tensor whose storage was resized under it (torch allows it): its size says more bytes
    than the storage holds, and the probe leaves it to the general path (which raises: the
    backend's tests) instead of copying past the allocation. Old code: 16,000 floats with an
    8-byte storage passed, and 64,000 bytes were copied from it."""
    scratch = np.full(65536, 7, np.uint8)
    at, room = scratch.ctypes.data, scratch.nbytes
    big = torch.ones(16000)
    big.untyped_storage().resize_(8)
    base = torch.ones(16)
    view = base[8:]                                 # offset 32 bytes, 32 bytes long
    base.untyped_storage().resize_(40)
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)              # as FSDP frees a parameter's storage
    for what, t in {"shrunk": big, "offset view": view, "freed": freed}.items():
        assert helper.probe([t], _opts(), at, room) is None, what
    assert (scratch == 7).all()
    fits = torch.ones(16)[8:]                       # the same view, its storage whole: taken
    assert helper.probe([fits], _opts(), at, room)[:2] == (fits.data_ptr(), 32)


def test_probe_of_a_parameter(helper):
    """nn.Parameter is the plain class for THPVariable_CheckExact: taken when it needs no grad."""
    scratch = np.zeros(16, np.uint8)
    p = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert helper.probe([p], _opts(), scratch.ctypes.data, 16) is not None


def test_cache_folder_and_switch(tmp_path):
    """R2COMM_CACHE_DIR places the build; R2COMM_TORCH_LEAN=0 never builds (the backend's
    Python path); a wrong value is an error."""
    code = ("import os, sys; from r2comm.torch import lean; m = lean.helper(); "
            "print(m is None, lean.cache_dir().startswith(sys.argv[1]))")
    env = dict(os.environ, R2COMM_CACHE_DIR=str(tmp_path), R2COMM_TORCH_LEAN="0")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert not os.listdir(tmp_path)
    env["R2COMM_TORCH_LEAN"] = "sometimes"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "R2COMM_TORCH_LEAN='sometimes'" in out.stderr
