"""Shared-memory links between ranks on one host (issue 20): which pairs use them, set-up,
segment names and clean-up. The hot path is r2comm/_core/shm.pxd and r2_shm.h.

Which pairs. Ranks a and b are local when their host keys (r2comm.control.hostid: boot id and network
namespace, R2COMM_HOST in tests) are equal and both have R2COMM_SHM on (the default). A local
pair has exactly one data link, the shared-memory one, at data-rail index 0 of that pair
(Engine nrails_per_peer = 1), plus the TCP control connection as every pair. NIC rails and
NIC faults (comm.fail_rail, R2COMM_FAULT) concern remote peers only: comm.rails sums over
remote peers, comm.shm_peers names the local ones.

Set-up (cold path, Python; the lower rank opens, as for TCP rails):
  1. the opener creates a POSIX shm segment (O_EXCL, mode 0600) named
     /r2comm-<tag>-<pid namespace>-<opener pid>-<lo>-<hi>-<connection id> holding both
     rings, where tag = HMAC(job secret, the other fields)[:8] (hex): another user who lists
     /dev/shm learns nothing that takes part in a handshake; its header carries the job id,
     connection id and ring size;
  2. it opens a TCP connection to the peer's control listener (loopback or the management
     address) and runs tcp.py's HMAC handshake with rail code SHM_RAIL and that connection id:
     both sides prove the job secret before anything is mapped;
  3. the accepting side derives the segment name from the authenticated HELLO, maps it after
     checking that it is this user's with no group/other permission bits, checks the header
     (job, connection id, a ring size within bounds that matches the length), and answers one
     byte; a segment that fails a check fails the link with SegmentError;
  4. the opener unlinks the name as soon as that byte arrives (or on any failure): once both
     have mapped it nothing is left in /dev/shm, so a crash later leaves nothing behind.
  The connection then stays open as the doorbell (written only towards a peer that announced
  it is going to sleep) and as liveness: a local peer that dies closes it, and its rail fails
  (EOF) exactly like a TCP rail whose peer died.

Trust. Whoever can write a mapped segment (the peer, or a same-user process that opened the
name before it was unlinked) can rewrite its header and counters at any time. So neither side
reads the header after the check in 3: each adopts the rings' size from the length it mapped
and starts every counter at 0, and the counters the other side publishes are bounds-checked on
every read (r2_shm.h); a bad one fails the link (EPROTO), never a copy outside the mapping.

No room. If the segment cannot be made (a container's /dev/shm of 64 MiB holds 7 links at the
default 4 MiB rings; 8 local ranks need 28), the pair's link is a TCP connection over the
control listener instead (rail code TCP_RAIL, attached as the pair's data rail 0), with a
warning naming the fixes: a smaller R2COMM_SHM_RING, a larger /dev/shm (docker --shm-size), or
R2COMM_SHM=0. Fail-back of that link tries shared memory first again.

Clean-up: a process that dies between 1 and 4 leaves a segment; cleanup_stale() (run at every
Communicator start) unlinks the r2comm segments of this user, made in this pid namespace, older
than any set-up can take (SETUP_MAX_AGE_S), whose creator process no longer exists. Another
job's segment (another user, another pid namespace under a shared /dev/shm, one still in its
set-up) is left alone.

TRANSPORT is the kind's object (kind.Transport), the local kind (r2comm.transport.LOCAL): which
pairs are local and their rails, the endpoint record's key, a pair's whole set-up (open), the
accepting side by HELLO rail code (attach), and the clean-up before the engine (prepare).
"""
import errno
import functools
import hashlib
import hmac
import logging
import os
import select
import stat
import struct
import time

from . import tcp
from .kind import Transport
from ..errors import R2commProtocolError

log = logging.getLogger("r2comm")

