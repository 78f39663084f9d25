"""Lose a rank, not the job (issue 44): ULFM's Revoke, Agree and Shrink over r2comm's own
engine, with no MPI after bootstrap.

Revoke. The engine keeps a revoked flag per communicator id (failover.pxi revoke_comm): every
active operation of that id fails with R2commRevokedError, every later post fails at once, and
the revocation travels as an ABORT frame with code E_REVOKED to every peer the rank holds a
working connection to, each of which passes it on once (O(connections) frames per rank, like
an abort). The revoking rank first connects its live ring neighbours in the communicator, so
the news has a path around the dead ranks.

Agree (agree()). A fault-tolerant, uniform agreement on (AND of the flags, MAX of an auxiliary
integer, one set of failed ranks), run on a twin of the communicator of its own
(CommIds.ft: it still works once the communicator is revoked) with point-to-point messages.
Failures come from the failure detector (control/liveness.py: confirmed deaths, a fail-stop
model), never from a timeout guess. It is a Paxos whose ballots are the known-failed sets:

- Attempt K (this rank's known-failed set; K only grows): the live ranks L = members \\ K in
  rank order form a binary tree (position i: parent (i-1)//2, children 2i+1, 2i+2), rooted at
  the lowest live rank, the coordinator. depth log2(|L|); at most 3 peers per rank per attempt.
- UP: a rank waits for REPORTs of its children (each: the subtree's AND, MAX and the accepted
  proposal of highest ballot |K_b|), then reports to its parent. PROPOSE: the coordinator picks
  the accepted value of highest ballot if any, else (AND, MAX, K), and sends it down; a rank
  accepts a proposal only of its current attempt. ACK: up again once the subtree accepted.
  DECIDE: the coordinator decides once every live rank accepted, and the decision goes down.
  4·log2 n message delays when nothing fails.
- A message naming more failed ranks makes the receiver adopt them (the union) and restart; a
  message of an older attempt is answered with UPDATE (the newer set). A rank that decided
  sends DECIDE to its tree neighbours and keeps answering every message of that agreement with
  DECIDE (a responder thread), until its next agreement on the communicator decides or
  RESPONDER_S pass, so a rank still undecided learns the decision from a rank that returned.
Why it is uniform (no two ranks ever decide differently, also when ranks die during it):
attempts that reach PROPOSE are ordered by inclusion (if x is in K1 \\ K2 and y in K2 \\ K1, x
reported in attempt K2 after y's death and y in K1 after x's: impossible, since a failed rank
is dead), so |K| orders them as Paxos ballots. A value decided in attempt K was accepted by
every rank of L(K); a later attempt K' ⊃ K gathers a report from every rank of L(K') ⊆ L(K),
each of which accepted (K, v) before it moved on (it accepts nothing of an attempt it left), so
the coordinator of K' proposes v again (the highest ballot, by induction). A rank decides only
a value that was decided. See tests/test_shrink.py for the protocol run without processes
against random crashes (Agreement is a pure state machine; agree() is its driver).

Every function here takes a communicator's Channel (channel.py; Communicator passes its own):
a control-layer module sees no mpi4py face. shrink() returns the new Channel, which the
Communicator wraps.

Shrink (shrink()). An agreement with flag 1 and, as MAX, every survivor's next free
communicator id (CommIds): the new communicator holds the members not in the agreed failed set,
in rank order, with id CommIds.shrunk(that maximum) (the same on every survivor), on the same
world (engine, connections, shared-memory segments, rails); its plans are made afresh."""
import struct
import threading
import time
import weakref

import numpy as np

from ..errors import R2commArgumentError, R2commError, R2commNetworkError, R2commTimeout

AGREE_TAG = 0x61000000           # tags of the agreements: AGREE_TAG | call number mod 2**24
CALL_MASK = (1 << 24) - 1
RESPONDER_S = 60.0               # a decided rank answers late messages this long at most
POLL_S = (0.0002, 0.002)         # the driver's poll interval (grows from the first to the last)
RESPONDER_POLL_S = 0.02         # ... and the responder's, once idle
FAILED_POLL_S = 0.005            # how often the driver asks the failure detector

