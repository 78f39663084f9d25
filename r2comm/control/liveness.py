"""A failure detector that scales (issue 31): heartbeats on a ring, suspicion confirmed by a
second observer, the news spread to every rank in O(log n) rounds.

Ring. The live ranks form a ring in rank order; each rank opens one authenticated connection
(TCP.connect's handshake, the job secret, rail id RING) to its successor and accepts one from its
predecessor, on a listener of its own. Every `period` it sends a heartbeat on both: 2 frames per
rank per period and 5 sockets (listener, wake-up pair, two ring connections), whatever the
job's size. Each rank watches both neighbours:
any valid frame from a rank counts as hearing it.

Suspicion and confirmation (SWIM's indirect probe). A neighbour silent for `suspect` seconds,
or whose ring connection closed or refused, is suspected; the suspecter asks the suspect's other
ring neighbour (then the next live ranks, up to CONFIRMERS) to probe it on a fresh connection.
Only what the kernel says of the suspect is evidence of death: a refused connect, an
authenticated connection it reset or closed, or (a process on this host) its pid gone -> its
process is gone; no TCP answer within PROBE_S from another host -> its host or path is dead.
Anything else is inconclusive -> frozen: a handshake closed, reset or unanswered (a SIGSTOPped
process, a debugger, or a flood that holds its listener: nobody else can tell those apart), no
TCP answer on this host. A PONG -> alive (the suspecter's own link was slow: the suspicion is
dropped). A gone or unreachable rank is declared dead at once; a frozen one only once it has
been silent (no authenticated frame) for `frozen` seconds (README: a paused process is not a
dead one), then the same way. With two live ranks there is no second observer: the suspecter
probes itself.

Admission. The listener is public (any local user can connect to it), so it takes connections
under admission.Policy, like the links' listeners: a connection holds a slot only once its
HELLO carries a valid tag, anonymous ones are capped in all and per source address and the
oldest goes for a newcomer; established ones are capped by kind (MAX_RING, MAX_ONCE), refused
after the proof (the connector sees an inconclusive close, never a refusal).

Spread. The declarer sends the news (the whole dead list) along a halving tree over the live
ranks in ring order starting at itself: each receiver forwards to the middle of the ring segment
it is responsible for, keeps the first half, and so on: ceil(log2 n) rounds, at most that many
messages per rank per death, on short-lived authenticated connections (rail id ONCE). A target
that does not answer hands its segment to the next live rank in it. Heartbeats carry the dead
list's size and digest, so a rank that missed the tree (its sender died mid-way) gets the list
from a ring neighbour one period later. The ring is repaired around a dead rank (the next live
rank is connected), so a second failure is detected the same way. The ring view (neighbours,
the dead list's digest) is cached and recomputed only when the dead or departed ranks change,
so a pass of the ring thread costs the same at 64 ranks and at 8,192 (issue 39); observers and
the spread's targets are found in O(log n) (RingView). A rank that learns it was
itself declared dead (it resumed after a long stop) treats every other rank as lost: a fail-stop
model, as in ULFM.

Every new dead rank goes to on_dead(rank, reason, process) (the communicator passes the engine's
peer_dead: the same lost-peer path as when every rail to it failed). One daemon thread runs the
ring (selector, bounded timeouts); one more does the blocking client work (connect, confirm,
spread) from a queue. Nothing here runs on the data path. Frames: type, flags, length, counter,
payload, and a 16-byte HMAC-SHA256 tag under the connection's per-direction key (TCP.take_keys),
each counter used once in order; a bad frame closes its connection."""
import bisect
import collections
import hashlib
import hmac
import logging
import os
import queue
import selectors
import socket
import struct
import threading
import time
import zlib

from . import admission
from ..transport import CONTROL as TCP, LOCAL

log = logging.getLogger("r2comm")

RING = 0xFFFD        # rail id of a ring connection (HELLO)
ONCE = 0xFFFC        # rail id of a short-lived one (confirm, probe, spread)
HDR = struct.Struct("!BBHQ")             # type, flags, payload length, frame counter
TAG_LEN = 16
MAX_PAYLOAD = 0xFFFF                     # a dead list of up to 5,041 entries
HB = struct.Struct("!III")               # dead ranks known, digest of the list, of the facts
ENTRY = struct.Struct("!IBII")           # dead rank, cause, suspected by, confirmed by
SUSPECT = struct.Struct("!I")            # the suspect
VERDICT = struct.Struct("!IB")           # the suspect, verdict
END = struct.Struct("!I")                # the exclusive end (rank) of a spread segment
NOBODY = 0xFFFFFFFF

T_HB, T_DEADS, T_SUSPECT, T_VERDICT, T_PING, T_PONG, T_SPREAD, T_BYE = range(1, 9)
T_FACTS, T_SPREAD_FACTS = 9, 10          # the NIC facts (r2comm/control/facts.py), whole
ALIVE, GONE, UNREACHABLE, FROZEN = 0, 1, 2, 3
CAUSE_TEXT = {GONE: "its process is gone (connections refused or reset)",
              UNREACHABLE: "its host answers nothing (no TCP reply)",
              FROZEN: "its process is frozen (its kernel accepts connections, the process "
                      "answers nothing)"}
