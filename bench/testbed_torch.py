#!/usr/bin/env python3
"""torch.distributed on r2comm vs Gloo in the emulated cluster (r2comm.testbed), as root.

    sudo .venv/bin/python bench/testbed_torch.py --part main     # DDP vs Gloo, flaps: ~4 min
    sudo .venv/bin/python bench/testbed_torch.py --part cycles   # interleaved faults: ~20 min
    sudo .venv/bin/python bench/testbed_torch.py --quick         # both, fewer steps and tokens

A fabric of 2 hosts x 2 rail NICs shaped to --rate (500mbit) by tbf; 4 ranks, 2 per host, each
host's ranks started by one torchrun in its namespace (`python -m r2comm.testbed torchrun`'s
launcher, rendezvous over the management network). The job is examples/torch_ddp_lm.py, an
ordinary DDP training script, in two step shapes:

  compute   a tiny LM (0.6 MiB of gradients) on large batches: compute dominates the step
  network   a small LM (5 MiB of gradients) on small batches: the allreduces dominate

and for each shape the runs (r2comm unless named):

  healthy   fault-free
  nic_down  host 1's NIC 0 taken down for real (`ip link set nic0 down` in its namespace) once
            rank 0 has finished step --fail-step - 1, brought back up after step
            --restore-step - 1
  degraded  the same NIC shaped to a tenth of its rate over the same steps
  gloo      the same script on Gloo (GLOO_SOCKET_IFNAME=nic0,nic1: both NICs), fault-free
  gloo_down Gloo, NIC 0 of host 1 down at the same step and up again after the outage the
            r2comm nic_down run had (or after the restore step, if Gloo gets there); the run
            is bounded by --job-timeout and Gloo's own timeout (--gloo-timeout): what happens
            (stall, error, hang) is recorded as it happens

plus `flap` (network shape, r2comm: the NIC goes down and up within --flap-s, twice, far apart;
a step is slow when it takes over 1.5x the median of the steps before the first flap).

The interleaved runs (--part cycles, r2comm.bench.cycles) measure the two small overheads the
issue sets targets for, which one fault per job cannot resolve on a shared machine (its load
moves step times between jobs by more than 1%): within one job host 1's NIC 0 goes down and up
in alternating blocks, and each item is compared with the healthy blocks around it.

  cycle_compute  the compute shape, 4 ranks, CYCLE_LM: 64 cycles of 8 steps down, 8 up
  serving        examples/torch_tp_serving.py (tensor-parallel decoding, 8 allreduces of 32 KiB
                 per token), 2 ranks (one per host), CYCLE_SERVE: 64 cycles of 250 tokens

each with a fault-free job of the same length (the placebo: its items labelled as the faulty
job's). The r2comm runs of one shape must print the same loss-curve digest (bitwise identical
losses). Step times are rank 0's. --part main writes --out/testbed_torch.json (and .png),
--part cycles --out/testbed_torch_cycles.json, --part all (default) both runs in one file.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from r2comm.bench import cycles  # noqa: E402
from r2comm.bench.cycles import median  # noqa: E402
LM = REPO / "examples" / "torch_ddp_lm.py"
SERVE = REPO / "examples" / "torch_tp_serving.py"

SHAPES = {  # examples/torch_ddp_lm.py arguments
    "compute": {"size": "tiny", "batch": 96, "bucket_mb": 0.25},
    "network": {"size": "small", "batch": 2, "bucket_mb": 1.0},
}
SLOW_FACTOR = 1.5   # a flap's slow step: over this x the median healthy step
SERVE_WARMUP = 30   # serving tokens left out at the start
# interleaved fault blocks (r2comm.bench.cycles) for the two small-overhead targets: items per
# block, down/up cycles, items left out at the start, items after each repair counted apart
CYCLE_LM = {"shape": "compute", "warm": 4, "block": 8, "cycles": 64, "settle": 1, "nproc": 2}
CYCLE_SERVE = {"warm": SERVE_WARMUP, "block": 250, "cycles": 64, "settle": 100, "nproc": 1}


# ------------------------------------------------------------------------------- one job
class Job:
    """One torchrun per host; rank 0's output (host 0) is followed line by line, and
    TRIGGERS[text] runs (in its own thread) when a line starting with text appears."""

    def __init__(self, fab, argv, env, workdir, name, timeout, nproc=2):
        from r2comm.control.ports import free_port
        from r2comm.testbed.launch import torchrun_commands
        self.name, self.timeout = name, timeout
        self.logs = [workdir / f"{name}-host{h}.log" for h in range(fab.hosts)]
        self.cmds = torchrun_commands(fab, [str(a) for a in argv], nproc=nproc, port=free_port())
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        self.lines, self.triggers, self.fired, self.threads = [], {}, {}, []
        self.timed_out = False

    def on(self, text, action):
        self.triggers[text] = action

    def fire(self, text):
        """Run the action of TEXT now (once), in a thread."""
        if text in self.fired or text not in self.triggers:
            return
        self.fired[text] = time.time()
        th = threading.Thread(target=self.triggers[text], daemon=True)
        th.start()
        self.threads.append(th)

    def run(self, watchdog=None):
        """Run to the end (or the timeout); WATCHDOG(job) is called every 50 ms. Returns rc."""
        from r2comm.testbed.launch import _stop
        files = [open(p, "w") for p in self.logs]
        procs = []
        try:
            procs.append(subprocess.Popen(self.cmds[0], env=self.env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, bufsize=1,
                                          start_new_session=True))
            for cmd, f in zip(self.cmds[1:], files[1:]):
                procs.append(subprocess.Popen(cmd, env=self.env, stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            reader = threading.Thread(target=self._read, args=(procs[0].stdout, files[0]),
                                      daemon=True)
            reader.start()
            deadline = time.monotonic() + self.timeout
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    time.sleep(3.0)  # let the other host report its own error first
                    break
                if time.monotonic() > deadline:
                    self.timed_out = True
                    break
                if watchdog is not None:
                    watchdog(self)
                time.sleep(0.05)
            _stop(procs)
            reader.join(timeout=5)
            for th in self.threads:
                th.join(timeout=30)
            return max(abs(p.returncode if p.returncode is not None else 1) for p in procs)
        finally:
            _stop(procs)
            for f in files:
                f.close()

    def _read(self, pipe, log):
        for line in pipe:
            log.write(line)
            log.flush()
            self.lines.append((time.time(), line.rstrip("\n")))
            for text in list(self.triggers):
                if line.startswith(text):
                    self.fire(text)

    def tail(self, n=40):
        out = []
        for p in self.logs:
            try:
                out += [f"[{p.stem}] {ln}" for ln in p.read_text().splitlines()[-n:]]
            except OSError:
                pass
        return out


# ------------------------------------------------------------------------------- cases
def step_line(k):
    return f"[lm] step {k:3d} "


def fault_recorder(faults):
    """act(what, fn) -> a callback that runs fn (a fault on the fabric) and appends its wall
    times to FAULTS."""
    def act(what, fn):
        def run():
            t = time.time()
            fn()
            faults.append({"what": what, "t": t, "done": time.time()})
        return run
    return act


def lm_case(fab, args, workdir, shape, backend, fault, outage_s=None):
    """One DDP run; FAULT in (None, "nic_down", "degraded", "flap"). Returns its record."""
    sh = SHAPES[shape]
    name = f"{shape}_{backend}_{fault or 'healthy'}"
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    steps = args.steps[shape]
    argv = [LM, "--backend", backend, "--size", sh["size"], "--batch",
            sh["batch"], "--bucket-mb", sh["bucket_mb"], "--steps", steps, "--json", result]
    env = {}
    if backend == "gloo":
        argv += ["--timeout", args.gloo_dead_timeout if fault == "nic_dead" else args.gloo_timeout]
        env["GLOO_SOCKET_IFNAME"] = "nic0,nic1"
    job = Job(fab, argv, env, workdir, name, args.job_timeout)
    fail, restore = args.fail_step[shape], args.restore_step[shape]
    faults = []                                   # (wall time, what)
    act = fault_recorder(faults)
    slow = fab.rate // 10 if fab.rate else "100mbit"
    if fault == "nic_dead":                       # down for good (until the job has ended)
        job.on(step_line(fail - 1), act("nic_down", lambda: fab.nic_down(1, 0)))
    if fault == "nic_down":
        job.on(step_line(fail - 1), act("nic_down", lambda: fab.nic_down(1, 0)))
        job.on(step_line(restore - 1), act("nic_up", lambda: fab.nic_up(1, 0)))
    elif fault == "degraded":
        job.on(step_line(fail - 1), act("degrade", lambda: fab.degrade(1, 0, slow)))
        job.on(step_line(restore - 1), act("restore_rate", lambda: fab.degrade(1, 0, fab.rate)))
    elif fault == "flap":
        def flap():            # fab.flap(period=2 * flap_s, count=1) without its last wait
            fab.nic_down(1, 0)
            time.sleep(args.flap_s)
            fab.nic_up(1, 0)
        for k in args.flap_steps:
            job.on(step_line(k - 1), act(f"flap@{k}", flap))

    def watchdog(j):
        # Gloo may never reach the restore step: bring the NIC back after the r2comm outage
        down = j.fired.get(step_line(fail - 1))
        if fault == "nic_down" and outage_s and down and time.time() > down + outage_s:
            j.fire(step_line(restore - 1))

    started = time.time()
    try:
        rc = job.run(watchdog)
    finally:  # the fabric is healthy again for the next case, whatever happened
        fab.nic_up(1, 0)
        if fault == "degraded":
            fab.degrade(1, 0, fab.rate)
    rec = {"name": name, "shape": shape, "backend": backend, "fault": fault, "rc": rc,
           "timed_out": job.timed_out, "wall_s": time.time() - started, "faults": faults,
           "fail_step": fail if fault in ("nic_down", "degraded") else None,
           "restore_step": restore if fault in ("nic_down", "degraded") else None,
           "flap_steps": args.flap_steps if fault == "flap" else None}
    if result.exists():
        rec.update(json.loads(result.read_text()))
    else:
        rec["error"] = rec.get("error") or "no result written"
    if rc != 0 or rec.get("error") or job.timed_out:
        rec["log_tail"] = job.tail()
    last = job.lines[-1][0] if job.lines else None
    rec["last_output_t"] = last
    return rec


def cycle_faults(job, fab, marks, line):
    """Host 1's NIC 0 down / up as rank 0 prints LINE(item) for each of MARKS (cycles.marks());
    returns the list the link changes' wall times go to."""
    faults = []
    act = fault_recorder(faults)
    change = {"down": lambda: fab.nic_down(1, 0), "up": lambda: fab.nic_up(1, 0)}
    for k, what in marks:
        job.on(line(k), act(f"nic_{what}", change[what]))
    return faults


