"""The device-buffer staging pipeline (r2comm/gpu/pipeline.py) on the host stand-in device
(r2comm/gpu/standin.py): real multi-rank jobs under mpiexec, no GPU needed. What only a GPU can
show (the cupy backend, its kernels, real streams, speed) is in tests/test_gpu.py."""
import numpy as np
import pytest

from conftest import ROOT, run_mpi

WORKER = f"{ROOT}/tests/gpu_worker.py"


def scenario(n, name, env=None, limit=120, **kw):
    args = [f"{k}={v}" for k, v in kw.items()]
    rc, out = run_mpi(n, [WORKER, name] + args, timeout=limit, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {name} ")]
    assert lines, f"{name}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


SMALL = {"R2COMM_GPU_SEGMENT": "4096", "R2COMM_GPU_STAGING": "20000"}   # 2 slots: reuse


@pytest.mark.mpi
@pytest.mark.parametrize("n,mode", [(2, "device"), pytest.param(3, "device", marks=pytest.mark.slow), (2, "host")])
def test_every_collective_exact_on_standin(n, mode):
    """Every collective (in place too), dtypes, ops, sizes with tails, 4 KiB segments through a
    pool of 2 slots: exact against numpy, identical on every rank, the pool's memory reused."""
    count, out = scenario(n, "standin_collectives", env={**SMALL, "R2COMM_GPU_REDUCE": mode})
    assert count == n * 540, out[-2000:]
    assert "allocated': 2" in out and "oversize': 0" in out


@pytest.mark.mpi
def test_copies_overlap_the_wire_and_calls_stay_in_flight():
    count, out = scenario(2, "standin_overlap", env={"R2COMM_GPU_SEGMENT": "4096",
                                                     "R2COMM_GPU_STAGING": "1M"})
    assert count == 4


@pytest.mark.mpi
def test_stream_ordering_and_completion_means_in_place():
    count, _ = scenario(2, "standin_streams", env=SMALL)
    assert count == 8


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_failure_mid_pipeline_raises_everywhere_and_stops_copies(n):
    """A device error on one rank, a mismatch in a late segment, a bad argument and a timeout:
    Wait raises on every rank, no copy runs afterwards, the slots are back, the next call works."""
    count, _ = scenario(n, "standin_errors", env={**SMALL, "R2COMM_GPU_STAGING": "100000"},
                        limit=60, timeout=15)
    assert count == 7 * n


@pytest.mark.mpi
def test_calls_beyond_the_sequence_budget_grow_their_segments():
    count, _ = scenario(2, "standin_big", env=SMALL)
    assert count == 2


@pytest.mark.mpi
def test_rail_failure_mid_collective_bit_exact():
    count, _ = scenario(2, "standin_failover", env={"R2COMM_GPU_SEGMENT": "262144"})
    assert count == 8


@pytest.mark.mpi
def test_rail_failure_with_replanning_every_call():
    """R2COMM_REPLAN=1: the epoch check runs at each device call's own sequence number, and the
    segments' collectives follow the plans of their call's epoch."""
    count, _ = scenario(2, "standin_failover", env={"R2COMM_GPU_SEGMENT": "262144",
                                                    "R2COMM_REPLAN": "1"}, count=1 << 19)
    assert count == 10          # (8 + the calls that waited for the switch, on each rank)


@pytest.mark.mpi
def test_float16_bfloat16_device_reductions():
    count, _ = scenario(2, "standin_lowprec", env={"R2COMM_GPU_SEGMENT": "8192"})
    assert count == 12


# -- no MPI ---------------------------------------------------------------------------------------
def test_bfloat16_conversion_rounds_to_nearest_even():
    from r2comm.gpu.backend import bf16_to_f32, f32_to_bf16
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, 3.0e38], np.float32)
    b = f32_to_bf16(x)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0); 1 + 3*2^-8 rounds up
    assert bf16_to_f32(b).tolist()[:4] == [1.0, 1.0, 1.015625, -2.5]
    assert np.isinf(bf16_to_f32(b)[4])
    assert f32_to_bf16(np.array([np.nan], np.float32))[0] == 0x7FC0


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int64", "float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["SUM", "PROD", "MIN", "MAX"])
def test_reference_reduction_is_rank_order(dtype, op):
    from r2comm.gpu.backend import reduce_blocks
    rng = np.random.default_rng(3)
    blocks = [rng.integers(1, 4, 50).astype(dtype) for _ in range(3)]
    f = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[op]
    want = f(f(blocks[0], blocks[1]).astype(dtype), blocks[2]).astype(dtype)
    got = reduce_blocks([b.view(np.uint8) for b in blocks], op, dtype)
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, want)


