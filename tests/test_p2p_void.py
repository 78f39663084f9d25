"""A point-to-point message its sender gave up travels as a void (an empty FL_P2P | FL_VOID
DATA frame), driven frame by frame on the engine's in-memory fuzz transport (the Rig of
tests/test_engine_limits.py, rank 0 of 2): the receiver's later messages of the pair stop
waiting for it and keep their order, a stored part of it is dropped, a receive it matched
fails, a late chunk of it is stale, and what voids can make a rank hold is bounded; the sender
writes one for a send that failed and takes no sequence number for a send to a lost peer.
The multi-rank case (rails failed for real, then restored): tests/test_p2p_recover.py."""
import os
import struct
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_engine_limits import Rig, data_header, CS, U8, FL_P2P, F_DATA  # noqa: E402

from r2comm._core import engine as eng, testing  # noqa: E402

FL_VOID = 4
F_ACK = 2
HDR = struct.Struct("<IBBBBIIIIIIQII")          # r2_wire.h's r2_hdr (48 bytes)
ACTIVE, DONE, ERROR = 0, 1, 2


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def void(comm, seq):
    return data_header(comm, seq, 0, 0, 0, flags=FL_P2P | FL_VOID)


def msg(comm, seq, byte, n=10, tag=9):
    return data_header(comm, seq, 0, n, n, flags=FL_P2P, aux=tag) + bytes([byte]) * n


def state_of(rig, oid, wait=0.0):
    return rig.e.wait(oid, wait)


def frames(data):
    """The (type, flags, comm, seq, total, chunk) of each frame in bytes an engine wrote."""
    out, pos = [], 0
    while pos + HDR.size <= len(data):
        f = HDR.unpack_from(data, pos)
        out.append((f[1], f[2], f[5], f[6], f[11], f[9]))
        pos += HDR.size + f[10]
    return out


def test_a_void_lets_the_pairs_next_message_match(rig):
    """Message 1 of the pair arrives; message 0 never will (its sender gave it up): until the
    void for 0 arrives, a receive waits; then it gets message 1. Old code: it waited forever."""
    buf = np.zeros(10, np.uint8)
    assert rig.feed(0, msg(1, 1, 11))
    oid = rig.p2p_recv(buf, -1)
    assert state_of(rig, oid)[0] == ACTIVE
    assert rig.feed(1, void(1, 0))
    assert state_of(rig, oid, 1.0)[0] == DONE and (buf == 11).all()
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 0


def test_messages_around_a_void_keep_their_order(rig):
    """Void 1 arrives before message 2, message 0 last: receives get 0 then 2 (message 2 is not
    matched before 0 was seen), the void held meanwhile is freed."""
    assert rig.feed(1, void(1, 1))
    assert rig.feed(0, msg(1, 2, 22))
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 2     # void 1, message 2: waiting
    bufs = [np.zeros(10, np.uint8) for _ in range(2)]
    oids = [rig.p2p_recv(b, -1) for b in bufs]
    assert state_of(rig, oids[0])[0] == ACTIVE
    assert rig.feed(0, msg(1, 0, 5))
    for oid in oids:
        assert state_of(rig, oid, 1.0)[0] == DONE
    assert (bufs[0] == 5).all() and (bufs[1] == 22).all()
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 0
    assert rig.feed(0, void(1, 1)) and rig.feed(0, void(1, 2))       # repeated, stale: nothing
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 0


def test_a_void_drops_the_stored_part_and_a_late_chunk_is_stale(rig):
    """Chunk 0 of two of message 0 is stored; its void drops it; chunk 1 arriving late is read
    and dropped (the rail stays up); message 1 goes to the next receive."""
    assert rig.feed(0, data_header(1, 0, 0, CS, 2 * CS, flags=FL_P2P, aux=9) + bytes([1]) * CS)
    assert testing.debug_state(rig.e)["unexpected_bytes"] == CS
    assert rig.feed(1, void(1, 0))
    st = testing.debug_state(rig.e)
    assert st["unexpected_msgs"] == 0 and st["unexpected_bytes"] == 0, st
    assert rig.feed(0, data_header(1, 0, 1, CS, 2 * CS, flags=FL_P2P, aux=9) + bytes([1]) * CS)
    assert testing.debug_state(rig.e)["unexpected_msgs"] == 0
    buf = np.zeros(2 * CS, np.uint8)
    oid = rig.p2p_recv(buf, -1)
    assert rig.feed(0, msg(1, 1, 7))
    state, _, _, nrecv = state_of(rig, oid, 1.0)
    assert state == DONE and nrecv == 10 and (buf[:10] == 7).all() and not buf[10:].any()


def test_a_void_fails_the_receive_its_message_matched(rig):
    """A receive matched message 0 and got its first chunk; the void says the rest never comes:
    the receive fails at once with E_NETWORK, naming the sender (not at its timeout)."""
    buf = np.zeros(2 * CS, np.uint8)
    oid = rig.p2p_recv(buf, 9)
    assert rig.feed(0, data_header(1, 0, 0, CS, 2 * CS, flags=FL_P2P, aux=9) + bytes([1]) * CS)
    assert state_of(rig, oid)[0] == ACTIVE
    assert rig.feed(1, void(1, 0))
    state, code, text, _ = state_of(rig, oid, 1.0)
    assert state == ERROR and code == eng.ERR_NETWORK and "rank 1's send" in text, text
    buf2 = np.zeros(10, np.uint8)
    oid2 = rig.p2p_recv(buf2, 9)
    assert rig.feed(0, msg(1, 1, 3))
    assert state_of(rig, oid2, 1.0)[0] == DONE and (buf2 == 3).all()


