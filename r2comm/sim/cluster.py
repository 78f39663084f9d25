"""Replays the planner's schedules on a simulated fabric, with the engine's striping and
failover policy.

Cluster = Fabric (physical) + the engines' view of every NIC (RailView) + one FlowSim clock.
run_schedules() replays a schedule set (one planner Schedule per rank) message by message:

* Every message is cut into the engine's chunks (Config.chunk_size); chunks are grouped into at
  most `segments` pipeline segments (segment c of a message covers the same chunks as segment c
  of every message it depends on, so the planner's chunk-level dependencies hold per segment;
  segments=None: one segment per chunk, exact but slower).
* A send segment starts once its gates open (chunk-level dependencies: the same segment of
  every predecessor done); it is one flow striped over the pair's rails in proportion to their
  bandwidth as the engines see it (RailState.rail_weights semantics), or as the schedule
  declares for that pair (Schedule.rail_weights, on the rails the engines use); it arrives
  `alpha` after its last byte left; a receive segment is applied once it arrived and its own
  gates opened; a send segment is done when acknowledged (arrival + alpha), or at once if owned
  (copied).
  These are the rules of the planner's cost model (cost.py) and of tests/test_planner.py's
  executor; with data= the replay also moves and reduces the bytes, in simulated-time order.
* Failover (policy "r2comm"), with the engine's defaults (config.Config):
    - a NIC that fails stops carrying bytes at once; the chunks on it that were not yet
      acknowledged (at most one window per peer rail: min(R2COMM_WINDOW, rate x
      R2COMM_WINDOW_MS)) are stuck; the rest of that rail's share goes on the pair's other
      rails (the dead rail's window is full, so the engine queues nothing more on it);
    - the stuck chunks are re-sent on the surviving rails after the reaction time: a hard
      failure (socket error) HARD_DETECT_S; a silent one the quiet limit of the engine's tail
      hedging (5 ms + 4 chunk times, R2COMM_HEDGE) or, with hedge=False, the rail deadline
      R2COMM_RAIL_TIMEOUT_MS;
    - the rail counts as failed (an event; re-planning can follow) at the rail deadline
      (silent) or at once (hard);
    - fail-back: probes at R2COMM_PROBE_MS after the failure, doubling up to
      R2COMM_PROBE_MAX_MS when the rail failed within 2 s of its last restore (flapping); the
      first probe that finds the NIC up restores the rail.
  Policy "backup" (hot repair alone, as the comparison in the paper): the failed NIC's share of
  every stripe moves to one fixed backup NIC of the same host (the next one up), crossing to the
  peer's NIC k through the spine; stripe weights never change (no rebalancing).
"""
import numpy as np

from ..config import Config
from ..planner import cost as _cost
from ..planner.schedule import SEND, SCRATCH, COPY, REDUCE, REDUCE_SEND, REDUCE_SEND_REV
from .flows import FlowSim, INF

CFG = Config()
HARD_DETECT_S = 0.002            # socket error -> rail failed (testbed: 1.8 ms measured)
FLAP_WINDOW_S = 2.0              # engine: a failure this soon after a restore doubles the backoff
_NP = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}


class SimStall(RuntimeError):
    """The replay cannot finish: a pair lost every rail and nothing will bring one back."""


class RailView:
    """The engines' view of every NIC: usable for new chunks or failed (waiting for a probe)."""

    def __init__(self, H, K):
        self.failed = [[False] * K for _ in range(H)]    # counted failed (deadline passed)
        self.avoid = [[False] * K for _ in range(H)]     # no new chunks (stuck or failed)
        self.backoff = [[0.0] * K for _ in range(H)]
        self.restore_time = [[-INF] * K for _ in range(H)]
        self.gen = [[0] * K for _ in range(H)]           # failure generation (cancels timers)


