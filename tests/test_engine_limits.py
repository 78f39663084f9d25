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

from r2comm._core import engine as eng  # noqa: E402

CS = fuzz_wire.CS
U8 = fuzz_wire.U8
F_DATA, F_ABORT, FL_P2P = fuzz_wire.F_DATA, fuzz_wire.F_ABORT, fuzz_wire.FL_P2P


class Rig:
    """Rank 0 of 2 with two rails and the control connection to rank 1 on the fuzz transport."""

    def __init__(self, window=4 * CS):
        self.e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, window)
        for k in (0, 1, 2):
            self.e.fuzz_attach(1, k, 7 + k)
        self.keep = []

    def recv(self, buf, comm, seq, sig, step=0, mode=0, timeout=5.0):
        """Post a collective receive of buf from rank 1 (copy mode)."""
        plan = eng.Plan([("recv", 1, step, 0, 0, buf.nbytes, mode, False)], [], "t")
        bw = eng.Buffer(buf, True)
        self.keep += [plan, bw]
        return self.e.post(plan, bw.ptr, 0, 0, U8, 0, comm, seq, sig, timeout, [0, 1])

    def p2p_recv(self, buf, tag):
        plan = eng.Plan([("recv", 1, 0, 0, 0, buf.nbytes, 0, False)], [], "t")
        bw = eng.Buffer(buf, True)
        self.keep += [plan, bw]
        return self.e.post(plan, bw.ptr, 0, 0, U8, 0, 1, 0, 0, 5.0, [0, 1], 1, tag, buf.nbytes)

    def feed(self, rail, data):
        used, up, _ = self.e.fuzz_feed(1, rail, data)
        assert used == len(data)
        return up

    def close(self):
        self.e.close()
        for b in self.keep:
            if isinstance(b, eng.Buffer):
                b.release()


def data_header(comm, seq, chunk, ln, total, sig=0, flags=0, step=0, aux=0):
    return eng.encode_header(F_DATA, flags, U8, 0, comm, seq, step, sig, chunk, ln, total, aux)


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
    head = data_header(1, 0, 0, CS, total, sig=0xA1)
    assert rig.feed(0, head + good[:split])
    assert rig.feed(1, head + good)                 # applied: chunk 0 complete
    assert rig.feed(0, late[split:])                # the rest of the late copy
    assert buf[:CS].tobytes() == good, "a late copy wrote into a chunk already applied"
    assert (buf[CS:] == 0xEE).all()
    rig.e.fuzz_sent(0)
    rig.e.fuzz_sent(1)


def test_late_copy_into_a_reducing_receive_is_not_applied_twice(rig):
    """The same interleaving on a reducing receive (staged per rail): the chunk is reduced in
    once, from the first complete copy."""
    buf = np.ones(CS, np.uint8)
    rig.recv(buf, 1, 0, 0xB2, mode=1)
    head = data_header(1, 0, 0, CS, CS, sig=0xB2)
    assert rig.feed(0, head + bytes([2]) * 100)
    assert rig.feed(1, head + bytes([2]) * CS)
    assert rig.feed(0, bytes([9]) * (CS - 100))
    assert (buf == 3).all(), np.unique(buf)
