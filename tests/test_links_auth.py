"""The links thread under hostile clients (issue 17, item 7; issue 28, items 4 and 6):
handshakes run off the accept path with one deadline each, pending handshakes are capped,
garbage is refused and reported (bounded, with a rate-limited log line), a real peer still
gets in meanwhile, also through a flood of idle connections, and no error of one connection
ends the thread or leaks what the connection took."""
import logging
import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import NoFaults

from r2comm.control import links as links_mod
from r2comm.transport import verbs as verbs_rails
from r2comm.transport import tcp
from r2comm.errors import R2commProtocolError

import flood_client


class FakeLinks:
    """What Links calls on an engine's links (Engine.links). fail: exceptions the next attach()
    calls raise (without taking the fd); due: (peer, rail) fail-back probes to report as due,
    once each."""

    def peer_ok(self, peer):
        return True      # (no peer is held lost here)

    def __init__(self):
        self.attached = []
        self.fail = []
        self.due = []
        self.probes_failed = []
        self.events = []

    def attach(self, peer, rail, fd, conn_id, *keys):
        if self.fail:
            raise self.fail.pop(0)
        self.attached.append((peer, rail, conn_id))
        os.close(fd)

    def attach_transport(self, peer, rail, transport, handle, conn_id, *keys):
        if self.fail:
            raise self.fail.pop(0)
        self.attached.append((peer, rail, conn_id))

    def reconnect_due(self):
        due, self.due = self.due, []
        return due

    def probe_timeout(self, peer, rail):
        return 1.0

    def probe_failed(self, peer, rail):
        self.probes_failed.append((peer, rail))

    def note_link_error(self, peer, rail, info):
        self.events.append(("link_error", peer, rail, info))

    def mark_unconnected(self, peer, rail, why):
        self.events.append(("rail_never_up", peer, rail, why))

    def link_state(self, peer, rail):
        return "up" if any(a[:2] == (peer, rail) for a in self.attached) else "down"


class FakeEngine:
    """What Links asks of an engine: its links and faults (Engine.links, Engine.faults)."""

    def __init__(self):
        self.links = FakeLinks()
        self.faults = NoFaults()


def _make_links(rank=1, peer_ep=None):
    """Rank `rank` of 2 with one rail: its listeners, and a links thread (not started)."""
    secret, job = os.urandom(32), os.urandom(8)
    lsts = [tcp.listen("127.0.0.1"), tcp.listen("127.0.0.1")]       # rail 0, control
    mine = {"rails": [lsts[0].getsockname()], "ctrl": lsts[1].getsockname()}
    other = peer_ep or {"rails": [("127.0.0.1", 1)], "ctrl": ("127.0.0.1", 1)}
    eps = [other, mine] if rank == 1 else [mine, other]
    boot = SimpleNamespace(rank=rank, size=2, rail_addrs=["127.0.0.1"], endpoints=eps,
                           listeners=lsts, secret=secret, job=job, transport="tcp")
    cfg = SimpleNamespace(rail_timeout_ms=500, sockbuf=0, notsent_lowat=0, connect_timeout=5.0)
    lk = links_mod.Links(FakeEngine(), boot, cfg)
    lk.ticks = 0

    def tick():
        lk.ticks += 1
    lk.on_tick = tick
    lk.handshake_timeout = 1.0
    return lk


@pytest.fixture
def links():
    """Rank 1 of 2 with one rail, its links thread running."""
    lk = _make_links()
    lk._thread.start()
    yield lk
    lk.close()


def _port(lk, i=0):
    return lk.boot.listeners[i].getsockname()[1]


