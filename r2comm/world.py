"""The world: what every communicator derived from one bootstrap shares (the engine, the links,
the job's transports, the id allocator, fault timers, event callbacks), its start-up (bootstrap,
engine, connections, the start-up agreement) and close, and the engine's tuning policy (spin,
hedge, the bandwidth probe's rates)."""
import atexit
import logging
import os
import threading
import weakref

from .control import bootstrap, facts, fdlimit, startup
from . import events, faults
from .control.comm_ids import CommIds
from .errors import R2commBuildError
from .control.nicwatch import NicWatch
from .planner.state import DEFAULT_BW
from .planner.topology import INTRA_BW
from .front.railview import loopback_only, topology
from .control.replan import Replans
from .control import liveness
from .transport import select
from .transport.rails import rail_stats
from .control.links import Links

log = logging.getLogger("r2comm")
# callables hook(engine, boot) run on every new engine before it starts: where tests inject
# what production never runs (tests/fake_transport.py: the fake transport of the test
# extension); empty in production
ENGINE_HOOKS = []
_live_worlds = weakref.WeakSet()
_ENGINE = None


def engine_module():
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


def bootstrap_consts(comm, mpi=True):
    """(MAX op, UNDEFINED color) of the bootstrap comm: a StoreComm's own, else mpi4py's
    (None when mpi is False)."""
    from .control.bootstrap_store import StoreComm, MAX, UNDEFINED
    if isinstance(comm, StoreComm):
        return MAX, UNDEFINED
    if not mpi:
        return None
    from mpi4py import MPI
    return MPI.MAX, MPI.UNDEFINED


def agree_max(comm):
    """v -> the maximum of v over the ranks of bootstrap communicator `comm` (collective)."""
    op = bootstrap_consts(comm)[0]
    return lambda v: comm.allreduce(v, op=op)


def spin_seconds(cfg, boot):
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


def hedge_mode(cfg, boot):
    """R2COMM_HEDGE, or by default: quiet rails and slow ones (2), but on loopback-only rails
    quiet ones only (1). Loopback rails share the CPUs, so their measured rates differ by
    scheduling alone (283 against 1782 MB/s in one 64 MiB run), and copies of a "slow" rail's
    tail then cost CPU time that the original transfer needed."""
    if cfg.hedge >= 0:
        return cfg.hedge
    return 1 if loopback_only(boot.endpoints) else 2