def cycle_faults_missing(faults, cy):
    """An error text when fewer link changes were made than the cycles need, else None."""
    want = 2 * cy["cycles"]
    return None if len(faults) == want else f"{len(faults)} of {want} link changes made"


def lm_cycle_case(fab, args, workdir, fault=True):
    """The compute-bound shape with host 1's NIC 0 down and up in alternating blocks of steps
    (args.cycle_lm), or the same number of steps fault-free (the placebo: its steps labelled
    like the faulty run's show how far two healthy block sets differ)."""
    cy, sh = args.cycle_lm, SHAPES[args.cycle_lm["shape"]]
    name = f"cycle_{cy['shape']}_r2comm_{'nic_down' if fault else 'healthy'}"
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    steps = cycles.total(cy["warm"], cy["block"], cy["cycles"])
    argv = [LM, "--backend", "r2comm", "--size", sh["size"], "--batch", sh["batch"],
            "--bucket-mb", sh["bucket_mb"], "--steps", steps, "--json", result]
    job = Job(fab, argv, {}, workdir, name, max(args.job_timeout, 60 + 0.5 * steps),
              nproc=cy["nproc"])
    faults = cycle_faults(job, fab, cycles.marks(cy["warm"], cy["block"], cy["cycles"]) if fault else [],
                          lambda k: step_line(k - 1))
    started = time.time()
    try:
        rc = job.run()
    finally:
        fab.nic_up(1, 0)
    rec = {"name": name, "backend": "r2comm", "fault": "cycles" if fault else None, "rc": rc,
           "timed_out": job.timed_out, "wall_s": time.time() - started, "faults": faults}
    if result.exists():
        rec.update(json.loads(result.read_text()))
    else:
        rec["error"] = "no result written"
    if fault:
        rec["error"] = rec.get("error") or cycle_faults_missing(faults, cy)
    if rc != 0 or rec.get("error") or job.timed_out:
        rec["log_tail"] = job.tail()
    return rec


