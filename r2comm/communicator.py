"""Communicator: mpi4py's collective and point-to-point API over r2comm's multi-rail engine.

Arguments are checked here with the GIL held; the transfer itself runs in the engine's progress
thread, and the caller waits on it without the GIL."""
import atexit
import os
import logging
import threading
import time
import weakref
import zlib

import numpy as np

from . import bootstrap, fdlimit, planner, startup
from . import buffers as _buffers
from . import faults as _faults
from .config import Config
from .errors import (R2commArgumentError, R2commBufferError, R2commBuildError,
                     R2commClosedError, PEER_ARGUMENT_CODE)
from .transport import shm, verbs as verbs_transport
from .transport.links import Links
from .ops import DTYPES as _DTYPES, Op as _Op, SUM, U8, as_op, dtype_code, mpi_op
from .transport import rails as _rails
from .request import Request, Status
from .planner.schedule import WORK, SEND, SCRATCH, COPY

log = logging.getLogger("r2comm")


class _InPlace:
    def __repr__(self):
        return "r2comm.IN_PLACE"


IN_PLACE = _InPlace()
ANY_TAG = -1
ANY_SOURCE = -1       # a receive's source: the first matching message from any rank
_live_worlds = weakref.WeakSet()


class _World:
    """What all communicators derived from one bootstrap share: the engine, the links, ids."""

    def __init__(self, engine, links, boot, cfg):
        self.engine = engine
        self.links = links
        self.boot = boot
        self.cfg = cfg
        self.next_comm_id = 1
        self.closed = False
        self.start_state = None      # RailState of the start-up outcome (world ranks), or None
        self.event_cursor = 0
        self.callbacks = []
        self.timers = []
        self.regcache = None         # verbs rails: user memory registered for zero-copy sends
        if getattr(boot, "transport", "tcp") == "verbs" and boot.rail_devices:
            # (not without acks: there a post's completion counts as delivery, and a zero-copy
            # post completes before the NIC has read the pages)
            zcopy = cfg.verbs_zcopy and cfg.acks
            for d in boot.rail_devices:
                d.zcopy = zcopy
            if zcopy:
                from .transport.regcache import RegCache
                self.regcache = RegCache(boot.rail_devices, cfg.verbs_reg_cache,
                                         cfg.verbs_reg_min)

    def close(self):
        if self.closed:
            return
        self.closed = True
        for t in self.timers:
            t.cancel()
        self.engine.drain(min(self.cfg.timeout, 10.0))
        self.links.close()
        self.engine.close()
        if self.regcache is not None:
            self.regcache.clear()    # (the connections are closed: nothing reads them now)


def _flush_events(world):
    """Log new engine events (R2COMM_DEBUG=INFO) and hand them to callbacks."""
    if world.closed:
        return []
    new = world.engine.events_since(world.event_cursor)
    if new:                          # (the engine keeps the last events only: numbered)
        world.event_cursor = new[-1]["index"] + 1
    for ev in new:
        if world.cfg.debug in ("INFO", "DEBUG"):
            log.warning("r2comm rank %d: %s peer=%s rail=%s detector=%s bytes=%s cause=%s %s",
                        ev["rank"], ev["kind"], ev["peer"], ev["rail"], ev["detector"],
                        ev["nbytes"], ev.get("cause"), ev["info"])
        for cb in world.callbacks:
            try:
                cb(ev)
            except Exception:                       # a callback must not kill the engine
                log.exception("r2comm event callback failed")
    return new


def _as_array(obj, writable, what):
    """A C-contiguous numpy view of a buffer or mpi4py buffer specification (buffers.py)."""
    return _buffers.as_array(obj, writable, what)


def _spin_seconds(cfg, boot):
    """How long a waiter busy-polls before it blocks in epoll. Polling through a whole
    operation (as MPI does) saves the wake-up latency between chunks (measured at 1 MiB on
    loopback: ~300 us per allreduce instead of ~350 us with a 50 us spin), but when a host runs
    more ranks than it has CPUs, the spinning takes the CPU from the rank being waited for."""
    if cfg.spin_us >= 0:
        return cfg.spin_us * 1e-6
    here = boot.endpoints[boot.rank]["host"]
    local = sum(1 for ep in boot.endpoints if ep["host"] == here)
    cpus = os.cpu_count() or 1           # the host's, not this rank's binding
    return 50e-6 if local > cpus else 1e-3


def _loopback_only(endpoints):
    """Every rail of these ranks' endpoints is a loopback address: one device (the CPUs),
    not several NICs."""
    # (rail addresses are dotted IPv4: 127/8 is loopback; ipaddress
    # objects cost ~20 us each, n x rails of them at start-up, several times)
    return all(a.split(".", 1)[0] == "127" for ep in endpoints for a, _ in ep["rails"])


def _hedge_mode(cfg, boot):
    """R2COMM_HEDGE, or by default: quiet rails and slow ones (2), but on loopback-only rails
    quiet ones only (1). Loopback rails share the CPUs, so their measured rates differ by
    scheduling alone (283 against 1782 MB/s in one 64 MiB run), and copies of a "slow" rail's
    tail then cost CPU time that the original transfer needed."""
    if cfg.hedge >= 0:
        return cfg.hedge
    return 1 if _loopback_only(boot.endpoints) else 2


def _start_state(world, members):
    """The start-up RailState (world.start_state) seen by the ranks `members` (global ranks,
    in communicator order), or None when it is healthy for them."""
    st = world.start_state
    if st is None:
        return None
    sub = planner.RailState([st.hosts[g] for g in members], st.nrails,
                            {(a, b, k): st.link[(ga, gb, k)]
                             for a, ga in enumerate(members) for b, gb in enumerate(members)
                             for k in range(st.nrails) if (ga, gb, k) in st.link},
                            st.alpha, st.chunk, st.degraded_tol)
    return None if sub.healthy() else sub


def _host_keys(endpoints):
    """The host key of every rank's endpoint (r2comm.hostid; the host name for endpoints that
    predate it)."""
    return [ep.get("host_key") or ep["host"] for ep in endpoints]


def _topology(endpoints, members):
    """The planner's Topology of the ranks `members` (global ranks, in communicator order)."""
    return planner.Topology.from_labels([_host_keys(endpoints)[g] for g in members],
                                        [len(endpoints[g]["rails"]) for g in members])


_IS_DEVICE = None


def _is_gpu(obj):
    global _IS_DEVICE
    if _IS_DEVICE is None:
        from .gpu.backend import is_device
        _IS_DEVICE = is_device
    return _IS_DEVICE(obj)


_HOST_TYPES = (np.ndarray, bytes, bytearray, memoryview, type(None), int)


def _device_args(args):
    """A collective's buffer arguments include a device array (the first two arguments are
    the buffers; IN_PLACE, None and numbers are not). Plain numpy arrays and the other host
    types are told apart by type alone: this runs on every call (small-message latency)."""
    for a in args[:2]:
        if type(a) not in _HOST_TYPES and _is_gpu(a):
            return True
    return False


