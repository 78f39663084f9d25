"""One report of a mismatch on every rank (matching.pxi, "one report of a mismatch"): the
communicator's rank 0 judges, the other ranks hold a mismatch's error until its verdict comes.
Driven frame by frame on one engine (rank 0 of 2, the fuzz transport of test_engine_limits);
the multi-rank race is tests/test_mismatch.py::test_racing_detectors_raise_one_report."""
import os
import struct
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_engine_limits import CS, U8, Rig, data_header  # noqa: E402

from r2comm._core import engine as eng, testing  # noqa: E402

F_ABORT, FL_VERDICT, E_MISMATCH, E_NETWORK = 5, 8, 3, 2
ACTIVE, ERROR = 0, 2
CTRL = 2                    # the rig's control connection (rails 0 and 1, then control)
JUDGE_IS_PEER = [1, 0]      # members: rank 1 is the communicator's rank 0, the judge
JUDGE_IS_ME = [0, 1]


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def post(rig, members, comm=3, seq=0):
    """A collective receive of 10 bytes from rank 1 (call descriptor 0x11) among `members`."""
    buf = np.zeros(10, np.uint8)
    plan = eng.Plan([("recv", 1, 0, 0, 0, buf.nbytes, 0, False)], [], "t")
    bw = eng.Buffer(buf, True)
    rig.keep += [plan, bw]
    return rig.e.post(plan, bw.ptr, 0, 0, U8, 0, comm, seq, 0x11, 5.0, members)


def other_call(comm=3, seq=0):
    """Rank 1's frame of another call (count 0x12) for (comm, seq)."""
    return data_header(comm, seq, 0, 10, 10, count=0x12) + bytes(10)


def verdict(text, comm=3, seq=0, code=E_MISMATCH):
    return testing.encode_header(F_ABORT, FL_VERDICT, 0, 0, comm, seq, 0, 0, 0, len(text), 0,
                                 code) + text


def aborts_sent(rig):
    """(flags, comm, seq, code, text) of each ABORT the engine wrote on the control connection."""
    out, raw = [], testing.fuzz_sent(rig.e, CTRL)
    while len(raw) >= 48:
        _, typ, flags, _, _, comm, seq, _, _, _, ln, _, aux, _ = struct.unpack(
            "<IBBBBIIIIIIQII", raw[:48])
        if typ == F_ABORT:
            out.append((flags, comm, seq, aux, raw[48:48 + ln].decode()))
        raw = raw[48 + ln:]
    return out


def test_a_non_judge_holds_a_mismatch_until_the_verdict(rig):
    """The mismatch fails the call, but its error waits for the judge's verdict, then is the
    verdict's report (old code: the own report at once)."""
    oid = post(rig, JUDGE_IS_PEER)
    assert rig.feed(0, other_call())
    state, code, msg, _ = rig.e.wait(oid, 0.3)
    assert state == ACTIVE, (state, code, msg)
    assert rig.feed(CTRL, verdict(b"the judge's report"))
    state, code, msg, _ = rig.e.wait(oid, 1.0)
    assert (state, code, msg) == (ERROR, E_MISMATCH, "the judge's report")


def test_the_judge_raises_its_first_report_and_sends_it_as_the_verdict(rig):
    oid = post(rig, JUDGE_IS_ME)
    assert rig.feed(0, other_call())
    state, code, msg, _ = rig.e.wait(oid, 0.0)
    assert state == ERROR and code == E_MISMATCH and "rank 1 called" in msg, msg
    sent = aborts_sent(rig)
    assert (FL_VERDICT, 3, 0, E_MISMATCH, msg) in sent, sent
    assert (0, 3, 0, E_MISMATCH, msg) in sent, sent              # the plain abort as before


def test_a_verdict_before_the_call_fails_it_when_posted(rig):
    assert rig.feed(CTRL, verdict(b"decided"))
    oid = post(rig, JUDGE_IS_PEER)
    assert rig.e.wait(oid, 0.0)[:3] == (ERROR, E_MISMATCH, "decided")


