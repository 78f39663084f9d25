"""The shared-memory transport (issue 20): the ring itself (in-process), segment set-up and
clean-up, and real mpiexec jobs: every collective exact over shared memory with 2-4 ranks on
one host, local and remote peers mixed (R2COMM_HOST per rank emulates hosts), NIC faults that
leave shared memory alone, and a local rank killed mid-collective."""
import ast
import contextlib
import errno
import mmap
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading

import pytest

from conftest import run_mpi, ROOT
import flood_client
from r2comm._core import testing

SHM_WORKER = os.path.join(ROOT, "tests", "shm_worker.py")
JOB = b"testjob!"
SECRET = b"a job secret of thirty-two bytes!"
SHM_OK = True           # (conftest: these jobs run over shared memory)


def _segments():
    from r2comm._core import shm_segments
    return shm_segments


def _pair(ring=4096, conn_id=7):
    """Both ends of one link in this process: (creator end, peer end, segment name)."""
    E = _segments()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-{conn_id:08x}"
    base, n = E.shm_create(name.encode(), ring, conn_id, JOB, os.getpid())
    try:
        b2, n2 = E.shm_attach(name.encode(), conn_id, JOB)
    finally:
        os.unlink("/dev/shm" + name)
    s1, s2 = socket.socketpair()
    s1.setblocking(False)
    s2.setblocking(False)
    return testing.ShmEnd(s1.detach(), base, n, 0), testing.ShmEnd(s2.detach(), b2, n2, 1), name


# -- the ring --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ring_stream_wraps_with_odd_sizes(seed):
    """Random odd-sized posts (gather lists of 1-5 parts) and reads through a 4 KiB ring, both
    directions, many wrap-arounds: every byte arrives once, in order; a full ring accepts a
    prefix (never more than its free space), an empty one returns nothing."""
    a, b, _ = _pair()
    rng = random.Random(seed)
    for src, dst in ((a, b), (b, a)):
        blob = rng.randbytes(300_000)
        sent, got, wraps = 0, bytearray(), 0
        for _ in range(200_000):
            if len(got) == len(blob):
                break
            if sent < len(blob):
                k = rng.choice([1, 3, 47, 4095, 4096, 4097, rng.randint(1, 9001)])
                r = src.send(blob[sent:sent + k], rng.randint(1, 5))
                assert 0 <= r <= min(k, len(blob) - sent)
                assert r > 0 or len(got) < sent      # refused only when the ring holds bytes
                assert sent + r - len(got) <= 4096   # never more than the ring holds
                wraps += (sent % 4096 + r) > 4096
                sent += r
            got += dst.recv(rng.choice([1, 7, 48, 4096, rng.randint(1, 7000)]))
        assert bytes(got) == blob
        assert wraps > 50
        assert dst.recv(100) == b""
    a.close()
    b.close()


def test_ring_doorbell_only_for_a_sleeper():
    """No system call while both ends are awake: a doorbell is rung only after the reader
    armed (announced sleep), once per arming; a reader that arms with bytes waiting is told
    not to sleep."""
    a, b, _ = _pair()
    for _ in range(100):
        assert a.send(b"x" * 100) == 100
        assert b.recv(100) == b"x" * 100
    assert a.bells == 0 and b.bells == 0
    assert b.arm() == 0                     # empty: armed, may sleep
    assert a.send(b"hello") == 5
    assert a.bells == 1                     # the sleeper was rung
    assert a.send(b"again") == 5
    assert a.bells == 1                     # once per arming
    assert b.wake() == 0 and b.dead == 0    # drains the doorbell
    assert b.recv(100) == b"helloagain"
    assert a.send(b"z") == 1 and a.bells == 1   # awake again: no doorbell
    assert b.arm() == 1                     # bytes waiting: do not sleep
    assert b.recv(10) == b"z"
    # a full ring: the writer arms, the reader's read rings it
    assert a.send(b"y" * 5000) == 4096
    assert a.send(b"y") == 0
    assert a.arm() == 0
    assert b.recv(10) == b"y" * 10
    assert b.bells == 1
    a.close()
    b.close()


