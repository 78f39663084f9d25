"""Workloads over time with failures, and the comparisons of the paper.

A workload is a list of steps per iteration: ("compute", seconds) or ("allreduce", bytes).
run() plays `iterations` of it on a Cluster from t = 0 while faults (a trace, or a random MTBF
process) change the fabric; every allreduce is the planner's schedule replayed with the
engine's failover. An allreduce whose time window holds no fault, probe or reaction reuses the
time of the last identical one (same plan, same fabric and view), so long runs cost little.

Policies:
  r2comm    failover + striping over the surviving NICs + re-planning at the next collective
            once the engines counted the failure (R2COMM_REPLAN / comm.replan());
  ring      the same failover and striping, no re-planning: the plan chosen for the healthy
            fabric stays (for large messages the plain ring over the degraded host);
  backup    hot repair alone: a fixed backup NIC takes the failed NIC's share, no rebalancing,
            no re-planning (the healthy fabric's plan);
  restart   (analytic) a library without failover: each failure costs the restart time plus
            the work lost since the last checkpoint (half an interval on average), then runs
            fault-free.
"""
import json
import os
import random

from .. import planner
from ..config import Config
from .cluster import Cluster
from .fabric import Fabric, FabricState
from .predict import EFFICIENCY, ALPHA, intra_host_time

CFG = Config()
POLICIES = ("r2comm", "ring", "backup")


def mtbf_trace(H, K, horizon, mtbf_s, mttr_s, seed=0, kind="down"):
    """Random NIC failures: each NIC fails after an exponential time of mean mtbf_s, is
    repaired mttr_s later, and so on, up to `horizon` seconds. [(t, kind, host, nic, value)]"""
    rng = random.Random(seed)
    out = []
    for h in range(H):
        for k in range(K):
            t = rng.expovariate(1.0 / mtbf_s)
            while t < horizon:
                out.append((t, kind, h, k, None))
                out.append((t + mttr_s, "up", h, k, None))
                t += mttr_s + rng.expovariate(1.0 / mtbf_s)
    return sorted(out)


def flapping(h, k, start, period, count, down_frac=0.5):
    out = []
    for i in range(count):
        t = start + i * period
        out += [(t, "down", h, k, None), (t + down_frac * period, "up", h, k, None)]
    return out


def load_trace(path):
    """A JSON list of [t, kind, host, nic, value] (kind: down, hard, up, degrade)."""
    with open(path) as f:
        return [tuple(x) + (None,) * (5 - len(x)) for x in json.load(f)]


class Runner:
    """Plays a workload on one fabric under one policy."""

    def __init__(self, fabric, policy="r2comm", hedge=True, itemsize=4):
        self.fab = fabric
        self.policy = policy
        cl_policy = "backup" if policy == "backup" else "r2comm"
        self.cl = Cluster(fabric, policy=cl_policy, hedge=hedge)
        self.itemsize = itemsize
        self.replan = policy == "r2comm"
        self._plans = {}
        self._times = {}
        self.op_times = []
        self.replays = 0

    def _view_state(self):
        f, v = self.fab, self.cl.view
        nic = [[0.0 if v.failed[h][k] else f.line[h][k] * f.factor[h][k] * f.efficiency
                for k in range(f.K)] for h in range(f.H)]
        return FabricState(list(range(f.H)), nic), nic

    def _plan(self, nbytes):
        if self.replan:
            st, nic = self._view_state()
            key = (nbytes, tuple(map(tuple, nic)))
            if key not in self._plans:
                self._plans[key] = planner.build_all("allreduce", self.fab.H, nbytes,
                                                     self.itemsize, 0, CFG.eager, "", st)
            return self._plans[key], key
        key = (nbytes, "healthy")             # planned once for the healthy fabric, kept
        if key not in self._plans:
            f = self.fab
            st = FabricState(list(range(f.H)), [[f.line[h][k] * f.efficiency
                                                  for k in range(f.K)] for h in range(f.H)])
            self._plans[key] = planner.build_all("allreduce", f.H, nbytes, self.itemsize, 0,
                                                 CFG.eager, "", st)
        return self._plans[key], key

    def allreduce(self, nbytes):
        sc, pkey = self._plan(nbytes)
        f, v = self.fab, self.cl.view
        key = (pkey, tuple(map(tuple, f.up)), tuple(map(tuple, f.factor)),
               tuple(map(tuple, v.avoid)))
        t0 = self.cl.sim.now
        dur = self._times.get(key)
        if dur is not None and self.cl.sim.next_event() > t0 + dur:
            self.cl.sim.skip_to(t0 + dur)
        else:
            before = self.cl.sim.next_event()
            dur = self.cl.run_schedules(sc)["time_s"]
            self.replays += 1
            if before > t0 + dur and key not in self._times:
                self._times[key] = dur
        intra = intra_host_time(self.fab, "allreduce", nbytes)
        if intra:
            self.cl.idle_until(self.cl.sim.now + intra)
        self.op_times.append((t0, self.cl.sim.now - t0))
        return self.cl.sim.now - t0

    def run(self, steps, iterations, faults=()):
        for fl in faults:
            self.cl.fault_at(*fl)
        its = []
        for _ in range(iterations):
            t0 = self.cl.sim.now
            for kind, val in steps:
                if kind == "compute":
                    self.cl.idle_until(self.cl.sim.now + val)
                else:
                    self.allreduce(val)
            its.append(self.cl.sim.now - t0)
        return its


