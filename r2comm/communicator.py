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

from . import bootstrap, planner
from . import faults as _faults
from .config import Config
from .errors import (R2commArgumentError, R2commBufferError, R2commClosedError,
                     R2commNetworkError)
from .links import Links
from .ops import SUM, U8, as_op, dtype_code
from .rails import Rail
from .request import Request, Status
from .planner.schedule import WORK, SEND, SCRATCH

log = logging.getLogger("r2comm")


class _InPlace:
    def __repr__(self):
        return "r2comm.IN_PLACE"


IN_PLACE = _InPlace()
ANY_TAG = -1
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
        self.event_cursor = 0
        self.callbacks = []
        self.timers = []

    def close(self):
        if self.closed:
            return
        self.closed = True
        for t in self.timers:
            t.cancel()
        self.engine.drain(min(self.cfg.timeout, 10.0))
        self.links.close()
        self.engine.close()


def _flush_events(world):
    """Log new engine events (R2COMM_DEBUG=INFO) and hand them to callbacks."""
    if world.closed:
        return []
    new = world.engine.events_since(world.event_cursor)
    world.event_cursor += len(new)
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
    """A C-contiguous numpy view of a buffer (never a copy), or a clear error."""
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            raise R2commBufferError(f"{what}: {type(obj).__name__} does not expose a buffer; pass "
                                    "a numpy array (lowercase methods take Python objects)") from None
    if not arr.flags.c_contiguous:
        raise R2commBufferError(f"{what} is not contiguous (strides {arr.strides}); use "
                                "np.ascontiguousarray")
    if writable and not arr.flags.writeable:
        raise R2commBufferError(f"{what} is read-only")
    if arr.dtype.byteorder == ">":
        raise R2commBufferError(f"{what} has non-native byte order")
    return arr


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
    import ipaddress
    return all(ipaddress.ip_address(a).is_loopback for ep in endpoints for a, _ in ep["rails"])


def _hedge_mode(cfg, boot):
    """R2COMM_HEDGE, or by default: quiet rails and slow ones (2), but on loopback-only rails
    quiet ones only (1). Loopback rails share the CPUs, so their measured rates differ by
    scheduling alone (283 against 1782 MB/s in one 64 MiB run), and copies of a "slow" rail's
    tail then cost CPU time that the original transfer needed."""
    if cfg.hedge >= 0:
        return cfg.hedge
    return 1 if _loopback_only(boot.endpoints) else 2


def _is_gpu(obj):
    return hasattr(obj, "__cuda_array_interface__")


