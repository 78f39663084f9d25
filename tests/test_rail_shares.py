"""A plan's declared rail shares (Schedule.rail_weights, compiled into the engine's Plan per
message): the engine's striping follows them, on its in-memory fuzz transport (rank 0 of 2,
two rails), and bad shares are refused when the Plan is built."""
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
CHUNKS = 8


def chunks_per_rail(weights, fail=None):
    """Data frames rank 0 writes on each rail for one send of CHUNKS chunks to rank 1 (window
    room for all of them, no acks): the striping's choice of rail per chunk."""
    e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, 2 * CHUNKS * CS)
    keep = []
    try:
        for k in (0, 1, 2):
            testing.fuzz_attach(e, 1, k, 7 + k)
        if fail is not None:                    # a malformed frame: the engine drops the rail
            assert not testing.fuzz_feed(e, 1, fail, b"\xff" * fuzz_wire.HDR.size)[1]
        src = (np.arange(CHUNKS * CS) % 97).astype(np.uint8)
        plan = eng.Plan([("send", 1, 0, 0, 0, src.nbytes, 0, False)], [], "t",
                        None, None if weights is None else [weights])
        bw = eng.Buffer(src, False)
        keep += [plan, bw]
        e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [0, 1])
        for _ in range(4):
            testing.fuzz_feed(e, 1, 2, b"")
        return [len(testing.fuzz_sent(e, k)) // (CS + fuzz_wire.HDR.size) for k in (0, 1)]
    finally:
        e.close()
        for b in keep:
            if isinstance(b, eng.Buffer):
                b.release()


def test_declared_shares_steer_the_chunks():
    """(1/4, 3/4): 2 of 8 chunks on rail 0, 6 on rail 1; (0, 1): all on rail 1; without shares
    the rails take turns (the engine's own striping, both unmeasured)."""
    assert chunks_per_rail((0.25, 0.75)) == [2, 6]
    assert chunks_per_rail((0.0, 1.0)) == [0, CHUNKS]
    own = chunks_per_rail(None)
    assert sum(own) == CHUNKS and min(own) >= 2, own


def test_a_declared_rail_that_is_down_is_skipped():
    """All declared on rail 1, which failed: the chunks go on rail 0 (the measured striping)."""
    assert chunks_per_rail((0.0, 1.0), fail=1) == [CHUNKS, 0]


def test_a_declared_rail_whose_acks_are_late_is_passed_by():
    """All declared on rail 1 with room for 2 chunks per rail and no acks: rail 1 takes 2 and
    the rest wait for it; once its acks are late (past its quiet limit, 20 ms unmeasured) the
    measured striping gives the waiting chunks to rail 0, as it would without shares."""
    import time
    e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, 2 * CS)
    keep = []
    try:
        for k in (0, 1, 2):
            testing.fuzz_attach(e, 1, k, 7 + k)
        src = (np.arange(CHUNKS * CS) % 97).astype(np.uint8)
        plan = eng.Plan([("send", 1, 0, 0, 0, src.nbytes, 0, False)], [], "t", None, [(0, 1)])
        bw = eng.Buffer(src, False)
        keep += [plan, bw]
        e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [0, 1])
        testing.fuzz_feed(e, 1, 2, b"")
        frame = CS + fuzz_wire.HDR.size
        assert [len(testing.fuzz_sent(e, k)) // frame for k in (0, 1)] == [0, 2]
        time.sleep(0.1)
        testing.fuzz_feed(e, 1, 2, b"")
        assert len(testing.fuzz_sent(e, 0)) // frame >= 1
    finally:
        e.close()
        for b in keep:
            if isinstance(b, eng.Buffer):
                b.release()


@pytest.mark.parametrize("bad", [(0.0, 0.0), (-0.5, 1.5), (float("nan"), 1.0), (),
                                 tuple([0.1] * 65)])
def test_bad_shares_are_refused(bad):
    with pytest.raises(ValueError, match="rail weights"):
        eng.Plan([("send", 1, 0, 0, 0, 8, 0, False)], [], "t", None, [bad])


def test_shares_only_on_sends_and_one_entry_per_message():
    with pytest.raises(ValueError, match="rail weights"):
        eng.Plan([("recv", 1, 0, 0, 0, 8, 0, False)], [], "t", None, [(0.5, 0.5)])
    with pytest.raises(ValueError, match="entries for"):
        eng.Plan([("send", 1, 0, 0, 0, 8, 0, False)], [], "t", None, [])