QUERY, REPORT, PROPOSE, ACK, DECIDE, UPDATE = range(1, 7)
KIND_NAMES = {QUERY: "QUERY", REPORT: "REPORT", PROPOSE: "PROPOSE", ACK: "ACK",
              DECIDE: "DECIDE", UPDATE: "UPDATE"}
MAGIC = 0x52324654               # "R2FT"
# magic, kind, has accepted, bad (OR: a rank's flag was no 64-bit int), the value's bad, call
# number, n, flag (AND), aux (MAX), accepted ballot, value flag, value aux; then two bitmaps of
# n bits: K, the value's failed set
HDR = struct.Struct("!IBBBBIIqqIqq")
INT64 = (-(1 << 63), 1 << 63)


def bitmap(ranks, n):
    """The n-bit bitmap (bytes) of a set of ranks."""
    bits = np.zeros(n, np.uint8)
    if ranks:
        bits[sorted(ranks)] = 1
    return np.packbits(bits).tobytes()


def unbitmap(data, n):
    """The set of ranks of an n-bit bitmap; ValueError where bits beyond n are set."""
    bits = np.unpackbits(np.frombuffer(data, np.uint8))
    if bits[n:].any():
        raise ValueError("bits set beyond the communicator's size")
    return frozenset(np.flatnonzero(bits[:n]).tolist())