SHM_RAIL = 0xFFFE          # the HELLO's rail code of a shared-memory link's doorbell connection
TCP_RAIL = 0xFFFD          # ... of a local pair's link over TCP (no room for a segment)
PREFIX = "r2comm-"
SHM_DIR = "/dev/shm"
SETUP_MAX_AGE_S = 60.0     # a segment younger than this may still be in its set-up (which is
                           # bounded by the connect / probe timeouts and the 2 s handshake)


class SegmentError(R2commProtocolError, OSError):
    """A peer's shared-memory segment failed a check (owner, mode, header or size)."""


def _segments():
    from .._core import shm_segments        # the segments and the hand-over to the engine
    return shm_segments


def shm_key():
    """What two processes of one host must share to meet in /dev/shm: the mount namespace
    (a container has its own /dev/shm unless started with --ipc=host) and the pid namespace
    (segment names carry the creator's pid, which clean-up checks). Ranks whose keys differ
    talk over TCP even on one host."""
    parts = []
    for ns in ("mnt", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def is_local(endpoints, a, b):
    """Ranks a and b talk through shared memory: the same host key (r2comm.control.hostid), R2COMM_SHM
    on both (the endpoint's "shm" is their shm_key(), or None/False when off), equal keys."""
    ea, eb = endpoints[a], endpoints[b]
    ka, kb = ea.get("shm"), eb.get("shm")
    return (a != b and bool(ka) and bool(kb) and ka == kb and
            ea.get("host_key") is not None and ea.get("host_key") == eb.get("host_key"))


def local_peers(endpoints, me):
    return [p for p in range(len(endpoints)) if is_local(endpoints, me, p)]


def data_rails(endpoints, a, b):
    """The number of data rails of pair (a, b): 1 (the shm link) for a local pair, else the
    common NIC rails."""
    if a == b:
        return 0
    if is_local(endpoints, a, b):
        return 1
    return min(len(endpoints[a]["rails"]), len(endpoints[b]["rails"]))


@functools.lru_cache(maxsize=1)
def pid_namespace():
    """This process's pid namespace (the inode of /proc/self/ns/pid), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(secret, pid, lo, hi, conn_id):
    """The link's segment name: the creator's pid namespace and pid say who may clean it up;
    its tag derives from the job secret (nothing in it is the job id or a key)."""
    rest = f"{pid_namespace():x}-{int(pid)}-{int(lo)}-{int(hi)}-{conn_id:08x}"
    tag = hmac.new(secret, b"r2comm shm name " + rest.encode(), hashlib.sha256).hexdigest()[:16]
    return f"/{PREFIX}{tag}-{rest}"


def _parse(entry):
    """(tag hex, pid namespace, pid) of an r2comm segment file name, or None."""
    if not entry.startswith(PREFIX):
        return None
    parts = entry[len(PREFIX):].split("-")
    if len(parts) != 6:
        return None
    try:
        return parts[0], int(parts[1], 16), int(parts[2])
    except ValueError:
        return None


def _alive(pid):
    if pid <= 0:
        return True               # not a process of ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(path, pid, uid, now, min_age):
    """The segment at path is this user's, older than min_age and its creator is gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == uid and now - st.st_mtime >= min_age
            and not _alive(pid))


def cleanup_stale(directory=SHM_DIR, min_age=SETUP_MAX_AGE_S):
    """Unlink the r2comm shm segments that this user's processes of this pid namespace created
    at least min_age s ago and left when they died (a job that crashed during set-up). Returns
    the names removed."""
    removed = []
    ns = pid_namespace()
    if ns == 0:
        return removed            # whose pids the names carry is unknown: touch nothing
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    uid, now = os.geteuid(), time.time()
    for entry in entries:
        parsed = _parse(entry)
        if parsed is None or parsed[1] != ns:
            continue
        path = os.path.join(directory, entry)
        if not _stale(path, parsed[2], uid, now, min_age):
            continue
        try:
            os.unlink(path)
            removed.append(entry)
        except OSError:
            pass
    return removed


def _unlink(name):
    try:
        os.unlink(SHM_DIR + name)
    except FileNotFoundError:
        pass
    except OSError:
        import _posixshmem
        try:
            _posixshmem.shm_unlink(name)
        except OSError:
            pass


