"""replay/T* against the host count for the degraded-server allreduce: plain ring, the degraded
schedule (planner/degraded.py) and the tree fold (planner/treefold.py).

H hosts x 2 NICs of 400 Gbit/s (efficiency as the simulator's default), one NIC of the last host
down or at a fraction of its rate, 256 MiB allreduce, replayed chunk by chunk with alpha = 0 (T*
has no latency term). The ring is the closed form (cost.ring_time: a lockstep pipeline); the
degraded schedule is replayed up to --max-degraded hosts, above that (NIC down only) its closed
form 1 + (H-1)c/N (exact where replayed, bench/SIM.md).

    python bench/sim_degraded_scale.py --hosts 3,4,8,9,16,17 --rates 0,0.5 \
        --json bench/out/sim/degraded_scale.json --plot bench/figures/sim_degraded_scale.png
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from r2comm.config import Config  # noqa: E402
from r2comm.planner import cost, degraded, treefold  # noqa: E402
from r2comm.planner.state import DEFAULT_ALPHA  # noqa: E402
from r2comm.sim.cluster import Cluster  # noqa: E402
from r2comm.sim.fabric import Fabric  # noqa: E402
from r2comm.sim.predict import EFFICIENCY  # noqa: E402

NICS, RATE = 2, 50e9


def fabric(H, nic_rate):
    """H hosts; the last host's NIC 1 down (nic_rate 0) or at nic_rate of its line rate."""
    fab = Fabric(H, NICS, RATE, 1, EFFICIENCY, 0.0)
    if nic_rate == 0:
        fab.down(H - 1, NICS - 1)
    else:
        fab.degrade(H - 1, NICS - 1, nic_rate)
    return fab


def replay(fab, build):
    st = fab.state()
    sc = [build(r, st) for r in range(fab.H)]
    res = Cluster(fab).run_schedules(sc)
    return res["time_s"], res["messages"]


def row(H, nic_rate, nbytes, max_degraded):
    fab = fabric(H, nic_rate)
    beta = (NICS - 1 + nic_rate) / NICS
    host_bw = NICS * RATE * EFFICIENCY
    tstar = cost.lower_bound(nbytes, host_bw, beta, H)
    eager, chunk = Config().eager, Config().chunk_size
    out = {"hosts": H, "nic_rate": nic_rate, "beta": beta, "bytes": nbytes, "tstar_s": tstar,
           "ring": cost.ring_time(nbytes, H, beta * host_bw) / tstar}
    t0 = time.process_time()
    tt, msgs = replay(fab, lambda r, st: treefold.allreduce_treefold(r, H, nbytes, 4, eager, st))
    out.update(treefold=tt / tstar, treefold_messages=msgs,
               treefold_closed_form=treefold.treefold_time(
                   H, nbytes, beta * host_bw, host_bw, chunk=chunk) / tstar,
               treefold_preferred=treefold.state_preferred(fab.state(), nbytes),
               treefold_cpu_s=time.process_time() - t0)
    if H <= max_degraded:
        td, dm = replay(fab, lambda r, st: degraded.allreduce_degraded(r, H, nbytes, 4, eager,
                                                                       st))
        out.update(degraded=td / tstar, degraded_messages=dm, degraded_replayed=True)
    else:
        out.update(degraded=1 + (H - 1) * chunk / nbytes, degraded_replayed=False)
    return out


def planner_pick(r):
    """What candidates() offers beside the ring for this row: the tree fold where its closed
    form is PREFER_MARGIN below the degraded schedule's (with the planner's alpha)."""
    bw = NICS * RATE * EFFICIENCY
    return "treefold" if treefold.preferred(r["hosts"], 1, r["bytes"], r["beta"] * bw, bw,
                                            Config().chunk_size, DEFAULT_ALPHA) else "degraded"


def _degraded_known(r):
    """Replayed, or the NIC is down (where 1 + (H-1)c/N is what the replay gives)."""
    return r["degraded_replayed"] or r["nic_rate"] == 0


def markdown(rows):
    lines = ["| hosts | NIC | beta | ring | degraded | tree fold | tree fold closed form "
             "| tree fold messages | degraded messages | offered | best of offered and ring |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["nic_rate"] != 0, r["nic_rate"], r["hosts"])):
        dg = f"{r['degraded']:.3f}" + ("" if r["degraded_replayed"] else " (formula)") \
            if _degraded_known(r) else "–"
        pick = planner_pick(r)
        best = min(r["ring"], r[pick])
        lines.append(f"| {r['hosts']} | {'down' if r['nic_rate'] == 0 else r['nic_rate']} | "
                     f"{r['beta']:.4f} | {r['ring']:.3f} | {dg} | {r['treefold']:.3f} | "
                     f"{r['treefold_closed_form']:.3f} | {r['treefold_messages']} | "
                     f"{r.get('degraded_messages', '–')} | {pick} | {best:.3f} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = sorted({r["nic_rate"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        rs = sorted((r for r in rows if r["nic_rate"] == rate), key=lambda r: r["hosts"])
        for key, lab in (("ring", "ring"), ("degraded", "degraded"), ("treefold", "tree fold")):
            pts = [(r["hosts"], r[key]) for r in rs if key != "degraded" or _degraded_known(r)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
        ax.axhline(1.05, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts")
        ax.set_title(f"NIC {'down' if rate == 0 else f'at {rate:g}'} "
                     f"(beta {(NICS - 1 + rate) / NICS:g})")
        ax.set_ylim(0.95, 2.1)
    axes[0][0].set_ylabel("replay / T*")
    axes[0][0].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", default="3,4,8,9,16,17,32,33,64,65,128,129")
    ap.add_argument("--rates", default="0,0.5,0.25,0.875", help="NIC rate fractions, 0: down")
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--max-degraded", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--from-json", nargs="*", help="only tabulate / plot these saved runs")
    a = ap.parse_args(argv)
    if a.from_json:
        rows = {}
        for path in a.from_json:
            with open(path) as f:
                for r in json.load(f):
                    rows.setdefault((r["hosts"], r["nic_rate"]), r)     # the first run of each
        rows = list(rows.values())
        print(markdown(rows))
        if a.plot:
            plot(rows, a.plot)
        return 0
    rows = []
    for rate in [float(x) for x in a.rates.split(",")]:
        for H in [int(x) for x in a.hosts.split(",")]:
            r = row(H, rate, a.bytes, a.max_degraded)
            print(json.dumps(r), flush=True)
            rows.append(r)
            if a.json:
                os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(markdown(rows))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
