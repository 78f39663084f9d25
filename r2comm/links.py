"""Connections between ranks: the initial mesh and fail-back.

Rank i connects to every higher rank j once per common rail and once for control; the lower
rank also re-connects a failed rail once the engine says a probe is due, so a rail whose link
came back is re-admitted without user action. At start-up the connections are tried in
parallel until a short deadline; one that does not come up starts down and is probed the same
way (r2comm/startup.py). One thread accepts incoming connections for the whole life of the
engine and authenticates them without blocking (tcp.ServerHandshake, driven by a selector): a
connection that never finishes its handshake holds one of MAX_PENDING slots until its
deadline, never the thread, so fail-back probes and event delivery keep running."""
import collections
import logging
import selectors
import threading
import time

from . import shm, verbs_rails
from ._core import tcp

log = logging.getLogger("r2comm")
HANDSHAKE_TIMEOUT = 2.0     # s: a whole incoming handshake (a rail's takes about a millisecond)
MAX_PENDING = 64            # incoming handshakes in progress; more connections are closed at once
REJECTED_KEEP = 256         # refused connections remembered in Links.rejected
LOG_EVERY = 5.0             # s: at most one warning about refused connections per this

CONNECT_TRY_S = 1.0      # longest one start-up connection attempt waits (a silent NIC)
CONNECT_RETRY_S = 0.1    # pause before a failed start-up attempt is tried again
CONNECT_THREADS = 32     # start-up connection attempts in flight at once
VERBS_EXCHANGE_S = 10.0  # s: a verbs rail's queue-pair exchange after its handshake (creating
                         # a QP and registering its slots takes ~1 s in an emulated guest)


