"""One collective's predicted time on a fabric, under the schedule r2comm's planner picks.

Defaults fitted to the netns testbed (bench/RESULTS.md, run of 2026-12-03 at commit
e306b9a9da8e): EFFICIENCY is the mean of measured busbw / line rate over the four healthy
multi-rail scenarios (2 and 4 ranks, 1 and 2 NICs of 1 Gbit/s: 0.121, 0.237, 0.122, 0.239 GB/s);
ALPHA is the planner's own per-message latency (planner.state.DEFAULT_ALPHA)."""
from ..config import Config
from .. import planner
from ..planner.state import DEFAULT_ALPHA
from .cluster import Cluster
from .fabric import Fabric

# (ranks, NICs per host, line bytes/s per NIC, measured busbw bytes/s), bench/RESULTS.md
TESTBED_HEALTHY = [(2, 1, 125e6, 0.121e9), (2, 2, 125e6, 0.237e9),
                   (4, 1, 125e6, 0.122e9), (4, 2, 125e6, 0.239e9)]
EFFICIENCY = sum(bw / (k * line) for _, k, line, bw in TESTBED_HEALTHY) / len(TESTBED_HEALTHY)
ALPHA = DEFAULT_ALPHA
INTRA_BW = 150e9            # bytes/s between GPUs of one host (NVLink class), host-level plans
OPS = ("allreduce", "allgather", "reduce_scatter_block", "bcast", "reduce", "alltoall",
       "barrier")


def parse_size(text):
    """Bytes from '64M', '1G', '4096', '1.5K' (binary suffixes)."""
    t = str(text).strip().upper().rstrip("B").rstrip("I")
    mult = 1
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suf):
            t, mult = t[:-1], m
            break
    v = float(t) * mult
    if v < 0:
        raise ValueError(f"negative size {text!r}")
    return int(v)


def parse_rate(text):
    """Bytes/s from '1gbit', '500mbit', '400Gbit', '25GB' (bytes/s), '1.25e9' (bytes/s)."""
    t = str(text).strip().lower().replace("/s", "").replace("ps", "")
    for suf, m in (("tbit", 1e12 / 8), ("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8),
                   ("tb", 1e12), ("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("g", 1e9 / 8),
                   ("m", 1e6 / 8)):
        if t.endswith(suf):
            v = float(t[: -len(suf)]) * m
            break
    else:
        v = float(t)
    if v <= 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return v


def build_fabric(hosts, nics, rate, ranks_per_host=1, down=(), degrade=(),
                 efficiency=EFFICIENCY, alpha=ALPHA, intra_bw=INTRA_BW, spine_bw=None):
    fab = Fabric(hosts, nics, rate, ranks_per_host, efficiency, alpha, intra_bw, spine_bw)
    for h, k in down:
        _check_nic(fab, h, k)
        fab.down(h, k)
    for h, k, frac in degrade:
        _check_nic(fab, h, k)
        if not 0 < frac <= 1:
            raise ValueError(f"degrade {h}:{k}: fraction {frac} not in (0, 1]")
        fab.degrade(h, k, frac)
    return fab


def _check_nic(fab, h, k):
    if not (0 <= h < fab.H and 0 <= k < fab.K):
        raise ValueError(f"NIC {h}:{k} does not exist ({fab.H} hosts x {fab.K} NICs)")


def settled_cluster(fab, flat=False, policy="r2comm", segments=None, hedge=True):
    """A Cluster whose engines already know about every NIC that is down (steady state)."""
    cl = Cluster(fab, policy=policy, flat=flat, segments=segments, hedge=hedge)
    for h in range(fab.H):
        for k in range(fab.K):
            if not fab.up[h][k]:
                cl.view.avoid[h][k] = cl.view.failed[h][k] = True
    cl.changed()
    return cl


def schedules(fab, op, nbytes, itemsize=4, replan=True, algo="", flat=False):
    """The planner's schedule set for `op` on fabric `fab` (replan: planned for the rail state
    the engines measure, as after comm.replan(); else the static plan)."""
    n = fab.H * fab.G if flat else fab.H
    st = fab.state(flat=flat)
    if not replan and flat and fab.G > 1:
        # the static plan the engines make for their hosts (hierarchical where it pays)
        topo = planner.Topology.from_labels(st.hosts, [fab.K] * n)
        return [planner.build(op, r, n, nbytes, itemsize, 0, Config().eager, algo, topo=topo)
                for r in range(n)], st
    return planner.build_all(op, n, nbytes, itemsize, 0, Config().eager, algo,
                             st if replan else None), st


def intra_host_time(fab, op, nbytes):
    """Host-level plans with G ranks per host: the intra-host reduce-scatter and allgather
    around the inter-host allreduce (ring over the host's GPUs at intra_bw)."""
    G = fab.G
    if G <= 1 or op != "allreduce":
        return 0.0
    return 2 * (G - 1) / G * nbytes / fab.intra_bw + 2 * (G - 1) * fab.alpha


def predict(hosts, nics, rate, nbytes, ranks_per_host=1, down=(), degrade=(), op="allreduce",
            itemsize=4, efficiency=EFFICIENCY, alpha=ALPHA, intra_bw=INTRA_BW, spine_bw=None,
            replan=True, algo="", flat=False, segments=None, policy="r2comm"):
    """{"time_s", "schedule", "fabric", ...}: one `op` of nbytes (per rank, as the planner
    counts it) under the plan r2comm would use, replayed on the fabric."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: one of {OPS}")
    if ranks_per_host > 1 and not flat and op != "allreduce":
        raise ValueError("host-level plans with several ranks per host exist for allreduce "
                         "only; use flat=True (--flat) for other collectives")
    fab = build_fabric(hosts, nics, rate, ranks_per_host, down, degrade, efficiency, alpha,
                       intra_bw, spine_bw)
    scheds, st = schedules(fab, op, nbytes, itemsize, replan, algo, flat)
    cl = settled_cluster(fab, flat, policy, segments)
    res = cl.run_schedules(scheds)
    intra = 0.0 if flat else intra_host_time(fab, op, nbytes)
    out = {
        "time_s": res["time_s"] + intra,
        "schedule": {
            "algo": scheds[0].algo if scheds else "",
            "planner_cost_s": scheds[0].cost if scheds and replan else None,
            "candidates": (planner.evaluate(op, len(scheds), nbytes, itemsize, st)
                           if replan and op == "allreduce" else None),
            "ranks": len(scheds),
            "messages": res["messages"],
            "max_bytes_sent_per_rank": max(res["bytes_sent"], default=0),
            "plan": ("hierarchical" if scheds and scheds[0].hierarchical
                     else "flat" if flat else "host-level"),
            "replanned": bool(replan),
        },
        "inter_host_s": res["time_s"],
        "intra_host_s": intra,
        "lower_bound_s": (planner.cost.lower_bound_state(nbytes, st)
                          if op == "allreduce" else None),
        "fabric": fab.describe(),
        "op": op, "bytes": nbytes, "policy": policy, "segments": segments,
    }
    return out
