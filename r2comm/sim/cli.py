"""python -m r2comm.sim {predict,validate,workloads,scale}"""
import argparse
import json
import sys

from .predict import predict, parse_rate, parse_size, EFFICIENCY, ALPHA, INTRA_BW, OPS


def _nic(text, with_rate=False):
    parts = text.split(":")
    try:
        if with_rate:
            h, k, r = parts
            r = float(r) if _is_frac(r) else r
            return int(h), int(k), r
        h, k = parts
        return int(h), int(k)
    except ValueError:
        form = "HOST:NIC:RATE" if with_rate else "HOST:NIC"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {form}") from None


def _is_frac(s):
    try:
        return float(s) <= 1.0
    except ValueError:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m r2comm.sim")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="time of one collective under r2comm's plan")
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--nics", type=int, required=True)
    p.add_argument("--rate", required=True, help="NIC line rate: 1gbit, 400gbit, 25GB (bytes/s)")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--down", type=lambda t: _nic(t), action="append", default=[],
                   metavar="HOST:NIC")
    p.add_argument("--degrade", type=lambda t: _nic(t, True), action="append", default=[],
                   metavar="HOST:NIC:RATE", help="RATE: fraction of line rate (<= 1) or a rate")
    p.add_argument("--op", default="allreduce", choices=OPS)
    p.add_argument("--bytes", required=True, help="per-rank bytes: 64M, 1G, ...")
    p.add_argument("--itemsize", type=int, default=4)
    p.add_argument("--alpha", type=float, default=ALPHA, help="seconds per message")
    p.add_argument("--efficiency", type=float, default=EFFICIENCY,
                   help=f"achievable fraction of line rate (default {EFFICIENCY:.3f}, testbed fit)")
    p.add_argument("--intra-bw", default=str(INTRA_BW))
    p.add_argument("--spine-bw", default=None)
    p.add_argument("--no-replan", action="store_true", help="static plan (no comm.replan())")
    p.add_argument("--algo", default="")
    p.add_argument("--flat", action="store_true", help="plan every rank, not one per host (the planner then "
                   "prices its hierarchical schedules too, --algo hierarchical forces them)")
    p.add_argument("--segments", type=int, default=None,
                   help="group chunks into at most this many pipeline segments per message "
                   "(faster, less exact); default: every chunk")
    p.add_argument("--policy", default="r2comm", choices=("r2comm", "backup"))
    p.add_argument("--json", action="store_true")
    v = sub.add_parser("validate", help="replay the testbed scenarios of bench/RESULTS.md")
    v.add_argument("--json", default=None)
    v.add_argument("--markdown", default=None)
    w = sub.add_parser("workloads", help="training / decoding scenarios, comparisons, plots")
    w.add_argument("--out", default="bench/out/sim")
    w.add_argument("--figures", default="bench/figures")
    w.add_argument("--quick", action="store_true")
    w.add_argument("--trace", default=None, help="JSON [[t, kind, host, nic, value], ...]: "
                   "replay this fault trace on the training workload instead of the sweeps")
    w.add_argument("--mtbf", type=float, default=None,
                   help="random NIC failures, mean time between failures per NIC (s)")
    w.add_argument("--mttr", type=float, default=60.0, help="repair time with --mtbf (s)")
    w.add_argument("--iterations", type=int, default=40)
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("scale", help="time the simulator itself at growing host counts")
    s.add_argument("--hosts", default="16,64,256")
    s.add_argument("--bytes", default="1G")
    s.add_argument("--algo", default="", help="force an allreduce algorithm ('' = planner)")
    s.add_argument("--segments", type=int, default=None)
    s.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "predict":
            rate = parse_rate(a.rate)
            deg = [(h, k, r if isinstance(r, float) else parse_rate(r) / rate)
                   for h, k, r in a.degrade]
            out = predict(a.hosts, a.nics, rate, parse_size(a.bytes), a.ranks_per_host,
                          a.down, deg, a.op, a.itemsize, a.efficiency, a.alpha,
                          parse_rate(a.intra_bw), parse_rate(a.spine_bw) if a.spine_bw else None,
                          not a.no_replan, a.algo, a.flat, a.segments, a.policy)
            if a.json:
                print(json.dumps(out))
            else:
                sch = out["schedule"]
                print(f"{a.op} of {parse_size(a.bytes)} B on {a.hosts} hosts x {a.nics} NICs: "
                      f"{out['time_s'] * 1e3:.3f} ms with {sch['algo']} "
                      f"({sch['messages']} messages)")
            return 0
        if a.cmd == "validate":
            from .validate import main as vmain
            return vmain(a)
        if a.cmd == "workloads":
            from .workloads import main as wmain
            return wmain(a)
        if a.cmd == "scale":
            from .validate import scale_main
            return scale_main(a)
    except ValueError as e:
        print(f"r2comm.sim: {e}", file=sys.stderr)
        return 2
    return 0