def test_ring_peer_death_after_its_last_bytes():
    """The peer's end closing (its process died): the bytes it wrote before are still read,
    then irecv reports EOF; writes fail at once."""
    a, b, _ = _pair()
    assert a.send(b"last words") == 10
    a.close()
    assert b.wake() == 0
    assert b.dead == -1000
    assert b.recv(4) == b"last"
    assert b.recv(100) == b" words"
    assert b.recv(100) == -1000
    assert b.send(b"x") == -1000
    b.close()


def test_segment_is_checked_and_named_per_job():
    E = _segments()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-0000abcd"
    base, n = E.shm_create(name.encode(), 8192, 0xabcd, JOB, os.getpid())
    try:
        assert n == 4096 + 2 * 8192
        st = os.stat("/dev/shm" + name)
        assert st.st_mode & 0o777 == 0o600
        with pytest.raises(OSError):         # O_EXCL: a name is never reused
            E.shm_create(name.encode(), 8192, 0xabcd, JOB, os.getpid())
        with pytest.raises(OSError):         # another connection's segment
            E.shm_attach(name.encode(), 0xabce, JOB)
        with pytest.raises(OSError):         # another job's
            E.shm_attach(name.encode(), 0xabcd, b"otherjob")
        b2, n2 = E.shm_attach(name.encode(), 0xabcd, JOB)
        E.shm_unmap(b2, n2)
    finally:
        os.unlink("/dev/shm" + name)
        E.shm_unmap(base, n)
    with pytest.raises(ValueError):
        E.shm_create(b"/r2comm-x", 5000, 1, JOB, 1)   # not a power of two


def test_segment_names_and_hellos_carry_no_job_id(monkeypatch):
    """Issue 40 item 3: what another user sees of a link's set-up, the segment's name in
    /dev/shm and the HELLO on the wire, carries neither the job id nor anything that another
    link reuses: the name's first field derives from the job secret and the link (HMAC), and
    the HELLO's tag from the secret and the HELLO. Before, both carried job.hex() / the job id,
    which let any local user send HELLOs that took a pair's claim. Driven through open_link:
    the segment cannot be made (the opener falls back to TCP), and the TCP link's HELLO is read
    by a plain listener."""
    import hashlib
    from types import SimpleNamespace
    from r2comm.transport import shm, tcp
    names = []

    class NoRoom:
        @staticmethod
        def shm_create(name, *args):
            names.append(name.decode())
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(shm, "_segments", lambda: NoRoom)
    monkeypatch.setattr(shm, "_warned", {1})             # (no warning about the fallback)
    lst = tcp.listen("127.0.0.1")
    hellos = []
    secret = os.urandom(32)
    job = hashlib.sha256(secret).digest()[:8]                # bootstrap's job id
    cfg = SimpleNamespace(shm_ring=4096, rail_timeout_ms=500, sockbuf=0, notsent_lowat=0)
    seen = []
    for _ in range(2):
        boot = SimpleNamespace(rank=0, size=2, secret=secret, job=job,
                               endpoints=[{}, {"ctrl": lst.getsockname(),
                                               "pid": os.getpid()}])
        t = threading.Thread(target=flood_client.observe_hellos, args=(lst, hellos))
        t.start()
        with pytest.raises((OSError, tcp.HandshakeError)):
            shm.open_link(None, boot, cfg, 1, 2.0)
        t.join(10)
        seen.append((names[-1], hellos[-1]))
    lst.close()
    for name, hello in seen:
        assert name.startswith("/r2comm-") and job.hex() not in name, name
        assert job not in hello and job.hex().encode() not in hello
    first = [name.split("-")[1] for name, _ in seen]
    assert first[0] != first[1] and len(first[0]) == 16      # per link, not per job


# -- hostile segments (issue 28) -----------------------------------------------------------
MAGIC = 0x3130474E495232           # r2_shm.h's header: magic, version, conn id, ring bytes,
HEADER = struct.Struct("<QIIQQ8s")  # creator pid, job id; then ring[0] at 128, ring[1] at 640
RING_AT = (128, 640)                # each: head at +0, tail at +128
EPROTO, EPERM = errno.EPROTO, errno.EPERM


def _craft(name, size, ring_bytes, conn_id=7, job=JOB):
    """A segment made by hand (as an attacker would): any length, any header."""
    fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, HEADER.pack(MAGIC, 1, conn_id, ring_bytes, os.getpid(), job), 0)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _writable_header(name):
    """The header page of segment `name`, mapped again for writing (what its peer sees)."""
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 4096)
    finally:
        os.close(fd)
    try:
        yield m
    finally:
        m.close()


