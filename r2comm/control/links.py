"""Connections between ranks: made on first use, and fail-back.

A rank connects to a peer when a schedule first needs it (connect_for: a compiled plan's whole
neighbour set, a point-to-point peer), every common rail and the control connection in
parallel, each retried until R2COMM_CONNECT_TIMEOUT; a data rail that does not come up by then
starts down (rail_never_up) and is probed for fail-back like a rail that failed later. So a
rank holds connections to the peers its schedules use: O(1) for ring plans, O(log n) for
halving, tree and dissemination ones, not n - 1 (issue 31). Only the start-up set
(eager_peers: the ring neighbours, whose connections the start-up bandwidth measurement (bandwidth.py) times and
whose outcome the ranks agree on, and the local peers' shared-memory links) is connected
before the Communicator returns.

Either end may open a pair's connection, also both at once: the lower rank's wins. A rank
refuses an incoming connection from a higher rank for a (peer, rail) it is opening itself or
has up, and accepts the lower rank's always; its own attempt waits while an incoming one for
the same (peer, rail) is being set up (_claim). So a pair ends with exactly one connection per
rail, and a one-sided need (the other rank never asks) is accepted by the other's links thread.
A failed rail is re-connected once the engine says a probe is due, by either end (on the
fail-back thread, never blocking the accepting one), so a rail whose link came back is
re-admitted without user action, also where only one end ever needed it. At start-up the
eager connections are tried in parallel until a short deadline; one that does not come up
starts down and is probed the same way (r2comm/control/startup.py).

One thread accepts incoming connections for the whole life of the engine and authenticates
them without blocking (CONTROL.ServerHandshake, driven by a selector): a connection that never
finishes its handshake holds one of 64 slots until its deadline, never the thread, so
fail-back probes and event delivery keep running.

A client that floods the listeners cannot lock the ranks out (admission.Policy, also the
failure detector's): a connection holds a slot of its pair only once its HELLO carries a valid
tag, whatever its source address; until then it is anonymous, capped in all and per address, and
the oldest anonymous one is closed for a newcomer. A pair's claim (_admit_pair) is taken only
once the connector proved the secret, so HELLOs that never do block none of this rank's own
connects. An error of one connection (a corrupt queue-pair address, an attach that raises)
closes that connection, is logged, counted (Links.nerrors) and recorded as a `link_error` event;
it never ends the thread.

Kinds. Links branches on no transport's name: a pair's connections are the job's NIC kind's
(r2comm.transport.kind_of(boot.transport): dial, attach), a local pair's one data link the
local kind's (transport.LOCAL: open, attach), the control connection TCP's (transport.CONTROL,
whose handshake every connection starts with); an accepted connection's kind follows from its
HELLO's rail code (transport.for_hello)."""
import collections
import errno
import logging
import os
import resource
import selectors
import threading
import time

from . import admission
from .. import transport
from ..transport import CONTROL, CTRL_RAIL, LOCAL, HandshakeError
from ..errors import R2commResourceError


log = logging.getLogger("r2comm")
HANDSHAKE_TIMEOUT = 2.0     # s: a whole incoming handshake (a rail's takes about a millisecond)
ACCEPT_BATCH = 256          # connections taken from one listener per wake-up
REJECTED_KEEP = 256         # refused connections remembered in Links.rejected
LOG_EVERY = 5.0             # s: at most one warning about refused connections per this

CONNECT_TRY_S = 1.0      # longest one start-up connection attempt waits (a silent NIC)
CONNECT_RETRY_S = 0.1    # pause before a failed start-up attempt is tried again
CONNECT_THREADS = 32     # start-up connection attempts in flight at once
BUSY = object()           # _attempt: another attempt at that connection is under way
OFF = "its NIC is announced down (r2comm.control.facts)"   # _first_use: not attempted
FD_RESERVE_SHARE = 64    # a first use leaves 1/64 of the fd limit free (own files, fail-back)
FD_WARN_FRACTION = 0.8   # a first use that takes a rank past this share of its limit warns
ACCEPT_PAUSE_S = 0.1     # listeners rest this long after accept() found no fd (EMFILE)