PROBE_S = 0.6          # one probe's connect, and then its handshake and PING, each at most
CONFIRMERS = 3         # second observers asked in turn (the first that answers decides)
HANDSHAKE_S = 2.0      # an incoming handshake's deadline
MAX_RING = 4           # ring connections held at once (the two neighbours, a repair's new one)
MAX_ONCE = 32          # short-lived ones (confirm, probe, spread) held at once
MAX_ASKS = 16          # others' suspicions waiting for a probe here (more: not answered)


# fds the detector holds once its ring is up: listener, wake-up pair, its selector's epoll fd and
# the connections to both ring neighbours (fds() counts all but the epoll fd)
STEADY_FDS = 6

class Settings:
    """The detector's timing (config.Config: R2COMM_LIVENESS_*), in seconds."""

    def __init__(self, period=0.2, suspect=2.0, frozen=60.0, probe=PROBE_S):
        if not (period > 0 and suspect > period and frozen >= 0 and probe > 0):
            raise ValueError(f"liveness settings: period {period}, suspect {suspect}, frozen "
                             f"{frozen}, probe {probe}: need 0 < period < suspect, frozen >= 0")
        self.period, self.suspect, self.frozen, self.probe = period, suspect, frozen, probe


class FrameError(Exception):
    """A frame that fails its checks (length, tag, counter, contents)."""


class Conn:
    """One authenticated connection: its socket, peer, kind and framing state."""

    def __init__(self, fd, peer, kind):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.tx_key, self.rx_key = TCP.take_keys(fd)
        self.peer, self.kind = peer, kind
        self.tx_ctr = self.rx_ctr = 0
        self.rbuf = bytearray()
        self.out = bytearray()
        self.lock = threading.Lock()
        self.job = None              # ONCE: the suspect this connection waits a verdict on

    def frame(self, ftype, payload=b""):
        """The bytes of one frame under this connection's next counter."""
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"a liveness frame of {len(payload)} bytes")
        head = HDR.pack(ftype, 0, len(payload), self.tx_ctr)
        self.tx_ctr += 1
        tag = hmac.new(self.tx_key, head + payload, hashlib.sha256).digest()[:TAG_LEN]
        return head + payload + tag

    def post(self, ftype, payload=b"", droppable=False):
        """Queue a frame and write what the socket takes; a heartbeat is dropped (False) while
        earlier bytes still wait (a peer that reads nothing)."""
        with self.lock:
            if droppable and self.out:
                return False
            self.out += self.frame(ftype, payload)
            self._flush()
            return True

    def flush(self):
        with self.lock:
            self._flush()

    def _flush(self):
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            del self.out[:n]

    def frames(self):
        """Read what arrived; yield the (type, payload) of every whole, valid frame. Raises
        EOFError at the end of the stream, FrameError for a bad frame, OSError."""
        while True:
            try:
                part = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            if not part:
                yield from self._parse()
                raise EOFError
            self.rbuf += part
            if len(part) < 65536:
                break
        yield from self._parse()

    def _parse(self):
        while len(self.rbuf) >= HDR.size:
            ftype, _flags, n, ctr = HDR.unpack_from(self.rbuf)
            if len(self.rbuf) < HDR.size + n + TAG_LEN:
                return
            head = bytes(self.rbuf[:HDR.size])
            payload = bytes(self.rbuf[HDR.size:HDR.size + n])
            tag = bytes(self.rbuf[HDR.size + n:HDR.size + n + TAG_LEN])
            want = hmac.new(self.rx_key, head + payload, hashlib.sha256).digest()[:TAG_LEN]
            if not hmac.compare_digest(tag, want):
                raise FrameError(f"rank {self.peer}: a liveness frame failed its tag")
            if ctr != self.rx_ctr:
                raise FrameError(f"rank {self.peer}: liveness frame {ctr} out of order")
            self.rx_ctr += 1
            del self.rbuf[:HDR.size + n + TAG_LEN]
            yield ftype, payload

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def encode_deads(deads):
    """The dead list as a payload: {rank: (cause, suspected by, confirmed by)}."""
    return b"".join(ENTRY.pack(r, c, s, v) for r, (c, s, v) in sorted(deads.items()))


def decode_deads(payload, size):
    """A received dead list, validated: {rank: (cause, suspected by, confirmed by)}."""
    if len(payload) % ENTRY.size:
        raise FrameError("a dead list of partial entries")
    out = {}
    for off in range(0, len(payload), ENTRY.size):
        r, c, s, v = ENTRY.unpack_from(payload, off)
        if not (r < size and c in CAUSE_TEXT and (s < size or s == NOBODY) and
                (v < size or v == NOBODY)):
            raise FrameError(f"a dead-list entry out of range ({r}, {c}, {s}, {v})")
        out[r] = (c, s, v)
    return out