def test_what_voids_make_a_rank_hold_is_bounded(rig):
    """Voids ahead of a gap are held as unexpected messages (capped: over the cap the peer's
    are dropped and the frame refused, as for data); voids for communicator ids nobody here
    used make pair states only while the rank holds fewer than the cap; a void that is not an
    empty point-to-point frame closes its rail."""
    testing.set_unexpected_limit(rig.e, 1 << 20, 16)
    conn, refused = 20, 0
    for s in range(1, 60):
        if not rig.feed(0, void(1, s)):
            refused += 1
            conn += 1
            testing.fuzz_attach(rig.e, 1, 0, conn)
        assert testing.debug_state(rig.e)["unexpected_msgs"] <= 16
    assert refused >= 2
    for comm in range(1000, 1100):
        if not rig.feed(0, void(comm, 0)):
            conn += 1
            testing.fuzz_attach(rig.e, 1, 0, conn)
        assert testing.debug_state(rig.e)["p2p_states"] <= 17
    bad = data_header(1, 70, 0, 0, 10, flags=FL_P2P | FL_VOID)
    assert not testing.fuzz_feed(rig.e, 1, 1, bad)[1]
    assert any("void frame" in ev["info"] for ev in rig.e.events_since(0)
               if ev["kind"] == "bad_frame")


def p2p_send(rig, arr, tag=9):
    plan = eng.Plan([("send", 1, 0, 0, 0, arr.nbytes, 0, arr.nbytes <= 64)], [], "t")
    bw = eng.Buffer(arr, False)
    rig.keep += [plan, bw]
    return rig.e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [1], 1, tag, arr.nbytes)


def sent_frames(rig):
    testing.fuzz_feed(rig.e, 1, 0, b"")                # (the engine writes what it has)
    return frames(testing.fuzz_sent(rig.e, 0)) + frames(testing.fuzz_sent(rig.e, 1))


def test_a_failed_send_sends_a_void_until_acknowledged(rig):
    """A large send (not copied) fails mid-way (cancelled, as a timed-out wait does): the
    engine writes a void for its sequence number, keeps it until the peer acknowledges it, and
    the pair's next message takes the next number."""
    big = np.ones(4 * CS, np.uint8)
    oid = p2p_send(rig, big)
    assert any(f[0] == F_DATA and f[3] == 0 and f[1] & FL_VOID == 0 for f in sent_frames(rig))
    rig.e.cancel(oid, 1, "gave up")
    assert state_of(rig, oid)[0] == ERROR
    voids = [f for f in sent_frames(rig) if f[0] == F_DATA and f[1] & FL_VOID]
    assert voids and all(f[1] & FL_P2P and f[2] == 1 and f[3] == 0 and f[4] == 0
                         for f in voids), voids
    rig.e.release(oid)
    assert testing.debug_state(rig.e)["sends"] == 1               # the void, until its ack
    ack = testing.encode_header(F_ACK, FL_P2P | FL_VOID, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)
    assert rig.feed(0, ack)
    assert testing.debug_state(rig.e)["sends"] == 0
    p2p_send(rig, np.full(10, 4, np.uint8))
    assert [f[3] for f in sent_frames(rig) if f[0] == F_DATA] == [1]


def test_a_send_to_a_lost_peer_takes_no_sequence_number(rig):
    """A send posted while the peer is lost fails at once and spends no number of the pair's
    sequence: once the pair is back, the next message is number 0 (old code: 1, which the
    receiver, never having seen 0, could not match)."""
    rig.e.links.peer_dead(1, "test: the failure detector said so")
    oid = p2p_send(rig, np.full(10, 1, np.uint8))
    state, code, text, _ = state_of(rig, oid)
    assert state == ERROR and code == eng.ERR_NETWORK and "unreachable" in text, text
    rig.e.release(oid)
    for k in (0, 1, 2):
        testing.fuzz_attach(rig.e, 1, k, 30 + k)
    sent_frames(rig)
    p2p_send(rig, np.full(10, 2, np.uint8))
    got = [f for f in sent_frames(rig) if f[0] == F_DATA]
    assert [(f[3], f[1] & FL_VOID) for f in got] == [(0, 0)], got


def test_closing_waits_for_a_void_only_while_its_peer_is_reachable(rig):
    """Engine.drain (before close) waits for a void's acknowledgement (the receiver needs it to
    match the pair's later messages), but not for one to a peer held lost (it may never come
    back: closing would wait out the drain's timeout for a message that carries no data)."""
    oid = p2p_send(rig, np.ones(4 * CS, np.uint8))
    sent_frames(rig)
    rig.e.cancel(oid, 1, "gave up")
    rig.e.release(oid)
    assert testing.debug_state(rig.e)["sends"] == 1
    assert rig.e.drain(0.2) is False
    rig.e.links.peer_dead(1, "test: the failure detector said so")
    assert rig.e.drain(5.0) is True


def test_closing_does_not_wait_for_data_to_a_dead_peer(rig):
    """Nor for a data send's acknowledgement once its peer is held lost (its operations failed:
    the acks cannot come), so a world freed after a rank died closes at once (issue 44: Free
    after Shrink waited out the drain's 10 s); while the peer is reachable it waits."""
    p2p_send(rig, np.ones(4 * CS, np.uint8))
    sent_frames(rig)
    assert testing.debug_state(rig.e)["sends"] == 1
    assert rig.e.drain(0.2) is False
    rig.e.links.peer_dead(1, "test: the failure detector said so")
    t0 = time.monotonic()
    assert rig.e.drain(5.0) is True and time.monotonic() - t0 < 1.0