def open_fds():
    """The fds this process has open now (/proc/self/fd; 0 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1      # less the directory's own fd
    except OSError:
        return 0


def start_peers(endpoints, me):
    """The peers rank `me` connects at start-up (Links.eager_peers): its ring neighbours and
    its local peers (transport.LOCAL), in rank order."""
    n = len(endpoints)
    ring = {(me - 1) % n, (me + 1) % n} - {me} if n > 1 else set()
    return sorted(ring | set(LOCAL.local_peers(endpoints, me)))

class Links:
    def __init__(self, engine, boot, cfg):
        self.engine = engine
        self.boot = boot
        self.cfg = cfg
        self.me = boot.rank
        # a local peer (transport.LOCAL) has one data rail, the local link, at index 0
        self.local_peers = set(LOCAL.local_peers(boot.endpoints, self.me))
        self.nrails = [0 if j == self.me else 1 if j in self.local_peers else
                       min(len(boot.rail_addrs), len(ep["rails"]))
                       for j, ep in enumerate(boot.endpoints)]
        self.nic = transport.kind_of(boot.transport)   # the kind of the NIC data rails
        self.rejected = collections.deque(maxlen=REJECTED_KEEP)  # (time, reason), newest last
        self.nrejected = 0            # refused connections in all (the deque keeps the last ones)
        self.handshake_timeout = HANDSHAKE_TIMEOUT
        self.admission = admission.Policy()   # which pending handshakes a flood may close
        self._pending = {}            # fd -> _Pending
        self.nerrors = 0              # connections closed for an unexpected error (link_error)
        self.errors = collections.deque(maxlen=REJECTED_KEEP)   # (time, what), newest last
        self._err_log_next = 0.0      # rate limit of the link-error warning
        self._log_next = 0.0          # rate limit of the "refused a connection" warning
        self._log_quiet = 0
        self._attached = 0
        self._seen = set()            # (peer, rail) that were attached at least once
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self.on_tick = None           # called every ~20 ms from the thread (event delivery)
        self._thread = threading.Thread(target=self._serve, name="r2comm-links", daemon=True)
        self.connect_timeout = cfg.connect_timeout   # s: a first use's bound
        self._opening = set()         # (peer, rail) this rank is connecting now (_claim)
        self._accepting = collections.Counter()   # (peer, rail) of incoming handshakes admitted
        self._ready = set()           # peers connected (or tried) for use: connect_for skips them
        self._want = threading.Lock()  # one connect_for at a time makes the connections
        self._failback_q = collections.deque()   # (peer, rail) fail-back probes for its thread
        self._failing_back = set()         # of which queued or running
        self._failback_thread = None
        self.nconnect_for = 0         # first uses that made connections (tests, bench)
        self.fd_warned = False        # the fd limit's warning was given (_check_fd_room)
        self._accept_rest = []        # (listener, index, until): resting after EMFILE (_accept)

    def engine_rail(self, peer, rail):
        return self.nrails[peer] if rail == CTRL_RAIL else rail

    # -- which connections, and who opens -------------------------------------------------------
    def eager_peers(self):
        """The peers connected at start-up (the same relation on both ends): the local peers
        (shared-memory links: a host runs a bounded number of ranks, and their set-up needs
        /dev/shm's room agreed before the first plan) and the ring neighbours (the bandwidth
        probe's partners; their outcome is agreed, so a wrong R2COMM_CTRL_ADDR still fails
        start-up on every rank)."""
        return start_peers(self.boot.endpoints, self.me)

    def _rails_of(self, peer):
        return list(range(self.nrails[peer])) + [CTRL_RAIL]

    def _up(self, peer, rail):
        """Connection (peer, rail) is up in the engine."""
        return self._state(peer, rail) == "up"

    def _state(self, peer, rail):
        """Engine.links.link_state of connection (peer, rail)."""
        return self.engine.links.link_state(peer, self.engine_rail(peer, rail))

    def _claim(self, peer, rail):
        """Take (peer, rail) for an attempt of this rank: False while one of ours or an
        admitted incoming handshake for it is under way, or it is up."""
        key = (peer, rail)
        with self._cv:
            if key in self._opening or self._accepting[key] > 0 or self._up(peer, rail):
                return False
            self._opening.add(key)
            return True

    def _unclaim(self, peer, rail):
        with self._cv:
            self._opening.discard((peer, rail))
            self._cv.notify_all()

    def _admit_pair(self, peer, rail, claim=True):
        """An incoming handshake for (peer, rail) may go on: the lower rank's always; a higher
        rank's unless this rank is opening that connection itself or has it up (the lower
        rank's connection wins, so both ends keep the same one). Admitted with claim: counted
        in _accepting until _release (only once the connector proved the secret)."""
        key = (peer, rail)
        with self._cv:
            if peer > self.me and (key in self._opening or self._up(peer, rail)):
                return False
            if claim:
                self._accepting[key] += 1
            return True

    def _release(self, key):
        if key is None:
            return
        with self._cv:
            self._accepting[key] -= 1
            if self._accepting[key] <= 0:
                del self._accepting[key]
            self._cv.notify_all()

    def _attempt(self, peer, rail, timeout):
        """One claimed attempt at (peer, rail): None (up), why it failed, or BUSY (another
        attempt for it is under way)."""
        if not self._claim(peer, rail):
            return None if self._up(peer, rail) else BUSY
        try:
            return self._open(peer, rail, timeout)
        finally:
            self._unclaim(peer, rail)

    # -- connect on first use -------------------------------------------------------------------
    def connect_for(self, peers):
        """Connect what a schedule needs: every rail and the control connection to each of
        `peers` (global ranks) not connected for use yet, all in parallel, each retried until
        R2COMM_CONNECT_TIMEOUT. A data rail that did not come up by then starts down
        (Engine.links.mark_unconnected: event rail_never_up, probed for fail-back); the others carry
        the traffic. Never raises for a connection that stays down. O(1) for peers already
        connected (the hot path: a set lookup each)."""
        ready = self._ready
        need = [p for p in peers if p not in ready and p != self.me]
        if not need:
            return
        with self._want:
            need = sorted({p for p in need if p not in self._ready})
            if not need:
                return
            jobs = [(p, k) for p in need if p not in self.local_peers for k in self._rails_of(p)]
            self._check_fd_room(need, [(p, k) for p, k in jobs if not self._up(p, k)])
            self.nconnect_for += 1
            deadline = time.monotonic() + self.connect_timeout
            outcome = _parallel(jobs, lambda p, k: self._first_use(p, k, deadline),
                                self.connect_timeout + CONNECT_TRY_S + 1.0)
            for (p, k), why in sorted(outcome.items()):
                if why is None or why is OFF or self._up(p, k):
                    continue                  # (OFF: stays idle until its NIC is back up)
                if k == CTRL_RAIL:
                    log.warning("r2comm rank %d: the control connection to rank %d did not come "
                                "up within %g s (R2COMM_CONNECT_TIMEOUT): %s", self.me, p,
                                self.connect_timeout, why)
                    continue
                self.engine.links.mark_unconnected(
                    p, k, f"did not connect on first use (rank {self.me} -> rank {p}, rail {k}, "
                    f"within {self.connect_timeout:g} s): {why}")
            self._ready.update(need)

    def reconnect_idle(self, peers, rail):
        """Data rail `rail` to each of `peers` (global ranks) that a first use already
        connected for and that is idle (skipped while its NIC was announced down): tried on
        the fail-back thread, as a fail-back probe is. Peers never needed stay for first use."""
        for peer in peers:
            if peer == self.me or peer not in self._ready or peer in self.local_peers or \
                    rail >= self.nrails[peer]:
                continue
            if self._state(peer, rail) != "idle":
                continue
            self._queue_failback(peer, rail)

    def _check_fd_room(self, peers, missing):
        """Before a first use opens the connections `missing` ((peer, rail) of `peers`): raise
        R2commResourceError when they would take this rank past its fd limit less a 64th of it
        (the caller's collective tells its peers, so every rank raises at once, not "rank r is
        unreachable" after the connect timeout from EMFILE in some attempts), and warn once past
        FD_WARN_FRACTION of it. An alltoall or point-to-point to every rank connects every peer:
        at a thousand ranks that is thousands of fds."""
        per_rail = self.nic.rail_fds
        add = sum(1 if k == CTRL_RAIL else per_rail for _, k in missing)
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if not add or limit == resource.RLIM_INFINITY:
            return
        held, reserve = open_fds(), max(limit // FD_RESERVE_SHARE, 2)
        if held + add + reserve > limit:
            raise R2commResourceError(
                f"rank {self.me}: connecting to {len(peers)} more peers on first use needs about "
                f"{add} file descriptors; it holds {held} of its limit of {limit} "
                f"(RLIMIT_NOFILE, less {reserve} kept free; r2comm lifted the soft limit to "
                f"the hard one at start-up): raise the hard limit (`ulimit -Hn`, limits.conf or "
                f"the launcher's), or call collectives that talk to fewer peers (an alltoall or "
                f"point-to-point to every rank connects every peer, on every rail)")
        if held + add > FD_WARN_FRACTION * limit and not self.fd_warned:
            self.fd_warned = True
            log.warning("r2comm rank %d: %d file descriptors after connecting %d more peers, "
                        "%.0f%% of its limit of %d (RLIMIT_NOFILE): more peers will fail with "
                        "R2commResourceError; raise `ulimit -Hn`", self.me, held + add,
                        len(peers), (held + add) * 100 / limit, limit)

    def _first_use(self, peer, rail, deadline):
        """Bring (peer, rail) up by `deadline`: this rank's attempts, or the peer's connection
        arriving meanwhile (then this rank's are refused there, or wait here). -> None if up,
        else why not."""
        why = f"no attempt finished within {self.connect_timeout:g} s"
        while True:
            if self._up(peer, rail):
                return None
            if rail != CTRL_RAIL and self._state(peer, rail) == "off":
                return OFF
            if rail != CTRL_RAIL and self.engine.faults.injected(rail, peer):
                return "the NIC is dark on this side (injected fault)"
            if not self.engine.links.peer_ok(peer):
                # (issue 44: a rank the failure detector declared dead meanwhile; retrying it
                # to the deadline would hold every other first use, connect_for's lock, 5 s)
                return "the peer is held lost (declared dead, or every rail to it failed)"
            left = deadline - time.monotonic()
            if left <= 0:
                return why
            err = self._attempt(peer, rail, max(min(left, CONNECT_TRY_S), 0.05))
            if err is None:
                return None
            if err is not BUSY:
                why = err
            with self._cv:                # woken when a connection is attached or released
                if not self._up(peer, rail):  # (the peer's may have come in meanwhile)
                    self._cv.wait(max(min(CONNECT_RETRY_S, deadline - time.monotonic()), 0.001))

    # -- set-up ---------------------------------------------------------------------------------
    def establish(self, timeout):
        """Open this rank's start-up connections (every data rail and the control connection
        to each higher rank of eager_peers()) in parallel, each retried until the start-up
        deadline `timeout` s from now
        (R2COMM_CONNECT_TIMEOUT): a refused or unreachable one every CONNECT_RETRY_S, a silent
        one (a blackholed NIC) after CONNECT_TRY_S. Never raises for a connection that stays
        down: returns {(peer, rail): None if up, else why not}; the ranks then agree on the
        outcome (startup.agree) and settle() marks what did not connect. Waits without a CPU."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        todo = collections.deque()
        outcome = {}
        for peer in [p for p in self.eager_peers() if p > self.me]:
            for rail in self._rails_of(peer):
                if rail != CTRL_RAIL and self.engine.faults.injected(rail, peer):
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
                err = self._attempt(peer, rail, max(min(left, CONNECT_TRY_S), 0.05))
                with lock:
                    if err is BUSY:
                        err = "an incoming connection for it did not finish"
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
        for peer in self.eager_peers():
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
                    self.engine.links.mark_unconnected(
                        peer, rail, f"did not connect at start-up ({who} -> rank {hi}, "
                        f"{start.describe(lo, hi, rail)}): {why}")
        self._ready.update(self.eager_peers())

    def _open(self, peer, rail, timeout):
        """One attempt at connection (peer, rail); attached to the engine when it works.
        Returns None, or why it failed."""
        if peer in self.local_peers and rail != CTRL_RAIL:
            try:
                # (no SYN into a dead link to give up on early: a loaded peer gets time)
                LOCAL.open(self.engine, self.boot, self.cfg, peer, max(timeout, 0.5))
            except (OSError, HandshakeError) as exc:
                return f"{LOCAL.title}: " + (str(exc) or type(exc).__name__)
            except Exception as exc:      # noqa: BLE001 (one connection's error, not the thread's)
                return self._link_error(f"opening a {LOCAL.title}", peer, rail, exc)
            self._seen_add(peer, rail)
            return None
        kind = CONTROL if rail == CTRL_RAIL else self.nic
        try:
            fd, conn_id = kind.dial(self.boot, self.cfg, peer, rail, timeout)
        except (OSError, HandshakeError) as exc:
            return str(exc) or type(exc).__name__
        except Exception as exc:          # noqa: BLE001
            return self._link_error("connecting", peer, rail, exc)
        try:
            self._attach(peer, rail, fd, conn_id)
        except (OSError, HandshakeError) as exc:
            return str(exc) or type(exc).__name__
        except Exception as exc:          # noqa: BLE001 (_attach released what it took)
            return self._link_error("attaching", peer, rail, exc)
        return None

    def _connect(self, peer, rail, timeout):
        return self._open(peer, rail, timeout) is None

    def _attach(self, peer, rail, fd, conn_id):
        """Connection (peer, rail), authenticated on fd, to the engine by its kind (the HELLO's
        rail code: a local link, the control connection, or a NIC data rail)."""
        kind = transport.for_hello(rail, self.nic)
        kind.attach(self.engine, self.boot, peer, rail, fd, conn_id, self.engine_rail(peer, rail))
        self._seen_add(peer, 0 if kind.local else rail)

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
            next_failback = 0.0
            while not self._stop.is_set():
                try:
                    ready = sel.select(0.02)
                except (OSError, ValueError):
                    return
                # handshakes first: a HELLO that arrived takes its connection out of a
                # flood's reach before the listeners' newcomers make room
                for key, _ in sorted(ready, key=lambda kv: kv[0].data is not None):
                    if key.data is None:
                        if key.fd in self._pending:   # (not evicted by an _accept just now)
                            self._step(sel, key.fd)
                    else:
                        self._accept(sel, key.fileobj, key.data)
                now = time.monotonic()
                for item in [x for x in self._accept_rest if now >= x[2]]:
                    self._accept_rest.remove(item)          # a rested listener accepts again
                    sel.register(item[0], selectors.EVENT_READ, item[1])
                for fd in [fd for fd, v in self._pending.items() if now >= v.hs.deadline]:
                    self._step(sel, fd, now)
                if now >= next_failback:
                    next_failback = now + 0.02
                    self._failback_due()
                    if self.on_tick is not None:
                        try:
                            self.on_tick()
                        except RuntimeError:
                            return
        finally:
            for p in list(self._pending.values()):
                p.hs.close()
                self._release(p.claim)
            self._pending.clear()
            sel.close()

    def _accept(self, sel, lst, lindex):
        """Take the connections waiting on a listener and start their handshakes."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = lst.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._reject(f"accept failed: {exc}")
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the connection stays queued and the listener readable: rest it, or the
                    # thread spins on accept() until an fd is free
                    sel.unregister(lst)
                    self._accept_rest.append((lst, lindex, time.monotonic() + ACCEPT_PAUSE_S))
                return
            try:
                self._admit_one(sel, sock, addr, lindex)
            except Exception as exc:      # noqa: BLE001 (that connection's error)
                sock.close()
                self._link_error(f"accepting {addr[0]}:{addr[1]}", -1, -1, exc)

    def _admit_one(self, sel, sock, addr, lindex):
        """Start the handshake of one accepted connection, making room for it if needed."""
        victims, room = self.admission.room({fd: p.hs for fd, p in self._pending.items()},
                                            addr[0])
        for fd, why in victims:
            self._evict(sel, fd, why)
        if not room:
            sock.close()
            self._reject(f"connection from {addr[0]}:{addr[1]} closed: "
                         f"{self.admission.total} handshakes pending, each with a valid hello")
            return
        pending = _Pending(None, lindex, addr[0])

        def check(peer, rail, lindex=lindex):
            return self._wanted(peer, rail, lindex) and self._admit_pair(peer, rail, False)

        def admit(peer, rail, lindex=lindex):
            if not (self._wanted(peer, rail, lindex) and self._admit_pair(peer, rail)):
                return False
            pending.claim = (peer, rail)   # released once attached or failed (_release)
            return True
        hs = CONTROL.ServerHandshake(sock, addr, self.boot.secret, self.me,
                                 time.monotonic() + self.handshake_timeout,
                                 self.cfg.rail_timeout_ms, admit, self.cfg.sockbuf,
                                 self.cfg.notsent_lowat, check)
        pending.hs = hs
        fd = sock.fileno()
        self._pending[fd] = pending
        sel.register(fd, selectors.EVENT_READ, None)
        self._step(sel, fd)

    def _wanted(self, peer, rail, lindex):
        """A connection from rank `peer` for `rail` on listener lindex is one this rank takes."""
        if not (0 <= peer < self.boot.size and peer != self.me):
            return False
        ctrl_index = len(self.boot.listeners) - 1
        if rail in LOCAL.hello_rails:   # only a local, lower rank opens one
            return lindex == ctrl_index and peer in self.local_peers and peer < self.me
        if rail == CTRL_RAIL:
            return lindex == ctrl_index
        if peer in self.local_peers:
            return False                   # a local peer has no NIC rails
        # the listener must be that rail's, and an injected fault keeps the NIC dark
        return rail < self.nrails[peer] and lindex == rail and \
            not self.engine.faults.injected(rail, peer)

    def _evict(self, sel, fd, why):
        """Close the pending handshake on fd to make room (admission.Policy chose it)."""
        p = self._pending[fd]
        self._forget(sel, fd)
        p.hs.close()
        self._release(p.claim)
        self._reject(f"connection from {p.src} closed to make room: {why}")

    def _step(self, sel, fd, now=None):
        """Advance the pending handshake on socket fd; past its deadline it is refused."""
        pend = self._pending[fd]
        hs = pend.hs
        try:
            res = hs.step(now)
        except (OSError, HandshakeError) as exc:
            self._forget(sel, fd)
            hs.close()
            self._release(pend.claim)
            if not isinstance(exc, CONTROL.Refused):
                self._reject(str(exc))
            return
        except Exception as exc:          # noqa: BLE001 (e.g. admit() on a closed engine)
            self._forget(sel, fd)
            hs.close()
            self._release(pend.claim)
            self._link_error("handshake", -1, -1, exc)
            return
        if res is None:
            if hs.got_hello and not pend.paired:   # its pair's slot, the newest of that pair
                pend.paired = True
                hss = {k: p.hs for k, p in self._pending.items()}
                for old in self.admission.pair_excess(hss, fd):
                    self._evict(sel, old, f"more than {self.admission.per_pair} handshakes "
                                          f"of rank {hs.pair[0]} rail {hs.pair[1]}")
            return
        self._forget(sel, fd)              # fd now belongs to the engine
        if transport.for_hello(res[1], self.nic).attach_blocks:
            # the attach waits for the peer (a queue-pair exchange): not on this thread,
            # which drives every other handshake
            threading.Thread(target=self._attach_blocking, args=(pend.claim, *res),
                             daemon=True, name="r2comm-attach").start()
        else:
            try:
                self._attach(*res)
            except (OSError, HandshakeError) as exc:
                self._reject(f"rank {res[0]} rail {res[1]}: connection refused: {exc}")
            except Exception as exc:      # noqa: BLE001 (_attach released what it took)
                self._link_error("attaching", res[0], res[1], exc)
            finally:
                self._release(pend.claim)

    def _attach_blocking(self, claim, *res):
        try:
            self._attach(*res)
        except OSError as exc:             # the exchange failed: the socket is closed
            self._reject(f"rank {res[0]} rail {res[1]}: {exc}")
        except Exception as exc:           # noqa: BLE001 (_attach released what it took)
            if not self._stop.is_set():    # (else: the engine was closed meanwhile)
                self._link_error(f"attaching a {self.nic.name} rail", res[0], res[1], exc)
        finally:
            self._release(claim)

    def _link_error(self, what, peer, rail, exc):
        """One connection failed unexpectedly (it is closed): log, count, event; -> the text."""
        text = f"{what} (rank {peer}, rail {rail}): {type(exc).__name__}: {exc}"
        self.nerrors += 1
        self.errors.append((time.time(), text))
        now = time.monotonic()
        if now >= self._err_log_next:           # at most one line per LOG_EVERY
            self._err_log_next = now + LOG_EVERY
            log.warning("r2comm rank %d: connection closed after an error (%d so far): %s",
                        self.me, self.nerrors, text,
                        exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)
        try:
            self.engine.links.note_link_error(peer, rail, text)
        except RuntimeError:               # the engine is closed
            pass
        return text

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

    def _failback_due(self):
        """Fail-back probes that are due: a shared-memory link's on this thread, by the lower
        rank (as it was set up); a NIC rail's by either end (the other may never have needed
        the pair), on the fail-back thread: a probe waits for the peer's links thread, and two
        ends probing each other from their accepting threads would each wait for the other."""
        try:
            due = self.engine.links.reconnect_due()
        except RuntimeError:
            return
        for peer, rail in due:
            try:
                if peer in self.local_peers:
                    if peer < self.me or not self._connect(
                            peer, rail, self.engine.links.probe_timeout(peer, rail)):
                        self.engine.links.probe_failed(peer, rail)   # the lower rank re-connects
                else:
                    self._queue_failback(peer, rail)
            except RuntimeError:
                return                                     # the engine was closed
            except Exception as exc:                       # noqa: BLE001
                self._link_error("fail-back probe", peer, rail, exc)

    def _queue_failback(self, peer, rail):
        """Have the fail-back thread try (peer, rail) once (not twice at a time)."""
        with self._cv:
            if (peer, rail) in self._failing_back:
                return
            self._failing_back.add((peer, rail))
            self._failback_q.append((peer, rail))
            self._cv.notify_all()
            if self._failback_thread is None:
                self._failback_thread = threading.Thread(target=self._failback_loop, daemon=True,
                                                name="r2comm-failback")
                self._failback_thread.start()

    def _failback_loop(self):
        """The fail-back thread: one attempt at a time, from _failback_due's queue."""
        while not self._stop.is_set():
            with self._cv:
                if not self._failback_q:
                    self._cv.wait(0.1)
                    continue
                peer, rail = self._failback_q.popleft()
            try:
                idle = self._state(peer, rail) == "idle"     # (reconnect_idle)
                err = self._attempt(peer, rail, self.engine.links.probe_timeout(peer, rail))
                if err is not None and err is not BUSY and not self._up(peer, rail):
                    if idle:                      # from now on probed as one that failed
                        self.engine.links.mark_unconnected(
                            peer, rail, f"did not connect when its NIC came back: {err}")
                    else:
                        self.engine.links.probe_failed(peer, rail)
                # (BUSY: a connection for it is being made; the next due probe sees how it went)
            except RuntimeError:
                return                                     # the engine was closed
            except Exception as exc:                       # noqa: BLE001
                self._link_error("fail-back probe", peer, rail, exc)
            finally:
                with self._cv:
                    self._failing_back.discard((peer, rail))

    @property
    def alive(self):
        """The links thread is running (accepting, probing, delivering events)."""
        return self._thread.is_alive()

    def close(self):
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(2.0)
        if self._failback_thread is not None:
            self._failback_thread.join(2.0)
        for s in self.boot.listeners:
            s.close()


class _Pending:
    """One incoming handshake in progress: its state machine, listener, source address, the
    (peer, rail) it was admitted for, and whether its pair's cap was applied."""
    __slots__ = ("hs", "lindex", "src", "claim", "paired")

    def __init__(self, hs, lindex, src):
        self.hs, self.lindex, self.src = hs, lindex, src
        self.claim = None
        self.paired = False


def _parallel(jobs, attempt, wait_s):
    """Run attempt(peer, rail) for every (peer, rail) of `jobs` at once (CONNECT_THREADS
    threads); -> {(peer, rail): its result}, None for one still running after wait_s."""
    todo = collections.deque(jobs)
    out = {job: "still connecting" for job in jobs}
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                if not todo:
                    return
                job = todo.popleft()
            res = attempt(*job)
            with lock:
                out[job] = res
    workers = [threading.Thread(target=work, name="r2comm-connect", daemon=True)
               for _ in range(min(len(jobs), CONNECT_THREADS))]
    for w in workers:
        w.start()
    end = time.monotonic() + wait_s
    for w in workers:
        w.join(max(end - time.monotonic(), 0))
    with lock:
        return dict(out)
