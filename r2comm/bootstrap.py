"""Bootstrap through mpi4py: job secret, agreed engine parameters, endpoint exchange."""
import hashlib
import os
import socket
from dataclasses import dataclass

from . import hostid
from . import shm
from . import rails as _rails
from . import verbs_rails
from .errors import R2commArgumentError
from .startup import quiet_barrier


@dataclass
class Bootstrap:
    rank: int
    size: int
    secret: bytes
    job: bytes
    params: dict
    rail_addrs: list
    listeners: list          # one per rail, then the control listener
    transport: str           # the job's rail transport: "tcp" or "verbs" (verbs_rails.decide)
    rail_devices: list       # verbs: this rank's RailDevice per rail; tcp: None
    endpoints: list          # per rank: {"rails": [(addr, port)], "ctrl": (addr, port), "host": str,
                             #  "host_key": str (r2comm.hostid: same key = same host),
                             #  "shm": shm.shm_key() or None (R2COMM_SHM=0),
                             #  "pid": int (names its shm segments)}


def run(mpi_comm, cfg, rails=None):
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    # ranks start at different times (imports, MPI start-up): wait for the others asleep, not
    # in a busy-polling MPI collective
    quiet_barrier(mpi_comm, cfg.timeout, "start-up (waiting for every rank to create its "
                  "Communicator)")
    secret = mpi_comm.bcast(os.urandom(32) if rank == 0 else None, root=0)
    job = hashlib.sha256(secret).digest()[:8]
    # parameters every rank must share come from rank 0
    params = mpi_comm.bcast(dict(chunk_size=cfg.chunk_size, acks=cfg.acks,
                                 integrity=cfg.integrity) if rank == 0 else None,
                            root=0)
    error = None
    listeners = []
    what = "rails=" if rails is not None else "R2COMM_RAILS"
    try:
        addrs = _rails.resolve_all(rails if rails is not None else cfg.rails, what)
        for k, a in enumerate(addrs):
            listeners.append(_rails.listen_on(a, what, k))
        listeners.append(_rails.listen_on(_rails.resolve(cfg.ctrl_addr, "R2COMM_CTRL_ADDR"),
                                          "R2COMM_CTRL_ADDR"))
    except (OSError, ValueError) as exc:
        addrs, error = [], f"rank {rank}: {exc}"
    errors = [e for e in mpi_comm.allgather(error) if e]
    if errors:
        for s in listeners:
            s.close()
        raise R2commArgumentError("r2comm bootstrap failed: " + "; ".join(errors))
    kind, devices, why = verbs_rails.local_offer(cfg.transport, addrs)
    mine = {"rails": [s.getsockname() for s in listeners[:-1]],
            "transport": (cfg.transport, kind, why),
            "ctrl": listeners[-1].getsockname(), "host": socket.gethostname(),
            "host_key": hostid.host_key(), "pid": os.getpid(),
            "shm": shm.shm_key() if cfg.shm else None}
    endpoints = mpi_comm.allgather(mine)
    try:
        transport = verbs_rails.decide([ep["transport"] for ep in endpoints])
    except R2commArgumentError:
        for s in listeners:
            s.close()
        raise
    return Bootstrap(rank, size, secret, job, params, addrs, listeners, transport,
                     devices if transport == "verbs" else None, endpoints)