def _wait_byte(fd, deadline):
    """Read the accepting side's one-byte answer on the non-blocking socket fd."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise tcp.HandshakeError("no answer to the shared-memory set-up in time")
        poller = select.poll()  # not select(): fds past 1024 once the fd limit was raised
        poller.register(fd, select.POLLIN)
        if not poller.poll(left * 1e3):
            continue
        try:
            b = os.read(fd, 1)
        except BlockingIOError:
            continue
        if not b:
            raise tcp.HandshakeError("the peer refused the shared-memory segment (closed)")
        if b != b"\x01":
            raise tcp.HandshakeError("unexpected answer to the shared-memory set-up")
        return


def open_link(engine, boot, cfg, peer, timeout):
    """The opener (lower rank): create the segment, authenticate over the peer's control
    listener, wait for it to map the segment, unlink the name, attach. With no room for the
    segment, a TCP connection takes its place (open_tcp_link). Raises OSError or
    tcp.HandshakeError."""
    seg = _segments()
    me, job = boot.rank, boot.job
    if not _alive(int(boot.endpoints[peer]["pid"])):
        # (a fail-back probe of a local peer that died: no segment is made for it, so none is
        # left behind should this process end before the attempt would fail)
        raise OSError(errno.ESRCH, f"rank {peer}'s process is gone")
    conn_id = struct.unpack("!I", os.urandom(4))[0]
    name = segment_name(boot.secret, os.getpid(), me, peer, conn_id)
    try:
        base, n = seg.shm_create(name.encode(), cfg.shm_ring, conn_id, job, os.getpid())
    except OSError as exc:
        _warn_no_room(me, peer, cfg.shm_ring, exc)
        open_tcp_link(engine, boot, cfg, peer, timeout)
        return
    fd = None
    try:
        deadline = time.monotonic() + timeout
        addr, port = boot.endpoints[peer]["ctrl"]
        fd, _ = tcp.connect(addr, port, None, boot.secret, me, peer, SHM_RAIL, timeout,
                            cfg.rail_timeout_ms, 0, 0, conn_id=conn_id)
        keys = tcp.take_keys(fd)
        _wait_byte(fd, deadline)
        _unlink(name)
        seg.attach(engine, peer, 0, fd, conn_id, base, n, 0, *keys)
    except BaseException:
        _unlink(name)
        if fd is not None:
            tcp.take_keys(fd)
            os.close(fd)
        seg.shm_unmap(base, n)
        raise


_warned = set()             # peers whose link fell back to TCP (one warning each)


def _warn_no_room(me, peer, ring, exc):
    """Say once per peer that its link is TCP for want of a segment, and how to fix that."""
    if peer in _warned:
        return
    _warned.add(peer)
    log.warning("r2comm rank %d: no shared-memory link to local rank %d (%d MiB segment: %s); "
                "using TCP for this pair. Fix: a smaller R2COMM_SHM_RING (each local pair "
                "needs 2 x the ring), a larger /dev/shm (docker run --shm-size), or "
                "R2COMM_SHM=0 for TCP between all local ranks", me, peer,
                max(1, (2 * ring) >> 20), exc.strerror or exc)


def open_tcp_link(engine, boot, cfg, peer, timeout):
    """The opener's fallback: a local pair's data rail 0 as a TCP connection to the peer's
    control listener (rail code TCP_RAIL). Raises OSError or tcp.HandshakeError."""
    addr, port = boot.endpoints[peer]["ctrl"]
    fd, conn_id = tcp.connect(addr, port, None, boot.secret, boot.rank, peer, TCP_RAIL,
                              timeout, cfg.rail_timeout_ms, cfg.sockbuf, cfg.notsent_lowat)
    keys = tcp.take_keys(fd)
    try:
        engine.links.attach(peer, 0, fd, conn_id, *keys)
    except BaseException:
        os.close(fd)
        raise


def accept_tcp_link(engine, boot, peer, fd, conn_id):
    """The accepting side of open_tcp_link, after the handshake on fd: attach it as the pair's
    data rail 0. On failure fd is closed and the error raised."""
    keys = tcp.take_keys(fd)
    try:
        if peer >= boot.rank:
            raise tcp.HandshakeError(f"rank {peer} opened a local link to a lower rank")
        engine.links.attach(peer, 0, fd, conn_id, *keys)
    except BaseException:
        os.close(fd)
        raise


def _map_peer_segment(name, conn_id, job, peer):
    """shm_attach, with its refusals (owner, mode, header, size) as SegmentError."""
    seg = _segments()
    try:
        return seg.shm_attach(name.encode(), conn_id, job)
    except OSError as exc:
        if exc.errno in (seg.SHM_EOWNER, seg.SHM_EBADSEG):
            raise SegmentError(exc.errno, f"rank {peer}'s shared-memory segment refused: "
                                          f"{exc.strerror}") from None
        raise


def accept_link(engine, boot, peer, fd, conn_id):
    """The accepting side (higher rank), after the handshake on fd: map the segment that the
    authenticated HELLO names, answer one byte, attach. On failure fd is closed and the error
    raised (the opener then sees EOF): SegmentError for a segment that fails its checks."""
    seg = _segments()
    keys = tcp.take_keys(fd)
    base = 0
    n = 0
    try:
        if peer >= boot.rank:
            raise tcp.HandshakeError(f"rank {peer} opened a shared-memory link to a lower rank")
        pid = boot.endpoints[peer].get("pid")
        if pid is None:
            raise tcp.HandshakeError(f"rank {peer} announced no process id")
        name = segment_name(boot.secret, pid, peer, boot.rank, conn_id)
        base, n = _map_peer_segment(name, conn_id, boot.job, peer)
        if os.write(fd, b"\x01") != 1:
            raise OSError(errno.EAGAIN, "could not answer the shared-memory set-up")
        seg.attach(engine, peer, 0, fd, conn_id, base, n, 1, *keys)
    except BaseException:
        os.close(fd)
        if base:
            seg.shm_unmap(base, n)
        raise


def local_groups(endpoints):
    """rank -> the ranks of its group of local ranks (itself included; is_local's relation,
    built in O(n)); ranks without shared memory are absent."""
    groups = {}
    for r, ep in enumerate(endpoints):
        if ep.get("shm") and ep.get("host_key") is not None:
            groups.setdefault((ep["shm"], ep["host_key"]), []).append(r)
    return {r: members for members in groups.values() for r in members}


class ShmTransport(Transport):
    """Shared-memory links between ranks of one host (a TCP link where no segment fits)."""
    name = "shm"
    local = True
    hello_rails = (SHM_RAIL, TCP_RAIL)
    title = "shared-memory link"      # how a report names a local pair's link

    # which pairs, and how many data rails a pair has (the local one, or the common NIC rails)
    is_local = staticmethod(is_local)
    local_peers = staticmethod(local_peers)
    local_groups = staticmethod(local_groups)
    data_rails = staticmethod(data_rails)

    def record(self, cfg):
        """This rank's entry in its endpoint record ("shm"): None where R2COMM_SHM is off."""
        return shm_key() if cfg.shm else None

    def prepare(self, cfg):
        if cfg.shm:
            cleanup_stale()

    def open(self, engine, boot, cfg, peer, timeout):
        """The opener's (lower rank's) whole set-up of the pair's link (open_link)."""
        open_link(engine, boot, cfg, peer, timeout)

    def attach(self, engine, boot, peer, rail, fd, conn_id, engine_rail=0):
        """The accepting side, by the HELLO's rail code: a segment's doorbell, or a local pair's
        link over TCP."""
        if rail == SHM_RAIL:
            accept_link(engine, boot, peer, fd, conn_id)
        else:
            accept_tcp_link(engine, boot, peer, fd, conn_id)


TRANSPORT = ShmTransport()