def _poke(m, ring, field, value):
    struct.pack_into("<Q", m, RING_AT[ring] + (128 if field == "tail" else 0), value)


def _unlinked(name):
    if os.path.exists("/dev/shm" + name):
        os.unlink("/dev/shm" + name)


@pytest.mark.parametrize("ring_bytes,size", [
    (2 ** 63, 4096),                 # 4096 + 2 * 2**63 wraps to 4096: the old check passed
    (2 ** 63 + 2048, 8192),          # wraps to 8192
    (0, 4096),
    (5000, 4096 + 10000),            # not a power of two
    (2048, 4096 + 4096),             # under the minimum
    (8192, 4096 + 4096),             # the length does not match
    (2 ** 31, 4096 + 2 ** 32),       # over the 1 GiB cap (a sparse file)
])
def test_attach_refuses_bad_ring_sizes(ring_bytes, size):
    """A header whose ring size overflows the length check, is out of bounds, or does not match
    the segment's length is refused (EPROTO) before anything is used; with 2**63 in a 4096-byte
    segment the old attach accepted it and adopt put the rings far outside the mapping."""
    E = _segments()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-00000007"
    _craft(name, size, ring_bytes)
    try:
        with pytest.raises(OSError) as ei:
            E.shm_attach(name.encode(), 7, JOB)
        assert ei.value.errno == EPROTO, ei.value
        assert "header or size" in str(ei.value)
    finally:
        _unlinked(name)


def test_attach_refuses_another_users_or_a_shared_mode_segment():
    """A segment that another user owns, or that group/other may open, is refused (EPERM) even
    when its header is right: someone else could rewrite it under us. The old attach mapped
    both."""
    E = _segments()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-00000008"
    base, n = E.shm_create(name.encode(), 4096, 8, JOB, os.getpid())
    fd = os.open("/dev/shm" + name, os.O_RDONLY)
    try:
        for mode, owner in ((0o644, 0), (0o640, 0), (0o606, 0), (0o600, 12345)):
            os.fchmod(fd, mode)
            os.fchown(fd, owner, -1)
            with pytest.raises(OSError) as ei:
                E.shm_attach(name.encode(), 8, JOB)
            assert ei.value.errno == EPERM, (oct(mode), owner, ei.value)
            assert "not this user's" in str(ei.value)
        os.fchown(fd, os.geteuid(), -1)
        os.fchmod(fd, 0o600)
        b2, n2 = E.shm_attach(name.encode(), 8, JOB)     # the same segment, put right: mapped
        E.shm_unmap(b2, n2)
    finally:
        os.close(fd)
        _unlinked(name)
        E.shm_unmap(base, n)


class _Boot:
    """What accept_link reads of the bootstrap: this is rank 1, rank 0 is this process."""
    rank = 1
    job = JOB
    secret = SECRET
    endpoints = [{"pid": os.getpid()}, {"pid": os.getpid()}]


@pytest.mark.parametrize("hostile", ["overflow", "mode", "owner"])
def test_hostile_segment_fails_the_link_with_a_protocol_error(hostile):
    """The accepting side of a link, handed a hostile segment under the name the authenticated
    HELLO derives: shm.accept_link raises SegmentError (an R2commProtocolError, and an OSError
    for the links thread), names the peer, closes the doorbell socket and maps nothing, so the
    opener sees the link refused. The old code attached the overflowing segment."""
    from r2comm.transport import shm
    from r2comm.errors import R2commProtocolError
    E = _segments()
    conn_id = 0x55
    name = shm.segment_name(SECRET, os.getpid(), 0, 1, conn_id)
    mapped = None
    if hostile == "overflow":
        _craft(name, 4096, 2 ** 63, conn_id)
    else:
        mapped = E.shm_create(name.encode(), 4096, conn_id, JOB, os.getpid())
        if hostile == "mode":
            os.chmod("/dev/shm" + name, 0o666)
        else:
            os.chown("/dev/shm" + name, 12345, -1)
    s1, s2 = socket.socketpair()
    fd = s2.detach()
    try:
        with pytest.raises(shm.SegmentError) as ei:
            shm.accept_link(None, _Boot(), 0, fd, conn_id)   # no engine: never reached
        assert isinstance(ei.value, R2commProtocolError) and isinstance(ei.value, OSError)
        assert "rank 0's shared-memory segment refused" in str(ei.value), str(ei.value)
        with pytest.raises(OSError):
            os.fstat(fd)                                     # the doorbell socket is closed
        assert s1.recv(1) == b""                             # the opener sees EOF, no answer
    finally:
        s1.close()
        _unlinked(name)
        if mapped:
            E.shm_unmap(*mapped)


