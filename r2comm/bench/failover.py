"""Failover test: a stream of allreduces while one rail fails.

Every rank runs back-to-back allreduces (4 MiB by default) for --duration
seconds.  One rank fails a rail at --fail-at seconds with comm.fail_rail()
from a timer thread, so the fault lands in the middle of a transfer as a real
NIC loss would (or, with --no-inject, the rail is taken down from outside and
the first 'rail_failed' event marks the fault).  A sampler thread reads every
rail's byte counters every --sample-ms, and each op's completion time is kept.

From these the test reports, per rank: throughput before the fault, the
pause (longest gap between op completions after the fault), throughput after
the pause, and the detection / migration delays from comm.events.

The ranks agree on when to stop without any extra message: the last element
of every allreduce carries a stop flag that a rank raises once its own clock
passes --duration, so all ranks see the raised flag in the same result.
"""
import os
import sys
import threading
import time

import numpy as np

from .data import pattern, reference
from .peers import rail_record
from .sizes import human


class RailSampler(threading.Thread):
    """Samples per-rail byte counters and states; aborts the job if ops stop completing.

    The watchdog exists because a collective that never finishes cannot be
    cancelled from Python: after --stall-timeout seconds without a completed
    op it prints what it knows and ends the process, which makes mpiexec end
    the others, instead of hanging until an outer timeout.
    """

    def __init__(self, comm, period_s, stall_timeout_s):
        super().__init__(daemon=True, name="r2bench-sampler")
        self.comm, self.period, self.stall = comm, period_s, stall_timeout_s
        self.t, self.sent, self.recv, self.state = [], [], [], []
        self.last_op = time.time()
        self.error = None
        self._halt = threading.Event()

    def sample(self):
        rails = self.comm.rails
        self.t.append(time.time())
        self.sent.append([r.bytes_sent for r in rails])
        self.recv.append([r.bytes_recv for r in rails])
        self.state.append([r.state for r in rails])

    def run(self):
        try:
            while not self._halt.wait(self.period):
                self.sample()
                if self.stall > 0 and time.time() - self.last_op > self.stall:
                    self._abort()
        except Exception as exc:  # reported in the summary; the stream itself goes on
            self.error = repr(exc)

    def _abort(self):
        rank = self.comm.rank
        print(f"# rank {rank}: no allreduce completed for {self.stall:g} s; "
              f"rail states {self.state[-1]}; last events {list(self.comm.events)[-5:]}",
              file=sys.stderr, flush=True)
        os._exit(3)

    def stop(self):
        self._halt.set()
        self.join()
        self.sample()  # closing sample after the last op

    def as_dict(self):
        return {"t": self.t, "bytes_sent": self.sent, "bytes_recv": self.recv, "state": self.state,
                "error": self.error}


class Timers:
    """The fault (and optional restore) actions of the failing rank, at fixed times after t0."""

    def __init__(self, comm, args, t0):
        self.comm, self.args, self.t0 = comm, args, t0
        self.t_fault = self.t_restore = None
        self.errors = []
        self._timers = []
        if not args.no_inject and comm.rank == args.fail_rank:
            self._timers.append(threading.Timer(max(0.0, t0 + args.fail_at - time.time()), self._fail))
            if args.restore_at is not None:
                self._timers.append(threading.Timer(max(0.0, t0 + args.restore_at - time.time()),
                                                    self._restore))
        for timer in self._timers:
            timer.daemon = True
            timer.start()

    def _fail(self):
        self.t_fault = time.time()
        try:
            self.comm.fail_rail(self.args.rail, mode=self.args.mode, peer=self.args.fail_peer)
        except Exception as exc:  # shown in the summary: an injection that failed is a result
            self.errors.append(f"fail_rail: {exc!r}")

    def _restore(self):
        self.t_restore = time.time()
        try:
            self.comm.restore_rail(self.args.rail)
        except Exception as exc:
            self.errors.append(f"restore_rail: {exc!r}")

    def cancel(self):
        for timer in self._timers:
            timer.cancel()
            if timer.is_alive():
                timer.join()


