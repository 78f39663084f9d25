"""This rank's part in the NIC facts (facts.py, issue 39): deciding what it has the evidence for,
announcing it, and applying every fact, its own and the others', to its engine.

Who decides what:
  * A host's NICs are decided by its leader, the lowest live rank of the host, from evidence
    that does not depend on which pairs carried traffic: the kernel's link state of the
    interface under each rail (down or no carrier: at once), an injected fault that darkens
    the emulated NIC towards every peer (R2COMM_FAULT, comm.fail_rail), and rail failures
    towards peers on two or more other hosts that no fact explains, lasting TRAFFIC_HOLD_S
    (one other host alone is that host's NIC, or a path: its owner or the pair decides). A NIC
    whose evidence has gone is announced up after UP_HOLD_S, doubled for each flap within
    FLAP_WINDOW_S up to UP_HOLD_MAX_S: a flapping NIC does not become a storm of plans.
    On rails whose rates mean something (not loopback) a NIC whose best measured rate stays
    below (1 - SLOW_NOISE) of the median of the host's other NICs' (which carry the same load)
    for SLOW_HOLD_S is announced at that fraction; measurement noise is only ever applied here,
    to what traffic suggests. The start-up probe's NIC rates, the same on every rank, give the
    slow NICs of the start (facts.probe_facts).
  * A pair's rail that stays down for PAIR_HOLD_S while neither end's NIC is announced down is
    a pair exception, announced by the pair's lower rank (and lifted by it once the rail is up
    again for UP_HOLD_S); PAIR_CUT_HOLD_S when every rail of the pair is down (the plans must
    relay its traffic: long enough for a NIC fact to explain it first).
Announcements go out through the failure detector's spread (control/liveness.py: O(log n)
rounds, and heartbeat digests repair what a spread missed).

Applying a fact (every rank, for every fact, connected pairs or not): a NIC announced down
marks rail k towards every rank of that host `nic_off` in the engine (Engine.links.set_nic_off):
counted down, never connected on first use; a connection that is still up is failed now (its
chunks move to the other rails, losslessly) and not probed until the NIC is announced up,
when the failed rails are probed at once and idle ones come back to first use. For this
host's own NIC only the idle rails towards the other hosts are marked: its failed rails stay
probed, which is how a NIC that comes back without a kernel signal is seen. Pair exceptions change only the plans (each end keeps probing its pair)."""
import logging
import statistics
import threading
import time

from . import facts as F

log = logging.getLogger("r2comm")

TICK_S = 0.2               # how often the evidence is looked at (the engine fails its own
                           # rails on a dead local NIC within 0.1 s by itself: idle_nic_check)
TRAFFIC_HOLD_S = 0.5       # failures towards other hosts count once they are this old
PAIR_HOLD_S = 1.0          # a pair's rail down this long, no NIC fact explaining it: an exception
PAIR_CUT_HOLD_S = 0.2      # ... every rail of the pair down this long: traffic must be relayed
UP_HOLD_S = 0.5            # evidence gone this long: announced up (doubled per flap)
UP_HOLD_MAX_S = 30.0
FLAP_WINDOW_S = 10.0       # down again within this of an up announcement: a flap
SLOW_HOLD_S = 1.0          # a NIC below its rail's figure this long is announced slow
SLOW_NOISE = 0.4           # rates within this fraction of each other are equal (the live
                           # rates of equal NICs under one load differ by up to ~1.5x here)
SLOW_STEP = 8              # levels: a slow NIC's announced level moves only by this much


