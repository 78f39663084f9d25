"""Multi-rank test scenarios, run under mpiexec by the pytest drivers.

    mpiexec -n N python tests/mpi_worker.py SCENARIO [key=value ...]

Each rank checks its own results against numpy (every rank can compute every rank's input,
since inputs are seeded by (case, rank)) and that all ranks hold the same bits. A scenario
prints "OK <scenario> <count>" on rank 0 when every check passed; any failed check raises,
so the job exits non-zero."""
import hashlib
import zlib
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, PROD, MIN, MAX  # noqa: E402
from r2comm._core import testing  # noqa: E402

WORLD = MPI.COMM_WORLD
DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64"]
OPS = [SUM, PROD, MIN, MAX]
NP_OPS = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}


def data(case, rank, count, dtype, op):
    """Integer-valued inputs whose reductions are exact in every dtype."""
    rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
    if op is PROD:
        vals = rng.choice([1, 1, 1, 2], size=count)
        if np.dtype(dtype).kind in "if":
            vals = vals * rng.choice([1, -1], size=count)
    elif op is SUM:
        hi = 10 if np.dtype(dtype).itemsize == 1 else 200
        vals = rng.integers(0, hi, size=count)
    else:
        vals = rng.integers(-50 if np.dtype(dtype).kind in "if" else 0, 100, size=count)
    return vals.astype(dtype)


def reduce_ref(case, n, count, dtype, op):
    acc = data(case, 0, count, dtype, op)
    for r in range(1, n):
        acc = NP_OPS[op.name](acc, data(case, r, count, dtype, op)).astype(dtype)
    return acc


def same_everywhere(arr, what):
    h = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    hs = WORLD.allgather(h)
    assert len(set(hs)) == 1, f"{what}: results differ between ranks"


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect(exc_type, fn, what):
    try:
        fn()
    except exc_type as exc:
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: expected {exc_type.__name__}, got "
                             f"{type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing raised")


