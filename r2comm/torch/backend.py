"""The torch.distributed backend "r2comm": how a process group of it is made and registered.

How it plugs in (torch 2.10 to 2.15). register() names "r2comm" to torch with
Backend.register_backend(..., extended_api=True) for "cpu", and for "cuda" only where torch has
CUDA and sees a GPU. torch calls _create for every process group of the backend (the group's
store, ranks, timeout and name), which returns a c10d Backend made in C++ (_backend.cpp, built
against the installed torch: native.py), so torch's dispatcher runs r2comm's collectives as it
runs Gloo's: CommDebugMode counts them, the profiler shows them, DDP's reducer, functional
collectives, DeviceMesh and DTensor reach them through torch's own ProcessGroup.

Bootstrap. The default group builds the r2comm world with Communicator.from_store over the
group's store (torchrun's TCPStore under env://): the job secret, endpoints and host names travel
through it, then r2comm opens its own connections. A sub-group (new_group) of that world uses the
same engine and connections: a child communicator whose id its members agree on through the
sub-group's store; its operations time out after the sub-group's own timeout (R2COMM_TIMEOUT,
when set, bounds every group's). A group whose ranks are not all in the world (the default group
is another backend) gets a world of its own. shrink_group makes a communicator over the
remaining ranks the same way, over the shrunk group's store; once the group's Communicator was
revoked (a rank died: recover.py) it is the survivors' Communicator.Shrink() instead."""
import datetime
import os

import torch
import torch.distributed as dist

from ..control.bootstrap_store import StoreComm
from ..communicator import Communicator
from ..errors import R2commArgumentError, R2commError
from ..world import engine_module
from . import native, pyops, recover

BACKEND_NAME = "r2comm"

# the Communicator whose r2comm world every later group shares (the default group's, built
# first), and {torch global rank: its rank in that Communicator}
_root = {"comm": None, "rank_of": None}
_groups = {}           # group name -> (its Communicator, its Backend), until its shutdown
# a grown Communicator that the default group init_process_group is making takes (_adopt)
_adopting = {"comm": None}


def devices():
    """The device types the backend registers for: "cpu", and "cuda" where torch has CUDA and
    sees a GPU (else torch would prefer a device it cannot use)."""
    found = ["cpu"]
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        found.append("cuda")
    return found


def _seconds(timeout):
    """The group's timeout in seconds; None where R2COMM_TIMEOUT sets every group's."""
    if os.environ.get("R2COMM_TIMEOUT"):
        return None                       # the Communicator reads R2COMM_TIMEOUT itself
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _communicator(store, rank, size, secs, granks):
    """The Communicator of a new group: a child of the world's where all its ranks are in
    it, else a world of its own (the default group's becomes _root)."""
    adopted = _adopting["comm"]
    if adopted is not None:           # grow()/join(): the default group on a grown world
        _adopting["comm"] = None
        if (adopted.rank, adopted.size) != (rank, size):
            raise R2commArgumentError(f"r2comm backend: the grown communicator is rank "
                                      f"{adopted.rank} of {adopted.size}, torch asked for "
                                      f"{rank} of {size}")
        _root["comm"], _root["rank_of"] = adopted, {i: i for i in range(size)}
        return adopted
    world, ranks = _root["comm"], _root["rank_of"]
    usable = (granks and world is not None and not world.channel.closed
              and all(g in ranks for g in granks))
    if not usable:
        comm = Communicator.from_store(store, rank, size, prefix="r2comm",
                                       store_timeout=secs or 300.0, timeout=secs)
        if not granks or world is None or world.channel.closed:
            _root["comm"] = comm
            _root["rank_of"] = {(granks[i] if granks else i): i for i in range(size)}
        return comm
    sc = StoreComm(store, rank, size, "r2comm-group", secs or 300.0)
    comm = world.derive(sc, [ranks[g] for g in granks])   # its id agreed over the group's store
    comm.timeout = world.timeout if secs is None else secs  # the group's own
    return comm


def _backend(comm, store, rank, size, secs, name, xchg=None):
    """The native Backend of a group on Communicator `comm` (`xchg`: its point-to-point
    twin where comm.Dup() cannot make one, a communicator made by Shrink)."""
    mod = native.module()
    mod.set_errors(pyops.engine_error)
    pyops.set_gpu_reduce(comm.channel.config.gpu_reduce)
    made = []

    def remake(excluded):
        """shrink_group: a Backend of this group without ranks `excluded`; after a rank died
        (the group's Communicator revoked) the survivors' (recover.survivors)."""
        keep = [r for r in range(size) if r not in set(excluded)]
        me = keep.index(rank)
        if comm.Is_revoked():
            new, twin = recover.survivors(comm, excluded)
            return _backend(new, store, new.rank, new.size, secs, None, twin)
        sc = StoreComm(store, me, len(keep), f"r2comm-shrink-{len(made)}", secs or 300.0)
        made.append(1)
        members = [comm.channel.world_rank(r) for r in keep]
        child = comm.derive(sc, members)
        child.timeout = comm.timeout
        return _backend(child, store, me, len(keep), secs, None)

    def forget():
        if name is not None and _groups.get(name, (None,))[0] is comm:
            del _groups[name]

    ops = pyops.Ops(comm, rank, size, remake, forget, xchg)
    backend = mod.R2commBackend(rank, size, comm.channel, ops, comm.channel.engine,
                                engine_module().c_api())
    if name is not None:
        _groups[name] = (comm, backend)
    return backend


