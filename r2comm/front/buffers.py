"""Buffer arguments: numpy arrays, any object with the buffer protocol, and the mpi4py buffer
specifications users of mpi4py write ([buf, MPI.FLOAT], [buf, count, MPI.FLOAT],
[buf, (count, displ), MPI.FLOAT]; for the vector collectives [buf, counts, displs, MPI.FLOAT]
and its shorter forms). Each becomes a C-contiguous numpy view of the user's memory, never a
copy, or a clear R2commBufferError that says what to pass instead. As in mpi4py, the count of
a block collective's buffer (Allgather, Alltoall, Gather, Scatter, ...) is the count of one
block, one rank's share."""
import numpy as np

from ..errors import R2commBufferError, unsupported
from .marks import is_bottom


def to_dtype(spec, what):
    """A numpy dtype from an mpi4py Datatype, a numpy dtype, a type or a typecode ('f')."""
    if isinstance(spec, np.dtype):
        return spec
    if type(spec).__name__ == "Datatype" and type(spec).__module__.startswith("mpi4py"):
        from mpi4py.util.dtlib import to_numpy_dtype
        if not spec.is_predefined:
            raise unsupported(f"{what}: a derived MPI datatype",
                              "pass a contiguous array of one element type (copy the elements "
                              "it selects, e.g. np.ascontiguousarray(a[::2]))")
        try:
            dt = np.dtype(to_numpy_dtype(spec))
        except Exception:
            dt = None
        if dt is None or dt.fields is not None:
            name = getattr(spec, "name", None) or repr(spec)
            raise R2commBufferError(f"{what}: MPI datatype {name} has no plain numpy element type; "
                                    "r2comm moves arrays of one integer or float type")
        return dt
    try:
        return np.dtype(spec)
    except TypeError:
        raise R2commBufferError(f"{what}: {spec!r} is not a datatype (pass an MPI datatype such "
                                "as MPI.FLOAT, a numpy dtype or a typecode such as 'f')") from None


def _base(obj, what):
    if isinstance(obj, np.ndarray):
        return obj
    if obj is None:                    # mpi4py's [None, 0, MPI.BYTE]: no memory at all
        return np.empty(0, np.uint8)
    if _is_spec(obj):
        raise R2commBufferError(f"{what}: nested buffer specification {type(obj).__name__}")
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise R2commBufferError(
            f"{what}: {type(obj).__name__} does not expose a buffer; pass a numpy array, an object "
            "with the buffer protocol, or an mpi4py buffer specification such as [buf, MPI.FLOAT] "
            "(the lowercase methods, e.g. allreduce(x), take Python objects)") from None
    except ValueError as exc:          # a format numpy does not read
        raise R2commBufferError(f"{what}: {type(obj).__name__} exposes a buffer numpy cannot "
                                f"read ({exc})") from None


def _is_spec(obj):
    return isinstance(obj, (list, tuple))


def _int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _parse_spec(obj, what):
    """(buffer, count or None, displacement, dtype or None) of an mpi4py specification."""
    n = len(obj)
    if n == 4:
        raise R2commBufferError(f"{what}: [buf, counts, displs, datatype] describes the buffer "
                                "of a vector collective (Gatherv, Allgatherv, Alltoallv, ...); "
                                "this call takes [buf, count, datatype]")
    if n not in (2, 3):
        raise R2commBufferError(f"{what}: a buffer specification is [buf, datatype], "
                                f"[buf, count, datatype] or [buf, (count, displ), datatype], got "
                                f"a {type(obj).__name__} of {n} items")
    buf = obj[0]
    if n == 2:
        size, dt = (obj[1], None) if (_int(obj[1]) or _is_spec(obj[1])) else (None, obj[1])
    else:
        size, dt = obj[1], obj[2]
    count, displ = size, 0
    if _is_spec(size):
        if len(size) != 2 or not all(_int(x) for x in size):
            raise R2commBufferError(f"{what}: (counts, displs) lists describe the buffer of a "
                                    "vector collective (Gatherv, ...); (count, displ) must be "
                                    "two integers here")
        count, displ = int(size[0]), int(size[1])
    elif size is not None:
        if not _int(size):
            raise R2commBufferError(f"{what}: count {size!r} is not an integer")
        count = int(size)
    if (count is not None and count < 0) or displ < 0:
        raise R2commBufferError(f"{what}: negative count or displacement ({count}, {displ})")
    return buf, count, displ, dt


def _bottom(obj, count, what):
    """mpi4py's MPI.BOTTOM: an empty buffer with no count (absolute addresses need derived
    datatypes, outside r2comm's scope)."""
    if not is_bottom(obj):
        return obj
    if count:
        raise unsupported(f"{what}: MPI.BOTTOM (absolute addresses)",
                          "pass the array itself with a count")
    return None


