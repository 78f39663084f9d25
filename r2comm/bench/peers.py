"""One adapter per benchmarked library, all driven through the same calls.

Each adapter turns a (collective, buffers) pair into a zero-argument callable
once per size, so the timing loop calls exactly one library function per
iteration and no argument translation (numpy -> tensor, op lookup) is timed.
Optionally it also returns a `pre` callable that the loop runs *outside* the
timer before each iteration (Gloo's allreduce is in place, so its input is
copied into the output buffer there).

Libraries:
    r2comm  r2comm.Communicator over MPI.COMM_WORLD (rails from R2COMM_RAILS)
    mpi     mpi4py buffer calls on a duplicate of COMM_WORLD; its transport
            (shared memory or TCP) is whatever the launch environment chose,
            see mpi_transport()
    gloo    torch.distributed with the Gloo backend, rendezvous on
            tcp://ADDR:PORT with the port picked by rank 0
"""
import contextlib
import os

import numpy as np

from ..control.ports import free_port

# Launch-time variables that decide how MPICH moves bytes between ranks on one host.
MPI_ENV_PREFIXES = ("MPIR_CVAR_", "FI_", "UCX_", "MPICH_")


class Unavailable(RuntimeError):
    """A requested library cannot be used in this environment (message says why)."""


def parse_peers(values):
    """--peer may repeat and take comma lists; 'none' clears. Returns unique names in order."""
    out = []
    for value in values or ():
        for name in filter(None, (v.strip().lower() for v in value.split(","))):
            if name == "none":
                out.clear()
            elif name not in ("mpi", "gloo", "r2comm-noack"):
                raise ValueError(f"unknown peer {name!r} (expected mpi, gloo, r2comm-noack or none)")
            elif name not in out:
                out.append(name)
    return out


def mpi_transport(env=os.environ):
    """Name the path MPICH uses between ranks on one host, from the launch environment.

    The MPICH wheel (ch4 with UCX and OFI netmods) talks through shared memory
    between local ranks.  MPIR_CVAR_NOLOCAL=1 alone is not enough to get TCP:
    ranks then use the netmod, but UCX picks its own shared-memory transports.
    TCP over loopback needs the OFI netmod with libfabric's tcp provider bound
    to lo (see TCP_ENV); UCX_TLS=tcp also works but UCX refuses the lo device
    and so talks over the host's external address.
    """
    if env.get("MPIR_CVAR_NOLOCAL", "0") in ("0", ""):
        return "shm"
    if env.get("MPIR_CVAR_CH4_NETMOD", "").lower() == "ofi" and env.get("FI_PROVIDER") in ("tcp", "sockets"):
        return "tcp"
    if set(env.get("UCX_TLS", "").split(",")) in ({"tcp"}, {"tcp", "self"}):
        return "tcp"
    return "netmod"


# The environment that makes MPICH 5 (pip wheel) use TCP over 127.0.0.1 between local ranks.
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi",
           "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}


def mpi_env(env=os.environ):
    """The MPI transport variables of this launch, recorded in the JSON output."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(MPI_ENV_PREFIXES)}


def rail_record(rail):
    """A Rail (a dataclass) as plain data for JSON: every field the Communicator exposes."""
    return dict(vars(rail))


class _MpiStyle:
    """Calls shared by r2comm and mpi4py: r2comm's Communicator mirrors mpi4py's buffer API."""

    def collective(self, case, op):
        c, s, r, o = self.comm, case.send, case.recv, self.ops[op]
        calls = {
            "allreduce": lambda: c.Allreduce(s, r, op=o),
            "allgather": lambda: c.Allgather(s, r),
            "reduce_scatter": lambda: c.Reduce_scatter_block(s, r, op=o),
            "bcast": lambda: c.Bcast(r, root=case.root),
            "alltoall": lambda: c.Alltoall(s, r),
            "gather": lambda: c.Gather(s, r, root=case.root),
            "scatter": lambda: c.Scatter(s, r, root=case.root),
            "allgatherv": lambda: c.Allgatherv(s, [r, case.counts, case.displs, None]),
            "alltoallv": lambda: c.Alltoallv([s, case.counts, case.displs, None],
                                             [r, case.counts, case.displs, None]),
            "scan": lambda: c.Scan(s, r, op=o),
        }
        return calls[case.kind], None

    def send(self, buf, dest):
        return lambda: self.comm.Send(buf, dest, tag=0)

    def recv(self, buf, source):
        return lambda: self.comm.Recv(buf, source, tag=0)

    def close(self):
        self.comm.Free()


class R2comm(_MpiStyle):
    """r2comm.Communicator; the library under test."""
    name = label = "r2comm"

    def __init__(self, world):
        try:
            import r2comm
            self.comm = r2comm.Communicator(world)
        except ImportError as exc:  # the Cython engine loads with the first Communicator
            raise Unavailable(f"r2comm engine not importable ({exc}); "
                              "build it (pip install -e .) or use --no-r2comm") from exc
        self.ops = {"sum": r2comm.SUM, "prod": r2comm.PROD, "min": r2comm.MIN, "max": r2comm.MAX}

    def window(self, buf, peer, n, sending):
        post = self.comm.Isend if sending else self.comm.Irecv
        return lambda: [req.Wait() for req in [post(buf, peer, tag=0) for _ in range(n)]]

    def describe(self):
        return {"rails": [rail_record(r) for r in self.comm.rails],
                "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("R2COMM_")}}


@contextlib.contextmanager
def temporary_env(env):
    """Set these environment variables while a Communicator is built (r2comm reads its
    settings at construction), then put the old values back."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class R2commNoAck(R2comm):
    """A second r2comm communicator with acknowledgements off (R2COMM_ACKS=0: a chunk counts
    as delivered once written, no loss protection; benchmark only). In the same job as the
    normal one, interleaved, it measures what the acknowledgement machinery costs without the
    job-to-job noise of two separate runs."""
    name = label = "r2comm-noack"

    def __init__(self, world):
        with temporary_env({"R2COMM_ACKS": "0"}):   # read at bootstrap (rank 0's value is used)
            super().__init__(world)

    def describe(self):
        return dict(super().describe(), acks=False)


