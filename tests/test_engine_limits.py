"""Issue 28: what a peer's frames can make a receiving engine do, driven frame by frame on the
engine's in-memory fuzz transport (tests/fuzz_wire.py): a late copy of a delivered chunk never
writes the user's buffer (item 3), the tables a peer can grow are bounded (item 7), and
sequence numbers wrap without stale drops (item 5, engine side)."""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuzz_wire  # noqa: E402

from r2comm._core import engine as eng, testing  # noqa: E402

CS = fuzz_wire.CS
U8 = fuzz_wire.U8
F_DATA, F_ABORT, FL_P2P = fuzz_wire.F_DATA, fuzz_wire.F_ABORT, fuzz_wire.FL_P2P


class Rig:
    """Rank 0 of 2 with two rails and the control connection to rank 1 on the fuzz transport."""

    def __init__(self, window=4 * CS):
        self.e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, window)
        for k in (0, 1, 2):
            testing.fuzz_attach(self.e, 1, k, 7 + k)
        self.keep = []

    def recv(self, buf, comm, seq, count, step=0, mode=0, timeout=5.0):
        """Post a collective receive of buf from rank 1 (copy mode)."""
        plan = eng.Plan([("recv", 1, step, 0, 0, buf.nbytes, mode, False)], [], "t")
        bw = eng.Buffer(buf, True)
        self.keep += [plan, bw]
        return self.e.post(plan, bw.ptr, 0, 0, U8, 0, comm, seq, count, timeout, [0, 1])

    def p2p_recv(self, buf, tag):
        plan = eng.Plan([("recv", 1, 0, 0, 0, buf.nbytes, 0, False)], [], "t")
        bw = eng.Buffer(buf, True)
        self.keep += [plan, bw]
        return self.e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [0, 1], 1, tag, buf.nbytes)

    def feed(self, rail, data):
        used, up, _ = testing.fuzz_feed(self.e, 1, rail, data)
        assert used == len(data)
        return up

    def close(self):
        self.e.close()
        for b in self.keep:
            if isinstance(b, eng.Buffer):
                b.release()


def data_header(comm, seq, chunk, ln, total, count=0, flags=0, step=0, aux=0):
    return testing.encode_header(F_DATA, flags, U8, 0, comm, seq, step, count, chunk, ln, total, aux)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


