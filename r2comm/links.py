"""Connections between ranks: the initial mesh and fail-back.

Rank i connects to every higher rank j once per common rail and once for control; the lower
rank also re-connects a failed rail once the engine says a probe is due, so a rail whose link
came back is re-admitted without user action. One thread accepts (and authenticates) incoming
connections for the whole life of the engine."""
import logging
import select
import threading
import time

from ._core import tcp
from .errors import R2commNetworkError

log = logging.getLogger("r2comm")


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
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self.on_tick = None           # called every ~20 ms from the thread (event delivery)
        self._thread = threading.Thread(target=self._serve, name="r2comm-links", daemon=True)

    def engine_rail(self, peer, rail):
        return self.nrails[peer] if rail == tcp.CTRL_RAIL else rail

    # -- set-up ---------------------------------------------------------------------------------
    def establish(self, timeout):
        expected = sum(n + 1 for j, n in enumerate(self.nrails) if j != self.me)
        self._thread.start()
        deadline = time.monotonic() + timeout
        for peer in range(self.me + 1, self.boot.size):
            for rail in list(range(self.nrails[peer])) + [tcp.CTRL_RAIL]:
                self._connect(peer, rail, max(deadline - time.monotonic(), 0.1), initial=True)
        with self._cv:
            while self._attached < expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise R2commNetworkError(
                        f"rank {self.me}: only {self._attached} of {expected} rail connections "
                        f"came up within {timeout:.0f} s")
                self._cv.wait(min(left, 0.1))

    def _connect(self, peer, rail, timeout, initial=False):
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
            if initial:
                raise R2commNetworkError(f"rank {self.me}: cannot connect rail {rail} to rank "
                                         f"{peer} at {addr}:{port}: {exc}") from exc
            return False
        self._attach(peer, rail, fd, conn_id)
        return True

    def _attach(self, peer, rail, fd, conn_id):
        self.engine.attach(peer, self.engine_rail(peer, rail), fd, conn_id)
        with self._cv:
            self._attached += 1
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