def cycle_analysis(rec, base, cy, key, q, method="bootstrap"):
    """Labels of REC's items (r2comm.bench.cycles) and the comparisons: the NIC down against
    healthy-and-settled, the items just after a repair against the same, each also on the
    fault-free run BASE under REC's labels (the placebo), and the method's calibration on BASE
    (cycles.calibrate); q: the percentile compared; method: 'bootstrap' (cycles.compare,
    medians of steps) or 'groups' (cycles.compare_groups, tokens: their p99 and p50 are set by
    load bursts that the bootstrap takes for independent draws)."""
    if rec.get("error") or not rec.get(key):
        return {"error": rec.get("error") or "no items"}
    if key == "step_s":
        ends = rec["step_end"]
        starts = [e - d for e, d in zip(ends, rec["step_s"])]
    else:
        starts = rec["token_start"]
        ends = [t + d for t, d in zip(starts, rec["token_s"])]
    labs = cycles.labels(starts, ends, rec["faults"], cy["warm"], cy["settle"])
    vals = rec[key]

    def measure(values, labels, lab, q=q, boot=2000):
        if method == "groups":
            return cycles.compare_groups(values, labels, lab, cycles.HEALTHY, q=q)
        return cycles.compare(values, labels, lab, cycles.HEALTHY, q=q, boot=boot)

    out = {"counts": cycles.counts(labs), "q": q, "phases": {}, "method": method,
           "down": measure(vals, labs, cycles.DOWN), "after": measure(vals, labs, cycles.AFTER),
           "settle": cy["settle"], "block": cy["block"], "cycles": cy["cycles"],
           "nproc": cy["nproc"]}
    for lab in (cycles.BEFORE, cycles.HIT, cycles.DOWN, cycles.AFTER, cycles.HEALTHY):
        v = [x for x, (la, _) in zip(vals, labs) if la == lab]
        out["phases"][lab] = {"n": len(v), "p50_s": cycles.pct(v, 50), "p99_s": cycles.pct(v, 99),
                              "max_s": max(v) if v else None}
    if q != 50:
        out["down_p50"] = measure(vals, labs, cycles.DOWN, q=50)
    bv = (base or {}).get(key) or []
    if len(bv) >= len(vals) and not (base or {}).get("error"):
        bl = labs[:len(vals)]
        out["placebo_down"] = measure(bv[:len(vals)], bl, cycles.DOWN)
        out["placebo_after"] = measure(bv[:len(vals)], bl, cycles.AFTER)
        out["calibration"] = cycles.calibrate(bv, cy["warm"], cy["block"], cy["settle"], cy["cycles"],
                                              lambda v, la, lab: measure(v, la, lab, boot=500))
    return out


