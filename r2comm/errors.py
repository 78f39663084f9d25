"""The r2comm exception hierarchy. Engine error codes map onto these classes, so every rank
that takes part in a failed operation raises the same class with the same message."""


class R2commError(Exception):
    """Base class of every error r2comm raises."""


class R2commArgumentError(R2commError, ValueError):
    """A bad argument seen locally: unknown op, dtype/op mismatch, bad root or rank."""


class R2commBufferError(R2commArgumentError):
    """A buffer r2comm cannot use: non-contiguous, read-only, or too small."""


class R2commClosedError(R2commError):
    """The communicator was freed (or its engine closed)."""


class R2commTimeout(R2commError, TimeoutError):
    """A blocking wait ran past its timeout."""


class R2commNetworkError(R2commError, ConnectionError):
    """A peer became unreachable: every rail to it failed, or it died."""


class R2commMismatchError(R2commError):
    """Ranks called a collective with arguments that do not match (sizes, dtypes, ops, roots)."""


class R2commPeerError(R2commMismatchError):
    """Another rank's call of the same collective failed its own argument checks (it raised an
    R2commArgumentError there): the message names that rank and its error. The call still took
    its sequence number on every rank, so the next collective on the communicator works."""


class R2commTruncateError(R2commMismatchError):
    """A point-to-point message was larger than the receive buffer."""


class R2commRevokedError(R2commError):
    """The communicator was revoked (Communicator.Revoke() on some rank, issue 44): every
    pending and later operation of it raises this on every rank; Agree() and Shrink() still
    work on it (README, Failure semantics: after a rank died)."""


class R2commProtocolError(R2commError):
    """A peer broke the protocol (e.g. a different chunk size)."""


class R2commResourceError(R2commError):
    """A resource limit of this machine is too small for the job (file descriptors at start-up,
    r2comm/control/fdlimit.py, or for a first use's connections, control/links.py)."""


class R2commSecurityWarning(UserWarning):
    """A configuration that leaves the job open to other users or the network (a store
    bootstrap without an out-of-band secret: README, Security)."""


class R2commBuildError(R2commError, ImportError):
    """The compiled engine (r2comm/_core/engine.pyx) is not built for this Python."""


OUT_OF_SCOPE = "outside r2comm's scope"


def unsupported(what, instead):
    """The R2commArgumentError of an MPI feature r2comm leaves out on purpose (derived datatypes,
    long double, buffered sends, intercommunicators), naming what to use instead."""
    return R2commArgumentError(f"{what} is {OUT_OF_SCOPE}: {instead}")


# engine error codes (r2comm/_core/engine_state.pxi, E_*)
CODE_CLASSES = {
    1: R2commTimeout,
    2: R2commNetworkError,
    3: R2commMismatchError,
    4: R2commTruncateError,
    5: R2commProtocolError,
    6: R2commClosedError,
    7: R2commPeerError,
    8: R2commRevokedError,
}
PEER_ARGUMENT_CODE = 7      # engine code of an ABORT sent by a rank whose own arguments were bad


def from_code(code, message):
    return CODE_CLASSES.get(code, R2commError)(message)



# Marks that r2comm's modules put on an exception they handle, of any class (an exception cannot
# be weakly referenced, so they travel on it): _r2comm_told, its peers were sent it (an ABORT);
# _r2comm_remote, it came from the engine, so the peers failed the same operation already.
def claim_telling(exc):
    """True the first time it is asked for `exc`: the caller then tells the peers of it."""
    if getattr(exc, "_r2comm_told", False):
        return False
    exc._r2comm_told = True
    return True


def mark_remote(exc):
    """Note that `exc` came from the engine (the peers failed the same operation)."""
    exc._r2comm_remote = True


def is_remote(exc):
    """`exc` was marked with mark_remote."""
    return getattr(exc, "_r2comm_remote", False)
