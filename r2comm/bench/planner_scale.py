"""Plan time per rank at scale (issues 32 and 39): one rank's planner.build() of a 64 MiB float32
allreduce for H hosts x 8 ranks, 64 to 8,192 ranks, healthy (a Topology, no rail state), with NIC
3 of host H/2 down and with it at half its rate (the state the Communicator plans from after a
NIC is announced down or slow: a planner.state.NicRailState of 8 NICs per host, healthy NICs at
DEFAULT_BW, degraded_tol 0.02); the first plan of a new size (every planner cache cleared,
planner.clear_caches(), its functools caches too; the Topology or rail state made inside the
timing) and a later size of the same size class; --colls: the first plan of every collective
(allreduce, allgather, reduce_scatter_block, bcast, reduce, alltoall, barrier) at the hosts
given, each cold on its own, and all of them in turn after one cold start (the rail state
made once); with --old, every rank's schedules priced by cost.py as before
(planner.build_topo), where that takes seconds, not hours. --sweep adds the choice against the
simulator's replay (sim/sweep.py; --sweep-big: at 32-128 hosts, sweep.big_grid), --bound the
replay/T* of the planner's own choice at 3-512 hosts with a NIC down or partly slow
(sim/sweep.bound_case; --bound-hosts ...,1024 adds 1,024 hosts: about 5-7 min of CPU per NIC
state; --bound-nics 8: 8 NICs per host), --coll-sweep the flat/hierarchical choice of allgather,
reduce_scatter_block and bcast against the replay (sim/sweep.collective_case). JSON for
bench/RESULTS.md (results_planner.py).

    python -m r2comm.bench.planner_scale --json bench/out/planner_scale.json [--old] [--sweep N]
        [--sweep-big] [--bound] [--bound-hosts 3,4,8,...] [--bound-nics 2] [--colls 128,1024]
"""
import argparse
import json
import platform
import statistics
import time

HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
G, NICS = 8, 8
NBYTES = 64 << 20
LATER = NBYTES + 4096                  # the same size class (a quarter octave)
OLD_MAX = 128                          # ranks: the old path above this takes minutes


KINDS = ("healthy", "down", "half")     # no rail state; NIC 3 of host H/2 down; at half rate
COLLS = (("allreduce", NBYTES), ("allgather", None), ("reduce_scatter_block", None),
         ("bcast", NBYTES), ("reduce", NBYTES), ("alltoall", None), ("barrier", 0))
                                       # None: a block of NBYTES / ranks


def _clear():
    from .. import planner
    planner.clear_caches()