def _create(dist_opts, pg_options=None):
    secs = _seconds(dist_opts.timeout)
    rank, size = dist_opts.group_rank, dist_opts.group_size
    comm = _communicator(dist_opts.store, rank, size, secs, list(dist_opts.global_ranks_in_group))
    return _backend(comm, dist_opts.store, rank, size, secs, dist_opts.group_id)


def _entry(group):
    pg = dist.group.WORLD if group is None else group
    entry = _groups.get(pg.group_name)
    if entry is not None:
        return entry
    # a group torch made from a Backend of ours (shrink_group names it after the call)
    mod = native.loaded()
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        backend = None
    if mod is not None and isinstance(backend, mod.R2commBackend):
        return backend.ops.comm, backend          # (backend.comm is its Channel)
    raise ValueError(f"process group {pg.group_name!r} is not an r2comm group")


def communicator(group=None):
    """The r2comm Communicator of process group `group` (default: the default group) of this
    backend: rails, events, fail_rail, timeout."""
    return _entry(group)[0]


def native_backend(group=None):
    """The c10d Backend object of r2comm group `group` (default: the default group):
    .comm, .pending_works (operations in flight)."""
    return _entry(group)[1]


def shrink(group=None):
    """The survivors' ProcessGroup of r2comm group `group` (default: the default group, which
    torch then replaces) after a rank of it died (recover.shrink): every survivor calls it and
    goes on with the group it returns (ranks 0..k-1 in the old order)."""
    return recover.shrink(communicator(group), group)


def grow(store, joiners, *, prefix, store_timeout=300.0):
    """The default group of the survivors (this group's ranks first, in their order) and
    `joiners` new processes, each of which calls join(store, prefix=prefix): every survivor
    calls it (after shrink(), typically) and goes on with the group it returns, which torch
    now holds as the default group (dist.get_rank(), dist.all_reduce(t), DDP). The old default
    group and its r2comm world are destroyed and freed once the new one is formed; until then
    they keep working, and where the growth fails (a joiner never comes: store_timeout) they
    are left as they were and torch's error type (DistBackendError) is raised. `prefix` names
    this growth on `store` (a fresh one every time)."""
    comm, backend = _entry(None)
    olds = [comm, backend.ops.pt2pt_comm, _root["comm"]]
    try:
        new = comm.Grow(store, joiners, prefix=prefix, store_timeout=store_timeout,
                        timeout=comm.timeout)
    except R2commError as exc:
        pyops.raise_as_torchs(exc)
    dist.destroy_process_group()
    group = _adopt(new, store, prefix)
    # the shrunk communicator, its twin, then the world (each once: a group never shrunk is
    # its world's communicator)
    for old in {id(c): c for c in olds if c is not None and c is not new}.values():
        old.Free()
    return group


def join(store, *, prefix, timeout=None, store_timeout=300.0):
    """In a new process (a replacement of a dead rank, or one more): join the group that the
    survivors grow with grow(store, joiners, prefix=prefix) and return it, torch's default
    group here too (init_process_group is not called before). This process gets the next new
    rank; store_timeout bounds the wait for the survivors; `timeout` (seconds or a timedelta,
    default R2COMM_TIMEOUT or r2comm's) is the group's."""
    register()
    if dist.is_initialized():
        raise ValueError("r2comm.torch.join: this process already has a default group "
                         "(join makes it)")
    secs = None if timeout is None else _seconds(timeout)
    try:
        new = Communicator.join(store, prefix=prefix, store_timeout=store_timeout,
                                **({} if secs is None else {"timeout": secs}))
    except R2commError as exc:
        pyops.raise_as_torchs(exc)
    return _adopt(new, store, prefix)


def _adopt(comm, store, prefix):
    """torch's default group on the grown Communicator `comm` (its store: `store` under
    prefix/torch, for the sub-groups torch makes later)."""
    _adopting["comm"] = comm
    try:
        dist.init_process_group(BACKEND_NAME, store=dist.PrefixStore(f"{prefix}/torch", store),
                                rank=comm.rank, world_size=comm.size,
                                timeout=datetime.timedelta(seconds=comm.timeout))
    finally:
        _adopting["comm"] = None
    return dist.group.WORLD


def register():
    """Register "r2comm" with torch.distributed (idempotent) for devices()."""
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) == BACKEND_NAME and \
            BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices())
