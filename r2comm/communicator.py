"""Communicator: mpi4py's collective and point-to-point API over r2comm's multi-rail engine.

The mpi4py face: arguments are checked here with the GIL held, then one call goes down, to the
Channel it holds (channel.py: sequence numbers, plans of the epoch, posting to the engine) or to
the world it runs on (world.py: links, transports, ids), through their public methods only. The
transfer itself runs in the engine's progress thread, and the caller waits on it without the
GIL."""
import functools

import numpy as np

from .control import tree as control
from .control import recovery
from .front import railview
from .front.args import (ANY_SOURCE, ANY_TAG, IN_PLACE, PROC_NULL, as_array as _as_array,
                         check_root, block_of as _block_of, check_apart as _check_apart,
                         is_in_place, device_args as _device_args, pair as _pair)
from .front.buffers import as_array as _as_blocks
from .channel import Channel
from .config import Config
from .errors import (R2commArgumentError, R2commBufferError, R2commError, R2commResourceError,
                     unsupported)

# errors a call finds on this rank before it posts anything (a bad argument, too few fds for the
# connections its plan needs): the caller raises them and tells the peers (Channel.tell_peers)
_TOLD_ERRORS = (R2commArgumentError, R2commResourceError)
from .faults import MODES as _FAULT_MODES
from .ops import DTYPES as _DTYPES, Op as _Op, SUM, U8, as_op, dtype_code, mpi_op, reduce_code
from .front.plans import call_name
from .planner.schedule import WORK, SEND
from .front.pt2pt import PointToPoint
from .control.startup import quiet_barrier
from .front.vcoll import VectorCollectives
from .request import ThreadRequest
from .world import World, bootstrap_consts, agree_max, engine_module as _engine

__all__ = ["Communicator", "IN_PLACE", "ANY_TAG", "ANY_SOURCE", "PROC_NULL"]


class _Unformed:
    """The channel of a Communicator that Ishrink() returned before its request completed:
    every use raises."""
    rank = size = None

    def __getattr__(self, name):
        raise R2commError("this communicator comes from Ishrink(): Wait() for its request "
                          "before using it")