# -- item 3: a late copy of a delivered chunk ---------------------------------------------------
@pytest.mark.parametrize("split", [1, CS // 2, CS - 1])
def test_late_copy_of_an_applied_chunk_never_writes_the_user_buffer(rig, split):
    """Chunk 0's header and the first `split` payload bytes arrive on rail 0; the whole chunk
    then arrives on rail 1 (a hedge copy) and is applied; rail 0's remaining bytes differ (a
    zero-copy sender rewrote the pages after rail 1's ack). The buffer holds only rail 1's
    bytes, and both copies are acknowledged. Old code: rail 0 kept writing into the delivered
    chunk (it ended GG..GGLL..LL)."""
    total = 2 * CS
    buf = np.full(total, 0xEE, np.uint8)
    rig.recv(buf, 1, 0, 0xA1)
    good = bytes([0x47]) * CS                       # 'G'
    late = bytes([0x4C]) * CS                       # 'L'
    head = data_header(1, 0, 0, CS, total, count=0xA1)
    assert rig.feed(0, head + good[:split])
    assert rig.feed(1, head + good)                 # applied: chunk 0 complete
    assert rig.feed(0, late[split:])                # the rest of the late copy
    assert buf[:CS].tobytes() == good, "a late copy wrote into a chunk already applied"
    assert (buf[CS:] == 0xEE).all()
    testing.fuzz_sent(rig.e, 0)
    testing.fuzz_sent(rig.e, 1)


def test_late_copy_into_a_reducing_receive_is_not_applied_twice(rig):
    """The same interleaving on a reducing receive (staged per rail): the chunk is reduced in
    once, from the first complete copy."""
    buf = np.ones(CS, np.uint8)
    rig.recv(buf, 1, 0, 0xB2, mode=1)
    head = data_header(1, 0, 0, CS, CS, count=0xB2)
    assert rig.feed(0, head + bytes([2]) * 100)
    assert rig.feed(1, head + bytes([2]) * CS)
    assert rig.feed(0, bytes([9]) * (CS - 100))
    assert (buf == 3).all(), np.unique(buf)


def test_hedge_copy_never_sent_over_a_late_read_transport():
    """A rail whose transport completes posts before the NIC reads the pages (verbs zero-copy,
    TPF_LATE_READ) gets no hedge copy, nor is a chunk on it copied: an ack of one copy would
    let the sender rewrite the pages the other is still read from. The same late rail on a
    plain transport is hedged (the control case)."""
    import time
    hedged = {}
    for late_read in (False, True):
        e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, CS)     # window: one chunk per rail
        keep = []
        try:
            for k in (0, 1, 2):
                testing.fuzz_attach(e, 1, k, 7 + k, late_read=late_read)
            src = (np.arange(2 * CS) % 97).astype(np.uint8)
            plan = eng.Plan([("send", 1, 0, 0, 0, 2 * CS, 0, False)], [], "t")
            bw = eng.Buffer(src, False)
            keep += [plan, bw]
            e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [0, 1])
            testing.fuzz_feed(e, 1, 2, b"")
            sent = {k: testing.fuzz_sent(e, k) for k in (0, 1)}
            fast = 0 if len(sent[0]) else 1
            c = fuzz_wire.HDR.unpack(sent[fast][:48])[9]
            ack = testing.encode_header(fuzz_wire.F_ACK, 0, 0, 0, 1, 0, 0, 0, c, 0, 0, 0)
            testing.fuzz_feed(e, 1, fast, ack)                        # the fast rail is free again
            time.sleep(0.1)                                   # the other rail is now late
            testing.fuzz_feed(e, 1, fast, b"")
            hedged[late_read] = sum(row[8] for row in e.rail_stats()[1])
        finally:
            e.close()
            for b in keep:
                if isinstance(b, eng.Buffer):
                    b.release()
    assert hedged[False] == CS, hedged          # the plain transport hedges the late chunk
    assert hedged[True] == 0, hedged


# -- item 7: bounded tables against a peer's frames ----------------------------------------------
def abort_frame(comm, seq, text):
    return testing.encode_header(F_ABORT, 0, 0, 0, comm, seq, 0, 0, 0, len(text), 0, 5) + text


def test_events_and_aborts_for_any_ids_stay_bounded(rig):
    """5,000 aborts (4 KiB of text each) for communicator ids nobody posted: the engine keeps
    the last 1,024 to 2,048 events and at most 1,024 pending aborts, adds no sequence entry
    for those ids, and the events it keeps are still numbered from the first. Old code: every
    event and every abort kept (about 40 MiB here), and a sequence entry per id."""
    text = b"x" * 4000
    n = 5000
    for i in range(n):
        assert rig.feed(2, abort_frame(1000 + i, 0, text))
    evs = rig.e.events_since(0)
    assert 1024 <= len(evs) <= 2048, len(evs)
    st = testing.debug_state(rig.e)
    assert st["aborted"] <= 1024 and st["next_seq"] == 0, st
    assert st["events_total"] == n
    assert [ev["index"] for ev in evs] == list(range(n - len(evs), n))
    last = rig.e.events_since(n - 1)
    assert len(last) == 1 and last[0]["kind"] == "abort" and last[0]["index"] == n - 1
    assert rig.e.events_since(n) == []


def test_an_abort_for_a_call_not_posted_yet_still_fails_it(rig):
    """The bound keeps the abort path: an abort that arrives before its call is posted, after
    more than the bound of aborts for other ids, fails the call when it is posted."""
    for i in range(1500):                                   # more than the bound, other ids
        assert rig.feed(2, abort_frame(5000 + i, 0, b"noise"))
    assert rig.feed(2, abort_frame(3, 0, b"rank 1 failed call #0"))
    oid = rig.recv(np.zeros(10, np.uint8), 3, 0, 0x11)
    state, code, msg, _ = rig.e.wait(oid, 1.0)
    assert state == 2 and "rank 1 failed call #0" in msg, (state, code, msg)