def test_a_call_the_mismatch_poisoned_quotes_the_verdict(rig):
    first = post(rig, JUDGE_IS_PEER, seq=0)
    later = post(rig, JUDGE_IS_PEER, seq=1)
    assert rig.feed(0, other_call(seq=0))
    assert rig.e.wait(later, 0.2)[0] == ACTIVE
    assert rig.feed(CTRL, verdict(b"the verdict on #0", seq=0))
    state, code, msg, _ = rig.e.wait(later, 1.0)
    assert state == ERROR and code == E_MISMATCH, msg
    assert "(call #0) did not match" in msg and msg.endswith("the verdict on #0"), msg
    assert rig.e.wait(first, 0.0)[2] == "the verdict on #0"


def test_without_a_verdict_the_own_report_after_the_bound(rig):
    """The judge never answers (its call ended otherwise): the hold ends after 2 s with the
    rank's own report; no hang."""
    oid = post(rig, JUDGE_IS_PEER)
    t0 = time.monotonic()
    assert rig.feed(0, other_call())
    state, code, msg, _ = rig.e.wait(oid, 10.0)
    took = time.monotonic() - t0
    assert state == ERROR and code == E_MISMATCH and "detected by rank 0" in msg, msg
    assert 1.5 < took < 6, took


def test_verdicts_are_bounded_and_only_a_mismatch_s(rig):
    """1,500 verdicts for ids nobody posted keep at most 1,024; a verdict with another error
    code is ignored (the call still runs)."""
    for i in range(1500):
        assert rig.feed(CTRL, verdict(b"x" * 1000, comm=9000 + i))
    assert testing.debug_state(rig.e)["verdicts"] <= 1024
    assert rig.feed(CTRL, verdict(b"not a mismatch", code=E_NETWORK))
    oid = post(rig, JUDGE_IS_PEER)
    assert rig.e.wait(oid, 0.1)[0] == ACTIVE


def test_a_call_posted_after_the_verdict_quotes_it_at_once(rig):
    """A call posted after the verdict came (the mismatch not reported by a wait yet) fails at
    once, quoting the verdict; after the bad call is released no verdict is kept for it."""
    first = post(rig, JUDGE_IS_PEER, seq=0)
    assert rig.feed(0, other_call(seq=0))
    assert rig.feed(CTRL, verdict(b"the verdict on #0", seq=0))
    later = post(rig, JUDGE_IS_PEER, seq=1)
    state, code, msg, _ = rig.e.wait(later, 0.0)
    assert state == ERROR and msg.endswith("cannot line up: the verdict on #0"), msg
    assert rig.e.wait(first, 0.0)[2] == "the verdict on #0"
    rig.e.release(first)
    assert testing.debug_state(rig.e)["verdicts"] == 0


# -- issue 40, item 7: a verdict counts only from the judge -------------------------------------
class Rig3(Rig):
    """Rank 0 of 3 on the fuzz transport: ranks 1 and 2 with two rails and control each, of
    which those in `up` are attached (a rank left out holds no connection with rank 0)."""

    def __init__(self, up=(1, 2)):
        self.e = eng.Engine(0, 3, [0, 2, 2], CS, 5.0, 10.0, 4 * CS)
        for peer in up:
            for k in (0, 1, 2):
                testing.fuzz_attach(self.e, peer, k, 7 + 3 * peer + k)
        self.keep = []

    def feed_from(self, peer, rail, data):
        used, up, _ = testing.fuzz_feed(self.e, peer, rail, data)
        assert used == len(data)
        return up


@pytest.fixture
def rig3():
    r = Rig3()
    yield r
    r.close()


def test_the_judge_takes_no_verdict_from_a_peer(rig):
    """This rank judges (members [0, 1]): rank 1's "verdict" neither fails its call nor sets
    its report. Old code: the call failed with rank 1's text."""
    oid = post(rig, JUDGE_IS_ME)
    assert rig.feed(CTRL, verdict(b"rank 1 decides"))
    assert rig.e.wait(oid, 0.3)[0] == ACTIVE
    assert testing.debug_state(rig.e)["verdicts"] == 0


