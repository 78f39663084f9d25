"""TCP rail transport, cold path: listen, connect, accept, and the authenticated handshake.

Every connection proves knowledge of the per-job secret both ways before the engine sees it:
  connector -> HELLO(magic, version, tag, src rank, dst rank, rail, connection id, nonce_c)
  acceptor  -> nonce_s + HMAC(secret, "acc" | HELLO | nonce_s)
  connector -> HMAC(secret, "con" | HELLO | nonce_s)
  acceptor  -> HMAC(secret, "ok" | HELLO | nonce_s)[:16]   (admitted)
The HELLO's tag is HMAC(secret, "hel" | the HELLO with a zero tag)[:8]: no job id travels, and
only a holder of the secret (or whoever replays a HELLO seen on the wire) makes a HELLO that the
acceptor answers.
The acceptor admits the connection (admit(): a claim on the pair's slot) only once the
connector's proof checked, then says so; a refusal closes the socket before that last message,
so the connector never takes a refused connection for a working one. Anything else (wrong tag,
wrong rank, bad MAC, short read, timeout) closes the socket. Both sides then derive one key per
direction from the secret and both nonces (frame MACs, R2COMM_INTEGRITY=mac); take_keys(fd)
hands them to whoever attaches the connection.

The accepting side is a non-blocking state machine (ServerHandshake) so that one thread can
drive many handshakes at once, each under one deadline: a client that trickles bytes holds a
slot, never the thread.

TRANSPORT is the kind's object (kind.Transport): a TCP rail is the authenticated socket itself,
handed to the engine's built-in table (_core/tcp.pxd). Every other kind's connections start with
this handshake too, and the control connections are TCP: the control plane reaches listen,
connect, ServerHandshake and take_keys through this object (r2comm.transport.CONTROL).
"""
import hashlib
import hmac
import os
import select
import socket
import struct
import time

from .kind import Transport

MAGIC = b"R2CH"
VERSION = 2            # 2: a tagged HELLO (no job id) and the acceptor's admission message
CTRL_RAIL = 0xFFFF
HELLO = struct.Struct("!4sH8siiHI16s")
TAG_LEN = 8            # the HELLO's tag
MAC_LEN = 32
ACK_LEN = 16           # the acceptor's "admitted"
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
FRAME_KEY_LEN = 32
_keys = {}          # fd -> (tx key, rx key) of a connection that has not been attached yet


class HandshakeError(Exception):
    """The peer did not prove the job secret, or spoke something else."""


class Refused(HandshakeError):
    """The acceptor does not want this connection (its check() or admit() said no)."""


def listen(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 0))
    s.listen(512)
    return s


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise HandshakeError("connection closed during handshake")
        buf += part
    return bytes(buf)


def _mac(secret, label, hello, nonce_s):
    return hmac.new(secret, label + hello + nonce_s, hashlib.sha256).digest()


def hello(secret, src, dst, rail, conn_id, nonce):
    """The tagged HELLO of a connection src -> dst on `rail`."""
    fields = (src, dst, rail, conn_id, nonce)
    tag = hmac.new(secret, b"hel" + HELLO.pack(MAGIC, VERSION, bytes(TAG_LEN), *fields),
                   hashlib.sha256).digest()[:TAG_LEN]
    return HELLO.pack(MAGIC, VERSION, tag, *fields)


def _hello_valid(secret, raw):
    """raw (a HELLO of this version) carries the tag of the job secret."""
    _m, _v, tag, src, dst, rail, conn_id, nonce = HELLO.unpack(raw)
    return hmac.compare_digest(tag, HELLO.unpack(hello(secret, src, dst, rail, conn_id, nonce))[2])


def _derive_keys(secret, hello, nonce_s, acceptor):
    """Per-connection, per-direction frame-MAC keys: fresh for every connection (both nonces),
    so a frame recorded on one connection never verifies on another."""
    c2s = hmac.new(secret, b"kcs" + hello + nonce_s, hashlib.sha256).digest()
    s2c = hmac.new(secret, b"ksc" + hello + nonce_s, hashlib.sha256).digest()
    return (s2c, c2s) if acceptor else (c2s, s2c)


def take_keys(fd):
    """(tx key, rx key) of the connection handed out as fd by connect/accept (once)."""
    return _keys.pop(fd, (b"", b""))


