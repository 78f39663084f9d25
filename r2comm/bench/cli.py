"""Command line of ``python -m r2comm.bench`` (run it under mpiexec).

    mpiexec -n 2 python -m r2comm.bench allreduce -m 8:64M --peer mpi,gloo --check
    mpiexec -n 2 python -m r2comm.bench latency -f
    mpiexec -n 2 python -m r2comm.bench failover --fail-at 1 --rail 0 --mode silent
    python -m r2comm.bench plot a.json b.json -o busbw.png
    python -m r2comm.bench results bench/out -o bench/RESULTS.md

Any exception on one rank aborts the whole job (MPI_Abort): the other ranks
would otherwise wait forever in the next collective.
"""
import argparse
import sys
import traceback

from .data import COLLECTIVES, DTYPES, OPS, P2P_DTYPES
from .sizes import parse_range, parse_size

DEFAULT_RANGE = {"latency": (1, 1 << 20), "bw": (1, 4 << 20)}  # collectives: 8 B .. 1 MiB
HELP = {
    "allreduce": "Allreduce latency / algbw / busbw",
    "allgather": "Allgather latency / algbw / busbw",
    "reduce_scatter": "Reduce_scatter_block latency / algbw / busbw",
    "bcast": "Bcast latency / algbw / busbw",
    "alltoall": "Alltoall latency / algbw / busbw",
    "gather": "Gather latency / algbw / busbw",
    "scatter": "Scatter latency / algbw / busbw",
    "allgatherv": "Allgatherv (equal counts) latency / algbw / busbw",
    "alltoallv": "Alltoallv (equal counts) latency / algbw / busbw",
    "scan": "Scan latency / algbw",
    "latency": "ping-pong latency between ranks 0 and 1 (Send/Recv)",
    "bw": "streaming bandwidth from rank 0 to rank 1 (window of messages)",
}


def _common(p, kind):
    p.add_argument("-m", "--message-size", type=parse_range, metavar="[MIN:]MAX",
                   help="size range in bytes, suffixes K/M/G (default %s)"
                   % ("8:1M" if kind in COLLECTIVES else "1:%s" % {"latency": "1M", "bw": "4M"}[kind]))
    p.add_argument("-i", "--iterations", type=int, default=1000, help="max timed iterations (default 1000)")
    p.add_argument("-x", "--warmup", type=int, default=10, help="max warm-up iterations (default 10)")
    p.add_argument("-f", "--full", action="store_true", help="also print min/max latency and iterations")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats, median reported (default 3)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="target seconds per measurement, limits iterations (0: exactly -i/-x)")
    p.add_argument("--check", action="store_true", help="validate every result against numpy")
    p.add_argument("--peer", action="append", metavar="mpi|gloo|r2comm-noack|none",
                   help="also run these libraries, interleaved (repeatable or comma list); "
                        "r2comm-noack: r2comm without acknowledgements (benchmark only)")
    p.add_argument("--no-r2comm", action="store_true", help="benchmark the peers only")
    p.add_argument("--r2comm-last", action="store_true",
                   help="build r2comm's communicator after the peers' (for r2comm-noack: "
                        "the first communicator built in a job runs slightly slower)")
    p.add_argument("--gloo-addr", default="127.0.0.1", help="Gloo rendezvous address (rank 0's)")
    p.add_argument("--dtype", choices=DTYPES if kind in COLLECTIVES else P2P_DTYPES,
                   default="float32" if kind in COLLECTIVES else "uint8")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw (or latency/bandwidth) vs size")
    p.set_defaults(func=sweep_cmd, kind=kind)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m r2comm.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for kind in COLLECTIVES + ("latency", "bw"):
        p = sub.add_parser(kind, help=HELP[kind])
        _common(p, kind)
        if kind in ("allreduce", "reduce_scatter", "scan"):
            p.add_argument("--op", choices=sorted(OPS), default="sum")
        if kind in ("bcast", "gather", "scatter"):
            p.add_argument("--root", type=int, default=0)
        if kind == "bw":
            p.add_argument("--window", type=int, default=64, help="messages in flight (default 64)")

    f = sub.add_parser("failover", help="allreduce stream with a rail failed midway")
    f.add_argument("--size", type=parse_size, default=4 << 20, help="bytes per allreduce (default 4M)")
    f.add_argument("--dtype", choices=DTYPES, default="float32")
    f.add_argument("--duration", type=float, default=5.0, help="seconds of streaming (default 5)")
    f.add_argument("--max-ops", type=int, default=100000, help="upper bound on allreduces")
    f.add_argument("-x", "--warmup", type=int, default=5, help="untimed allreduces first")
    f.add_argument("--fail-at", type=float, default=1.0, help="seconds after start (default 1)")
    f.add_argument("--rail", type=int, default=0, help="rail index to fail (default 0)")
    f.add_argument("--mode", choices=("hard", "silent"), default="hard",
                   help="hard: connection error; silent: bytes stop, no error")
    f.add_argument("--fail-rank", type=int, default=0, help="rank that injects the fault")
    f.add_argument("--fail-peer", type=int, default=None, help="fail only the link to this peer")
    f.add_argument("--restore-at", type=float, default=None, help="restore the rail at this time")
    f.add_argument("--no-inject", action="store_true",
                   help="inject nothing: a NIC is taken down externally (testbed)")
    f.add_argument("--sample-ms", type=float, default=10.0, help="rail counter sampling period")
    f.add_argument("--stall-timeout", type=float, default=30.0,
                   help="abort when no op completes for this long (0: never)")
    f.add_argument("--check", action="store_true", help="validate every allreduce result")
    f.add_argument("--json", metavar="FILE")
    f.add_argument("--plot", metavar="FILE.png", default="failover.png",
                   help="timeline PNG (default failover.png; '' for none)")
    f.set_defaults(func=failover_cmd)

    p = sub.add_parser("plot", help="plot one or more --json results together")
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png")
    p.set_defaults(func=None)

    r = sub.add_parser("results", help="write bench/RESULTS.md from the JSON files of bench/run_all.sh")
    r.add_argument("folder", nargs="?", default="bench/out", help="run_all.sh's output (default bench/out)")
    r.add_argument("-o", "--output", default="bench/RESULTS.md", help="Markdown file (default bench/RESULTS.md)")
    r.add_argument("--elapsed", type=float, metavar="S", help="seconds the benchmarks took (reported)")
    r.add_argument("--no-figures", action="store_true",
                   help="do not copy the PNGs it shows into figures/ next to the output")
    r.set_defaults(func=None)
    return parser