class World:
    """What all communicators derived from one bootstrap share: the engine, the links, ids."""

    def __init__(self, engine, links, boot, cfg, transports):
        self.engine = engine
        self.links = links
        self.boot = boot
        self.cfg = cfg
        self.transports = transports     # select.JobTransports: what the transports answer
        self.ids = CommIds()
        self.closed = False
        self.event_cursor = 0
        self.callbacks = []
        self.timers = []
        self.probe = None            # the start-up bandwidth probe's ProbeResult
        self.start_probe_bytes = None   # the probe size agreed at start-up (None: not agreed)
        self.liveness = None         # the failure detector (control/liveness.py), or None
        self.regcache = transports.registration_cache()   # zero-copy sends from user memory
        # NIC facts (facts.py): per host and NIC, plus pair exceptions; the start-up table's,
        # then what is announced (nicwatch.py); plans follow them (replan.py)
        eps = boot.endpoints
        self.nrails = max(len(ep["rails"]) for ep in eps)
        self.fact_host_of = facts.fact_hosts(topology(eps, range(boot.size)).host_of)
        self.start_facts = {}
        self.start_digest = 0
        self.facts = facts.FactBook(boot.size, max(self.fact_host_of) + 1, self.nrails)
        rel = cfg.rail_bw or []
        self.rail_figures = [DEFAULT_BW * (rel[k] if k < len(rel) else 1.0)
                             for k in range(self.nrails)]
        self.nicwatch = None
        self.replans = None

    @classmethod
    def open(cls, mpi_comm, cfg, rails, on_event=None):
        """Bootstrap through `mpi_comm`, start the engine, connect the links and agree on the
        start-up outcome (startup.py); every rank calls it."""
        boot = bootstrap.run(mpi_comm, cfg, rails)
        try:                               # the fd limit raised, and checked for the mesh
            fdlimit.check(boot.endpoints, boot.transport, boot.rank)
        except BaseException:
            for sock in boot.listeners:
                sock.close()
            if boot.detector is not None:
                boot.detector.close()
            raise
        try:
            return cls._open_on(boot, mpi_comm, cfg, on_event)
        except BaseException:
            if boot.detector is not None:  # closing twice is harmless (the detector's own)
                boot.detector.close()
            raise

    @classmethod
    def _open_on(cls, boot, mpi_comm, cfg, on_event):
        transports = select.for_job(boot, cfg)
        cfg.rail_timeout_ms = max(cfg.rail_timeout_ms, transports.min_rail_timeout_ms())
        cfg.chunk_size = boot.params["chunk_size"]
        cfg.integrity = boot.params["integrity"]
        transports.prepare()               # what jobs that crashed during set-up left
        engine = engine_module().Engine(
            boot.rank, boot.size, transports.data_rails(), cfg.chunk_size,
            cfg.rail_timeout_ms / 1e3, cfg.peer_timeout_ms / 1e3, cfg.window, cfg.probe_ms / 1e3,
            cfg.probe_max_ms / 1e3, len(boot.rail_addrs))
        transports.attach(engine)
        links, start = _connect(engine, boot, cfg, mpi_comm)
        world = cls(engine, links, boot, cfg, transports)
        world.start_probe_bytes = start.probe_bytes
        world.start_facts = start.facts(world.fact_host_of, world.nrails)
        world.start_digest = facts.digest_of(world.start_facts)
        world.facts.merge(world.start_facts)
        try:                               # issue 31: the ring failure detector
            world.liveness = liveness.start(engine, boot, cfg, world.facts)
            world.nicwatch = NicWatch(
                engine, world.facts, boot.rank, world.fact_host_of, boot.rail_addrs,
                len(boot.rail_addrs),
                spread=None if world.liveness is None else world.liveness.share_facts,
                dead=(lambda: ()) if world.liveness is None else world.liveness.dead,
                reconnect=links.reconnect_idle,
                measure_rates=not loopback_only(boot.endpoints))
            world.nicwatch.start()
            if cfg.replan_auto and boot.size > 1 and world.liveness is not None:
                world.replans = Replans(world)       # (the facts spread with the detector:
                world.replans.start()                # without it no other rank would join)
        except BaseException:
            world.close()
            raise
        links.on_tick = lambda: events.flush(world)
        if on_event is not None:
            world.callbacks.append(on_event)
        _live_worlds.add(world)
        return world

    def plan_state(self, entries, members, always=False):
        """The planner's state of the world ranks `members` from NIC facts `entries`
        (facts.plan_state): None when no fact holds against them, unless `always`."""
        return facts.plan_state(entries, self.fact_host_of, members, self.nrails,
                                self.rail_figures, INTRA_BW, always)

    def probe_size(self, mpi_comm):
        """The bandwidth probe's message size, the same on every rank (0: no probe; see
        wanted_probe_bytes)."""
        nbytes = self.start_probe_bytes        # agreed with the start-up outcome (startup.agree)
        if nbytes is None:
            nbytes = mpi_comm.bcast(wanted_probe_bytes(self.cfg, self.boot), root=0)
        return nbytes if self.boot.params["acks"] and self.boot.size > 1 else 0

    def probe_bandwidth(self, ctl, mpi_comm, nbytes, state, timeout):
        """Time every rail to the ring neighbours over control plane `ctl` (control/bandwidth.py;
        state: the plans' RailState or None), exchange each NIC's rate over `mpi_comm` and seed the engine's
        measured rates of every peer (a pair not timed: the slower of its two NICs)."""
        from .control import bandwidth as probe
        eng, g, rank = self.engine, ctl.global_ranks(), ctl.rank
        stats = eng.rail_stats()
        eng.tuning.set_hedge(False)  # tail copies on another rail would time that one
        try:
            eps = self.boot.endpoints
            res = probe.run(ctl, nbytes, lambda p, k: rail_stats(eng)[g[p]][k].state == "up",
                            lambda p: len(stats[g[p]]), self.cfg.eager, timeout,
                            hosts=[eps[x]["host"] for x in g],
                            max_rails=max(len(eps[x]["rails"]) for x in g),
                            reachable=None if state is None else
                            (lambda p: state.working(rank, p)))
        finally:
            eng.tuning.set_hedge(self.cfg.hedge)
        nics = mpi_comm.allgather(probe.nic_rates(res, len(self.boot.rail_addrs)))
        res.nic_rates = nics[rank]
        if g == list(range(self.boot.size)) and not loopback_only(eps):
            # the world's probe on real NICs (loopback "rails" all share the CPUs): the NICs
            # it found slow are facts, the same on every rank
            self.facts.merge(facts.probe_facts(nics, self.fact_host_of)[0])
        for p in range(len(g)):
            local = p != rank and self.transports.is_local(g[p])   # (no NIC: as measured)
            for k in range(len(stats[g[p]]) if p != rank else 0):
                rate = res.rates.get((p, k)) or (0.0 if local else
                                                 probe.pair_rate(nics[rank], nics[p], k))
                if rate > 0:
                    eng.tuning.set_rail_rate(g[p], k, rate)
        self.probe = res
        if self.cfg.debug in ("INFO", "DEBUG"):
            log.warning("r2comm rank %d: bandwidth probe %.1f ms: %s", rank,
                        res.seconds * 1e3, {f"{p}/{k}": f"{r / 1e9:.3f} GB/s"
                                            for (p, k), r in sorted(res.rates.items())})

    def arm_faults(self, text, rank, fail, restore):
        """Timers for R2COMM_FAULT's specs of rank `rank`: fail(rail, mode, peer, after_bytes)
        when one is due, restore(rail) when its restore_ms passed."""
        for spec in faults.parse(text) if text else ():
            if spec.rank not in (-1, rank):
                continue
            mode, peer = spec.mode, None if spec.peer < 0 else spec.peer
            after = None if spec.after_bytes < 0 else spec.after_bytes

            def fire(spec=spec, mode=mode, peer=peer, after=after):
                if not self.closed:
                    if not spec.start:        # start=1: injected before the connections
                        fail(spec.rail, mode, peer, after)
                    if spec.restore_ms >= 0:
                        self._timer(spec.restore_ms / 1e3, self._restore, (restore, spec.rail))
            self._timer(0 if spec.start else spec.after_ms / 1e3, fire, ())

    def _timer(self, seconds, fn, args):
        t = threading.Timer(seconds, fn, args)
        t.daemon = True
        self.timers.append(t)
        t.start()

    def _restore(self, restore, rail):
        if not self.closed:
            restore(rail)

    def close(self):
        """Drain (bounded), close the links and the engine; once."""
        if self.closed:
            return
        self.closed = True
        for t in self.timers:
            t.cancel()
        if self.replans is not None:
            self.replans.close()
        if self.nicwatch is not None:
            self.nicwatch.close()
        if self.liveness is not None:        # first, so that no death is declared late
            self.liveness.close()
        self.engine.drain(min(self.cfg.timeout, 10.0))
        self.links.close()
        self.engine.close()
        if self.regcache is not None:
            self.regcache.clear()    # (the connections are closed: nothing reads them now)


