"""Shared-memory links between ranks on one host (issue 20): which pairs use them, set-up,
segment names and clean-up. The hot path is r2comm/_core/shm.pxd and r2_shm.h.

Which pairs. Ranks a and b are local when their host keys (r2comm.hostid: boot id and network
namespace, R2COMM_HOST in tests) are equal and both have R2COMM_SHM on (the default). A local
pair has exactly one data link, the shared-memory one, at data-rail index 0 of that pair
(Engine nrails_per_peer = 1), plus the TCP control connection as every pair. NIC rails and
NIC faults (comm.fail_rail, R2COMM_FAULT) concern remote peers only: comm.rails sums over
remote peers, comm.shm_peers names the local ones.

Set-up (cold path, Python; the lower rank opens, as for TCP rails):
  1. the opener creates a POSIX shm segment (O_EXCL, mode 0600) named
     /r2comm-<job id>-<opener pid>-<lo>-<hi>-<connection id> holding both rings; its header
     carries the job id and connection id;
  2. it opens a TCP connection to the peer's control listener (loopback or the management
     address) and runs tcp.py's HMAC handshake with rail code SHM_RAIL and that connection id:
     both sides prove the job secret before anything is mapped;
  3. the accepting side derives the segment name from the authenticated HELLO, maps it, checks
     the header (job, connection id, sizes), and answers one byte;
  4. the opener unlinks the name as soon as that byte arrives (or on any failure): once both
     have mapped it nothing is left in /dev/shm, so a crash later leaves nothing behind.
  The connection then stays open as the doorbell (written only towards a peer that announced
  it is going to sleep) and as liveness: a local peer that dies closes it, and its rail fails
  (EOF) exactly like a TCP rail whose peer died.

Clean-up: a process that dies between 1 and 4 leaves a segment; cleanup_stale() (run at every
Communicator start) unlinks r2comm segments whose creator process no longer exists.
"""
import errno
import os
import select
import struct
import time

from ._core import tcp

SHM_RAIL = 0xFFFE          # the HELLO's rail code of a shared-memory link's doorbell connection
PREFIX = "r2comm-"
SHM_DIR = "/dev/shm"


def _engine():
    from ._core import engine
    return engine


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
    """Ranks a and b talk through shared memory: the same host key (r2comm.hostid), R2COMM_SHM
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


def segment_name(job, pid, lo, hi, conn_id):
    return f"/{PREFIX}{job.hex()}-{int(pid)}-{int(lo)}-{int(hi)}-{conn_id:08x}"


def _parse(entry):
    """(job hex, pid) of an r2comm segment file name, or None."""
    if not entry.startswith(PREFIX):
        return None
    parts = entry[len(PREFIX):].split("-")
    if len(parts) != 5:
        return None
    try:
        return parts[0], int(parts[1])
    except ValueError:
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(directory=SHM_DIR):
    """Unlink r2comm shm segments whose creating process is gone (a job that crashed during
    set-up). Returns the names removed."""
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        parsed = _parse(entry)
        if parsed is None or _alive(parsed[1]):
            continue
        try:
            os.unlink(os.path.join(directory, entry))
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
        r, _, _ = select.select([fd], [], [], left)
        if not r:
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
    listener, wait for it to map the segment, unlink the name, attach. Raises OSError or
    tcp.HandshakeError."""
    eng = _engine()
    me, job = boot.rank, boot.job
    conn_id = struct.unpack("!I", os.urandom(4))[0]
    name = segment_name(job, os.getpid(), me, peer, conn_id)
    base, n = eng.shm_create(name.encode(), cfg.shm_ring, conn_id, job, os.getpid())
    fd = None
    try:
        deadline = time.monotonic() + timeout
        addr, port = boot.endpoints[peer]["ctrl"]
        fd, _ = tcp.connect(addr, port, None, boot.secret, job, me, peer, SHM_RAIL, timeout,
                            cfg.rail_timeout_ms, 0, 0, conn_id=conn_id)
        keys = tcp.take_keys(fd)
        _wait_byte(fd, deadline)
        _unlink(name)
        engine.attach_shm(peer, 0, fd, conn_id, base, n, 0, *keys)
    except BaseException:
        _unlink(name)
        if fd is not None:
            tcp.take_keys(fd)
            os.close(fd)
        eng.shm_unmap(base, n)
        raise


def accept_link(engine, boot, peer, fd, conn_id):
    """The accepting side (higher rank), after the handshake on fd: map the segment that the
    authenticated HELLO names, answer one byte, attach. On failure fd is closed and the error
    raised (the opener then sees EOF)."""
    eng = _engine()
    keys = tcp.take_keys(fd)
    base = 0
    n = 0
    try:
        if peer >= boot.rank:
            raise tcp.HandshakeError(f"rank {peer} opened a shared-memory link to a lower rank")
        pid = boot.endpoints[peer].get("pid")
        if pid is None:
            raise tcp.HandshakeError(f"rank {peer} announced no process id")
        name = segment_name(boot.job, pid, peer, boot.rank, conn_id)
        base, n = eng.shm_attach(name.encode(), conn_id, boot.job)
        if os.write(fd, b"\x01") != 1:
            raise OSError(errno.EAGAIN, "could not answer the shared-memory set-up")
        engine.attach_shm(peer, 0, fd, conn_id, base, n, 1, *keys)
    except BaseException:
        os.close(fd)
        if base:
            eng.shm_unmap(base, n)
        raise