# Collective descriptor: every DATA frame of a collective carries, besides the comm id and the
# sequence number, what its sender called, so that the first frame that disagrees is caught by an
# integer compare in the engine (check_match) and both sides can be named in the error:
#   header.aux = kind (bits 0-2) | non-blocking (bit 3) | root (bits 4-19, 0xFFFF: >= 65535)
#                | 12-bit hash of the rest of the plan (bits 20-31: algorithm, size, sizes)
#   header.sig = element count (low 32 bits)     header.dtype, header.redop as before
_KINDS = {"allreduce": 1, "reduce": 2, "bcast": 3, "allgather": 4, "reduce_scatter_block": 5,
          "alltoall": 6, "barrier": 7}
_KIND_NAMES = {1: "Allreduce", 2: "Reduce", 3: "Bcast", 4: "Allgather",
               5: "Reduce_scatter_block", 6: "Alltoall", 7: "Barrier"}
_NONBLOCKING = 8
# A communicator's sequence numbers are uint32 on the wire and wrap: the engine compares them
# modulo 2**32 (engine_state.pxi: seq_before), so call 2**32 follows call 2**32 - 1 as any other.
SEQ_MASK = 0xFFFFFFFF
# Rooted collectives (Bcast, Reduce) leave ranks that hear from nobody (a Bcast root, a Reduce
# leaf): their data alone cannot tell them that the others called the same thing. They get an
# agreement: a dissemination exchange of header-only frames (ceil(log2 n) rounds, each round's
# send gated on the previous round's receive) that carries the descriptor, so every rank hears,
# directly or through a checked chain, from every other rank before its call returns. The other
# collectives need none: every rank's result already depends on a frame from every rank.
_AGREE_STEP = 0xFFF000
_AGREED = ("bcast", "reduce")


def _agreement(rank, n, base):
    """The agreement's messages (schedule tuples, global indices from `base`) and deps."""
    msgs, deps, prev, k, d = [], [], None, 0, 1
    while d < n:
        msgs.append(("send", (rank + d) % n, _AGREE_STEP + k, WORK, 0, 0, COPY, True))
        if prev is not None:
            deps.append((prev, base + len(msgs) - 1))
        msgs.append(("recv", (rank - d) % n, _AGREE_STEP + k, WORK, 0, 0, COPY, False))
        prev = base + len(msgs) - 1
        k, d = k + 1, d * 2
    return msgs, deps