def phases(rec):
    """Step indices before / during / after the fault, by the wall times of the fault."""
    ends, secs = rec.get("step_end", []), rec.get("step_s", [])
    f = {x["what"]: x for x in rec.get("faults", [])}
    down = f.get("nic_down") or f.get("degrade")
    up = f.get("nic_up") or f.get("restore_rate")
    if not down:
        return None
    t_down = down["t"]
    t_up = up["done"] if up else float("inf")
    out = {"before": [], "during": [], "after": []}
    for i, (e, s) in enumerate(zip(ends, secs)):
        if i < 2:
            continue                              # warm-up
        start = e - s
        if e < t_down:
            out["before"].append(i)
        elif start < t_up:
            out["during"].append(i)
        else:
            out["after"].append(i)
    return out


def compare(rec, base):
    """Step-time overhead of a faulty run REC against the fault-free run BASE (same shape)."""
    ph = phases(rec)
    if ph is None or not base.get("step_s"):
        return None
    s, b = rec["step_s"], base["step_s"]
    during = ph["during"]
    hit = during[0] if during else None
    steady = during[1:]                            # the NIC is gone: the surviving one's speed
    same = [i for i in steady if i < len(b)]
    out = {"phases": ph, "hit_step": hit,
           "hit_step_s": s[hit] if hit is not None else None,
           "healthy_median_s": median(b[2:]),
           "before_median_s": median([s[i] for i in ph["before"]]),
           "during_median_s": median([s[i] for i in steady]),
           "after_median_s": median([s[i] for i in ph["after"]]),
           "base_same_steps_median_s": median([b[i] for i in same])}
    bb = median([b[i] for i in ph["before"] if i < len(b)])
    if bb and out["base_same_steps_median_s"]:  # how much the fault-free run itself drifted
        out["base_drift"] = out["base_same_steps_median_s"] / bb - 1
    if out["during_median_s"] and out["base_same_steps_median_s"]:
        out["overhead_during"] = out["during_median_s"] / out["base_same_steps_median_s"] - 1
    if out["during_median_s"] and out["before_median_s"]:
        out["overhead_vs_own_before"] = out["during_median_s"] / out["before_median_s"] - 1
    n = min(len(s), len(b))
    if n > 2 and len(s) == rec.get("steps"):
        out["run_overhead"] = sum(s[2:n]) / sum(b[2:n]) - 1
    return out


def gloo_outcome(rec, base):
    """What Gloo did when the NIC went down, in words and numbers."""
    f = {x["what"]: x for x in rec.get("faults", [])}
    down, up = f.get("nic_down"), f.get("nic_up")
    out = {"completed_steps": len(rec.get("step_s", [])), "steps": rec.get("steps"),
           "rc": rec.get("rc"), "timed_out": rec.get("timed_out"), "error": rec.get("error"),
           "outage_s": (up["done"] - down["t"]) if down and up else None}
    s, ends = rec.get("step_s", []), rec.get("step_end", [])
    if down:
        after = [i for i, e in enumerate(ends) if e > down["t"]]
        if after:
            out["hit_step"] = after[0]
            out["hit_step_s"] = s[after[0]]
            out["after_median_s"] = median([s[i] for i in after[1:]])
        out["healthy_median_s"] = median(base["step_s"][2:]) if base.get("step_s") else None
        if rec.get("timed_out"):
            out["kind"] = "hang"
            out["text"] = (f"hung: no step finished after the NIC went down; killed by the "
                           f"{rec['wall_s']:.0f} s job timeout")
        elif rec.get("error") or rec.get("rc"):
            why = (rec.get("error") or f"rc {rec.get('rc')}").split("\n")[0][:200]
            out["kind"] = "error"
            last = rec.get("last_output_t")
            out["error_after_s"] = last - down["t"] if last else None
            when = f" {out['error_after_s']:.0f} s after the NIC went down" if last else ""
            out["text"] = (f"failed{when}: {len(s)} of {rec.get('steps')} steps done, then "
                           f"`{why}`")
        elif after:
            out["kind"] = "stall"
            out["text"] = (f"stalled: the step in flight took {s[after[0]]:.1f} s (the NIC was "
                           f"down {out['outage_s'] or 0:.1f} s), then Gloo went on after nic-up")
        else:
            out["kind"] = "unaffected"
            out["text"] = "the NIC went down after the last step"
    return out


