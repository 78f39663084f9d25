"""Verbs rails, the cold path: which RDMA device carries each rail, which transport the job
runs on (R2COMM_TRANSPORT), and the queue-pair exchange that turns an authenticated rail
connection into a verbs connection.

A rail is an IPv4 address (R2COMM_RAILS). Its RDMA device is the one whose RoCE v2 GID table
holds that address (::ffff:a.b.c.d), i.e. the RoCE device on the rail's own netdev; on
InfiniBand (no IPv4 GIDs) the devices named in R2COMM_RDMA_DEVICES are taken in rail order.
Every rank says what it can do (VerbsTransport.offer) and bootstrap gathers it
(r2comm.transport.decide): `verbs` needs a device
on every rail of every rank and is an error otherwise (never a silent fall-back to TCP); `auto`
takes verbs where every rank can, else TCP; `tcp` never opens a device.

The exchange runs over the rail's TCP connection right after its handshake, both ends alike:
send QP address + tag, read the peer's, move the QP to RTS, send one ready byte, read the
peer's. The tag is HMAC(connection key of that direction, address), so an address that was not
sent by the authenticated peer is refused. The socket then stays open beside the QP (the
companion socket of verbs_transport.pxi: failure notice, health probes, NIC checks).

TRANSPORT is the kind's object (kind.Transport): its offer, its attach (the exchange, then the
table handed to the engine by address), three fds per rail, the rail-deadline floor of its
queue pairs and the registration cache of zero-copy sends (regcache.py)."""
import hashlib
import hmac
import os
import select
import socket
import time

from ..errors import R2commProtocolError
from .tcp import TcpTransport, take_keys

EXCHANGE_S = 10.0  # s: a queue-pair exchange after its handshake (creating a QP and
                   # registering its slots takes ~1 s in an emulated guest)
QPX_MAGIC = b"R2QX"
TAG_LEN = 16
READY = b"\x01"
_devices = {}          # rail address -> RailDevice (opened once per process, kept)


def min_rail_timeout_ms():
    """The shortest rail deadline a verbs rail tolerates: two local ACK timeouts of its queue
    pair (4.096 us x 2**timeout each; the QP retransmits a lost packet after one)."""
    verbs, _ = load()
    return 2 * 4.096e-3 * (1 << verbs.DEFAULT_QP_TIMEOUT)


def load():
    """The compiled verbs module, or (None, why not)."""
    try:
        from .._core import verbs
    except ImportError as exc:
        return None, (f"r2comm was built without libibverbs ({exc}); install libibverbs-dev "
                      "(scripts/rdma-deps.sh) and rebuild")
    return verbs, None


def _gid_index_for(ctx, addr):
    idx = ctx.roce_v2_ipv4_index(addr)
    if idx is None:
        forced = os.environ.get("R2COMM_RDMA_GID_INDEX", "").strip()
        if forced and ctx.query_port()["link_layer"] == 1:     # InfiniBand: no IPv4 GIDs
            idx = int(forced)
    return idx


def find_devices(rail_addrs, pool=None):
    """Per rail: (RailDevice, None) or (None, why none). Devices stay open for the process;
    pool: (receive slots, send slots, send slots per connection) of a device opened now
    (the defaults of verbs_transport.pxi when None)."""
    verbs, why = load()
    if verbs is None:
        return [(None, why)] * len(rail_addrs)
    names = verbs.device_names()
    if not names:
        return [(None, "no RDMA device (ibv_devices lists none)")] * len(rail_addrs)
    order = [n for n in os.environ.get("R2COMM_RDMA_DEVICES", "").split(",") if n.strip()]
    out = []
    for k, addr in enumerate(rail_addrs):
        if addr in _devices:
            out.append((_devices[addr], None))
            continue
        found, tried = None, []
        candidates = names if not order else ([order[k]] if k < len(order) else []) + names
        for name in candidates:
            try:
                ctx = verbs.Context(name)
            except verbs.VerbsError as exc:
                tried.append(f"{name}: {exc}")
                continue
            port = ctx.query_port()
            gid = _gid_index_for(ctx, addr)
            if gid is not None and port["state"] == "ACTIVE":
                found = verbs.RailDevice(ctx, gid, addr, *(pool or ()))
                break
            tried.append(f"{name}: " + ("port " + port["state"] if gid is not None else
                                        f"no RoCE v2 GID for {addr}"))
            ctx.close()
        if found is None:
            out.append((None, f"no RDMA device carries rail {k} ({addr}): " + "; ".join(tried)))
        else:
            _devices[addr] = found
            out.append((found, None))
    return out


