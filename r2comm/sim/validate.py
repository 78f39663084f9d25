"""Replays the testbed scenarios of bench/RESULTS.md in the simulator and prints predicted vs
measured side by side; checks the degraded-server bound T* from 8 to 512 hosts; times the
simulator itself (scale).

Testbed parameters: NICs shaped by tbf to 1gbit (multi-rail, failover) or 500mbit (degraded
server), 64 MiB float32 allreduce, one rank per host except the 4-rank multi-rail job (2 hosts x
2 ranks, the same-host pair over loopback TCP). Efficiency and alpha: the fitted defaults of
predict.py (EFFICIENCY is fitted on the healthy multi-rail rows, so those rows are in-sample;
the failover and degraded-server rows are out of sample)."""
import json
import time

from ..config import Config
from ..planner import cost
from .cluster import Cluster
from .fabric import Fabric
from .predict import EFFICIENCY, ALPHA, schedules

MiB = 1 << 20
N = 64 * MiB
LOOPBACK_BW = 2.0e9          # same-host TCP pair on this VM (RESULTS.md loopback busbw 2-2.5 GB/s)
CFG = Config()

# bench/RESULTS.md, "Multi-rail and NIC failover in the netns testbed" (busbw GB/s; op times ms)
MULTIRAIL = {2: {"1nic": 0.121, "2nic": 0.237, "after": 0.121, "detect_ms": 504,
                 "op_ms": (300, 340, 556)},
             4: {"1nic": 0.122, "2nic": 0.239, "after": 0.119, "detect_ms": 494,
                 "op_ms": (508, 831, 851)}}
# bench/RESULTS.md, "Degraded-server allreduce in the testbed" (ms)
DEGRADED = {3: {"tstar": 1074, "ring": 1446, "replanned": 1139},
            4: {"tstar": 1074, "ring": 1636, "replanned": 1176}}


def _fabric(hosts, nics, rate, G=1, down=()):
    f = Fabric(hosts, nics, rate, G, EFFICIENCY, ALPHA, LOOPBACK_BW)
    for h, k in down:
        f.down(h, k)
    return f


def _busbw(n, t):
    return 2 * (n - 1) / n * N / t


def _one_op(fab, flat, replan):
    # the measured runs (MULTIRAIL) planned flat: a ring over every rank
    sc, _ = schedules(fab, "allreduce", N, 4, replan=replan, flat=flat, algo="flat")
    return Cluster(fab, flat=flat).run_schedules(sc)["time_s"], sc[0].algo


def multirail_rows():
    rows = []
    for n, m in MULTIRAIL.items():
        G = n // 2
        for key, nics, down in (("1nic", 1, ()), ("2nic", 2, ()), ("after", 2, [(1, 0)])):
            fab = _fabric(2, nics, 125e6, G, down)
            t, algo = _one_op(fab, flat=True, replan=False)
            rows.append({"scenario": f"multi-rail, {n} ranks, " + {
                "1nic": "1 NIC", "2nic": "2 NICs", "after": "after NIC 1:0 failed"}[key],
                "unit": "busbw GB/s", "measured": m[key], "predicted": _busbw(n, t) / 1e9,
                "algo": algo})
    return rows


