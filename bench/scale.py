"""What a rank holds and how long start-up takes as the job grows (issue 31), on loopback.

    python bench/scale.py [--ns 8,16,32,48] [--rails 2] [--hosts 0] [--algo ALGO]
                          [--timeout 240] [--budget 540] [--out DIR]

For each n one mpiexec job of n ranks runs on this machine, shared memory off (R2COMM_SHM=0:
every pair is a network pair, as between hosts) on --rails loopback rails (127.0.0.1,
127.0.0.2, ...); --hosts H sets R2COMM_HOST so that the planner sees H hosts; --algo sets
R2COMM_ALGO for the job (e.g. `ring`; default: the planner's choice, which on this machine is
Rabenseifner's at 1-4 MiB up to 32 ranks and the ring at 48). Each rank measures

  startup_s   its Communicator() (after an MPI barrier: from the same start on every rank)
  startup_cpu_ms  the CPU time its process spent in it (all threads: the n ranks share the cores)
  fds_before  its open fds (/proc/self/fd) before (MPI's, Python's)
  fds_start   the same once the Communicator is built
  fds_mix     the same after a mix: 4 MiB allreduce, 1 MiB bcast, 64 KiB-per-rank
              allgather, 8 B allreduce (mix_algo: the 4 MiB allreduce's algorithm)
  rss_mib     VmRSS after the mix
  pinned_kib  VmPin (memory the kernel holds pinned: verbs registrations; 0 on TCP)
  first_ms    its first 1 MiB allreduce (after a barrier), before the mix
  fds_r2comm  fds_mix - fds_before: what r2comm holds (MPICH's own grow with the rank's number)
  rails_down  (peer, rail) connections that did not come up at start-up (should be 0)

Rank 0 gathers the rows; the driver prints per n the median and the maximum over ranks, next to
the full-mesh model's fds for that n (model() below), then the model extrapolated to 1,024
ranks x 8 NICs (TCP and verbs). Writes DIR/scale.json (default bench/out). A job that fails or
runs past --timeout is reported and the sweep goes on; n that would start after --budget
seconds are skipped (said so)."""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
VERBS_POOL = (64 + 32) * 64 * 1024   # a verbs device's registered slot pool (the defaults: 64
                                     # receive slots in its SRQ + 32 send slots of 64 KiB,
                                     # R2COMM_VERBS_RECV_SLOTS/_SEND_SLOTS, verbs_transport.pxi),
                                     # shared by all its QPs: pinned per rank = nics x VERBS_POOL
QP_SLAB = (16 + 32) * 64 * 1024      # before the pools: a registered slab per QP (16 send +
                                     # 32 receive slots of 64 KiB)
VERBS_RAIL_FDS = 3                   # side socket, completion channel, epoll fd (VerbsTransport.rail_fds)
ENGINE_FDS = 3                       # the engine's own (epoll and wake-up fds; measured)
DETECTOR_FDS = 6   # the failure detector: r2comm.control.liveness.STEADY_FDS (test_scale_bench)


# -- the full-mesh model -----------------------------------------------------------------------
def model(n, nics, transport="tcp", base_fds=0, slab_per_qp=False):
    """What a rank holds in today's full mesh of n ranks with `nics` rails: fds (one socket per
    peer and rail, a verbs rail 3, plus one control connection per peer and the listeners),
    verbs QPs, and the registered slot pools (bytes: one per device, shared by its QPs, so
    independent of n; slab_per_qp: a slab per QP, as before issue 31), on top of base_fds (MPI,
    Python) and the engine's own few."""
    peers = n - 1
    per_rail = VERBS_RAIL_FDS if transport == "verbs" else 1
    qps = peers * nics if transport == "verbs" else 0
    pinned = (qps * QP_SLAB if slab_per_qp else nics * VERBS_POOL) if transport == "verbs" else 0
    return {"n": n, "nics": nics, "transport": transport,
            "fds": base_fds + ENGINE_FDS + DETECTOR_FDS + peers * (nics * per_rail + 1) + nics + 1,
            "qps": qps, "pinned_bytes": pinned}