def flap_analysis(rec, args, down_pace=None):
    """Slow steps after each flap. A step is slow when it takes over SLOW_FACTOR x the pace it
    had the bandwidth for: the median step before the first flap, or, for a step that ran
    wholly while the NIC was down (a flap of --flap-s spans several steps), the median step of
    the NIC-down run DOWN_PACE (half the bandwidth is not the flap's cost: the NIC-down target
    judges it)."""
    s, ends = rec.get("step_s", []), rec.get("step_end", [])
    first = min(args.flap_steps)
    base = median(s[2:first - 1]) if len(s) > first else None
    out = {"healthy_median_s": base, "down_median_s": down_pace, "slow_factor": SLOW_FACTOR,
           "flaps": []}
    if base is None:
        return out
    faults = {f["what"]: f for f in rec.get("faults", [])}
    for k in args.flap_steps:
        window = list(range(k, min(len(s), k + 6)))   # the flap happens in step k
        f = faults.get(f"flap@{k}")
        inside = [i for i in window if f and i < len(ends) and ends[i] - s[i] >= f["t"]
                  and ends[i] <= f["done"]]
        limit = {i: SLOW_FACTOR * (max(base, down_pace) if i in inside and down_pace else base)
                 for i in window}
        slow = [i for i in window if s[i] > limit[i]]
        out["flaps"].append({"step": k, "window": window, "step_s": [s[i] for i in window],
                             "down_steps": inside, "limit_s": [limit[i] for i in window],
                             "slow_steps": slow, "slow_count": len(slow),
                             "over_healthy_x1.5": sum(1 for i in window if s[i] > SLOW_FACTOR * base)})
    out["max_slow_steps"] = max(f["slow_count"] for f in out["flaps"]) if out["flaps"] else None
    return out


def serving_case(fab, args, workdir, fault=True):
    """Tensor-parallel decoding with host 1's NIC 0 down and up in alternating blocks of tokens
    (args.cycle_serve; the first block healthy), or as many tokens fault-free."""
    cy = args.cycle_serve
    name = "serving" if fault else "serving_healthy"
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    tokens = cycles.total(0, cy["block"], cy["cycles"])
    argv = [SERVE, "--no-inject", "--tokens", tokens, "--fail-token", -1, "--restore-token", -1,
            "--mark-every", cy["block"], "--json", result]
    job = Job(fab, argv, {}, workdir, name, max(args.job_timeout, 60 + 0.06 * tokens),
              nproc=cy["nproc"])
    faults = cycle_faults(job, fab, cycles.marks(0, cy["block"], cy["cycles"]) if fault else [],
                          lambda k: f"[serve] mark {k} ")
    started = time.time()
    try:
        rc = job.run()
    finally:
        fab.nic_up(1, 0)
    rec = {"name": name, "rc": rc, "timed_out": job.timed_out, "wall_s": time.time() - started,
           "faults": faults}
    if not result.exists():
        rec["error"] = "no result written"
        rec["log_tail"] = job.tail()
        return rec
    d = json.loads(result.read_text())
    rec.update({k: d[k] for k in ("ranks", "layers", "allreduce_bytes", "tokens", "checksum")})
    rec["token_start"], rec["token_s"] = d["token_start"], d["token_s"]
    if fault:
        rec["error"] = cycle_faults_missing(faults, cy)
    return rec


