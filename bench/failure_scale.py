"""What a NIC failure costs one rank as the job grows (issue 39): the production code of one rank
driven with synthetic peers, 64 to 8,192 ranks x 8 NICs (8 ranks a host), every cache cold.

    python bench/failure_scale.py [--ns 64,...,8192] [--json bench/out/failure_scale.json]
                                  [--plot bench/figures/failure_scale.png]

Each (n, case) runs in a fresh process (nothing cached from another point). The rank is rank 0
(host 0); the failure is at NIC 3 of host H/2. Cases:

  nic_down     the NIC is announced down
  nic_half     the NIC is announced at half its rate
  start_rail   the NIC did not connect at start-up (its rail failed towards the ring
               neighbours on the hosts before and after it): the start-up exchange's reports
               (n of them, two with failures) validated, the facts derived, the first state

Phases, each timed in CPU seconds (time.process_time), with the RSS the process holds
afterwards; the Python heap's peak per phase (tracemalloc) comes from a second fresh process of
the same point (tracing slows allocation several times over, so it is not on while timing):

  learn    the facts frame as the failure detector receives it (FactBook.decode, merge) and
           its application to a real Engine of n peers (NicWatch.apply: the rail marked
           towards every rank of that host)   [start_rail: startup.agree's report loop and
           StartOutcome.facts]
  agree    the switch round (replan.py) as this rank runs it: control.allgather of its
           (limit, digest) row over the control trees, every message arriving at once (a stand-in
           plane: no sockets; what is measured is this rank's work, O(n) rows per message),
           then the decision
  state    the plan state from the facts (World.plan_state: facts.plan_state)
  plans    the first plan of each collective on that state (plans.compile_call, as
           Channel.compiled: the planner's schedule and the engine's Plan): allreduce 64 MiB,
           allgather and reduce_scatter_block 1 MiB blocks, bcast and reduce 64 MiB, alltoall
           64 KiB blocks

Setup (the Engine of n peers, the Topology) is not timed. JSON for bench/RESULTS.md, a plot of
CPU ms per phase against n."""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

NS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
G, NICS, RAIL = 8, 8, 3
CASES = ("nic_down", "nic_half", "start_rail")
PLANS = (("allreduce", 64 << 20, 4), ("allgather", 1 << 20, 4),
         ("reduce_scatter_block", 1 << 20, 4), ("bcast", 64 << 20, 4), ("reduce", 64 << 20, 4),
         ("alltoall", 64 << 10, 4))


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Done:
    """A request that completed at once."""
    done = True

    def Wait(self, timeout=None):
        return None


class _Plane:
    """The control plane of one rank as control.allgather sees it, every peer's message there at
    once: a receive gets a whole table (every row known: the largest merge), a send its copy."""

    def __init__(self, n, me, row, engine):
        import numpy as np
        self.size, self.rank, self.timeout, self.plan_state = n, me, 30.0, None
        self.engine = engine
        self._members = list(range(n))
        full = np.ones((n + 1, len(row) + 1))    # every rank's row known (column 0), each the
        full[:n, 1:] = row                        # same as this one's (every rank agrees)
        full[n, 0] = 1.0                          # the root's verdict: DONE
        self._full = full

    def global_ranks(self):
        return self._members

    def connect(self, ranks):
        pass

    def message(self, kind, box, peer, tag, status=None, rail=None):
        if kind == "recv":
            box[...] = self._full
            status.count = box.nbytes
        return _Done()


def _phase(out, name, fn):
    """Run one phase: its CPU ms, or (while tracemalloc traces: the memory pass) its heap peak."""
    if tracemalloc.is_tracing():
        tracemalloc.reset_peak()
        res = fn()
        out[name + "_peak_kib"] = round(tracemalloc.get_traced_memory()[1] / 1024, 1)
        return res
    t0 = time.process_time()
    res = fn()
    out[name + "_ms"] = round((time.process_time() - t0) * 1e3, 3)
    return res


