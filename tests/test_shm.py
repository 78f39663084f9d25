"""The shared-memory transport (issue 20): the ring itself (in-process), segment set-up and
clean-up, and real mpiexec jobs: every collective exact over shared memory with 2-4 ranks on
one host, local and remote peers mixed (R2COMM_HOST per rank emulates hosts), NIC faults that
leave shared memory alone, and a local rank killed mid-collective."""
import os
import random
import re
import socket
import subprocess
import sys

import pytest

from conftest import run_mpi, ROOT

SHM_WORKER = os.path.join(ROOT, "tests", "shm_worker.py")
JOB = b"testjob!"
SHM_OK = True           # (conftest: these jobs run over shared memory)


def _engine():
    from r2comm._core import engine
    return engine


def _pair(ring=4096, conn_id=7):
    """Both ends of one link in this process: (creator end, peer end, segment name)."""
    E = _engine()
    name = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-{conn_id:08x}"
    base, n = E.shm_create(name.encode(), ring, conn_id, JOB, os.getpid())
    try:
        b2, n2 = E.shm_attach(name.encode(), conn_id, JOB)
    finally:
        os.unlink("/dev/shm" + name)
    s1, s2 = socket.socketpair()
    s1.setblocking(False)
    s2.setblocking(False)
    return E.ShmEnd(s1.detach(), base, n, 0), E.ShmEnd(s2.detach(), b2, n2, 1), name


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
    E = _engine()
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


def test_stale_segments_of_dead_processes_are_removed():
    """A process that dies between creating a segment and its peer mapping it leaves the name
    behind: cleanup_stale() removes it (its creator's pid is in the name), and leaves a live
    process's segment alone."""
    from r2comm import shm
    code = ("import os, sys; sys.path.insert(0, %r); from r2comm._core import engine as E; "
            "n = '/r2comm-%s-%%d-0-1-00000001' %% os.getpid(); "
            "E.shm_create(n.encode(), 4096, 1, %r, os.getpid()); print(n, flush=True); "
            "os._exit(0)") % (ROOT, JOB.hex(), JOB)
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         timeout=60, check=True).stdout.split()
    dead = out[0]
    assert os.path.exists("/dev/shm" + dead)
    live = f"/r2comm-{JOB.hex()}-{os.getpid()}-0-1-00000002"
    E = _engine()
    base, n = E.shm_create(live.encode(), 4096, 2, JOB, os.getpid())
    try:
        removed = shm.cleanup_stale()
        assert dead[1:] in removed
        assert not os.path.exists("/dev/shm" + dead)
        assert os.path.exists("/dev/shm" + live)
    finally:
        os.unlink("/dev/shm" + live)
        E.shm_unmap(base, n)


def test_local_pairs_follow_host_keys_and_r2comm_shm():
    from r2comm import shm
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
from r2comm._core import engine as E
name, fd, total, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
base, n = E.shm_attach(name.encode(), 9, b"testjob!")
end = E.ShmEnd(fd, base, n, 1)
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
    E = _engine()
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
    reader = E.ShmEnd(s1.detach(), base, n, 0)
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