def tune(sock, rail_timeout_ms, sockbuf=0, lowat=0):
    """Socket options for a rail: no Nagle, kernel aids for dead-peer detection, and a fixed
    receive buffer when sockbuf > 0: receive autotuning starts small and grows per connection,
    which left some connections of a job ~40% slower at 0.5-2 MiB on loopback than others. The
    send buffer keeps autotuning: a fixed large one queues tens of ms of data in the kernel on a
    slow NIC, where the engine can no longer steer it to a faster rail. lowat > 0 sets
    TCP_NOTSENT_LOWAT: the socket takes more only when less than lowat bytes wait unsent, so
    the engine's acks (small frames written between chunks) queue behind at most that much of
    this connection's data instead of a whole autotuned send buffer; under traffic in both
    directions on a shaped NIC that is the difference between ~95% and ~60% of its rate."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    # no TCP_USER_TIMEOUT: the engine judges a quiet rail itself at its deadline (from
    # TCP_INFO), and since Linux 5.11 the user timeout also aborts a connection whose peer
    # keeps its receive window shut that long, i.e. a peer process that is merely stopped
    sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, 0)
    if sockbuf > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
    if lowat > 0:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lowat)


def connect(addr, port, local_addr, secret, src, dst, rail, timeout, rail_timeout_ms,
            sockbuf=0, lowat=0, conn_id=None):
    """Open and authenticate one connection; returns (fd, connection id). conn_id: the
    connection id to announce (default random; a shared-memory link names its segment by it).
    Raises OSError (ConnectionRefusedError: nothing listens there) or HandshakeError (the
    acceptor closed before admitting it: refused, busy, or not this job)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        if local_addr:
            sock.bind((local_addr, 0))
        sock.connect((addr, port))
        if conn_id is None:
            conn_id = struct.unpack("!I", os.urandom(4))[0]
        msg = hello(secret, src, dst, rail, conn_id, os.urandom(16))
        sock.sendall(msg)
        reply = _recv_exact(sock, 16 + MAC_LEN)
        nonce_s, mac = reply[:16], reply[16:]
        if not hmac.compare_digest(mac, _mac(secret, b"acc", msg, nonce_s)):
            raise HandshakeError(f"rank {dst} at {addr}:{port} failed to prove the job secret")
        sock.sendall(_mac(secret, b"con", msg, nonce_s))
        if not hmac.compare_digest(_recv_exact(sock, ACK_LEN),
                                   _mac(secret, b"ok", msg, nonce_s)[:ACK_LEN]):
            raise HandshakeError(f"rank {dst} at {addr}:{port}: a bad admission message")
        tune(sock, rail_timeout_ms, sockbuf, lowat)
        sock.setblocking(False)
        keys = _derive_keys(secret, msg, nonce_s, False)
        fd = sock.detach()
        _keys[fd] = keys
        return fd, conn_id
    except BaseException:
        sock.close()
        raise