def restart_time(fault_free_total, nfail, restart_s, ckpt_interval_s):
    """A library that restarts from the last checkpoint on every failure."""
    return fault_free_total + nfail * (restart_s + ckpt_interval_s / 2.0)


def training_steps(grad_bytes, buckets, compute_s):
    b = grad_bytes // buckets
    return [("compute", compute_s)] + [("allreduce", b)] * buckets


def decoding_steps(layers, msg_bytes, compute_per_layer_s):
    return [("compute", compute_per_layer_s), ("allreduce", msg_bytes)] * layers


def compare(fabric_args, steps, iterations, faults, restart_s=300.0, ckpt_interval_s=1800.0,
            policies=("r2comm", "ring", "backup")):
    """Total times and overheads against the fault-free run, per policy (+ restart)."""
    free = Runner(Fabric(**fabric_args)).run(steps, iterations)
    t_free = sum(free)
    out = {"fault_free_s": t_free, "iterations": iterations,
           "failures": sum(1 for f in faults if f[1] in ("down", "hard")), "policies": {}}
    for pol in policies:
        r = Runner(Fabric(**fabric_args), pol)
        its = r.run(steps, iterations, faults)
        out["policies"][pol] = {"total_s": sum(its), "overhead": sum(its) / t_free - 1,
                                "worst_iteration_s": max(its), "replays": r.replays,
                                "iterations_s": its}
    t_r = restart_time(t_free, out["failures"], restart_s, ckpt_interval_s)
    out["policies"]["restart"] = {"total_s": t_r, "overhead": t_r / t_free - 1,
                                  "restart_s": restart_s, "ckpt_interval_s": ckpt_interval_s}
    return out


