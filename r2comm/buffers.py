"""Buffer arguments: numpy arrays, any object with the buffer protocol, and the mpi4py buffer
specifications users of mpi4py write ([buf, MPI.FLOAT], [buf, count, MPI.FLOAT],
[buf, (count, displ), MPI.FLOAT]). Each becomes a C-contiguous numpy view of the user's memory,
never a copy, or a clear R2commBufferError that says what to pass instead."""
import numpy as np

from .errors import R2commBufferError


def to_dtype(spec, what):
    """A numpy dtype from an mpi4py Datatype, a numpy dtype, a type or a typecode ('f')."""
    if isinstance(spec, np.dtype):
        return spec
    if type(spec).__name__ == "Datatype" and type(spec).__module__.startswith("mpi4py"):
        from mpi4py.util.dtlib import to_numpy_dtype
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
        raise R2commBufferError(f"{what}: [buf, counts, displs, datatype] describes a vector "
                                "collective (Allgatherv, Alltoallv, ...), which r2comm does not "
                                "provide; pass one block per rank")
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
            raise R2commBufferError(f"{what}: (counts, displs) lists describe a vector collective, "
                                    "which r2comm does not provide; (count, displ) must be two "
                                    "integers")
        count, displ = int(size[0]), int(size[1])
    elif size is not None:
        if not _int(size):
            raise R2commBufferError(f"{what}: count {size!r} is not an integer")
        count = int(size)
    if (count is not None and count < 0) or displ < 0:
        raise R2commBufferError(f"{what}: negative count or displacement ({count}, {displ})")
    return buf, count, displ, dt


def as_array(obj, writable, what):
    """A C-contiguous numpy view of a buffer or buffer specification (never a copy)."""
    count, displ, dt = None, 0, None
    if _is_spec(obj):
        obj, count, displ, dt = _parse_spec(obj, what)
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
