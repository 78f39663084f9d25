"""OSU-format tables with nccl-tests bandwidth columns, and the JSON record.

The first columns are exactly OSU's for the first library (r2comm unless
--no-r2comm), so existing OSU parsers read them; the nccl-tests algbw/busbw
columns follow, then per peer its time (or bandwidth), busbw and the ratio.
A ratio is always first-library speed / peer speed: > 1 means the first
library is faster, for latency and bandwidth tests alike.
"""
import json
import os
import platform
import subprocess
import sys
import time
from statistics import median

TITLES = {
    "allreduce": "# OSU MPI Allreduce Latency Test",
    "allgather": "# OSU MPI Allgather Latency Test",
    "reduce_scatter": "# OSU MPI Reduce_scatter Latency Test",
    "bcast": "# OSU MPI Broadcast Latency Test",
    "alltoall": "# OSU MPI All-to-All Personalized Exchange Latency Test",
    "gather": "# OSU MPI Gather Latency Test",
    "scatter": "# OSU MPI Scatter Latency Test",
    "allgatherv": "# OSU MPI Allgatherv Latency Test",
    "alltoallv": "# OSU MPI All-to-Allv Personalized Exchange Latency Test",
    "scan": "# OSU MPI Scan Latency Test",
    "latency": "# OSU MPI Latency Test",
    "bw": "# OSU MPI Bandwidth Test",
}

SIZE_W, NUM_W, ITER_W, PEER_W = 10, 18, 12, 16


def metrics(bench, result):
    """Per-(size, library) numbers for tables and JSON, from the medians over rounds."""
    seconds = median(bench.time_of(r) for r in result.rounds)
    algbw = result.size * bench.messages_per_iteration / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "lib": result.lib, "size": result.size, "count": result.count,
        "iters": result.iters, "warmup": result.warmup,
        "avg_us": result.avg * 1e6, "min_us": result.min * 1e6, "max_us": result.max * 1e6,
        "time_us": seconds * 1e6,
        "algbw_GBps": algbw, "busbw_GBps": algbw * bench.factor, "MBps": algbw * 1e3,
        "rounds_us": [[v * 1e6 for v in r] for r in result.rounds],
        "round_us": [bench.time_of(r) * 1e6 for r in result.rounds],
    }


class Table:
    """Streams one OSU-style table: header once, then a row per size."""

    def __init__(self, kind, labels, full, out=None):
        self.kind, self.labels, self.full, self.out = kind, labels, full, out
        # a peer's columns are wide enough for its longest name (r2comm-noack)
        self.peer_w = [max(PEER_W, 2 + max(len(f"{labels[0]}/{p}"), len(f"{p}:busbw"), len(f"{p}(MB/s)")))
                       for p in labels[1:]]

    def _print(self, line):
        print(line, file=self.out or sys.stdout, flush=True)

    def _columns(self):
        first, peers = self.labels[0], self.labels[1:]
        if self.kind == "bw":
            cols = [("Bandwidth (MB/s)", NUM_W)]
        else:
            cols = [("Latency (us)" if self.kind == "latency" else "Avg Latency(us)", NUM_W)]
            if self.full:
                cols += [("Min Latency(us)", NUM_W), ("Max Latency(us)", NUM_W), ("Iterations", ITER_W)]
        if self.kind not in ("latency", "bw"):
            cols += [("algbw(GB/s)", NUM_W), ("busbw(GB/s)", NUM_W)]
        for p, w in zip(peers, self.peer_w):
            if self.kind == "bw":
                cols.append((f"{p}(MB/s)", w))
            else:
                cols.append((f"{p}(us)", w))
                if self.kind != "latency":
                    cols.append((f"{p}:busbw", w))
            cols.append((f"{first}/{p}", w))
        return cols

    def header(self, lines):
        """Title, '# ' comment lines describing the run, then the column names."""
        self._print(TITLES[self.kind])
        for line in lines:
            self._print(f"# {line}")
        head = f"{'# Size':<{SIZE_W}}" + "".join(f"{name:>{w}}" for name, w in self._columns())
        self._print(head)

    def row(self, rows):
        """`rows`: metrics() dicts for one size, in library order."""
        first, peers = rows[0], rows[1:]
        if self.kind == "bw":
            cells = [f"{first['MBps']:>{NUM_W}.2f}"]
        else:
            cells = [f"{first['avg_us']:>{NUM_W}.2f}"]
            if self.full:
                cells += [f"{first['min_us']:>{NUM_W}.2f}", f"{first['max_us']:>{NUM_W}.2f}",
                          f"{first['iters']:>{ITER_W}d}"]
        if self.kind not in ("latency", "bw"):
            cells += [f"{first['algbw_GBps']:>{NUM_W}.3f}", f"{first['busbw_GBps']:>{NUM_W}.3f}"]
        for p, w in zip(peers, self.peer_w):
            if self.kind == "bw":
                cells.append(f"{p['MBps']:>{w}.2f}")
            else:
                cells.append(f"{p['avg_us']:>{w}.2f}")
                if self.kind != "latency":
                    cells.append(f"{p['busbw_GBps']:>{w}.3f}")
            cells.append(f"{speed_ratio(first, p):>{w}.2f}")
        self._print(f"{first['size']:<{SIZE_W}d}" + "".join(cells))