class Communicator:
    """A group of ranks that run collectives over every rail between each pair.

    Communicator(mpi_comm=MPI.COMM_WORLD, *, rails=None, timeout=None, chunk_size=None, ...)
    bootstraps through mpi4py: ranks, a job secret, one listening endpoint per rail, then one
    authenticated TCP connection per rail (plus a control connection) to every peer."""

    def __init__(self, mpi_comm=None, *, rails=None, timeout=None, chunk_size=None,
                 rail_timeout_ms=None, peer_timeout_ms=None, ctrl_addr=None, on_event=None):
        from mpi4py import MPI
        from ._core.engine import Engine
        cfg = Config.from_env()
        for name, val in (("timeout", timeout), ("chunk_size", chunk_size),
                          ("rail_timeout_ms", rail_timeout_ms), ("peer_timeout_ms", peer_timeout_ms),
                          ("ctrl_addr", ctrl_addr)):
            if val is not None:
                setattr(cfg, name, val)
        mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        boot = bootstrap.run(mpi_comm, cfg, rails)
        cfg.chunk_size = boot.params["chunk_size"]
        links = None
        engine = Engine(boot.rank, boot.size,
                        [0 if j == boot.rank else min(len(boot.rail_addrs), len(ep["rails"]))
                         for j, ep in enumerate(boot.endpoints)],
                        cfg.chunk_size, cfg.rail_timeout_ms / 1e3, cfg.peer_timeout_ms / 1e3,
                        cfg.window, cfg.probe_ms / 1e3, cfg.probe_max_ms / 1e3)
        try:
            engine.start()
            links = Links(engine, boot, cfg)
            err = None
            try:
                links.establish(cfg.timeout)
            except R2commNetworkError as exc:
                err = str(exc)
            errs = [e for e in mpi_comm.allgather(err) if e]
            if errs:
                raise R2commNetworkError("; ".join(errs))
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
        links.on_tick = lambda: _flush_events(world)
        if on_event is not None:
            world.callbacks.append(on_event)
        _live_worlds.add(world)
        self._init(world, mpi_comm, list(range(boot.size)), 0, owner=True)
        world.probe = None
        # Loopback rails are one device: the probe would time the CPUs (the planner then uses
        # only the scale of the rates), so it runs there only when asked for. (After it the
        # loopback allreduce used to run up to 2x slower at 64 KiB-2 MiB: the unequal rates it
        # read had the tail hedge copy chunks, which loopback rails no longer do, _hedge_mode.)
        loop_only = _loopback_only(boot.endpoints)
        want = cfg.bw_probe > 0 and (cfg.bw_probe_set or not loop_only)
        nbytes = mpi_comm.bcast(max(cfg.bw_probe, cfg.eager + 4096) if want else 0,
                                root=0)        # every rank probes alike (message sizes), or none
        if nbytes and boot.params["acks"] and boot.size > 1:
            try:
                self._bandwidth_probe(nbytes)
            except BaseException:
                world.close()
                raise
        self._arm_faults(cfg.fault)
        mpi_comm.Barrier()

    def _bandwidth_probe(self, nbytes):
        """Time every rail to every peer (probe.py) and seed the engine's measured rates."""
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
                            max_rails=max(len(self._world.boot.endpoints[x]["rails"]) for x in g))
        finally:
            if hedge is not None:
                hedge(self._cfg.hedge)
        for (p, k), rate in res.rates.items():
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
        self.size = len(members)

    @classmethod
    def _child(cls, world, mpi_comm, members, comm_id):
        c = cls.__new__(cls)
        c._init(world, mpi_comm, members, comm_id, owner=False)
        return c

    # -- mpi4py-style accessors ----------------------------------------------------------------
    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    @property
    def mpi_comm(self):
        return self._mpi

    def _check(self):
        if self._engine is None or self._world.closed:
            raise R2commClosedError("communicator has been freed")

    # -- communicator management ---------------------------------------------------------------
    def Dup(self):
        self._check()
        new_mpi = self._mpi.Dup()
        cid = self._mpi.allreduce(self._world.next_comm_id, op=_mpi_max())
        self._world.next_comm_id = cid + 1
        return Communicator._child(self._world, new_mpi, list(self._members), cid)

    def Split(self, color=0, key=0):
        self._check()
        from mpi4py import MPI
        undefined = color is None or color == MPI.UNDEFINED or color < 0
        colors = self._mpi.allgather(None if undefined else color)
        base = self._mpi.allreduce(self._world.next_comm_id, op=_mpi_max())
        distinct = sorted({c for c in colors if c is not None})
        self._world.next_comm_id = base + len(distinct) + 1
        new_mpi = self._mpi.Split(MPI.UNDEFINED if undefined else color, key)
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
        """Every failover event this rank's engine recorded (dicts, oldest first)."""
        self._check()
        return self._engine.events_since(0)

    def on_event(self, callback):
        """Call `callback(event)` for each new event (from r2comm's link thread)."""
        self._world.callbacks.append(callback)

    @property
    def rails(self):
        """This rank's rails with live state, summed over the communicator's peers."""
        self._check()
        stats = self._engine.rail_stats()
        peers = [g for g in self._members if g != self._world.boot.rank]
        out = []
        for k, addr in enumerate(self._world.boot.rail_addrs):
            rows = [stats[p][k] for p in peers if k < len(stats[p])]
            up = sum(1 for r in rows if r[0] == "up")
            state = "up" if up == len(rows) else ("down" if up == 0 else "degraded")
            out.append(Rail(k, addr, state, rows[0][5] if rows else 1.0,
                            sum(r[1] for r in rows), sum(r[2] for r in rows),
                            sum(r[3] for r in rows), sum(r[6] for r in rows), up, len(rows),
                            sum(r[8] for r in rows)))
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
                    self.fail_rail(spec.rail, mode, peer, after)
                    if spec.restore_ms >= 0:
                        t = threading.Timer(spec.restore_ms / 1e3, self._safe_restore, (spec.rail,))
                        t.daemon = True
                        self._world.timers.append(t)
                        t.start()
            t = threading.Timer(spec.after_ms / 1e3, fire)
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
            sched = planner.build(coll, self.rank, self.size, nbytes, itemsize, root,
                                  self._cfg.eager, self._cfg.algo if coll == "allreduce" else "",
                                  state=self._state, separate_send=separate)
            sched.validate()
            msgs = [(k, self._members[p], st, b, off, n, mode, own)
                    for (k, p, st, b, off, n, mode, own) in sched.msgs]
            sig = zlib.crc32(f"{coll}|{nbytes}|{dtc}|{redop}|{root}|{sched.algo}|{self.size}".encode())
            hit = (_engine().Plan(msgs, sched.deps, sched.algo), sched, sig)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def plan(self, op="allreduce", nbytes=0, itemsize=4, root=0, in_place=False):
        """The schedule this rank would run for (op, nbytes): its algorithm (.algo), messages
        and, once the plans follow a rail state (replan()), the predicted seconds (.cost)."""
        return self._schedule(op, nbytes, itemsize, root, separate=not in_place)[1]

    # -- re-planning ---------------------------------------------------------------------------
    def rail_state(self):
        """The live rail state of this communicator, the same on every rank (collective, over
        r2comm's control plane). Bandwidths are the engines' measured rates (start-up probe,
        then acknowledgements), R2COMM_RAIL_BW where a rail has no measurement yet."""
        self._check()
        from . import control
        eps = self._world.boot.endpoints
        hosts = [eps[g]["host"] for g in self._members]
        nrails = max(len(ep["rails"]) for ep in eps)
        # loopback "rails" are one device: only the overall scale of the measurements counts
        loop = _loopback_only(eps[g] for g in self._members)
        ctl = control.plane(self)
        return planner.RailState.gather(lambda mine: control.gather_rails(ctl, mine, nrails),
                                        self.rank, self._members, self._engine.rail_stats(),
                                        hosts, self._cfg.rail_bw or None,
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
        stats = self._engine.rail_stats()
        return tuple((g, tuple((row[0], row[6]) for row in stats[g]))
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
               result=None, extra_pre=()):
        """Build/fetch the schedule, do the local pre-copies, post it to the engine."""
        self._check()
        if self._cfg.replan_every and self._seq % self._cfg.replan_every == 0:
            self._maybe_replan()
        separate = send is not None and send is not work
        plan, sched, sig = self._schedule(coll, nbytes, itemsize, root, dtc, redop, separate)
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
        memcopy = eng.memcopy
        for (db, do, sb, so, n) in (*extra_pre, *sched.pre):
            if n:
                memcopy(ptr[db] + do, ptr[sb] + so, n)
        seq = self._seq
        self._seq += 1
        members = self._members
        if self._state is not None:       # peers this rank cannot reach are relayed around
            members = [g for i, g in enumerate(self._members)
                       if i == self.rank or self._state.working(self.rank, i)]
        oid = self._engine.post(plan, ptr[0], ptr[1], ptr[2], dtc, redop, self._id, seq, sig,
                                self.timeout, members)
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

    def Iallreduce(self, sendbuf, recvbuf, op=SUM):
        if _is_gpu(recvbuf):
            return _gpu_staged(self.Iallreduce, sendbuf, recvbuf, op)
        self._check()
        op = as_op(op)
        s, r = self._pair(sendbuf, recvbuf, "Allreduce")
        if s.nbytes != r.nbytes:
            raise R2commBufferError(f"Allreduce: sendbuf has {s.nbytes} bytes, recvbuf {r.nbytes}")
        dtc = dtype_code(r.dtype)
        pre = [] if s is r else [(WORK, 0, SEND, 0, r.nbytes)]
        return self._start("allreduce", r.nbytes, r.itemsize, dtc, op.code, r, s, extra_pre=pre)

    def Allreduce(self, sendbuf, recvbuf, op=SUM):
        self.Iallreduce(sendbuf, recvbuf, op).Wait()

    def Ireduce(self, sendbuf, recvbuf, op=SUM, root=0):
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
                           root=root, extra_pre=pre)

    def Reduce(self, sendbuf, recvbuf, op=SUM, root=0):
        self.Ireduce(sendbuf, recvbuf, op, root).Wait()

    def Ibcast(self, buf, root=0):
        if _is_gpu(buf):
            return _gpu_staged_bcast(self, buf, root)
        self._check()
        self._check_root(root)
        b = _as_array(buf, self.rank != root, "Bcast buf")
        return self._start("bcast", b.nbytes, b.itemsize, dtype_code(b.dtype), 0, b, None, root=root)

    def Bcast(self, buf, root=0):
        self.Ibcast(buf, root).Wait()

    def Iallgather(self, sendbuf, recvbuf):
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
                           extra_pre=pre)

    def Allgather(self, sendbuf, recvbuf):
        self.Iallgather(sendbuf, recvbuf).Wait()

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=SUM):
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
                           op.code, r, s)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=SUM):
        self.Ireduce_scatter_block(sendbuf, recvbuf, op).Wait()

    def Ialltoall(self, sendbuf, recvbuf):
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
                           r, s)

    def Alltoall(self, sendbuf, recvbuf):
        self.Ialltoall(sendbuf, recvbuf).Wait()

    def Ibarrier(self):
        self._check()
        return self._start("barrier", 0, 1, U8, 0, None, None)

    def Barrier(self):
        self.Ibarrier().Wait()

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
        self._check_root(peer)
        if peer == self.rank:
            raise R2commArgumentError("send/receive to self is not supported")
        if not isinstance(tag, (int, np.integer)) or tag < -1 or tag >= 1 << 31:
            raise R2commArgumentError(f"bad tag {tag!r}")
        if kind == "send" and tag < 0:
            raise R2commArgumentError("a send needs a tag >= 0")
        Plan, Buffer = _engine().Plan, _engine().Buffer
        gpeer = self._members[peer]
        nbytes = arr.nbytes
        owned = kind == "send" and nbytes <= self._cfg.eager
        plan = Plan([(kind, gpeer, 0, WORK, 0, nbytes, 0, owned)], [], "p2p")
        b = Buffer(arr, kind == "recv")
        oid = self._engine.post(plan, b.ptr, 0, 0, dtype_code(arr.dtype), 0, self._id, 0, 0,
                                self.timeout, [gpeer], 1, int(tag), nbytes,
                                -1 if rail is None else int(rail))
        if status is not None:
            status.source, status.tag = peer, tag
        return Request(self, oid, [b], None, None, status)

    def Isend(self, buf, dest, tag=0, rail=None):
        """rail: pin the message to one rail while it is up (probes, experiments); if that
        rail fails, its chunks move to the others like any others."""
        return self._p2p("send", _as_array(buf, False, "Send buf"), dest, tag, rail=rail)

    def Send(self, buf, dest, tag=0, rail=None):
        self.Isend(buf, dest, tag, rail).Wait()

    def Irecv(self, buf, source, tag=ANY_TAG, status=None):
        return self._p2p("recv", _as_array(buf, True, "Recv buf"), source, tag, status)

    def Recv(self, buf, source, tag=ANY_TAG, status=None):
        self.Irecv(buf, source, tag, status).Wait()

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=None, recvtag=ANY_TAG,
                 status=None):
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
        return self._mpi.allreduce(x, op=as_op(op).mpi())

    def bcast(self, obj, root=0):
        self._check()
        return self._mpi.bcast(obj, root=root)

    def allgather(self, obj):
        self._check()
        return self._mpi.allgather(obj)

    def barrier(self):
        self.Barrier()

    def __repr__(self):
        return (f"<r2comm.Communicator rank {self.rank}/{self.size} id {self._id} "
                f"rails {len(self._world.boot.rail_addrs)}>")


def _engine():
    """The compiled engine module (imported on first use, so `import r2comm` stays light)."""
    global _ENGINE
    if _ENGINE is None:
        from ._core import engine as _ENGINE_MOD
        _ENGINE = _ENGINE_MOD
    return _ENGINE


_ENGINE = None


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def _gpu_staged(fn, sendbuf, recvbuf, op):
    """cupy buffers: staged through host memory (no GPUDirect path yet)."""
    import cupy
    host_r = cupy.asnumpy(recvbuf)
    host_s = IN_PLACE if sendbuf is IN_PLACE else cupy.asnumpy(sendbuf)
    fn(host_s, host_r, op).Wait()
    cupy.copyto(recvbuf, cupy.asarray(host_r))
    return _Done()


def _gpu_staged_bcast(comm, buf, root):
    import cupy
    host = cupy.asnumpy(buf)
    comm.Ibcast(host, root).Wait()
    cupy.copyto(buf, cupy.asarray(host))
    return _Done()


class _Done:
    def Wait(self, timeout=None):
        return None

    def Test(self):
        return True


@atexit.register
def _close_all():
    for w in list(_live_worlds):
        try:
            w.close()
        except Exception:
            pass