class Cluster:
    """A fabric, the engines' view of it and one clock; runs schedules and faults."""

    def __init__(self, fabric, policy="r2comm", hedge=True, flat=False, segments=None, cfg=None):
        if policy not in ("r2comm", "backup"):
            raise ValueError(f"policy {policy!r}: 'r2comm' or 'backup'")
        self.fab = fabric
        self.cfg = cfg or CFG
        self.policy = policy
        self.hedge = hedge
        self.flat = flat
        self.segments = segments
        self.nranks = fabric.H * fabric.G if flat else fabric.H
        self.sim = FlowSim(fabric.capacities(self.nranks), max_links=3 * fabric.K + 2)
        self.view = RailView(fabric.H, fabric.K)
        self.log = []                                   # (t, what, host, nic, detail)
        self.parts = {}                                 # flow id -> Part
        self.stuck = {}                                 # (h, k) -> [Part]
        self.window_used = {}                           # (a, b, k) -> stuck bytes
        self.resent = 0.0
        self.op = None
        self.error = None
        self.preempt = False        # hot transfers pause a bulk one on the wire (see send)
        self.active = {}            # (a, b) -> live flows of the pair
        self.queue = {}             # (a, b) -> [(transfer, nbytes)] waiting behind them
        self._pending = 0           # NICs down whose failure the engines have not reacted to
        self._cache = {}            # (a, b) -> (rails, path row) while nothing is pending
        self.declared = {}          # (a, b) -> rail shares the running operation declares
        for h in range(fabric.H):   # NICs already down: found at start-up (the engines' probe)
            for k in range(fabric.K):
                if not fabric.up[h][k]:
                    self.view.avoid[h][k] = self.view.failed[h][k] = True
        self.changed()

    # -- topology ---------------------------------------------------------------------------------
    def host(self, r):
        return r // self.fab.G if self.flat else r

    def _weights(self, ha, hb):
        """{rail: share} for new chunks between hosts ha and hb, as the engines stripe."""
        f, v = self.fab, self.view
        if self.policy == "backup":
            return {k: 1.0 / f.K for k in range(f.K)}
        w = {}
        for k in range(f.K):
            if v.avoid[ha][k] or v.avoid[hb][k]:
                continue
            x = min(f.line[ha][k] * f.factor[ha][k], f.line[hb][k] * f.factor[hb][k])
            if x > 0:
                w[k] = x
        tot = sum(w.values())
        return {k: x / tot for k, x in w.items()} if tot > 0 else {}

    def _pair_weights(self, a, b):
        """{rail: share} for new chunks from rank a to rank b: the operation's declared rail
        weights for the pair (Schedule.rail_weights) on the rails the engines use, else the
        engines' own striping (_weights)."""
        ha, hb = self.host(a), self.host(b)
        w = self._weights(ha, hb)
        want = self.declared.get((a, b)) if self.policy == "r2comm" else None
        if want is None or not w:
            return w
        mine = {k: want[k] for k in w if k < len(want) and want[k] > 0}
        tot = sum(mine.values())
        return {k: x / tot for k, x in mine.items()} if tot > 0 else w

    def _backup(self, h, k):
        K = self.fab.K
        for d in range(1, K):
            j = (k + d) % K
            if not self.view.avoid[h][j]:
                return j
        return None

    def _rail_links(self, ha, hb, k):
        """Links of one stripe on rail k (policy 'backup': via backup NICs and the spine)."""
        f, v = self.fab, self.view
        if self.policy == "backup":
            ka = k if not v.avoid[ha][k] else self._backup(ha, k)
            kb = k if not v.avoid[hb][k] else self._backup(hb, k)
            if ka is None or kb is None:
                return None
            out = [f.tx(ha, ka), f.rx(hb, kb)]
            if ka != kb:
                out.append(f.spine)
            return out
        return [f.tx(ha, k), f.rx(hb, k)]

    def _path(self, a, b, rails):
        """[(link, coef)] of a flow striped as `rails` ({k: share})."""
        ha, hb = self.host(a), self.host(b)
        if ha == hb:
            return [(self.fab.local_tx(a), 1.0), (self.fab.local_rx(b), 1.0)]
        acc = {}
        for k, w in rails.items():
            links = self._rail_links(ha, hb, k)
            if links is None:
                return None
            for l in links:
                acc[l] = acc.get(l, 0.0) + w
        return sorted(acc.items())

    def _nic_dead(self, h, k):
        return not self.fab.up[h][k]

    def _window(self, ha, hb, k):
        f = self.fab
        rate = min(f.nic_capacity(ha, k) or f.line[ha][k] * f.efficiency,
                   f.nic_capacity(hb, k) or f.line[hb][k] * f.efficiency)
        return min(self.cfg.window, max(self.cfg.chunk_size, rate * self.cfg.window_ms / 1e3))

    # -- moving bytes -------------------------------------------------------------------------------
    def send(self, a, b, nbytes, done, *args, hot=False):
        """Move nbytes a -> b; done(*args) once every byte arrived (before the latency alpha).

        Per pair, transfers go in the engine's queue order (one connection per rail): a *hot*
        transfer (released by a dependency: the next stage of a pipeline) goes ahead of the
        *bulk* ones (ready when the operation was posted), after the hot ones already queued,
        and a bulk transfer on the wire yields to it (the engine picks the next chunk from the
        front of the queue); different pairs share links max-min fairly."""
        seg = _Transfer(a, b, done, args)
        key = (a, b)
        live = self.active.get(key)
        if nbytes > 0 and (live or key in self.queue):
            if hot and live and self.preempt and not any(p.hot for p in live):
                self._preempt(key)
            else:
                self._enqueue(key, seg, nbytes, hot, front=False)
                return seg
        seg.hot = hot
        return self._start(seg, nbytes)

    def _enqueue(self, key, seg, nbytes, hot, front):
        """Queue (seg, nbytes): hot after the hot entries; bulk at the back (front=True: ahead
        of the other bulk entries, for a transfer that yielded to a hot one)."""
        q = self.queue.setdefault(key, [])
        nhot = 0
        while nhot < len(q) and q[nhot][2]:
            nhot += 1
        q.insert(nhot if hot or front else len(q), (seg, nbytes, hot))
        seg.parts += 1                         # held by the queue
        seg.started = True

    def _preempt(self, key):
        for p in list(self.active.get(key, ())):
            if p.rails is None and self.host(key[0]) != self.host(key[1]):
                continue
            left = self.sim.cancel(p.flow)
            self.parts.pop(p.flow, None)
            self.active[key].remove(p)
            p.seg.parts -= 1
            if left > 0:
                self._enqueue(key, p.seg, left, False, front=True)
            else:
                p.seg.check()

    def _dequeue(self, key):
        q = self.queue.get(key)
        if not q:
            return
        seg, nbytes, hot = q.pop(0)
        if not q:
            del self.queue[key]
        seg.parts -= 1
        seg.started = False
        seg.hot = hot
        self._start(seg, nbytes)

    def _start(self, seg, nbytes):
        a, b = seg.a, seg.b
        if self._pending == 0 and nbytes > 0:         # fast path: no NIC dead and unnoticed
            hit = self._cache.get((a, b))
            if hit is None:
                ha, hb = self.host(a), self.host(b)
                rails = None if ha == hb else self._pair_weights(a, b)
                path = self._path(a, b, rails if rails is not None else {}) \
                    if rails is None or rails else None
                hit = (rails, None if path is None else self.sim.row(path))
                self._cache[(a, b)] = hit
            rails, row = hit
            if row is not None:
                p = _Part(seg, nbytes, rails, None)
                seg.parts += 1
                p.flow = self.sim.add(row, nbytes, self._part_done, p)
                self.parts[p.flow] = p
                self.active.setdefault((a, b), []).append(p)
                seg.started = True
                return seg
        ha, hb = self.host(a), self.host(b)
        if ha == hb:
            self._part(seg, nbytes, None)
        else:
            self._stripe(seg, nbytes, self._pair_weights(a, b))
        seg.started = True
        seg.check()
        return seg

    def _stripe(self, seg, nbytes, rails):
        """Start nbytes of `seg` over `rails`; the share of a rail whose NIC is dead but not yet
        abandoned is stuck (up to a window), the rest goes on the live rails."""
        a, b = seg.a, seg.b
        ha, hb = self.host(a), self.host(b)
        if not rails:
            self._stall(seg, nbytes)
            return
        live, stuck_total = {}, 0.0
        for k, w in rails.items():
            dead = [(h, k) for h in (ha, hb) if self._nic_dead(h, k)] if self.policy == "r2comm" \
                else [(h, kk) for h, kk in ((ha, k), (hb, k)) if self._nic_dead(h, kk)
                      and not self.view.avoid[h][kk]]
            if not dead:
                live[k] = w
                continue
            key = (a, b, k)
            room = self._window(ha, hb, k) - self.window_used.get(key, 0.0)
            st = min(w * nbytes, max(room, 0.0))
            if st > 0:
                self.window_used[key] = self.window_used.get(key, 0.0) + st
                p = _Part(seg, st, {k: 1.0}, key)
                seg.parts += 1
                self.stuck.setdefault(dead[0], []).append(p)
                stuck_total += st
        rest = nbytes - stuck_total
        if rest <= 1e-9:
            return
        tot = sum(live.values())
        if tot <= 0:
            # no live rail in the engines' view yet: everything waits for the reaction
            for k in rails:
                dead = [(h, k) for h in (ha, hb) if self._nic_dead(h, k)] or [(ha, k)]
                p = _Part(seg, rest * rails[k], {k: 1.0}, None)
                seg.parts += 1
                self.stuck.setdefault(dead[0], []).append(p)
            return
        self._part(seg, rest, {k: w / tot for k, w in live.items()})

    def _part(self, seg, nbytes, rails):
        path = self._path(seg.a, seg.b, rails) if rails is not None else \
            self._path(seg.a, seg.b, {})
        if path is None:
            self._stall(seg, nbytes)
            return
        p = _Part(seg, nbytes, rails, None)
        seg.parts += 1
        key = (seg.a, seg.b)
        self.active.setdefault(key, []).append(p)
        p.flow = self.sim.add(path, nbytes, self._part_done, p)
        if p.flow >= 0:
            self.parts[p.flow] = p

    def _part_done(self, p):
        self.parts.pop(p.flow, None)
        key = (p.seg.a, p.seg.b)
        self.active[key].remove(p)
        p.seg.parts -= 1
        p.seg.check()
        if not self.active[key]:
            self._dequeue(key)

    def _stall(self, seg, nbytes):
        """No rail between the pair: wait for a fail-back; the engine gives up (raises
        R2commNetworkError) after R2COMM_PEER_TIMEOUT_MS."""
        p = _Part(seg, nbytes, None, None)
        seg.parts += 1
        self.stuck.setdefault(("pair", seg.a, seg.b), []).append(p)
        self.sim.at(self.sim.now + self.cfg.peer_timeout_ms / 1e3, self._peer_timeout, p)

    def _peer_timeout(self, p):
        if any(p in v for v in self.stuck.values()):
            self.error = (f"ranks {p.seg.a} and {p.seg.b} had no working rail for "
                          f"R2COMM_PEER_TIMEOUT_MS={self.cfg.peer_timeout_ms:g} ms")
            self.sim.stop = True

    # -- faults -------------------------------------------------------------------------------------
    def fault_at(self, t, kind, h, k, value=None):
        """Schedule a fault: kind 'down' (silent), 'hard' (socket error), 'up', 'degrade'
        (value: fraction of the line rate; 1 restores it)."""
        if not (0 <= h < self.fab.H and 0 <= k < self.fab.K):
            raise ValueError(f"no NIC {h}:{k} on {self.fab.H} hosts x {self.fab.K} NICs")
        if kind not in ("down", "hard", "up", "degrade"):
            raise ValueError(f"fault kind {kind!r}")
        if kind == "degrade" and not (value is not None and 0 < float(value) <= 1):
            raise ValueError(f"degrade {h}:{k} needs a fraction of the line rate in (0, 1], "
                             f"not {value!r}")
        self.sim.at(t, self._fault, kind, h, k, value)

    def changed(self):
        """The fabric or the engines' view of it changed: drop cached plans, recount pending."""
        self._cache.clear()
        f, v = self.fab, self.view
        self._pending = sum(1 for h in range(f.H) for k in range(f.K)
                            if not f.up[h][k] and not v.avoid[h][k])

    def _set_caps(self, h, k):
        self._cache.clear()
        c = self.fab.nic_capacity(h, k)
        self.sim.set_capacity(self.fab.tx(h, k), c)
        self.sim.set_capacity(self.fab.rx(h, k), c)

    def _fault(self, kind, h, k, value):
        f, v, now = self.fab, self.view, self.sim.now
        self.log.append((now, kind, h, k, value))
        if kind == "degrade":
            f.degrade(h, k, value)
            self._set_caps(h, k)
            self._rebalance(h, k)
            return
        if kind == "up":
            if f.up[h][k]:
                return
            f.restore(h, k)
            self._set_caps(h, k)
            if not v.failed[h][k]:            # back before the deadline: TCP resumes
                v.avoid[h][k] = False
            self.changed()
            if not v.failed[h][k]:
                self._release((h, k), same_rail=True)
                self._rebalance_host(h)
            return
        if not f.up[h][k]:
            return
        f.down(h, k)
        self._set_caps(h, k)
        self.changed()
        v.gen[h][k] += 1
        g = v.gen[h][k]
        # chunks on the dead NIC: one window per peer rail stuck, the rest to the live rails
        for fid in self.sim.flows_on([f.tx(h, k), f.rx(h, k)]):
            p = self.parts.get(fid)
            if p is None or p.rails is None:
                continue
            left = self.sim.cancel(fid)
            self.parts.pop(fid, None)
            self.active[(p.seg.a, p.seg.b)].remove(p)
            p.seg.parts -= 1
            self._stripe(p.seg, left, p.rails)
            if not self.active[(p.seg.a, p.seg.b)]:
                self._dequeue((p.seg.a, p.seg.b))
        if kind == "hard":
            react = detect = HARD_DETECT_S
        else:
            detect = self.cfg.rail_timeout_ms / 1e3
            react = self._quiet_limit(h, k) if self.hedge else detect
        self.sim.at(now + react, self._react, h, k, g)
        self.sim.at(now + detect, self._detect, h, k, g)

    def _quiet_limit(self, h, k):
        rate = self.fab.line[h][k] * self.fab.factor[h][k] * self.fab.efficiency
        return 0.005 + 4.0 * self.cfg.chunk_size / rate if rate > 0 else 0.02

    def _react(self, h, k, g):
        """The engines stop using NIC (h, k) and re-send its stuck chunks elsewhere."""
        v = self.view
        if v.gen[h][k] != g or self.fab.up[h][k]:
            return
        v.avoid[h][k] = True
        self.changed()
        self.log.append((self.sim.now, "rerouted", h, k, None))
        self._release((h, k), same_rail=False)

    def _detect(self, h, k, g):
        v = self.view
        if v.gen[h][k] != g or self.fab.up[h][k] and not v.avoid[h][k]:
            return
        v.avoid[h][k] = True
        self.changed()
        if not v.failed[h][k]:
            self._release((h, k), same_rail=False)
        v.failed[h][k] = True
        now = self.sim.now
        if now - v.restore_time[h][k] < FLAP_WINDOW_S:
            v.backoff[h][k] = min(v.backoff[h][k] * 2 if v.backoff[h][k] > 0
                                  else self.cfg.probe_ms / 1e3, self.cfg.probe_max_ms / 1e3)
        else:
            v.backoff[h][k] = self.cfg.probe_ms / 1e3
        self.log.append((now, "rail_failed", h, k, v.backoff[h][k]))
        self.sim.at(now + v.backoff[h][k], self._probe, h, k, g)

    def _probe(self, h, k, g):
        v = self.view
        if v.gen[h][k] != g:
            return
        now = self.sim.now
        if self.fab.up[h][k]:
            v.failed[h][k] = v.avoid[h][k] = False
            self.changed()
            v.restore_time[h][k] = now
            self.log.append((now, "rail_restored", h, k, None))
            self._release(("pairs",), same_rail=False)  # stalled pairs may have a rail again
            self._rebalance_host(h)
            return
        v.backoff[h][k] = min(v.backoff[h][k] * 2, self.cfg.probe_max_ms / 1e3)
        self.sim.at(now + v.backoff[h][k], self._probe, h, k, g)

    def _release(self, key, same_rail):
        """Re-send stuck parts (on the same rail if it came back, else striped anew)."""
        keys = [x for x in self.stuck if x == key or x[0] == "pair"]
        for x in keys:
            parts = self.stuck.pop(x)
            for p in parts:
                if p.wkey is not None:
                    self.window_used[p.wkey] = self.window_used.get(p.wkey, 0.0) - p.nbytes
                p.seg.parts -= 1
                if same_rail and p.rails is not None:
                    self._part(p.seg, p.nbytes, p.rails)
                else:
                    self.resent += p.nbytes
                    ha, hb = self.host(p.seg.a), self.host(p.seg.b)
                    if ha == hb:
                        self._part(p.seg, p.nbytes, None)
                    else:
                        self._stripe(p.seg, p.nbytes, self._pair_weights(p.seg.a, p.seg.b))
                p.seg.check()

    def _rebalance_host(self, h):
        """A rail of host h is usable again: chunks not yet sent spread over it too."""
        if self.policy != "r2comm":
            return
        for fid, p in list(self.parts.items()):
            if p.rails is None or h not in (self.host(p.seg.a), self.host(p.seg.b)):
                continue
            w = self._pair_weights(p.seg.a, p.seg.b)
            if w and w != p.rails and self.sim.remaining(fid) > 0:
                p.rails = w
                self.sim.repath(fid, self._path(p.seg.a, p.seg.b, w))

    def _rebalance(self, h, k):
        """A NIC's rate changed: the engines' striping follows (measured rates, window room)."""
        if self.policy != "r2comm":
            return
        f = self.fab
        for fid in self.sim.flows_on([f.tx(h, k), f.rx(h, k)]):
            p = self.parts.get(fid)
            if p is None or p.rails is None:
                continue
            w = self._pair_weights(p.seg.a, p.seg.b)
            if not w:
                continue
            p.rails = w
            self.sim.repath(fid, self._path(p.seg.a, p.seg.b, w))

    # -- schedules ----------------------------------------------------------------------------------
    def run_schedules(self, schedules, data=None, dtype=None, op="SUM", until=INF):
        """Replay one schedule per rank from now; returns a result dict (see _Op.result)."""
        if len(schedules) != self.nranks:
            raise ValueError(f"{len(schedules)} schedules for {self.nranks} ranks")
        o = _Op(self, schedules, self.segments, data, dtype, op)
        declared = {(r, peer): tuple(w) for r, sc in enumerate(schedules)
                    for peer, w in getattr(sc, "rail_weights", {}).items()}
        if declared or self.declared:
            self.declared = declared
            self._cache.clear()
        self.op = o
        o.start()
        if not o.finished():
            self.sim.run(until=until)
        self.op = None
        return o.result()

    def idle_until(self, t):
        """Let time pass with no traffic (faults and probes still happen)."""
        self.sim.run(until=t)
        if self.sim.now < t:
            self.sim.now = t


