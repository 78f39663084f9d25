"""The links thread under hostile clients (issue 17, item 7): handshakes run off the accept
path with one deadline each, pending handshakes are capped, garbage is refused and reported
(bounded, with a rate-limited log line), and a real peer still gets in meanwhile."""
import logging
import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from r2comm import links as links_mod
from r2comm._core import tcp


class FakeEngine:
    def __init__(self):
        self.attached = []

    def attach(self, peer, rail, fd, conn_id, *keys):
        self.attached.append((peer, rail, conn_id))
        os.close(fd)

    def injected(self, rail, peer):
        return False

    def reconnect_due(self):
        return []


@pytest.fixture
def links():
    """Rank 1 of 2 with one rail: its listeners, and a running links thread."""
    secret, job = os.urandom(32), os.urandom(8)
    lsts = [tcp.listen("127.0.0.1"), tcp.listen("127.0.0.1")]       # rail 0, control
    eps = [{"rails": [("127.0.0.1", 1)], "ctrl": ("127.0.0.1", 1)},
           {"rails": [lsts[0].getsockname()], "ctrl": lsts[1].getsockname()}]
    boot = SimpleNamespace(rank=1, size=2, rail_addrs=["127.0.0.1"], endpoints=eps,
                           listeners=lsts, secret=secret, job=job)
    cfg = SimpleNamespace(rail_timeout_ms=500, sockbuf=0, notsent_lowat=0)
    lk = links_mod.Links(FakeEngine(), boot, cfg)
    lk.ticks = 0

    def tick():
        lk.ticks += 1
    lk.on_tick = tick
    lk.handshake_timeout = 1.0
    lk._thread.start()
    yield lk
    lk.close()


def _port(lk, i=0):
    return lk.boot.listeners[i].getsockname()[1]


def _connect(lk, timeout=2.0):
    return tcp.connect("127.0.0.1", _port(lk), None, lk.boot.secret, lk.boot.job, 0, 1, 0,
                       timeout, 500)


def _closed_within(sock, limit):
    """True if the server closes sock within limit seconds."""
    sock.settimeout(limit)
    try:
        return sock.recv(100) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _soon(cond, limit=2.0):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_slow_handshake_holds_neither_the_thread_nor_past_its_deadline(links):
    hello = struct.pack("!4sH", b"R2CH", 1) + bytes(38)
    slow = socket.create_connection(("127.0.0.1", _port(links)))
    stop = threading.Event()

    def trickle():
        for i in range(len(hello)):
            if stop.wait(0.2):
                return
            try:
                slow.send(hello[i:i + 1])
            except OSError:
                return
    t = threading.Thread(target=trickle)
    t.start()
    time.sleep(0.3)
    try:
        t0, ticks0 = time.monotonic(), links.ticks
        fd, cid = _connect(links)                  # a real peer gets in at once meanwhile
        os.close(fd)
        assert time.monotonic() - t0 < 0.5
        assert _soon(lambda: links.engine.attached)
        assert links.engine.attached == [(0, 0, cid)]
        # one deadline for the whole handshake (1 s here), though bytes keep coming
        assert _closed_within(slow, 2.5)
        assert time.monotonic() - t0 < 2.5
        assert links.ticks - ticks0 >= 10          # the thread kept ticking (events, probes)
        assert _soon(lambda: any("not completed in time" in w for _, w in links.rejected))
    finally:
        stop.set()
        t.join(5)
        slow.close()


def test_pending_handshakes_are_capped(links):
    links.max_pending = 8
    idle = [socket.create_connection(("127.0.0.1", _port(links))) for _ in range(20)]
    try:
        t0 = time.monotonic()
        closed = [s for s in idle if _closed_within(s, 0.05)]
        assert len(closed) >= 12 and time.monotonic() - t0 < 0.9   # the excess, at once
        assert _soon(lambda: sum("already pending" in w for _, w in links.rejected) >= 12)
        time.sleep(1.2)                             # the 8 pending ones reach their deadline
        assert all(_closed_within(s, 1.0) for s in idle if s not in closed)
        fd, _ = _connect(links)                     # and a real peer gets in again
        os.close(fd)
    finally:
        for s in idle:
            s.close()


def test_garbage_hellos_are_refused_reported_and_bounded(links, caplog):
    caplog.set_level(logging.WARNING, logger="r2comm")
    bad_job = tcp.HELLO.pack(tcp.MAGIC, tcp.VERSION, os.urandom(8), 0, 1, 0, 5, bytes(16))
    wrong_rank = tcp.HELLO.pack(tcp.MAGIC, tcp.VERSION, links.boot.job, 0, 7, 0, 5, bytes(16))
    kinds = [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40, bad_job, wrong_rank, os.urandom(44)]
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", _port(links, i % 2)))
        s.sendall(kinds[i % len(kinds)])
        assert _closed_within(s, 2.0)
        s.close()
    # a connector that does not know the secret: its proof fails
    s = socket.create_connection(("127.0.0.1", _port(links)))
    s.sendall(tcp.HELLO.pack(tcp.MAGIC, tcp.VERSION, links.boot.job, 0, 1, 0, 5, bytes(16)))
    s.recv(48)
    s.sendall(bytes(32))
    assert _closed_within(s, 2.0)
    s.close()
    assert _soon(lambda: links.nrejected >= 301)
    assert links.nrejected == 301 and not links.engine.attached
    assert len(links.rejected) == links_mod.REJECTED_KEEP < 301
    why = " | ".join(w for _, w in links.rejected)
    assert "not an r2comm rail" in why and "another job/rank" in why
    assert "failed authentication" in links.rejected[-1][1]
    warned = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(warned) <= 2                    # rate-limited, not one line per connection
    fd, cid = _connect(links)
    os.close(fd)