def sweep_cmd(args, comm_world, argv):
    """Size sweep of one collective / latency / bw over r2comm and the peers."""
    from . import osu
    from .peers import open_libraries, parse_peers
    from .report import Table, document, metrics, summary_lines, write_json
    from .sizes import sweep

    world = comm_world.Dup()  # the harness's barriers and reductions never mix with a library's
    kind = args.kind
    lo, hi = args.message_size or (None, None)
    d_lo, d_hi = DEFAULT_RANGE.get(kind, (8, 1 << 20))
    sizes = sweep(d_lo if lo is None else lo, d_hi if hi is None else hi)
    settings = osu.Settings(iters=args.iterations, warmup=args.warmup, rounds=args.rounds,
                            budget=args.budget, check=args.check)
    if kind in COLLECTIVES:
        bench = osu.Collective(kind, world, args.dtype, getattr(args, "op", "sum"),
                               getattr(args, "root", 0), args.check)
    elif kind == "latency":
        bench = osu.PingPong(world, args.dtype, args.check)
    else:
        bench = osu.Stream(world, args.dtype, args.check, args.window)

    libs = open_libraries(comm_world, not args.no_r2comm, parse_peers(args.peer), args.gloo_addr,
                          r2comm_last=args.r2comm_last)
    labels = [lib.label for lib in libs]
    table = None
    if world.rank == 0:
        table = Table(kind, labels, args.full)
        lines = summary_lines(kind, world.size, labels, args.dtype, getattr(args, "op", None),
                              settings, bench.factor)
        if libs[0].name == "r2comm":
            rails = libs[0].describe()["rails"]
            lines.append("r2comm rails: " + ", ".join(f"{r['index']}:{r['address']}" for r in rails))
        table.header(lines)

    def on_size(case, results):
        if table:
            table.row([metrics(bench, r) for r in results])

    raw = osu.sweep(bench, libs, sizes, settings, on_size)
    described = [{"name": lib.name, "label": lib.label, "built": getattr(lib, "built", None),
                  **lib.describe()} for lib in libs]
    for lib in libs:
        lib.close()
    if world.rank == 0:
        rows = {label: [metrics(bench, r) for r in results] for label, results in raw.items()}
        extra = {"dtype": args.dtype, "op": getattr(args, "op", None), "factor": bench.factor}
        if kind == "bw":
            extra["window"] = args.window
        doc = document(kind, argv, world.size, described, settings, rows, extra)
        if args.json:
            write_json(args.json, doc)
        if args.plot:
            from .plot import plot_sweep
            plot_sweep([doc], args.plot)
            print(f"# plot written to {args.plot}", flush=True)
    world.Free()
    return 0


def failover_cmd(args, comm_world, argv):
    from .failover import run
    world = comm_world.Dup()
    if world.size < 2:
        raise ValueError("failover needs at least 2 ranks")
    if not args.no_inject and not 0 <= args.fail_rank < world.size:
        raise ValueError(f"--fail-rank {args.fail_rank} is not a rank of this {world.size}-rank job")
    rc = run(args, world, argv)
    world.Free()
    return rc


def plot_cmd(args):
    import json
    import os
    from .plot import plot_sweep
    docs = []
    for path in args.files:
        with open(path) as f:
            docs.append(json.load(f))
    plot_sweep(docs, args.output, names=[os.path.splitext(os.path.basename(p))[0] for p in args.files])
    print(f"# plot written to {args.output}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.cmd == "plot":
        return plot_cmd(args)
    if args.cmd == "results":  # no MPI: reads JSON files only
        from .results import results_cmd
        return results_cmd(args)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    try:
        return args.func(args, world, argv)
    except Exception:
        sys.stdout.flush()
        print(f"# rank {world.rank}: ", end="", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        if world.size > 1:
            world.Abort(2)
        return 2