class _Transfer:
    __slots__ = ("a", "b", "done", "args", "parts", "started", "fired", "hot")

    def __init__(self, a, b, done, args):
        self.a, self.b, self.done, self.args = a, b, done, args
        self.hot = False
        self.parts = 0
        self.started = False
        self.fired = False

    def check(self):
        if self.started and self.parts == 0 and not self.fired:
            self.fired = True
            self.done(*self.args)


class _Part:
    __slots__ = ("seg", "nbytes", "rails", "wkey", "flow", "hot")

    def __init__(self, seg, nbytes, rails, wkey):
        self.seg, self.nbytes, self.rails, self.wkey = seg, nbytes, rails, wkey
        self.flow = -1
        self.hot = seg.hot


def _segments(m, cs, segments):
    """Byte bounds [(lo, hi)] of a message of m bytes: whole chunks in <= segments groups."""
    nch = max(1, -(-m // cs))
    S = nch if segments is None else max(1, min(nch, segments))
    return [(min(c * nch // S * cs, m), min((c + 1) * nch // S * cs, m)) for c in range(S)]


class _Op:
    """One schedule set in flight (see the module docstring for the rules)."""

    def __init__(self, cl, schedules, segments, data, dtype, op):
        self.cl, self.sim = cl, cl.sim
        self.scheds = schedules
        self.t0 = cl.sim.now
        self.alpha = cl.fab.alpha
        cs = cl.cfg.chunk_size
        if dtype is not None:
            isz = np.dtype(dtype).itemsize
            cs = max(isz, cs - cs % isz)
        self.dt = np.dtype(dtype) if dtype is not None else None
        self.opf = _NP[op]
        self.data = data
        self.ts = _cost.transfers(schedules)
        self.node = {}                       # (rank, msg) -> (kind, transfer)
        for t, x in enumerate(self.ts):
            self.node[(x["src"], x["si"])] = ("send", t)
            self.node[(x["dst"], x["ri"])] = ("recv", t)
        self.bounds = {}
        for t, x in enumerate(self.ts):
            self.bounds[t] = _segments(x["nbytes"], cs, segments)
        self.gate, self.succ = {}, {}
        for r, s in enumerate(schedules):
            for i in range(len(s.msgs)):
                k = (r, i)
                if k not in self.node:
                    continue
                self.gate[k] = [0] * len(self.bounds[self.node[k][1]])
                self.succ[k] = []
            for a, b in s.deps:
                self.succ[(r, a)].append((r, b))
                g = self.gate[(r, b)]
                for c in range(len(g)):
                    g[c] += 1
        self.arrived = set()
        self.snap = {}
        self.left = sum(len(g) for g in self.gate.values())
        self.finish = [self.t0] * len(schedules)
        self.bytes_sent = [0] * len(schedules)
        self.end = None

    def finished(self):
        return self.left == 0

    def start(self):
        if self.data is not None:
            for r, s in enumerate(self.scheds):
                self.data[r][SCRATCH] = np.zeros(s.scratch, np.uint8)
                for (db, do, sb, so, ln) in s.pre:
                    if ln:
                        self.data[r][db][do:do + ln] = self.data[r][sb][so:so + ln].copy()
        if self.left == 0:
            self._end()
            return
        for k, g in self.gate.items():
            if self.node[k][0] == "send":
                for c in range(len(g)):
                    if g[c] == 0:
                        self._send_ready(k, c)

    def _region(self, k, c):
        r, i = k
        m = self.scheds[r].msgs[i]
        lo, hi = self.bounds[self.node[k][1]][c]
        return m[3], m[4] + lo, m[4] + hi

    def _done(self, k, c):
        self.left -= 1
        r = k[0]
        if self.sim.now > self.finish[r]:
            self.finish[r] = self.sim.now
        for b in self.succ[k]:
            g = self.gate[b]
            g[c] -= 1
            if g[c] == 0:
                if self.node[b][0] == "send":
                    self._send_ready(b, c, True)
                elif (b, c) in self.arrived:
                    self._apply(b, c)
        if self.left == 0:
            self._end()

    def _send_ready(self, k, c, hot=False):
        r, i = k
        m = self.scheds[r].msgs[i]
        t = self.node[k][1]
        x = self.ts[t]
        lo, hi = self.bounds[t][c]
        if self.data is not None:
            buf, a, b = self._region(k, c)
            self.snap[(t, c)] = self.data[r][buf][a:b].copy()
        self.bytes_sent[r] += hi - lo
        self.cl.send(x["src"], x["dst"], hi - lo, self._sent, k, t, c, hot=hot)
        if m[7]:                                  # owned: copied, done now
            self._done(k, c)

    def _sent(self, k, t, c):
        self.sim.at(self.sim.now + self.alpha, self._arrive, k, t, c)

    def _arrive(self, k, t, c):
        x = self.ts[t]
        rk = (x["dst"], x["ri"])
        if not x["owned"]:
            self.sim.at(self.sim.now + self.alpha, self._done, k, c)    # the ack
        self.arrived.add((rk, c))
        if self.gate[rk][c] == 0:
            self._apply(rk, c)

    def _apply(self, k, c):
        self.arrived.discard((k, c))
        if self.data is not None:
            r, i = k
            m = self.scheds[r].msgs[i]
            t = self.node[k][1]
            buf, lo, hi = self._region(k, c)
            data = self.snap.pop((t, c))
            dst = self.data[r][buf][lo:hi]
            if m[6] == COPY:
                dst[:] = data
            elif hi > lo:
                mine = self.data[r][SEND][lo:hi] if m[6] in (REDUCE_SEND, REDUCE_SEND_REV) \
                    else dst
                a, b = mine.view(self.dt), data.view(self.dt)
                with np.errstate(all="ignore"):
                    res = self.opf(a, b) if m[6] in (REDUCE, REDUCE_SEND) else self.opf(b, a)
                dst[:] = np.asarray(res, self.dt).view(np.uint8)
        self._done(k, c)

    def _end(self):
        self.end = self.sim.now
        if self.data is not None:
            for r, s in enumerate(self.scheds):
                for (db, do, sb, so, ln) in s.post:
                    if ln:
                        self.data[r][db][do:do + ln] = self.data[r][sb][so:so + ln].copy()
        self.sim.stop = True

    def result(self):
        if self.end is None and self.cl.error:
            raise SimStall(self.cl.error)
        if self.end is None:
            raise SimStall(f"replay stuck at t={self.sim.now:.6f}: {self.left} message segments "
                           "never completed (a pair lost every rail?)")
        return {"time_s": self.end - self.t0, "start": self.t0, "end": self.end,
                "finish": [f - self.t0 for f in self.finish], "bytes_sent": self.bytes_sent,
                "messages": len(self.ts), "algo": self.scheds[0].algo if self.scheds else ""}
