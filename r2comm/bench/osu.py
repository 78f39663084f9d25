"""OSU-style timing loops, interleaved across libraries, with medians over rounds.

Method (kept close to the OSU micro-benchmarks so numbers compare):
  * collectives: each iteration is timed on its own and followed by a barrier
    on the harness's communicator (outside the timer); a rank's time is its
    mean over the iterations; the table's Avg/Min/Max are the mean/min/max of
    that over ranks (OSU), and bandwidths use the slowest rank's time;
  * latency: ping-pong between ranks 0 and 1, one-way time = round trip / 2;
  * bw: rank 0 streams a window of messages to rank 1, which acknowledges
    each window; bandwidth = bytes in the windows / time.

Fairness on a small, noisy machine: for each size every library is measured
in turn, for several rounds, starting with a different library each round,
and the median over rounds is reported.  The iteration count of each
(size, library) is chosen once from a short calibration so that one
measurement takes about `budget` seconds (OSU's -i is the upper bound) and is
then identical on all ranks and in all rounds.
"""
import time
from dataclasses import dataclass, field
from statistics import median

import numpy as np
from mpi4py import MPI

from .data import make_case, make_p2p

_clock = time.perf_counter


# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw * factor(n).
BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "bcast": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "allgatherv": lambda n: (n - 1) / n,
    "alltoallv": lambda n: (n - 1) / n,
    "scan": lambda n: 1.0,
}


def polite_barrier(comm, spin_s=200e-6, nap_s=50e-6):
    """Barrier that spins briefly, then naps between polls.

    MPI_Barrier busy-polls.  On a machine with as many cores as ranks, a rank
    spinning in it takes the CPU from work the libraries still do after a call
    returns on that rank (Gloo's and r2comm's I/O threads, the kernel's TCP
    processing), which tripled Gloo's measured allreduce time on 2 cores.
    Spinning first keeps the ranks' exit skew small when they arrive together,
    which is what small-message latencies need.
    """
    req = comm.Ibarrier()
    give_up = _clock() + spin_s
    while not req.Test():
        if _clock() > give_up:
            time.sleep(nap_s)


class CheckFailed(RuntimeError):
    """A result differed from the numpy reference (--check)."""