def failover_rows(offsets=(0.1, 0.3, 0.5, 0.7, 0.9)):
    """Stream of allreduces; NIC 0 of host 1 goes silent during op 2 at `offset` of it (the
    testbed's `ip link set down`: no socket error). Returns healthy / hit / after op times and
    the detection time (fault -> rail_failed)."""
    rows = []
    for n, m in MULTIRAIL.items():
        G = n // 2
        hits, detect, healthy, after = [], None, None, None
        for off in offsets:
            fab = _fabric(2, 2, 125e6, G)
            sc, _ = schedules(fab, "allreduce", N, 4, replan=False, flat=True, algo="flat")
            cl = Cluster(fab, flat=True)
            t_h = cl.run_schedules(sc)["time_s"]
            healthy = t_h
            cl.fault_at(cl.sim.now + off * t_h, "down", 1, 0)
            hits.append(cl.run_schedules(sc)["time_s"])
            ops = [cl.run_schedules(sc)["time_s"] for _ in range(3)]
            after = ops[-1]
            fail = [t for t, w, *_ in cl.log if w == "down"][0]
            det = [t for t, w, *_ in cl.log if w == "rail_failed"]
            detect = (det[0] - fail) if det else None
        mh, mhit, maft = m["op_ms"]
        rows += [
            {"scenario": f"failover timeline, {n} ranks: healthy op", "unit": "ms",
             "measured": mh, "predicted": healthy * 1e3},
            {"scenario": f"failover timeline, {n} ranks: op hit by the fault", "unit": "ms",
             "measured": mhit, "predicted": sorted(hits)[len(hits) // 2] * 1e3,
             "range": [min(hits) * 1e3, max(hits) * 1e3]},
            {"scenario": f"failover timeline, {n} ranks: op after", "unit": "ms",
             "measured": maft, "predicted": after * 1e3},
            {"scenario": f"failover timeline, {n} ranks: detection", "unit": "ms",
             "measured": m["detect_ms"], "predicted": detect * 1e3 if detect else None}]
    return rows


def degraded_rows():
    rows = []
    for H, m in DEGRADED.items():
        fab = _fabric(H, 2, 62.5e6, 1, [(H - 1, 1)])
        t_ring, a1 = _one_op(fab, flat=False, replan=False)
        t_rep, a2 = _one_op(fab, flat=False, replan=True)
        tstar = cost.lower_bound(N, 2 * 62.5e6, 0.5, H)
        rows += [{"scenario": f"degraded server, {H} hosts: T*", "unit": "ms",
                  "measured": m["tstar"], "predicted": tstar * 1e3, "algo": "bound"},
                 {"scenario": f"degraded server, {H} hosts: static ring", "unit": "ms",
                  "measured": m["ring"], "predicted": t_ring * 1e3, "algo": a1},
                 {"scenario": f"degraded server, {H} hosts: replanned", "unit": "ms",
                  "measured": m["replanned"], "predicted": t_rep * 1e3, "algo": a2}]
    return rows


def tstar_rows(hosts=(8, 16, 32, 64, 128, 256, 512), nbytes=256 * MiB, beta=0.5, nics=2,
               rate=50e9, segments=None, max_sim_hosts=512):
    """The planner's choice on H hosts with one host at beta of the others' bandwidth (a NIC
    down when beta = (K-1)/K, else a degraded NIC rate), replayed, against T* (at the
    achievable rate: efficiency x line)."""
    out = []
    for H in hosts:
        fab = Fabric(H, nics, rate, 1, EFFICIENCY, 0.0)
        if abs(beta - (nics - 1) / nics) < 1e-9:
            fab.down(H - 1, nics - 1)
        else:
            for k in range(nics):
                fab.degrade(H - 1, k, beta)
        t0 = time.process_time()
        sc, st = schedules(fab, "allreduce", nbytes, 4)
        t1 = time.process_time()
        tstar = cost.lower_bound(nbytes, nics * rate * EFFICIENCY, beta, H)
        row = {"hosts": H, "beta": beta, "bytes": nbytes, "algo": sc[0].algo,
               "tstar_s": tstar, "planner_cost_s": sc[0].cost, "plan_cpu_s": t1 - t0,
               "ring_s": cost.ring_time(nbytes, H, min(st.pair_bw(a, (a + 1) % H)
                                                          for a in range(H)))}
        if H <= max_sim_hosts:
            cl = Cluster(fab, segments=segments)
            r = cl.run_schedules(sc)
            row.update(sim_s=r["time_s"], sim_cpu_s=time.process_time() - t1,
                       messages=r["messages"], ratio=r["time_s"] / tstar)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _fmt(v):
    return "–" if v is None else (f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}")


def markdown(rows):
    lines = ["| scenario | unit | measured | predicted | predicted / measured | plan |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["predicted"] / r["measured"] if r.get("predicted") and r["measured"] else None
        pred = _fmt(r["predicted"])
        if "range" in r:
            pred += f" (range {_fmt(r['range'][0])}–{_fmt(r['range'][1])})"
        lines.append(f"| {r['scenario']} | {r['unit']} | {_fmt(r['measured'])} | {pred} | "
                     f"{'–' if ratio is None else f'{ratio:.3f}'} | {r.get('algo', '')} |")
    return "\n".join(lines)


def main(a):
    rows = multirail_rows() + failover_rows() + degraded_rows()
    md = markdown(rows)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "efficiency": EFFICIENCY, "alpha": ALPHA}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    return 0


def scale_main(a):
    """H hosts x 8 GPUs x 8 NICs (400 Gbit/s), NIC 3 of host H/2 down; one allreduce of
    a.bytes with a.algo ('' = the planner's choice), replayed with a.segments."""
    from .predict import parse_size
    out = []
    for H in [int(x) for x in a.hosts.split(",")]:
        fab = Fabric(H, 8, 50e9, 8, EFFICIENCY, 5e-6)
        fab.down(H // 2, 3)
        t0 = time.perf_counter()
        c0 = time.process_time()
        sc, _ = schedules(fab, "allreduce", parse_size(a.bytes), 2, algo=a.algo)
        t1 = time.perf_counter()
        c1 = time.process_time()
        cl = Cluster(fab, segments=a.segments)
        r = cl.run_schedules(sc)
        t2 = time.perf_counter()
        c2 = time.process_time()
        row = {"hosts": H, "ranks": H * 8, "bytes": parse_size(a.bytes), "algo": sc[0].algo,
               "segments": a.segments, "messages": r["messages"], "sim_time_s": r["time_s"],
               "plan_wall_s": t1 - t0, "plan_cpu_s": c1 - c0, "replay_wall_s": t2 - t1,
               "replay_cpu_s": c2 - c1, "flow_events": cl.sim.events,
               "rate_recomputes": cl.sim.recomputes}
        print(json.dumps(row), flush=True)
        out.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