# ------------------------------------------------------------------------------- figure
def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    style = {"r2comm_healthy": ("tab:blue", "r2comm fault-free"),
             "r2comm_nic_down": ("tab:red", "r2comm, NIC down"),
             "r2comm_degraded": ("tab:orange", "r2comm, NIC at 1/10 rate"),
             "gloo_healthy": ("tab:gray", "Gloo fault-free"),
             "gloo_nic_down": ("black", "Gloo, NIC down")}
    for ax, shape in zip(axes, SHAPES):
        for key, (color, label) in style.items():
            rec = report["cases"].get(f"{shape}_{key}")
            if not rec or not rec.get("step_s"):
                continue
            ax.plot(range(len(rec["step_s"])), [v * 1e3 for v in rec["step_s"]], color=color,
                    lw=1.2, marker=".", label=label)
        cfg = report["config"]
        ax.axvspan(cfg["fail_step"][shape] - 0.5, cfg["restore_step"][shape] - 0.5,
                   color="red", alpha=0.08, label="NIC down / degraded (from step)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms, rank 0)")
        ax.set_title(f"{shape}-bound step ({SHAPES[shape]['size']} LM, batch "
                     f"{SHAPES[shape]['batch']})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"DDP on 4 ranks, 2 hosts x 2 NICs at {report['config']['rate']}: "
                 f"host 1's NIC 0 fails mid-training", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- driver
def driver(args):
    from r2comm.testbed import Fabric
    from testbed_failover import driver_dirs      # (this folder)
    out_dir, workdir = driver_dirs("bench/testbed_torch.py", args.out, "r2tb-torch-")
    report = {"config": {"hosts": 2, "nics": 2, "rate": args.rate, "ranks": 4,
                         "ranks_per_host": 2, "shapes": SHAPES, "steps": args.steps,
                         "fail_step": args.fail_step, "restore_step": args.restore_step,
                         "flap_steps": args.flap_steps, "flap_down_s": args.flap_s,
                         "part": args.part, "cycle_lm": args.cycle_lm,
                         "cycle_serve": args.cycle_serve, "gloo_timeout_s": args.gloo_timeout,
                         "gloo_dead_timeout_s": args.gloo_dead_timeout,
                         "serve_warmup_tokens": SERVE_WARMUP,
                         "gloo_ifnames": "nic0,nic1",
                         "fault": "fab.nic_down(1, 0): ip link set nic0 down in host 1",
                         "degraded": "fab.degrade(1, 0, rate / 10)", "argv": sys.argv[1:]},
              "cases": {}, "seconds": None}
    started = time.monotonic()
    cases = report["cases"]

    def log(rec):
        cases[rec["name"]] = rec
        err = f", error: {rec['error'][:160]}" if rec.get("error") else ""
        st = rec.get("step_s") or []
        med = f", median step {median(st[2:]) * 1e3:.1f} ms" if len(st) > 2 else ""
        print(f"# {rec['name']}: rc {rec['rc']}{', TIMED OUT' if rec.get('timed_out') else ''}, "
              f"{rec['wall_s']:.1f} s{med}, digest {rec.get('digest')}{err}", flush=True)
        for line in rec.get("log_tail", [])[-15:] if (rec.get("error") or rec["rc"]) else []:
            print(f"#   {line}")

    try:
        with Fabric(hosts=2, nics=2, rate=args.rate, tag=f"bt{os.getpid() % 100000}") as fab:
            run_cases(fab, args, workdir, cases, log)
    except KeyboardInterrupt:  # run_all.sh's timeout: keep what was measured
        report["interrupted"] = f"stopped (SIGINT) after {time.monotonic() - started:.0f} s"
        print(f"# {report['interrupted']}; writing what was measured", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summarize(report, args)
    report["seconds"] = time.monotonic() - started
    name = "testbed_torch_cycles" if args.part == "cycles" else "testbed_torch"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    try:
        if args.part != "cycles":
            plot(report, out_dir / "testbed_torch.png")
    except Exception as exc:  # the JSON is what matters
        print(f"# no figure: {exc!r}")
    print_summary(report)
    print(f"# wrote {out_dir / f'{name}.json'} in {report['seconds']:.0f} s")
    bad = [k for k, v in report["summary"].get("digests_equal", {}).items() if v is False]
    return 1 if bad else 0


def run_cases(fab, args, workdir, cases, log):
    """The cases, in order (the Gloo NIC-down run takes the outage of r2comm's)."""
    main = args.part in ("main", "all")
    for shape in args.shapes if main else []:
        log(lm_case(fab, args, workdir, shape, "r2comm", None))
        log(lm_case(fab, args, workdir, shape, "r2comm", "nic_down"))
        log(lm_case(fab, args, workdir, shape, "r2comm", "degraded"))
        log(lm_case(fab, args, workdir, shape, "gloo", None))
        down = cases[f"{shape}_r2comm_nic_down"]
        f = {x["what"]: x for x in down.get("faults", [])}
        outage = (f["nic_up"]["done"] - f["nic_down"]["t"]) if len(f) == 2 else 5.0
        log(lm_case(fab, args, workdir, shape, "gloo", "nic_down",
                    outage_s=max(3.0, outage)))
    if "network" in args.shapes and main:
        log(lm_case(fab, args, workdir, "network", "r2comm", "flap"))
        log(lm_case(fab, args, workdir, "network", "gloo", "nic_dead"))
    if args.part == "main":
        return
    if args.cycle_lm["cycles"]:
        log(lm_cycle_case(fab, args, workdir, fault=False))
        log(lm_cycle_case(fab, args, workdir))
    if args.cycle_serve["cycles"]:
        log(serving_case(fab, args, workdir, fault=False))
        log(serving_case(fab, args, workdir))


def summarize(report, args):
    cases, summ = report["cases"], {"shapes": {}, "digests_equal": {}}
    for shape in args.shapes if args.part in ("main", "all") else []:
        g = lambda k: cases.get(f"{shape}_{k}", {})  # noqa: E731
        base = g("r2comm_healthy")
        s = {"r2comm_healthy_median_s": median(base.get("step_s", [])[2:]),
             "gloo_healthy_median_s": median(g("gloo_healthy").get("step_s", [])[2:]),
             "grad_bytes": base.get("grad_bytes")}
        for fault in ("nic_down", "degraded"):
            rec = g(f"r2comm_{fault}")
            s[fault] = compare(rec, base) if rec and not rec.get("error") else (
                {"error": rec.get("error")} if rec else None)
        s["gloo_nic_down"] = gloo_outcome(g("gloo_nic_down"), g("gloo_healthy")) \
            if g("gloo_nic_down") else None
        runs = [g(k) for k in ("r2comm_healthy", "r2comm_nic_down", "r2comm_degraded")]
        if shape == "network" and cases.get("network_r2comm_flap"):
            runs.append(cases["network_r2comm_flap"])
        digests = {r["name"]: r.get("digest") for r in runs if r}
        s["digests"] = digests
        complete = all(r.get("digest") and len(r.get("step_s", [])) == r.get("steps") for r in runs if r)
        summ["digests_equal"][shape] = (len(set(digests.values())) == 1) if complete and digests else None
        gd = g("gloo_healthy").get("digest")
        s["gloo_digest"] = gd
        summ["shapes"][shape] = s
    if cases.get("network_r2comm_flap"):
        pace = (summ["shapes"].get("network", {}).get("nic_down") or {}).get("during_median_s")
        summ["flap"] = flap_analysis(cases["network_r2comm_flap"], args, pace)
    if cases.get("network_gloo_nic_dead"):
        summ["gloo_nic_dead"] = gloo_outcome(cases["network_gloo_nic_dead"],
                                             cases.get("network_gloo_healthy", {}))
    cy = args.cycle_lm
    lc = cases.get(f"cycle_{cy['shape']}_r2comm_nic_down")
    if lc:
        summ["cycle_lm"] = cycle_analysis(lc, cases.get(f"cycle_{cy['shape']}_r2comm_healthy"),
                                          cy, "step_s", 50)
        summ["cycle_lm"]["digest"] = lc.get("digest")
        summ["cycle_lm"]["fault_free_digest"] = (cases.get(
            f"cycle_{cy['shape']}_r2comm_healthy") or {}).get("digest")
    sv, sb = cases.get("serving"), cases.get("serving_healthy")
    if sv:
        summ["serving"] = {"error": sv.get("error"), "checksum": sv.get("checksum"),
                           "fault_free_checksum": (sb or {}).get("checksum"),
                           "ranks": sv.get("ranks"), "layers": sv.get("layers"),
                           "allreduce_bytes": sv.get("allreduce_bytes"),
                           "tokens": sv.get("tokens")}
        if not sv.get("error") and sv.get("token_s"):
            summ["serving"].update(cycle_analysis(sv, sb, args.cycle_serve, "token_s", 99, "groups"))
    report["summary"] = summ


def print_summary(report):
    ms = lambda v: f"{v * 1e3:.1f} ms" if v is not None else "-"   # noqa: E731
    pc = lambda v: f"{v:+.1%}" if v is not None else "-"           # noqa: E731
    summ = report["summary"]
    for shape, s in summ["shapes"].items():
        print(f"## {shape}: r2comm healthy {ms(s['r2comm_healthy_median_s'])}, Gloo healthy "
              f"{ms(s['gloo_healthy_median_s'])}; digests equal: {summ['digests_equal'][shape]} "
              f"{s['digests']}")
        for fault in ("nic_down", "degraded"):
            c = s.get(fault) or {}
            print(f"   {fault}: during {ms(c.get('during_median_s'))} vs fault-free "
                  f"{ms(c.get('base_same_steps_median_s'))} = {pc(c.get('overhead_during'))} "
                  f"(vs own before {pc(c.get('overhead_vs_own_before'))}); hit step "
                  f"{ms(c.get('hit_step_s'))}; after {ms(c.get('after_median_s'))}; whole run "
                  f"{pc(c.get('run_overhead'))} {c.get('error') or ''}")
        gd = s.get("gloo_nic_down") or {}
        print(f"   gloo nic_down: {gd.get('text')}")
    if "flap" in summ:
        f = summ["flap"]
        for x in f["flaps"]:
            print(f"## flap at step {x['step']}: slow steps {x['slow_steps']} of "
                  f"{[round(v * 1e3) for v in x['step_s']]} ms (healthy "
                  f"{ms(f['healthy_median_s'])})")
    for key, what in (("cycle_lm", "compute step, median"), ("serving", "serving, p99")):
        c = summ.get(key) or {}
        for part in ("down", "after"):
            x, pl = c.get(part) or {}, c.get(f"placebo_{part}") or {}
            if "ratio" in x:
                print(f"## {what}, {part} vs healthy (interleaved): {ms(x['a'])} vs {ms(x['b'])} = "
                      f"{pc(x['ratio'])} [{x.get('coverage', 0.9):.0%} {pc(x.get('lo'))}, "
                      f"{pc(x.get('hi'))}], n {x['n_a']}/{x['n_b']}; placebo {pc(pl.get('ratio'))} "
                      f"[{pc(pl.get('lo'))}, {pc(pl.get('hi'))}]")
        cal = c.get("calibration") or {}
        if cal.get("runs"):
            print(f"## {what}: calibration ({c.get('method')}) on the fault-free job relabelled "
                  f"{cal['runs']} ways: intervals held 0 in {cal['held']}, median width "
                  f"{cal['width']:.1%}, median |ratio| {cal['abs_ratio']:.1%}")
        for lab, ph in (c.get("phases") or {}).items():
            print(f"## {what}: {lab}: {ph['n']} items, p50 {ms(ph['p50_s'])}, p99 "
                  f"{ms(ph['p99_s'])}, max {ms(ph['max_s'])}")
    if "gloo_nic_dead" in summ:
        print(f"## gloo, NIC never back: {summ['gloo_nic_dead'].get('text')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="500mbit", help="per-NIC rate (default 500mbit)")
    ap.add_argument("--shapes", default="compute,network")
    ap.add_argument("--quick", action="store_true", help="fewer steps and tokens (smoke run)")
    ap.add_argument("--cycle-lm", dest="cycle_lm_set", metavar="KEY=N,...",
                    help=f"change the interleaved compute runs' {sorted(CYCLE_LM)} (cycles=0: none)")
    ap.add_argument("--cycle-serve", dest="cycle_serve_set", metavar="KEY=N,...",
                    help=f"change the interleaved serving runs' {sorted(CYCLE_SERVE)} (cycles=0: none)")
    ap.add_argument("--summarize", metavar="JSON",
                    help="no runs: summarize this script's JSON again (after a change to the analysis)")
    ap.add_argument("--part", choices=("main", "cycles", "all"), default="all",
                    help="main: the DDP runs against Gloo, the flaps (testbed_torch.json); cycles: "
                         "the interleaved runs, compute step and serving (testbed_torch_cycles.json)")
    ap.add_argument("--flap-s", type=float, default=0.3, help="seconds a flapping NIC is down")
    ap.add_argument("--gloo-timeout", type=float, default=30.0)
    ap.add_argument("--gloo-dead-timeout", type=float, default=15.0,
                    help="Gloo's timeout in the run whose NIC never comes back")
    ap.add_argument("--job-timeout", type=float, default=75.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    args = ap.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    if args.quick:
        args.steps = {"compute": 10, "network": 16}
        args.fail_step = {"compute": 4, "network": 5}
        args.restore_step = {"compute": 8, "network": 11}
        args.flap_steps = [5, 11]
        args.cycle_lm = {**CYCLE_LM, "block": 4, "cycles": 3}
        args.cycle_serve = {**CYCLE_SERVE, "block": 60, "cycles": 3, "settle": 30}
    else:
        args.steps = {"compute": 32, "network": 40}
        args.fail_step = {"compute": 11, "network": 12}
        args.restore_step = {"compute": 22, "network": 26}
        args.flap_steps = [12, 26]
        args.cycle_lm, args.cycle_serve = dict(CYCLE_LM), dict(CYCLE_SERVE)
    for text, cfg in ((args.cycle_lm_set, args.cycle_lm), (args.cycle_serve_set, args.cycle_serve)):
        for kv in filter(None, (text or "").split(",")):
            key, _, val = kv.partition("=")
            if key not in cfg or key == "shape":
                ap.error(f"--cycle-*: no setting {key!r} (have {sorted(cfg)})")
            cfg[key] = int(val)
    if args.summarize:
        report = json.loads(Path(args.summarize).read_text())
        args.part = report["config"].get("part", "all")
        args.cycle_lm = report["config"].get("cycle_lm", args.cycle_lm)
        args.cycle_serve = report["config"].get("cycle_serve", args.cycle_serve)
        args.shapes = [s for s in args.shapes if any(k.startswith(s) for k in report["cases"])]
        summarize(report, args)
        Path(args.summarize).write_text(json.dumps(report, indent=1))
        print_summary(report)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