class Mpi(_MpiStyle):
    """mpi4py buffer calls: the reference every MPI user already has."""
    name = "mpi"

    def __init__(self, world):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = world.Dup()  # own context: never matches the harness's own messages
        self.label = f"mpi-{mpi_transport()}"
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def window(self, buf, peer, n, sending):
        post = self.comm.Isend if sending else self.comm.Irecv
        waitall = self.MPI.Request.Waitall
        return lambda: waitall([post(buf, peer, tag=0) for _ in range(n)])

    def describe(self):
        return {"transport": mpi_transport(), "library": self.MPI.Get_library_version().splitlines()[0],
                "env": mpi_env()}


class Gloo:
    """torch.distributed on Gloo (CPU tensors sharing memory with the numpy buffers)."""
    name = label = "gloo"

    def __init__(self, world, addr="127.0.0.1"):
        import torch
        import torch.distributed as dist
        if addr.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep Gloo's data sockets on loopback
        torch.set_num_threads(1)  # one core per rank on small machines
        port = free_port(addr) if world.rank == 0 else None
        port = world.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                rank=world.rank, world_size=world.size)
        self.torch, self.dist = torch, dist
        R = dist.ReduceOp
        self.ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}

    def collective(self, case, op):
        d, o = self.dist, self.ops[op]
        st, rt = self.torch.from_numpy(case.send), self.torch.from_numpy(case.recv)
        if case.kind == "allreduce":  # in place only: load the input outside the timer
            return (lambda: d.all_reduce(rt, op=o)), (lambda: np.copyto(case.recv, case.send))
        calls = {
            "allgather": lambda: d.all_gather_single(rt, st),
            "reduce_scatter": lambda: d.reduce_scatter_single(rt, st, op=o),
            "bcast": lambda: d.broadcast(rt, src=case.root),
            "alltoall": lambda: d.all_to_all_single(rt, st),
        }
        return calls[case.kind], None

    def send(self, buf, dest):
        t = self.torch.from_numpy(buf)
        return lambda: self.dist.send(t, dest)

    def recv(self, buf, source):
        t = self.torch.from_numpy(buf)
        return lambda: self.dist.recv(t, source)

    def window(self, buf, peer, n, sending):
        t = self.torch.from_numpy(buf)
        post = self.dist.isend if sending else self.dist.irecv
        return lambda: [w.wait() for w in [post(t, peer) for _ in range(n)]]

    def describe(self):
        return {"torch": self.torch.__version__, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME")}

    def close(self):
        self.dist.destroy_process_group()


def gloo_unavailable():
    """None when torch.distributed with Gloo can be used here, else the reason."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch is not importable ({exc}); pip install 'torch>=2.10,<2.16'"
    if not dist.is_gloo_available():
        return "this torch build has no Gloo backend"
    return None


def open_libraries(world, with_r2comm, peers, gloo_addr="127.0.0.1", log=print, r2comm_last=False):
    """Instantiate r2comm (unless disabled) and the peers; r2comm is listed first.

    r2comm is built first unless `r2comm_last`. The order matters between two r2comm
    communicators (r2comm against r2comm-noack): the first one built in a job ran 1-2%
    slower at 16 MiB in A/A runs, so the ack-overhead figure comes from two jobs, one per
    order. A missing r2comm is an error (it is the library under test); a missing
    Gloo is skipped with its reason.  Ranks agree on Gloo's availability with
    an allreduce so that none of them waits in a rendezvous alone.
    """
    from mpi4py import MPI
    libs = [R2comm(world)] if with_r2comm and not r2comm_last else []
    for name in peers:
        if name == "mpi":
            libs.append(Mpi(world))
            continue
        if name == "r2comm-noack":
            libs.append(R2commNoAck(world))
            continue
        reason = gloo_unavailable()
        if world.allreduce(int(reason is None), op=MPI.MIN):
            libs.append(Gloo(world, gloo_addr))
        elif world.rank == 0:
            log(f"# gloo peer skipped: {reason or 'torch is missing on another rank'}")
    if with_r2comm and r2comm_last:
        libs.insert(0, R2comm(world))
        built = libs[1:] + libs[:1]
    else:
        built = libs
    for i, lib in enumerate(built):
        lib.built = i      # construction order, recorded in the JSON
    if not libs:
        raise Unavailable("nothing to benchmark: r2comm disabled and no peer available")
    return libs