class Communicator(VectorCollectives, PointToPoint):
    """A group of ranks that run collectives over every rail between each pair.

    Communicator(mpi_comm=MPI.COMM_WORLD, *, rails=None, timeout=None, chunk_size=None, ...)
    bootstraps through mpi4py: ranks, a job secret, one listening endpoint per rail, then one
    authenticated TCP connection per rail (plus a control connection) to every peer.

    Start-up is bounded by connect_timeout (R2COMM_CONNECT_TIMEOUT, default 5 s): a rail that
    does not connect by then starts down for that pair (event rail_never_up, comm.rails) and
    is probed for fail-back like a rail that failed later; the first plans route around it.
    Only a control connection that does not come up, or rails that leave the ranks in
    disconnected groups, raise R2commNetworkError (on every rank). Point-to-point calls are
    pt2pt.py's, Gather/Scatter, the vector collectives and the scans vcoll.py's."""

    def __init__(self, mpi_comm=None, *, rails=None, timeout=None, chunk_size=None,
                 rail_timeout_ms=None, peer_timeout_ms=None, ctrl_addr=None, on_event=None,
                 connect_timeout=None):
        _engine()                          # R2commBuildError before any bootstrap
        cfg = Config.from_env()
        for name, val in (("timeout", timeout), ("chunk_size", chunk_size),
                          ("rail_timeout_ms", rail_timeout_ms), ("peer_timeout_ms", peer_timeout_ms),
                          ("ctrl_addr", ctrl_addr), ("connect_timeout", connect_timeout)):
            if val is not None:
                setattr(cfg, name, val)
        if mpi_comm is None:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        if callable(getattr(mpi_comm, "Is_inter", None)) and mpi_comm.Is_inter():
            raise unsupported("an intercommunicator", "build the Communicator on an "
                              "intracommunicator (intercomm.Merge() joins both groups)")
        world = World.open(mpi_comm, cfg, rails, on_event)
        chan = Channel(world, list(range(world.boot.size)), world.ids.WORLD)
        self._attach(world, mpi_comm, chan, owner=True)
        nbytes = world.probe_size(mpi_comm)    # every rank probes alike (message sizes), or none
        if nbytes:
            try:
                world.probe_bandwidth(control.plane(chan), mpi_comm, nbytes, chan.plan_state,
                                      min(self.timeout, 30.0))
            except BaseException:
                world.close()
                raise
        world.arm_faults(cfg.fault, self.rank, self.fail_rail, self.restore_rail)
        quiet_barrier(mpi_comm, cfg.timeout, "start-up (the last ranks' set-up)")

    def _attach(self, world, mpi_comm, chan, owner):
        self._world = world          # the world it runs on (world.py)
        self._mpi = mpi_comm         # its bootstrap communicator (lowercase object calls)
        self._chan = chan            # its line to the engine (channel.py)
        self._owner = owner          # it opened the world: Free() closes it
        self._freed = False
        self.rank = chan.rank
        self.size = chan.size

    @classmethod
    def _over(cls, world, mpi_comm, chan):
        """A Communicator over channel `chan` of `world` (Dup, Split, twins, derive)."""
        comm = cls.__new__(cls)
        comm._attach(world, mpi_comm, chan, owner=False)
        return comm

    @property
    def channel(self):
        """r2comm's internal interface to this communicator's engine side (channel.Channel):
        for r2comm's own modules (gpu/pipeline.py, the torch backend, tests), not the mpi4py
        face."""
        return self._chan

    @property
    def timeout(self):
        """Seconds: the bound of every blocking wait of this communicator."""
        return self._chan.timeout

    @timeout.setter
    def timeout(self, seconds):
        self._chan.timeout = seconds

    def twin(self, kind, generation=0):
        """A hidden Communicator over the same ranks with its own id (Channel.twin: kind
        "control", "epoch" or "gpu" with its generation); r2comm's internal interface."""
        return self._over(self._world, self._mpi, self._chan.twin(kind, generation))

    def derive(self, boot_comm, members):
        """A new Communicator of this world over `members` (world ranks, in rank order) on
        bootstrap communicator `boot_comm` (Channel.derive; collective over boot_comm)."""
        return self._over(self._world, boot_comm, self._chan.derive(boot_comm, members))

    @classmethod
    def from_store(cls, store, rank, size, *, prefix="r2comm", store_timeout=300.0, **kwargs):
        """Bootstrap through a key-value store instead of MPI (torchrun's TCPStore, torch's
        FileStore, or r2comm.control.bootstrap_store.DirStore without torch): every rank calls it with
        the same store, size and prefix and its own rank; the other keyword arguments are the
        constructor's. store_timeout (s) bounds each wait for the other ranks' keys. The salt of
        the job secret and the endpoints travel through the store, never pickled (the lowercase
        object calls then take None, bool, int, float, str, bytes, list, tuple and dict); set
        R2COMM_JOB_SECRET_FILE on every rank where others can read the store (README,
        Security); no MPI."""
        from .control.bootstrap_store import StoreComm, instance_prefix
        comm = StoreComm(store, rank, size, instance_prefix(store, prefix), store_timeout)
        return cls(comm, **kwargs)

    def Grow(self, store, joiners, *, prefix, store_timeout=300.0, **kwargs):
        """A new Communicator of this one's ranks (first, in their order) and `joiners` new
        processes (ranks size .. size + joiners - 1), each of which calls
        Communicator.join(store, prefix=prefix) (issue 44; ncclCommGrow's role). Collective
        over this communicator; `prefix` names this growth on `store` (a fresh one every
        time). The new communicator is a world of its own (its connections, engine and
        detector; this one keeps running meanwhile): Free this one once you are done with it.
        store_timeout and the other keyword arguments are from_store's."""
        from .control.bootstrap_store import StoreComm, announce_growth
        self._chan.check()
        if not isinstance(joiners, int) or joiners < 0:
            raise R2commArgumentError(f"Grow: joiners must be an int >= 0, not {joiners!r}")
        size = self.size + joiners
        if self.rank == 0:
            announce_growth(store, prefix, self.size, size)
        kwargs.setdefault("timeout", self.timeout)
        return type(self)(StoreComm(store, self.rank, size, f"{prefix}/world", store_timeout),
                          **kwargs)

    @classmethod
    def join(cls, store, *, prefix, store_timeout=300.0, **kwargs):
        """Join a communicator that grows (Grow with the same store and prefix): this process
        claims the next new rank and returns the grown Communicator. store_timeout bounds the
        wait for the announcement and each bootstrap step; the other keyword arguments are
        from_store's."""
        from .control.bootstrap_store import StoreComm, claim_growth
        rank, size = claim_growth(store, prefix, store_timeout)
        return cls(StoreComm(store, rank, size, f"{prefix}/world", store_timeout), **kwargs)

    @property
    def probe_result(self):
        """What the start-up bandwidth probe measured on this rank (control/bandwidth.ProbeResult:
        .rates {(peer, rail): bytes/s}, .seconds), or None when it did not run (R2COMM_PROBE=0)."""
        return self._world.probe

    # -- mpi4py-style accessors ----------------------------------------------------------------
    def Get_rank(self):
        """This rank's index in the communicator (0 .. size-1)."""
        return self.rank

    def Get_size(self):
        """The number of ranks in the communicator."""
        return self.size

    @property
    def mpi_comm(self):
        """The mpi4py communicator this one was built on (bootstrap and lowercase object calls;
        None for one made by Shrink)."""
        return self._mpi

    def _boot(self, what):
        """The bootstrap communicator that `what` (a lowercase object call, Dup, Split) goes
        through; R2commError where there is none (a communicator made by Shrink)."""
        if self._mpi is None:
            raise R2commError(f"{what}: this communicator was made by Shrink() and has no "
                              f"bootstrap (MPI or store) communicator, which the survivors "
                              f"cannot use once a rank died; use the buffer calls (Allreduce, "
                              f"Bcast, ...) on numpy arrays")
        return self._mpi

    # -- communicator management ---------------------------------------------------------------
    def Dup(self):
        """A new communicator over the same ranks with its own sequence of operations, so
        a library can run collectives that never match the caller's. Collective: every rank
        calls it. Shares this one's connections; Free() it when done."""
        self._chan.check()
        new_mpi = self._boot("Dup").Dup()
        return self.derive(new_mpi, self._chan.global_ranks())

    def Split(self, color=0, key=0):
        """Collective: ranks passing the same `color` form a new communicator, ordered by
        `key` (then by rank), as MPI_Comm_split. A rank passing `color=None`, a negative color
        or MPI.UNDEFINED takes part but gets None back."""
        self._chan.check()
        UNDEFINED = bootstrap_consts(self._boot("Split"))[1]
        undefined = color is None or color == UNDEFINED or color < 0
        colors = self._mpi.allgather(None if undefined else color)
        distinct = sorted({c for c in colors if c is not None})
        base = self._world.ids.agree(agree_max(self._mpi), len(distinct) + 1)
        new_mpi = self._mpi.Split(UNDEFINED if undefined else color, key)
        if undefined:
            return None
        members = new_mpi.allgather(self._world.boot.rank)
        return self._over(self._world, new_mpi,
                          Channel(self._world, members, base + distinct.index(color)))

    def Free(self):
        """Collective, as in MPI: a bounded barrier first, so no rank closes its connections
        while a peer still needs acknowledgements or retransmissions from it."""
        if self._freed:
            return
        self._freed = True
        if self._owner:
            if not self._world.closed:
                try:
                    self.Ibarrier().Wait(timeout=min(self.timeout, 10.0))
                except Exception:        # a dead peer must not keep us from closing
                    pass
            self._chan.free()            # (its agreement's responder stops before the engine)
            self._world.close()
            return
        if self._mpi is not None:
            try:
                self._mpi.Free()
            except Exception:
                pass
        self._chan.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.Free()

    # -- observation and faults ----------------------------------------------------------------
    @property
    def events(self):
        """The failover events this rank's engine keeps (the last 1,024 to 2,048; dicts, oldest
        first, each numbered: "index")."""
        self._chan.check()
        return self._chan.engine.events_since(0)

    def on_event(self, callback):
        """Call `callback(event)` for each new event (from r2comm's link thread)."""
        self._world.callbacks.append(callback)

    @property
    def rails(self):
        """This rank's rails with live state, summed over the communicator's peers (NIC rails:
        remote peers only; a local peer's link is shared memory, see shm_peers)."""
        self._chan.check()
        return self._world.transports.nic_rails(self._chan.engine, self._chan.global_ranks())

    @property
    def reg_cache(self):
        """The registration cache of RDMA rails (zero-copy sends from user memory): {"entries",
        "entry_bytes", "zcopy_bytes", "copy_bytes", "zcopy_sends", "registered",
        "deregistered", "live", "busy", "refused"}, summed over this rank's rail devices;
        None on TCP rails or with zero-copy sends off."""
        self._chan.check()
        rc = self._world.regcache
        return None if rc is None else rc.stats()

    @property
    def shm_peers(self):
        """The ranks of this communicator reached through shared memory (same host, R2COMM_SHM
        on both), each with its link's live state: {rank: {"state", "bytes_sent",
        "bytes_recv", "failures"}}. NIC rails (comm.rails) and NIC faults concern the others."""
        self._chan.check()
        return self._world.transports.memory_links(self._chan.engine,
                                                   self._chan.global_ranks())

    def fail_rail(self, index, mode="hard", peer=None, after_bytes=None):
        """Fail this rank's rail `index` for real: "hard" shuts the connections down, "silent"
        makes the NIC drop everything without an error. peer (a rank of this communicator)
        limits it to one peer; after_bytes delays it until that many more bytes were sent."""
        self._chan.check()
        if mode not in _FAULT_MODES:
            raise R2commArgumentError(f"mode must be 'hard' or 'silent', got {mode!r}")
        gpeer = -1 if peer is None else self._chan.world_rank(peer)
        self._chan.engine.faults.inject(index, _FAULT_MODES[mode], gpeer,
                                   -1 if after_bytes is None else int(after_bytes))

    def restore_rail(self, index):
        """Lift an injected fault; the rail is probed and re-admitted automatically."""
        self._chan.check()
        self._chan.engine.faults.clear_injection(index)

    # -- planning ------------------------------------------------------------------------------
    def schedule(self, op="allreduce", nbytes=0, itemsize=4, root=0, in_place=False):
        """The schedule (planner.Schedule) this rank would run for (op, nbytes): its algorithm
        (.algo; .hierarchical is True for the host-aware plans of planner/hierarchical.py),
        messages and the predicted seconds (.cost) once the plans are priced (a rail state after
        replan(), or several hosts running several ranks)."""
        return self._chan.compiled(op, nbytes, itemsize, root, separate=not in_place)[1]

    plan = schedule     # the older name, kept for existing scripts

    def topology(self):
        """Which ranks share a host (host keys from bootstrap, r2comm.control.hostid; R2COMM_HOST
        overrides a rank's key): a dict with nhosts, hosts (the ranks of each host, in rank
        order), rails_per_host (rails listed by the host's ranks), regular (every host runs
        as many ranks), hierarchical (several hosts, some with several ranks: the planner then
        prices hierarchical plans), and this rank's host, local_rank and local_size. Once the
        plans follow a rail state (replan()), rails_up_per_host counts each host's NICs that
        the state has usable towards another host."""
        return railview.describe(self._chan.topo, self.rank, self._chan.plan_state)

    # -- re-planning ---------------------------------------------------------------------------
    def rail_state(self):
        """The rail state of this communicator from the NIC facts every rank holds (collective,
        over r2comm's control plane: it waits until the ranks' facts agree): per host and NIC
        (a NIC announced down at 0, one announced slow at its fraction of the rail's figure,
        R2COMM_RAIL_BW x 10 Gbit/s), plus the pairs announced down (planner.state.NicRailState)."""
        self._chan.check()
        return self._chan.agreed_state()

    @property
    def epoch(self):
        """The agreed rail-state epoch: 0 at start, +1 at every switch of the plans (a NIC
        announced down or up again, by default; an R2COMM_REPLAN=K check; a replan() call);
        the same on every rank after the same operation."""
        return self._chan.epoch

    def replan(self, state=None):
        """Make the plans follow the rail state (rail_state(), or `state`) from the next call on
        (collective: every rank calls it at the same operation boundary). Needed only with
        R2COMM_REPLAN=0 or for a state of your own: by default the plans follow the NIC facts
        by themselves. Broken pairs are routed around; a slow host gets the degraded-server
        allreduce or the tree fold when the cost model says it is faster. Returns the state."""
        self._chan.check()
        state = self.rail_state() if state is None else state
        self._chan.switch_plans(state, force=True)
        return state

    # -- collectives (buffer interface) ----------------------------------------------------------
    def Iallreduce(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Start an allreduce; returns a Request (see Allreduce for the arguments). Several
        may be in flight at once; every rank must start the same collectives in the same order."""
        return self._call("allreduce", False, self._iallreduce, sendbuf, recvbuf, op, stream=stream)

    def Allreduce(self, sendbuf, recvbuf, op=SUM, stream=None, *, as_nonblocking=False):
        """Combine `sendbuf` of every rank with `op` (SUM, PROD, MIN, MAX or mpi4py's
        MPI.* ops) into `recvbuf` on every rank. Pass IN_PLACE as sendbuf to reduce recvbuf in
        place. Buffers: numpy arrays, buffer-protocol objects or mpi4py specifications such as
        [buf, MPI.FLOAT], of the same size and dtype on every rank; the result is bitwise the same
        on every rank. Raises R2commMismatchError when ranks disagree, R2commTimeout after
        comm.timeout, R2commNetworkError when a peer is lost; rail failures are survived.
        as_nonblocking=True: the call matches the other ranks' Iallreduce (an Iallreduce
        waited for at once, at Allreduce's cost; for front ends whose synchronous and
        asynchronous calls must match each other, such as torch's)."""
        if type(recvbuf) is np.ndarray and stream is None and \
                self._fast_allreduce(sendbuf, recvbuf, op, not as_nonblocking):
            return
        req = self._call("allreduce", not as_nonblocking, self._iallreduce, sendbuf, recvbuf, op,
                         stream=stream)
        if as_nonblocking:
            req.Wait()

    def prepare_allreduce(self, nbytes, dtype, op=SUM):
        """A function f(sendbuf, recvbuf) doing Allreduce(sendbuf, recvbuf, op,
        as_nonblocking=True) for separate numpy arrays of `nbytes` bytes of `dtype`, with the
        op and dtype converted once: for front ends whose small calls are latency-bound (the
        torch backend). Buffers of another kind or dtype raise R2commArgumentError (the peers'
        call R2commPeerError); anything else is Allreduce's, errors included. Not collective:
        each rank prepares its own."""
        self._chan.check()
        dt = np.dtype(dtype)
        op = as_op(op)
        dtc = reduce_code(dt, op)
        if type(nbytes) is not int or nbytes <= 0 or nbytes % dt.itemsize:
            raise R2commArgumentError(f"prepare_allreduce: {nbytes!r} bytes is not a positive "
                                      f"multiple of {dt}'s {dt.itemsize}")
        key = ("fast", nbytes, dtc, op.code, True)
        ndarray = np.ndarray

        def allreduce(sendbuf, recvbuf):
            """Allreduce(sendbuf, recvbuf, op, as_nonblocking=True), prepared."""
            try:
                ok = recvbuf.dtype is dt and sendbuf.dtype is dt
            except AttributeError:
                ok = False
            if not ok and not (type(recvbuf) is ndarray and type(sendbuf) is ndarray and
                               recvbuf.dtype == dt and sendbuf.dtype == dt):
                err = R2commArgumentError(f"prepared allreduce: numpy arrays of {dt} expected")
                self._chan.tell_peers(err, "allreduce", False)
                raise err
            if not self._chan.run_cached(key, "allreduce", recvbuf, sendbuf, nbytes, dt.itemsize,
                                    dtc, op.code, False):
                self.Allreduce(sendbuf, recvbuf, op, as_nonblocking=True)
        return allreduce

    def _fast_allreduce(self, sendbuf, recvbuf, op, blocking=True):
        """Allreduce of numpy arrays in one engine call (Engine.run: export, post, wait,
        release), for the latency-bound calls where the general path's Python (buffer
        wrappers, Request, plan lookup by a long key) cost as much as the transfer. Returns
        False, having done nothing, for anything it does not cover (other buffer kinds, a
        dtype or op to convert or refuse, a re-plan check due, relayed members, registered
        memory): the general path then handles the call and its errors."""
        if sendbuf is IN_PLACE:
            send = None
        elif type(sendbuf) is np.ndarray and sendbuf.dtype == recvbuf.dtype and \
                sendbuf.nbytes == recvbuf.nbytes:
            send = sendbuf
        else:
            return False
        if type(op) is not _Op:
            op = mpi_op(op)
            if op is None:
                return False
        dtc = _DTYPES.get(recvbuf.dtype)
        nbytes = recvbuf.nbytes
        flags = recvbuf.flags
        if dtc is None or not nbytes or not (flags.c_contiguous and flags.writeable) or \
                not (send is None or send.flags.c_contiguous):
            return False
        return self._chan.run_cached(("fast", nbytes, dtc, op.code, send is not None), "allreduce",
                                recvbuf, send, nbytes, recvbuf.itemsize, dtc, op.code, blocking)

    def _call(self, kind, blocking, start, *args, stream=None):
        """Run a collective's start function; a bad argument on this rank is told to the peers
        (they raise R2commPeerError and the call still counts, so the sequence stays in step).
        Blocking calls wait here: MPI never matches them with non-blocking ones. Device buffers
        (cupy arrays, ...) take the staging pipeline (r2comm/gpu/pipeline.py)."""
        if _device_args(args):
            return self._device_call(kind, blocking, args, stream)
        if stream is not None:
            raise R2commArgumentError("stream= orders a collective on device buffers; these "
                                      "buffers are host memory")
        try:
            req = start(*args, blocking)
        except _TOLD_ERRORS as exc:
            self._chan.tell_peers(exc, kind, blocking)
            raise
        if not blocking:
            return req
        req.Wait()

    def _device_call(self, kind, blocking, args, stream):
        from .gpu import pipeline
        self._chan.check()
        try:
            req = pipeline.start(self, kind, blocking, args, stream)
        except _TOLD_ERRORS as exc:
            pipeline.tell_peers(self, exc, call_name(kind))
            raise
        if not blocking:
            return req
        req.Wait()

    @property
    def gpu_path(self):
        """How collectives on device buffers move data: "staged-pipelined" (pinned host
        staging, chunked and overlapped with the wire) on every rail; GPUDirect RDMA is not
        available (gpu_info() says why)."""
        from .gpu import GPU_PATH
        return GPU_PATH

    def gpu_info(self):
        """The device-buffer path of this communicator: path, whether GPUDirect is used and
        why not, the reduction mode, segment and pool sizes, and counters of the calls so far
        (calls, segments, bytes, device reductions, backend)."""
        from .gpu import pipeline
        return pipeline.info(self)

    def _iallreduce(self, sendbuf, recvbuf, op=SUM, _blocking=False):
        self._chan.check()
        op = as_op(op)
        s, r = _pair(sendbuf, recvbuf, "Allreduce")
        if s.nbytes != r.nbytes:
            raise R2commBufferError(f"Allreduce: sendbuf has {s.nbytes} bytes, recvbuf {r.nbytes}")
        dtc = reduce_code(r.dtype, op)
        pre = [] if s is r else [(WORK, 0, SEND, 0, r.nbytes)]
        return self._chan.start("allreduce", r.nbytes, r.itemsize, dtc, op.code, r, s, extra_pre=pre,
                           blocking=_blocking)

    def Ireduce(self, sendbuf, recvbuf, op=SUM, root=0, stream=None):
        """Start a reduce to `root`; returns a Request (see Reduce)."""
        return self._call("reduce", False, self._ireduce, sendbuf, recvbuf, op, root,
                          stream=stream)

    def Reduce(self, sendbuf, recvbuf, op=SUM, root=0, stream=None):
        """Combine `sendbuf` of every rank with `op` into `recvbuf` on rank `root` (recvbuf
        is ignored elsewhere; IN_PLACE as sendbuf on the root reduces recvbuf in place)."""
        self._call("reduce", True, self._ireduce, sendbuf, recvbuf, op, root, stream=stream)

    def _ireduce(self, sendbuf, recvbuf, op=SUM, root=0, _blocking=False):
        self._chan.check()
        op = as_op(op)
        check_root(root, self.size)
        if self.rank == root:
            s, r = _pair(sendbuf, recvbuf, "Reduce")
            if s.nbytes != r.nbytes:
                raise R2commBufferError(f"Reduce: sendbuf has {s.nbytes} bytes, recvbuf {r.nbytes}")
            pre = [] if s is r else [(WORK, 0, SEND, 0, r.nbytes)]
        else:
            s = _as_array(sendbuf, False, "Reduce sendbuf")
            r, pre = None, []
        return self._chan.start("reduce", s.nbytes, s.itemsize, reduce_code(s.dtype, op), op.code, r, s,
                           root=root, extra_pre=pre, blocking=_blocking)

    def Ibcast(self, buf, root=0, stream=None):
        """Start a broadcast from `root`; returns a Request (see Bcast)."""
        return self._call("bcast", False, self._ibcast, buf, root, stream=stream)

    def Bcast(self, buf, root=0, stream=None):
        """Copy `buf` of rank `root` into `buf` on every other rank (same size and dtype
        everywhere; writable except on the root)."""
        self._call("bcast", True, self._ibcast, buf, root, stream=stream)

    def _ibcast(self, buf, root=0, _blocking=False):
        self._chan.check()
        check_root(root, self.size)
        b = _as_array(buf, self.rank != root, "Bcast buf")
        return self._chan.start("bcast", b.nbytes, b.itemsize, dtype_code(b.dtype), 0, b, None, root=root,
                           blocking=_blocking)

    def Iallgather(self, sendbuf, recvbuf, stream=None):
        """Start an allgather; returns a Request (see Allgather)."""
        return self._call("allgather", False, self._iallgather, sendbuf, recvbuf, stream=stream)

    def Allgather(self, sendbuf, recvbuf, stream=None):
        """Gather every rank's `sendbuf` into `recvbuf` on every rank, in rank order:
        recvbuf holds size x sendbuf (a count in its specification is one rank's share). With
        IN_PLACE (or None), each rank's block is already in its slot of recvbuf."""
        self._call("allgather", True, self._iallgather, sendbuf, recvbuf, stream=stream)

    def _iallgather(self, sendbuf, recvbuf, _blocking=False):
        self._chan.check()
        r = _as_blocks(recvbuf, True, "Allgather recvbuf", self.size)
        if r.nbytes % self.size:
            raise R2commBufferError(f"Allgather: recvbuf of {r.nbytes} bytes is not {self.size} "
                                    "equal blocks")
        block = r.nbytes // self.size
        if is_in_place(sendbuf):
            sendbuf, pre = IN_PLACE, []
        else:
            s = _as_array(sendbuf, False, "Allgather sendbuf")
            if s.dtype != r.dtype or s.nbytes != block:
                raise R2commBufferError(f"Allgather: recvbuf must hold {self.size} x sendbuf "
                                        f"({s.nbytes} bytes {s.dtype}), got {r.nbytes} bytes {r.dtype}")
            if _block_of(s, r, self.rank, block):     # sendbuf is this rank's block: in place
                sendbuf = IN_PLACE
                pre = []
            else:
                _check_apart(s, r, "Allgather")
                pre = [(WORK, self.rank * block, SEND, 0, block)]
        send = None if sendbuf is IN_PLACE else s
        return self._chan.start("allgather", block, r.itemsize, dtype_code(r.dtype), 0, r, send,
                           extra_pre=pre, blocking=_blocking)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Start a reduce-scatter; returns a Request (see Reduce_scatter_block)."""
        return self._call("reduce_scatter_block", False, self._ireduce_scatter_block, sendbuf,
                          recvbuf, op, stream=stream)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Reduce `sendbuf` (size equal blocks; a count in its specification is one block's)
        over all ranks with `op`; rank i receives block i of the result in `recvbuf` (IN_PLACE
        or None: recvbuf holds the input, the result lands in its first block)."""
        self._call("reduce_scatter_block", True, self._ireduce_scatter_block, sendbuf, recvbuf, op,
                   stream=stream)

    def _ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, _blocking=False):
        self._chan.check()
        op = as_op(op)
        if is_in_place(sendbuf):            # recvbuf holds every block: a count is one block's
            s = r = _as_blocks(recvbuf, True, "Reduce_scatter_block recvbuf", self.size)
        else:
            s = _as_blocks(sendbuf, False, "Reduce_scatter_block sendbuf", self.size)
            r = _as_array(recvbuf, True, "Reduce_scatter_block recvbuf")
            if s.dtype != r.dtype:
                raise R2commArgumentError(f"Reduce_scatter_block: sendbuf dtype {s.dtype} != "
                                          f"recvbuf dtype {r.dtype}")
        if s.nbytes % self.size:
            raise R2commBufferError(f"Reduce_scatter_block: sendbuf of {s.nbytes} bytes is not "
                                    f"{self.size} equal blocks")
        block = s.nbytes // self.size
        if s is not r and r.nbytes < block:
            raise R2commBufferError(f"Reduce_scatter_block: recvbuf holds {r.nbytes} bytes, "
                                    f"needs {block}")
        if block % s.itemsize:
            raise R2commBufferError("Reduce_scatter_block: blocks must be whole elements")
        post = None
        if s is not r and _block_of(r, s, self.rank, block):
            # recvbuf is this rank's block of sendbuf (torch's in-place form): the result goes
            # to a block of its own, copied there once the operation ended
            out, r = r, np.empty_like(r)
            post = functools.partial(np.copyto, out, r)
        elif s is not r:
            _check_apart(s, r, "Reduce_scatter_block")
        return self._chan.start("reduce_scatter_block", block, s.itemsize, reduce_code(s.dtype, op),
                           op.code, r, s, post=post, blocking=_blocking)

    def Ialltoall(self, sendbuf, recvbuf, stream=None):
        """Start an all-to-all exchange; returns a Request (see Alltoall)."""
        return self._call("alltoall", False, self._ialltoall, sendbuf, recvbuf, stream=stream)

    def Alltoall(self, sendbuf, recvbuf, stream=None):
        """Block j of `sendbuf` (size equal blocks; a count in a specification is one block's)
        goes to rank j, where it lands in block i (the sender's rank) of `recvbuf`. The buffers
        must not overlap; IN_PLACE (or None): recvbuf is the input too (sent from a copy)."""
        self._call("alltoall", True, self._ialltoall, sendbuf, recvbuf, stream=stream)

    def _ialltoall(self, sendbuf, recvbuf, _blocking=False):
        self._chan.check()
        r = _as_blocks(recvbuf, True, "Alltoall recvbuf", self.size)
        if is_in_place(sendbuf):
            s = r.copy()
        else:
            s = _as_blocks(sendbuf, False, "Alltoall sendbuf", self.size)
            if s.dtype != r.dtype:
                raise R2commArgumentError(f"Alltoall: sendbuf dtype {s.dtype} != recvbuf "
                                          f"dtype {r.dtype}")
            _check_apart(s, r, "Alltoall")
        if s.nbytes != r.nbytes or s.nbytes % self.size:
            raise R2commBufferError(f"Alltoall: sendbuf ({s.nbytes} bytes) and recvbuf "
                                    f"({r.nbytes} bytes) must be equal and hold {self.size} blocks")
        return self._chan.start("alltoall", s.nbytes // self.size, s.itemsize, dtype_code(s.dtype), 0,
                           r, s, blocking=_blocking)

    def Ibarrier(self):
        """Start a barrier; returns a Request that completes once every rank entered it."""
        self._chan.check()
        return self._chan.start("barrier", 0, 1, U8, 0, None, None)

    def Barrier(self):
        """Return once every rank of the communicator has called Barrier."""
        self._chan.check()
        self._chan.start("barrier", 0, 1, U8, 0, None, None, blocking=True).Wait()

    # -- fault tolerance (ULFM, issue 44) ------------------------------------------------------
    # (the logic is control/recovery.py's; README, Failure semantics: after a rank died)
    def Revoke(self):
        """Revoke this communicator on every rank: every pending and later operation of it
        raises R2commRevokedError there, also one blocked in a call that can never complete.
        Agree() and Shrink() still work on it. Local: returns at once."""
        recovery.revoke(self._chan)

    def Is_revoked(self):
        """True once this communicator was revoked (by any rank, as far as this one knows)."""
        return self._chan.revoked

    def Get_failed(self):
        """The ranks of this communicator this rank knows to have failed (the failure
        detector's, and peers every rail to which failed), as a SORTED LIST of ranks (mpi4py
        returns a Group). Local."""
        return recovery.get_failed(self._chan)

    def Ack_failed(self, num_to_ack=None):
        """Acknowledge the first `num_to_ack` ranks of Get_failed() (None: all of them);
        returns how many failures this rank has acknowledged in all (MPI 4.1). Local."""
        return recovery.ack_failed(self._chan, num_to_ack)

    def Agree(self, flag):
        """The bitwise AND of the survivors' integer flags (64 bits), the same on every
        survivor, also when ranks die during the call (a fault-tolerant, uniform agreement:
        control/recovery.py); the agreed set of failed ranks is then Get_agreed_failed().
        Collective over the survivors; works on a revoked communicator."""
        return recovery.agree(self._chan, flag)[0]

    def Iagree(self, flag):
        """Agree() without blocking: `flag` is a writable buffer of one integer (a numpy array,
        array.array("i", [f]), as mpi4py's Iagree), read now and given the agreed AND when the
        returned Request completes (its Wait raises what Agree would). The agreement runs on a
        helper thread; do not call Agree, Shrink or another Iagree on this communicator
        before it completed."""
        try:
            arr = np.asarray(memoryview(flag))
        except TypeError:
            arr = None
        if arr is None or arr.size != 1 or arr.dtype.kind not in "iu" or arr.itemsize > 8 \
                or not arr.flags.writeable:
            raise R2commArgumentError(f"Iagree: flag must be a writable buffer of one integer "
                                      f"(e.g. np.array([1], np.int32)), not {flag!r}")
        cell = arr.reshape(1).view(np.int64) if arr.dtype == np.uint64 else arr.reshape(1)
        value = int(cell[0])
        self._chan.check()

        def run():
            cell[0] = recovery.agree(self._chan, value)[0]
        return ThreadRequest(run, self._background_limit(),
                             f"r2comm-iagree-{self._chan.comm_id}")

    def Ishrink(self):
        """Shrink() without blocking, as mpi4py's: (the new Communicator, a Request). The new
        Communicator is usable once the Request completed (before that its rank and size are
        None and its calls raise R2commError); the Request's Wait raises what Shrink would."""
        self._chan.check()
        new = type(self).__new__(type(self))
        new._attach(self._world, None, _Unformed(), owner=False)

        def run():
            new._attach(self._world, None, recovery.shrink(self._chan), owner=False)
        return new, ThreadRequest(run, self._background_limit(),
                                  f"r2comm-ishrink-{self._chan.comm_id}")

    def _background_limit(self):
        """How long a Wait on an Iagree/Ishrink request may take: the agreement's own bound
        (this communicator's timeout) and the Shrink after it, with a margin, so that the
        agreement's R2commTimeout is the one raised."""
        return 2 * self.timeout + 5.0

    def Get_agreed_failed(self):
        """The failed ranks (sorted) that the last Agree()/Shrink() agreed on, the same on
        every survivor."""
        return recovery.last_agreed(self._chan)

    def Shrink(self):
        """A new Communicator of the survivors (the agreed set: every survivor gets the same
        members and id), ranks renumbered in order, plans made afresh, on the same engine,
        connections, shared-memory segments and rails. Collective over the survivors; works on
        a revoked communicator. Its mpi_comm is None: the lowercase object calls, Dup and Split
        raise R2commError on it."""
        return self._over(self._world, None, recovery.shrink(self._chan))

    # -- lowercase (objects) ----------------------------------------------------------------------
    def allreduce(self, x, op=SUM):
        """numpy arrays go through the engine and come back as a new array; other Python
        objects go through mpi4py (pickle), as in mpi4py."""
        self._chan.check()
        if isinstance(x, np.ndarray):
            src = np.ascontiguousarray(x)
            out = np.empty_like(src)
            self.Allreduce(src, out, op)
            return out
        op = as_op(op)
        mpi = self._boot("allreduce of Python objects")
        return mpi.allreduce(x, op=op if bootstrap_consts(mpi, False) else op.mpi())

    def bcast(self, obj, root=0):
        """Any picklable object of `root`, returned on every rank (through mpi4py)."""
        self._chan.check()
        return self._boot("bcast").bcast(obj, root=root)

    def allgather(self, obj):
        """Every rank's picklable object, as a list in rank order (through mpi4py)."""
        self._chan.check()
        return self._boot("allgather").allgather(obj)

    def barrier(self):
        """Same as Barrier()."""
        self.Barrier()

    def __repr__(self):
        return (f"<r2comm.Communicator rank {self.rank}/{self.size} id {self._chan.comm_id} "
                f"rails {len(self._world.boot.rail_addrs)}>")