def one_failure(fabric_args, steps, warm, iterations, kind="down", policies=POLICIES):
    """One NIC (host 1, NIC 0) fails at the start of iteration `warm` and stays down. Per policy:
    healthy iteration time, degraded steady-state iteration time, transient (extra time of the
    iterations around the failure beyond the steady state) and the detection/reaction log."""
    free = Runner(Fabric(**fabric_args)).run(steps, warm)
    t_h = sorted(free)[len(free) // 2]
    out = {"healthy_s": t_h, "policies": {}}
    for pol in policies:
        r = Runner(Fabric(**fabric_args), pol)
        its = r.run(steps, warm)
        r.cl.fault_at(r.cl.sim.now + 1e-3, kind, 1, 0)
        its += r.run(steps, iterations - warm)
        t_d = its[-1]
        transient = sum(its[warm:]) - (iterations - warm) * t_d
        out["policies"][pol] = {"degraded_s": t_d, "slowdown": t_d / t_h - 1,
                                "transient_s": transient, "iterations_s": its,
                                "replays": r.replays}
    return out


def concurrent(fabric_args, steps, iterations, nfails, policies=POLICIES):
    """Steady-state iteration time with n NICs down at once (distinct hosts), per policy."""
    H, K = fabric_args["hosts"], fabric_args["nics"]
    rows = []
    free = Runner(Fabric(**fabric_args)).run(steps, iterations)[-1]
    for n in nfails:
        row = {"failed_nics": n, "healthy_s": free}
        for pol in policies:
            fab = Fabric(**fabric_args)
            for i in range(n):
                fab.down((1 + 3 * i) % H, i % K)
            its = Runner(fab, pol).run(steps, iterations)
            row[pol] = its[-1] / free - 1
        rows.append(row)
    return rows


def job_overhead(one, nfail, job_s, mttr_s, restart_s, ckpt_interval_s):
    """Overhead of a job of job_s seconds in which nfail NIC failures happen one at a time,
    each repaired after mttr_s: (time degraded x slowdown + transient) per failure; a
    restarting library loses restart_s plus half a checkpoint interval per failure."""
    out = {}
    for pol, v in one["policies"].items():
        out[pol] = nfail * (mttr_s * v["slowdown"] + v["transient_s"]) / job_s
    out["restart"] = nfail * (restart_s + ckpt_interval_s / 2.0) / job_s
    return out



def main(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.figures, exist_ok=True)
    quick = a.quick
    H, K = (8, 4) if quick else (16, 8)
    if getattr(a, "trace", None) or getattr(a, "mtbf", None):
        fa = dict(hosts=H, nics=K, rate=50e9, ranks_per_host=8, efficiency=EFFICIENCY,
                  alpha=ALPHA)
        steps = training_steps(1 << 30, 4, 0.25)
        horizon = a.iterations * 0.3
        faults = load_trace(a.trace) if a.trace else \
            mtbf_trace(H, K, horizon, a.mtbf, a.mttr, a.seed)
        c = compare(fa, steps, a.iterations, faults)
        c["faults"] = faults
        path = os.path.join(a.out, "sim_trace.json")
        with open(path, "w") as f:
            json.dump(c, f, indent=1)
        print(json.dumps({p: round(v["overhead"] * 100, 4) for p, v in c["policies"].items()}),
              f"({c['failures']} failures; {path})")
        return 0
    job_s, mttr_s, restart_s, ckpt_s = 24 * 3600.0, 3600.0, 600.0, 3600.0
    results = {"params": {"job_s": job_s, "mttr_s": mttr_s, "restart_s": restart_s,
                          "ckpt_interval_s": ckpt_s, "efficiency": EFFICIENCY, "alpha": ALPHA}}
    scen = {
        "training": (dict(hosts=H, nics=K, rate=50e9, ranks_per_host=8, efficiency=EFFICIENCY,
                          alpha=ALPHA), training_steps(1 << 30, 4, 0.25),
                     f"DP training, {H} hosts x 8 GPUs x {K} NICs (400 Gbit/s), "
                     "1 GiB of gradients in 4 buckets, 250 ms compute"),
        "decoding": (dict(hosts=4, nics=K, rate=50e9, ranks_per_host=8, efficiency=EFFICIENCY,
                          alpha=ALPHA), decoding_steps(160, 8 * 8192 * 2, 50e-6),
                     f"TP decoding over 4 hosts x 8 GPUs x {K} NICs, 160 allreduces of "
                     "128 KiB per token, 50 us compute between them"),
    }
    for name, (fa, steps, title) in scen.items():
        one = one_failure(fa, steps, 3, 8)
        conc = concurrent(fa, steps, 3, (0, 1, 2, 4, 8))
        nf = list(range(0, 17, 2))
        ovh = [job_overhead(one, n, job_s, mttr_s, restart_s, ckpt_s) for n in nf]
        res = {"title": title, "one_failure": one, "concurrent": conc,
               "job_overhead": [dict(failures=n, **o) for n, o in zip(nf, ovh)]}
        results[name] = res
        with open(os.path.join(a.out, f"sim_{name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(name, json.dumps({p: round(v["slowdown"] * 100, 3)
                                for p, v in one["policies"].items()}),
              json.dumps(conc), flush=True)
        fig, axs = plt.subplots(1, 2, figsize=(11, 4))
        ax = axs[0]
        for pol, mk in (("r2comm", "o-"), ("ring", "s--"), ("backup", "^-."),
                        ("restart", "x:")):
            ax.plot(nf, [100 * o[pol] for o in ovh], mk, label=pol)
        ax.set_xlabel(f"NIC failures in a {job_s / 3600:.0f} h job (each down {mttr_s / 60:.0f} min)")
        ax.set_ylabel("overhead vs fault-free (%)")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.legend()
        ax.grid(alpha=0.3)
        ax = axs[1]
        for pol, mk in (("r2comm", "o-"), ("ring", "s--"), ("backup", "^-.")):
            ax.plot([c["failed_nics"] for c in conc], [100 * c[pol] for c in conc], mk,
                    label=pol)
        ax.set_xlabel("NICs down at once (distinct hosts)")
        ax.set_ylabel("slowdown of an iteration (%)" if name == "training"
                      else "slowdown of a token (%)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(a.figures, f"sim_{name}.png"), dpi=110)
        plt.close(fig)
    with open(os.path.join(a.out, "sim_workloads.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0
