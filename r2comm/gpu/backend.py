"""The dispatch from an array to its device backend (the stand-in's own, or cupy's, imported on
first use), device-array detection, and the bfloat16 marker. The interface the backends implement
and the reference semantics of their reductions are in device.py (re-exported here)."""
from ..errors import R2commArgumentError, R2commBufferError
from .device import (OP_NAMES, REDUCE_DTYPES, DeviceBackend, bf16_to_f32,  # noqa: F401
                     f32_to_bf16, reduce_blocks)

GPU_PATH = "staged-pipelined"
GPUDIRECT_REASON = ("GPUDirect RDMA is not implemented in r2comm (no registration of device "
                    "memory with the NIC): device buffers are staged through pinned host memory")


class Typed:
    """A device array whose element type its own dtype cannot say (bfloat16 held as uint16 or
    int16): r2comm.gpu.bfloat16(arr)."""
    __slots__ = ("array", "dtype")

    def __init__(self, array, dtype):
        self.array, self.dtype = array, dtype


def bfloat16(arr):
    """Mark a 2-byte device array (uint16/int16 storage) as bfloat16 for reductions."""
    return Typed(arr, "bfloat16")


def unwrap(obj):
    return (obj.array, obj.dtype) if isinstance(obj, Typed) else (obj, None)


def is_device(obj):
    """True for an array in device memory: a cupy array or anything with
    __cuda_array_interface__, a host stand-in array, or a Typed wrapper of one."""
    obj, _ = unwrap(obj)
    if hasattr(obj, "__r2comm_device__"):
        return True
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:           # a CUDA tensor that refuses to export (requires grad): device
        return True


_CUPY = None                    # {CUDA device id: CupyBackend}


def backend_for(obj):
    """The backend of a device array: its own (__r2comm_device__), or cupy's for
    __cuda_array_interface__ (cupy is imported here, on first use)."""
    global _CUPY
    obj, _ = unwrap(obj)
    own = getattr(obj, "__r2comm_device__", None)
    if own is not None:
        return own
    try:
        from . import cupy_backend
    except ImportError as exc:
        raise R2commArgumentError(
            f"a CUDA array ({type(obj).__name__}) needs cupy for r2comm's staging path, and "
            f"cupy cannot be imported ({exc}); install the cupy wheel for your CUDA "
            "(e.g. `pip install cupy-cuda12x`)") from exc
    if _CUPY is None:
        _CUPY = {}
    dev = cupy_backend.device_of(obj)
    be = _CUPY.get(dev)
    if be is None:
        be = _CUPY[dev] = cupy_backend.CupyBackend(dev)   # one per GPU: its streams and pool
    return be


def describe(obj, writable, what):
    """(backend, device buffer, nbytes, dtype name, itemsize) of a device array argument."""
    arr, override = unwrap(obj)
    be = backend_for(arr)
    buf, nbytes, dt, isz = be.flat(arr, writable, what)
    if override is not None:
        if override != "bfloat16" or isz != 2:
            raise R2commBufferError(f"{what}: {override} needs 2-byte storage, got {dt}")
        dt = override
    return be, buf, nbytes, dt, isz