def stream(comm, r2, args, world):
    """Run the allreduce stream on this rank; returns its raw record (times, samples, events)."""
    count = max(2, args.size // np.dtype(args.dtype).itemsize)
    send = pattern(comm.rank, np.arange(count), args.dtype)
    send[-1] = 0  # the stop flag
    recv = np.empty_like(send)
    expected = reference(range(comm.size), np.arange(count - 1), args.dtype, "sum")
    for _ in range(args.warmup):
        comm.Allreduce(send, recv, op=r2.SUM)
    sampler = RailSampler(comm, args.sample_ms / 1e3, args.stall_timeout)
    world.Barrier()
    t0 = time.time()
    sampler.last_op = t0
    sampler.sample()
    sampler.start()
    timers = Timers(comm, args, t0)
    ops, bad = [], 0
    deadline = t0 + args.duration
    while True:
        if not send[-1] and time.time() >= deadline:
            send[-1] = 1
        comm.Allreduce(send, recv, op=r2.SUM)
        done = time.time()
        ops.append(done)
        sampler.last_op = done
        if args.check and not np.array_equal(recv[:-1], expected):
            bad += 1
        if recv[-1] > 0 or len(ops) >= args.max_ops:
            break
    sampler.stop()
    timers.cancel()
    return {"rank": comm.rank, "t0": t0, "ops": ops, "wrong_results": bad,
            "samples": sampler.as_dict(), "events": [dict(e) for e in comm.events],
            "t_fault": timers.t_fault, "t_restore": timers.t_restore, "errors": timers.errors,
            "rails": [rail_record(r) for r in comm.rails]}


def window(ops, t_begin, t_fault, t_end, nbytes):
    """Throughput before `t_fault`, the pause after it, and throughput after the pause.

    ops: sorted completion times.  The pause is the longest interval between
    consecutive completions (t_begin counting as one) among ops that complete
    in (t_fault, t_end]; throughput after it counts the ops completing after
    the pause's end up to t_end.  Rates are algorithm bandwidth in bytes/s.
    """
    ops = np.asarray(ops, float)
    marks = np.concatenate([[t_begin], ops])
    gaps = np.diff(marks)
    pre = ops <= t_fault
    out = {"ops_before": int(pre.sum()),
           "rate_before": _rate(marks[: int(pre.sum()) + 1], nbytes),
           "gap_before_s": float(np.median(gaps[pre])) if pre.any() else None}
    post = (ops > t_fault) & (ops <= t_end)
    if not post.any():
        return {**out, "pause_s": None, "pause_end": None, "ops_after": 0, "rate_after": None}
    idx = np.flatnonzero(post)
    worst = idx[np.argmax(gaps[idx])]
    after = marks[worst + 1: idx[-1] + 2]  # from the end of the pause to the last op in the window
    return {**out, "pause_s": float(gaps[worst]), "pause_end": float(ops[worst]),
            "ops_after": len(after) - 1, "rate_after": _rate(after, nbytes)}


def _rate(marks, nbytes):
    """Bytes/s over consecutive completion marks (first mark = start of the interval)."""
    if len(marks) < 2 or marks[-1] <= marks[0]:
        return None
    return (len(marks) - 1) * nbytes / (marks[-1] - marks[0])


def first_event(events, kinds, after=None):
    """Earliest event whose kind is in `kinds` (at or after `after`), or None."""
    hits = [e for e in events if e.get("kind") in kinds and (after is None or e.get("t", 0) >= after)]
    return min(hits, key=lambda e: e["t"]) if hits else None


def analyze(ranks, nbytes, factor):
    """Fault time (injected, else first detection), and per-rank window() plus event delays.

    Byte counts: 'requeued' sums the `nbytes` of this rank's 'migrated' events
    (unacknowledged data moved to surviving rails); 'resent' is the rails'
    bytes_resent counter at the end of the run.
    """
    injected = [r["t_fault"] for r in ranks if r["t_fault"] is not None]
    restored = [r["t_restore"] for r in ranks if r["t_restore"] is not None]
    detected = [e["t"] for r in ranks for e in r["events"] if e.get("kind") == "rail_failed" and "t" in e]
    t_fault = min(injected) if injected else (min(detected) if detected else None)
    t_restore = min(restored) if restored else None
    per_rank = []
    for r in ranks:
        ops, t0 = r["ops"], r["t0"]
        t_end = ops[-1] if ops else t0
        row = {"rank": r["rank"], "ops": len(ops), "seconds": t_end - t0,
               "wrong_results": r["wrong_results"], "errors": r["errors"],
               "sampler_error": r["samples"]["error"]}
        if t_fault is None:
            row["rate_before"] = _rate(np.concatenate([[t0], ops]), nbytes)
        else:
            row.update(window(ops, t0, t_fault, t_restore or t_end, nbytes))
            for key, kinds in (("detect", ("rail_failed",)), ("notified", ("peer_notified",)),
                               ("migrated", ("migrated",))):
                ev = first_event(r["events"], kinds, after=t_fault - 1.0)
                row[f"{key}_s"] = ev["t"] - t_fault if ev else None
                row[f"{key}_by"] = (ev.get("detector"), ev.get("info")) if ev else None
            row["bytes_requeued"] = sum(int(e.get("nbytes") or 0) for e in r["events"]
                                        if e.get("kind") == "migrated")
        row["bytes_resent"] = sum(int(rail.get("bytes_resent") or 0) for rail in r["rails"])
        if t_restore is not None:
            after = window(ops, t0, t_restore, t_end, nbytes)
            row["restore_pause_s"], row["rate_restored"] = after["pause_s"], after["rate_after"]
            ev = first_event(r["events"], ("rail_restored",), after=t_restore)
            row["readmitted_s"] = ev["t"] - t_restore if ev else None
        for key in ("rate_before", "rate_after", "rate_restored"):
            if row.get(key) is not None:
                row[key.replace("rate", "busbw") + "_GBps"] = row[key] * factor / 1e9
        per_rank.append(row)
    return t_fault, t_restore, per_rank


def _ms(v):
    return f"{v * 1e3:.1f}" if v is not None else "-"


def _gbps(v):
    return f"{v / 1e9:.3f}" if v is not None else "-"


def summary(args, ranks, t_fault, t_restore, rows, nranks):
    """Human-readable report lines (OSU-style '#' header, one row per rank, then events)."""
    rails = ", ".join(f"{r['index']}:{r['address']}" for r in ranks[0]["rails"])
    how = ("external (--no-inject), first detection" if args.no_inject else
           f"{args.mode} fail_rail({args.rail}) on rank {args.fail_rank} at {args.fail_at:g} s")
    t0 = min(r["t0"] for r in ranks)
    lines = [f"# r2comm failover test: {human(args.size)} allreduce stream ({args.dtype}), "
             f"{nranks} ranks, rails [{rails}]",
             f"# fault: {how}" + (f" (t={t_fault - t0:.3f} s)" if t_fault else "; no rail failure observed")
             + (f"; restore at {t_restore - t0:.3f} s" if t_restore else ""),
             "# algbw in GB/s; pause = longest gap between op completions after the fault"]
    lines.append(f"{'# rank':<7}{'ops':>6}{'before':>9}{'pause(ms)':>11}{'gap(ms)':>9}{'after':>9}"
                 f"{'detect(ms)':>12}{'migrate(ms)':>13}{'requeued(B)':>13}{'resent(B)':>11}{'wrong':>7}")
    for row in rows:
        lines.append(f"{row['rank']:<7}{row['ops']:>6}{_gbps(row.get('rate_before')):>9}"
                     f"{_ms(row.get('pause_s')):>11}{_ms(row.get('gap_before_s')):>9}"
                     f"{_gbps(row.get('rate_after')):>9}{_ms(row.get('detect_s')):>12}"
                     f"{_ms(row.get('migrated_s')):>13}{row.get('bytes_requeued', 0):>13}"
                     f"{row['bytes_resent']:>11}"
                     f"{row['wrong_results']:>7}")
        for err in row["errors"] + ([row["sampler_error"]] if row["sampler_error"] else []):
            lines.append(f"# rank {row['rank']} error: {err}")
    if t_restore is not None:
        for row in rows:
            lines.append(f"# rank {row['rank']} after restore: rail back after {_ms(row['readmitted_s'])} ms, "
                         f"pause {_ms(row['restore_pause_s'])} ms, {_gbps(row['rate_restored'])} GB/s")
    ref = t_fault if t_fault is not None else t0
    events = sorted((e for r in ranks for e in r["events"]), key=lambda e: e.get("t", 0))
    if events:
        lines.append(f"# events (ms from {'fault' if t_fault else 'start'}):")
    for e in events:
        rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "kind", "rank"))
        lines.append(f"#   {(e.get('t', ref) - ref) * 1e3:+9.1f}  rank {e.get('rank')} {e.get('kind')} {rest}")
    return lines


