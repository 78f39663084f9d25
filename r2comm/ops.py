"""Reduction ops and element types (their codes match r2comm/_core/r2_reduce.h)."""
import numpy as np

from .errors import R2commArgumentError


class Op:
    __slots__ = ("name", "code")

    def __init__(self, name, code):
        self.name, self.code = name, code

    def __repr__(self):
        return f"r2comm.{self.name}"

    def mpi(self):
        from mpi4py import MPI
        return getattr(MPI, self.name)


SUM, PROD, MIN, MAX = Op("SUM", 0), Op("PROD", 1), Op("MIN", 2), Op("MAX", 3)
OPS = {o.name: o for o in (SUM, PROD, MIN, MAX)}

DTYPES = {np.dtype(t): i for i, t in enumerate(
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"])}
U8 = DTYPES[np.dtype("uint8")]


def as_op(op):
    if isinstance(op, Op):
        return op
    name = op if isinstance(op, str) else None
    if name is not None:
        name = name.upper()[4:] if name.upper().startswith("MPI_") else name.upper()
        if name in OPS:
            return OPS[name]
    try:                       # an mpi4py op object
        from mpi4py import MPI
        for o in OPS.values():
            if op == getattr(MPI, o.name):
                return o
    except ImportError:
        pass
    raise R2commArgumentError(f"unknown reduction op {op!r}; r2comm supports SUM, PROD, MIN, MAX")


_MPI_OPS = None


def mpi_op(op):
    """The r2comm Op of one of mpi4py's predefined op objects (compared by identity: they are
    unhashable), or None. Cheap enough for a fast path; as_op() is the general converter."""
    global _MPI_OPS
    if _MPI_OPS is None:
        try:
            from mpi4py import MPI
            _MPI_OPS = [(getattr(MPI, o.name), o) for o in OPS.values()]
        except ImportError:
            _MPI_OPS = []
    for mop, o in _MPI_OPS:
        if op is mop:
            return o
    return None


def dtype_code(dt):
    code = DTYPES.get(np.dtype(dt))
    if code is None:
        raise R2commArgumentError(
            f"unsupported dtype {np.dtype(dt)}; r2comm reduces int8..int64, uint8..uint64, "
            "float16, float32 and float64")
    return code
