"""Reduction ops and element types (their codes match r2comm/_core/r2_reduce.h)."""
import numpy as np

from .errors import R2commArgumentError, unsupported


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

# the element types every op reduces (the Allreduce fast path takes these alone)
DTYPES = {np.dtype(t): i for i, t in enumerate(
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"])}
U8 = DTYPES[np.dtype("uint8")]
# every element type r2comm moves: complex numbers reduce with SUM and PROD only, bool with no op
# (MPI defines no MIN/MAX on complex numbers, and only logical ops on C_BOOL)
ALL_DTYPES = {**DTYPES, np.dtype("complex64"): 11, np.dtype("complex128"): 12,
              np.dtype("bool"): 13}
CODE_DTYPES = {code: dt for dt, code in ALL_DTYPES.items()}
COMPLEX = (11, 12)
BOOL = 13
_WIDE = {"float128": "float64", "complex256": "complex128"}


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
    """The engine's code of element type `dt` (any r2comm moves); R2commArgumentError else."""
    dt = np.dtype(dt)
    code = ALL_DTYPES.get(dt)
    if code is None:
        if dt.name in _WIDE:
            raise unsupported(f"{dt.name} (long double)", f"convert to {_WIDE[dt.name]} "
                              f"(arr.astype(np.{_WIDE[dt.name]}))")
        raise R2commArgumentError(
            f"unsupported dtype {dt}; r2comm moves int8..int64, uint8..uint64, float16, "
            "float32, float64, complex64, complex128 and bool")
    return code


def reduce_code(dt, op):
    """dtype_code(dt) where MPI defines `op` (an Op) on it: every op on integers and reals,
    SUM and PROD on complex numbers, none on bool; R2commArgumentError otherwise."""
    code = dtype_code(dt)
    if code == BOOL:
        raise R2commArgumentError(
            f"{op.name} of bool: MPI defines only logical ops on booleans; reduce them as "
            "uint8 (MAX: logical or, MIN: logical and)")
    if code in COMPLEX and op.code > PROD.code:
        raise R2commArgumentError(f"{op.name} of {np.dtype(dt)}: MPI defines MIN and MAX for "
                                  "real numbers only (SUM and PROD for complex ones)")
    return code
