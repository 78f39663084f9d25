"""The device backend interface of the staging pipeline and the reference (numpy) semantics of
the device reductions, bfloat16 included.

A backend works on flat byte ranges of device memory ("device buffers": whatever the backend
returns from `flat`, addressed by byte offsets) and on pinned host memory (numpy uint8 arrays from
`pinned`). Every copy and kernel is enqueued on a stream and returns at once; completion is seen
through events (record / query / synchronize). The pipeline never touches device memory itself.

The implementations (cupy_backend.py, standin.py) import this module, and backend.py (the
dispatch from an array to its backend) imports cupy_backend.py; nothing here imports back."""
import numpy as np

# the dtypes a device reduction knows: numpy's, plus bfloat16 (stored as uint16)
REDUCE_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "bfloat16")
OP_NAMES = ("SUM", "PROD", "MIN", "MAX")


class DeviceBackend:
    """What the pipeline needs from a device. Methods raise on misuse; `timeout` is seconds."""
    name = "abstract"

    def flat(self, obj, writable, what):
        """(device buffer, nbytes, dtype name, itemsize) of a C-contiguous device array."""
        raise NotImplementedError

    def stream_of(self, obj, stream=None):
        """The stream a collective on `obj` orders itself after: `stream` when given, else the
        stream the array's producer named (__cuda_array_interface__ 'stream'), else the
        backend's current stream."""
        raise NotImplementedError

    def new_stream(self):
        raise NotImplementedError

    def record(self, stream):
        """An event recorded on `stream` (complete once the work queued before it is)."""
        raise NotImplementedError

    def wait_event(self, stream, event):
        """Work queued on `stream` from now on runs after `event` (no host blocking)."""
        raise NotImplementedError

    def query(self, event):
        raise NotImplementedError

    def synchronize(self, event, timeout):
        """Block until `event` completed; False when `timeout` passed first."""
        raise NotImplementedError

    def d2h(self, host, host_off, dev, dev_off, n, stream):
        """Enqueue: host[host_off:+n] = dev[dev_off:+n] (host: pinned numpy uint8)."""
        raise NotImplementedError

    def h2d(self, dev, dev_off, host, host_off, n, stream):
        """Enqueue: dev[dev_off:+n] = host[host_off:+n]."""
        raise NotImplementedError

    def pinned(self, nbytes):
        """Page-locked host memory, a numpy uint8 array."""
        raise NotImplementedError

    def empty(self, nbytes):
        """A device buffer of nbytes (scratch)."""
        raise NotImplementedError

    def can_reduce(self, op, dtype):
        return op in OP_NAMES and dtype in REDUCE_DTYPES

    def reduce(self, dst, dst_off, src, src_offs, count, op, dtype, stream):
        """Enqueue: dst[dst_off:] (count elements of dtype) = src block 0 op block 1 op ...,
        blocks at byte offsets src_offs of the device buffer src, combined in that order (so
        every rank that reduces the same blocks gets the same bits)."""
        raise NotImplementedError


# -- reference semantics of the device reductions (numpy; the host stand-in runs these) ----------
def bf16_to_f32(u16):
    """bfloat16 bits (uint16) -> float32."""
    return (np.asarray(u16, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32):
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    b = np.ascontiguousarray(f32, np.float32).view(np.uint32)
    out = ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(np.ascontiguousarray(f32, np.float32))
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _np_op(op):
    return {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[op]


def reduce_blocks(blocks, op, dtype):
    """blocks[0] op blocks[1] op ... in order, as the device kernels compute it: float16 and the
    other numpy dtypes element by element in their own type (one rounding per step), bfloat16 in
    float32 with one round-to-nearest-even per step. Returns an array of the storage dtype."""
    f = _np_op(op)
    if dtype == "bfloat16":
        acc = blocks[0].view(np.uint16).copy()
        for b in blocks[1:]:
            acc = f32_to_bf16(f(bf16_to_f32(acc), bf16_to_f32(b.view(np.uint16))))
        return acc
    dt = np.dtype(dtype)
    acc = blocks[0].view(dt).copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for b in blocks[1:]:
            acc = f(acc, b.view(dt)).astype(dt, copy=False)
    return acc