def on_demand_peers(n):
    """The peers a rank connects with connections on demand (links.connect_for) once it ran the
    usual plans, shared memory off: its ring neighbours (start-up, ring plans), its binary
    tree's parent and two children (bcast, reduce: algorithms.binary_tree) and its log2 n
    partners of recursive doubling / halving (small allreduces, barrier), at most n - 1."""
    return min(n - 1, 2 + 3 + max(0, math.ceil(math.log2(n))))


def model_on_demand(n, nics, transport="tcp"):
    """What a rank holds with connections on demand (on_demand_peers), as model() does for the
    full mesh."""
    peers = on_demand_peers(n)
    per_rail = VERBS_RAIL_FDS if transport == "verbs" else 1
    qps = peers * nics if transport == "verbs" else 0
    return {"n": n, "nics": nics, "transport": transport, "peers": peers,
            "fds": ENGINE_FDS + DETECTOR_FDS + peers * (nics * per_rail + 1) + nics + 1,
            "qps": qps, "pinned_bytes": nics * VERBS_POOL if transport == "verbs" else 0}


def model_table(ns=(8, 48, 64, 256, 1024), nics=8):
    rows = [model(n, nics, t, slab_per_qp=True) for t in ("tcp", "verbs") for n in ns]
    lines = [f"full-mesh model per rank before issue 31 (a slab per QP), {nics} NICs (fds without "
             "MPI's and Python's own):",
             f"{'transport':>9} {'ranks':>6} {'fds':>8} {'verbs QPs':>10} {'pinned':>10}"]
    for r in rows:
        lines.append(f"{r['transport']:>9} {r['n']:>6} {r['fds']:>8} {r['qps']:>10} "
                     f"{r['pinned_bytes'] / 2**20:>8.0f} MiB")
    lazy = [model_on_demand(n, nics, t) for t in ("tcp", "verbs") for n in ns]
    lines += [f"connections-on-demand model per rank, pooled verbs slots, {nics} NICs:",
              f"{'transport':>9} {'ranks':>6} {'peers':>6} {'fds':>8} {'verbs QPs':>10} "
              f"{'pinned':>10}"]
    for r in lazy:
        lines.append(f"{r['transport']:>9} {r['n']:>6} {r['peers']:>6} {r['fds']:>8} "
                     f"{r['qps']:>10} {r['pinned_bytes'] / 2**20:>8.0f} MiB")
    return ([dict(r, model="full_mesh") for r in rows] +
            [dict(r, model="on_demand") for r in lazy]), "\n".join(lines)


def synthetic_records(n, nics=8, per_host=8):
    """n ranks' start-up endpoint records as the Iallgather delivers them (JSON bytes; the
    fields of bootstrap.run's record), per_host ranks to a host, nics rails each."""
    recs = []
    for r in range(n):
        h = r // per_host
        ip = f"{h // 250 % 250}.{h % 250 + 1}"
        recs.append(json.dumps({
            "rails": [[f"198.{18 + k % 2}.{ip}", 40000 + r % 20000] for k in range(nics)],
            "transport": ["auto", "tcp", "no verbs device"], "ctrl": [f"198.19.{ip}", 30000],
            "host": f"node{h:05d}", "host_key": f"{h:032x}", "pid": 1000 + r,
            "shm": f"{h:016x}", "check": "0123456789abcdef" * 2,
            "params": {"chunk_size": 524288, "acks": True, "integrity": "checksum"},
            "detector": [f"198.19.{ip}", 20000],
            "fds": [40, 1 << 20, 1 << 20]}, separators=(",", ":")).encode())
    return recs


def records_cost(ns=(1024, 8192), nics=8, per_host=8, me=5):
    """The CPU one rank spends on the n start-up records (the part of start-up that grows with
    n; the three collectives take log2 n rounds): decoded, validated, the fd budgets judged,
    its local peers, the communicator's topology and the peers' addresses. -> rows of n, ms,
    us per rank, record bytes per rank. Measured here, in one process."""
    from r2comm.control import bootstrap, fdlimit
    from r2comm.front import railview
    from r2comm.control import links
    from r2comm.transport import shm
    rows = []
    for n in ns:
        raw = synthetic_records(n, nics, per_host)
        c0 = time.process_time()
        eps = bootstrap.validate_endpoints([json.loads(b) for b in raw], n)
        fdlimit.check(eps, "tcp", me)
        shm.local_peers(eps, me)
        railview.topology(eps, list(range(n)))
        links.start_peers(eps, me)
        cpu = time.process_time() - c0
        rows.append({"n": n, "nics": nics, "ms": cpu * 1e3, "us_per_rank": cpu * 1e6 / n,
                     "record_bytes": sum(len(b) for b in raw)})
    return rows