def as_array(obj, writable, what, blocks=0):
    """A C-contiguous numpy view of a buffer or buffer specification (never a copy). blocks > 1:
    the buffer of a block collective, `blocks` blocks of one rank's share each: a count in the
    specification is one block's, and the view covers blocks x count elements."""
    count, displ, dt = None, 0, None
    if _is_spec(obj):
        obj, count, displ, dt = _parse_spec(obj, what)
        obj = _bottom(obj, count, what)
        if count is not None and blocks > 1:
            count *= blocks
    else:
        obj = _bottom(obj, None, what)
        if obj is None:
            raise R2commBufferError(f"{what}: None is no buffer here")
    arr = _base(obj, what)
    if not arr.flags.c_contiguous:
        raise R2commBufferError(f"{what} is not contiguous (strides {arr.strides}); use "
                                "np.ascontiguousarray")
    if writable and not arr.flags.writeable:
        raise R2commBufferError(f"{what} is read-only")
    if dt is not None or count is not None or displ:
        dt = arr.dtype if dt is None else to_dtype(dt, what)
        raw = arr.reshape(-1).view(np.uint8)
        avail = raw.nbytes // dt.itemsize
        if count is None:
            if raw.nbytes % dt.itemsize:
                raise R2commBufferError(f"{what}: {raw.nbytes} bytes are not whole {dt} elements")
            count = avail - displ
        if displ + count > avail:
            raise R2commBufferError(f"{what}: count {count} at displacement {displ} needs "
                                    f"{(displ + count) * dt.itemsize} bytes of {dt}, the buffer "
                                    f"holds {raw.nbytes}")
        arr = raw[displ * dt.itemsize:(displ + count) * dt.itemsize].view(dt)
    if arr.dtype.byteorder == ">":
        raise R2commBufferError(f"{what} has non-native byte order")
    return arr


def _counts(v, blocks, what, name):
    if _int(v):
        return [int(v)] * blocks
    try:
        out = [int(x) for x in v]
    except TypeError:
        raise R2commBufferError(f"{what}: {name} {v!r} is neither an integer nor a sequence "
                                "of them") from None
    if len(out) != blocks:
        raise R2commBufferError(f"{what}: {len(out)} {name}, one per rank ({blocks}) expected")
    return out


def as_vector(obj, writable, what, blocks):
    """(1-D view of the whole buffer, counts, displacements) of a vector collective's buffer
    over `blocks` ranks, in elements: [buf, counts, displs, datatype] or a shorter form of it
    (mpi4py's rules: no counts, the buffer split as evenly as possible; one count, every rank
    that count; no displacements, the blocks one after another; one displacement d, block i at
    i x d). Every block must lie in the buffer."""
    counts = displs = dt = None
    if _is_spec(obj):
        n = len(obj)
        if n not in (2, 3, 4):
            raise R2commBufferError(f"{what}: a vector buffer is [buf, counts, displs, "
                                    f"datatype] or a shorter form, got {n} items")
        if n == 4:
            obj, counts, displs, dt = obj
        else:
            mid, dt = (obj[1], obj[2]) if n == 3 else (obj[1], None)
            obj = obj[0]
            if n == 2 and not (_int(mid) or _is_spec(mid)):
                mid, dt = None, mid
            if isinstance(mid, tuple):
                if len(mid) != 2:
                    raise R2commBufferError(f"{what}: (counts, displs) must be two items")
                counts, displs = mid
            else:
                counts = mid
    if _bottom(obj, 1 if counts is not None else None, what) is None:
        obj = None
    arr = as_array(obj if obj is not None else [None, 0, np.uint8], writable, what)
    if dt is not None:
        dt = to_dtype(dt, what)
        if arr.nbytes % dt.itemsize:
            raise R2commBufferError(f"{what}: {arr.nbytes} bytes are not whole {dt} elements")
        arr = arr.reshape(-1).view(np.uint8).view(dt)
    arr = arr.reshape(-1)
    if counts is None:
        q, r = divmod(arr.size, blocks)
        counts = [q + (i < r) for i in range(blocks)]
    else:
        counts = _counts(counts, blocks, what, "counts")
    if displs is None:
        displs, at = [], 0
        for c in counts:
            displs.append(at)
            at += c
    elif _int(displs):
        displs = [int(displs) * i for i in range(blocks)]
    else:
        displs = _counts(displs, blocks, what, "displacements")
    for i, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > arr.size:
            raise R2commBufferError(f"{what}: block {i} ({c} elements at {d}) does not lie in "
                                    f"the buffer of {arr.size} {arr.dtype} elements")
    return arr, counts, displs
