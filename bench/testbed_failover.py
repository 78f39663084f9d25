#!/usr/bin/env python3
"""Multi-rail bandwidth and NIC failover in the emulated cluster (r2comm.testbed), as root.

    sudo .venv/bin/python bench/testbed_failover.py              # 2 then 4 ranks, ~50 s
    sudo .venv/bin/python bench/testbed_failover.py --ranks 2    # one rank per host, ~25 s

A fabric of 2 hosts x 2 rail NICs, each NIC shaped to --rate (1gbit) by tbf, so the
network and not the CPU limits r2comm.  Ranks are placed in blocks (one host per half of
the job); NIC k of every host is on switch k.  For each job size it runs two jobs:

  single   Communicator(rails=[this host's NIC 0]) only: the one-NIC baseline
  failover both NICs: (1) --iters timed allreduces, healthy; (2) a stream of allreduces
           for --stream-seconds while this script takes host 1's NIC 0 down for real
           (`ip link set nic0 down` in host 1's namespace) --fail-at seconds into the
           stream; rank 0 samples comm.rails[i].bytes_sent every --sample-ms from a
           thread; (3) --iters timed allreduces with the NIC still down

Every allreduce result is compared bit for bit with the reference (integer-valued float32).
Bandwidth follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n, with the time
of --iters back-to-back ops after a barrier, the slowest rank's.  The failure is
described by: detection delay (fault -> first rail_failed event), the pause (longest run of
samples after the fault in which rank 0 sent < 10% of its healthy rate), and the longest
gap between allreduce completions around the fault (vs the healthy op time).

Writes --out/testbed_failover.json, --out/testbed_timeline.png (the first job size) and
testbed_timeline_<n>ranks.png for the others.  rank 0's counters are summed over its peers
(comm.rails), so with 2 ranks per host they include its same-host peer, whose traffic
takes the host's loopback rather than a NIC: the 2-rank timeline is the clean one.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from r2comm.bench.failover import RailSampler  # noqa: E402
from r2comm.testbed import kill_job  # noqa: E402

MAX_STREAM_OPS = 10_000


# ------------------------------------------------------------------------------- worker side
def _inputs(rank, nranks, count):
    """Integer-valued float32 inputs, so sums are exact whatever the order of reduction."""
    base = (np.arange(count, dtype=np.int64) % 251).astype(np.float32)
    x = base + np.float32(rank)
    ref = base * np.float32(nranks) + np.float32(nranks * (nranks - 1) // 2)
    return x, ref


def fresh_marker(out, name):
    """The path of a file the ranks create to signal the driver (in OUT, made if need be),
    with a stale one from an earlier run removed (shared by the testbed_* scripts)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    if os.path.exists(path):
        os.remove(path)
    return path


def wait_marker(path, proc, seconds):
    """Wait, at most SECONDS, until PATH exists or the job PROC ended."""
    deadline = time.time() + seconds
    while not os.path.exists(path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)