def point(n, case, colls=None, memory=False):
    """One (n, case) in this process (colls: the collectives whose first plans are timed, all of
    PLANS by default; memory: the pass that traces the Python heap instead of timing, since
    tracing slows allocation several times over): {"ranks", "case", "<phase>_ms", ..., "total_ms",
    "peak_mib", "rss_added_mib", "algo", "facts", "exceptions"}."""
    from r2comm.control import tree as control, facts, replan
    from r2comm.front import plans
    from r2comm._core import engine as eng_mod
    from r2comm.config import Config
    from r2comm.control.nicwatch import NicWatch
    from r2comm.planner import clear_caches
    from r2comm.planner.state import DEFAULT_BW
    from r2comm.planner.topology import INTRA_BW, Topology
    H = n // G
    host_of = [r // G for r in range(n)]
    me, victim = 0, H // 2
    members = list(range(n))
    figures = [DEFAULT_BW] * NICS
    cfg = Config()
    engine = eng_mod.Engine(me, n, [NICS] * n, cfg.chunk_size, 0.5, 1.5, 16 << 20, 0.1, 5.0,
                            NICS)
    book = facts.FactBook(n, H, NICS)
    watch = NicWatch(engine, book, me, host_of, [f"198.18.{k}.1" for k in range(NICS)], NICS)
    topo = Topology.from_labels(host_of, [NICS] * n)
    clear_caches()
    out = {"ranks": n, "hosts": H, "case": case}
    rss0 = _rss_mib()
    if memory:
        tracemalloc.start()

    if case == "start_rail":
        from r2comm.control import startup
        first, last = victim * G, victim * G + G - 1
        reports = [{} for _ in range(n)]
        reports[first - 1][(first, RAIL)] = "timed out"      # the opener is the lower rank
        reports[last][(last + 1, RAIL)] = "timed out"
        eps = [{"rails": [(f"198.18.{k}.{r % 250}", 4000) for k in range(NICS)],
                "ctrl": ("198.19.0.1", 5000), "host": f"h{host_of[r]}"} for r in range(n)]

        class _Boot:
            endpoints = eps

        class _Comm:                         # a store bootstrap's shape: no Iallreduce
            def Get_size(self):
                return n

            def Barrier(self):
                pass

            def allgather(self, obj):
                return reports

        def learn():
            start = startup.agree(_Comm(), _Boot(), {}, 30.0)
            got = start.facts(host_of, NICS)
            book.merge(got)
            watch.apply()
            return got
    else:
        level = 0 if case == "nic_down" else facts.FULL // 2
        owner = facts.FactBook(n, H, NICS)
        owner.announce(facts.nic_key(victim, RAIL), level, victim * G)
        payload = owner.encode()

        def learn():
            book.merge(book.decode(payload))
            watch.apply()
            return book.snapshot()[1]
    entries = _phase(out, "learn", learn)
    digest = facts.digest_of(entries)

    def agree():
        row = [float(replan.SWITCH_MARGIN), float(digest)]
        table = control.allgather(_Plane(n, me, row, engine), row)
        assert replan.same_rows(table[:, 1:])
        return replan.latest([int(x) for x in table[:, 0]])
    _phase(out, "agree", agree)
    state = _phase(out, "state", lambda: facts.plan_state(entries, host_of, members, NICS,
                                                            figures, INTRA_BW))

    def first_plans():
        algos = {}
        for coll, nbytes, itemsize in PLANS:
            if colls is not None and coll not in colls:
                continue
            _, sched, _, _, _ = plans.compile_call(eng_mod.Plan, coll, me, members, nbytes,
                                                   itemsize, 0, 0, 0, True, cfg, state, topo)
            algos[coll] = sched.algo
        return algos
    out["algos"] = _phase(out, "plans", first_plans)
    if memory:
        out["heap_peak_mib"] = round(max(out[p + "_peak_kib"] for p in ("learn", "agree",
                                                                      "state", "plans")) / 1024, 2)
        tracemalloc.stop()
    else:
        out["rss_added_mib"] = round(_rss_mib() - rss0, 1)
        out["maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        out["total_ms"] = round(sum(out[p + "_ms"] for p in ("learn", "agree", "state",
                                                               "plans")), 3)
        out["plan_ms"] = {}                       # (each collective's alone: the same again,
        for coll, nbytes, itemsize in PLANS:      # cold, one at a time)
            if colls is not None and coll not in colls:
                continue
            clear_caches()
            t0 = time.process_time()
            plans.compile_call(eng_mod.Plan, coll, me, members, nbytes, itemsize, 0, 0, 0, True,
                               cfg, state, topo)
            out["plan_ms"][coll] = round((time.process_time() - t0) * 1e3, 2)
    out["facts"] = len(entries)
    out["exceptions"] = 0 if state is None else len(state.exceptions)
    out["degraded_hosts"] = [] if state is None else state.degraded_hosts()
    engine.close()
    return out