class Communicator:
    """A group of ranks that run collectives over every rail between each pair.

    Communicator(mpi_comm=MPI.COMM_WORLD, *, rails=None, timeout=None, chunk_size=None, ...)
    bootstraps through mpi4py: ranks, a job secret, one listening endpoint per rail, then one
    authenticated TCP connection per rail (plus a control connection) to every peer.

    Start-up is bounded by connect_timeout (R2COMM_CONNECT_TIMEOUT, default 5 s): a rail that
    does not connect by then starts down for that pair (event rail_never_up, comm.rails) and
    is probed for fail-back like a rail that failed later; the first plans route around it.
    Only a control connection that does not come up, or rails that leave the ranks in
    disconnected groups, raise R2commNetworkError (on every rank)."""

    def __init__(self, mpi_comm=None, *, rails=None, timeout=None, chunk_size=None,
                 rail_timeout_ms=None, peer_timeout_ms=None, ctrl_addr=None, on_event=None,
                 connect_timeout=None):
        Engine = _engine().Engine
        cfg = Config.from_env()
        for name, val in (("timeout", timeout), ("chunk_size", chunk_size),
                          ("rail_timeout_ms", rail_timeout_ms), ("peer_timeout_ms", peer_timeout_ms),
                          ("ctrl_addr", ctrl_addr), ("connect_timeout", connect_timeout)):
            if val is not None:
                setattr(cfg, name, val)
        if mpi_comm is None:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        boot = bootstrap.run(mpi_comm, cfg, rails)
        try:                               # the fd limit raised, and checked for the mesh
            fdlimit.check(mpi_comm, _bootstrap_consts(mpi_comm)[0], boot.endpoints, boot.rank,
                          boot.transport)
        except BaseException:
            for sock in boot.listeners:
                sock.close()
            raise
        if boot.transport == "verbs":
            # a queue pair retransmits a lost packet only after its local ACK timeout: a rail
            # deadline shorter than two of them would fail healthy verbs rails
            cfg.rail_timeout_ms = max(cfg.rail_timeout_ms, verbs_transport.min_rail_timeout_ms())
        cfg.chunk_size = boot.params["chunk_size"]
        cfg.integrity = boot.params["integrity"]
        links = None
        if cfg.shm:
            shm.cleanup_stale()            # segments of jobs that crashed during set-up
        # a local peer's one data rail is the shared-memory link (r2comm/transport/shm.py)
        engine = Engine(boot.rank, boot.size,
                        [0 if j == boot.rank else
                         (1 if shm.is_local(boot.endpoints, boot.rank, j) else
                          min(len(boot.rail_addrs), len(ep["rails"])))
                         for j, ep in enumerate(boot.endpoints)],
                        cfg.chunk_size, cfg.rail_timeout_ms / 1e3, cfg.peer_timeout_ms / 1e3,
                        cfg.window, cfg.probe_ms / 1e3, cfg.probe_max_ms / 1e3,
                        len(boot.rail_addrs))
        faults = _faults.parse(cfg.fault)
        for j in shm.local_peers(boot.endpoints, boot.rank):
            engine.set_shm_peer(j)          # no NIC under it: NIC faults do not apply
        try:
            if cfg.test_transport:          # tests only: the fake transport (per-rank seed)
                fake = dict(cfg.test_transport)
                engine.fake_transport(fake.pop("seed") * 1009 + boot.rank, **fake)
            engine.set_integrity(cfg.integrity == "mac")
            engine.start()
            for spec in faults:           # NICs dark from the start (R2COMM_FAULT start=1)
                if spec.start and spec.rank in (-1, boot.rank):
                    engine.inject(spec.rail, _faults.MODES[spec.mode], spec.peer)
            links = Links(engine, boot, cfg)
            # Loopback rails are one device: the probe would time the CPUs (the planner then
            # uses only the scale of the rates), so it runs there only when asked for. (After
            # it the loopback allreduce used to run up to 2x slower at 64 KiB-2 MiB: the
            # unequal rates it read had the tail hedge copy chunks, which loopback rails no
            # longer do, _hedge_mode.)
            want = cfg.bw_probe > 0 and (cfg.bw_probe_set or not _loopback_only(boot.endpoints))
            # start on the rails that connect within R2COMM_CONNECT_TIMEOUT (startup.py); the
            # same reduction agrees on the probe's message size (issue 31: one collective less)
            start = startup.agree(mpi_comm, boot, links.establish(cfg.connect_timeout),
                                  cfg.timeout + cfg.connect_timeout,
                                  max(cfg.bw_probe, cfg.eager + 4096) if want else 0)
            start.check(cfg.connect_timeout)
            links.settle(start)
            if start.down_rails() and boot.rank == 0:
                log.warning("r2comm: started without %d rail connection(s), probed for fail-back: "
                            "%s", len(start.down_rails()),
                            "; ".join(f"rank {a} - rank {b} {start.describe(a, b, k)}: {why}"
                                      for a, b, k, why in start.down_rails()))
            if cfg.rail_bw:
                engine.set_weights(cfg.rail_bw[:len(boot.rail_addrs)])
            if not boot.params["acks"]:
                engine.set_noack(True)
            cfg.hedge = _hedge_mode(cfg, boot)     # resolved once: the probe restores it
            engine.set_hedge(cfg.hedge)
            engine.spin = _spin_seconds(cfg, boot)
            engine.set_window_time(cfg.window_ms * 1e-3)
        except BaseException:
            if links is not None:
                links.close()
            engine.close()
            raise
        world = _World(engine, links, boot, cfg)
        world.start_state = start.rail_state(_topology(boot.endpoints,
                                                       range(boot.size)).host_of,
                                             cfg.rail_bw, "scale" if _loopback_only(boot.endpoints)
                                             else "nic")
        links.on_tick = lambda: _flush_events(world)
        if on_event is not None:
            world.callbacks.append(on_event)
        _live_worlds.add(world)
        self._init(world, mpi_comm, list(range(boot.size)), 0, owner=True)
        world.probe = None
        nbytes = start.probe_bytes             # every rank probes alike (message sizes), or none
        if nbytes is None:
            nbytes = mpi_comm.bcast(max(cfg.bw_probe, cfg.eager + 4096) if want else 0, root=0)
        if nbytes and boot.params["acks"] and boot.size > 1:
            try:
                self._bandwidth_probe(nbytes)
            except BaseException:
                world.close()
                raise
        self._arm_faults(cfg.fault)
        startup.quiet_barrier(mpi_comm, cfg.timeout, "start-up (the last ranks' set-up)")

    @classmethod
    def from_store(cls, store, rank, size, *, prefix="r2comm", store_timeout=300.0, **kwargs):
        """Bootstrap through a key-value store instead of MPI (torchrun's TCPStore, torch's
        FileStore, or r2comm.bootstrap_store.DirStore without torch): every rank calls it with
        the same store, size and prefix and its own rank; the other keyword arguments are the
        constructor's. store_timeout (s) bounds each wait for the other ranks' keys. The salt of
        the job secret and the endpoints travel through the store, never pickled (the lowercase
        object calls then take None, bool, int, float, str, bytes, list, tuple and dict); set
        R2COMM_JOB_SECRET_FILE on every rank where others can read the store (README,
        Security); no MPI."""
        from .bootstrap_store import StoreComm, instance_prefix
        comm = StoreComm(store, rank, size, instance_prefix(store, prefix), store_timeout)
        return cls(comm, **kwargs)

    def _bandwidth_probe(self, nbytes):
        """Time every rail to the ring neighbours (probe.py) and seed the engine's measured
        rates of every peer."""
        from . import control, probe
        eng, g = self._engine, self._members
        stats = eng.rail_stats()
        hedge = getattr(eng, "set_hedge", None)   # tail copies on another rail would time that one
        if hedge is not None:
            hedge(False)
        try:
            res = probe.run(control.plane(self), nbytes,
                            lambda p, k: eng.rail_stats()[g[p]][k][0] == "up",
                            lambda p: len(stats[g[p]]), self._cfg.eager, min(self.timeout, 30.0),
                            hosts=[self._world.boot.endpoints[x]["host"] for x in g],
                            max_rails=max(len(self._world.boot.endpoints[x]["rails"]) for x in g),
                            reachable=None if self._state is None else
                            (lambda p: self._state.working(self.rank, p)))
        finally:
            if hedge is not None:
                hedge(self._cfg.hedge)
        # issue 31: partners timed, every other peer seeded with the slower of the two NICs
        nics = self._mpi.allgather(probe.nic_rates(res, len(self._world.boot.rail_addrs)))
        res.nic_rates = nics[self.rank]
        eps, me = self._world.boot.endpoints, self._world.boot.rank
        for p in range(self.size):
            local = p != self.rank and shm.is_local(eps, me, g[p])   # (no NIC: as measured)
            for k in range(len(stats[g[p]]) if p != self.rank else 0):
                rate = res.rates.get((p, k)) or (0.0 if local else
                                                 probe.pair_rate(nics[self.rank], nics[p], k))
                if rate > 0:
                    eng.set_rail_rate(g[p], k, rate)
        self._world.probe = res
        if self._cfg.debug in ("INFO", "DEBUG"):
            log.warning("r2comm rank %d: bandwidth probe %.1f ms: %s", self.rank,
                        res.seconds * 1e3, {f"{p}/{k}": f"{r / 1e9:.3f} GB/s"
                                            for (p, k), r in sorted(res.rates.items())})

    @property
    def probe_result(self):
        """What the start-up bandwidth probe measured on this rank (probe.ProbeResult: .rates
        {(peer, rail): bytes/s}, .seconds), or None when it did not run (R2COMM_PROBE=0)."""
        return getattr(self._world, "probe", None)

    def _init(self, world, mpi_comm, members, comm_id, owner):
        self._world = world
        self._engine = world.engine
        self._cfg = world.cfg
        self._mpi = mpi_comm
        self._members = members               # global rank of each rank of this communicator
        self._rank_of = {g: i for i, g in enumerate(members)}   # global rank -> rank here
        self._id = comm_id
        self._owner = owner
        self._seq = 0
        self._plans = {}
        self.timeout = world.cfg.timeout      # seconds; every blocking wait of this communicator
        self._state = None                    # RailState the plans are made for (None: static)
        self._marks = None                    # this rank's rail marks when the epoch was agreed
        self._epoch = 0                       # agreed rail-state epoch (see _maybe_replan)
        self._epoch_state = None              # the RailState gathered when it was agreed
        self._ctl = None                      # control-plane twin (control.plane)
        self._is_ctl = False
        self.rank = members.index(world.boot.rank)
        self._topo = _topology(world.boot.endpoints, members)
        # the first plans follow the start-up outcome: rails that did not connect are down, a
        # pair with no common rail is relayed around (startup.py)
        state = _start_state(world, members)
        if state is not None:
            self._epoch_state = state
            self._adopt(state)
        self.size = len(members)

    @classmethod
    def _child(cls, world, mpi_comm, members, comm_id):
        c = cls.__new__(cls)
        c._init(world, mpi_comm, members, comm_id, owner=False)
        return c

    # -- mpi4py-style accessors ----------------------------------------------------------------
    def Get_rank(self):
        """This rank's index in the communicator (0 .. size-1)."""
        return self.rank

    def Get_size(self):
        """The number of ranks in the communicator."""
        return self.size

    @property
    def mpi_comm(self):
        """The mpi4py communicator this one was built on (bootstrap and lowercase object calls)."""
        return self._mpi

    def _check(self):
        if self._engine is None or self._world.closed:
            raise R2commClosedError("communicator has been freed")

    # -- communicator management ---------------------------------------------------------------
    def Dup(self):
        """A new communicator over the same ranks with its own sequence of operations, so
        a library can run collectives that never match the caller's. Collective: every rank
        calls it. Shares this one's connections; Free() it when done."""
        self._check()
        new_mpi = self._mpi.Dup()
        cid = self._mpi.allreduce(self._world.next_comm_id, op=_bootstrap_consts(self._mpi)[0])
        self._world.next_comm_id = cid + 1
        return Communicator._child(self._world, new_mpi, list(self._members), cid)

    def Split(self, color=0, key=0):
        """Collective: ranks passing the same `color` form a new communicator, ordered by
        `key` (then by rank), as MPI_Comm_split. A rank passing `color=None`, a negative color
        or MPI.UNDEFINED takes part but gets None back."""
        self._check()
        MAX, UNDEFINED = _bootstrap_consts(self._mpi)
        undefined = color is None or color == UNDEFINED or color < 0
        colors = self._mpi.allgather(None if undefined else color)
        base = self._mpi.allreduce(self._world.next_comm_id, op=MAX)
        distinct = sorted({c for c in colors if c is not None})
        self._world.next_comm_id = base + len(distinct) + 1
        new_mpi = self._mpi.Split(UNDEFINED if undefined else color, key)
        if undefined:
            return None
        members = new_mpi.allgather(self._world.boot.rank)
        return Communicator._child(self._world, new_mpi, members, base + distinct.index(color))

    def Free(self):
        """Collective, as in MPI: a bounded barrier first, so no rank closes its connections
        while a peer still needs acknowledgements or retransmissions from it."""
        if self._engine is None:
            return
        if self._owner:
            if not self._world.closed:
                try:
                    self.Ibarrier().Wait(timeout=min(self.timeout, 10.0))
                except Exception:        # a dead peer must not keep us from closing
                    pass
            self._world.close()
        elif self._mpi is not None:
            try:
                self._mpi.Free()
            except Exception:
                pass
        self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.Free()

    # -- observation and faults ----------------------------------------------------------------
    @property
    def events(self):
        """The failover events this rank's engine keeps (the last 1,024 to 2,048; dicts, oldest
        first, each numbered: "index")."""
        self._check()
        return self._engine.events_since(0)

    def on_event(self, callback):
        """Call `callback(event)` for each new event (from r2comm's link thread)."""
        self._world.callbacks.append(callback)

    @property
    def rails(self):
        """This rank's rails with live state, summed over the communicator's peers."""
        self._check()
        boot = self._world.boot
        eps, me = boot.endpoints, boot.rank
        # NIC rails: remote peers only (a local peer's link is shared memory, see shm_peers)
        peers = [g for g in self._members if g != me and not shm.is_local(eps, me, g)]
        return _rails.summarize(_rails.rail_stats(self._engine), peers, boot.rail_addrs,
                                boot.transport, boot.rail_devices)

    @property
    def reg_cache(self):
        """Verbs rails' registration cache (zero-copy sends from user memory): {"entries",
        "entry_bytes", "zcopy_bytes", "copy_bytes", "zcopy_sends", "registered",
        "deregistered", "live", "busy", "refused"}, summed over this rank's rail devices;
        None on TCP rails or with R2COMM_VERBS_ZCOPY=0."""
        self._check()
        rc = self._world.regcache
        return None if rc is None else rc.stats()

    @property
    def shm_peers(self):
        """The ranks of this communicator reached through shared memory (same host, R2COMM_SHM
        on both), each with its link's live state: {rank: {"state", "bytes_sent",
        "bytes_recv", "failures"}}. NIC rails (comm.rails) and NIC faults concern the others."""
        self._check()
        stats = _rails.rail_stats(self._engine)
        kinds = self._engine.transports()
        eps = self._world.boot.endpoints
        me = self._world.boot.rank
        out = {}
        for i, g in enumerate(self._members):
            if g != me and shm.is_local(eps, me, g):
                row = stats[g][0]
                out[i] = {"state": row.state, "bytes_sent": row.bytes_sent,
                          "bytes_recv": row.bytes_recv, "failures": row.failures,
                          "transport": kinds[g][0]}
        return out

    def fail_rail(self, index, mode="hard", peer=None, after_bytes=None):
        """Fail this rank's rail `index` for real: "hard" shuts the connections down, "silent"
        makes the NIC drop everything without an error. peer (a rank of this communicator)
        limits it to one peer; after_bytes delays it until that many more bytes were sent."""
        self._check()
        if mode not in _faults.MODES:
            raise R2commArgumentError(f"mode must be 'hard' or 'silent', got {mode!r}")
        gpeer = -1 if peer is None else self._members[peer]
        self._engine.inject(index, _faults.MODES[mode], gpeer,
                            -1 if after_bytes is None else int(after_bytes))

    def restore_rail(self, index):
        """Lift an injected fault; the rail is probed and re-admitted automatically."""
        self._check()
        self._engine.clear_injection(index)

    def _arm_faults(self, text):
        if not text:
            return
        for spec in _faults.parse(text):
            if spec.rank not in (-1, self.rank):
                continue
            mode, peer = spec.mode, None if spec.peer < 0 else spec.peer
            after = None if spec.after_bytes < 0 else spec.after_bytes

            def fire(spec=spec, mode=mode, peer=peer, after=after):
                if not self._world.closed:
                    if not spec.start:        # start=1: injected before the connections
                        self.fail_rail(spec.rail, mode, peer, after)
                    if spec.restore_ms >= 0:
                        t = threading.Timer(spec.restore_ms / 1e3, self._safe_restore, (spec.rail,))
                        t.daemon = True
                        self._world.timers.append(t)
                        t.start()
            t = threading.Timer(0 if spec.start else spec.after_ms / 1e3, fire)
            t.daemon = True
            self._world.timers.append(t)
            t.start()

    def _safe_restore(self, rail):
        if not self._world.closed:
            self.restore_rail(rail)

    # -- planning ------------------------------------------------------------------------------
    def _schedule(self, coll, nbytes, itemsize, root=0, dtc=0, redop=0, separate=False):
        """(compiled Plan, Schedule, signature), cached per operation shape. The signature
        travels in every frame header so that ranks with other arguments are detected."""
        key = (coll, nbytes, itemsize, root, dtc, redop, separate)
        hit = self._plans.get(key)
        if hit is None:
            algo = self._cfg.algo
            if coll != "allreduce" and algo not in planner.GENERIC_ALGOS:
                algo = ""
            sched = planner.build(coll, self.rank, self.size, nbytes, itemsize, root,
                                  self._cfg.eager, algo, state=self._state,
                                  separate_send=separate, topo=self._topo)
            sched.validate()
            msgs, deps, algo = list(sched.msgs), list(sched.deps), sched.algo
            if coll in _AGREED and self._cfg.agree and self.size > 1 and (
                    self._state is None or all(
                        self._state.working(i, (i + d) % self.size) for i in range(self.size)
                        for d in (1 << b for b in range((self.size - 1).bit_length())))):
                more, mdeps = _agreement(self.rank, self.size, len(msgs))
                msgs += more
                deps += mdeps
                algo += "+agree"
            msgs = [(k, self._members[p], st, b, off, n, mode, own)
                    for (k, p, st, b, off, n, mode, own) in msgs]
            self._world.links.connect_for({m[1] for m in msgs})   # issue 31: on first use
            count = nbytes // itemsize if itemsize else nbytes
            h = zlib.crc32(f"{coll}|{nbytes}|{itemsize}|{dtc}|{redop}|{root}|{algo}|{self.size}|"
                           f"{count >> 32}".encode())
            desc = (_KINDS[coll] | (min(root, 0xFFFF) << 4) | ((h & 0xFFF) << 20)) \
                if coll in _KINDS else 0
            hit = (_engine().Plan(msgs, deps, algo), sched, count & 0xFFFFFFFF, desc)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def plan(self, op="allreduce", nbytes=0, itemsize=4, root=0, in_place=False):
        """The schedule this rank would run for (op, nbytes): its algorithm (.algo;
        .hierarchical is True for the host-aware plans of planner/hierarchical.py), messages
        and the predicted seconds (.cost) once the plans are priced (a rail state after
        replan(), or several hosts running several ranks)."""
        return self._schedule(op, nbytes, itemsize, root, separate=not in_place)[1]

    def topology(self):
        """Which ranks share a host (host keys from bootstrap, r2comm.hostid; R2COMM_HOST
        overrides a rank's key): a dict with nhosts, hosts (the ranks of each host, in rank
        order), rails_per_host (rails listed by the host's ranks), regular (every host runs
        as many ranks), hierarchical (several hosts, some with several ranks: the planner then
        prices hierarchical plans), and this rank's host, local_rank and local_size. Once the
        plans follow a rail state (replan()), rails_up_per_host counts each host's NICs that
        the state has usable towards another host."""
        d = self._topo.describe(self.rank)
        st = self._state
        if st is not None and self._topo.nhosts > 1 and \
                planner.Topology.from_labels(st.hosts).host_of == self._topo.host_of:
            d["rails_up_per_host"] = [sum(1 for k in range(st.nrails)
                                          if st.nic_bw(st.hosts[rs[0]], k) > 0)
                                      for rs in self._topo.hosts]
        return d

    def _tell_peers(self, exc, kind, blocking):
        """A local argument error in a collective (the caller raises it): take the call's
        sequence number and send every peer an ABORT with the error (engine.post_error), so
        their call of this collective raises R2commPeerError naming this rank, and the next
        collective lines up on every rank."""
        if getattr(exc, "_r2comm_told", False) or self._engine is None or self._world.closed \
                or self.size == 1:
            return
        exc._r2comm_told = True
        if self._cfg.replan_every and self._seq % self._cfg.replan_every == 0:
            try:                            # the peers' call runs the epoch check here too
                self._maybe_replan()
            except Exception:
                log.exception("r2comm: epoch check before a failed call")
        seq = self._seq
        self._seq = (seq + 1) & SEQ_MASK
        name = _KIND_NAMES[_KINDS[kind]]
        if not blocking:
            name = "I" + name[0].lower() + name[1:]
        msg = (f"rank {self._world.boot.rank} could not start its {name} (call #{seq} on "
               f"communicator {self._id}): {type(exc).__name__}: {exc}")
        try:
            self._world.links.connect_for(self._members)   # issue 31: every peer hears it
            self._engine.post_error(self._id, seq, self._members, PEER_ARGUMENT_CODE, msg)
        except Exception:                   # never hide the caller's own error
            log.exception("r2comm: could not tell the peers about a local argument error")

    # -- re-planning ---------------------------------------------------------------------------
    def rail_state(self):
        """The live rail state of this communicator, the same on every rank (collective, over
        r2comm's control plane). Bandwidths are the engines' measured rates (start-up probe,
        then acknowledgements), R2COMM_RAIL_BW where a rail has no measurement yet."""
        self._check()
        from . import control
        eps = self._world.boot.endpoints
        hosts = list(self._topo.host_of)
        nrails = max(len(ep["rails"]) for ep in eps)
        # loopback "rails" are one device: only the overall scale of the measurements counts
        loop = _loopback_only(eps[g] for g in self._members)
        ctl = control.plane(self)
        stats = self._engine.rail_stats()
        me = self._world.boot.rank
        for g in list(stats):
            if shm.is_local(eps, me, g):
                # a shared-memory link shows as a full set of working rails: the planner then
                # prices a local pair at least like a healthy remote one (never as a pair that
                # lost NICs), and NIC failures elsewhere never touch it
                stats[g] = stats[g][:1] * nrails
        return planner.agree.agree_state(lambda fixed, exc: control.agree_rails(ctl, fixed, exc),
                                       self.rank, self._members, stats, hosts, nrails,
                                       self._cfg.rail_bw or None,
                                       rates="scale" if loop else "nic")

    @property
    def epoch(self):
        """The agreed rail-state epoch: 0 at start, +1 at every agreed change (an R2COMM_REPLAN
        check that saw a rail fail or come back, or a replan() call); the same on every rank
        after the same operation."""
        return self._epoch

    def replan(self, state=None):
        """Make the plans follow the rail state from now on (collective: every rank must call
        it at the same operation boundary, which is what makes the switch agreed). Broken
        pairs are routed around; a slow host gets the degraded-server allreduce when the cost
        model says it is faster. Starts a new epoch. Returns the state."""
        self._marks = self._rail_marks()
        state = self.rail_state() if state is None else state
        self._epoch += 1
        self._epoch_state = state
        self._adopt(state)
        return state

    def _adopt(self, state):
        self._state = state
        self._plans.clear()

    def _rail_marks(self):
        stats = _rails.rail_stats(self._engine)
        return tuple((g, tuple((row.state, row.failures) for row in stats[g]))
                     for g in self._members if g in stats)

    def _maybe_replan(self):
        """R2COMM_REPLAN=K: the epoch check, at every K-th operation (the same boundary on every
        rank, because all ranks run the same sequence of operations).

        Each rank proposes the agreed epoch, plus one if its own rails changed (one failed or
        came back: up/down state or failure count) since the epoch was agreed; the ranks take
        the maximum over r2comm's control plane (control.allgather: point-to-point messages
        through the engine, lossless under rail failures, routed around pairs that lost every
        rail). A higher epoch is adopted by every rank here, before this operation: they gather
        the rail state (also over the control plane) and re-plan from it, unless the plans are
        still static and the state is healthy (every rail up, no slow host). The first check
        always starts epoch 1, so a slow NIC seen by the start-up probe is planned for."""
        if self._is_ctl:
            return
        from . import control
        marks = self._rail_marks()
        propose = self._epoch + (1 if marks != self._marks else 0)
        epoch = int(control.allreduce_max(control.plane(self), [propose])[0])
        if epoch <= self._epoch:
            return
        self._marks = marks
        state = self.rail_state()
        self._epoch = epoch
        self._epoch_state = state
        if self._state is not None or not state.healthy():
            self._adopt(state)

    def _start(self, coll, nbytes, itemsize, dtc, redop, work, send, root=0, post=None,
               result=None, extra_pre=(), blocking=False):
        """Build/fetch the schedule, do the local pre-copies, post it to the engine."""
        self._check()
        if self._cfg.replan_every and self._seq % self._cfg.replan_every == 0:
            self._maybe_replan()
        separate = send is not None and send is not work
        plan, sched, sig, desc = self._schedule(coll, nbytes, itemsize, root, dtc, redop, separate)
        if sched.fills_work:
            extra_pre = ()      # the schedule reads the input from SEND itself
        scratch = np.empty(sched.scratch, np.uint8) if sched.scratch else None
        keep = [work, send, scratch]
        ptr = [0, 0, 0]
        eng = _engine()
        for i, (obj, writable) in enumerate(((work, True), (send, False), (scratch, True))):
            if obj is not None:
                keep[i] = eng.Buffer(obj, writable)
                ptr[i] = keep[i].ptr
        rc = self._world.regcache
        if rc is not None:               # verbs: large user buffers go zero-copy
            rc.note(work)
            if separate:
                rc.note(send)
        memcopy = eng.memcopy
        for (db, do, sb, so, n) in (*extra_pre, *sched.pre):
            if n:
                memcopy(ptr[db] + do, ptr[sb] + so, n)
        seq = self._seq
        self._seq = (seq + 1) & SEQ_MASK
        members = self._members
        if self._state is not None:       # peers this rank cannot reach are relayed around
            members = [g for i, g in enumerate(self._members)
                       if i == self.rank or self._state.working(self.rank, i)]
        oid = self._engine.post(plan, ptr[0], ptr[1], ptr[2], dtc, redop, self._id, seq, sig,
                                self.timeout, members, 0, desc if blocking else desc | _NONBLOCKING)
        posts = [(db, do, sb, so, n) for (db, do, sb, so, n) in sched.post if n]

        def finish():
            for (db, do, sb, so, n) in posts:
                memcopy(ptr[db] + do, ptr[sb] + so, n)
            if post is not None:
                post()
        return Request(self, oid, keep, finish if (posts or post) else None, result)

    # -- collectives (buffer interface) ----------------------------------------------------------
    def _pair(self, sendbuf, recvbuf, what):
        """Validate (sendbuf, recvbuf); IN_PLACE means the receive buffer holds the input."""
        r = _as_array(recvbuf, True, f"{what} recvbuf")
        if sendbuf is IN_PLACE:
            return r, r
        s = _as_array(sendbuf, False, f"{what} sendbuf")
        if s.dtype != r.dtype:
            raise R2commArgumentError(f"{what}: sendbuf dtype {s.dtype} != recvbuf dtype {r.dtype}")
        return s, r

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

    def _fast_allreduce(self, sendbuf, recvbuf, op, blocking=True):
        """Allreduce of numpy arrays in one engine call (Engine.run: export, post, wait,
        release), for the latency-bound calls where the general path's Python (buffer
        wrappers, Request, plan lookup by a long key) cost as much as the transfer. Returns
        False, having done nothing, for anything it does not cover (other buffer kinds, a
        dtype or op to convert or refuse, a re-plan check due, relayed members, registered
        memory): the general path then handles the call and its errors."""
        if self._engine is None or self._world.closed or self._state is not None or \
                self._cfg.replan_every or self._world.regcache is not None:
            return False
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
        # kept among the plans, so whatever drops those (a new rail state, a switched
        # algorithm) drops these too
        key = ("fast", nbytes, dtc, op.code, send is not None)
        hit = self._plans.get(key)
        if hit is None:
            plan, sched, sig, desc = self._schedule("allreduce", nbytes, recvbuf.itemsize, 0, dtc,
                                                    op.code, send is not None)
            ok = not (sched.scratch or sched.pre or sched.post) and sched.fills_work
            hit = self._plans[key] = (plan, sig, desc) if ok else False
        if not hit:
            return False
        seq = self._seq
        self._seq = (seq + 1) & 0xFFFFFFFF      # SEQ_MASK (a literal: the fast path)
        try:
            oid = self._engine.run(hit[0], recvbuf, send, nbytes, dtc, op.code, self._id, seq,
                                   hit[1], self.timeout, self._members,
                                   hit[2] if blocking else hit[2] | _NONBLOCKING)
        except (ValueError, BufferError, TypeError) as exc:    # raised before anything posted
            self._seq = seq
            err = R2commBufferError(f"Allreduce: {exc}")
            self._tell_peers(err, "allreduce", blocking)
            raise err from exc
        if oid:         # failed or timed out: a Request raises its error as Wait() would
            eng = _engine()
            keep = [eng.Buffer(recvbuf, True)] + ([eng.Buffer(send, False)] if send is not None else [])
            req = Request(self, oid, keep)
            req._settle(*self._engine.wait(oid, 0.0), self.timeout)
            req.Wait()
        return True

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
        except R2commArgumentError as exc:
            self._tell_peers(exc, kind, blocking)
            raise
        if not blocking:
            return req
        req.Wait()

    def _device_call(self, kind, blocking, args, stream):
        from .gpu import pipeline
        try:
            req = pipeline.start(self, kind, blocking, args, stream)
        except R2commArgumentError as exc:
            pipeline.tell_peers(self, exc, _KIND_NAMES[_KINDS[kind]])
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
        from .gpu import GPU_PATH, GPUDIRECT_REASON
        from .gpu.pipeline import _contexts
        pools = [{"backend": c.backend.name, "slot_bytes": c.pool.slot_bytes,
                  "slots": c.pool.nslots, "allocated": c.pool.made, "peak_in_use": c.pool.peak,
                  "oversize": c.pool.oversize} for c in list(_contexts.values())]
        return {"path": GPU_PATH, "gpudirect": False, "gpudirect_reason": GPUDIRECT_REASON,
                "reduce": self._cfg.gpu_reduce, "segment": self._cfg.gpu_segment,
                "staging": self._cfg.gpu_staging, "pools": pools,
                **(self.__dict__.get("_gpu_stats") or {"calls": 0, "segments": 0, "bytes": 0,
                                                       "device_reductions": 0, "backend": None})}

    def _iallreduce(self, sendbuf, recvbuf, op=SUM, _blocking=False):
        self._check()
        op = as_op(op)
        s, r = self._pair(sendbuf, recvbuf, "Allreduce")
        if s.nbytes != r.nbytes:
            raise R2commBufferError(f"Allreduce: sendbuf has {s.nbytes} bytes, recvbuf {r.nbytes}")
        dtc = dtype_code(r.dtype)
        pre = [] if s is r else [(WORK, 0, SEND, 0, r.nbytes)]
        return self._start("allreduce", r.nbytes, r.itemsize, dtc, op.code, r, s, extra_pre=pre,
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
        self._check()
        op = as_op(op)
        self._check_root(root)
        if self.rank == root:
            s, r = self._pair(sendbuf, recvbuf, "Reduce")
            if s.nbytes != r.nbytes:
                raise R2commBufferError(f"Reduce: sendbuf has {s.nbytes} bytes, recvbuf {r.nbytes}")
            pre = [] if s is r else [(WORK, 0, SEND, 0, r.nbytes)]
        else:
            s = _as_array(sendbuf, False, "Reduce sendbuf")
            r, pre = None, []
        return self._start("reduce", s.nbytes, s.itemsize, dtype_code(s.dtype), op.code, r, s,
                           root=root, extra_pre=pre, blocking=_blocking)

    def Ibcast(self, buf, root=0, stream=None):
        """Start a broadcast from `root`; returns a Request (see Bcast)."""
        return self._call("bcast", False, self._ibcast, buf, root, stream=stream)

    def Bcast(self, buf, root=0, stream=None):
        """Copy `buf` of rank `root` into `buf` on every other rank (same size and dtype
        everywhere; writable except on the root)."""
        self._call("bcast", True, self._ibcast, buf, root, stream=stream)

    def _ibcast(self, buf, root=0, _blocking=False):
        self._check()
        self._check_root(root)
        b = _as_array(buf, self.rank != root, "Bcast buf")
        return self._start("bcast", b.nbytes, b.itemsize, dtype_code(b.dtype), 0, b, None, root=root,
                           blocking=_blocking)

    def Iallgather(self, sendbuf, recvbuf, stream=None):
        """Start an allgather; returns a Request (see Allgather)."""
        return self._call("allgather", False, self._iallgather, sendbuf, recvbuf, stream=stream)

    def Allgather(self, sendbuf, recvbuf, stream=None):
        """Gather every rank's `sendbuf` into `recvbuf` on every rank, in rank order:
        recvbuf holds size x sendbuf. With IN_PLACE, each rank's block is already in its slot of
        recvbuf."""
        self._call("allgather", True, self._iallgather, sendbuf, recvbuf, stream=stream)

    def _iallgather(self, sendbuf, recvbuf, _blocking=False):
        self._check()
        r = _as_array(recvbuf, True, "Allgather recvbuf")
        if r.nbytes % self.size:
            raise R2commBufferError(f"Allgather: recvbuf of {r.nbytes} bytes is not {self.size} "
                                    "equal blocks")
        block = r.nbytes // self.size
        if sendbuf is IN_PLACE:
            pre = []
        else:
            s = _as_array(sendbuf, False, "Allgather sendbuf")
            if s.dtype != r.dtype or s.nbytes != block:
                raise R2commBufferError(f"Allgather: recvbuf must hold {self.size} x sendbuf "
                                        f"({s.nbytes} bytes {s.dtype}), got {r.nbytes} bytes {r.dtype}")
            pre = [(WORK, self.rank * block, SEND, 0, block)]
        send = None if sendbuf is IN_PLACE else s
        return self._start("allgather", block, r.itemsize, dtype_code(r.dtype), 0, r, send,
                           extra_pre=pre, blocking=_blocking)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Start a reduce-scatter; returns a Request (see Reduce_scatter_block)."""
        return self._call("reduce_scatter_block", False, self._ireduce_scatter_block, sendbuf,
                          recvbuf, op, stream=stream)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=SUM, stream=None):
        """Reduce `sendbuf` (size equal blocks) over all ranks with `op`; rank i receives
        block i of the result in `recvbuf` (IN_PLACE: in the first block of recvbuf)."""
        self._call("reduce_scatter_block", True, self._ireduce_scatter_block, sendbuf, recvbuf, op,
                   stream=stream)

    def _ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM, _blocking=False):
        self._check()
        op = as_op(op)
        s, r = self._pair(sendbuf, recvbuf, "Reduce_scatter_block")
        if s.nbytes % self.size:
            raise R2commBufferError(f"Reduce_scatter_block: sendbuf of {s.nbytes} bytes is not "
                                    f"{self.size} equal blocks")
        block = s.nbytes // self.size
        if s is not r and r.nbytes < block:
            raise R2commBufferError(f"Reduce_scatter_block: recvbuf holds {r.nbytes} bytes, "
                                    f"needs {block}")
        if block % s.itemsize:
            raise R2commBufferError("Reduce_scatter_block: blocks must be whole elements")
        return self._start("reduce_scatter_block", block, s.itemsize, dtype_code(s.dtype),
                           op.code, r, s, blocking=_blocking)

    def Ialltoall(self, sendbuf, recvbuf, stream=None):
        """Start an all-to-all exchange; returns a Request (see Alltoall)."""
        return self._call("alltoall", False, self._ialltoall, sendbuf, recvbuf, stream=stream)

    def Alltoall(self, sendbuf, recvbuf, stream=None):
        """Block j of `sendbuf` (size equal blocks) goes to rank j, where it lands in block
        i (the sender's rank) of `recvbuf`. The buffers must not overlap."""
        self._call("alltoall", True, self._ialltoall, sendbuf, recvbuf, stream=stream)

    def _ialltoall(self, sendbuf, recvbuf, _blocking=False):
        self._check()
        if sendbuf is IN_PLACE:
            raise R2commArgumentError("Alltoall: IN_PLACE is not supported")
        s, r = self._pair(sendbuf, recvbuf, "Alltoall")
        if s.nbytes != r.nbytes or s.nbytes % self.size:
            raise R2commBufferError(f"Alltoall: sendbuf ({s.nbytes} bytes) and recvbuf "
                                    f"({r.nbytes} bytes) must be equal and hold {self.size} blocks")
        if np.shares_memory(s, r):
            raise R2commBufferError("Alltoall: sendbuf and recvbuf overlap")
        return self._start("alltoall", s.nbytes // self.size, s.itemsize, dtype_code(s.dtype), 0,
                           r, s, blocking=_blocking)

    def Ibarrier(self):
        """Start a barrier; returns a Request that completes once every rank entered it."""
        self._check()
        return self._start("barrier", 0, 1, U8, 0, None, None)

    def Barrier(self):
        """Return once every rank of the communicator has called Barrier."""
        self._check()
        self._start("barrier", 0, 1, U8, 0, None, None, blocking=True).Wait()

    # -- point to point ----------------------------------------------------------------------------
    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise R2commArgumentError(f"root {root!r} is not a rank of this communicator "
                                      f"(size {self.size})")

    def _p2p(self, kind, arr, peer, tag, status=None, rail=None):
        self._check()
        if rail is not None and not (isinstance(rail, (int, np.integer))
                                     and 0 <= rail < len(self._world.boot.rail_addrs)):
            raise R2commArgumentError(f"rail {rail!r} is not a rail index "
                                      f"(0 .. {len(self._world.boot.rail_addrs) - 1})")
        any_source = kind == "recv" and isinstance(peer, (int, np.integer)) and peer == ANY_SOURCE
        if not any_source:
            self._check_root(peer)
        if peer == self.rank:
            raise R2commArgumentError("send/receive to self is not supported")
        if not isinstance(tag, (int, np.integer)) or tag < -1 or tag >= 1 << 31:
            raise R2commArgumentError(f"bad tag {tag!r}")
        if kind == "send" and tag < 0:
            raise R2commArgumentError("a send needs a tag >= 0")
        Plan, Buffer = _engine().Plan, _engine().Buffer
        gpeer = -1 if any_source else self._members[peer]
        if not any_source:          # issue 31: on first use (ANY_SOURCE: the sender connects)
            self._world.links.connect_for((gpeer,))
        nbytes = arr.nbytes
        owned = kind == "send" and nbytes <= self._cfg.eager
        plan = Plan([(kind, gpeer, 0, WORK, 0, nbytes, 0, owned)], [], "p2p")
        b = Buffer(arr, kind == "recv")
        if kind == "send" and not owned and self._world.regcache is not None:
            self._world.regcache.note(arr)
        oid = self._engine.post(plan, b.ptr, 0, 0, dtype_code(arr.dtype), 0, self._id, 0, 0,
                                self.timeout, [] if any_source else [gpeer], 1, int(tag), nbytes,
                                -1 if rail is None else int(rail))
        if status is not None:
            status.source, status.tag = peer, tag
        return Request(self, oid, [b], None, None, status)

    def _match_status(self, oid, status):
        """Fill `status` with the source and tag of the message receive `oid` matched."""
        gpeer, tag = self._engine.p2p_matched(oid)
        if gpeer >= 0:
            status.source, status.tag = self._rank_of.get(gpeer, -1), tag

    def Isend(self, buf, dest, tag=0, rail=None):
        """rail: pin the message to one rail while it is up (probes, experiments); if that
        rail fails, its chunks move to the others like any others."""
        return self._p2p("send", _as_array(buf, False, "Send buf"), dest, tag, rail=rail)

    def Send(self, buf, dest, tag=0, rail=None):
        """Send `buf` to rank `dest` with `tag` (>= 0); returns once the buffer may be
        reused. Messages between a pair with the same tag arrive in order. `rail` pins the
        message to one rail while it is up (see Isend)."""
        self.Isend(buf, dest, tag, rail).Wait()

    def Irecv(self, buf, source, tag=ANY_TAG, status=None):
        """Start receiving from rank `source` (ANY_SOURCE: any rank) into `buf` (ANY_TAG
        matches any tag); returns a Request. A `status` (r2comm.Status) receives the source,
        tag and byte count of the message matched."""
        return self._p2p("recv", _as_array(buf, True, "Recv buf"), source, tag, status)

    def Recv(self, buf, source, tag=ANY_TAG, status=None):
        """Receive a message from rank `source` into `buf`; R2commTruncateError when the
        message is larger than the buffer."""
        self.Irecv(buf, source, tag, status).Wait()

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=None, recvtag=ANY_TAG,
                 status=None):
        """Send `sendbuf` to `dest` and receive into `recvbuf` from `source` (default:
        `dest`) at the same time, without deadlock."""
        rr = self.Irecv(recvbuf, dest if source is None else source, recvtag, status)
        sr = self.Isend(sendbuf, dest, sendtag)
        Request.Waitall([sr, rr])

    # -- lowercase (objects) ----------------------------------------------------------------------
    def allreduce(self, x, op=SUM):
        """numpy arrays go through the engine and come back as a new array; other Python
        objects go through mpi4py (pickle), as in mpi4py."""
        self._check()
        if isinstance(x, np.ndarray):
            src = np.ascontiguousarray(x)
            out = np.empty_like(src)
            self.Allreduce(src, out, op)
            return out
        op = as_op(op)
        return self._mpi.allreduce(x, op=op if _bootstrap_consts(self._mpi, False) else op.mpi())

    def bcast(self, obj, root=0):
        """Any picklable object of `root`, returned on every rank (through mpi4py)."""
        self._check()
        return self._mpi.bcast(obj, root=root)

    def allgather(self, obj):
        """Every rank's picklable object, as a list in rank order (through mpi4py)."""
        self._check()
        return self._mpi.allgather(obj)

    def barrier(self):
        """Same as Barrier()."""
        self.Barrier()

    def __repr__(self):
        return (f"<r2comm.Communicator rank {self.rank}/{self.size} id {self._id} "
                f"rails {len(self._world.boot.rail_addrs)}>")


def _engine():
    """The compiled engine module (imported on first use, so `import r2comm` stays light)."""
    global _ENGINE
    if _ENGINE is None:
        try:
            from ._core import engine as _ENGINE_MOD
        except ImportError as exc:
            import r2comm
            where = os.path.dirname(os.path.dirname(os.path.abspath(r2comm.__file__)))
            raise R2commBuildError(
                f"r2comm's compiled engine is not built ({exc}). From the source tree {where} run "
                "`bash scripts/test.sh` (creates .venv and builds it) or `pip install -e .`; "
                "after editing engine sources, `python setup.py build_ext --inplace`") from exc
        _ENGINE = _ENGINE_MOD
    return _ENGINE


_ENGINE = None


def _bootstrap_consts(comm, mpi=True):
    """(MAX op, UNDEFINED color) of the bootstrap comm: a StoreComm's own, else mpi4py's
    (None when mpi is False)."""
    from .bootstrap_store import StoreComm, MAX, UNDEFINED
    if isinstance(comm, StoreComm):
        return MAX, UNDEFINED
    if not mpi:
        return None
    from mpi4py import MPI
    return MPI.MAX, MPI.UNDEFINED


@atexit.register
def _close_all():
    for w in list(_live_worlds):
        try:
            w.close()
        except Exception:
            pass