def rank_job(mib, timeout=120):
    """What a testbed bench rank starts with: (world, comm, x, ref, y) for a float32
    allreduce of `mib` MiB with exact inputs (shared by the testbed_* scripts)."""
    from mpi4py import MPI
    import r2comm
    world = MPI.COMM_WORLD
    comm = r2comm.Communicator(world, timeout=timeout)
    x, ref = _inputs(comm.rank, comm.size, (mib << 20) // 4)
    return world, comm, x, ref, np.empty_like(x)


def _timed(comm, world, x, y, ref, iters, r2comm):
    """Seconds per op (slowest rank) of ITERS back-to-back allreduces, and wrong results."""
    from mpi4py import MPI
    wrong = 0
    y.fill(-1.0)
    world.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        comm.Allreduce(x, y, op=r2comm.SUM)
    dt = time.perf_counter() - t
    wrong += 0 if np.array_equal(y, ref) else 1
    return world.allreduce(dt, op=MPI.MAX) / iters, world.allreduce(wrong)


class Sampler(RailSampler):
    """The harness's rail sampler on a fixed grid (no stall watchdog), timestamped with
    time.time()."""

    def __init__(self, comm, period):
        super().__init__(comm, period, 0)
        self.name = "testbed-sampler"

    def run(self):
        try:
            nxt = time.monotonic()
            while True:
                # a fixed grid, but never catching up in a burst after the thread was starved
                # (back-to-back samples would turn one late interval into a huge rate)
                nxt = max(nxt + self.period, time.monotonic() + self.period / 2)
                if self._halt.wait(max(0.0, nxt - time.monotonic())):
                    break
                self.sample()
        except Exception as exc:  # kept in the result; the stream goes on
            self.error = repr(exc)


def worker(args):
    from mpi4py import MPI
    import r2comm
    world = MPI.COMM_WORLD
    rank, n = world.rank, world.size
    rails = os.environ["R2COMM_RAILS"].split(",")
    if args.worker == "single":
        rails = rails[:1]
    comm = r2comm.Communicator(world, rails=rails, timeout=60)
    count = args.size // 4
    x, ref = _inputs(rank, n, count)
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=r2comm.SUM)                   # warm-up
    out = {"nranks": n, "rails": [r.address for r in comm.rails], "size": count * 4}
    out["healthy_s"], wrong = _timed(comm, world, x, y, ref, args.iters, r2comm)
    if args.worker == "failover":
        sampler = Sampler(comm, args.sample_ms / 1e3) if rank == 0 else None
        world.Barrier()
        t0 = time.time()
        t_end = world.bcast(t0 + args.stream_seconds, root=0)
        if rank == 0:
            sampler.sample()
            sampler.start()
            tmp = args.marker + ".tmp"
            Path(tmp).write_text(json.dumps({"t0": t0}))
            os.replace(tmp, args.marker)
        ops = []
        while len(ops) < MAX_STREAM_OPS and world.allreduce(time.time() < t_end, op=MPI.LAND):
            y.fill(-1.0)
            comm.Allreduce(x, y, op=r2comm.SUM)
            ops.append(time.time())
            wrong += 0 if np.array_equal(y, ref) else 1
        if rank == 0:
            sampler.stop()
        out["after_s"], wrong_after = _timed(comm, world, x, y, ref, args.iters, r2comm)
        wrong += wrong_after
        events = world.gather([dict(e) for e in comm.events], root=0)
        all_ops = world.gather(ops, root=0)
        if rank == 0:
            out.update(t0=t0, ops=all_ops, events=events,
                       rails_end=[r.__dict__ for r in comm.rails],
                       samples={"t": sampler.t, "bytes_sent": sampler.sent,
                                "bytes_recv": sampler.recv, "state": sampler.state,
                                "error": sampler.error})
    out["wrong_results"] = world.allreduce(wrong)
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    comm.Free()


# ------------------------------------------------------------------------------- driver side
def _job(fab, nranks, mode, args, workdir, env, inject=None):
    """Run one worker job in the fabric (bounded); INJECT(t0) runs once the stream started."""
    result = workdir / f"{mode}-{nranks}.json"
    marker = workdir / f"{mode}-{nranks}.marker"
    for p in (result, marker):
        p.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
            "--result", str(result), "--marker", str(marker), "--size", str(args.size),
            "--iters", str(args.iters), "--stream-seconds", str(args.stream_seconds),
            "--sample-ms", str(args.sample_ms)]
    proc = fab.mpiexec(nranks, argv, env=env, timeout=args.job_timeout, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
    fault = None
    try:
        if inject is not None:
            deadline = time.monotonic() + args.job_timeout
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if marker.exists():
                fault = inject(json.loads(marker.read_text())["t0"])
        out, _ = proc.communicate(timeout=args.job_timeout + 15)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out, _ = proc.communicate(timeout=10)
    finally:
        kill_job(proc)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"{mode} job with {nranks} ranks failed (rc {proc.returncode}):\n"
                         f"{out[-5000:]}")
    return json.loads(result.read_text()), fault


def _busbw(size, seconds, n):
    algbw = size / seconds
    return {"time_s": seconds, "algbw_GBps": algbw / 1e9,
            "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9,
            "busbw_Gbit": algbw * 2 * (n - 1) / n * 8 / 1e9}