def test_unexpected_collective_frames_for_any_ids_are_capped(rig):
    """Collective DATA frames for 3,000 communicator ids nobody posted, with the store capped
    at 1,000 messages: at most 1,000 are kept; at the cap the peer's unexpected messages are
    dropped, this rank's operations with it fail naming the cap, and the frame is refused
    (that rail closes: nothing of it is acknowledged). No sequence entry is made for any id.
    Old code: 3,000 entries (one per id), and one sequence entry per id."""
    testing.set_unexpected_limit(rig.e, 1 << 30, 1000)
    oid = rig.recv(np.zeros(10, np.uint8), 1, 0, 0x11)
    conn = 20
    refused = 0
    peak = 0
    for i in range(3000):
        if not rig.feed(0, data_header(2000 + i, 0, 0, 10, 10, count=0x11) + bytes(10)):
            refused += 1
            conn += 1
            testing.fuzz_attach(rig.e, 1, 0, conn)
        st = testing.debug_state(rig.e)
        peak = max(peak, st["unexpected_msgs"])
        assert st["unexpected"] <= 1000 and st["unexpected_msgs"] <= 1000, st
    assert peak == 1000 and refused >= 2, (peak, refused)
    assert testing.debug_state(rig.e)["next_seq"] == 1                # the receive posted here only
    state, code, msg, _ = rig.e.wait(oid, 1.0)
    assert state == 2 and "R2COMM_UNEXPECTED_MSGS" in msg and "rank 1" in msg, msg
    assert any("unexpected data" in ev["info"] for ev in rig.e.events_since(0)
               if ev["kind"] == "bad_frame")


def test_unexpected_p2p_bytes_are_capped(rig):
    """Point-to-point messages no receive wants (tag 9, across 50 communicator ids) with the
    store capped at 64 KiB: never more than 64 KiB held, and the pair states made for ids
    nobody used stay bounded too; a receive posted later still gets a message sent after
    the overflow."""
    testing.set_unexpected_limit(rig.e, 64 * 1024, 1 << 20)
    conn = 20
    seqs = {}
    refused = 0
    for i in range(200):
        comm = 100 + i % 50
        s = seqs.get(comm, 0)
        frame = data_header(comm, s, 0, CS, CS, flags=FL_P2P, aux=9) + bytes([i % 251]) * CS
        if not rig.feed(1, frame):
            refused += 1
            conn += 1
            testing.fuzz_attach(rig.e, 1, 1, conn)
        else:
            seqs[comm] = s + 1
        st = testing.debug_state(rig.e)
        assert st["unexpected_bytes"] <= 64 * 1024 and st["p2p_states"] <= 50, st
    assert st["unexpected_bytes"] > 0 and refused >= 2, (st, refused)
    buf = np.zeros(CS, np.uint8)
    testing.set_unexpected_limit(rig.e, 1 << 30, 1 << 20)
    s = seqs.get(7, 0)
    assert rig.feed(1, data_header(7, s, 0, CS, CS, flags=FL_P2P, aux=9) + bytes([42]) * CS)
    plan = eng.Plan([("recv", 1, 0, 0, 0, CS, 0, False)], [], "t")
    bw = eng.Buffer(buf, True)
    rig.keep += [plan, bw]
    oid = rig.e.post(plan, bw.ptr, 0, 0, U8, 0, 7, 0, 0, 5.0, [0, 1], 1, 9, CS)
    assert rig.e.wait(oid, 1.0)[0] == 1 and (buf == 42).all()


