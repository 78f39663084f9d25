"""The cupy device backend: CUDA streams, events, pinned host memory, async copies and the
reduction kernels (one cupy ElementwiseKernel per op, instantiated per dtype by cupy; bfloat16
as uint16 storage with float32 arithmetic and round-to-nearest-even).

Imported only when a __cuda_array_interface__ array reaches a collective (backend.backend_for),
so r2comm never needs cupy otherwise. NOT VERIFIED ON A GPU in the session that wrote it: the
pipeline logic it plugs into is tested on the host stand-in; tests/test_gpu.py and
scripts/gpu-check.sh check this module on a machine with a GPU."""
import time

import numpy as np
import cupy
from cupy.cuda import runtime

from ..errors import R2commBufferError
from .device import DeviceBackend

_H2D = getattr(runtime, "memcpyHostToDevice", 1)      # cudaMemcpyKind
_D2H = getattr(runtime, "memcpyDeviceToHost", 2)

_BF16_PREAMBLE = r"""
__device__ __forceinline__ float r2_bf2f(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short r2_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;   // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                       // nearest even
    return (unsigned short)(u >> 16);
}
"""

# z = x op y, element by element in the storage type (numpy's semantics: integers wrap, NaN
# propagates through MIN/MAX)
_BODY = {
    "SUM": "z = x + y;",
    "PROD": "z = x * y;",
    "MIN": "z = (x != x) ? x : ((y != y) ? y : ((y < x) ? y : x));",
    "MAX": "z = (x != x) ? x : ((y != y) ? y : ((y > x) ? y : x));",
}
_BODY_BF16 = {
    "SUM": "z = r2_f2bf(r2_bf2f(x) + r2_bf2f(y));",
    "PROD": "z = r2_f2bf(r2_bf2f(x) * r2_bf2f(y));",
    "MIN": "float a = r2_bf2f(x), b = r2_bf2f(y); "
           "z = (a != a || b != b) ? (unsigned short)0x7fc0 : ((b < a) ? y : x);",
    "MAX": "float a = r2_bf2f(x), b = r2_bf2f(y); "
           "z = (a != a || b != b) ? (unsigned short)0x7fc0 : ((b > a) ? y : x);",
}


class DevBuf:
    """A byte range of device memory: pointer, size, and the object that owns it."""
    __slots__ = ("ptr", "nbytes", "owner")

    def __init__(self, ptr, nbytes, owner):
        self.ptr, self.nbytes, self.owner = ptr, nbytes, owner


def _cai(obj, what="buffer"):
    try:
        return obj.__cuda_array_interface__
    except Exception as exc:
        raise R2commBufferError(f"{what}: {type(obj).__name__} does not export its CUDA memory "
                                f"({exc}); pass a detached, contiguous array") from None


def device_of(obj):
    """The CUDA device holding the array (the current device for an empty one)."""
    ptr = _cai(obj)["data"][0]
    if ptr:
        try:
            return int(runtime.pointerGetAttributes(ptr).device)
        except Exception:
            pass
    return int(cupy.cuda.runtime.getDevice())