def wait_rails_up(comm, limit):
    """True once every rail of this rank is up to every peer (polled, at most `limit` s)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(ra.state == "up" for ra in comm.rails):
            return True
        time.sleep(0.01)
    return False


def sizes(n, big=True):
    # 40001 float32 = 160 KB: ring allreduce with eager (owned) blocks of unequal sizes
    out = [0, 1, 7, 4 * n + 1, 1000, 40001]
    if big:
        out.append((3 << 20) // 8 + 3)     # several chunks, not divisible by n
    return out


# ------------------------------------------------------------------------------------------
def sc_collectives(comm, args):
    n, r = comm.size, comm.rank
    count = 0
    for dtype in DTYPES:
        big = dtype in ("float32", "int64", "float16")
        for op in OPS:
            for cnt in sizes(n, big and op is SUM):
                case = f"ar-{dtype}-{op.name}-{cnt}"
                x = data(case, r, cnt, dtype, op)
                # garbage in the output: the schedules write it without copying x there first
                y = np.frombuffer(np.random.bytes(x.nbytes), x.dtype).copy()
                comm.Allreduce(x, y, op)
                ref = reduce_ref(case, n, cnt, dtype, op)
                check(np.array_equal(y, ref), f"Allreduce {case}")
                same_everywhere(y, case)
                count += 1
    for cnt in sizes(n):
        # IN_PLACE, lowercase
        case = f"inplace-{cnt}"
        x = data(case, r, cnt, "float32", SUM)
        comm.Allreduce(r2comm.IN_PLACE, x, SUM)
        check(np.array_equal(x, reduce_ref(case, n, cnt, "float32", SUM)), case)
        z = comm.allreduce(data(case, r, cnt, "int32", MAX), MAX)
        check(np.array_equal(z, reduce_ref(case, n, cnt, "int32", MAX)), "lowercase " + case)
        count += 2
    check(comm.allreduce(r + 1) == n * (n + 1) // 2, "lowercase allreduce of int (pickle path)")
    for root in range(n):
        for cnt in sizes(n):
            for dtype in ("uint8", "float64"):
                case = f"bcast-{root}-{cnt}-{dtype}"
                b = data(case, root, cnt, dtype, SUM) if r == root else np.zeros(cnt, dtype)
                comm.Bcast(b, root)
                check(np.array_equal(b, data(case, root, cnt, dtype, SUM)), case)
                count += 1
            case = f"reduce-{root}-{cnt}"
            x = data(case, r, cnt, "int32", SUM)
            out = np.zeros(cnt, "int32") if r == root else None
            comm.Reduce(x, out, SUM, root)
            if r == root:
                check(np.array_equal(out, reduce_ref(case, n, cnt, "int32", SUM)), case)
            count += 1
    for cnt in sizes(n):
        for dtype in ("int16", "float32"):
            case = f"allgather-{cnt}-{dtype}"
            x = data(case, r, cnt, dtype, SUM)
            out = np.empty(cnt * n, dtype)
            comm.Allgather(x, out)
            ref = np.concatenate([data(case, k, cnt, dtype, SUM) for k in range(n)])
            check(np.array_equal(out, ref), case)
            inplace = np.zeros(cnt * n, dtype)
            inplace[r * cnt:(r + 1) * cnt] = x
            comm.Allgather(r2comm.IN_PLACE, inplace)
            check(np.array_equal(inplace, ref), "in-place " + case)
            case = f"rsb-{cnt}-{dtype}"
            x = data(case, r, cnt * n, dtype, SUM)
            out = np.empty(cnt, dtype)
            comm.Reduce_scatter_block(x, out, SUM)
            ref = reduce_ref(case, n, cnt * n, dtype, SUM)[r * cnt:(r + 1) * cnt]
            check(np.array_equal(out, ref), case)
            case = f"alltoall-{cnt}-{dtype}"
            x = data(case, r, cnt * n, dtype, SUM)
            out = np.empty(cnt * n, dtype)
            comm.Alltoall(x, out)
            ref = np.concatenate([data(case, k, cnt * n, dtype, SUM)[r * cnt:(r + 1) * cnt]
                                  for k in range(n)])
            check(np.array_equal(out, ref), case)
            count += 4
    comm.Barrier()
    return count


def sc_p2p(comm, args):
    n, r = comm.size, comm.rank
    count = 0
    for cnt in (0, 1, 1000, 300001):
        # ring exchange with Sendrecv
        case = f"sendrecv-{cnt}"
        out = np.empty(cnt, "float64")
        comm.Sendrecv(data(case, r, cnt, "float64", SUM), (r + 1) % n, 5, out, (r - 1) % n, 5)
        check(np.array_equal(out, data(case, (r - 1) % n, cnt, "float64", SUM)), case)
        count += 1
    if r == 0:
        # messages with different tags, received in reverse tag order
        for tag in range(5):
            comm.Send(np.full(10 + tag, tag, "int32"), 1, tag=tag)
        st = r2comm.Status()
        buf = np.zeros(100, "int64")
        comm.Recv(buf, 1, tag=7, status=st)
        check(st.count == 8 * 50 and (buf[:50] == 7).all(), "Recv with status and larger buffer")
        # truncation error is raised on the receiver
        comm.Send(np.ones(64, "uint8"), 1, tag=9)
    elif r == 1:
        for tag in reversed(range(5)):
            b = np.zeros(10 + tag, "int32")
            comm.Recv(b, 0, tag=tag)
            check((b == tag).all(), f"tagged recv {tag}")
        comm.Send(np.full(50, 7, "int64"), 0, tag=7)
        exc = expect(r2comm.R2commTruncateError, lambda: comm.Recv(np.zeros(8, "uint8"), 0, tag=9),
                     "truncated Recv")
        check("truncated" in str(exc), "truncation message")
    count += 7
    # truncation with the receive posted before the message arrives (its match fails while the
    # first header is being read), then the next message on the pair still gets through
    for it in range(4):
        if r == 1:
            req = comm.Irecv(np.zeros(8, "uint8"), 0, tag=11)
        WORLD.Barrier()
        if r == 0:
            comm.Send(np.ones(64 << 10 if it % 2 else 64, "uint8"), 1, tag=11)
            comm.Send(np.full(16, it, "uint8"), 1, tag=12)
        elif r == 1:
            expect(r2comm.R2commTruncateError, req.Wait, "truncated pre-posted Irecv")
            b = np.zeros(16, "uint8")
            comm.Recv(b, 0, tag=12)
            check((b == it).all(), "message after a truncated one")
        WORLD.Barrier()
    count += 1
    # many non-blocking sends/receives in flight, completed in reverse order
    reqs, bufs = [], []
    for k in range(8):
        peer = (r + 1 + k % (n - 1)) % n
        src = (r - 1 - k % (n - 1)) % n
        b = np.zeros(5000 + k, "int32")
        bufs.append((b, src, k))
        reqs.append(comm.Irecv(b, src, tag=k))
        reqs.append(comm.Isend(np.full(5000 + k, 1000 * r + k, "int32"), peer, tag=k))
    r2comm.Request.Waitall(list(reversed(reqs)))
    for b, src, k in bufs:
        check((b == 1000 * src + k).all(), f"Irecv {k}")
    count += 8
    comm.Barrier()
    return count


def sc_nonblocking(comm, args):
    n, r = comm.size, comm.rank
    reqs, outs = [], []
    cases = [(f"nb-{k}", [1, 1000, 100000, 700001][k % 4]) for k in range(10)]
    for case, cnt in cases:
        x = data(case, r, cnt, "int32", SUM)
        y = np.empty_like(x)
        outs.append(y)
        reqs.append(comm.Iallreduce(x, y, SUM))
    bc = data("nb-bcast", 0, 5000, "float32", SUM) if r == 0 else np.zeros(5000, "float32")
    reqs.append(comm.Ibcast(bc, 0))
    ag = np.empty(300 * n, "int16")
    reqs.append(comm.Iallgather(data("nb-ag", r, 300, "int16", SUM), ag))
    rs = np.empty(4000, "float64")
    reqs.append(comm.Ireduce_scatter_block(data("nb-rs", r, 4000 * n, "float64", SUM), rs, SUM))
    # complete in reverse order, with Test polling on one
    polls = 0
    while not reqs[0].Test():
        polls += 1
        time.sleep(0.001)
    for q in reversed(reqs[1:]):
        q.Wait()
    for (case, cnt), y in zip(cases, outs):
        check(np.array_equal(y, reduce_ref(case, n, cnt, "int32", SUM)), case)
    check(np.array_equal(bc, data("nb-bcast", 0, 5000, "float32", SUM)), "Ibcast")
    check(np.array_equal(ag, np.concatenate([data("nb-ag", k, 300, "int16", SUM) for k in range(n)])),
          "Iallgather")
    check(np.array_equal(rs, reduce_ref("nb-rs", n, 4000 * n, "float64", SUM)[r * 4000:(r + 1) * 4000]),
          "Ireduce_scatter_block")
    return len(reqs)


def sc_errors(comm, args):
    n, r = comm.size, comm.rank
    E = r2comm
    a = np.arange(20, dtype="float32")
    count = 0
    for what, fn, exc in [
        ("non-contiguous", lambda: comm.Allreduce(a[::2], np.empty(10, "float32")), E.R2commBufferError),
        ("read-only recvbuf", lambda: comm.Allreduce(a, np.frombuffer(bytes(80), "float32")),
         E.R2commBufferError),
        ("dtype differs", lambda: comm.Allreduce(a, np.empty(20, "float64")), E.R2commArgumentError),
        ("recvbuf too small", lambda: comm.Allreduce(a, np.empty(10, "float32")), E.R2commBufferError),
        ("unknown op", lambda: comm.Allreduce(a, np.empty(20, "float32"), op="XOR"), E.R2commArgumentError),
        ("unsupported dtype", lambda: comm.Allreduce(np.zeros(4, np.longdouble),
                                                     np.zeros(4, np.longdouble)), E.R2commArgumentError),
        ("MAX of complex", lambda: comm.Allreduce(np.zeros(4, "complex64"), np.zeros(4, "complex64"),
                                                  MAX), E.R2commArgumentError),
        ("list as buffer", lambda: comm.Allreduce([1, 2], np.empty(2)), E.R2commBufferError),
        ("bad root", lambda: comm.Bcast(a, root=n), E.R2commArgumentError),
        ("allgather recvbuf", lambda: comm.Allgather(a, np.empty(20 * n + 1, "float32")), E.R2commBufferError),
    ]:
        expect(exc, fn, what)
        count += 1
    # arguments that differ between ranks: every rank raises the same error class
    for what, fn in [
        ("sizes differ", lambda: comm.Allreduce(np.ones(1000 + r, "int32"), np.empty(1000 + r, "int32"))),
        ("big sizes differ", lambda: comm.Allreduce(np.ones(300000 + 7 * r, "int32"),
                                                    np.empty(300000 + 7 * r, "int32"))),
        ("dtypes differ", lambda: comm.Allreduce(np.ones(64, "int32" if r else "float32"),
                                                 np.empty(64, "int32" if r else "float32"))),
        ("ops differ", lambda: comm.Allreduce(np.ones(64, "int32"), np.empty(64, "int32"),
                                              SUM if r else MAX)),
    ]:
        exc = expect(r2comm.R2commMismatchError, fn, what)
        check("differ" in str(exc), f"{what}: message says what differs: {exc}")
        flags = WORLD.allgather(True)
        check(all(flags), what)
        count += 1
    # the communicator is still usable afterwards
    y = comm.allreduce(np.full(10, r, "int64"))
    check((y == n * (n - 1) // 2).all(), "allreduce after errors")
    # a freed communicator
    d = comm.Dup()
    d.Free()
    expect(r2comm.R2commClosedError, lambda: d.Allreduce(a, np.empty_like(a)), "freed communicator")
    # timeout: rank 0 of a Dup does not take part; the others raise within the timeout
    d = comm.Dup()
    d.timeout = 1.5
    t0 = time.monotonic()
    if r != 0:
        expect(r2comm.R2commTimeout, lambda: d.Allreduce(a, np.empty_like(a)), "timeout")
        check(time.monotonic() - t0 < 6, "timeout bounded")
    WORLD.Barrier()
    count += 2
    if n > 2:
        # mismatched roots can leave every rank waiting for a sender that never comes: no header
        # can show it, so each rank must end with an error within the timeout, not hang
        d = comm.Dup()
        d.timeout = 1.5
        t0 = time.monotonic()
        expect(r2comm.R2commError, lambda: d.Bcast(np.ones(100, "int32"), root=1 if r == 0 else 0),
               "roots differ")
        check(time.monotonic() - t0 < 6, "roots differ: bounded")
        WORLD.Barrier()
        count += 1
    return count


def sc_comms(comm, args):
    n, r = comm.size, comm.rank
    count = 0
    d = comm.Dup()
    y = d.allreduce(np.full(100, r + 1, "int64"))
    check((y == n * (n + 1) // 2).all(), "Dup allreduce")
    count += 1
    s = comm.Split(color=r % 2, key=-r)
    members = [k for k in range(n) if k % 2 == r % 2]
    check(s.size == len(members) and s.rank == len(members) - 1 - members.index(r), "Split ranks")
    if s.size > 1:
        y = s.allreduce(np.full(1000, r, "int64"))
        check((y == sum(members)).all(), "Split allreduce")
        b = np.arange(10.0) if s.rank == 0 else np.zeros(10)
        s.Bcast(b, 0)
        check(np.array_equal(b, np.arange(10.0)), "Split bcast")
    count += 1
    # both communicators interleaved
    y1 = np.empty(5, "int32")
    q1 = d.Iallreduce(np.full(5, 1, "int32"), y1)
    y2 = comm.allreduce(np.full(5, 2, "int32"))
    q1.Wait()
    check((y1 == n).all() and (y2 == 2 * n).all(), "interleaved communicators")
    none = comm.Split(color=None if r == 0 else 1)
    check((none is None) == (r == 0), "Split with undefined color")
    if none is not None:
        none.Free()
    s.Free()
    with comm.Dup() as w:
        w.Barrier()
    d.Free()
    count += 2
    return count


def sc_drain(comm, args):
    """Closing waits for the acks a peer still owes, so the delayed acks of small messages
    must leave before a rank closes: drain() sends them (a rank that closed with one queued
    left its peer in Free() until the drain timeout, 10 s). Ranks 0 and 1, 30 rounds: rank 1
    receives an eager message and drains at once; nothing may stay queued; Free is quick."""
    r = comm.rank
    buf = np.arange(16, dtype=np.int64)
    left = 0
    for i in range(30):
        if r == 0:
            comm.Send(buf + i, 1, tag=i)
        elif r == 1:
            out = np.empty_like(buf)
            comm.Recv(out, 0, tag=i)
            check(np.array_equal(out, buf + i), "eager message")
            check(comm.channel.engine.drain(2.0), "drained")
            left += sum(c[3] for rails in testing.debug_state(comm.channel.engine)["unsent"].values()
                        for c in rails)
        WORLD.Barrier()
    check(left == 0, f"{left} delayed acks still queued after drain()")
    t0 = time.monotonic()
    comm.Free()
    took = WORLD.allreduce(time.monotonic() - t0, op=MPI.MAX)
    check(took < 3.0, f"Free() took {took:.1f} s")
    return 30


def sc_spinon(comm, args):
    """A wait spins on while its sockets are busy (run with a tiny R2COMM_SPIN_US): 8 MiB
    allreduces outlast the spin, so waits get extended, and exactly; with the extension off
    no wait is, and the results are the same."""
    r, n = comm.rank, comm.size
    cnt = 2 << 20
    x = data("spin", r, cnt, "int32", SUM)
    ref = reduce_ref("spin", n, cnt, "int32", SUM)
    y = np.empty_like(x)
    eng = comm.channel.engine
    check(eng.tuning.spin < 1e-4, f"run with a short spin (R2COMM_SPIN_US), got {eng.tuning.spin}")
    for extend in (1, 0):
        eng.tuning.spin_extend = extend
        before = eng.tuning.spin_extended
        for _ in range(5):
            y[:] = 0
            comm.Allreduce(x, y)
            check(np.array_equal(y, ref), f"allreduce with spin_extend={extend}")
        got = WORLD.allreduce(eng.tuning.spin_extended - before)
        if extend:
            check(got > 0, "no wait was extended while 8 MiB allreduces kept the sockets busy")
        else:
            check(got == 0, f"{got} waits extended with spin_extend=0")
    eng.tuning.spin_extend = 1
    return 10


def sc_contended(comm, args):
    """CPU hogs (one per CPU, started by rank 0, each ends by itself after 5 s) make the
    waiters' busy-polling compete: the engine notices spins it lost the CPU in and shortens
    them (Engine.tuning.spin_preempted counts them); results stay exact."""
    import subprocess
    r = comm.rank
    hogs = []
    if r == 0:
        code = "import time\nt = time.time()\nwhile time.time() - t < 5: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]
    try:
        WORLD.Barrier()
        time.sleep(0.2)
        cnt = 1 << 18
        x = data("hog", r, cnt, "int32", SUM)
        ref = reduce_ref("hog", comm.size, cnt, "int32", SUM)
        y = np.empty_like(x)
        t_end = time.monotonic() + 3.0
        done = 0
        while True:
            comm.Allreduce(x, y)
            check(np.array_equal(y, ref), "allreduce under CPU contention")
            done += 1
            if done % 10 == 0 and WORLD.allreduce(time.monotonic() > t_end, op=MPI.LOR):
                break
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    pre = WORLD.allreduce(comm.channel.engine.tuning.spin_preempted)
    check(pre > 0, f"no contended spin noticed in {done} allreduces next to {os.cpu_count()} hogs")
    check(WORLD.allreduce(comm.channel.engine.tuning.spin_yields) > 0, "spinning waiters never yielded the CPU")
    if r == 0:
        print(f"CONTENDED ops={done} preempted_spins={pre}", flush=True)
    return 1


def sc_fastpath(comm, args):
    """Blocking Allreduce of small numpy arrays goes through one engine call
    (Communicator._fast_allreduce): exact results for every dtype and op (r2comm's and
    mpi4py's op objects, in place and not), one sequence number per call, in step with
    non-blocking and large calls in flight around it; its errors are the general path's, on
    every rank: sizes that differ, a read-only or non-contiguous buffer, a timeout, a freed
    communicator."""
    n, r = comm.size, comm.rank
    count = 0
    mpi_ops = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX}
    for dtype in DTYPES:
        for op in OPS:
            for cnt in (1, 3, 1000):
                for how in ("r2", "mpi", "inplace"):
                    case = f"fast-{dtype}-{op.name}-{cnt}-{how}"
                    x = data(case, r, cnt, dtype, op)
                    seq = comm.channel.next_call
                    if how == "inplace":
                        y = x.copy()
                        comm.Allreduce(r2comm.IN_PLACE, y, op)
                    else:
                        y = np.frombuffer(np.random.bytes(x.nbytes), x.dtype).copy()
                        comm.Allreduce(x, y, mpi_ops[op.name] if how == "mpi" else op)
                    check(comm.channel.next_call == seq + 1, f"{case}: {comm.channel.next_call - seq} sequence numbers")
                    check(np.array_equal(y, reduce_ref(case, n, cnt, dtype, op)), case)
                    count += 1
    check(any(k[0] == "fast" and v for k, v in comm.channel._plans.items()), "no call took the fast path")
    # the fast path's plans go with the others: an algorithm switched in-job (as
    # bench/testbed_hier.py does) is what the next call runs
    x = np.full(1 << 16, r + 1, np.float32)
    for algo in ("ring", "recursive_doubling", ""):
        comm.channel.config.algo = algo
        comm.channel._plans.clear()
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        check(np.all(y == n * (n + 1) / 2), f"allreduce with algo {algo!r}")
        ran = [v[0].algo for k, v in comm.channel._plans.items() if k[0] == "fast" and v]
        check(ran == [comm.schedule("allreduce", x.nbytes, 4).algo] and (ran[0] == algo or not algo),
              f"algo {algo!r}: the fast path ran {ran}")
    count += 3
    # in step with operations around it: a large Iallreduce in flight, small blocking ones
    big = np.full(300_000, r + 1, np.float64)
    bigout = np.empty_like(big)
    req = comm.Iallreduce(big, bigout)
    small = np.array([r + 1], np.int64)
    out = np.empty_like(small)
    for i in range(20):
        comm.Allreduce(small, out)
        check(out[0] == n * (n + 1) // 2, f"small allreduce {i} beside a large one: {out}")
    req.Wait()
    check(np.all(bigout == n * (n + 1) / 2), "large Iallreduce beside small ones")
    count += 21
    # sizes that differ: every rank raises, and the next call is fine
    x = np.ones(4 if r == 0 else 5, np.float32)
    expect(r2comm.R2commMismatchError, lambda: comm.Allreduce(x, np.empty_like(x)), "sizes")
    # a read-only receive buffer (this rank) or a strided one: an argument error here, a
    # peer error on the others
    ro = np.zeros(4, np.float64)
    ro.flags.writeable = False
    bad = ro if r == n - 1 else np.zeros(4, np.float64)
    exc = expect(r2comm.R2commError, lambda: comm.Allreduce(np.ones(4), bad), "read-only")
    want = r2comm.R2commArgumentError if r == n - 1 else r2comm.R2commPeerError
    check(isinstance(exc, want), f"read-only on rank {n - 1}: {type(exc).__name__} here")
    strided = np.zeros(8, np.float64)[::2] if r == 0 else np.zeros(4, np.float64)
    exc = expect(r2comm.R2commError, lambda: comm.Allreduce(np.ones(4), strided), "strided")
    want = r2comm.R2commArgumentError if r == 0 else r2comm.R2commPeerError
    check(isinstance(exc, want), f"strided on rank 0: {type(exc).__name__} here")
    out = np.empty(2, np.float64)
    comm.Allreduce(np.full(2, r, np.float64), out)
    check(np.all(out == n * (n - 1) / 2), "an allreduce after the errors")
    count += 4
    # a timeout: rank 0 calls alone on a duplicate and gives up after its timeout
    d = comm.Dup()
    d.timeout = 0.5
    if r == 0:
        t0 = time.monotonic()
        expect(r2comm.R2commTimeout, lambda: d.Allreduce(np.ones(1), np.empty(1)), "timeout")
        took = time.monotonic() - t0
        check(0.4 < took < 6, f"timed out after {took:.2f} s")
    WORLD.Barrier()
    d.Free()
    expect(r2comm.R2commClosedError, lambda: d.Allreduce(np.ones(1), np.empty(1)), "freed")
    count += 2
    return count


def sc_seqwrap(comm, args):
    """The communicator's sequence starts at `start` (default 2**32 - 3, the same on every
    rank: a private test hook) and real collectives run across 2**32, where the wire's uint32
    sequence wraps to 0: the 8-byte fast path, a large Allreduce, non-blocking calls in
    flight across the wrap, Bcast, Barrier, a Dup'ed communicator's own wrap, and an argument
    error that takes a sequence number. All exact; the sequence wrapped."""
    n, r = comm.size, comm.rank
    start = int(args.get("start", 2**32 - 3))
    comm.channel.seek_seq(start)
    count = 0
    for i in range(8):
        x = np.array([r + i], np.int64)                           # 8 bytes: the fast path
        y = np.zeros(1, np.int64)
        comm.Allreduce(x, y, SUM)
        check(y[0] == sum(k + i for k in range(n)), f"fast allreduce {i}: {y}")
        big = data(f"wrap-{i}", r, 300_000, "int32", SUM)
        out = np.empty_like(big)
        comm.Allreduce(big, out, SUM)
        check(np.array_equal(out, reduce_ref(f"wrap-{i}", n, 300_000, "int32", SUM)), f"big {i}")
        count += 2
    check(comm.channel.next_call < 100, f"sequence did not wrap: {comm.channel.next_call}")
    # (sequences only go forward: each case below starts a new communicator near the wrap)
    d = comm.Dup()
    d.channel.seek_seq(2**32 - 2)                                          # in flight across the wrap
    xs = [np.full(1000, r + k, np.float64) for k in range(5)]
    ys = [np.zeros(1000) for _ in range(5)]
    reqs = [d.Iallreduce(xs[k], ys[k], SUM) for k in range(5)]
    for k in range(4, -1, -1):
        reqs[k].Wait()
        check((ys[k] == sum(q + k for q in range(n))).all(), f"iallreduce {k}")
        count += 1
    b = np.arange(10, dtype=np.int32) if r == 0 else np.zeros(10, np.int32)
    d.Bcast(b, root=0)
    check(np.array_equal(b, np.arange(10)), "bcast after the wrap")
    d.Barrier()
    d.Free()
    d = comm.Dup()
    d.channel.seek_seq(2**32 - 1)                                          # an error takes the last one
    expect(r2comm.R2commError, lambda: d.Allreduce(np.zeros(3), np.zeros(2), SUM)
           if r == 0 else d.Allreduce(np.zeros(3), np.zeros(3), SUM), "size error at 2**32-1")
    check(d.channel.next_call == 0, f"an error's sequence number did not wrap: {d.channel.next_call}")
    for i in range(4):
        y = np.zeros(1, np.int64)
        d.Allreduce(np.array([i], np.int64), y, SUM)
        check(y[0] == n * i, f"allreduce {i} after an error at the wrap")
        count += 1
    d.Free()
    return count + 2


def sc_prepared(comm, args):
    """Communicator.prepare_allreduce: the function it returns is Allreduce for every dtype
    and op (one sequence number a call), matches a peer's Iallreduce, raises on bad input on
    every rank and stays in step after, gives exact results where the fast path does not apply
    (the general path then runs it), and on a freed communicator raises."""
    n, r = comm.size, comm.rank
    count = 0
    for dtype in DTYPES:
        for op in OPS:
            for cnt in (1, 3):
                case = f"prep-{dtype}-{op.name}-{cnt}"
                x = data(case, r, cnt, dtype, op)
                y = np.empty_like(x)
                seq = comm.channel.next_call
                if r == 1 and cnt == 3:            # the peer's call is non-blocking
                    comm.Iallreduce(x, y, op).Wait()
                else:
                    comm.prepare_allreduce(x.nbytes, x.dtype, op)(x, y)
                check(comm.channel.next_call == seq + 1, f"{case}: {comm.channel.next_call - seq} sequence numbers")
                check(np.array_equal(y, reduce_ref(case, n, cnt, dtype, op)), case)
                count += 1
    for bad in ((0, "float32"), (6, "float32"), (8, "complex128"), (8.0, "float64")):
        expect(r2comm.R2commArgumentError, lambda: comm.prepare_allreduce(*bad), f"prepare {bad}")
    expect(r2comm.R2commArgumentError, lambda: comm.prepare_allreduce(8, "float64", "XOR"),
           "prepare with an unknown op")
    run = comm.prepare_allreduce(16, np.float64, SUM)
    x, y = np.full(2, r + 1.0), np.empty(2)
    bad = np.empty(2, np.int64) if r == 0 else y            # rank 0 passes the wrong dtype
    exc = expect(r2comm.R2commError, lambda: run(x, bad), "a receive buffer of another dtype")
    want = r2comm.R2commArgumentError if r == 0 else r2comm.R2commPeerError
    check(isinstance(exc, want), f"wrong dtype on rank 0: {type(exc).__name__} here")
    expect(r2comm.R2commError, lambda: run(x, [0.0, 0.0]) if r == 1 else run(x, y), "a list")
    run(x, y)
    check(np.all(y == n * (n + 1) / 2), "a prepared call after the errors")
    count += 8
    comm.channel.config.replan_every = 4                # where the fast path does not apply (a re-plan
    for i in range(12):                       # check due), the general path runs the call
        x = np.full(2, r + i, np.float64)
        seq = comm.channel.next_call
        run(x, y)
        check(comm.channel.next_call == seq + 1, f"prepared call {i}, re-plan checks: {comm.channel.next_call - seq}")
        check(np.all(y == n * (n - 1) / 2 + n * i), f"prepared call {i} with re-plan checks")
    comm.channel.config.replan_every = 0
    count += 1
    d = comm.Dup()
    run_d = d.prepare_allreduce(8, np.float64, SUM)
    d.Free()
    expect(r2comm.R2commClosedError, lambda: run_d(np.ones(1), np.empty(1)), "freed")
    expect(r2comm.R2commClosedError, lambda: d.prepare_allreduce(8, np.float64), "prepare freed")
    return count + 2


def sc_aliased(comm, args):
    """Send and receive buffers that share memory (MPI forbids it; the schedules would read
    input they had already overwritten: a 1-element Iallreduce(x, x) on 4 ranks gave wrong sums)
    raise R2commBufferError on the rank that passed them, R2commPeerError on the others, on
    the fast path, the prepared call and the general path of every collective with both
    buffers; IN_PLACE still works, and the next call after each error is exact."""
    n, r = comm.size, comm.rank
    count = 0
    bad = (r == n - 1)                        # only the last rank passes aliased buffers
    want = r2comm.R2commBufferError if bad else r2comm.R2commPeerError

    def refused(fn, what):
        exc = expect(r2comm.R2commError, fn, what)
        check(isinstance(exc, want), f"{what}: {type(exc).__name__} on rank {r}")
        if bad:
            check("overlap" in str(exc), f"{what}: {exc}")
        y = np.empty(3)
        comm.Allreduce(np.full(3, r + 1.0), y)
        check(np.all(y == n * (n + 1) / 2), f"the allreduce after {what}")

    cases = {
        "Allreduce 1 (fast path)": lambda x: comm.Allreduce(x[:1], x[:1] if bad else x[1:2]),
        "Allreduce 4000 (fast path)": lambda x: comm.Allreduce(x[:4000], x[:4000] if bad else x[4000:8000]),
        "Allreduce overlapping halves": lambda x: comm.Allreduce(x[:4000], x[2000:6000] if bad else x[4000:8000]),
        "Iallreduce 1": lambda x: comm.Iallreduce(x[:1], x[:1] if bad else x[1:2]).Wait(),
        "Allreduce 2**20 (general path)": lambda x: comm.Allreduce(x[:1 << 19], x[:1 << 19] if bad else x[1 << 19:]),
        "prepared": lambda x: comm.prepare_allreduce(8, np.float64)(x[:1], x[:1] if bad else x[1:2]),
        "Reduce at the root": lambda x: comm.Reduce(x[:4], x[:4] if bad else x[4:8], root=n - 1),
        "Reduce_scatter_block": lambda x: comm.Reduce_scatter_block(x[:4 * n], x[:4] if bad else x[4 * n:4 * n + 4]),
        "Allgather": lambda x: comm.Allgather(x[:2], x[:2 * n] if bad else x[2 * n:4 * n]),
        "Alltoall": lambda x: comm.Alltoall(x[:n], x[:n] if bad else x[n:2 * n]),
    }
    for what, fn in cases.items():
        x = np.ones(1 << 20)
        refused(lambda: fn(x), what)
        count += 1
    x = np.full(5, r + 1.0)
    comm.Allreduce(r2comm.IN_PLACE, x)
    check(np.all(x == n * (n + 1) / 2), "IN_PLACE after the refused calls")
    # torch's (and NCCL's) in-place forms: the input is this rank's block of the output
    # (all-gather), the output this rank's block of the input (reduce-scatter)
    for k in (3, 50000):
        g = np.zeros(k * n)
        g[r * k:(r + 1) * k] = r + 1
        comm.Allgather(g[r * k:(r + 1) * k], g)
        check(np.array_equal(g, np.repeat(np.arange(1.0, n + 1), k)), f"in-place Allgather {k}")
        v = np.arange(k * n, dtype=np.float64) + r
        comm.Reduce_scatter_block(v, v[r * k:(r + 1) * k])
        want = n * np.arange(r * k, (r + 1) * k, dtype=np.float64) + n * (n - 1) / 2
        check(np.array_equal(v[r * k:(r + 1) * k], want), f"in-place Reduce_scatter_block {k}")
    return count + 3


SCENARIOS = {"collectives": sc_collectives, "p2p": sc_p2p, "nonblocking": sc_nonblocking,
             "errors": sc_errors, "comms": sc_comms, "drain": sc_drain, "contended": sc_contended,
             "spinon": sc_spinon, "fastpath": sc_fastpath, "seqwrap": sc_seqwrap,
             "prepared": sc_prepared, "aliased": sc_aliased}


def main(scenarios=None, default_timeout=30, dump_after=240, comm_kwargs=None):
    """Run the scenario named on the command line: one Communicator, the scenario, on failure
    the engine's last events and state on stderr, then "OK <name> <count summed over ranks>".
    Shared by every worker (mpi, fault, fabric, planner)."""
    import faulthandler
    name = sys.argv[1]
    args = dict(a.split("=", 1) for a in sys.argv[2:])
    if scenarios is None:
        if name in SCENARIOS:
            scenarios = SCENARIOS
        else:
            import fault_worker
            scenarios, default_timeout = fault_worker.SCENARIOS, 60
            comm_kwargs = fault_worker.comm_kwargs(args)
    faulthandler.dump_traceback_later(float(args.get("dump_after", dump_after)), exit=False)
    comm = r2comm.Communicator(MPI.COMM_WORLD, timeout=float(args.get("timeout", default_timeout)),
                               **(comm_kwargs or {}))
    try:
        count = scenarios[name](comm, args)
    except BaseException:
        for ev in comm.events[-30:]:
            print(f"rank {WORLD.rank} event: {ev}", file=sys.stderr)
        print(f"rank {WORLD.rank} state: {testing.debug_state(comm.channel.engine)}", file=sys.stderr,
              flush=True)
        raise
    total = WORLD.allreduce(count)
    if WORLD.rank == 0:
        print(f"OK {name} {total}", flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