# -- item 5: sequence numbers that wrap ----------------------------------------------------------
@pytest.mark.parametrize("last", [2**32 - 2, 2**32 - 1, 2**32 - 256])
def test_a_frame_of_the_next_lap_is_not_taken_for_a_stale_one(rig, last):
    """Collective (comm 9, seq `last`) completes; a frame of the next call, whose sequence
    wrapped to 0 (a host communicator's call 2**32, or a GPU twin id reused after 2**30 calls
    with its twin sequence restarting at 0), arrives before that call is posted here. It is
    kept and delivered. Old code: dropped as stale (but acknowledged), the call waited until
    its timeout."""
    a = np.zeros(10, np.uint8)
    oid = rig.recv(a, 9, last, 0x11)
    assert rig.feed(0, data_header(9, last, 0, 10, 10, count=0x11) + bytes([1]) * 10)
    assert rig.e.wait(oid, 1.0)[0] == 1 and (a == 1).all()
    assert rig.feed(0, data_header(9, 0, 0, 10, 10, count=0x11) + bytes([2]) * 10)
    b = np.zeros(10, np.uint8)
    oid = rig.recv(b, 9, 0, 0x11, timeout=1.0)
    state, code, msg, _ = rig.e.wait(oid, 2.0)
    assert state == 1 and (b == 2).all(), (state, msg)
    # and a frame of the lap before is still stale (dropped, the next call is not disturbed)
    assert rig.feed(0, data_header(9, last, 0, 10, 10, count=0x11) + bytes([3]) * 10)
    assert testing.debug_state(rig.e)["unexpected"] == 0


def test_p2p_messages_match_in_order_across_the_wrap(rig):
    """A pair's point-to-point sequence crosses 2**32 with messages arriving out of order
    (hook: both directions start at 2**32 - 2): receives for any tag get them in sequence
    order, 2**32 - 2, 2**32 - 1, 0, 1. Old code: compared sequences as plain integers (a
    message after the wrap was taken for one already seen)."""
    start = 2**32 - 2
    testing.p2p_start(rig.e, 1, 1, start)
    seqs = [start, start + 1, 0, 1]
    for k in (2, 3, 1, 0):                                      # arrival order
        s = seqs[k]
        assert rig.feed(0, data_header(1, s % 2**32, 0, 10, 10, flags=FL_P2P, aux=9)
                        + bytes([k + 1]) * 10)
    bufs = [np.zeros(10, np.uint8) for _ in range(4)]
    oids = [rig.p2p_recv(b, -1) for b in bufs]
    for k in range(4):
        assert rig.e.wait(oids[k], 1.0)[0] == 1, k
        assert (bufs[k] == k + 1).all(), (k, bufs[k])
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 0


def test_unexpected_limits_from_the_environment(monkeypatch):
    """R2COMM_UNEXPECTED_MSGS / R2COMM_UNEXPECTED_BYTES set the caps; a malformed value raises
    R2commArgumentError naming the variable."""
    from r2comm.errors import R2commArgumentError
    monkeypatch.setenv("R2COMM_UNEXPECTED_MSGS", "5")
    r = Rig()
    try:
        for i in range(5):
            assert r.feed(0, data_header(3000 + i, 0, 0, 10, 10, count=1) + bytes(10))
        frame = data_header(4000, 0, 0, 10, 10, count=1) + bytes(10)
        assert not testing.fuzz_feed(r.e, 1, 0, frame)[1]
        assert testing.debug_state(r.e)["unexpected_msgs"] == 0          # the peer's were dropped
    finally:
        r.close()
    monkeypatch.setenv("R2COMM_UNEXPECTED_BYTES", "lots")
    with pytest.raises(R2commArgumentError, match="R2COMM_UNEXPECTED_BYTES"):
        eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, CS)


def test_p2p_receive_posted_before_anything_arrived(rig):
    """A receive posted while the pair holds no unexpected message (the matching walk over an
    empty store), then its message arrives."""
    buf = np.zeros(10, np.uint8)
    oid = rig.p2p_recv(buf, 9)
    assert rig.feed(0, data_header(1, 0, 0, 10, 10, flags=FL_P2P, aux=9) + bytes([7]) * 10)
    assert rig.e.wait(oid, 1.0)[0] == 1 and (buf == 7).all()
