"""Connections between ranks: the initial mesh and fail-back.

Rank i connects to every higher rank j once per common rail and once for control; the lower
rank also re-connects a failed rail once the engine says a probe is due, so a rail whose link
came back is re-admitted without user action. At start-up the connections are tried in
parallel until a short deadline; one that does not come up starts down and is probed the same
way (r2comm/startup.py). One thread accepts (and authenticates) incoming
connections for the whole life of the engine."""
import collections
import logging
import select
import threading
import time

from ._core import tcp

log = logging.getLogger("r2comm")

CONNECT_TRY_S = 1.0      # longest one start-up connection attempt waits (a silent NIC)
CONNECT_RETRY_S = 0.1    # pause before a failed start-up attempt is tried again
CONNECT_THREADS = 32     # start-up connection attempts in flight at once


class Links:
    def __init__(self, engine, boot, cfg):
        self.engine = engine
        self.boot = boot
        self.cfg = cfg
        self.me = boot.rank
        self.nrails = [0 if j == self.me else min(len(boot.rail_addrs), len(ep["rails"]))
                       for j, ep in enumerate(boot.endpoints)]
        self.rejected = []            # (time, reason) of refused connections
        self._attached = 0
        self._seen = set()            # (peer, rail) that were attached at least once
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self.on_tick = None           # called every ~20 ms from the thread (event delivery)
        self._thread = threading.Thread(target=self._serve, name="r2comm-links", daemon=True)

    def engine_rail(self, peer, rail):
        return self.nrails[peer] if rail == tcp.CTRL_RAIL else rail

    # -- set-up ---------------------------------------------------------------------------------
    def establish(self, timeout):
        """Open this rank's connections (every data rail and the control connection to every
        higher rank) in parallel, each retried until the start-up deadline `timeout` s from now
        (R2COMM_CONNECT_TIMEOUT): a refused or unreachable one every CONNECT_RETRY_S, a silent
        one (a blackholed NIC) after CONNECT_TRY_S. Never raises for a connection that stays
        down: returns {(peer, rail): None if up, else why not}; the ranks then agree on the
        outcome (startup.agree) and settle() marks what did not connect. Waits without a CPU."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        todo = collections.deque()
        outcome = {}
        for peer in range(self.me + 1, self.boot.size):
            for rail in list(range(self.nrails[peer])) + [tcp.CTRL_RAIL]:
                if rail != tcp.CTRL_RAIL and self.engine.injected(rail, peer):
                    outcome[(peer, rail)] = "the NIC is dark on this side (injected fault, " \
                                            "R2COMM_FAULT start=1)"
                else:
                    todo.append((peer, rail, 0.0))
                    outcome[(peer, rail)] = f"no attempt finished within {timeout:g} s"
        lock = threading.Lock()

        def work():
            while True:
                with lock:
                    if not todo:
                        return
                    peer, rail, not_before = todo.popleft()
                nap = min(not_before, deadline) - time.monotonic()
                if nap > 0:
                    time.sleep(nap)
                left = deadline - time.monotonic()
                err = self._open(peer, rail, max(min(left, CONNECT_TRY_S), 0.05))
                with lock:
                    if err is not None and deadline - time.monotonic() > CONNECT_RETRY_S:
                        todo.append((peer, rail, time.monotonic() + CONNECT_RETRY_S))
                    else:
                        outcome[(peer, rail)] = err
        workers = [threading.Thread(target=work, name="r2comm-connect", daemon=True)
                   for _ in range(min(len(todo), CONNECT_THREADS))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(max(deadline - time.monotonic(), 0) + CONNECT_TRY_S + 1.0)
        with lock:                            # (an attempt still running counts as down)
            return dict(outcome)

    def settle(self, start, grace=2.0):
        """Make this rank's engine match the agreed start-up table (startup.StartOutcome):
        every data rail of this rank that did not connect starts DOWN (rail_never_up, probed
        for fail-back from now on), also on the accepting side, which never saw the attempt.
        A connection the opener reports up is waited for (at most `grace` s: the last message
        of its handshake may still be on the way); one that does not arrive is marked down
        here and fails on the opener's side when this side closes it."""
        deadline = time.monotonic() + grace
        for peer in range(self.boot.size):
            if peer == self.me:
                continue
            lo, hi = min(self.me, peer), max(self.me, peer)
            for rail in range(self.nrails[peer]):
                why = start.failed.get((lo, hi, rail))
                if why is None and peer < self.me:
                    with self._cv:
                        while (peer, rail) not in self._seen and time.monotonic() < deadline:
                            self._cv.wait(0.05)
                        if (peer, rail) not in self._seen:
                            why = "the connection rank {peer} opened did not finish its " \
                                  "handshake here".format(peer=peer)
                if why is not None:
                    who = "this rank" if lo == self.me else f"rank {lo}"
                    self.engine.mark_unconnected(
                        peer, rail, f"did not connect at start-up ({who} -> rank {hi}, "
                        f"{start.describe(lo, hi, rail)}): {why}")

    def _open(self, peer, rail, timeout):
        """One attempt at connection (peer, rail); attached to the engine when it works.
        Returns None, or why it failed."""
        ep = self.boot.endpoints[peer]
        if rail == tcp.CTRL_RAIL:
            (addr, port), local = ep["ctrl"], None
        else:
            (addr, port), local = ep["rails"][rail], self.boot.rail_addrs[rail]
        try:
            fd, conn_id = tcp.connect(addr, port, local, self.boot.secret, self.boot.job, self.me,
                                      peer, rail, timeout, self.cfg.rail_timeout_ms,
                                      self.cfg.sockbuf, self.cfg.notsent_lowat)
        except (OSError, tcp.HandshakeError) as exc:
            return str(exc) or type(exc).__name__
        self._attach(peer, rail, fd, conn_id)
        return None

    def _connect(self, peer, rail, timeout):
        return self._open(peer, rail, timeout) is None

    def _attach(self, peer, rail, fd, conn_id):
        self.engine.attach(peer, self.engine_rail(peer, rail), fd, conn_id)
        with self._cv:
            self._attached += 1
            self._seen.add((peer, rail))
            self._cv.notify_all()

    # -- the thread -----------------------------------------------------------------------------
    def _serve(self):
        listeners = self.boot.listeners
        next_probe = 0.0
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select(listeners, [], [], 0.02)
            except (OSError, ValueError):
                return
            for lst in ready:
                self._accept(lst, listeners.index(lst))
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + 0.02
                self._probe()
                if self.on_tick is not None:
                    try:
                        self.on_tick()
                    except RuntimeError:
                        return

    def _accept(self, lst, lindex):
        ctrl_index = len(self.boot.listeners) - 1

        def admit(peer, rail):
            if not (0 <= peer < self.boot.size and peer != self.me):
                return False
            if rail == tcp.CTRL_RAIL:
                return lindex == ctrl_index
            # the listener must be that rail's, and an injected fault keeps the NIC dark
            return rail < self.nrails[peer] and lindex == rail and not self.engine.injected(rail, peer)
        try:
            peer, rail, fd, conn_id = tcp.accept(lst, self.boot.secret, self.boot.job, self.me,
                                                 1.0, self.cfg.rail_timeout_ms, admit,
                                                 self.cfg.sockbuf, self.cfg.notsent_lowat)
        except (OSError, tcp.HandshakeError) as exc:
            if "refused (rail failed" not in str(exc):
                self.rejected.append((time.time(), str(exc)))
                log.warning("r2comm rank %d: refused a connection: %s", self.me, exc)
            return
        self._attach(peer, rail, fd, conn_id)

    def _probe(self):
        try:
            due = self.engine.reconnect_due()
        except RuntimeError:
            return
        for peer, rail in due:
            if peer > self.me:
                if not self._connect(peer, rail, 0.3):
                    self.engine.probe_failed(peer, rail)
            else:
                self.engine.probe_failed(peer, rail)   # the lower rank re-connects; wait for it

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for s in self.boot.listeners:
            s.close()
