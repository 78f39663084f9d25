"""Single-process tests: reduction kernels, the wire validator, the handshake, malformed frames,
planner schedules, configuration parsing."""
import os
import socket
import threading
import time

import numpy as np
import pytest

from r2comm import faults, planner
from r2comm._core import engine as eng, testing
from r2comm.transport import tcp
from r2comm.ops import DTYPES, as_op, SUM, MAX
from r2comm.errors import R2commArgumentError
from r2comm.planner.algorithms import allreduce_ring, allreduce_rd, blocks

NP = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}


@pytest.mark.parametrize("dt", [str(d) for d in DTYPES])
@pytest.mark.parametrize("op", ["SUM", "PROD", "MIN", "MAX"])
def test_reduce_kernels_match_numpy(dt, op):
    rng = np.random.default_rng(1)
    if np.dtype(dt).kind == "f":
        a = rng.standard_normal(1001).astype(dt) * 3
        b = rng.standard_normal(1001).astype(dt) * 3
        a[5], b[7] = np.nan, np.nan
    else:
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, 1001, dtype=dt, endpoint=True)
        b = rng.integers(info.min, info.max, 1001, dtype=dt, endpoint=True)
    for rev in (0, 1):
        d = a.copy()
        testing.reduce_local(d.ctypes.data, b.ctypes.data, d.nbytes, DTYPES[np.dtype(dt)],
                         as_op(op).code, rev)
        with np.errstate(all="ignore"):
            ref = (NP[op](b, a) if rev else NP[op](a, b)).astype(dt)
        assert np.array_equal(d.view(f"u{d.itemsize}"), ref.view(f"u{d.itemsize}")) or \
            np.array_equal(d, ref, equal_nan=True), f"{dt} {op} rev={rev}"


def test_float16_rounding_matches_numpy_exhaustively():
    a = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    b = np.roll(a, 12345)
    d = a.copy()
    testing.reduce_local(d.ctypes.data, b.ctypes.data, d.nbytes, DTYPES[np.dtype("float16")], 0)
    with np.errstate(all="ignore"):
        ref = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(d), nan)
    assert np.array_equal(d[~nan].view(np.uint16), ref[~nan].view(np.uint16))


