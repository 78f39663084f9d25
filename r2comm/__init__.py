"""r2comm: fault-tolerant multi-rail collective communication for Python.

Light on import: the engine and mpi4py load only when a Communicator is created, so
`python -m r2comm.testbed exec` can place a process in its namespace before MPI starts."""
from .errors import (R2commError, R2commArgumentError, R2commBufferError, R2commClosedError,
                     R2commTimeout, R2commNetworkError, R2commMismatchError, R2commTruncateError,
                     R2commProtocolError, R2commBuildError, R2commPeerError,
                     R2commRevokedError,
                     R2commResourceError, R2commSecurityWarning)
from .ops import SUM, PROD, MIN, MAX, Op

__version__ = "0.1.0"

_LAZY = {"Communicator": "communicator", "IN_PLACE": "communicator", "ANY_TAG": "communicator",
         "ANY_SOURCE": "communicator", "PROC_NULL": "front.args", "UNDEFINED": "front.args",
         "Request": "request", "Status": "request", "Prequest": "request",
         "REQUEST_NULL": "request", "Message": "front.pt2pt", "Rail": "transport.rails"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'r2comm' has no attribute {name!r}")


__all__ = ["Communicator", "Request", "Status", "Rail", "IN_PLACE", "ANY_TAG", "ANY_SOURCE",
           "PROC_NULL", "UNDEFINED", "Prequest", "REQUEST_NULL", "Message", "SUM", "PROD",
           "MIN", "MAX", "Op", "R2commError", "R2commArgumentError", "R2commBufferError",
           "R2commClosedError", "R2commTimeout", "R2commNetworkError", "R2commMismatchError",
           "R2commTruncateError", "R2commProtocolError", "R2commBuildError", "R2commPeerError",
           "R2commRevokedError",
           "R2commResourceError", "R2commSecurityWarning"]