def speed_ratio(a, b):
    """How many times faster `a` is than `b` at the same size: round by round (each round
    measures both back to back) b's time / a's time, median over the rounds. The machine's
    speed drifts between rounds, for both libraries at once, and the per-round ratio cancels
    that; the ratio of the two medians does not (1 MiB in one run: r2comm faster in 4 of 5
    rounds, median ratio 1.18x, ratio of the medians 0.92x). Without paired rounds (files
    from before `round_us`), the ratio of the medians."""
    ra, rb = a.get("round_us"), b.get("round_us")
    if ra and rb and len(ra) == len(rb) and all(x > 0 for x in ra):
        return median(y / x for x, y in zip(ra, rb))
    return medians_ratio(a, b)


def medians_ratio(a, b):
    """b's median time / a's median time."""
    return b["time_us"] / a["time_us"] if a["time_us"] > 0 else float("nan")


def summary_lines(kind, nranks, labels, dtype, op, settings, factor):
    """The '# ...' lines under the title: what was run and how numbers are defined."""
    lines = [f"r2comm.bench {kind}: {nranks} ranks, dtype {dtype}"
             + (f", op {op}" if kind in ("allreduce", "reduce_scatter") else "")
             + f"; libraries: {', '.join(labels)}",
             f"median of {settings.rounds} interleaved rounds; iterations <= {settings.iters}"
             + (f", ~{settings.budget:g} s per measurement" if settings.budget > 0 else "")
             + ("; every result checked against numpy" if settings.check else "")]
    if kind not in ("latency", "bw"):
        lines.append(f"bytes as in nccl-tests; algbw = bytes/t (t: slowest rank), "
                     f"busbw = algbw*{factor:.3g}; ratio = speed of {labels[0]} / peer in each round, "
                     f"median over rounds")
    elif len(labels) > 1:
        lines.append(f"ratio = speed of {labels[0]} / peer in each round, median over rounds "
                     f"(>1: {labels[0]} faster)")
    return lines


def document(kind, argv, nranks, libraries, settings, rows_by_lib, extra=None):
    """The JSON record of one run (written by rank 0)."""
    doc = {
        "schema": "r2comm.bench/1", "bench": kind, "argv": argv, "nranks": nranks,
        "time": time.time(), "host": platform.node(), "python": platform.python_version(),
        "settings": {"iters": settings.iters, "warmup": settings.warmup, "rounds": settings.rounds,
                     "budget_s": settings.budget, "check": settings.check},
        "libraries": libraries,
        "results": rows_by_lib,
        "machine": machine(),
    }
    doc.update(extra or {})
    return doc


def machine():
    """Facts about the machine and software of a run, for bench/RESULTS.md (best effort)."""
    from importlib import metadata
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    versions = {}
    for dist in ("numpy", "mpi4py", "mpich", "torch", "matplotlib"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    info["versions"] = versions
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        info["mpi_library"] = mpi.Get_library_version().splitlines()[0].strip()
    info["r2comm_commit"] = _git_commit()
    return info


def _git_commit():
    """HEAD of the checkout r2comm runs from, '+' when it has uncommitted changes; None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path, doc):
    """Write atomically so a killed run never leaves a truncated file behind."""
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(value):
    """numpy scalars and other odd values in event dicts."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
