#!/usr/bin/env python3
"""Same-job A/B of r2comm settings: the tool behind the engine's tuning claims.

    mpiexec -n 2 python bench/ab_settings.py --size 4M --rounds 11 "" "R2COMM_CHUNK_SIZE=1M"
    mpiexec -n 2 python bench/ab_settings.py --size 16M --order rev "" "R2COMM_ACKS=0"
    mpiexec -n 2 python bench/ab_settings.py --size 4M "" "engine.tuning.spin_extend=0"

Each argument is one variant: `;`-separated `NAME=VALUE` items. `R2COMM_*` items are set in
the environment while that variant's Communicator is built. `engine.PATH=INT` items set an
attribute under the Engine afterwards, by its dotted path (the spin policy's knobs are the
engine's tuning: engine.tuning.spin_extend, spin_yield, spin_adapt). `package=NAME` builds
it from another importable copy of r2comm (another build of the engine, e.g. main's tree copied
as package `r2base`, see bench/ab_builds.sh): two builds compared in the same job. The variants and
mpi4py's Allreduce (on a Dup of COMM_WORLD) run in rounds, one after another in a rotated
order, with a fixed iteration count per round. Each variant's time per call is printed, with
the median over rounds of MPI's time / its time in the same round. The median over rounds of
the first variant's time / the second's is printed too. The machine's speed drifts between
rounds, and paired ratios cancel that.

The first communicator built in a job runs 1-2% slower than a second identical one (A/A at
16 MiB), so run both `--order fwd` and `--order rev` before believing a few %.
"""
import argparse
import importlib
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import r2comm
from r2comm.bench.osu import polite_barrier
from r2comm.bench.peers import temporary_env
from r2comm.bench.sizes import parse_size


def parse_variant(text):
    env, attrs = {}, {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"variant item {item!r}: expected NAME=VALUE")
        if name == "package":
            attrs[name] = value
        elif name.startswith("engine."):
            attrs[name[len("engine."):]] = int(value)
        elif name.startswith("R2COMM_"):
            env[name] = value
        else:
            raise SystemExit(f"variant item {item!r}: expected R2COMM_* or engine.PATH")
    return env, attrs


def build(world, env, attrs):
    attrs = dict(attrs)
    pkg = importlib.import_module(attrs.pop("package")) if "package" in attrs else r2comm
    with temporary_env(env):
        comm = pkg.Communicator(world)
    for k, v in attrs.items():
        *path, name = k.split(".")
        obj = comm.channel.engine
        for part in path:
            obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, name):
            raise SystemExit(f"Engine has no attribute {k!r}")
        setattr(obj, name, v)
    return comm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="';'-separated NAME=VALUE items ('' = defaults)")
    p.add_argument("--size", default="4M", help="allreduce bytes (float32), K/M suffixes")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--seconds", type=float, default=0.2, help="target seconds per measurement")
    p.add_argument("--order", choices=("fwd", "rev"), default="fwd", help="build order of the variants")
    p.add_argument("--barrier", action="store_true", help="a barrier between calls, as the harness does")
    p.add_argument("--json", help="write the per-round times here (rank 0)")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    variants = [parse_variant(v) for v in args.variants]
    comms = [None] * len(variants)
    order = range(len(variants)) if args.order == "fwd" else reversed(range(len(variants)))
    for i in order:
        comms[i] = build(world, *variants[i])
    mpi = world.Dup()
    n = max(1, parse_size(args.size) // 4)
    send = (np.arange(n) % 7).astype(np.float32)
    recv = np.empty_like(send)
    libs = [(f"v{i}", (lambda c: lambda: c.Allreduce(send, recv))(c)) for i, c in enumerate(comms)]
    libs.append(("mpi", lambda: mpi.Allreduce(send, recv)))

    def timed(f, iters):
        if args.barrier:
            total = 0.0
            polite_barrier(world)
            for _ in range(iters):
                t = time.perf_counter()
                f()
                total += time.perf_counter() - t
                polite_barrier(world)
            return world.allreduce(total / iters, op=MPI.MAX)
        world.Barrier()
        t = time.perf_counter()
        for _ in range(iters):
            f()
        return world.allreduce((time.perf_counter() - t) / iters, op=MPI.MAX)

    for _, f in libs:
        for _ in range(5):
            f()
    slowest = max(timed(f, 3) for _, f in libs)
    iters = max(3, min(10000, int(args.seconds / max(slowest, 1e-7))))
    rounds = {k: [] for k, _ in libs}
    for r in range(args.rounds):
        k0 = r % len(libs)
        for k, f in libs[k0:] + libs[:k0]:
            rounds[k].append(timed(f, iters) * 1e6)
    if world.rank == 0:
        mpi_t = np.array(rounds["mpi"])
        print(f"# {args.size} allreduce, {world.size} ranks, {args.rounds} rounds x {iters} calls, "
              f"build order {args.order}{', barrier between calls' if args.barrier else ''}")
        for i, text in enumerate(args.variants):
            t = np.array(rounds[f"v{i}"])
            print(f"v{i} {text or '(defaults)'!s:40} {np.median(t):10.1f} us   "
                  f"mpi/v{i} per round: median {np.median(mpi_t / t):.3f} "
                  f"[{(mpi_t / t).min():.2f}, {(mpi_t / t).max():.2f}]")
        print(f"mpi {'':40} {np.median(mpi_t):10.1f} us")
        if len(variants) > 1:
            ratio = np.array(rounds["v0"]) / np.array(rounds["v1"])
            print(f"v0/v1 time per round: median {np.median(ratio):.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"variants": args.variants, "iters": iters, "rounds_us": rounds}, fh)
    for c in comms:
        c.Free()
    mpi.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