def _connect(lk, timeout=2.0):
    return tcp.connect("127.0.0.1", _port(lk), None, lk.boot.secret, 0, 1, 0,
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
        assert _soon(lambda: links.engine.links.attached)
        assert links.engine.links.attached == [(0, 0, cid)]
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
    """Connections without a valid hello hold at most `anonymous` of the slots: the oldest
    are closed for newcomers at once, the rest at their deadline; a peer then gets in."""
    links.admission = links_mod.admission.Policy(total=8, anonymous=6, per_source=6)
    idle = [socket.create_connection(("127.0.0.1", _port(links))) for _ in range(20)]
    try:
        t0 = time.monotonic()
        closed = [s for s in idle if _closed_within(s, 0.05)]
        assert len(closed) >= 14 and time.monotonic() - t0 < 0.9   # the excess, at once
        assert _soon(lambda: sum("to make room" in w for _, w in links.rejected) >= 14)
        time.sleep(1.2)                             # the 6 pending ones reach their deadline
        assert all(_closed_within(s, 1.0) for s in idle if s not in closed)
        fd, _ = _connect(links)                     # and a real peer gets in again
        os.close(fd)
    finally:
        for s in idle:
            s.close()


def test_garbage_hellos_are_refused_reported_and_bounded(links, caplog):
    caplog.set_level(logging.WARNING, logger="r2comm")
    bad_job = tcp.hello(os.urandom(32), 0, 1, 0, 5, bytes(16))         # another job's secret
    wrong_rank = tcp.hello(links.boot.secret, 0, 7, 0, 5, bytes(16))
    kinds = [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40, bad_job, wrong_rank, os.urandom(44)]
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", _port(links, i % 2)))
        s.sendall(kinds[i % len(kinds)])
        assert _closed_within(s, 2.0)
        s.close()
    # a connector that does not know the secret: its proof fails
    s = socket.create_connection(("127.0.0.1", _port(links)))
    s.sendall(tcp.hello(links.boot.secret, 0, 1, 0, 5, bytes(16)))
    s.recv(48)
    s.sendall(bytes(32))
    assert _closed_within(s, 2.0)
    s.close()
    assert _soon(lambda: links.nrejected >= 301)
    assert links.nrejected == 301 and not links.engine.links.attached
    assert len(links.rejected) == links_mod.REJECTED_KEEP < 301
    why = " | ".join(w for _, w in links.rejected)
    assert "not an r2comm rail" in why and "another job/rank" in why
    assert "failed authentication" in links.rejected[-1][1]
    warned = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(warned) <= 2                    # rate-limited, not one line per connection
    fd, cid = _connect(links)
    os.close(fd)


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_idle_flood_does_not_lock_peers_out(links):
    """Issue 28 item 4: 200 idle connections (renewed when cut) and a trickling client on the
    listeners; a peer's connections (start-up, fail-back) still get through, each within 1 s."""
    stop, opened = threading.Event(), [0]
    ports = [_port(links, 0), _port(links, 1)]
    attackers = [threading.Thread(target=flood_client.idle, args=(ports, 200, stop, opened, 30)),
                 threading.Thread(target=flood_client.trickle, args=(ports[0], stop, 30))]
    for t in attackers:
        t.start()
    try:
        assert _soon(lambda: opened[0] >= 200, 10.0)
        time.sleep(0.3)
        took = []
        for k in range(10):
            for rail, i in ((0, 0), (tcp.CTRL_RAIL, 1)):
                t0 = time.monotonic()
                fd, _ = tcp.connect("127.0.0.1", _port(links, i), None, links.boot.secret,
                                    0, 1, rail, 1.0, 500)
                took.append(time.monotonic() - t0)
                os.close(fd)
            time.sleep(0.05)
        assert _soon(lambda: len(links.engine.links.attached) == 20)
        assert max(took) < 1.0, took
        assert opened[0] > 200                          # the server did cut (and we renewed)
        assert sum("to make room" in w for _, w in links.rejected) >= 50
        assert links.alive
    finally:
        stop.set()
        for t in attackers:
            t.join(10)


def test_pending_limits_per_source_and_for_unknown_sources(links):
    """One source holds at most per_source handshakes without a valid hello, all sources
    together at most `anonymous` (the oldest go); a peer's connection gets in."""
    per = links.admission.per_source
    links.admission.anonymous = 2 * per
    idle = {}
    try:
        for i in range(3):
            for _ in range(10):
                s = socket.socket()
                s.bind((f"127.0.0.{10 + i}", 0))
                s.connect(("127.0.0.1", _port(links)))
                idle[s] = i
        time.sleep(0.3)
        left = [i for s, i in idle.items() if not _closed_within(s, 0.01)]
        assert len(left) == 2 * per
        assert max(left.count(i) for i in range(3)) == per
        fd, _ = _connect(links)                          # 127.0.0.1: a peer's address
        os.close(fd)
        assert _soon(lambda: len(links.engine.links.attached) == 1)
    finally:
        for s in idle:
            s.close()


def test_attach_errors_neither_end_the_thread_nor_leak(links):
    """Issue 28 item 6, accepting side: an attach that raises (a corrupt address, no memory,
    a bad argument) closes that connection (the peer sees EOF), counts and events it; the
    thread lives on and the next connection attaches."""
    assert _soon(lambda: links.ticks > 0)               # the thread made its selector
    before = _fds()
    links.engine.links.fail = [R2commProtocolError("corrupt QP address"), MemoryError(),
                         ValueError("no such peer/rail"), KeyError("x")] * 3
    for _ in range(12):
        fd, _ = _connect(links)
        s = socket.socket(fileno=fd)
        assert _closed_within(s, 2.0)
        s.close()
    assert _soon(lambda: links.nerrors == 12)
    assert links.alive
    assert len(links.engine.links.events) == 12 and links.engine.links.events[0][1:3] == (0, 0)
    assert "corrupt QP address" in links.engine.links.events[0][3]
    fd, cid = _connect(links)
    os.close(fd)
    assert _soon(lambda: links.engine.links.attached == [(0, 0, cid)])
    assert _fds() <= before


def test_failed_failback_attach_keeps_probing(monkeypatch):
    """Issue 28 item 6, connecting side: a fail-back probe whose attach raises is closed and
    counted; the thread lives, and the next probe brings the rail back."""
    srv = tcp.listen("127.0.0.1")
    lk = _make_links(rank=0, peer_ep={"rails": [srv.getsockname()], "ctrl": srv.getsockname()})
    lk._thread.start()
    got = []

    def peer():                                          # rank 1's side of two probes
        for _ in range(2):
            try:
                got.append(tcp.accept(srv, lk.boot.secret, 1, 5.0, 500))
            except (OSError, tcp.HandshakeError) as exc:
                got.append(exc)
    t = threading.Thread(target=peer)
    t.start()
    try:
        before = _fds()
        lk.engine.links.fail = [R2commProtocolError("corrupt QP address")]
        lk.engine.links.due = [(1, 0)]
        assert _soon(lambda: len(got) == 1, 5.0)
        s = socket.socket(fileno=got[0][2])
        assert _closed_within(s, 2.0)                    # the connector closed its end
        s.close()
        time.sleep(0.1)
        assert lk._thread.is_alive(), "the links thread died"
        assert _soon(lambda: lk.nerrors == 1, 5.0)
        assert lk.engine.links.probes_failed == [(1, 0)]
        lk.engine.links.due = [(1, 0)]                   # the next probe: fail-back happens
        assert _soon(lambda: lk.engine.links.attached and
                     lk.engine.links.attached[0][:2] == (1, 0), 5.0)
        t.join(5)
        os.close(got[1][2])
        assert lk.alive and _fds() <= before
    finally:
        t.join(5)
        lk.close()
        srv.close()


def test_verbs_handover_released_when_attach_transport_raises(links, monkeypatch):
    """Issue 28 item 6, verbs: the connection exchange() handed over is discarded (QP, slots,
    companion socket) when attach_transport raises, and the error is counted, not fatal."""
    handles, discarded = iter(range(1000, 1010)), []

    def exchange(device, fd, tx, rx, timeout):
        os.close(fd)                                     # exchange() owns fd
        return next(handles)
    monkeypatch.setattr(verbs_rails, "exchange", exchange)
    monkeypatch.setattr(verbs_rails, "discard", discarded.append)
    monkeypatch.setattr(verbs_rails, "load",
                        lambda: (SimpleNamespace(transport_address=lambda: 1), None))
    links.nic = verbs_rails.TRANSPORT
    links.boot.rail_devices = [None]
    links.engine.links.fail = [MemoryError("no memory for a connection's transport state")]
    fd, _ = _connect(links)
    os.close(fd)
    assert _soon(lambda: links.nerrors == 1)
    assert discarded == [1000]
    fd, cid = _connect(links)
    os.close(fd)
    assert _soon(lambda: links.engine.links.attached == [(0, 0, cid)])
    assert discarded == [1000] and links.alive


def test_link_errors_reach_the_engine_events():
    """Engine.links.note_link_error, what Links calls for a connection's error: a `link_error` event
    in comm.events / on_event (engine.events_since)."""
    from r2comm._core import engine as eng
    e = eng.Engine(0, 2, [0, 1], 1 << 16, 5.0, 10.0, 1 << 20)
    try:
        e.links.note_link_error(1, 0, "attaching (rank 1, rail 0): R2commProtocolError: corrupt")
        ev = e.events_since(0)[-1]
        assert (ev["kind"], ev["peer"], ev["rail"]) == ("link_error", 1, 0)
        assert "corrupt" in ev["info"]
    finally:
        e.close()


def test_exchange_turns_a_corrupt_qp_address_into_connection_error(monkeypatch):
    """Issue 28 item 6, verbs: a peer's queue-pair address that does not decode (another
    version, corrupt) is a ConnectionError like any failed exchange (the links thread closes
    that connection), and the unconnected QP and the socket are released at once."""
    import hashlib
    import hmac
    from r2comm._core import verbs as vmod
    freed = []

    class FakeConn:                          # VerbsConn's calls; connect() decodes like the real
        def __init__(self, device, side_fd):
            self.side = side_fd

        def address(self):
            return b"A" * 40

        def connect(self, theirs):
            raise R2commProtocolError(f"QP address is {len(theirs)} bytes, expected 40")

        def __del__(self):
            os.close(self.side)
            freed.append(True)
    monkeypatch.setattr(vmod, "VerbsConn", FakeConn, raising=False)
    a, b = socket.socketpair()
    tx, rx = os.urandom(32), os.urandom(32)
    bogus = b"\x00" * 7
    b.sendall(verbs_rails.QPX_MAGIC + bytes([len(bogus)]) + bogus +
              hmac.new(tx, b"qpx" + bogus, hashlib.sha256).digest()[:verbs_rails.TAG_LEN])
    before = _fds()
    with pytest.raises(ConnectionError, match="QP address"):
        verbs_rails.exchange(None, a.detach(), rx, tx, 2.0)
    assert freed == [True]                   # freed when exchange() returned, not later
    assert _fds() == before - 1              # its socket (fd) and the QP's copy are closed
    b.settimeout(1.0)
    sent = b.recv(4096)                      # this side's address and tag, then EOF
    assert sent.startswith(verbs_rails.QPX_MAGIC) and b.recv(100) == b""
    b.close()


def test_accept_without_a_free_fd_rests_the_listener(links):
    """accept() failing with EMFILE leaves the connection queued and the listener readable:
    the thread rests that listener ACCEPT_PAUSE_S instead of spinning on it (before: thousands
    of refusals a second, one CPU busy), and takes the queued connection once an fd is free:
    a real peer's handshake then completes. The clients live in another process (this one has
    no fd to spare)."""
    import resource
    import subprocess
    import sys
    port = _port(links)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    client = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        f"s = [socket.create_connection(('127.0.0.1', {port})) for _ in range(3)]\n"
        "print('up', flush=True); time.sleep(30)")], stdout=subprocess.PIPE, text=True)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (_fds(), hard))    # one fd free
        try:
            assert client.stdout.readline().strip() == "up"
            time.sleep(1.0)
            refused = [w for _, w in links.rejected if "accept failed" in w]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # one try per ACCEPT_PAUSE_S (0.1 s) and listener: about 10 in the second, not thousands
        assert 1 <= len(refused) <= 25, len(refused)
        assert "Too many open files" in refused[0], refused[0]
        fd, _ = _connect(links, timeout=5.0)        # the listener accepts again
        os.close(fd)
    finally:
        client.kill()
        client.wait(10)