class Links:
    def __init__(self, engine, boot, cfg):
        self.engine = engine
        self.boot = boot
        self.cfg = cfg
        self.me = boot.rank
        # a local peer (r2comm/shm.py) has one data rail, the shared-memory link, at index 0
        self.shm_peers = set(shm.local_peers(boot.endpoints, self.me))
        self.nrails = [0 if j == self.me else 1 if j in self.shm_peers else
                       min(len(boot.rail_addrs), len(ep["rails"]))
                       for j, ep in enumerate(boot.endpoints)]
        self.verbs = getattr(boot, "transport", "tcp") == "verbs"   # data rails on queue pairs
        self.rejected = collections.deque(maxlen=REJECTED_KEEP)  # (time, reason), newest last
        self.nrejected = 0            # refused connections in all (the deque keeps the last ones)
        self.handshake_timeout = HANDSHAKE_TIMEOUT
        self.max_pending = MAX_PENDING
        self._pending = {}            # fd -> (ServerHandshake, listener index)
        self._log_next = 0.0          # rate limit of the "refused a connection" warning
        self._log_quiet = 0
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
        if peer in self.shm_peers and rail != tcp.CTRL_RAIL:
            try:
                # (no SYN into a dead link to give up on early: a loaded peer gets time)
                shm.open_link(self.engine, self.boot, self.cfg, peer, max(timeout, 0.5))
            except (OSError, tcp.HandshakeError) as exc:
                return "shared-memory link: " + (str(exc) or type(exc).__name__)
            self._seen_add(peer, rail)
            return None
        if rail == tcp.CTRL_RAIL:
            (addr, port), local = ep["ctrl"], None
        else:
            (addr, port), local = ep["rails"][rail], self.boot.rail_addrs[rail]
        try:
            fd, conn_id = tcp.connect(addr, port, local, self.boot.secret, self.boot.job, self.me,
                                      peer, rail, timeout, self.cfg.rail_timeout_ms,
                                      self.cfg.sockbuf, self.cfg.notsent_lowat)
            self._attach(peer, rail, fd, conn_id)
        except (OSError, tcp.HandshakeError) as exc:
            return str(exc) or type(exc).__name__
        return None

    def _connect(self, peer, rail, timeout):
        return self._open(peer, rail, timeout) is None

    def _attach(self, peer, rail, fd, conn_id):
        if rail == shm.SHM_RAIL:       # the doorbell connection of a shared-memory link
            shm.accept_link(self.engine, self.boot, peer, fd, conn_id)
            self._seen_add(peer, 0)
            return
        if rail == shm.TCP_RAIL:       # a local pair's link over TCP (no room in /dev/shm)
            shm.accept_tcp_link(self.engine, self.boot, peer, fd, conn_id)
            self._seen_add(peer, 0)
            return
        keys = tcp.take_keys(fd)
        if rail != tcp.CTRL_RAIL and self.verbs:
            # the authenticated socket carries the queue-pair exchange, then stays beside
            # the QP as its companion (verbs_rails.exchange); the control connection stays TCP
            handle = verbs_rails.exchange(self.boot.rail_devices[rail], fd, keys[0], keys[1],
                                          VERBS_EXCHANGE_S)
            self.engine.attach_transport(peer, rail, verbs_rails.load()[0].transport_address(),
                                         handle, conn_id, *keys)
        else:
            self.engine.attach(peer, self.engine_rail(peer, rail), fd, conn_id, *keys)
        self._seen_add(peer, rail)

    def _seen_add(self, peer, rail):
        with self._cv:
            self._attached += 1
            self._seen.add((peer, rail))
            self._cv.notify_all()

    # -- the thread -----------------------------------------------------------------------------
    def _serve(self):
        listeners = self.boot.listeners
        sel = selectors.DefaultSelector()
        try:
            for i, lst in enumerate(listeners):
                lst.setblocking(False)
                sel.register(lst, selectors.EVENT_READ, i)
            next_probe = 0.0
            while not self._stop.is_set():
                try:
                    ready = sel.select(0.02)
                except (OSError, ValueError):
                    return
                for key, _ in ready:
                    if key.data is None:
                        self._step(sel, key.fd)
                    else:
                        self._accept(sel, key.fileobj, key.data)
                now = time.monotonic()
                for fd in [fd for fd, v in self._pending.items() if now >= v[0].deadline]:
                    self._step(sel, fd, now)
                if now >= next_probe:
                    next_probe = now + 0.02
                    self._probe()
                    if self.on_tick is not None:
                        try:
                            self.on_tick()
                        except RuntimeError:
                            return
        finally:
            for hs, _ in list(self._pending.values()):
                hs.close()
            self._pending.clear()
            sel.close()

    def _accept(self, sel, lst, lindex):
        """Take the connections waiting on a listener and start their handshakes."""
        for _ in range(self.max_pending + 1):
            try:
                sock, addr = lst.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._reject(f"accept failed: {exc}")
                return
            if len(self._pending) >= self.max_pending:
                sock.close()
                self._reject(f"connection from {addr[0]}:{addr[1]} closed: {self.max_pending} "
                             "handshakes already pending")
                continue
            ctrl_index = len(self.boot.listeners) - 1

            def admit(peer, rail, lindex=lindex):
                if not (0 <= peer < self.boot.size and peer != self.me):
                    return False
                if rail == tcp.CTRL_RAIL:
                    return lindex == ctrl_index
                if rail in (shm.SHM_RAIL, shm.TCP_RAIL):   # only a local, lower rank opens one
                    return lindex == ctrl_index and peer in self.shm_peers and peer < self.me
                if peer in self.shm_peers:
                    return False               # a local peer has no NIC rails
                # the listener must be that rail's, and an injected fault keeps the NIC dark
                return rail < self.nrails[peer] and lindex == rail and not self.engine.injected(rail, peer)
            hs = tcp.ServerHandshake(sock, addr, self.boot.secret, self.boot.job, self.me,
                                     time.monotonic() + self.handshake_timeout,
                                     self.cfg.rail_timeout_ms, admit, self.cfg.sockbuf,
                                     self.cfg.notsent_lowat)
            fd = sock.fileno()
            self._pending[fd] = (hs, lindex)
            sel.register(fd, selectors.EVENT_READ, None)
            self._step(sel, fd)

    def _step(self, sel, fd, now=None):
        """Advance the pending handshake on socket fd; past its deadline it is refused."""
        hs, _ = self._pending[fd]
        try:
            res = hs.step(now)
        except (OSError, tcp.HandshakeError) as exc:
            self._forget(sel, fd)
            hs.close()
            if "refused (rail failed" not in str(exc):
                self._reject(str(exc))
            return
        if res is not None:
            self._forget(sel, fd)          # fd now belongs to the engine
            if res[1] not in (tcp.CTRL_RAIL, shm.SHM_RAIL, shm.TCP_RAIL) and self.verbs:
                # the queue-pair exchange waits for the peer: not on this thread, which
                # drives every other handshake
                threading.Thread(target=self._attach_verbs, args=res, daemon=True,
                                 name="r2comm-qpx").start()
            else:
                try:
                    self._attach(*res)
                except (OSError, tcp.HandshakeError, ValueError, MemoryError) as exc:
                    self._reject(f"rank {res[0]} rail {res[1]}: connection refused: {exc}")

    def _attach_verbs(self, *res):
        try:
            self._attach(*res)
        except OSError as exc:             # the exchange failed: the socket is closed
            self._reject(f"rank {res[0]} rail {res[1]}: {exc}")
        except RuntimeError:               # the engine was closed meanwhile
            pass

    def _forget(self, sel, fd):
        del self._pending[fd]
        try:
            sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _reject(self, reason):
        """Remember a refused connection; warn at most once per LOG_EVERY seconds."""
        self.rejected.append((time.time(), reason))
        self.nrejected += 1
        now = time.monotonic()
        if now >= self._log_next:
            more = f" ({self._log_quiet} more not logged)" if self._log_quiet else ""
            log.warning("r2comm rank %d: refused a connection: %s%s", self.me, reason, more)
            self._log_next = now + LOG_EVERY
            self._log_quiet = 0
        else:
            self._log_quiet += 1

    def _probe(self):
        try:
            due = self.engine.reconnect_due()
        except RuntimeError:
            return
        for peer, rail in due:
            if peer > self.me:
                if not self._connect(peer, rail, self.engine.probe_timeout(peer, rail)):
                    self.engine.probe_failed(peer, rail)
            else:
                self.engine.probe_failed(peer, rail)   # the lower rank re-connects; wait for it

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for s in self.boot.listeners:
            s.close()