def msg_size(n):
    return HDR.size + 2 * ((n + 7) // 8)


class Msg:
    """One agreement message, decoded and validated (decode) or to be encoded (encode)."""
    __slots__ = ("kind", "call", "K", "flag", "aux", "bad", "acc")

    def __init__(self, kind, call, K, flag=0, aux=0, acc=None, bad=False):
        self.kind, self.call, self.K = kind, call, frozenset(K)
        self.flag, self.aux, self.bad = flag, aux, bool(bad)
        self.acc = acc       # None or (ballot, (vflag, vaux, vfailed frozenset, vbad))

    def encode(self, n):
        ballot, (vf, va, vfail, vbad) = self.acc if self.acc is not None else \
            (0, (0, 0, (), False))
        return HDR.pack(MAGIC, self.kind, self.acc is not None, self.bad, bool(vbad),
                        self.call & 0xFFFFFFFF, n, self.flag, self.aux, ballot, vf, va) + \
            bitmap(self.K, n) + bitmap(vfail, n)

    @classmethod
    def decode(cls, data, n, call):
        """The message in `data` of agreement `call` over n ranks; ValueError where anything
        is off (length, magic, kind, size, call, ballot, bitmaps)."""
        if len(data) != msg_size(n):
            raise ValueError(f"{len(data)} bytes, not {msg_size(n)}")
        magic, kind, has, bad, vbad, c, nn, flag, aux, ballot, vf, va = HDR.unpack_from(data)
        if magic != MAGIC or kind not in KIND_NAMES or nn != n or \
                not {has, bad, vbad} <= {0, 1}:
            raise ValueError("bad header")
        if c != call & 0xFFFFFFFF:
            raise ValueError(f"agreement {c}, not {call & 0xFFFFFFFF}")
        nb = (n + 7) // 8
        K = unbitmap(data[HDR.size:HDR.size + nb], n)
        vfail = unbitmap(data[HDR.size + nb:], n)
        if has and not 0 < ballot <= n + 1:
            raise ValueError("bad ballot")
        return cls(kind, call, K, flag, aux,
                   (ballot, (vf, va, vfail, bool(vbad))) if has else None, bool(bad))


def _better(a, b):
    """The accepted proposal of higher ballot of a and b (either may be None)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a[0] >= b[0] else b


class Agreement:
    """One rank's state in one agreement (module doc): a pure state machine. Its inputs are
    start(), failed(ranks) and receive(src, Msg); each returns the messages to send, as
    (destination rank, Msg). `decided` is None until it holds (flag, aux, failed frozenset,
    bad: some rank passed a bad flag)."""

    def __init__(self, n, me, flag, aux=0, failed=(), call=0, bad=False):
        if not 0 <= me < n:
            raise R2commArgumentError(f"rank {me} of {n}")
        self.n, self.me, self.call = n, me, call
        self.flag, self.aux, self.bad = int(flag), int(aux), bool(bad)
        self.K = frozenset(failed) - {me}
        self.acc = None            # (ballot, value) accepted here, highest so far
        self.decided = None
        self.attempts = 0
        self._tree = None

    # -- the tree of the current attempt -------------------------------------------------------
    def tree(self):
        """(parent or None, children) of this rank in the current attempt's tree (kept until
        the attempt changes: O(n) once per attempt)."""
        if self._tree is None or self._tree[0] is not self.K:
            live = [r for r in range(self.n) if r not in self.K]
            i = live.index(self.me)
            parent = live[(i - 1) // 2] if i else None
            self._tree = (self.K, (parent, [live[c] for c in (2 * i + 1, 2 * i + 2)
                                            if c < len(live)]))
        return self._tree[1]

    def _msg(self, kind, **kw):
        return Msg(kind, self.call, self.K, **kw)

    # -- inputs -----------------------------------------------------------------------------------
    def start(self):
        return self._restart()

    def failed(self, ranks):
        """The failure detector declared `ranks` dead."""
        new = frozenset(ranks) - self.K
        if not new or self.decided is not None:
            return []
        if self.me in new:
            raise R2commNetworkError(f"rank {self.me} was itself declared dead by the failure "
                                     f"detector (it was stopped too long): it cannot agree")
        self.K = self.K | new
        return self._restart()

    def receive(self, src, m):
        """Message m from rank src."""
        if self.decided is not None:
            return [] if m.kind == DECIDE else [(src, Msg(DECIDE, self.call, self.K,
                                                          acc=(1, self.decided)))]
        if m.kind == DECIDE:                  # a decided value: the only one there can be
            return self._decide(m.acc[1]) if m.acc is not None else []
        if src in self.K:
            return []                          # (sent before it died)
        out = []
        if not m.K <= self.K:                  # it knows of more failures: adopt them
            out += self.failed(m.K)
            if self.decided is not None:
                return out
        if m.K != self.K:                      # an older attempt: tell the sender
            return out + ([] if m.kind == UPDATE else [(src, self._msg(UPDATE))])
        parent, kids = self.tree()
        if m.kind == REPORT and src in kids and self.phase == "up":
            self.reports[src] = m
            out += self._maybe_report()
        elif m.kind == PROPOSE and src == parent and m.acc is not None:
            out += self._accept(m.acc[1])
        elif m.kind == ACK and src in kids and self.phase == "ack":
            self.acks.add(src)
            out += self._maybe_ack()
        return out                             # (QUERY, UPDATE of this attempt: nothing to do)

    # -- the phases -------------------------------------------------------------------------------
    def _restart(self):
        self.attempts += 1
        self.phase, self.reports, self.acks = "up", {}, set()
        _, kids = self.tree()
        return [(c, self._msg(QUERY)) for c in kids] + self._maybe_report()

    def _maybe_report(self):
        parent, kids = self.tree()
        if self.phase != "up" or any(c not in self.reports for c in kids):
            return []
        flag, aux, bad, acc = self.flag, self.aux, self.bad, self.acc
        for c in kids:
            r = self.reports[c]
            flag &= r.flag
            aux = max(aux, r.aux)
            bad = bad or r.bad
            acc = _better(acc, r.acc)
        if parent is not None:
            self.phase = "reported"
            return [(parent, self._msg(REPORT, flag=flag, aux=aux, acc=acc, bad=bad))]
        value = acc[1] if acc is not None else (flag, aux, self.K, bad)
        return self._accept(value)             # the coordinator proposes

    def _accept(self, value):
        self.acc = (len(self.K) + 1, value)
        self.phase, self.acks = "ack", set()
        _, kids = self.tree()
        return [(c, self._msg(PROPOSE, acc=self.acc)) for c in kids] + self._maybe_ack()

    def _maybe_ack(self):
        parent, kids = self.tree()
        if self.phase != "ack" or any(c not in self.acks for c in kids):
            return []
        if parent is None:
            return self._decide(self.acc[1])
        self.phase = "acked"
        return [(parent, self._msg(ACK))]

    def _decide(self, value):
        self.decided = (int(value[0]), int(value[1]), frozenset(value[2]), bool(value[3]))
        parent, kids = self.tree()
        return [(q, Msg(DECIDE, self.call, self.K, acc=(1, self.decided)))
                for q in ([parent] if parent is not None else []) + kids]


# -- the driver over a communicator -------------------------------------------------------------
class _State:
    """A communicator's agreements on this rank: its twin, the next call number, the rank's
    acknowledged failures and the last agreed set, the responder of its last decision."""

    def __init__(self, comm):
        self.twin = comm.ft_twin()
        self.calls = 0
        self.acked = []            # ranks acknowledged (Ack_failed), in acknowledgement order
        self.agreed = []           # the failed ranks of the last agreement (sorted)
        self.responder = None      # (thread, stop event) of the last decision
        self.lock = threading.Lock()


_states = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _state(comm):
    with _states_lock:
        st = _states.get(comm)
        if st is None:
            st = _states[comm] = _State(comm)
        return st


def release(comm):
    """`comm` is freed: the responder of its last agreement stops (within its poll interval)
    and its twin is dropped. Free a communicator only once its survivors are past its last
    agreement (e.g. after a collective on the communicator Shrink made from it)."""
    with _states_lock:
        st = _states.pop(comm, None)
    if st is None:
        return
    with st.lock:
        resp, st.responder = st.responder, None
    if resp is not None:
        resp[1].set()
        resp[0].join(1.0)
    st.twin.free()


def failed_ranks(comm):
    """Ranks of `comm` this rank knows to be dead, sorted (the failure detector's confirmed
    deaths, and the peers the engine holds lost)."""
    return sorted(comm.dead_ranks(confirmed=False))


def get_failed(comm):
    return failed_ranks(comm)


def ack_failed(comm, num_to_ack=None):
    """Acknowledge the first `num_to_ack` (None: all) of get_failed(); returns how many this
    rank has acknowledged in all (MPI 4.1's MPI_Comm_ack_failed)."""
    st = _state(comm)
    failed = failed_ranks(comm)
    if num_to_ack is None:
        num_to_ack = len(failed)
    if not isinstance(num_to_ack, int) or num_to_ack < 0:
        raise R2commArgumentError(f"Ack_failed: num_to_ack must be an int >= 0, not "
                                  f"{num_to_ack!r}")
    with st.lock:
        for r in failed[:num_to_ack]:
            if r not in st.acked:
                st.acked.append(r)
        return len(st.acked)


def last_agreed(comm):
    """The failed ranks of `comm`'s last agreement on this rank (sorted)."""
    return list(_state(comm).agreed)


class _Wire:
    """The agreement's messages on the twin: one receive from any rank kept posted, sends
    tracked until they end."""

    def __init__(self, twin, n, call):
        self.twin, self.n, self.call = twin, n, call
        self.tag = AGREE_TAG | (call & CALL_MASK)
        self.size = msg_size(n)
        self.sends = []
        self.bad = 0
        self._post()

    def _post(self):
        self.box = np.zeros(self.size, np.uint8)
        self.rq, self.status = self.twin.post_recv_any(self.box, self.tag)

    def poll(self):
        """(source, Msg) of a message received, or None; a bad one is dropped (counted)."""
        try:
            if not self.rq.Test():
                return None
        except R2commError:
            self.bad += 1
            self._post()
            return None
        src, count, data = self.status.source, self.status.count, self.box.tobytes()
        self._post()
        if count != self.size or not isinstance(src, int) or not 0 <= src < self.n:
            self.bad += 1
            return None
        try:
            return src, Msg.decode(data, self.n, self.call)
        except (ValueError, struct.error):
            self.bad += 1
            return None

    def send(self, out):
        for dst, m in out:
            if not self.twin.peer_alive(dst):
                continue
            try:
                self.sends.append(self.twin.message(
                    "send", np.frombuffer(m.encode(self.n), np.uint8), dst, self.tag))
            except R2commError:
                pass
        self.reap()

    def reap(self):
        keep = []
        for rq in self.sends:
            try:
                if not rq.Test():
                    keep.append(rq)
            except R2commError:
                pass
        self.sends = keep

    def close(self):
        try:
            self.rq.abort(6, "agreement over")
            self.rq.Test()
        except R2commError:
            pass


def _respond(wire, machine, stop, until):
    """A decided rank answers every late message of its agreement with DECIDE (module doc)."""
    pause = POLL_S[1]
    try:
        while not stop.is_set() and time.monotonic() < until and not wire.twin.closed:
            got = wire.poll()
            if got is None:
                wire.reap()
                stop.wait(pause)
                pause = min(pause * 2, RESPONDER_POLL_S)
                continue
            pause = POLL_S[1]
            wire.send(machine.receive(*got))
    except R2commError:
        pass
    finally:
        wire.close()


def agree(comm, flag, aux=0, timeout=None):
    """(AND of the flags, MAX of aux, sorted failed ranks), the same on every survivor of
    `comm` (module doc). Collective over the survivors; bounded by `timeout` (the
    communicator's by default): R2commTimeout after it."""
    bad = not isinstance(flag, (int, np.integer)) or not INT64[0] <= int(flag) < INT64[1]
    # (a bad flag still takes part, so that every rank raises rather than waits)
    comm.check()
    st = _state(comm)
    twin, n, me = st.twin, comm.size, comm.rank
    with st.lock:
        call = st.calls
        st.calls += 1
    limit = comm.timeout if timeout is None else float(timeout)
    deadline = time.monotonic() + limit
    machine = Agreement(n, me, 0 if bad else int(flag), int(aux),
                        comm.dead_ranks(confirmed=True), call, bad)
    wire = _Wire(twin, n, call)
    try:
        wire.send(machine.start())
        pause, next_check = POLL_S[0], 0.0
        while machine.decided is None:
            now = time.monotonic()
            if now > deadline:
                raise R2commTimeout(f"Agree on communicator {comm.comm_id} (rank {me}) did not "
                                    f"decide within {limit:g} s")
            if now >= next_check:
                wire.send(machine.failed(comm.dead_ranks(confirmed=True)))
                next_check = now + FAILED_POLL_S
            got = wire.poll()
            if got is not None:
                wire.send(machine.receive(*got))
                pause = POLL_S[0]
                continue
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])
    except BaseException:
        wire.close()
        raise
    # hand the wire to a responder; the previous agreement's responder may stop (every live
    # rank has left that agreement, since this one decided: module doc)
    stop = threading.Event()
    th = threading.Thread(target=_respond, args=(wire, machine, stop,
                                                  time.monotonic() + RESPONDER_S),
                          name=f"r2comm-agree-{comm.comm_id}-{call}", daemon=True)
    with st.lock:
        prev, st.responder = st.responder, (th, stop)
        st.agreed = sorted(machine.decided[2])
    if prev is not None:
        prev[1].set()
    th.start()
    if bad:
        raise R2commArgumentError(f"Agree: flag must be an int of 64 bits, not {flag!r}")
    if machine.decided[3]:
        raise R2commArgumentError(f"Agree on communicator {comm.comm_id}: another rank passed "
                                  f"a flag that is no 64-bit int (it raised the same)")
    return machine.decided[0], machine.decided[1], sorted(machine.decided[2])


def revoke(comm):
    """Revoke `comm` on every rank (module doc)."""
    comm.revoke(f"communicator {comm.comm_id} was revoked (Revoke on rank {comm.rank})")


def shrink(comm, timeout=None):
    """The Channel of `comm`'s survivors (module doc). Collective over the survivors."""
    _, top, failed = agree(comm, 1, comm.next_free_id(), timeout)
    gone = set(failed)
    members = [g for i, g in enumerate(comm.global_ranks()) if i not in gone]
    return comm.shrunk(members, top)
