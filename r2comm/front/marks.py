"""mpi4py's own markers, read from mpi4py.MPI once it is imported (never imported here: a
store-bootstrapped job may run without MPI). A leaf: args.py and buffers.py both use it."""
import sys

_MPI_MARKS = None     # mpi4py's (IN_PLACE, BOTTOM, ANY_SOURCE, PROC_NULL), once it is imported


def mpi_marks():
    """(IN_PLACE, BOTTOM, ANY_SOURCE, PROC_NULL) of mpi4py, or None where mpi4py.MPI was never
    imported (r2comm never imports it for this: a store-bootstrapped job may run without MPI)."""
    global _MPI_MARKS
    if _MPI_MARKS is None:
        mod = sys.modules.get("mpi4py.MPI")
        if mod is not None:
            _MPI_MARKS = (mod.IN_PLACE, mod.BOTTOM, int(mod.ANY_SOURCE), int(mod.PROC_NULL))
    return _MPI_MARKS


def is_bottom(obj):
    """mpi4py's MPI.BOTTOM (absolute addresses: derived datatypes only)."""
    marks = mpi_marks()
    return marks is not None and obj is marks[1]