def _context(H, kind):
    """{"topo": Topology} (healthy) or {"state": NicRailState} with NIC 3 of host H/2 down or
    at half its rate, as the Communicator builds it from the announced NICs."""
    from ..planner.state import NicRailState
    from ..planner.topology import Topology, INTRA_BW, DEFAULT_BW
    labels = [r // G for r in range(H * G)]
    if kind in (False, "healthy"):
        return {"topo": Topology.from_labels(labels, [NICS] * len(labels))}
    nic = [[DEFAULT_BW] * NICS for _ in range(H)]
    nic[H // 2][3] = 0.0 if kind in (True, "down") else DEFAULT_BW / 2
    return {"state": NicRailState(labels, nic, INTRA_BW, degraded_tol=0.02)}


def plan_times(H, kind, reps_first=3, reps_later=5):
    """{"ranks", "first_ms", "later_ms", "algo", "messages", ...} for one row."""
    from .. import planner
    n = H * G
    firsts, s = [], None
    for _ in range(reps_first):
        _clear()
        t0 = time.perf_counter()
        ctx = _context(H, kind)
        s = planner.build("allreduce", 0, n, NBYTES, 4, 0, 64 << 10, **ctx)
        firsts.append(time.perf_counter() - t0)
    laters = []
    for i in range(reps_later):
        t0 = time.perf_counter()
        s2 = planner.build("allreduce", 0, n, LATER + 4 * i, 4, 0, 64 << 10, **ctx)
        laters.append(time.perf_counter() - t0)
    return {"hosts": H, "ranks": n, "nic": kind, "nic_down": kind == "down", "algo": s.algo,
            "later_algo": s2.algo, "messages": len(s.msgs),
            "first_ms": 1e3 * statistics.median(firsts),
            "later_ms": 1e3 * statistics.median(laters), "predicted_ms": 1e3 * s.cost}


def collective_times(H, kind, reps=3):
    """The first plan of each collective of COLLS on rank 0, cold: {"ranks", "nic", "colls":
    {coll: {"first_ms", "algo", "messages"}}, "sequence_ms"}: each its own cold start (median of
    reps), and "sequence_ms" all of them in turn after one (the rail state made once, inside)."""
    from .. import planner
    n = H * G
    out = {}
    for coll, nb in COLLS:
        nb = NBYTES // n if nb is None else nb
        ts = []
        for _ in range(reps):
            _clear()
            t0 = time.perf_counter()
            s = planner.build(coll, 0, n, nb, 4, 0, 64 << 10, **_context(H, kind))
            ts.append(time.perf_counter() - t0)
        out[coll] = {"first_ms": 1e3 * statistics.median(ts), "algo": s.algo,
                     "messages": len(s.msgs), "bytes": nb}
    seq = []
    for _ in range(reps):
        _clear()
        t0 = time.perf_counter()
        ctx = _context(H, kind)
        for coll, nb in COLLS:
            planner.build(coll, 0, n, NBYTES // n if nb is None else nb, 4, 0, 64 << 10, **ctx)
        seq.append(time.perf_counter() - t0)
    return {"hosts": H, "ranks": n, "nic": kind, "colls": out,
            "sequence_ms": 1e3 * statistics.median(seq)}


def old_time(H):
    """Seconds of the old path: every rank's schedules, priced by cost.py (build_topo)."""
    from .. import planner
    _clear()
    ctx = _context(H, "healthy")
    t0 = time.perf_counter()
    planner.build_topo("allreduce", H * G, NBYTES, 4, 0, 64 << 10, "", ctx["topo"])
    return time.perf_counter() - t0


def bound_rows(hosts=None, nics=2, rates=None, ranks_per_host=1):
    """sweep.bound_case() over BOUND_HOSTS (or `hosts`) x BOUND_RATES (or `rates`), printed as
    they come."""
    from ..sim import sweep
    rows = []
    for rate in rates or sweep.BOUND_RATES:
        for H in hosts or sweep.BOUND_HOSTS:
            rows.append(sweep.bound_case(H, rate, nics=nics, ranks_per_host=ranks_per_host))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def collective_sweep():
    """sweep.collective_case() over sweep.collective_grid(): per collective the mean and worst
    chosen / best replay, the closed forms' and cost.py's (about 25 min of CPU here)."""
    from ..sim import sweep
    t0 = time.process_time()
    pts = [sweep.collective_case(*c) for c in sweep.collective_grid()]
    out = {"points": len(pts), "cpu_s": time.process_time() - t0, "by_coll": {}}
    for coll in sorted({p["coll"] for p in pts}):
        mine = [p for p in pts if p["coll"] == coll]
        out["by_coll"][coll] = {k: (sum(p[k] for p in mine) / len(mine), max(p[k] for p in mine))
                                for k in ("ratio", "cost_py_ratio")}
    out["worst"] = sorted(pts, key=lambda p: -p["ratio"])[:8]
    print(json.dumps(out["by_coll"]), flush=True)
    return out


def sweep_rows(points):
    """sweep.case() over `points`: {"points", "cpu_s", "worst", "ratios"}, the worst printed."""
    from ..sim import sweep
    t0 = time.process_time()
    pts = [sweep.case(*c) for c in points]
    out = {"points": len(pts), "cpu_s": time.process_time() - t0,
           "worst": max(pts, key=lambda r: r["ratio"]),
           "ratios": [[r["hosts"], r["nics"], r["loss"], r["bytes"], r["chosen"], r["ratio"]]
                      for r in pts]}
    print(json.dumps(out["worst"]), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--hosts", default=",".join(map(str, HOSTS)))
    p.add_argument("--old", action="store_true", help="time the old path up to 128 ranks")
    p.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="also the sweep against the replay with N random points")
    p.add_argument("--sweep-big", action="store_true",
                   help="also the sweep against the replay at 32-128 hosts (sweep.big_grid)")
    p.add_argument("--bound", action="store_true",
                   help="also replay/T* of the planner's choice per host count and NIC state")
    p.add_argument("--bound-hosts", default="")
    p.add_argument("--bound-nics", type=int, default=2, help="NICs per host of the --bound runs")
    p.add_argument("--bound-rates", default="",
                   help="the slow NIC's rates of the --bound runs (0: down; default all)")
    p.add_argument("--bound-ranks", type=int, default=1, help="ranks per host of --bound")
    p.add_argument("--colls", default="",
                   help="hosts (e.g. 128,1024) at which to time every collective's first plan")
    p.add_argument("--coll-sweep", action="store_true",
                   help="also the flat/hierarchical choice of the other collectives against "
                        "the replay (sweep.collective_grid)")
    p.add_argument("--no-plan-times", action="store_true", help="skip the plan-time rows")
    a = p.parse_args(argv)
    rows = []
    for H in ([] if a.no_plan_times else [int(x) for x in a.hosts.split(",")]):
        for kind in KINDS:
            row = plan_times(H, kind)
            if a.old and kind == "healthy" and H * G <= OLD_MAX:
                row["old_s"] = old_time(H)
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"rows": rows, "bytes": NBYTES, "later_bytes": LATER, "ranks_per_host": G,
           "nics": NICS, "machine": platform.processor() or platform.machine(),
           "command": "python -m r2comm.bench.planner_scale " + " ".join(argv or [])}
    if a.colls:
        doc["colls"] = []
        for H in [int(x) for x in a.colls.split(",")]:
            for kind in ("down", "half"):
                doc["colls"].append(collective_times(H, kind))
                print(json.dumps(doc["colls"][-1]), flush=True)
    if a.sweep:
        from ..sim import sweep
        doc["sweep"] = sweep_rows(sweep.grid(a.sweep))
    if a.coll_sweep:
        doc["coll_sweep"] = collective_sweep()
    if a.sweep_big:
        from ..sim import sweep
        doc["sweep_big"] = sweep_rows(sweep.big_grid())
    if a.bound:
        doc["bound"] = bound_rows([int(x) for x in a.bound_hosts.split(",")] if a.bound_hosts
                                  else None, a.bound_nics,
                                  [float(x) for x in a.bound_rates.split(",")]
                                  if a.bound_rates else None, a.bound_ranks)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
