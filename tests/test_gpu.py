"""Device buffers on a real GPU (marker `gpu`): every collective with cupy arrays exact against
numpy, arrays on non-default streams, float16/bfloat16 reductions against a float64 reference,
a rail failure mid-collective, and the reduction kernels bit for bit against the reference the
host stand-in uses. Skipped, with the reason, where cupy or a CUDA GPU is missing (run
scripts/gpu-check.sh on a GPU machine). The same pipeline logic runs without a GPU in
tests/test_gpu_staging.py."""
import numpy as np
import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.gpu
WORKER = f"{ROOT}/tests/gpu_worker.py"


def _gpu_absent():
    """Why the GPU tests cannot run here, or None."""
    try:
        import cupy
    except Exception as exc:                    # ImportError, or a broken CUDA install
        return f"cupy is not importable ({type(exc).__name__}: {exc}); scripts/gpu-check.sh installs it"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA GPU: {type(exc).__name__}: {exc}"
    if n < 1:
        return "no CUDA GPU (cupy sees 0 devices)"
    return None


_WHY = _gpu_absent()
skip_no_gpu = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def scenario(n, name, env=None, limit=300, **kw):
    args = [f"{k}={v}" for k, v in kw.items()]
    rc, out = run_mpi(n, [WORKER, name] + args, timeout=limit, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {name} ")]
    assert lines, f"{name}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@skip_no_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["device", "host"])
def test_every_collective_with_cupy_exact(mode):
    count, _ = scenario(2, "cupy_collectives", env={"R2COMM_GPU_SEGMENT": "4096",
                                                    "R2COMM_GPU_STAGING": "1M",
                                                    "R2COMM_GPU_REDUCE": mode})
    assert count == 2 * 540


@skip_no_gpu
@pytest.mark.mpi
def test_cupy_arrays_on_non_default_streams():
    count, _ = scenario(2, "cupy_streams", env={"R2COMM_GPU_SEGMENT": "1M"})
    assert count == 2 * 4


@skip_no_gpu
@pytest.mark.mpi
def test_cupy_float16_bfloat16_against_float64():
    count, _ = scenario(2, "standin_lowprec", env={"R2COMM_GPU_SEGMENT": "8192"}, dev="cupy")
    assert count == 12


@skip_no_gpu
@pytest.mark.mpi
def test_cupy_rail_failure_mid_collective_bit_exact():
    count, _ = scenario(2, "standin_failover", env={"R2COMM_GPU_SEGMENT": "262144"}, dev="cupy")
    assert count == 8


@skip_no_gpu
@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "uint64", "float16",
                                   "float32", "float64", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "PROD", "MIN", "MAX"])
def test_cupy_kernels_match_the_reference_bit_for_bit(dtype, op):
    import cupy
    from r2comm.gpu.backend import reduce_blocks, f32_to_bf16
    from r2comm.gpu.cupy_backend import CupyBackend
    be = CupyBackend()
    rng = np.random.default_rng([3, len(dtype), len(op)])
    n, count = 3, 100003
    if dtype == "bfloat16":
        blocks = [f32_to_bf16(rng.uniform(-2, 2, count).astype(np.float32)) for _ in range(n)]
    elif np.dtype(dtype).kind == "f":
        blocks = [rng.uniform(-2, 2, count).astype(dtype) for _ in range(n)]
    else:
        blocks = [rng.integers(0, 100, count).astype(dtype) for _ in range(n)]
    isz = blocks[0].itemsize
    src = be.empty(n * count * isz)
    dst = be.empty(count * isz)
    s = be.new_stream()
    host = be.pinned(n * count * isz)
    host[:] = np.concatenate([b.view(np.uint8) for b in blocks])
    be.h2d(src, 0, host, 0, n * count * isz, s)
    be.reduce(dst, 0, src, [j * count * isz for j in range(n)], count, op, dtype, s)
    out = be.pinned(count * isz)
    be.d2h(out, 0, dst, 0, count * isz, s)
    assert be.synchronize(be.record(s), 30)
    want = reduce_blocks([b.view(np.uint8) for b in blocks], op, dtype)
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8))
    del cupy


def _torch_cuda_absent():
    try:
        import torch
    except Exception as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return _WHY


@pytest.mark.skipif(_torch_cuda_absent() is not None, reason=_torch_cuda_absent() or "")
def test_torch_cuda_tensors_take_the_device_pipeline():
    """The torch backend with CUDA tensors (torchrun, 2 ranks on one GPU): every collective it
    routes to the pipeline, a non-default stream, AVG; exact against the CPU."""
    import subprocess
    import sys
    import os
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               R2COMM_GPU_SEGMENT="1M")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", "29517", f"{ROOT}/tests/gpu_torch_worker.py"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0 and "OK torch_cuda" in p.stdout, p.stdout[-4000:]