def wanted_probe_bytes(cfg, boot):
    """The bandwidth probe's message size this rank asks for (0: none). Loopback rails are one
    device: the probe would time the CPUs (the planner then uses only the scale of the rates),
    so it runs there only when asked for. (After it the loopback allreduce used to run up to 2x
    slower at 64 KiB-2 MiB: the unequal rates it read had the tail hedge copy chunks, which
    loopback rails no longer do, hedge_mode.)"""
    want = cfg.bw_probe > 0 and (cfg.bw_probe_set or not loopback_only(boot.endpoints))
    return max(cfg.bw_probe, cfg.eager + 4096) if want else 0


def _connect(engine, boot, cfg, mpi_comm):
    """Start the engine and connect its links; (links, the agreed startup outcome). The engine
    (and links) are closed again when anything fails."""
    links = None
    try:
        for hook in ENGINE_HOOKS:      # what tests inject (none in production)
            hook(engine, boot)
        engine.tuning.set_integrity(cfg.integrity == "mac")
        engine.start()
        for spec in faults.parse(cfg.fault):   # NICs dark from the start (R2COMM_FAULT start=1)
            if spec.start and spec.rank in (-1, boot.rank):
                engine.faults.inject(spec.rail, faults.MODES[spec.mode], spec.peer)
        links = Links(engine, boot, cfg)
        # start on the rails that connect within R2COMM_CONNECT_TIMEOUT (startup.py)
        # the same reduction agrees on the probe's message size (one collective less)
        # this rank's NICs the kernel reports down (or a start=1 fault darkens): NIC facts
        nic_down = [k for k, st in enumerate(engine_module().nic_states(boot.rail_addrs))
                    if st == 0 or engine.faults.nic_injected(k)]
        start = startup.agree(mpi_comm, boot, links.establish(cfg.connect_timeout),
                              cfg.timeout + cfg.connect_timeout, wanted_probe_bytes(cfg, boot),
                              nic_down)
        start.check(cfg.connect_timeout)
        links.settle(start)
        if start.down_rails() and boot.rank == 0:
            log.warning("r2comm: started without %d rail connection(s), probed for fail-back: "
                        "%s", len(start.down_rails()),
                        "; ".join(f"rank {a} - rank {b} {start.describe(a, b, k)}: {why}"
                                  for a, b, k, why in start.down_rails()))
        if cfg.rail_bw:
            engine.tuning.set_weights(cfg.rail_bw[:len(boot.rail_addrs)])
        if not boot.params["acks"]:
            engine.tuning.set_noack(True)
        cfg.hedge = hedge_mode(cfg, boot)     # resolved once: the probe restores it
        engine.tuning.set_hedge(cfg.hedge)
        engine.tuning.spin = spin_seconds(cfg, boot)
        engine.tuning.set_window_time(cfg.window_ms * 1e-3)
    except BaseException:
        if links is not None:
            links.close()
        engine.close()
        raise
    return links, start


@atexit.register
def _close_all():
    for w in list(_live_worlds):
        try:
            w.close()
        except Exception:
            pass