class ServerHandshake:
    """The accepting side of one handshake, driven without blocking: step() when the socket is
    readable (or its deadline passed) returns None while more is needed, the result
    (peer rank, rail, fd, connection id) once the connector proved the secret and admit() took
    it (the socket is then detached: fd belongs to the caller), or raises HandshakeError
    (Refused: check() or admit() said no) or OSError; the caller closes it. check(peer, rail)
    runs on a valid HELLO, before this side's proof, and must have no effect; admit(peer, rail)
    runs once the connector's proof checked (where a claim may be taken). One deadline covers
    the whole handshake."""

    def __init__(self, sock, addr, secret, me, deadline, rail_timeout_ms, admit=None,
                 sockbuf=0, lowat=0, check=None):
        self.sock, self.addr, self.deadline = sock, addr, deadline
        self.since = time.monotonic()
        self.pair = None                  # (peer rank, rail) once a valid HELLO named them
        self._secret, self._me, self._admit, self._check = secret, me, admit, check
        self._tune = (rail_timeout_ms, sockbuf, lowat)
        self._buf = bytearray()
        self._hello = None
        self._nonce_s = None
        sock.setblocking(False)

    def fileno(self):
        return self.sock.fileno()

    @property
    def got_hello(self):
        """The connector sent a HELLO with a valid tag for this rank (it got this side's proof)."""
        return self._hello is not None

    def _who(self):
        return f"connection from {self.addr[0]}:{self.addr[1]}"

    def step(self, now=None):
        return self._step(time.monotonic() if now is None else now)

    def close(self):
        self.sock.close()

    def _step(self, now):
        need = HELLO.size if self._hello is None else MAC_LEN
        while len(self._buf) < need:
            try:
                part = self.sock.recv(need - len(self._buf))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise HandshakeError(f"{self._who()}: {exc}") from exc
            if not part:
                raise HandshakeError(f"{self._who()}: closed during handshake")
            self._buf += part
            if self._hello is None and len(self._buf) >= 4 and self._buf[:4] != MAGIC:
                raise HandshakeError(f"{self._who()} is not an r2comm rail")
        if len(self._buf) < need:
            if now >= self.deadline:
                raise HandshakeError(f"{self._who()}: handshake not completed in time "
                                     f"({len(self._buf)} of {need} bytes)")
            return None
        if self._hello is None:
            msg, self._buf = bytes(self._buf), bytearray()
            magic, ver, _tag, src, dst, rail, _conn_id, _nonce = HELLO.unpack(msg)
            if magic != MAGIC or ver != VERSION:
                raise HandshakeError(f"{self._who()} is not an r2comm rail of this version")
            if dst != self._me or not _hello_valid(self._secret, msg):
                raise HandshakeError(f"{self._who()} belongs to another job/rank")
            if self._check is not None and not self._check(src, rail):
                raise Refused(f"rank {src} rail {rail}: refused (not wanted on this side)")
            self._hello, self._nonce_s, self.pair = msg, os.urandom(16), (src, rail)
            self._send(self._nonce_s + _mac(self._secret, b"acc", msg, self._nonce_s))
            return self._step(now)
        if not hmac.compare_digest(bytes(self._buf),
                                   _mac(self._secret, b"con", self._hello, self._nonce_s)):
            raise HandshakeError(f"{self._who()} failed authentication")
        _magic, _ver, _tag, src, _dst, rail, conn_id, _nonce = HELLO.unpack(self._hello)
        if self._admit is not None and not self._admit(src, rail):
            raise Refused(f"rank {src} rail {rail}: refused (not wanted on this side)")
        self._send(_mac(self._secret, b"ok", self._hello, self._nonce_s)[:ACK_LEN])
        tune(self.sock, *self._tune)
        keys = _derive_keys(self._secret, self._hello, self._nonce_s, True)
        fd = self.sock.detach()
        _keys[fd] = keys
        return src, rail, fd, conn_id

    def _send(self, data):
        """Send one short handshake message whole (a new socket's empty buffer takes it)."""
        try:
            sent = self.sock.send(data)
        except OSError as exc:
            raise HandshakeError(f"{self._who()}: {exc}") from exc
        if sent != len(data):
            raise HandshakeError(f"{self._who()}: could not send a handshake message")


def accept(listener, secret, me, timeout, rail_timeout_ms, admit=None, sockbuf=0, lowat=0):
    """Accept and authenticate one connection, blocking; returns (peer rank, rail, fd,
    connection id). admit(peer, rail) -> False refuses it once the connector proved the secret,
    before this side admits it, so the connector never takes a refused connection for a working
    rail. timeout bounds the whole handshake."""
    sock, addr = listener.accept()
    hs = ServerHandshake(sock, addr, secret, me, time.monotonic() + timeout,
                         rail_timeout_ms, admit, sockbuf, lowat)
    try:
        while True:
            res = hs.step()
            if res is not None:
                return res
            poller = select.poll()           # not select(): it fails on fds >= 1024
            poller.register(hs.sock, select.POLLIN)
            poller.poll(max(hs.deadline - time.monotonic(), 0) * 1e3)
    except BaseException:
        hs.close()
        raise


class TcpTransport(Transport):
    """TCP rails: the handshake's socket is the connection (engine.links.attach)."""
    name = "tcp"
    CTRL_RAIL = CTRL_RAIL
    HandshakeError = HandshakeError
    Refused = Refused

    # the handshake, for the control plane (links, liveness) and for other kinds' set-up
    listen = staticmethod(listen)
    connect = staticmethod(connect)
    accept = staticmethod(accept)
    ServerHandshake = ServerHandshake
    take_keys = staticmethod(take_keys)

    def dial(self, boot, cfg, peer, rail, timeout):
        """The connection's socket, authenticated: to the peer's rail `rail` listener from this
        rank's address of that rail, or to its control listener (rail CTRL_RAIL)."""
        ep = boot.endpoints[peer]
        if rail == CTRL_RAIL:
            (addr, port), local = ep["ctrl"], None
        else:
            (addr, port), local = ep["rails"][rail], boot.rail_addrs[rail]
        return connect(addr, port, local, boot.secret, boot.rank, peer, rail, timeout,
                       cfg.rail_timeout_ms, cfg.sockbuf, cfg.notsent_lowat)

    def attach(self, engine, boot, peer, rail, fd, conn_id, engine_rail):
        keys = take_keys(fd)
        try:
            engine.links.attach(peer, engine_rail, fd, conn_id, *keys)
        except BaseException:
            os.close(fd)                  # the engine did not take it
            raise


TRANSPORT = TcpTransport()