def _pair_mapped(conn_id):
    """A created and an attached mapping of one fresh segment, not adopted yet, and its name
    (still linked, so the test can map the header again as the peer would)."""
    E = _segments()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-{conn_id:08x}"
    a = E.shm_create(name.encode(), 4096, conn_id, JOB, os.getpid())
    b = E.shm_attach(name.encode(), conn_id, JOB)
    return a, b, name


def _ends(a, b):
    s1, s2 = socket.socketpair()
    s1.setblocking(False)
    s2.setblocking(False)
    return testing.ShmEnd(s1.detach(), *a, 0), testing.ShmEnd(s2.detach(), *b, 1)


def test_adopt_refuses_a_length_that_is_no_segments():
    """The rings' size comes from the mapped length: a length no valid ring size gives is
    refused before anything is adopted (ShmEnd here, shm_segments.attach the same way)."""
    a, b, name = _pair_mapped(0x40)
    _unlinked(name)
    s1, s2 = socket.socketpair()
    try:
        for n in (4096, 4096 + 5000, 4096 + 2 * 2048, 4096 + 2 * 4096 + 1):
            with pytest.raises(ValueError):
                testing.ShmEnd(s1.fileno(), a[0], n, 0)
    finally:
        s1.close()
        s2.close()
        _segments().shm_unmap(*a)
        _segments().shm_unmap(*b)


def test_counters_far_out_of_range_at_set_up_fail_the_link():
    """Counters in the segment set far out of range before either side adopts it (equal heads
    and tails, so the ring looks empty): both sides start their own counters at 0 and never
    read them back, so the first read sees a head 2**63 ahead and fails the link (EPROTO);
    writes then fail too. The old adopt took the segment's values as its starting point."""
    a, b, name = _pair_mapped(0x41)
    try:
        with _writable_header(name) as m:
            for ring in (0, 1):
                _poke(m, ring, "head", 2 ** 63 - 100)
                _poke(m, ring, "tail", 2 ** 63 - 100)
    finally:
        _unlinked(name)
    x, y = _ends(a, b)
    try:
        for end in (x, y):
            assert end.recv(100) == -EPROTO
            assert end.dead == -EPROTO
            assert end.send(b"z" * 10) == -EPROTO
    finally:
        x.close()
        y.close()


def test_counters_moved_out_of_range_after_set_up_fail_the_link():
    """Counters moved after set-up (a head 2**40 ahead, a tail past the head) are caught on the
    next read of them, every time: the link fails (EPROTO), nothing is copied."""
    a, b, name = _pair_mapped(0x42)
    x, y = _ends(a, b)
    try:
        assert x.send(b"q" * 100) == 100 and y.recv(100) == b"q" * 100
        with _writable_header(name) as m:
            _poke(m, 1, "head", 2 ** 40)          # peer -> creator: far ahead of the tail
            assert x.recv(10) == -EPROTO
            assert y.send(b"w" * 4096) == 4096    # the peer's own ring: fills it
            _poke(m, 1, "tail", 2 ** 50)          # creator's tail, as the peer sees it: past
            assert y.send(b"w") == -EPROTO        # its head; read when the ring is full
    finally:
        _unlinked(name)
        x.close()
        y.close()