def _make_pair(addr="127.0.0.1"):
    """Ranks 0 and 1 of a job, one rail each, every listener on `addr`: their links (threads
    not started), sharing one secret and endpoint table."""
    secret, job = os.urandom(32), os.urandom(8)
    lsts = [[tcp.listen(addr), tcp.listen(addr)] for _ in range(2)]      # rail 0, control
    eps = [{"rails": [ls[0].getsockname()], "ctrl": ls[1].getsockname()} for ls in lsts]
    cfg = SimpleNamespace(rail_timeout_ms=500, sockbuf=0, notsent_lowat=0, connect_timeout=3.0)
    out = []
    for r in range(2):
        boot = SimpleNamespace(rank=r, size=2, rail_addrs=[addr], endpoints=eps,
                               listeners=lsts[r], secret=secret, job=job, transport="tcp")
        out.append(links_mod.Links(FakeEngine(), boot, cfg))
    return out


class _Segment:
    """A file in /dev/shm under the name a local pair's shared-memory link gives its segment
    (mode 0600: another user sees the name only), as during a link's set-up."""

    def __init__(self, boot):
        from r2comm.transport import shm
        self.path = "/dev/shm" + shm.segment_name(boot.secret, os.getpid(), 0, 1, 0x1234)
        os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))

    def close(self):
        os.unlink(self.path)