def run(args, world, argv):
    """The `failover` subcommand: stream, gather to rank 0, report, JSON, timeline PNG."""
    import r2comm
    from .osu import BUSBW_FACTOR
    from .report import machine, write_json
    comm = r2comm.Communicator(world)
    if len(comm.rails) < 2 and world.rank == 0:
        print(f"# warning: only {len(comm.rails)} rail(s); failover needs a second rail", flush=True)
    record = stream(comm, r2comm, args, world)
    ranks = world.gather(record, root=0)
    comm.Free()
    if world.rank != 0:
        return 0
    nbytes = max(2, args.size // np.dtype(args.dtype).itemsize) * np.dtype(args.dtype).itemsize
    factor = BUSBW_FACTOR["allreduce"](world.size)
    t_fault, t_restore, rows = analyze(ranks, nbytes, factor)
    lines = summary(args, ranks, t_fault, t_restore, rows, world.size)
    print("\n".join(lines), flush=True)
    plot_rank = args.fail_rank if args.fail_rank < world.size else 0
    report = {"schema": "r2comm.bench/1", "bench": "failover", "argv": argv, "nranks": world.size,
              "size": nbytes, "dtype": args.dtype, "t_fault": t_fault, "t_restore": t_restore,
              "analysis": rows, "ranks": ranks, "plot_rank": plot_rank,
              "title": lines[0].lstrip("# ") + "\n" + lines[1].lstrip("# "),
              "time": min(r["t0"] for r in ranks), "machine": machine(),
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("R2COMM_")}}
    if args.json:
        write_json(args.json, report)
    if args.plot:
        from .plot import plot_failover
        plot_failover(report, args.plot)
        print(f"# timeline written to {args.plot}", flush=True)
    failed = any(r["wrong_results"] for r in rows)
    return 4 if failed else 0
