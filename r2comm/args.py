"""Argument markers and checks shared by the host-buffer calls (communicator.py) and the
device-buffer pipeline (gpu/pipeline.py): IN_PLACE, ANY_TAG, ANY_SOURCE, root/rank checks, a
(sendbuf, recvbuf) pair, and telling device buffers from host ones."""
import numpy as np

from . import buffers
from .errors import R2commArgumentError, R2commBufferError


class _InPlace:
    def __repr__(self):
        return "r2comm.IN_PLACE"


IN_PLACE = _InPlace()
ANY_TAG = -1
ANY_SOURCE = -1       # a receive's source: the first matching message from any rank


def check_root(root, size):
    """Raise R2commArgumentError unless `root` is a rank of a communicator of `size` ranks."""
    if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise R2commArgumentError(f"root {root!r} is not a rank of this communicator "
                                  f"(size {size})")


def as_array(obj, writable, what):
    """A C-contiguous numpy view of a buffer or mpi4py buffer specification (buffers.py)."""
    return buffers.as_array(obj, writable, what)


def pair(sendbuf, recvbuf, what, apart=True):
    """Validate (sendbuf, recvbuf); IN_PLACE means the receive buffer holds the input.
    apart=False leaves the overlap check (check_apart) to the caller."""
    r = buffers.as_array(recvbuf, True, f"{what} recvbuf")
    if sendbuf is IN_PLACE:
        return r, r
    s = buffers.as_array(sendbuf, False, f"{what} sendbuf")
    if s.dtype != r.dtype:
        raise R2commArgumentError(f"{what}: sendbuf dtype {s.dtype} != recvbuf dtype {r.dtype}")
    if apart:
        check_apart(s, r, what)
    return s, r


def block_of(inner, outer, index, nbytes):
    """Whether array `inner` is exactly block `index` (of nbytes) of array `outer`: torch's
    (and NCCL's) in-place form of all-gather and reduce-scatter."""
    return inner.nbytes == nbytes and outer.nbytes >= (index + 1) * nbytes and \
        inner.ctypes.data == outer.ctypes.data + index * nbytes


def check_apart(s, r, what):
    """Raise R2commBufferError where a call's send and receive buffers share memory (MPI
    forbids it; the schedule would read input it had already overwritten)."""
    if np.may_share_memory(s, r):       # contiguous views: their bounds overlap exactly then
        raise R2commBufferError(f"{what}: sendbuf and recvbuf overlap in memory; pass "
                                "r2comm.IN_PLACE as sendbuf for an in-place call")


_IS_DEVICE = None
_HOST_TYPES = (np.ndarray, bytes, bytearray, memoryview, type(None), int)


def _is_device(obj):
    """gpu.backend.is_device, imported on first use (`import r2comm` stays light)."""
    global _IS_DEVICE
    if _IS_DEVICE is None:
        from .gpu.backend import is_device
        _IS_DEVICE = is_device
    return _IS_DEVICE(obj)


def device_args(args):
    """A collective's buffer arguments include a device array (the first two arguments are
    the buffers; IN_PLACE, None and numbers are not). Plain numpy arrays and the other host
    types are told apart by type alone: this runs on every call (small-message latency)."""
    for a in args[:2]:
        if type(a) not in _HOST_TYPES and _is_device(a):
            return True
    return False