def _readable(sock, timeout):
    """Wait up to timeout s for sock to be readable (poll: select() fails on fds >= 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(timeout, 0) * 1e3))


def _recv_exact(sock, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"queue-pair exchange: peer sent {len(buf)} of {n} bytes in time")
        if not _readable(sock, left):
            continue
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("queue-pair exchange: the peer closed the connection")
        buf += part
    return bytes(buf)


def exchange(device, fd, tx_key, rx_key, timeout):
    """Make a verbs connection on `device` and connect it to the peer at the other end of the
    authenticated rail socket `fd` (both ends call this). Returns the handle for
    Engine.links.attach_transport (give it to discard() if that raises); the socket then belongs to
    the connection. Raises OSError or ConnectionError (the socket closed, the queue pair and its
    slots freed) if the exchange fails, also for a peer's address that does not decode."""
    from .._core import verbs
    sock = socket.socket(fileno=fd)
    deadline = time.monotonic() + timeout
    conn = None
    try:
        sock.setblocking(True)
        sock.settimeout(timeout)
        conn = verbs.VerbsConn(device, os.dup(sock.fileno()))
        mine = conn.address()
        tag = hmac.new(tx_key, b"qpx" + mine, hashlib.sha256).digest()[:TAG_LEN]
        sock.sendall(QPX_MAGIC + bytes([len(mine)]) + mine + tag)
        head = _recv_exact(sock, 5, deadline)
        if head[:4] != QPX_MAGIC:
            raise ConnectionError("queue-pair exchange: the peer does not speak verbs "
                                  "(R2COMM_TRANSPORT differs?)")
        theirs = _recv_exact(sock, head[4], deadline)
        want = hmac.new(rx_key, b"qpx" + theirs, hashlib.sha256).digest()[:TAG_LEN]
        if not hmac.compare_digest(_recv_exact(sock, TAG_LEN, deadline), want):
            raise ConnectionError("queue-pair exchange: the peer's address failed "
                                  "authentication")
        conn.connect(theirs)
        sock.sendall(READY)
        if _recv_exact(sock, 1, deadline) != READY:
            raise ConnectionError("queue-pair exchange: bad ready byte")
        sock.setblocking(False)
        return conn.handover()
    except verbs.VerbsError as exc:
        raise ConnectionError(f"verbs connection set-up failed: {exc}") from None
    except R2commProtocolError as exc:          # QpAddress.decode: another version, corrupt
        raise ConnectionError(f"queue-pair exchange: {exc}") from None
    except socket.timeout:
        raise TimeoutError("queue-pair exchange timed out") from None
    finally:
        conn = None           # an unconnected QP, its slots and socket copy are freed now
        sock.close()          # the connection holds its own duplicate of the socket


def discard(handle):
    """Free a connection from exchange() that no engine adopted (attach_transport raised): its
    queue pair, registered slots and companion socket (the peer then sees EOF)."""
    verbs, _ = load()
    if verbs is not None and handle:
        verbs.discard(handle)


def pinned_stats():
    """This process's pinned memory on its RDMA devices: per device (rail address) its slot
    pool's stats (RailDevice.pool_stats: slots and where they are, pinned_bytes), and the total
    pinned by the pools, which depends on the settings and the devices, not on the peers."""
    per = {addr: dev.pool_stats() for addr, dev in _devices.items()}
    return {"devices": per, "pinned_bytes": sum(p["pinned_bytes"] for p in per.values())}


class VerbsTransport(TcpTransport):
    """Verbs rails: dialled and authenticated as TCP rails, then the queue-pair exchange on
    that socket (which stays as the companion); the control connection stays TCP."""
    name = "verbs"
    rail_fds = 3             # the companion socket, the completion channel, the epoll fd
    attach_blocks = True     # the exchange waits for the peer
    missing = "has no usable RDMA device"

    def offer(self, rail_addrs, cfg=None):
        # a device opened now gets its slot pool from the settings (R2COMM_VERBS_*_SLOTS)
        pool = None if cfg is None else (cfg.verbs_recv_slots, cfg.verbs_send_slots,
                                         cfg.verbs_conn_send_slots)
        found = find_devices(rail_addrs, pool)
        missing = [why for dev, why in found if dev is None]
        if missing:
            return None, "; ".join(dict.fromkeys(missing))
        return [dev for dev, _ in found], None

    def min_rail_timeout_ms(self):
        return min_rail_timeout_ms()

    def attach(self, engine, boot, peer, rail, fd, conn_id, engine_rail):
        keys = take_keys(fd)
        # the authenticated socket carries the queue-pair exchange, then stays beside the QP
        # as its companion (exchange: it owns fd from here, also when it raises)
        handle = exchange(boot.rail_devices[rail], fd, keys[0], keys[1], EXCHANGE_S)
        try:
            engine.links.attach_transport(peer, engine_rail, load()[0].transport_address(),
                                          handle, conn_id, *keys)
        except BaseException:
            discard(handle)       # QP, slots, companion socket: the peer sees EOF
            raise

    def registration_cache(self, boot, cfg):
        """Set the rail devices' zero-copy mode; the RegCache that registers user memory for
        zero-copy sends, or None where sends always copy."""
        devices = boot.rail_devices
        if not devices:
            return None
        # (not without acks: there a post's completion counts as delivery, and a zero-copy
        # post completes before the NIC has read the pages)
        zcopy = cfg.verbs_zcopy and cfg.acks
        for d in devices:
            d.zcopy = zcopy
        if not zcopy:
            return None
        from .regcache import RegCache
        return RegCache(devices, cfg.verbs_reg_cache, cfg.verbs_reg_min)


TRANSPORT = VerbsTransport()