@dataclass
class Settings:
    """Timing knobs shared by all subcommands (OSU's -i/-x plus the round/budget scheme)."""
    iters: int = 1000  # -i: upper bound on timed iterations per measurement
    warmup: int = 10  # -x: upper bound on untimed iterations before each measurement
    rounds: int = 3  # interleaved repeats; the median is reported
    budget: float = 0.25  # target seconds per measurement; <= 0 means exactly -i / -x
    check: bool = False  # validate every result against the reference
    min_iters: int = 3

    def plan(self, seconds_per_iter):
        """(iters, warmup) for a measurement whose iterations take about `seconds_per_iter`."""
        if self.budget <= 0:
            return self.iters, self.warmup
        want = int(self.budget / max(seconds_per_iter, 1e-9))
        iters = max(1, min(self.iters, max(self.min_iters, want)))
        return iters, min(self.warmup, max(1, iters // 4))


@dataclass
class Result:
    """One (size, library): per-round (avg, min, max) seconds and their medians."""
    lib: str
    size: int
    count: int
    iters: int
    warmup: int
    rounds: list = field(default_factory=list)

    @property
    def avg(self):
        return median(r[0] for r in self.rounds)

    @property
    def min(self):
        return median(r[1] for r in self.rounds)

    @property
    def max(self):
        return median(r[2] for r in self.rounds)


class Collective:
    """One collective kind; times one call per iteration like osu_allreduce."""
    messages_per_iteration = 1  # bandwidth = size * this / time

    def __init__(self, kind, world, dtype="float32", op="sum", root=0, check=False):
        self.kind, self.world, self.dtype, self.op, self.root, self.check = kind, world, dtype, op, root, check
        self.factor = BUSBW_FACTOR[kind](world.size)

    def case(self, size):
        return make_case(self.kind, size, self.world.rank, self.world.size, self.dtype, self.op, self.root)

    def prepare(self, lib, case):
        return lib.collective(case, self.op)

    def measure(self, prepared, case, lib, iters, warmup):
        """(mean, min, max) over ranks of each rank's mean time per call."""
        run, pre = prepared
        before = [f for f in ((case.reset if self.check else None), pre) if f]
        world = self.world
        for _ in range(warmup):
            for f in before:
                f()
            run()
        polite_barrier(world)
        total = 0.0
        for _ in range(iters):
            for f in before:
                f()
            t = _clock()
            run()
            total += _clock() - t
            if self.check and not case.check():
                _fail(self.kind, lib, case)
            polite_barrier(world)
        per_rank = world.allgather(total / iters)
        return sum(per_rank) / len(per_rank), min(per_rank), max(per_rank)

    @staticmethod
    def time_of(stats):
        """Time used for algbw: the slowest rank (a collective ends when its last rank does)."""
        return stats[2]


class _Pair:
    """What the point-to-point benchmarks share: ranks 0 and 1 do the work, others wait."""
    factor = 1.0
    name = "p2p"

    def __init__(self, world, dtype="uint8", check=False):
        if world.size < 2:
            raise ValueError(f"{self.name} needs at least 2 ranks")
        self.world, self.dtype, self.check = world, dtype, check

    def case(self, size):
        return make_p2p(size, self.world.rank, self.dtype)


class PingPong(_Pair):
    """osu_latency: ranks 0 and 1 bounce a message; other ranks wait at the barrier."""
    name = "latency"
    messages_per_iteration = 1

    def prepare(self, lib, case):
        rank = self.world.rank
        if rank > 1:
            return None
        peer = 1 - rank
        return lib.send(case.send, peer), lib.recv(case.recv, peer)

    def measure(self, prepared, case, lib, iters, warmup):
        """(mean, min, max) over iterations of rank 0's one-way time, shared with all ranks."""
        rank = self.world.rank
        times = np.zeros(iters)
        polite_barrier(self.world)
        if rank <= 1:
            send, recv = prepared
            first, second = (send, recv) if rank == 0 else (recv, send)
            for i in range(-warmup, iters):
                t = _clock()
                first()
                second()
                if i >= 0:
                    times[i] = _clock() - t
                if self.check:
                    if not case.check():
                        _fail("latency", lib, case)
                    case.reset()
        stats = (times.mean() / 2, times.min() / 2, times.max() / 2) if rank == 0 else None
        return self.world.bcast(stats, root=0)

    @staticmethod
    def time_of(stats):
        return stats[0]


class Stream(_Pair):
    """osu_bw: rank 0 sends `window` messages back to back, rank 1 acknowledges each window."""
    name = "bw"

    def __init__(self, world, dtype="uint8", check=False, window=64):
        super().__init__(world, dtype, check)
        self.window = window
        self.messages_per_iteration = window
        self.ack = np.zeros(4, np.uint8)

    def prepare(self, lib, case):
        rank = self.world.rank
        if rank > 1:
            return None
        sending = rank == 0
        data = lib.window(case.send if sending else case.recv, 1 - rank, self.window, sending)
        ack = lib.recv(self.ack, 1) if sending else lib.send(self.ack, 0)
        return data, ack

    def measure(self, prepared, case, lib, iters, warmup):
        """(mean, min, max) over iterations of rank 0's time per window, shared with all ranks."""
        rank = self.world.rank
        times = np.zeros(iters)
        polite_barrier(self.world)
        if rank <= 1:
            data, ack = prepared
            for i in range(-warmup, iters):
                t = _clock()
                data()
                ack()
                if i >= 0:
                    times[i] = _clock() - t
                if self.check and rank == 1:
                    if not case.check():
                        _fail("bw", lib, case)
                    case.reset()
        stats = (times.mean(), times.min(), times.max()) if rank == 0 else None
        return self.world.bcast(stats, root=0)

    @staticmethod
    def time_of(stats):
        return stats[0]


def _fail(what, lib, case):
    i, got, want = case.first_mismatch()
    raise CheckFailed(f"{what} check failed: {lib.label}, {case.nbytes} bytes, "
                      f"element {i}: got {got}, expected {want}")


def sweep(bench, libs, sizes, settings, on_size=None):
    """Measure every size on every library, interleaved; returns {lib label: [Result]}.

    `on_size(case, results)` is called after each size (for streaming tables).
    Sizes that round to the same buffer (small allgathers, say) are measured once.
    """
    out = {lib.label: [] for lib in libs}
    seen = set()
    for size in sizes:
        case = bench.case(size)
        if case.nbytes in seen:
            continue
        seen.add(case.nbytes)
        if settings.check:
            case.reset()
        prepared = [bench.prepare(lib, case) for lib in libs]
        results = []
        for lib, prep in zip(libs, prepared):
            seconds = calibrate(bench, prep, case, lib, settings) if settings.budget > 0 else 0.0
            iters, warmup = settings.plan(seconds)
            results.append(Result(lib.label, case.nbytes, case.count, iters, warmup))
        for rnd in range(settings.rounds):
            for k in _rotated(len(libs), rnd):
                r = results[k]
                r.rounds.append(bench.measure(prepared[k], case, libs[k], r.iters, r.warmup))
        for lib, r in zip(libs, results):
            out[lib.label].append(r)
        if on_size:
            on_size(case, results)
    return out


def calibrate(bench, prepared, case, lib, settings):
    """Seconds per iteration, the same on all ranks (slowest rank's estimate).

    Probes of 1, 4, 16, ... iterations until one lasts a tenth of the budget,
    so that a slow first call (connection set-up, page faults) does not stand
    for the steady state of small messages.
    """
    n, warmup = 1, 1
    while True:
        stats = bench.measure(prepared, case, lib, n, warmup)
        seconds = bench.world.allreduce(bench.time_of(stats), op=MPI.MAX)
        if seconds * n >= settings.budget / 10 or n >= settings.iters:
            return seconds
        n, warmup = n * 4, 0


def _rotated(n, start):
    """Library order for one round: each round starts one library later."""
    return [(start + i) % n for i in range(n)]
