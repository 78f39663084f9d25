"""TCP rail transport, cold path: listen, connect, accept, and the authenticated handshake.

Every connection proves knowledge of the per-job secret both ways before the engine sees it:
  connector -> HELLO(magic, version, job id, src rank, dst rank, rail, connection id, nonce_c)
  acceptor  -> nonce_s + HMAC(secret, "acc" | HELLO | nonce_s)
  connector -> HMAC(secret, "con" | HELLO | nonce_s)
Anything else (wrong job, wrong rank, bad MAC, short read, timeout) closes the socket.
"""
import hashlib
import hmac
import os
import socket
import struct

MAGIC = b"R2CH"
VERSION = 1
CTRL_RAIL = 0xFFFF
HELLO = struct.Struct("!4sH8siiHI16s")
MAC_LEN = 32
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


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
            sockbuf=0, lowat=0):
    """Open and authenticate one connection; returns (fd, connection id)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        if local_addr:
            sock.bind((local_addr, 0))
        sock.connect((addr, port))
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
        return sock.detach(), conn_id
    except BaseException:
        sock.close()
        raise


def accept(listener, secret, job, me, timeout, rail_timeout_ms, admit=None, sockbuf=0,
           lowat=0):
    """Accept and authenticate one connection; returns (peer rank, rail, fd, connection id).
    admit(peer, rail) -> False refuses it before this side proves the secret, so the
    connector never takes a refused connection for a working rail."""
    sock, addr = listener.accept()
    try:
        sock.settimeout(timeout)
        hello = _recv_exact(sock, HELLO.size)
        magic, ver, pjob, src, dst, rail, conn_id, _nonce = HELLO.unpack(hello)
        if magic != MAGIC or ver != VERSION:
            raise HandshakeError(f"connection from {addr[0]}:{addr[1]} is not an r2comm rail")
        if pjob != job or dst != me:
            raise HandshakeError(f"connection from {addr[0]}:{addr[1]} belongs to another job/rank")
        if admit is not None and not admit(src, rail):
            raise HandshakeError(f"rank {src} rail {rail}: refused (rail failed on this side)")
        nonce_s = os.urandom(16)
        sock.sendall(nonce_s + _mac(secret, b"acc", hello, nonce_s))
        mac = _recv_exact(sock, MAC_LEN)
        if not hmac.compare_digest(mac, _mac(secret, b"con", hello, nonce_s)):
            raise HandshakeError(f"connection from {addr[0]}:{addr[1]} failed authentication")
        tune(sock, rail_timeout_ms, sockbuf, lowat)
        sock.setblocking(False)
        return src, rail, sock.detach(), conn_id
    except BaseException:
        sock.close()
        raise