def run_point(n, case, timeout, colls=None):
    """The point timed in one fresh process and its heap traced in another, merged."""
    out = {}
    for memory in (False, True):
        cmd = [sys.executable, __file__, "--point", f"{n}:{case}"] + \
            (["--colls", ",".join(colls)] if colls else []) + (["--memory"] if memory else [])
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=timeout, cwd=str(ROOT))
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            return {"ranks": n, "case": case, "error": (p.stderr or p.stdout)[-2000:]}
        out = {**json.loads(lines[-1]), **out}
    return out


def table(rows):
    out = ["| ranks | case | learn ms | agree ms | state ms | plans ms | total CPU ms | heap "
           "peak MiB | RSS added MiB | allreduce plan |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['ranks']} | {r['case']} | error | | | | | | | |")
            continue
        out.append(f"| {r['ranks']} | {r['case']} | {r['learn_ms']:.2f} | {r['agree_ms']:.2f} | "
                   f"{r['state_ms']:.2f} | {r['plans_ms']:.1f} | {r['total_ms']:.1f} | "
                   f"{r['heap_peak_mib']:.1f} | {r['rss_added_mib']:.1f} | "
                   f"{r['algos']['allreduce']} |")
    return "\n".join(out)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for case, style in zip(CASES, ("o-", "s--", "^:")):
        pts = sorted((r["ranks"], r) for r in rows if r.get("case") == case and "error" not in r)
        if not pts:
            continue
        xs = [x for x, _ in pts]
        axes[0].plot(xs, [r["total_ms"] for _, r in pts], style, label=f"{case}: total")
        axes[1].plot(xs, [r["heap_peak_mib"] for _, r in pts], style, label=case)
    pts = sorted((r["ranks"], r) for r in rows if r.get("case") == "nic_down" and "error" not in r)
    for phase in ("learn", "agree", "state", "plans"):
        axes[0].plot([x for x, _ in pts], [r[phase + "_ms"] for _, r in pts], "x-", alpha=0.5,
                     label=f"nic_down: {phase}")
    for ax, title, unit in ((axes[0], "CPU per rank, NIC failure to new plans", "CPU ms"),
                            (axes[1], "memory a rank adds (Python heap peak)", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (8 per host, 8 NICs)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(50, color="grey", lw=0.8)
    axes[0].axhline(200, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default=",".join(map(str, NS)))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--colls", default="", help="only these collectives' first plans")
    p.add_argument("--point", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.point:
        n, case = a.point.split(":")
        print(json.dumps(point(int(n), case, a.colls.split(",") if a.colls else None,
                               a.memory)), flush=True)
        return 0
    rows = []
    for n in (int(x) for x in a.ns.split(",")):
        for case in a.cases.split(","):
            rows.append(run_point(n, case, a.timeout, a.colls.split(",") if a.colls else None))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    doc = {"rows": rows, "ranks_per_host": G, "nics": NICS, "rail": RAIL,
           "machine": platform.processor() or platform.machine(),
           "command": "python bench/failure_scale.py " + " ".join(argv or [])}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.plot:
        plot(rows, a.plot)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