class NicWatch:
    """One rank's NIC evidence, announcements and their application (see the module doc)."""

    def __init__(self, engine, book, me, host_of, rail_addrs, nrails, *, spread=None,
                 dead=None, reconnect=None, measure_rates=False):
        self.engine, self.book, self.me = engine, book, me
        self.host_of = list(host_of)                 # fact host of every world rank
        self.my_host = self.host_of[me]
        self.rail_addrs = list(rail_addrs)
        self.nrails = nrails
        self.spread = spread                         # () -> None: tell the others (liveness)
        self.dead = dead or (lambda: ())             # () -> the ranks known dead
        self.reconnect = reconnect                   # (peers, rail) -> None: idle rails to use
        self.measure_rates = measure_rates
        self.members = {}
        for r, h in enumerate(self.host_of):
            self.members.setdefault(h, []).append(r)
        self.announced = 0                           # announcements made here (tests, stats)
        self._applied = {}                           # key -> level applied to the engine
        self._seen = -1                              # book.changes last applied
        self._nic_up_t = [0.0] * nrails              # when the kernel/injection last said up
        self._nic_down_t = [0.0] * nrails            # ... and down
        self._up_since = {}                          # key -> when its evidence went away
        self._flaps = {}                             # key -> [times of down announcements]
        self._slow_since = {}
        self._apply_lock = threading.Lock()        # apply() runs here and on the replan thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="r2comm-nics", daemon=True)
        engine.links.set_same_host([r for r in self.members[self.my_host] if r != me])

    def start(self):
        self.apply()
        self._thread.start()

    def close(self):
        self._stop.set()
        with self.book.cond:
            self.book.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(2.0)

    # -- the thread -------------------------------------------------------------------------------
    def _run(self):
        next_eval = 0.0
        while not self._stop.is_set():
            self.book.wait_change(self._seen, TICK_S)
            if self._stop.is_set():
                return
            try:
                self.apply()
                now = time.monotonic()
                if now >= next_eval:
                    next_eval = now + TICK_S
                    self.evaluate(now)
            except RuntimeError:                    # the engine was closed
                return
            except Exception:                       # noqa: BLE001 (logged; the watch goes on)
                log.exception("r2comm rank %d: NIC watch", self.me)
                time.sleep(TICK_S)

    # -- evidence ---------------------------------------------------------------------------------
    def leader(self):
        """The lowest live rank of this rank's host: the one that speaks for its NICs."""
        dead = set(self.dead())
        return min((r for r in self.members[self.my_host] if r not in dead), default=self.me)

    def evaluate(self, now):
        """Look at the evidence once; announce what changed."""
        down = self.engine.links.down_rails()
        if self.leader() == self.me:
            self._judge_nics(now, down)
        self._judge_pairs(now, down)

    def _judge_nics(self, now, down):
        kernel = _nic_states(self.rail_addrs)
        rates = self.engine.links.nic_rates(self.nrails) if self.measure_rates else None
        for k in range(self.nrails):
            key = F.nic_key(self.my_host, k)
            why = []
            if k < len(kernel) and kernel[k] == 0:
                why.append(f"the kernel reports the interface under rail {k} "
                           f"({self.rail_addrs[k]}) down or without carrier")
            if self.engine.faults.nic_injected(k):
                why.append(f"an injected fault darkens rail {k} towards every peer")
            if why:
                self._nic_down_t[k] = now
            elif self._nic_down_t[k] > self._nic_up_t[k]:
                self._nic_up_t[k] = now
            hosts = self._failed_hosts(k, down, now)
            if len(hosts) >= 2:
                why.append(f"rail {k} failed towards ranks of {len(hosts)} other hosts "
                           f"(hosts {sorted(hosts)[:8]})")
            level = self.book.level(key)
            if why:
                self._up_since.pop(key, None)
                self._slow_since.pop(key, None)
                if level != 0:
                    self._announce(key, 0, "; ".join(why))
                    self._flaps.setdefault(key, []).append(now)
                continue
            want = self._slow_level(key, k, rates, now)      # None: no evidence either way
            if level == 0 or (want == F.FULL and level < F.FULL):
                since = self._up_since.setdefault(key, now)
                if now - since >= self._up_hold(key, now):
                    self._up_since.pop(key, None)
                    self._announce(key, F.FULL if want is None else want,
                                   f"the evidence against it is gone for {now - since:.1f} s")
            elif want is not None and want < F.FULL and abs(want - level) >= SLOW_STEP:
                self._up_since.pop(key, None)
                self._announce(key, want, f"its best measured rate is {want}/{F.FULL} of "
                               "its other NICs'")
            else:
                self._up_since.pop(key, None)

    def _failed_hosts(self, k, down, now):
        """The other hosts towards whose ranks rail k failed at least TRAFFIC_HOLD_S ago, after
        the NIC last came back, unexplained by a fact about their NIC or pair."""
        out = set()
        back = now - self._nic_up_t[k] if self._nic_up_t[k] else None
        for peer, rail, age, off in down:
            if rail != k or off or age < TRAFFIC_HOLD_S or (back is not None and age > back):
                continue
            h = self.host_of[peer]
            if h == self.my_host or self.book.level(F.nic_key(h, k)) < F.FULL or \
                    self.book.level(F.pair_key(self.me, peer, k)) < F.FULL:
                continue
            out.add(h)
        return out

    def _slow_level(self, key, k, rates, now):
        """The level the live rates support for NIC k, or None where they say nothing (not
        measured; no other NIC of this host to compare with; slow for less than SLOW_HOLD_S):
        FULL at or above (1 - SLOW_NOISE) of the median of this host's other NICs' rates (they
        carry the same load), else the fraction."""
        if rates is None or k >= len(rates) or rates[k] <= 0:
            return None
        others = [v for j, v in enumerate(rates) if j != k and v > 0]
        if not others:
            return None
        ref = statistics.median(others)
        if rates[k] >= (1 - SLOW_NOISE) * ref:
            self._slow_since.pop(key, None)
            return F.FULL
        since = self._slow_since.setdefault(key, now)
        if now - since < SLOW_HOLD_S:
            return None
        return F.level_of(rates[k] / ref)

    def _up_hold(self, key, now):
        flaps = [t for t in self._flaps.get(key, ()) if now - t < FLAP_WINDOW_S]
        self._flaps[key] = flaps
        return min(UP_HOLD_S * (2 ** max(len(flaps) - 1, 0)), UP_HOLD_MAX_S)

    def _judge_pairs(self, now, down):
        failed = set()
        cut = {}                                     # peer -> its rails down here
        for peer, k, age, off in down:
            cut[peer] = cut.get(peer, 0) + 1
        for peer, k, age, off in down:
            if peer < self.me or off:
                continue                             # the pair's lower rank speaks for it
            h = self.host_of[peer]
            if self.book.level(F.nic_key(self.my_host, k)) < F.FULL or \
                    self.book.level(F.nic_key(h, k)) < F.FULL:
                continue
            key = F.pair_key(self.me, peer, k)
            failed.add(key)
            hold = PAIR_CUT_HOLD_S if cut[peer] >= self._rails_to(peer) else PAIR_HOLD_S
            if age >= hold and self.book.level(key) != 0:
                self._up_since.pop(key, None)
                self._announce(key, 0, f"rail {k} to rank {peer} down for {age:.1f} s while "
                               "neither NIC is announced down")
                self._flaps.setdefault(key, []).append(now)
        _, entries = self.book.snapshot()
        for key, f in entries.items():
            if key[0] != F.PAIR or key[1] != self.me or f.level == F.FULL or key in failed:
                continue
            if self.engine.links.link_state(key[2], key[3]) != "up":
                self._up_since.pop(key, None)
                continue
            since = self._up_since.setdefault(key, now)
            if now - since >= self._up_hold(key, now):
                self._up_since.pop(key, None)
                self._announce(key, F.FULL, f"rail {key[3]} to rank {key[2]} is up again")

    def _rails_to(self, peer):
        return self.engine.links.rails_to(peer)

    def _announce(self, key, level, why):
        fact = self.book.announce(key, level, self.me)
        if fact is None:
            return
        self.announced += 1
        log.info("r2comm rank %d: announced %s at level %d/%d: %s", self.me, describe(key),
                 level, F.FULL, why)
        self.apply()
        if self.spread is not None:
            self.spread()

    # -- applying -------------------------------------------------------------------------------
    def apply(self):
        """Bring the engine in line with every fact held (idempotent; the changes only). The
        replan thread calls it too before a round, so that the round's first-use connections
        never wait on a NIC the facts already hold down."""
        with self._apply_lock:
            self._apply()

    def _apply(self):
        changes = self.book.changes
        if changes == self._seen:
            return
        _, entries = self.book.snapshot()
        self._seen = changes
        for key, f in sorted(entries.items()):
            old = self._applied.get(key, F.FULL)
            if old == f.level:
                continue
            self._applied[key] = f.level
            self._note(key, f, old)
            if key[0] != F.NIC or (old == 0) == (f.level == 0):
                continue
            _, h, _, k = key
            off = f.level == 0
            why = f"{describe(key)} announced {'down' if off else 'up'} by rank {f.origin}"
            if h == self.my_host:
                peers = [r for r in range(len(self.host_of)) if self.host_of[r] != h]
                self.engine.links.set_nic_off(peers, k, off, why, fail_up=False,
                                              cause_local=True, idle_only=True)
            else:
                peers = self.members.get(h, [])
                self.engine.links.set_nic_off(peers, k, off, why, fail_up=True)
            if not off and self.reconnect is not None:
                self.reconnect(peers, k)

    def _note(self, key, f, old):
        if key[0] == F.NIC:
            kind = "nic_up" if f.level == F.FULL else "nic_down"
        else:
            kind = "pair_up" if f.level == F.FULL else "pair_down"
        text = (f"{describe(key)} announced at {f.level}/{F.FULL} of its rate by rank "
                f"{f.origin} (fact version {f.version}; was {old}/{F.FULL})")
        try:
            self.engine.note_event(kind, f.origin, key[3], text)
        except RuntimeError:
            pass


def describe(key):
    kind, x, y, k = key
    return f"NIC {k} of host {x}" if kind == F.NIC else f"rail {k} between ranks {x} and {y}"


def _nic_states(addrs):
    from .._core import engine
    return engine.nic_states(addrs)