def _flood(args):
    """The flood client (tests/flood_client.py) as another user; stopped by closing stdin."""
    import subprocess
    return subprocess.Popen(flood_client.command(args), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _captured_hello(boot, src, dst, rail):
    """The HELLO a rank sends when it opens (src -> dst, rail), as seen on the wire."""
    lst = tcp.listen("127.0.0.1")
    seen = []
    t = threading.Thread(target=flood_client.observe_hellos, args=(lst, seen))
    t.start()
    with pytest.raises((OSError, tcp.HandshakeError)):
        tcp.connect("127.0.0.1", lst.getsockname()[1], None, boot.secret, src, dst,
                    rail, 2.0, 500)
    t.join(5)
    lst.close()
    return seen[0]


@pytest.mark.parametrize("attack", ["shm-names", "replayed-hello"])
def test_hellos_without_the_proof_take_no_claim(attack):
    """Issue 40 item 3: another user sends HELLOs for (rank 1 -> rank 0, control) from changing
    127.x addresses and never proves the secret: built from the segment names it can list in
    /dev/shm (the job id was their first field), or replayed from one seen on the wire (a
    network observer). Rank 0's first use of rank 1 still brings every connection up within 2 s
    (its deadline: 3 s). Before, the job id was public and every such HELLO took the pair's
    claim for up to 2 s: rank 0's own connect to rank 1 was BUSY until its deadline (the
    control connection did not come up)."""
    lk0, lk1 = _make_pair()
    seg = _Segment(lk0.boot)
    hello = "shm" if attack == "shm-names" else \
        _captured_hello(lk0.boot, 1, 0, tcp.CTRL_RAIL).hex()
    flood = _flood([8, 0, _port(lk0, 1), f"hellos={hello}", "from=1", "to=0",
                    f"rail={tcp.CTRL_RAIL}", f"version={tcp.VERSION}"])
    try:
        for lk in (lk0, lk1):
            lk._thread.start()
        time.sleep(1.0)                     # the flood is under way
        t0 = time.monotonic()
        lk0.connect_for([1])
        took = time.monotonic() - t0
        assert sorted(a[:2] for a in lk0.engine.links.attached) == [(1, 0), (1, 1)], \
            (lk0.engine.links.attached, lk0.engine.links.events)
        assert took < 2.0, took
    finally:
        out = flood.communicate("", timeout=20)[0]
        for lk in (lk0, lk1):
            lk.close()
        seg.close()
    got = flood_client.result(out)
    assert got["hellos"] >= 50, out
    if attack == "shm-names":
        assert got["answered"] == 0, out        # refused before this side's proof


@pytest.mark.parametrize("hellos", ["idle", "shm"])
def test_flood_from_a_peers_own_address_does_not_block_start_up(hellos):
    """Issue 40 item 2: the ranks listen on 127.0.0.9, and another user binds 127.0.0.9 too and
    floods rank 1's listeners from it: 200 idle connections renewed when cut (and HELLOs built
    from the /dev/shm names, never proven). Rank 0's start-up connections to rank 1 come up,
    and so does each of ten more connections (retried as the links retry), within 2 s (the
    flood keeps rank 1's thread
    accepting and closing a thousand or more connections a second on this shared 2-core
    machine). Before, a source that was a peer's address was exempt from every cap on sources,
    and those HELLOs counted as valid ones: "Connection reset by peer"."""
    addr = "127.0.0.9"
    lk0, lk1 = _make_pair(addr)
    seg = _Segment(lk0.boot)
    extra = [] if hellos == "idle" else ["hellos=shm", "from=0", "to=1",
                                         f"rail={tcp.CTRL_RAIL}", f"version={tcp.VERSION}"]
    flood = _flood([10, 200, _port(lk1, 1), _port(lk1, 0), f"src={addr}", f"dst={addr}",
                    *extra])
    took = []
    try:
        lk1._thread.start()
        time.sleep(1.5)                     # the flood holds what it can
        t0 = time.monotonic()
        outcome = lk0.establish(3.0)
        took.append(time.monotonic() - t0)
        assert all(why is None for why in outcome.values()), outcome
        # each dialed as the links dial (start-up and first use retry a refused attempt): its
        # HELLO takes it out of the flood's reach once read, but on a loaded machine the flood
        # (same address) can pass it first and it is closed to make room (CI met 1 such
        # attempt in 10); every connection must still be up within 2 s
        tries = []
        for k in range(10):
            t0 = time.monotonic()
            for attempt in range(1, 100):
                try:
                    fd, _ = tcp.connect(addr, _port(lk1, 1), addr, lk0.boot.secret, 0, 1,
                                        tcp.CTRL_RAIL, 3.0, 500)
                    break
                except tcp.HandshakeError:
                    if time.monotonic() - t0 > 2.0:
                        raise
            took.append(time.monotonic() - t0)
            tries.append(attempt)
            os.close(fd)
        assert max(took) < 2.0, (took, tries)
    finally:
        out = flood.communicate("", timeout=20)[0]
        for lk in (lk0, lk1):
            lk.close()
        seg.close()
    assert flood_client.result(out)["opened"] > 200, out          # cut and renewed


def test_admission_policy_keeps_valid_hellos_and_the_newest():
    """admission.Policy (links and the failure detector): a newcomer over its address's cap
    closes that address's oldest connection without a valid hello, over the anonymous cap the
    oldest anonymous one; a connection whose hello checked is never closed for an anonymous
    newcomer, whatever its address, and the newcomer is refused only when every slot holds
    one; a pair keeps its newest `per_pair`."""
    from r2comm.control.admission import Policy

    class Hs:
        def __init__(self, src, since, pair=None):
            self.addr, self.since, self.pair = (src, 1), since, pair
            self.got_hello = pair is not None
    pol = Policy(total=6, anonymous=4, per_source=2, per_pair=2)
    pend = {1: Hs("127.0.0.9", 1, (0, 0)), 2: Hs("127.0.0.9", 2), 3: Hs("127.0.0.9", 3)}
    assert pol.room(pend, "127.0.0.9") == ([(2, "more than 2 without a valid hello from "
                                                "127.0.0.9")], True)
    pend.update({4: Hs("10.0.0.1", 4), 5: Hs("10.0.0.2", 5)})
    assert pol.room(pend, "10.0.0.3")[0][0][0] == 2                # the oldest anonymous
    del pend[2]
    assert pol.room(pend, "10.0.0.3") == ([], True)
    full = {k: Hs("127.0.0.9", k, (k % 3, 0)) for k in range(6)}   # every slot: a valid hello
    assert pol.room(full, "127.0.0.9") == ([], False)
    full[9] = Hs("127.0.0.9", 9, (0, 0))
    assert pol.pair_excess(full, 9) == [0]                        # pair (0, 0): 0, 3, 9
    with pytest.raises(ValueError):
        Policy(total=4, anonymous=8)