def digest(deads):
    """A short digest of the set of dead ranks (heartbeats carry it)."""
    return zlib.crc32(b"".join(struct.pack("!I", r) for r in sorted(deads)))


def halving_targets(members):
    """The halving tree over `members` (live ranks after this one in ring order, the segment
    this rank spreads to): [(target index, exclusive end index)] in sending order."""
    out = []
    hi = len(members)
    while hi > 0:
        t = hi // 2
        out.append((t, hi))
        hi = t
    return out


def reason_text(rank, cause, suspecter, confirmer, silent=None):
    """The message the engine's errors carry for a rank the detector declared dead."""
    who = f"suspected by rank {suspecter}" if suspecter != NOBODY else "suspected"
    if confirmer != NOBODY and confirmer != suspecter:
        who += f", confirmed by rank {confirmer}"
    quiet = f", silent for {silent:.1f} s" if silent is not None else ""
    return (f"rank {rank} is dead (failure detector: {CAUSE_TEXT[cause]}{quiet}; {who})")


class RingView:
    """The live ranks of a ring of `size` in rank order, given the ranks that are out (dead or
    departed): neighbours, counts and the k-th live rank after a rank in O(log n) each."""

    def __init__(self, size, out=()):
        self.size = size
        self.out = frozenset(out)
        self._sorted = sorted(self.out)

    def _out_within(self, a, m):
        """Out ranks at ring offsets 1..m after a."""
        if m <= 0:
            return 0
        lo, hi, n, srt = a + 1, a + m, self.size, self._sorted
        if hi < n:
            return bisect.bisect_right(srt, hi) - bisect.bisect_left(srt, lo)
        return len(srt) - bisect.bisect_left(srt, lo) + bisect.bisect_right(srt, hi - n)

    def count(self, a, b):
        """Live ranks after a and before b in ring order (b == a: all but a)."""
        m = ((b - a) % self.size or self.size) - 1
        return m - self._out_within(a, m)

    def nth(self, a, k):
        """The k-th (from 0) live rank after a in ring order; None if there are fewer."""
        lo, hi = 1, self.size - 1
        if hi - self._out_within(a, hi) <= k:
            return None
        while lo < hi:                         # the least offset with k + 1 live ranks up to it
            mid = (lo + hi) // 2
            if mid - self._out_within(a, mid) > k:
                hi = mid
            else:
                lo = mid + 1
        return (a + lo) % self.size

    def walk(self, a, step):
        """The live ranks from a (not a itself) in ring order (step 1) or backwards (-1)."""
        r = a
        for _ in range(self.size - 1):
            r = (r + step) % self.size
            if r not in self.out:
                yield r

    def neighbours(self, a):
        """(predecessor, successor) of a among the live ranks (None, None: a is alone)."""
        succ = next(self.walk(a, 1), None)
        if succ is None or succ == a:
            return None, None
        return next(self.walk(a, -1)), succ