class CupyBackend(DeviceBackend):
    """One per GPU: streams, events, scratch and kernels are made on that device."""
    name = "cupy"

    def __init__(self, device=0):
        self.device = device
        self._kernels = {}

    # -- arrays and streams ----------------------------------------------------------------------
    def flat(self, obj, writable, what):
        cai = _cai(obj, what)
        shape = tuple(cai["shape"])
        try:
            dt = np.dtype(cai["typestr"])
        except TypeError:
            raise R2commBufferError(f"{what}: element type {cai['typestr']!r} is not one numpy "
                                    "knows (bfloat16: pass r2comm.gpu.bfloat16(arr) of its "
                                    "uint16 view)") from None
        ptr, readonly = cai["data"]
        count = int(np.prod(shape)) if shape else 1
        strides = cai.get("strides")
        if strides is not None and count > 1:
            want, acc = [], dt.itemsize
            for d in reversed(shape):
                want.append(acc)
                acc *= d
            if any(d > 1 and s != w for d, s, w in zip(shape, strides, reversed(want))):
                raise R2commBufferError(f"{what} is not C-contiguous (strides {strides})")
        if writable and readonly:
            raise R2commBufferError(f"{what} is read-only")
        return DevBuf(ptr, count * dt.itemsize, obj), count * dt.itemsize, dt.name, dt.itemsize

    def _as_stream(self, s):
        if isinstance(s, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
            return s
        handle = getattr(s, "cuda_stream", s)          # torch.cuda.Stream, or a raw handle
        if isinstance(handle, int):
            if handle == 0:
                return cupy.cuda.Stream.null
            try:
                return cupy.cuda.ExternalStream(handle, self.device)
            except TypeError:                        # cupy < 13: no device argument
                return cupy.cuda.ExternalStream(handle)
        raise R2commBufferError(f"stream={s!r} is not a CUDA stream (a cupy or torch stream, or "
                                "a cudaStream_t handle)")

    def stream_of(self, obj, stream=None):
        if stream is not None:
            return self._as_stream(stream)
        cai = getattr(obj, "__cuda_array_interface__", None) or {}
        s = cai.get("stream")
        if s is not None:
            return self._as_stream(int(s))
        return cupy.cuda.get_current_stream()

    def new_stream(self):
        with cupy.cuda.Device(self.device):
            return cupy.cuda.Stream(non_blocking=True)

    def record(self, stream):
        with cupy.cuda.Device(self.device):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(stream)
        return ev

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def query(self, event):
        return event.done

    def synchronize(self, event, timeout):
        end = time.monotonic() + timeout
        while not event.done:
            if time.monotonic() > end:
                return False
            time.sleep(0.0001)
        return True

    # -- memory and copies ---------------------------------------------------------------------
    def d2h(self, host, host_off, dev, dev_off, n, stream):
        runtime.memcpyAsync(host.ctypes.data + host_off, dev.ptr + dev_off, n,
                            _D2H, stream.ptr)

    def h2d(self, dev, dev_off, host, host_off, n, stream):
        runtime.memcpyAsync(dev.ptr + dev_off, host.ctypes.data + host_off, n,
                            _H2D, stream.ptr)

    def pinned(self, nbytes):
        try:
            import cupyx
            return cupyx.empty_pinned((nbytes,), np.uint8)
        except (ImportError, AttributeError):
            mem = cupy.cuda.alloc_pinned_memory(nbytes)
            return np.frombuffer(mem, np.uint8, nbytes)    # holds `mem` alive

    def empty(self, nbytes):
        with cupy.cuda.Device(self.device):
            a = cupy.empty(nbytes, cupy.uint8)
        return DevBuf(a.data.ptr, nbytes, a)

    # -- reductions ------------------------------------------------------------------------------
    def kernel(self, op, dtype):
        key = (op, dtype == "bfloat16")
        k = self._kernels.get(key)
        if k is None:
            if dtype == "bfloat16":
                k = cupy.ElementwiseKernel("uint16 x, uint16 y", "uint16 z", _BODY_BF16[op],
                                           f"r2comm_{op.lower()}_bf16", preamble=_BF16_PREAMBLE)
            else:
                k = cupy.ElementwiseKernel("T x, T y", "T z", _BODY[op], f"r2comm_{op.lower()}")
            self._kernels[key] = k
        return k

    def view(self, buf, off, count, storage):
        isz = np.dtype(storage).itemsize
        mem = cupy.cuda.UnownedMemory(buf.ptr + off, count * isz, buf.owner, self.device)
        return cupy.ndarray((count,), storage, cupy.cuda.MemoryPointer(mem, 0))

    def reduce(self, dst, dst_off, src, src_offs, count, op, dtype, stream):
        storage = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        k = self.kernel(op, dtype)
        out = self.view(dst, dst_off, count, storage)
        blocks = [self.view(src, o, count, storage) for o in src_offs]
        with cupy.cuda.Device(self.device), stream:
            if len(blocks) == 1:
                out[...] = blocks[0]
                return
            k(blocks[0], blocks[1], out)
            for b in blocks[2:]:
                k(out, b, out)
