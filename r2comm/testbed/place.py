"""Put a process into its host's namespace, then become the real command.

Why exec rather than `ip netns exec` from a wrapper: under mpiexec, each
rank must keep the process identity and the PMI connection (PMI_FD, an
inherited socket) that hydra gave it, so the rank itself joins the namespace
with setns(2) and execs the command.  MPICH's ranks on one machine talk
through shared memory, which namespaces do not separate, so MPI bootstrap
keeps working across "hosts".
"""
import ctypes
import os

from ._iproute import NETNS_DIR, TestbedError

CLONE_NEWNET = 0x40000000
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "R2COMM_TESTBED_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "R2COMM_TESTBED_SIZE")


def _first_int(environ, names):
    for name in names:
        if environ.get(name, "").strip():
            return int(environ[name])
    return None


def rank_and_size(environ):
    """(rank, size) set by the launcher (MPICH hydra, Open MPI, or by hand), else None."""
    rank, size = _first_int(environ, RANK_VARS), _first_int(environ, SIZE_VARS)
    if rank is None:
        return None
    if size is None:
        raise TestbedError(f"rank {rank} is set but no job size ({' / '.join(SIZE_VARS)})")
    return rank, size


def enter_netns(name):
    """setns(2) this process into the named network namespace (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        raise TestbedError(f"network namespace {name!r} does not exist; is the fabric up?") from None
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise TestbedError(f"setns into {name!r} failed: {os.strerror(err)} (root needed)")
    finally:
        os.close(fd)


def exec_in_fabric(fabric, argv, host=None):
    """Become ARGV inside FABRIC: on HOST, else on the host this rank maps to. Does not return."""
    if not argv:
        raise TestbedError("exec needs a command after --")
    if host is None:
        placed = rank_and_size(os.environ)
        if placed is None:
            raise TestbedError(f"no rank in the environment ({' / '.join(RANK_VARS)}): "
                               "run under mpiexec or give --host")
        host = fabric.host_of_rank(*placed)
    env = {**os.environ, **fabric.host_env(host)}
    enter_netns(fabric.host_ns(host))
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise TestbedError(f"cannot run {argv[0]!r}: {exc.strerror}") from None