class Detector:
    """The ring failure detector of one rank (see the module's docstring)."""

    def __init__(self, rank, size, secret, listener, addrs, settings, on_dead=None, pids=None,
                 facts=None):
        self.me, self.size = rank, size
        self.facts = facts                   # the NIC facts it spreads (facts.FactBook), or None
        self.secret = secret
        self.listener = listener
        self.addrs = addrs                   # per rank: (address, port) of its listener
        self.pids = dict(pids or {})         # rank -> pid, of ranks this kernel shows (this host)
        self.s = settings
        self.on_dead = on_dead
        self.admission = admission.Policy()  # which pending handshakes a flood may close
        self.deads = {}                      # rank -> (cause, suspected by, confirmed by)
        self.dead_at = {}                    # rank -> time.time() this rank learned it
        self.left = set()                    # ranks that closed their detector (BYE)
        self.excluded = False                # this rank was declared dead by the others
        self.sent = collections.Counter()    # frames sent, by type name (tests, stats)
        self.refuted = 0                     # suspicions a second observer refuted
        self.started = time.monotonic()
        self._heard = {}                     # rank -> monotonic time of its last valid frame
        self._gone = set()                   # neighbours whose ring connection closed
        self._checking = {}                  # suspect -> monotonic start of its check
        self._next_check = {}                # suspect -> no new check before this time
        self._frozen_since = {}              # suspect -> monotonic time its silence began
        self._ring = {}                      # fd -> Conn (ring connections)
        self._once = {}                      # fd -> Conn (short-lived, accepted)
        self._pending = {}                   # fd -> TCP.ServerHandshake
        self._paired = set()                 # of which fds whose pair's cap was applied
        self._view = RingView(size)          # the live ranks (recomputed when deads/left change)
        self._nbrs_now = self._view.neighbours(rank)
        self._digest = digest({})            # of the dead list (heartbeats carry it)
        self._connecting = None              # successor being connected by the worker
        self._succ_conn = None
        self._nbrs = None                    # (pred, succ) last seen by _watch
        self._synced = {}                    # fd -> monotonic time a dead list was last sent
        self._facts_synced = {}              # fd -> ... and the facts
        self._jobs = queue.Queue()           # worker jobs: (function, args)
        self._asks = queue.Queue(MAX_ASKS)   # others' suspicions to probe (second worker)
        self._done = collections.deque()     # worker results: callables run on the ring thread
        self._handed = set()                 # ring fds the worker dialed, not yet adopted or
        self._handed_lock = threading.Lock()  # closed by the ring thread (close() closes them)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._lock = threading.Lock()        # deads / dead_at / left, read by other threads
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name="r2comm-liveness", daemon=True)
        self._worker = threading.Thread(target=self._work, args=(self._jobs,),
                                        name="r2comm-liveness-io", daemon=True)
        # a second observer's probes run apart from this rank's own checks: two ranks that
        # suspect the same rank ask each other, and must not wait on each other's worker
        self._prober = threading.Thread(target=self._work, args=(self._asks,),
                                        name="r2comm-liveness-probe", daemon=True)

    # -- public ---------------------------------------------------------------------------------
    def start(self):
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        self._worker.start()
        self._prober.start()

    def dead(self):
        """{rank: time.time() this rank learned that it is dead}."""
        with self._lock:
            return dict(self.dead_at)

    def neighbours(self):
        """(predecessor, successor) among the live ranks in this rank's view (None: alone)."""
        return self._nbrs_now

    def share_facts(self):
        """Spread this rank's NIC facts to every live rank (the halving tree, as a death's
        news; heartbeat digests repair what a spread missed)."""
        if self.facts is not None and not self._stop.is_set():
            self._jobs.put((self._spread, (self.me, T_SPREAD_FACTS)))

    def fds(self):
        """Sockets this detector holds now (listener, wake pair and connections)."""
        return 3 + len(self._ring) + len(self._once) + len(self._pending)

    def close(self):
        """Say goodbye to the ring neighbours (they repair the ring, nobody is declared dead),
        stop both threads, close every socket."""
        if self._stop.is_set():
            return
        self._call(self._say_bye)
        deadline = time.monotonic() + 1.0
        while self._thread.is_alive() and not self._bye_sent and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self._jobs.put(None)
        try:
            self._asks.put_nowait(None)
        except queue.Full:
            pass
        self._poke()
        self._thread.join(2.0)
        self._worker.join(2.0)
        self._prober.join(2.0)
        for c in list(self._ring.values()) + list(self._once.values()):
            c.close()
        for hs in self._pending.values():
            hs.close()
        with self._handed_lock:              # dialed while closing, never adopted (a socket
            for fd in self._handed:          # left in CLOSE_WAIT per lost hand-over)
                os.close(fd)
            self._handed.clear()
        self._sel.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    _bye_sent = False

    # -- the ring view ---------------------------------------------------------------------------
    def _out(self, r):
        return r in self.deads or r in self.left

    def _reviewed(self):
        """The dead or departed ranks changed: recompute the ring view, neighbours and digest
        (the only O(n) work, once per change)."""
        with self._lock:
            out = set(self.deads) | self.left
            self._digest = digest(self.deads)
        self._view = RingView(self.size, out)
        self._nbrs_now = self._view.neighbours(self.me)

    def _succ(self):
        return self._nbrs_now[1]

    def _other_observers(self, q):
        """Who may confirm a suspicion of q: its other ring neighbour, then the next live
        ranks (never q, never this rank), CONFIRMERS at most; walks only as far as those."""
        step = 1 if self._succ() == q else -1  # q's other neighbour is after it / before it
        out = []
        for r in self._view.walk(q, step):
            if r != self.me and r != q:
                out.append(r)
                if len(out) == CONFIRMERS:
                    break
        return out

    # -- the ring thread -------------------------------------------------------------------------
    def _serve(self):
        next_hb = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = max(0.0, min(next_hb - now, self.s.period / 2))
                # handshakes first: a HELLO that arrived takes its connection out of a flood's
                # reach before the listener's newcomers make room
                for key, _ in sorted(self._sel.select(wait), key=lambda kv: kv[0].data == "listen"):
                    self._ready(key)
                while self._done:
                    self._done.popleft()()
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self.s.period
                    self._beat(now)
                self._expire(now)
                if not self.excluded:
                    self._keep_ring(now)
                    self._watch(now)
        except Exception:                      # noqa: BLE001 (logged; the detector stops)
            if not self._stop.is_set():
                log.exception("r2comm rank %d: the failure detector stopped", self.me)

    def _ready(self, key):
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            try:
                self._wake_r.recv(4096)
            except OSError:
                pass
        elif key.data == "hs":
            self._step(key.fd)
        else:
            self._read(key.data)

    def _accept(self):
        for _ in range(32):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            victims, room = self.admission.room(self._pending, addr[0])
            for fd, _why in victims:
                self._pending[fd].close()
                self._drop_pending(fd)
            if not room:
                sock.close()
                continue
            hs = TCP.ServerHandshake(sock, addr, self.secret, self.me,
                                     time.monotonic() + HANDSHAKE_S, 0, self._admit,
                                     check=self._wanted)
            self._pending[sock.fileno()] = hs
            self._sel.register(sock.fileno(), selectors.EVENT_READ, "hs")
            self._step(sock.fileno())

    def _wanted(self, peer, rail):
        """A HELLO from rank `peer` for `rail` may go on (before the proof: no effect)."""
        return 0 <= peer < self.size and peer != self.me and rail in (RING, ONCE)

    def _admit(self, peer, rail):
        """The connector proved the secret: room for one more connection of its kind?"""
        held = len(self._ring) < MAX_RING if rail == RING else len(self._once) < MAX_ONCE
        return self._wanted(peer, rail) and held

    def _step(self, fd, now=None):
        hs = self._pending.get(fd)
        if hs is None:
            return
        try:
            res = hs.step(now)
        except (OSError, TCP.HandshakeError):
            self._drop_pending(fd)
            hs.close()
            return
        if res is None:
            if hs.got_hello and fd not in self._paired:    # the newest of its pair stay
                self._paired.add(fd)
                for old in self.admission.pair_excess(self._pending, fd):
                    self._pending[old].close()
                    self._drop_pending(old)
            return
        self._drop_pending(fd)
        peer, rail, cfd, _conn_id = res
        conn = Conn(cfd, peer, "ring" if rail == RING else "once")
        (self._ring if rail == RING else self._once)[cfd] = conn
        self._sel.register(cfd, selectors.EVENT_READ, conn)
        if self._out(peer) and peer in self.deads:
            self._tell_dead(conn)

    def _drop_pending(self, fd):
        del self._pending[fd]
        self._paired.discard(fd)
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _expire(self, now):
        for fd in [fd for fd, hs in self._pending.items() if now >= hs.deadline]:
            self._step(fd, now)

    def _drop(self, conn, evidence=True):
        """Close a connection; a ring neighbour's closing is evidence against it."""
        fd = conn.sock.fileno()
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        self._ring.pop(fd, None)
        self._once.pop(fd, None)
        self._synced.pop(fd, None)
        if conn is self._succ_conn:
            self._succ_conn = None
        conn.close()
        if evidence and conn.kind == "ring" and not self._out(conn.peer) and \
                conn.peer in self.neighbours():
            self._gone.add(conn.peer)

    def _read(self, conn):
        try:
            for ftype, payload in conn.frames():
                self._heard[conn.peer] = time.monotonic()
                self._gone.discard(conn.peer)
                self._on_frame(conn, ftype, payload)
                if conn.sock.fileno() < 0:
                    return
        except (EOFError, OSError):
            self._drop(conn)
        except FrameError as exc:
            log.warning("r2comm rank %d: %s; connection closed", self.me, exc)
            self._drop(conn)
        else:
            conn.flush()

    def _on_frame(self, conn, ftype, payload):
        if conn.peer in self.deads:            # a rank declared dead speaks: it is told so
            self._tell_dead(conn)
            return
        if ftype == T_HB:
            if len(payload) != HB.size:
                raise FrameError("a heartbeat of the wrong size")
            n, dig, fdig = HB.unpack(payload)
            if dig != self._digest:
                self._sync(conn)
            if self.facts is not None and fdig != self._facts_digest():
                self._sync_facts(conn)
        elif ftype == T_DEADS:
            self._merge(decode_deads(payload, self.size))
        elif ftype == T_FACTS:
            self._merge_facts(payload)
        elif ftype in (T_SPREAD, T_SPREAD_FACTS):
            if len(payload) < END.size:
                raise FrameError("a spread frame without its segment")
            (end,) = END.unpack_from(payload)
            if end >= self.size:
                raise FrameError("a spread segment out of range")
            if ftype == T_SPREAD:
                self._merge(decode_deads(payload[END.size:], self.size))
            else:
                self._merge_facts(payload[END.size:])
            self._drop(conn, evidence=False)
            self._jobs.put((self._spread, (end, ftype)))
        elif ftype == T_SUSPECT:
            (q,) = SUSPECT.unpack(payload) if len(payload) == SUSPECT.size else (self.size,)
            if q >= self.size or q == self.me or conn.job is not None:
                raise FrameError("a bad suspicion")
            conn.job = q
            try:
                self._asks.put_nowait((self._confirm_for, (conn, q)))
            except queue.Full:                 # (the asker turns to another observer)
                self._drop(conn, evidence=False)
        elif ftype == T_PING:
            conn.post(T_PONG)
        elif ftype == T_BYE:
            if conn.peer not in self.left:
                with self._lock:
                    self.left.add(conn.peer)
                self._reviewed()
            self._drop(conn, evidence=False)
        else:
            raise FrameError(f"unexpected liveness frame type {ftype}")

    def _tell_dead(self, conn):
        try:
            conn.post(T_DEADS, encode_deads(self.deads))
        except OSError:
            pass
        self._drop(conn, evidence=False)

    def _sync(self, conn):
        """Send the dead list to a neighbour whose digest differs (once a period at most)."""
        fd = conn.sock.fileno()
        now = time.monotonic()
        if now - self._synced.get(fd, 0.0) >= self.s.period and self.deads:
            self._synced[fd] = now
            with self._lock:
                payload = encode_deads(self.deads)
            conn.post(T_DEADS, payload)
            self.sent["deads"] += 1

    def _facts_digest(self):
        return self.facts.digest() & 0xFFFFFFFF if self.facts is not None else 0

    def _merge_facts(self, payload):
        """Take a received facts table (validated by the book; a bad one closes the frame's
        connection like any bad frame)."""
        if self.facts is None:
            return
        try:
            self.facts.merge(self.facts.decode(payload))
        except ValueError as exc:             # (facts.FactError)
            raise FrameError(f"a bad facts table: {exc}") from None

    def _sync_facts(self, conn):
        """Send the facts to a neighbour whose digest differs (once a period at most)."""
        fd = conn.sock.fileno()
        now = time.monotonic()
        if now - self._facts_synced.get(fd, 0.0) >= self.s.period:
            self._facts_synced[fd] = now
            conn.post(T_FACTS, self.facts.encode())
            self.sent["facts"] += 1

    def heartbeat_peers(self):
        """The ranks this one sends its heartbeats to: its ring neighbours."""
        return set(self.neighbours())

    def _beat(self, now):
        if self.excluded:
            return
        beat_to = self.heartbeat_peers()
        payload = HB.pack(len(self.deads), self._digest, self._facts_digest())
        for conn in list(self._ring.values()):
            if conn.peer in beat_to:
                try:
                    if conn.post(T_HB, payload, droppable=True):
                        self.sent["hb"] += 1
                except OSError:
                    self._drop(conn)

    def _keep_ring(self, now):
        """Hold a connection to the successor; close ring connections to ranks that are out."""
        succ = self._succ()
        for conn in list(self._ring.values()):
            if self._out(conn.peer):
                self._drop(conn, evidence=False)
        if self._succ_conn is not None and self._succ_conn.peer != succ:
            self._drop(self._succ_conn, evidence=False)
        if succ is None or self._succ_conn is not None or self._connecting is not None:
            return
        if succ in self._checking or now < self._next_check.get(("connect", succ), 0):
            return
        self._connecting = succ
        self._jobs.put((self._connect_ring, (succ,)))

    def _watch(self, now):
        """Suspect a silent (or closed) neighbour and have a second observer check it."""
        nbrs = self.neighbours()
        if nbrs != self._nbrs:                 # a new neighbour gets a whole suspect period
            grace = now + (self.s.suspect if self._nbrs is None else 0.0)   # (start-up: two)
            for q in nbrs:
                if q is not None and (self._nbrs is None or q not in self._nbrs):
                    self._heard[q] = max(self._heard.get(q, 0.0), grace)
            self._nbrs = nbrs
        for q in set(nbrs):
            if q is None or q in self._checking or now < self._next_check.get(q, 0):
                continue
            heard = self._heard.get(q, now)
            if q in self._gone or now - heard > self.s.suspect:
                self._checking[q] = now
                self.sent["suspect"] += 1
                self._jobs.put((self._check, (q, now - heard)))

    # -- results from the worker (run on the ring thread) ---------------------------------------
    def _ring_connected(self, q, fd, refused=False):
        self._connecting = None
        if fd is not None:
            with self._handed_lock:
                if fd not in self._handed:       # close() closed it already
                    return
                self._handed.discard(fd)
        if fd is None:
            if refused:
                self._gone.add(q)
            self._next_check[("connect", q)] = time.monotonic() + self.s.period
            return
        conn = Conn(fd, q, "ring")
        if self._out(q) or self._stop.is_set() or q != self._succ():
            conn.close()
            return
        self._ring[fd] = conn
        self._succ_conn = conn
        self._sel.register(fd, selectors.EVENT_READ, conn)
        self._gone.discard(q)

    def _checked(self, q, verdict, confirmer, silent):
        """A suspicion of q came back with the second observer's verdict."""
        self._checking.pop(q, None)
        now = time.monotonic()
        if self._out(q):
            return
        if verdict is None:                       # nobody could confirm: ask again later
            self._next_check[q] = now + self.s.period
            return
        if verdict == ALIVE:
            self.refuted += 1
            self._heard[q] = now
            self._gone.discard(q)
            self._frozen_since.pop(q, None)
            if self._succ_conn is not None and self._succ_conn.peer == q:
                self._drop(self._succ_conn, evidence=False)   # re-connect the slow link
            return
        if verdict == FROZEN:
            since = self._frozen_since.setdefault(q, now - silent)
            if now - since < self.s.frozen:
                self._next_check[q] = now + min(self.s.suspect / 2, self.s.frozen - (now - since))
                return
        self._merge({q: (verdict, self.me, confirmer)}, silent=silent, origin=True)

    def _merge(self, news, silent=None, origin=False):
        """Take dead ranks learned from a frame (or declared here): tell the engine, repair the
        ring; a declarer spreads the news."""
        fresh = {r: v for r, v in news.items() if r not in self.deads}
        if not fresh:
            return
        t = time.time()
        with self._lock:
            self.deads.update(fresh)
            for r in fresh:
                self.dead_at[r] = t
        self._reviewed()
        for r, (cause, sus, conf) in sorted(fresh.items()):
            if r == self.me:
                continue
            self._notify(r, reason_text(r, cause, sus, conf,
                                        silent if origin and cause == FROZEN else None),
                         cause != UNREACHABLE)
        if self.me in fresh:
            self._excluded(fresh[self.me])
            return
        if origin:
            self._jobs.put((self._spread, (self.me,)))

    def _excluded(self, why):
        """The others declared this rank dead: every other rank is lost to it (fail-stop)."""
        self.excluded = True
        cause, sus, conf = why
        text = (f"this rank ({self.me}) was declared dead by the failure detector of the "
                f"others ({CAUSE_TEXT[cause]}; suspected by rank {sus}, confirmed by rank "
                f"{conf}): it can no longer reach any rank")
        for r in range(self.size):
            if r != self.me and r not in self.deads:
                self._notify(r, text, True)
        for conn in list(self._ring.values()):
            self._drop(conn, evidence=False)

    def _notify(self, r, reason, process):
        if self.on_dead is None:
            return
        try:
            self.on_dead(r, reason, process)
        except RuntimeError:                   # the engine is closed
            pass
        except Exception:                      # noqa: BLE001
            log.exception("r2comm rank %d: failure detector callback", self.me)

    def _say_bye(self):
        for conn in list(self._ring.values()):
            try:
                conn.post(T_BYE)
            except OSError:
                pass
        self._bye_sent = True

    # -- the worker (blocking client work) ------------------------------------------------------
    def _call(self, fn, *args):
        """Run fn(*args) on the ring thread soon."""
        self._done.append(lambda: fn(*args))
        self._poke()

    def _poke(self):
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _work(self, jobs):
        while not self._stop.is_set():
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:                  # noqa: BLE001
                if not self._stop.is_set():
                    log.exception("r2comm rank %d: failure detector job", self.me)

    def _dial(self, q, rail, timeout):
        """An authenticated connection to q's detector: a Conn, or the OSError / HandshakeError."""
        addr, port = self.addrs[q]
        fd, _cid = TCP.connect(addr, port, None, self.secret, self.me, q, rail, timeout, 0)
        return Conn(fd, q, "ring" if rail == RING else "once")

    def _connect_ring(self, q):
        """Connect the successor q; a refused connect is evidence against it, a handshake that
        closed or reset is not (a flood can do that)."""
        refused = False
        try:
            fd, _cid = TCP.connect(self.addrs[q][0], self.addrs[q][1], None, self.secret,
                                   self.me, q, RING, self.s.probe, 0)
        except ConnectionRefusedError:
            fd, refused = None, True
        except (OSError, TCP.HandshakeError):
            fd = None
        if fd is not None:
            with self._handed_lock:
                if self._stop.is_set():              # closing: nobody would adopt it
                    os.close(fd)
                    return
                self._handed.add(fd)
        self._call(self._ring_connected, q, fd, refused)

    def _check(self, q, silent):
        """Have a second observer probe suspect q; the verdict goes back to the ring thread."""
        verdict, confirmer = None, NOBODY
        observers = self._other_observers(q)
        if not observers:                          # two live ranks: nobody else to ask
            verdict, confirmer = self.probe(q), self.me
        for c in observers:
            try:
                verdict = self._ask(c, q)
            except (OSError, TCP.HandshakeError, FrameError, EOFError):
                continue
            confirmer = c
            break
        if verdict is None and observers and self.probe(q) == GONE:
            # no observer answers (several died at once): the kernel's refusal alone is
            # evidence enough; silence is not (this rank may be the one cut off)
            verdict, confirmer = GONE, self.me
        self._call(self._checked, q, verdict, confirmer, silent)

    def _ask(self, c, q):
        """Ask observer c for its verdict on q (it probes q itself)."""
        conn = self._dial(c, ONCE, self.s.probe)
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(3 * self.s.probe + 0.5)
            conn.sock.sendall(conn.frame(T_SUSPECT, SUSPECT.pack(q)))
            self.sent["confirm"] += 1
            for ftype, payload in self._blocking_frames(conn):
                if ftype == T_VERDICT and len(payload) == VERDICT.size:
                    r, verdict = VERDICT.unpack(payload)
                    if r == q and verdict in (ALIVE, GONE, UNREACHABLE, FROZEN):
                        return verdict
                if ftype == T_DEADS:
                    self._call(self._merge, decode_deads(payload, self.size))
                raise FrameError("no verdict")
            raise EOFError
        finally:
            conn.close()

    @staticmethod
    def _blocking_frames(conn):
        while True:
            part = conn.sock.recv(65536)
            if not part:
                return
            conn.rbuf += part
            yield from conn._parse()

    def _confirm_for(self, conn, q):
        """Another rank suspects q: probe it and answer with the verdict."""
        verdict = GONE if q in self.deads else self.probe(q)
        self.sent["probe"] += 1

        def answer():
            if conn.sock.fileno() >= 0:
                try:
                    conn.post(T_VERDICT, VERDICT.pack(q, verdict))
                except OSError:
                    self._drop(conn, evidence=False)
        self._call(answer)

    def probe(self, q):
        """Probe q's detector directly: ALIVE (it answered a PING), GONE (its pid gone from this
        host, a refused connect, or it reset or closed the authenticated connection),
        UNREACHABLE (no TCP answer from another host) or FROZEN (inconclusive: its kernel
        accepted and the handshake or PING went unanswered, closed or reset, or no TCP answer
        on this host)."""
        if self._process_gone(q):
            return GONE
        addr, port = self.addrs[q]
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw.settimeout(self.s.probe)
        try:
            raw.connect((addr, port))              # the kernel's answer alone
        except ConnectionRefusedError:
            return GONE
        except OSError:                            # (on this host: a full backlog, a flood's)
            return FROZEN if q in self.pids else UNREACHABLE
        finally:
            raw.close()
        try:
            conn = self._dial(q, ONCE, self.s.probe)
        except ConnectionRefusedError:
            return GONE
        except (OSError, TCP.HandshakeError):
            return FROZEN
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(self.s.probe)
            conn.sock.sendall(conn.frame(T_PING))
            for ftype, _payload in self._blocking_frames(conn):
                return ALIVE if ftype == T_PONG else FROZEN
            return GONE                            # it closed an authenticated connection
        except ConnectionResetError:
            return GONE
        except (OSError, FrameError):
            return FROZEN
        finally:
            conn.close()

    def _process_gone(self, q):
        """q runs on this host (its pid known) and no process has that pid any more."""
        pid = self.pids.get(q)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:                            # another user's process: it exists
            return False
        return False

    def _spread(self, end, ftype=T_SPREAD):
        """Send the dead list (T_SPREAD) or the facts (T_SPREAD_FACTS) down the halving tree
        over this rank's segment (live ranks after it, before `end`); a target that does not
        answer hands its part to the next."""
        with self._lock:
            payload = encode_deads(self.deads) if ftype == T_SPREAD else self.facts.encode()
        view = self._view
        m = view.count(self.me, end)           # live ranks of the segment, none listed
        for t, hi in halving_targets(range(m)):
            stop = view.nth(self.me, hi) if hi < m else end
            for k in range(t, hi):
                try:
                    conn = self._dial(view.nth(self.me, k), ONCE, self.s.probe)
                except (OSError, TCP.HandshakeError):
                    continue
                try:
                    conn.sock.setblocking(True)
                    conn.sock.settimeout(self.s.probe)
                    conn.sock.sendall(conn.frame(ftype, END.pack(stop) + payload))
                    self.sent["spread" if ftype == T_SPREAD else "spread_facts"] += 1
                except OSError:
                    continue
                finally:
                    conn.close()
                break