def _longest_run(mask):
    """(start, length) of the longest run of True in MASK."""
    best, start, cur = (0, 0), 0, 0
    for i, m in enumerate(mask):
        cur = cur + 1 if m else 0
        if cur == 1:
            start = i
        if cur > best[1]:
            best = (start, cur)
    return best


def _rates(res, key):
    """(interval end times, bytes/s per rail per sampling interval) from rank 0's samples."""
    s = res["samples"]
    t = np.asarray(s["t"])
    return t[1:], np.diff(np.asarray(s[key], float), axis=0) / np.diff(t)[:, None]


def analyze(res, t_fault, n):
    """Throughput before/after, detection delays, the pause and the op that met the fault.

    Rank 0's received bytes per 10 ms follow the wire (what got through the shaped NICs);
    its sent bytes lead it by the socket buffers, in window-sized bursts.  The pause is the
    longest run of intervals within 5 s after the fault in which rank 0 received < 10% of its
    healthy rate; for scale, the same measure over the healthy part of the stream (the
    boundaries between ops) is given as pause_healthy_s.
    """
    size = res["size"]
    mid, recv = _rates(res, "bytes_recv")
    _, sent = _rates(res, "bytes_sent")
    dt = np.diff(np.asarray(res["samples"]["t"]))
    total = recv.sum(axis=1)
    before = (mid > res["t0"] + 0.1) & (mid <= t_fault)
    after = mid > t_fault + 1.0
    healthy_rate = float(total[before].mean()) if before.any() else float("nan")

    def pause(window):
        start, length = _longest_run(window & (total < 0.1 * healthy_rate))
        return (float(dt[start:start + length].sum()),
                float(mid[start] - dt[start] - t_fault) if length else None)

    pause_s, pause_at = pause((mid > t_fault) & (mid <= t_fault + 5.0))
    pause_healthy, _ = pause(before)
    events = sorted((e for rank_ev in res["events"] for e in rank_ev), key=lambda e: e["t"])
    first = {}
    for e in events:
        if e["t"] >= t_fault - 0.5:
            first.setdefault(e["kind"], e)
    ops0 = np.asarray(res["ops"][0])
    marks = np.concatenate([[res["t0"]], ops0])
    spans = np.diff(marks)                                # each op's start -> completion
    pre = ops0 <= t_fault
    hit = int(np.argmax(ops0 > t_fault)) if (ops0 > t_fault).any() else None
    gbps = lambda v: (v / 1e9).tolist()                   # noqa: E731
    return {
        "t_fault_rel_s": t_fault - res["t0"],
        "rank0_recv_GBps_before": healthy_rate / 1e9,
        "rank0_recv_GBps_after": float(total[after].mean()) / 1e9 if after.any() else None,
        "rank0_recv_per_rail_GBps_before": gbps(recv[before].mean(axis=0)),
        "rank0_recv_per_rail_GBps_after": gbps(recv[after].mean(axis=0)) if after.any() else None,
        "rank0_sent_per_rail_GBps_before": gbps(sent[before].mean(axis=0)),
        "rank0_sent_per_rail_GBps_after": gbps(sent[after].mean(axis=0)) if after.any() else None,
        "pause_s": pause_s, "pause_starts_after_fault_s": pause_at,
        "pause_healthy_s": pause_healthy,
        "detect_s": {k: first[k]["t"] - t_fault for k in first},
        "first_events": {k: {kk: first[k][kk] for kk in ("rank", "peer", "rail", "detector",
                                                          "nbytes", "info") if kk in first[k]}
                         for k in first},
        "op_healthy_median_s": float(np.median(spans[pre][1:])) if pre.sum() > 1 else None,
        "op_hit_by_fault_s": float(spans[hit]) if hit is not None else None,
        "op_after_median_s": (float(np.median(spans[hit + 1:])) if hit is not None
                              and len(spans) > hit + 1 else None),
        "stream_ops": len(ops0),
        "events": [{k: e.get(k) for k in ("t", "rank", "kind", "peer", "rail", "detector",
                                          "nbytes", "info")} for e in events],
    }