def test_wire_header_round_trip_and_validation():
    h = testing.encode_header(1, 0, 9, 0, 3, 17, 2, 0xABCD, 4, 1000, 5000, 0)
    assert len(h) == 48 and testing.validate_header(h, 1 << 18) == 0
    bad_magic = b"XXXX" + h[4:]
    assert testing.validate_header(bad_magic, 1 << 18) == -1
    flipped = bytearray(h)
    flipped[20] ^= 1                       # any changed byte breaks the checksum
    assert testing.validate_header(bytes(flipped), 1 << 18) == -2
    too_long = testing.encode_header(1, 0, 9, 0, 3, 17, 2, 0, 0, 1 << 20, 1 << 21, 0)
    assert testing.validate_header(too_long, 1 << 18) == -4
    past_end = testing.encode_header(1, 0, 9, 0, 3, 17, 2, 0, 0, 100, 50, 0)
    assert testing.validate_header(past_end, 1 << 18) == -4
    bad_type = testing.encode_header(9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert testing.validate_header(bad_type, 1024) == -3
    rng = np.random.default_rng(0)         # random garbage is always rejected
    for _ in range(2000):
        assert testing.validate_header(rng.bytes(48), 1 << 18) < 0


def _listener():
    s = tcp.listen("127.0.0.1")
    return s, s.getsockname()[1]


def test_handshake_accepts_the_job_and_refuses_others():
    secret = os.urandom(32)
    lst, port = _listener()
    got = {}

    def acceptor(n):
        for _ in range(n):
            try:
                got.setdefault("ok", []).append(tcp.accept(lst, secret, 1, 2.0, 500))
            except tcp.HandshakeError as exc:
                got.setdefault("err", []).append(str(exc))
    t = threading.Thread(target=acceptor, args=(3,))
    t.start()
    fd, cid = tcp.connect("127.0.0.1", port, None, secret, 0, 1, 0, 2.0, 500)
    with pytest.raises(tcp.HandshakeError):       # wrong secret: acceptor's MAC does not verify
        tcp.connect("127.0.0.1", port, None, os.urandom(32), 0, 1, 0, 2.0, 500)
    raw = socket.create_connection(("127.0.0.1", port))   # a stray client speaking garbage
    raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
    t.join(5)
    raw.close()
    os.close(fd)
    lst.close()
    assert len(got["ok"]) == 1 and got["ok"][0][0] == 0 and got["ok"][0][3] == cid
    assert len(got["err"]) == 2


def test_malformed_frame_closes_the_rail_and_is_reported():
    e = eng.Engine(0, 2, [0, 1], 1 << 16, 0.5, 1.0, 1 << 20)
    e.start()
    a, b = socket.socketpair()
    a.setblocking(False)
    e.links.attach(1, 0, a.detach(), 7)
    b.sendall(b"\x00" * 48 + b"junk")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and e.rail_stats()[1][0][0] == "up":
        time.sleep(0.01)
    kinds = [ev["kind"] for ev in e.events_since(0)]
    assert e.rail_stats()[1][0][0] == "down"
    assert "bad_frame" in kinds and "rail_failed" in kinds
    assert b.recv(16) == b""               # the engine closed its end
    e.close()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_schedules_are_consistent(n):
    """Every send has exactly one matching receive on the peer, with the same size."""
    for build in (lambda r: allreduce_ring(r, n, 4000 + 8 * 13, 8),
                  lambda r: allreduce_rd(r, n, 64, 8),
                  lambda r: planner.build("bcast", r, n, 1000, 1, n - 1, 0),
                  lambda r: planner.build("reduce", r, n, 1000, 4, n // 2, 0),
                  lambda r: planner.build("allgather", r, n, 100, 4, 0, 0),
                  lambda r: planner.build("reduce_scatter_block", r, n, 100, 4, 0, 0),
                  lambda r: planner.build("alltoall", r, n, 100, 4, 0, 0)):
        sends, recvs = {}, {}
        for r in range(n):
            s = build(r).validate()
            for kind, peer, step, buf, off, nbytes, mode, owned in s.msgs:
                (sends if kind == "send" else recvs)[(r, peer, step) if kind == "send"
                                                     else (peer, r, step)] = nbytes
        assert sends == recvs


def test_ring_moves_the_bandwidth_optimal_volume():
    n, nbytes = 4, 4 << 20
    s = allreduce_ring(1, n, nbytes, 4)
    assert s.bytes_sent() == 2 * (n - 1) * nbytes // n
    assert [b[1] for b in blocks(10, 4, 4)] == [8, 12, 8, 12]


def test_ops_and_fault_specs_parse():
    assert as_op("sum") is SUM and as_op("MPI_MAX") is MAX
    with pytest.raises(R2commArgumentError):
        as_op("XOR")
    (f,) = faults.parse("rank=1,rail=0,after_ms=200,mode=silent")
    assert (f.rank, f.rail, f.mode, f.after_ms) == (1, 0, "silent", 200)
    assert len(faults.parse("rail=0;rail=1,mode=hard,restore_ms=50")) == 2
    with pytest.raises(ValueError):
        faults.parse("rail=0,mode=fast")


def test_hedge_mode_from_config(monkeypatch):
    from types import SimpleNamespace
    from r2comm.config import Config
    from r2comm.world import hedge_mode as _hedge_mode

    def boot(*addrs):
        return SimpleNamespace(endpoints=[{"rails": [(a, 0) for a in addrs]}])
    monkeypatch.delenv("R2COMM_HEDGE", raising=False)
    cfg = Config.from_env()
    assert _hedge_mode(cfg, boot("127.0.0.1", "127.0.0.2")) == 1    # one device: quiet only
    assert _hedge_mode(cfg, boot("198.18.0.1", "198.18.1.1")) == 2  # NICs: slow ones too
    for v, want in (("0", 0), ("1", 1), ("2", 2)):
        monkeypatch.setenv("R2COMM_HEDGE", v)
        assert _hedge_mode(Config.from_env(), boot("127.0.0.1")) == want
    monkeypatch.setenv("R2COMM_HEDGE", "3")
    with pytest.raises(R2commArgumentError):
        Config.from_env()
    e = eng.Engine(0, 1, [0], 65536, 1.0, 1.0, 1 << 20)
    try:
        with pytest.raises(ValueError):
            e.tuning.set_hedge(3)
        e.tuning.set_hedge(1)
    finally:
        e.close()