def test_standin_stream_order_events_and_sticky_errors():
    from r2comm.gpu.standin import HostBackend, DeviceError
    be = HostBackend(copy_delay=0.01, fail_copy_at=3)
    s1, s2 = be.new_stream(), be.new_stream()
    out = []
    be.launch(s1, lambda: out.append("a"))
    ev = be.record(s1)
    be.wait_event(s2, ev)
    be.launch(s2, lambda: out.append("b"))
    be.sync(s2)
    assert out == ["a", "b"]
    host = be.pinned(8)
    dev = np.arange(8, dtype=np.uint8)
    be.d2h(host, 0, dev, 0, 8, s1)
    be.h2d(dev, 0, host, 0, 4, s1)
    be.d2h(host, 0, dev, 0, 8, s1)              # copy #3 fails
    be.launch(s1, lambda: out.append("after"))
    ev = be.record(s1)
    with pytest.raises(DeviceError):
        be.synchronize(ev, 10)
    assert "after" in out                       # kernels still run; copies after it do not
    assert be.copies == 3 and be.active == 0


def test_order_of_net_steps():
    from r2comm.gpu.pipeline import _order, _seg_len, MAX_PHASES
    assert _order(3, 1) == [(0, 0), (1, 0), (2, 0)]
    o = _order(4, 2)
    assert o == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (3, 0), (2, 1), (3, 1)]
    for k in range(4):                          # each segment's exchange before its gather
        assert o.index((k, 0)) < o.index((k, 1))
    assert _order(1, 2) == [(0, 0), (0, 1)]
    # segments grow so that a call's steps fit its sequence numbers
    L = _seg_len(1 << 30, 8, 4096, 2)
    assert -(-(1 << 30) // L) <= MAX_PHASES // 2 and L % 8 == 0
    assert _seg_len(100, 12, 4096, 1) == 4092


def test_settings_are_checked(monkeypatch):
    from r2comm.config import Config
    from r2comm.errors import R2commArgumentError
    monkeypatch.setenv("R2COMM_GPU_STAGING", "64M")
    monkeypatch.setenv("R2COMM_GPU_SEGMENT", "1M")
    c = Config.from_env()
    assert (c.gpu_staging, c.gpu_segment, c.gpu_reduce) == (64 << 20, 1 << 20, "device")
    monkeypatch.setenv("R2COMM_GPU_REDUCE", "gpu")
    with pytest.raises(R2commArgumentError, match="R2COMM_GPU_REDUCE"):
        Config.from_env()
    monkeypatch.setenv("R2COMM_GPU_REDUCE", "host")
    monkeypatch.setenv("R2COMM_GPU_SEGMENT", "100")
    with pytest.raises(R2commArgumentError, match="R2COMM_GPU_SEGMENT"):
        Config.from_env()


def test_cuda_array_without_cupy_says_what_to_install(monkeypatch):
    """A __cuda_array_interface__ object when cupy is missing: a clear error, not an
    ImportError from deep inside."""
    import sys
    from r2comm.gpu import backend
    from r2comm.errors import R2commArgumentError

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    monkeypatch.setattr(backend, "_CUPY", None)
    monkeypatch.setitem(sys.modules, "cupy", None)       # import cupy fails
    monkeypatch.setitem(sys.modules, "r2comm.gpu.cupy_backend", None)
    with pytest.raises(R2commArgumentError, match="cupy"):
        backend.backend_for(FakeCuda())


def test_device_buffers_are_told_apart_from_host_buffers():
    from r2comm.front.args import device_args as _device_args, IN_PLACE
    from r2comm.gpu import bfloat16
    from r2comm.gpu.standin import HostBackend
    be = HostBackend()
    x = be.array(np.zeros(4, np.float32))
    assert _device_args((x, x, None)) and _device_args((IN_PLACE, x))
    assert _device_args((bfloat16(be.zeros(4, "bfloat16")), None))
    assert not _device_args((np.zeros(4), np.zeros(4), x))     # the op position is no buffer
    assert not _device_args((IN_PLACE, np.zeros(4))) and not _device_args((bytearray(8), 0))


def test_torch_cpu_tensors_keep_the_host_path():
    torch = pytest.importorskip("torch")
    from r2comm.torch.pyops import _device
    assert _device(torch.ones(4)) is None and _device(torch.ones(4), reduce=True) is None