def test_a_member_s_verdict_does_not_count_where_the_judge_is_connected(rig3):
    """Members [1, 0, 2], judge 1 connected: rank 2's verdict is ignored, the judge's then
    counts. Old code: rank 2's text failed the call."""
    oid = post(rig3, [1, 0, 2])
    assert rig3.feed_from(2, CTRL, verdict(b"rank 2 decides"))
    assert rig3.e.wait(oid, 0.3)[0] == ACTIVE
    assert rig3.feed_from(1, CTRL, verdict(b"the judge decides"))
    assert rig3.e.wait(oid, 1.0)[:3] == (ERROR, E_MISMATCH, "the judge decides")


def test_a_non_member_s_verdict_never_counts(rig3):
    """Members [1, 0]: rank 2, outside the communicator, is ignored before and after the call
    is posted. Old code: its text failed the call."""
    assert rig3.feed_from(2, CTRL, verdict(b"an outsider decides"))
    oid = post(rig3, [1, 0])
    assert rig3.e.wait(oid, 0.2)[0] == ACTIVE
    assert rig3.feed_from(2, CTRL, verdict(b"an outsider decides", seq=0))
    assert rig3.e.wait(oid, 0.3)[0] == ACTIVE
    assert testing.debug_state(rig3.e)["verdicts"] == 0


def test_an_early_verdict_is_checked_when_the_call_is_posted(rig3):
    """A verdict from rank 2 before the call (members [1, 0, 2]) is dropped at the post, and
    does not keep the judge's, which comes later, out. Old code: the call failed at its post
    with rank 2's text."""
    assert rig3.feed_from(2, CTRL, verdict(b"rank 2 decides"))
    oid = post(rig3, [1, 0, 2])
    assert rig3.e.wait(oid, 0.2)[0] == ACTIVE
    assert rig3.feed_from(1, CTRL, verdict(b"the judge decides"))
    assert rig3.e.wait(oid, 1.0)[:3] == (ERROR, E_MISMATCH, "the judge decides")


def test_the_judge_s_early_verdict_wins_over_an_earlier_relay(rig3):
    """Before the call is posted a member's relay comes first, then the judge's own verdict
    (judge connected): the call fails at its post with the judge's. Old code: with the first
    to come (the relay's)."""
    assert rig3.feed_from(2, CTRL, verdict(b"as rank 2 relayed it"))
    assert rig3.feed_from(1, CTRL, verdict(b"as the judge sent it"))
    oid = post(rig3, [1, 0, 2])
    assert rig3.e.wait(oid, 0.0)[:3] == (ERROR, E_MISMATCH, "as the judge sent it")
    rig3.e.release(oid)
    assert testing.debug_state(rig3.e)["verdicts"] == 0


def test_an_early_relay_counts_where_the_judge_holds_no_connection():
    r = Rig3(up=(1,))
    try:
        assert r.feed_from(1, CTRL, verdict(b"relayed before the post"))
        oid = post(r, [2, 0, 1])
        assert r.e.wait(oid, 0.0)[:3] == (ERROR, E_MISMATCH, "relayed before the post")
    finally:
        r.close()


def test_a_relayed_verdict_counts_where_the_judge_holds_no_connection():
    """Members [2, 0, 1], judge 2 not connected to this rank (connections made on first use):
    rank 1's relay of the verdict counts, as before, and the call holding its mismatch takes
    it."""
    r = Rig3(up=(1,))
    try:
        oid = post(r, [2, 0, 1])
        assert r.feed_from(1, 0, other_call())
        assert r.e.wait(oid, 0.3)[0] == ACTIVE            # held for the verdict
        assert r.feed_from(1, CTRL, verdict(b"relayed from the judge"))
        assert r.e.wait(oid, 1.0)[:3] == (ERROR, E_MISMATCH, "relayed from the judge")
    finally:
        r.close()
