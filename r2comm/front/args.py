"""Argument markers and checks shared by the host-buffer calls (communicator.py) and the
device-buffer pipeline (gpu/pipeline.py): IN_PLACE, ANY_TAG, ANY_SOURCE, PROC_NULL, root/rank
checks, a (sendbuf, recvbuf) pair, and telling device buffers from host ones.

mpi4py's own markers are accepted wherever r2comm's are (MPI.IN_PLACE, MPI.ANY_SOURCE,
MPI.PROC_NULL, MPI.ANY_TAG, MPI.BOTTOM; None as a send buffer means IN_PLACE, as in mpi4py).
r2comm's ANY_SOURCE and PROC_NULL are values of their own, so they never collide with each
other nor with MPICH's (PROC_NULL -1, ANY_SOURCE -2, ROOT -3) or Open MPI's (ANY_SOURCE -1,
PROC_NULL -2, ROOT -4)."""
import numpy as np

from . import buffers
from .marks import mpi_marks
from ..errors import R2commArgumentError, R2commBufferError


class _InPlace:
    def __repr__(self):
        return "r2comm.IN_PLACE"


IN_PLACE = _InPlace()
ANY_TAG = -1          # a receive's tag: any tag (MPICH's and Open MPI's value too)
ANY_SOURCE = -21      # a receive's source: the first matching message from any rank
PROC_NULL = -22       # a peer that is no rank: the call completes at once and moves nothing
UNDEFINED = -32766    # Waitany/Testany with no active request (MPICH's and Open MPI's value)

def is_in_place(obj):
    """IN_PLACE, mpi4py's MPI.IN_PLACE or None (mpi4py's reading of a missing send buffer)."""
    if obj is IN_PLACE or obj is None:
        return True
    marks = mpi_marks()
    return marks is not None and obj is marks[0]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_any_source(peer):
    """r2comm.ANY_SOURCE or mpi4py's MPI.ANY_SOURCE."""
    if not _is_int(peer):
        return False
    marks = mpi_marks()
    return peer == ANY_SOURCE or (marks is not None and peer == marks[2])


def is_proc_null(peer):
    """r2comm.PROC_NULL or mpi4py's MPI.PROC_NULL."""
    if not _is_int(peer):
        return False
    marks = mpi_marks()
    return peer == PROC_NULL or (marks is not None and peer == marks[3])


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
    if is_in_place(sendbuf):
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
        from ..gpu.backend import is_device
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