def listener(addr):
    """The detector's listening socket on control address `addr` (bootstrap opens it, so that
    its address travels in the endpoint records)."""
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((addr, 0))
        lst.listen(1024)       # a frozen rank's kernel queues the probes it does not accept
    except BaseException:
        lst.close()
        raise
    return lst


def start(engine, boot, cfg, facts=None):
    """The communicator's detector (None when R2COMM_LIVENESS=0 or one rank) on the listener
    bootstrap opened (boot.detector), every rank's address from the endpoint records, every new
    dead rank handed to engine.links.peer_dead; it spreads the NIC facts of `facts` (a FactBook)."""
    if boot.detector is None:
        return None
    try:
        addrs = [_addr(ep.get("detector"), r) for r, ep in enumerate(boot.endpoints)]
    except BaseException:
        boot.detector.close()
        raise
    pids = {r: ep["pid"] for r, ep in enumerate(boot.endpoints)
            if LOCAL.is_local(boot.endpoints, boot.rank, r)}   # same host, same pid namespace
    det = Detector(boot.rank, boot.size, boot.secret, boot.detector, addrs,
                   Settings(cfg.liveness_period_ms / 1e3, cfg.liveness_suspect_ms / 1e3,
                            cfg.liveness_frozen_ms / 1e3),
                   on_dead=engine.links.peer_dead, pids=pids, facts=facts)
    det.start()
    return det


def _addr(a, r):
    """One rank's (IPv4 address, port), validated."""
    if not (isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str) and
            isinstance(a[1], int) and 0 < a[1] < 65536):
        raise ValueError(f"liveness: rank {r}'s address is not (IPv4 address, port)")
    try:
        socket.inet_pton(socket.AF_INET, a[0])      # dotted-quad IPv4 only
    except OSError:
        raise ValueError(f"liveness: rank {r}'s address {a[0][:64]!r} is not IPv4") from None
    return (a[0], a[1])