def plot(res, t_fault, ana, rate_bps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    det = ana["detect_s"].get("rail_failed")
    for ax, key, smooth_n, what in ((axes[0], "bytes_recv", 1, "received (≈ wire), 10 ms"),
                                    (axes[1], "bytes_sent", 10, "sent into sockets, 100 ms avg")):
        mid, rate = _rates(res, key)
        rate = rate * 8 / 1e9
        x = mid - t_fault
        smooth = lambda v: np.convolve(v, np.ones(smooth_n) / smooth_n, mode="same")  # noqa: E731
        ax.plot(x, smooth(rate.sum(axis=1)), color="0.6", lw=3.0, label="total")
        for i in range(rate.shape[1]):
            ax.plot(x, smooth(rate[:, i]), color=colors[i % 4], lw=1.1,
                    label=f"rail {i} ({res['rails'][i]})")
        ax.axvline(0, color="red", lw=1.5, ls="--", label="nic_down(host 1, NIC 0)")
        if det is not None:
            ax.axvspan(0, det, color="red", alpha=0.12,
                       label=f"until first rail_failed ({det * 1e3:.0f} ms)")
        if rate_bps:
            ax.axhline(rate_bps / 1e9, color="gray", lw=0.8, ls=":", label="one NIC's rate")
        for op in res["ops"][0]:
            ax.axvline(op - t_fault, ymax=0.04, color="gray", lw=1.0)
        ax.set_ylabel(f"rank 0 {key.split('_')[1]} (Gbit/s)")
        ax.set_title(f"rank 0, {what}", fontsize=9, loc="left")
        top = float(np.nanmax(smooth(rate.sum(axis=1)))) * 1.05
        if rate_bps:  # a starved sampler can still show one short spike: keep the scale useful
            top = min(top, 3.0 * rate.shape[1] * rate_bps / 1e9)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("time from the fault (s); ticks: allreduce completions on rank 0")
    fig.suptitle(f"r2comm in the testbed: {res['nranks']} ranks, 2 hosts x 2 NICs, "
                 f"{res['size'] >> 20} MiB allreduce stream; NIC 0 of host 1 goes down at t=0\n"
                 f"op hit by the fault {ana['op_hit_by_fault_s'] * 1e3:.0f} ms "
                 f"(healthy {ana['op_healthy_median_s'] * 1e3:.0f} ms, after "
                 f"{ana['op_after_median_s'] * 1e3:.0f} ms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_size(fab, n, args, workdir, env):
    """The single-rail job and the failover job with N ranks; returns the run's record."""
    single, _ = _job(fab, n, "single", args, workdir, env)

    def inject(t0):
        time.sleep(max(0.0, t0 + args.fail_at - time.time()))
        t = time.time()
        fab.nic_down(1, 0)
        return t
    res, t_fault = _job(fab, n, "failover", args, workdir, env, inject=inject)
    if t_fault is None:
        raise SystemExit("the stream never started; no fault injected")
    ana = analyze(res, t_fault, n)
    run = {"nranks": n, "rails": res["rails"],
           "single_rail": _busbw(res["size"], single["healthy_s"], n),
           "healthy": _busbw(res["size"], res["healthy_s"], n),
           "after_failure": _busbw(res["size"], res["after_s"], n),
           "wrong_results": res["wrong_results"] + single["wrong_results"],
           "failover": ana, "t0": res["t0"], "t_fault": t_fault,
           "timeline": res["samples"], "ops": res["ops"], "rails_end": res["rails_end"]}
    run["speedup_2nics_vs_1"] = run["healthy"]["busbw_GBps"] / run["single_rail"]["busbw_GBps"]
    return res, t_fault, ana, run


def _print_run(run, args):
    n, ana = run["nranks"], run["failover"]
    ms = lambda v: f"{v * 1e3:.0f}" if v is not None else "-"   # noqa: E731
    print(f"# {n} ranks, {args.size >> 20} MiB allreduce, 2 hosts x 2 NICs @ {args.rate}")
    for key in ("single_rail", "healthy", "after_failure"):
        b = run[key]
        print(f"  {key:<14} busbw {b['busbw_GBps']:.3f} GB/s ({b['busbw_Gbit']:.2f} Gbit/s), "
              f"{b['time_s'] * 1e3:.0f} ms/op")
    print(f"  2 NICs / 1 NIC = {run['speedup_2nics_vs_1']:.2f}x; wrong results: "
          f"{run['wrong_results']}")
    det = ana["detect_s"]
    print(f"  fault at {ana['t_fault_rel_s']:.2f} s into the stream; rail_failed after "
          f"{ms(det.get('rail_failed'))} ms, first re-sent chunk acked after "
          f"{ms(det.get('redelivered'))} ms")
    print(f"  rank 0 receive rate {ana['rank0_recv_GBps_before'] * 8:.2f} -> "
          f"{(ana['rank0_recv_GBps_after'] or 0) * 8:.2f} Gbit/s; pause (<10% of healthy) "
          f"{ms(ana['pause_s'])} ms (op boundaries when healthy: {ms(ana['pause_healthy_s'])} "
          f"ms); op hit by the fault {ms(ana['op_hit_by_fault_s'])} ms, healthy "
          f"{ms(ana['op_healthy_median_s'])} ms, after {ms(ana['op_after_median_s'])} ms",
          flush=True)



def driver_dirs(script, out, prefix):
    """A testbed driver's start: root is needed (network namespaces); returns the output folder
    (made) and a fresh work folder for the ranks' files."""
    if os.geteuid() != 0:
        raise SystemExit(f"{script} needs root (network namespaces)")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, Path(tempfile.mkdtemp(prefix=prefix))

def driver(args):
    from r2comm.testbed import Fabric
    from r2comm.testbed.rates import parse_rate
    out_dir, workdir = driver_dirs("bench/testbed_failover.py", args.out, "r2tb-bench-")
    env = {"R2COMM_RAIL_TIMEOUT_MS": str(args.rail_timeout_ms)}
    report = {"config": {"hosts": 2, "nics": 2, "rate": args.rate, "size": args.size,
                         "iters": args.iters, "stream_seconds": args.stream_seconds,
                         "fail_at_s": args.fail_at, "sample_ms": args.sample_ms,
                         "R2COMM_RAIL_TIMEOUT_MS": args.rail_timeout_ms,
                         "fault": "fab.nic_down(1, 0): ip link set nic0 down in host 1",
                         "argv": sys.argv[1:]},
              "runs": {}}
    started = time.monotonic()
    try:
        for n in args.ranks:
            with Fabric(hosts=2, nics=2, rate=args.rate, tag=f"bf{os.getpid()}") as fab:
                res, t_fault, ana, run = _run_size(fab, n, args, workdir, env)
            png = "testbed_timeline.png" if n == args.ranks[0] else f"testbed_timeline_{n}ranks.png"
            plot(res, t_fault, ana, parse_rate(args.rate), out_dir / png)
            run["plot"] = png
            report["runs"][str(n)] = run
            _print_run(run, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.monotonic() - started
    (out_dir / "testbed_failover.json").write_text(json.dumps(report, indent=1))
    pngs = ", ".join(r["plot"] for r in report["runs"].values())
    print(f"# wrote {out_dir / 'testbed_failover.json'} and {pngs} in {report['seconds']:.0f} s")
    bad = sum(r["wrong_results"] for r in report["runs"].values())
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="job sizes, comma separated (default 2,4)")
    ap.add_argument("--rate", default="1gbit", help="per-NIC rate (default 1gbit)")
    ap.add_argument("--size", type=int, default=64 << 20, help="allreduce bytes (default 64 MiB)")
    ap.add_argument("--iters", type=int, default=5, help="timed allreduces per phase")
    ap.add_argument("--stream-seconds", type=float, default=5.0)
    ap.add_argument("--fail-at", type=float, default=1.5, help="seconds into the stream")
    ap.add_argument("--sample-ms", type=float, default=10.0)
    ap.add_argument("--rail-timeout-ms", type=float, default=500.0,
                    help="R2COMM_RAIL_TIMEOUT_MS for the job (r2comm's default 500)")
    ap.add_argument("--job-timeout", type=float, default=90.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    ap.add_argument("--worker", choices=["single", "failover"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--marker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.ranks = [int(v) for v in args.ranks.split(",")]
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
