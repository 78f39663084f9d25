"""TCP rail transport, cold path: listen, connect, accept, and the authenticated handshake.

Every connection proves knowledge of the per-job secret both ways before the engine sees it:
  connector -> HELLO(magic, version, job id, src rank, dst rank, rail, connection id, nonce_c)
  acceptor  -> nonce_s + HMAC(secret, "acc" | HELLO | nonce_s)
  connector -> HMAC(secret, "con" | HELLO | nonce_s)
Anything else (wrong job, wrong rank, bad MAC, short read, timeout) closes the socket.
Both sides then derive one key per direction from the secret and both nonces (frame MACs,
R2COMM_INTEGRITY=mac); take_keys(fd) hands them to whoever attaches the connection.

The accepting side is a non-blocking state machine (ServerHandshake) so that one thread can
drive many handshakes at once, each under one deadline: a client that trickles bytes holds a
slot, never the thread.
"""
import hashlib
import hmac
import os
import select
import socket
import struct
import time

MAGIC = b"R2CH"
VERSION = 1
CTRL_RAIL = 0xFFFF
HELLO = struct.Struct("!4sH8siiHI16s")
MAC_LEN = 32
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
FRAME_KEY_LEN = 32
_keys = {}          # fd -> (tx key, rx key) of a connection that has not been attached yet


class HandshakeError(Exception):
    """The peer did not prove the job secret, or spoke something else."""


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


def connect(addr, port, local_addr, secret, job, src, dst, rail, timeout, rail_timeout_ms,
            sockbuf=0, lowat=0, conn_id=None):
    """Open and authenticate one connection; returns (fd, connection id). conn_id: the
    connection id to announce (default random; a shared-memory link names its segment by it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        if local_addr:
            sock.bind((local_addr, 0))
        sock.connect((addr, port))
        if conn_id is None:
            conn_id = struct.unpack("!I", os.urandom(4))[0]
        hello = HELLO.pack(MAGIC, VERSION, job, src, dst, rail, conn_id, os.urandom(16))
        sock.sendall(hello)
        reply = _recv_exact(sock, 16 + MAC_LEN)
        nonce_s, mac = reply[:16], reply[16:]
        if not hmac.compare_digest(mac, _mac(secret, b"acc", hello, nonce_s)):
            raise HandshakeError(f"rank {dst} at {addr}:{port} failed to prove the job secret")
        sock.sendall(_mac(secret, b"con", hello, nonce_s))
        tune(sock, rail_timeout_ms, sockbuf, lowat)
        sock.setblocking(False)
        keys = _derive_keys(secret, hello, nonce_s, False)
        fd = sock.detach()
        _keys[fd] = keys
        return fd, conn_id
    except BaseException:
        sock.close()
        raise


class ServerHandshake:
    """The accepting side of one handshake, driven without blocking: step() when the socket is
    readable (or its deadline passed) returns None while more is needed, the result
    (peer rank, rail, fd, connection id) once the connector proved the secret (the socket is
    then detached: fd belongs to the caller), or raises HandshakeError or OSError (the caller
    closes it). One deadline covers the whole handshake."""

    def __init__(self, sock, addr, secret, job, me, deadline, rail_timeout_ms, admit=None,
                 sockbuf=0, lowat=0):
        self.sock, self.addr, self.deadline = sock, addr, deadline
        self._secret, self._job, self._me, self._admit = secret, job, me, admit
        self._tune = (rail_timeout_ms, sockbuf, lowat)
        self._buf = bytearray()
        self._hello = None
        self._nonce_s = None
        sock.setblocking(False)

    def fileno(self):
        return self.sock.fileno()

    @property
    def got_hello(self):
        """The connector sent a valid HELLO of this job to this rank (it got this side's proof)."""
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
            hello, self._buf = bytes(self._buf), bytearray()
            magic, ver, pjob, src, dst, rail, conn_id, _nonce = HELLO.unpack(hello)
            if magic != MAGIC or ver != VERSION:
                raise HandshakeError(f"{self._who()} is not an r2comm rail")
            if pjob != self._job or dst != self._me:
                raise HandshakeError(f"{self._who()} belongs to another job/rank")
            if self._admit is not None and not self._admit(src, rail):
                raise HandshakeError(f"rank {src} rail {rail}: refused (rail failed on this side)")
            self._hello, self._nonce_s = hello, os.urandom(16)
            reply = self._nonce_s + _mac(self._secret, b"acc", hello, self._nonce_s)
            try:
                sent = self.sock.send(reply)      # 48 bytes into a new socket's empty buffer
            except OSError as exc:
                raise HandshakeError(f"{self._who()}: {exc}") from exc
            if sent != len(reply):
                raise HandshakeError(f"{self._who()}: could not send the handshake reply")
            return self._step(now)
        if not hmac.compare_digest(bytes(self._buf),
                                   _mac(self._secret, b"con", self._hello, self._nonce_s)):
            raise HandshakeError(f"{self._who()} failed authentication")
        _magic, _ver, _job, src, _dst, rail, conn_id, _nonce = HELLO.unpack(self._hello)
        tune(self.sock, *self._tune)
        keys = _derive_keys(self._secret, self._hello, self._nonce_s, True)
        fd = self.sock.detach()
        _keys[fd] = keys
        return src, rail, fd, conn_id


def accept(listener, secret, job, me, timeout, rail_timeout_ms, admit=None, sockbuf=0,
           lowat=0):
    """Accept and authenticate one connection, blocking; returns (peer rank, rail, fd,
    connection id). admit(peer, rail) -> False refuses it before this side proves the secret,
    so the connector never takes a refused connection for a working rail. timeout bounds the
    whole handshake."""
    sock, addr = listener.accept()
    hs = ServerHandshake(sock, addr, secret, job, me, time.monotonic() + timeout,
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