# -- one rank ----------------------------------------------------------------------------------
def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _fds():
    return len(os.listdir("/proc/self/fd")) - 1


def _mix(comm, np):
    """Ring-size allreduce, bcast, allgather and a small allreduce; every result checked."""
    n, r = comm.size, comm.rank
    x = np.full(MIB, r + 1, np.float32)                       # 4 MiB
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    assert y[0] == n * (n + 1) / 2 and y[-1] == y[0], "allreduce"
    b = np.full(MIB // 4, r, np.float32)
    comm.Bcast(b, root=0)
    assert b[0] == 0 and b[-1] == 0, "bcast"
    g = np.full(16384, r, np.float32)
    out = np.empty(16384 * n, np.float32)
    comm.Allgather(g, out)
    assert all(out[k * 16384] == k for k in range(n)), "allgather"
    s = np.array([1.0])
    t = np.empty_like(s)
    comm.Allreduce(s, t)
    assert t[0] == n, "small allreduce"
    return comm.schedule("allreduce", x.nbytes, 4).algo


def rank_main(a):
    import numpy as np
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if a.hosts:
        os.environ["R2COMM_HOST"] = f"h{world.rank * a.hosts // world.size}"
    import importlib
    import r2comm
    importlib.import_module("r2comm._core.engine")    # loaded now: not start-up's cost
    for mod in ("r2comm.communicator", "r2comm.control.tree", "r2comm.control.bandwidth"):
        importlib.import_module(mod)                  # nor compiling r2comm's sources (no .pyc
                                                      # under PYTHONDONTWRITEBYTECODE: ~60 ms
                                                      # of CPU per rank, n ranks on few cores)
    fds_before = _fds()
    world.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    comm = r2comm.Communicator(world, timeout=a.timeout)
    row = {"rank": comm.rank, "startup_s": time.perf_counter() - t0,
           "startup_cpu_ms": (time.process_time() - c0) * 1e3, "fds_before": fds_before,
           "fds_start": _fds()}
    row["rails_down"] = sum(ra.peers - ra.peers_up for ra in comm.rails)
    x = np.ones(MIB // 4, np.float32)
    y = np.empty_like(x)
    world.Barrier()
    t0 = time.perf_counter()
    comm.Allreduce(x, y)
    row["first_ms"] = (time.perf_counter() - t0) * 1e3
    assert y[0] == comm.size, "first allreduce"
    row["mix_algo"] = _mix(comm, np)
    row.update(fds_mix=_fds(), rss_mib=_status_kib("VmRSS") / 1024,
               pinned_kib=_status_kib("VmPin"))
    row["fds_r2comm"] = row["fds_mix"] - fds_before
    rows = world.gather(row, root=0)
    comm.Free()
    if world.rank == 0:
        Path(a.json).write_text(json.dumps(rows))


# -- the driver --------------------------------------------------------------------------------
def _mpiexec():
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.exists() else "mpiexec"


def run_job(n, a, json_path):
    """One n-rank job; -> (rows or None, why not)."""
    env = dict(os.environ, R2COMM_SHM="0", MPIEXEC_TIMEOUT=str(a.timeout), R2COMM_ALGO=a.algo,
               R2COMM_RAILS=",".join(f"127.0.0.{k + 1}" for k in range(a.rails)),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [_mpiexec(), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--rank",
           "--json", str(json_path), "--timeout", str(a.timeout), "--hosts", str(a.hosts)]
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=a.timeout + 30)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {a.timeout + 30} s"
    if p.returncode != 0 or not json_path.exists():
        return None, f"rc {p.returncode}: {p.stdout[-1500:]}"
    return json.loads(json_path.read_text()), ""


def summary(n, rows, rails):
    """Median and maximum over ranks of every measured field, and the model's fds (r2comm's)."""
    out = {"n": n, "ranks": len(rows), "model_fds": model(n, rails)["fds"],
           "on_demand_fds": model_on_demand(n, rails)["fds"],
           "mix_algo": sorted({r["mix_algo"] for r in rows})}
    for key in ("startup_s", "startup_cpu_ms", "fds_before", "fds_start", "fds_mix", "fds_r2comm", "rss_mib", "pinned_kib", "first_ms",
                "rails_down"):
        vals = [r[key] for r in rows]
        out[key] = {"median": statistics.median(vals), "max": max(vals)}
    return out


def table(summaries):
    head = (f"{'ranks':>5} {'start-up s':>13} {'fds start':>11} {'fds mix':>11} "
            f"{'r2comm fds':>11} {'model':>6} "
            f"{'RSS MiB':>13} {'pinned':>7} {'first 1 MiB ms':>15} {'down':>5}")
    lines = ["per rank: median / max over ranks (r2comm fds: after the mix less before the "
             "Communicator; model: today's full mesh)", head]
    for s in summaries:
        def mm(k, f):
            return f"{s[k]['median']:{f}}/{s[k]['max']:{f}}"
        lines.append(f"{s['n']:>5} {mm('startup_s', '.2f'):>13} {mm('fds_start', '.0f'):>11} "
                     f"{mm('fds_mix', '.0f'):>11} {mm('fds_r2comm', '.0f'):>11} {s['model_fds']:>6} {mm('rss_mib', '.0f'):>13} "
                     f"{s['pinned_kib']['max']:>7.0f} {mm('first_ms', '.1f'):>15} "
                     f"{s['rails_down']['max']:>5}")
    return "\n".join(lines)


def driver(a):
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = [int(x) for x in a.ns.split(",") if x.strip()]
    started = time.monotonic()
    summaries, skipped = [], {}
    loads = []
    for n in ns:
        loads.append(os.getloadavg()[0])
        if time.monotonic() - started > a.budget:
            skipped[n] = f"over the --budget of {a.budget} s"
            continue
        rows, why = run_job(n, a, out / f"scale_n{n}.json")
        if rows is None:
            skipped[n] = why
            print(f"n={n}: no result: {why}", flush=True)
            continue
        summaries.append(summary(n, rows, a.rails))
        print(table(summaries[-1:]).splitlines()[-1], flush=True)
    models, text = model_table()
    records = records_cost()
    text += "\nstart-up records per rank (8 NICs, 8 ranks a host; CPU here, one process):\n" + \
        "\n".join(f"{r['n']:>6} ranks: {r['ms']:.0f} ms ({r['us_per_rank']:.0f} us a rank), "
                  f"{r['record_bytes'] / 2**20:.2f} MiB of records" for r in records)
    report = {"config": {"ns": ns, "rails": a.rails, "hosts": a.hosts, "shm": 0, "algo": a.algo,
                         "argv": sys.argv[1:]},
              "command": " ".join(["python", "bench/scale.py", *sys.argv[1:]]),
              "loadavg": loads, "cpus": os.cpu_count(), "time": time.time(),
              "summaries": summaries, "skipped": skipped, "model_1024": models,
              "records_cost": records}
    (out / "scale.json").write_text(json.dumps(report, indent=1))
    try:                                  # the figure RESULTS.md shows (matplotlib optional)
        from r2comm.bench.plot import plot_scale
        plot_scale(report, out / "scale.png")
    except ImportError as exc:
        print(f"no scale.png: {exc}")
    print(table(summaries))
    for n, why in skipped.items():
        print(f"n={n} skipped: {why}")
    print(text)
    print(f"wrote {out / 'scale.json'}")
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default="8,16,32,48", help="rank counts, comma-separated")
    p.add_argument("--rails", type=int, default=2, help="loopback rails per rank")
    p.add_argument("--hosts", type=int, default=0, help="emulated hosts (R2COMM_HOST), 0: off")
    p.add_argument("--algo", default="", help="R2COMM_ALGO for the job (default: the planner's)")
    p.add_argument("--timeout", type=int, default=240, help="s per job")
    p.add_argument("--budget", type=float, default=540, help="s: no job starts after this")
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank:
        rank_main(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