_REWRITER = r"""
import os, sys, mmap, socket, struct
sys.path.insert(0, sys.argv[1])
from r2comm._core import shm_segments as E, testing
job = b"testjob!"
name = "/r2comm-%s-%d-0-1-00000043" % (job.hex(), os.getpid())
a = E.shm_create(name.encode(), 4096, 0x43, job, os.getpid())
b = E.shm_attach(name.encode(), 0x43, job)
# the peer mapped it: now it rewrites the header before the creator adopts
fd = os.open("/dev/shm" + name, os.O_RDWR)
m = mmap.mmap(fd, 4096)
os.close(fd)
os.unlink("/dev/shm" + name)
struct.pack_into("<Q", m, 16, 1 << 40)          # ring_bytes: 1 TiB
s1, s2 = socket.socketpair()
x = testing.ShmEnd(s1.detach(), *a, 0)                # the creator
y = testing.ShmEnd(s2.detach(), *b, 1)                # the peer (it attached before the rewrite)
canary = bytearray(b"C" * (1 << 20))
blob = os.urandom(100_000)
for src, dst in ((y, x), (x, y)):
    sent, got = 0, bytearray()
    for _ in range(10_000):
        if len(got) == len(blob):
            break
        r = src.send(blob[sent:sent + 3000])
        assert r >= 0, r
        sent += r
        got += dst.recv(5000)
    assert bytes(got) == blob
assert canary == b"C" * (1 << 20)
print("RESULT ok", flush=True)
"""


def test_header_rewritten_after_create_is_not_used():
    """The peer rewrites the ring size in the header after it mapped the segment and before
    the creator adopts it (1 TiB in a 12 KiB segment): neither side takes the size from the
    header, so 100 KB stream through both rings intact and nothing outside the mapping is
    written. The old adopt read the size back and its first write landed 1 TiB past the rings
    (SIGSEGV, or another mapping of the process silently overwritten). In a child process, so
    a crash is a failed test."""
    p = subprocess.run([sys.executable, "-c", _REWRITER, ROOT], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "RESULT ok" in p.stdout, (p.returncode, p.stderr[-3000:])


def _dead_pid():
    """The pid of a process that has exited (and was reaped)."""
    p = subprocess.Popen(["true"])
    p.wait(timeout=30)
    return p.pid


def _age(name, seconds=300):
    """Make the segment `name` look created `seconds` ago (its mtime)."""
    t = __import__("time").time() - seconds
    os.utime("/dev/shm" + name, (t, t))


def test_stale_segments_of_dead_processes_are_removed():
    """A process that dies between creating a segment and its peer mapping it leaves the name
    behind: cleanup_stale() removes it once it is older than any set-up (its creator's pid and
    pid namespace are in the name), and leaves a live process's segment alone."""
    from r2comm.transport import shm
    code = ("import os, sys; sys.path.insert(0, %r); from r2comm._core import shm_segments as E; "
            "from r2comm.transport import shm; n = shm.segment_name(%r, os.getpid(), 0, 1, 1); "
            "E.shm_create(n.encode(), 4096, 1, %r, os.getpid()); print(n, flush=True); "
            "os._exit(0)") % (ROOT, SECRET, JOB)
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         timeout=60, check=True).stdout.split()
    dead = out[0]
    assert os.path.exists("/dev/shm" + dead)
    live = shm.segment_name(SECRET, os.getpid(), 0, 1, 2)
    E = _segments()
    base, n = E.shm_create(live.encode(), 4096, 2, JOB, os.getpid())
    try:
        _age(dead)
        _age(live)
        removed = shm.cleanup_stale()
        assert dead[1:] in removed
        assert not os.path.exists("/dev/shm" + dead)
        assert os.path.exists("/dev/shm" + live)
    finally:
        if os.path.exists("/dev/shm" + dead):
            os.unlink("/dev/shm" + dead)
        os.unlink("/dev/shm" + live)
        E.shm_unmap(base, n)


def test_cleanup_spares_young_foreign_and_other_users_segments():
    """cleanup_stale() removes only what this user's dead processes of this pid namespace left
    longer ago than any set-up takes: a dead creator's segment that is still young (in its
    set-up as far as anyone can tell), one owned by another user, one named in another pid
    namespace (a job sharing /dev/shm with --ipc=host) all stay; the old one of ours goes."""
    from r2comm.transport import shm
    E = _segments()
    pid = _dead_pid()
    ns = os.stat("/proc/self/ns/pid").st_ino
    names = {"young": shm.segment_name(SECRET, pid, 0, 1, 0x21),
             "other_user": shm.segment_name(SECRET, pid, 0, 1, 0x22),
             "other_ns": shm.segment_name(SECRET, pid, 0, 1, 0x23).replace(f"-{ns:x}-",
                                                                         f"-{ns + 1:x}-"),
             "stale": shm.segment_name(SECRET, pid, 0, 1, 0x24)}
    maps = []
    try:
        for key, name in names.items():
            maps.append(E.shm_create(name.encode(), 4096, 1, JOB, pid))
            if key != "young":
                _age(name)
        fd = os.open("/dev/shm" + names["other_user"], os.O_RDONLY)
        try:
            os.fchown(fd, 12345, 12345)
        finally:
            os.close(fd)
        removed = shm.cleanup_stale()
        left = {k for k, v in names.items() if os.path.exists("/dev/shm" + v)}
        assert left == {"young", "other_user", "other_ns"}, (left, removed)
        assert names["stale"][1:] in removed
    finally:
        for name in names.values():
            if os.path.exists("/dev/shm" + name):
                os.unlink("/dev/shm" + name)
        for base, n in maps:
            E.shm_unmap(base, n)


_OTHER_NS_CREATOR = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from r2comm._core import shm_segments as E
from r2comm.transport import shm
job = sys.argv[2].encode()
name = shm.segment_name(job, os.getpid(), 0, 1, 0x31)
E.shm_create(name.encode(), 4096, 0x31, job, os.getpid())
print(name, os.getpid(), flush=True)
sys.stdin.readline()            # "in set-up" until the test says
os.unlink("/dev/shm" + name)
"""


def test_cleanup_spares_an_in_setup_segment_of_another_pid_namespace():
    """Two jobs share /dev/shm (--ipc=host) but not their pid namespace: a process of the other
    job (here: in a pid namespace of its own, with a pid that does not exist in ours) holds a
    segment in its set-up. This job's cleanup_stale() must leave it alone even when it looks
    old, because the pid in its name says nothing about liveness here. The old cleanup
    unlinked it (its pid is not alive in this namespace)."""
    import shutil
    from r2comm.transport import shm
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a pid namespace")
    # a fork in the new namespace, after moving its last pid high: a pid unused in ours
    script = ('echo 3999990 > /proc/sys/kernel/ns_last_pid && "$0" -c "$1" "$2" "$3"; :')
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script,
                              sys.executable, _OTHER_NS_CREATOR, ROOT, JOB.decode()],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert len(line) == 2, line
        name, pid = line[0], int(line[1])
        assert os.path.exists("/dev/shm" + name)
        assert not shm._alive(pid), "precondition: the other namespace's pid is unused here"
        _age(name)
        shm.cleanup_stale()
        assert os.path.exists("/dev/shm" + name), "another pid namespace's segment removed"
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
        assert not os.path.exists("/dev/shm" + name)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for f in os.listdir("/dev/shm"):
            if f.startswith(f"r2comm-{JOB.hex()}-") and f.endswith("-0-1-00000031"):
                os.unlink("/dev/shm/" + f)


def test_local_pairs_follow_host_keys_and_r2comm_shm():
    from r2comm.transport import shm
    k = shm.shm_key()
    eps = [{"host_key": "h0", "shm": k, "rails": [1, 2]},
           {"host_key": "h0", "shm": k, "rails": [1, 2]},
           {"host_key": "h1", "shm": k, "rails": [1, 2]},
           {"host_key": "h0", "shm": None, "rails": [1, 2]},
           {"host_key": "h0", "shm": k + "-other-container", "rails": [1, 2]}]
    assert shm.local_peers(eps, 0) == [1]
    assert shm.data_rails(eps, 0, 4) == 2          # another /dev/shm (mount namespace): TCP
    assert shm.data_rails(eps, 0, 1) == 1
    assert shm.data_rails(eps, 0, 2) == 2          # another host: NIC rails
    assert shm.data_rails(eps, 0, 3) == 2          # R2COMM_SHM=0 on rank 3: TCP
    assert shm.data_rails(eps, 1, 1) == 0


# -- real jobs -------------------------------------------------------------------------------
def _run(n, scenario, timeout=120, env=None, **kw):
    args = [f"{k}={v}" for k, v in kw.items()]
    rc, out = run_mpi(n, [SHM_WORKER, scenario] + args, timeout=timeout, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, f"{scenario}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_exact_over_shared_memory(n):
    count, _ = _run(n, "collectives", timeout=60)
    assert count >= 300 * n


@pytest.mark.mpi
@pytest.mark.parametrize("n,hosts", [(3, "0,0,1"), (4, "0,1,0,1")])
def test_local_and_remote_peers_mixed(n, hosts):
    """Emulated hosts on loopback: same-host pairs over shared memory, the others over TCP."""
    count, _ = _run(n, "collectives", timeout=60, hosts=hosts)
    assert count >= 300 * n


@pytest.mark.mpi
def test_r2comm_shm_0_is_all_tcp():
    count, _ = _run(2, "collectives", timeout=60, env={"R2COMM_SHM": "0"})
    assert count >= 300 * 2


@pytest.mark.mpi
@pytest.mark.parametrize("n,hosts", [(3, None), (4, "0,0,1,1")])
def test_local_rank_killed_mid_collective(tmp_path, n, hosts):
    """SIGKILL of rank 1 (a local peer of rank 0) mid-stream: every survivor raises
    R2commNetworkError within 5 s of the kill, the local one by the shm link's doorbell socket
    closing (cause peer_process), and no segment of the job is left in /dev/shm."""
    others = [k for k in range(n) if k != 1]
    wait = " && ".join(f'[ -e "$0/rank{k}.txt" ]' for k in others)
    keep = ('"$@"; [ $? -eq 137 ] && for i in $(seq 150); do ' + wait +
            ' && break; sleep 0.1; done; exit 0')
    extra = [f"hosts={hosts}"] if hosts else []
    _, out = run_mpi(n, ["-c", keep, str(tmp_path), sys.executable, SHM_WORKER, "kill",
                         f"out={tmp_path}", *extra], timeout=60, expect_ok=False,
                     mpiexec_args=["-disable-auto-cleanup"], executable="sh")
    files = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert {"killed.txt", "pids.txt"} | {f"rank{k}.txt" for k in others} <= set(files), \
        out[-4000:]
    killed = float(files["killed.txt"])
    for k in others:
        line = files[f"rank{k}.txt"]
        took = float(re.search(r"raised_at=([\d.]+)", line).group(1)) - killed
        print(f"SIGKILL rank 1: rank {k} raised after {took:.2f} s: {line.strip()}")
        assert 0 < took < 5, line
        assert "R2commNetworkError" in line and "cause=peer_process" in line, line
    assert "local1=True" in files["rank0.txt"]
    pids = files["pids.txt"].split()
    left = [f for f in os.listdir("/dev/shm") if f.startswith("r2comm-") and
            any(f"-{p}-" in f for p in pids)]
    assert not left, left


@pytest.mark.mpi
def test_small_dev_shm_falls_back_to_tcp_for_the_pairs_that_do_not_fit():
    """/dev/shm too small for every local pair's segment (a 12 MiB tmpfs mounted over it in a
    private mount namespace, as a container's small /dev/shm; 3 ranks at the default 4 MiB
    rings need 3 x 8 MiB): start-up still succeeds, the pairs whose segment did not fit get a
    TCP link instead, the same on both ends, every collective is exact over both kinds, and
    the opener warns naming the fixes. The old code failed start-up (no path between ranks)."""
    import shutil
    from conftest import mpiexec_path
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs over /dev/shm")
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["MPIEXEC_TIMEOUT"] = "90"
    e.pop("R2COMM_SHM_RING", None)
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=12m r2comm-test /dev/shm && exec "$@"', "sh",
           mpiexec_path(), "-n", "3", sys.executable, SHM_WORKER, "small_shm"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                       timeout=150)
    out = p.stdout
    assert p.returncode == 0 and "OK small_shm " in out, out[-4000:]
    assert int(re.search(r"OK small_shm (\d+)", out).group(1)) >= 300 * 3
    kinds = {}
    for m in re.finditer(r"LINKS rank=(\d) (\{.*\})", out):
        kinds[int(m.group(1))] = ast.literal_eval(m.group(2))
    assert set(kinds) == {0, 1, 2}, out[-3000:]
    tcp_pairs = {(a, b) for a in kinds for b, k in kinds[a].items() if k == "tcp" and a < b}
    for a in kinds:
        for b, k in kinds[a].items():
            assert kinds[b][a] == k, kinds             # both ends agree on the pair's link
    assert tcp_pairs, kinds
    warned = set(re.findall(r"rank (\d): no shared-memory link to local rank (\d)", out))
    assert {(int(a), int(b)) for a, b in warned} == tcp_pairs, (warned, tcp_pairs)
    for fix in ("R2COMM_SHM_RING", "--shm-size", "R2COMM_SHM=0"):
        assert fix in out, fix


@pytest.mark.mpi
def test_stopped_local_process_is_held_not_failed():
    """Rank 1 stopped (SIGSTOP) for 1 s mid-stream, every rank local: the shm link has no
    kernel to acknowledge, but its doorbell socket is still open, so the late acks mean a
    stalled process (peer_stalled, cause peer_process, then peer_resumed), never a failed link;
    every result stays exact (fault_worker's stall scenario)."""
    from conftest import run_scenario
    count, out = run_scenario(3, "stall", timeout=60, stop=1)
    assert count == 3
    rows = [ln for ln in out.splitlines() if ln.startswith("STALL ")]
    assert rows and "'failed': []" in rows[0], out[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_failed_link_is_set_up_again(n):
    """A frame corrupted on the shm link (R2COMM_INTEGRITY=mac catches it) fails the link; the
    engine's fail-back sets up a new one (new segment, new handshake), the chunks are re-sent
    and every result stays exact."""
    count, out = _run(n, "relink", timeout=60, env={"R2COMM_INTEGRITY": "mac"})
    assert count == 40 * n
    assert "'rail_restored', 1, 0" in out, out[-3000:]


_WRITER = r"""
import os, random, select, sys, time
sys.path.insert(0, sys.argv[1])
from r2comm._core import shm_segments as E, testing
name, fd, total, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
base, n = E.shm_attach(name.encode(), 9, b"testjob!")
end = testing.ShmEnd(fd, base, n, 1)
rng = random.Random(seed)
blob = rng.randbytes(total)
sent, sleeps, stalls = 0, 0, 0
deadline = time.monotonic() + 120
while sent < total and time.monotonic() < deadline:
    r = end.send(blob[sent:sent + rng.choice([1, 5, 100, 3000, 4096, 7000])], rng.randint(1, 4))
    assert r >= 0, r
    sent += r
    if r == 0 and end.arm() == 0:           # full: sleep until the reader makes room
        sleeps += 1
        if not select.select([fd], [], [], 5.0)[0]:
            stalls += 1                      # a lost doorbell would end up here
        end.wake()
print(sent, sleeps, stalls, end.bells, flush=True)
end.close()
"""


def test_ring_across_processes_with_doorbells():
    """A writer process and this reader stream 16 MB through a 4 KiB ring concurrently, each
    sleeping on the doorbell socket whenever the ring is full / empty (arm, then select): every
    byte arrives in order, both sides really slept and rang, and no sleep ever waited out its
    5 s timeout (a lost wake-up)."""
    import select
    E = _segments()
    total, seed = 16_000_000, 11
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-00000009"
    base, n = E.shm_create(name.encode(), 4096, 9, JOB, os.getpid())
    s1, s2 = socket.socketpair()
    s1.setblocking(False)
    s2.setblocking(False)
    try:
        child = subprocess.Popen([sys.executable, "-c", _WRITER, ROOT, name, str(s2.fileno()),
                                  str(total), str(seed)], pass_fds=[s2.fileno()],
                                 stdout=subprocess.PIPE, text=True)
    finally:
        s2.close()
    reader = testing.ShmEnd(s1.detach(), base, n, 0)
    try:
        got = bytearray()
        sleeps = stalls = 0
        rng = random.Random(5)
        deadline = __import__("time").monotonic() + 120
        while len(got) < total and __import__("time").monotonic() < deadline:
            x = reader.recv(rng.choice([1, 48, 4096, 10000]))
            assert not isinstance(x, int), x
            got += x
            if not x and reader.arm() == 0:
                sleeps += 1
                if not select.select([reader.fileno()], [], [], 5.0)[0]:
                    stalls += 1
                reader.wake()
        out, _ = child.communicate(timeout=120)
        rbells = reader.bells
    finally:
        if child.poll() is None:
            child.kill()
        reader.close()
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)
    sent, wsleeps, wstalls, wbells = map(int, out.split())
    assert sent == total and len(got) == total
    assert bytes(got) == random.Random(seed).randbytes(total)
    assert stalls == 0 and wstalls == 0, (stalls, wstalls)
    assert sleeps + wsleeps > 0 and wbells + rbells > 0
    with pytest.raises(ValueError):
        reader.recv(1)                       # closed: refused, not a crash
