"""A rank paused (SIGSTOP) and continued on the netns testbed (run by tests/test_pause_testbed.py).

    Fabric.mpiexec(2, [python, tests/pause_worker.py, "pause", key=value ...])

One rank per host streams exact allreduces of `count` float32 (default 1 MiB). `start` s into
the stream the rank named first in `victims` is stopped (SIGSTOP) by the other rank for the
first of `pauses` (seconds), then continued (SIGCONT); the stream runs `after` s, then the next
victim is stopped for the next pause, and so on: several separate pauses in one job, of either
rank. Each rank writes `out`/rank<r>.json: its events, its op count, and the exception it
raised if any (a rank that raises writes it and leaves at once, so the job ends). Each stopper
writes `out`/marks<r>.json (the wall-clock stop and continue times) as it goes.
The test judges every pause on its own from these files.
"""
import json
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, MAX  # noqa: E402
from mpi_worker import WORLD, data, reduce_ref, check, main  # noqa: E402

MAX_OPS = 200_000           # a stream never runs more ops than this, whatever the clock says


def _write(path, payload):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _stopper(me, pids, plan, out):
    """Stop and continue the other rank for each (victim, pause, at) of `plan` whose victim is
    not this rank, at wall-clock time `at`; record each stop and continue in marks<me>.json."""
    marks = []
    for victim, pause, at in plan:
        if victim == me:
            continue
        time.sleep(max(0.0, at - time.time()))
        os.kill(pids[victim], signal.SIGSTOP)
        t_stop = time.time()
        time.sleep(pause)
        os.kill(pids[victim], signal.SIGCONT)
        marks.append({"victim": victim, "pause": pause, "stop": t_stop, "cont": time.time()})
        _write(os.path.join(out, f"marks{me}.json"), marks)


def sc_pause(comm, args):
    """The testbed stream with pauses of either rank (the module docstring); returns 1."""
    n, r = comm.size, comm.rank
    check(n == 2, "the pause scenario runs one rank per host, 2 hosts")
    victims = [int(v) for v in args.get("victims", "1").split(",")]
    pauses = [float(p) for p in args.get("pauses", "3").split(",")]
    check(len(victims) == len(pauses), "one victim per pause")
    start, after = float(args.get("start", 3)), float(args.get("after", 2))
    cnt = int(args.get("count", 1 << 18))
    out = args["out"]
    cases = [f"pause-{k}" for k in range(3)]
    xs = [data(c, r, cnt, "float32", SUM) for c in cases]
    refs = [reduce_ref(c, n, cnt, "float32", SUM) for c in cases]
    y = np.empty_like(xs[0])
    flag, more = np.zeros(1, "int32"), np.zeros(1, "int32")
    pids = WORLD.allgather(os.getpid())
    comm.Allreduce(xs[0], y)                        # warm-up: connections, buffers
    WORLD.Barrier()
    at = WORLD.bcast(time.time() + start)           # the schedule, in wall-clock time (one host)
    plan = []
    for victim, pause in zip(victims, pauses):
        plan.append((victim, pause, at))
        at += pause + after
    t_end = at
    threading.Thread(target=_stopper, args=(r, pids, plan, out), daemon=True).start()
    ops, exc, inexact = 0, None, None
    try:
        while ops < MAX_OPS:
            flag[0] = 1 if time.time() > t_end else 0
            comm.Allreduce(flag, more, MAX)
            if more[0]:
                break
            k = ops % len(cases)
            y.fill(np.float32(-1.0))                # poison: a missing chunk cannot look right
            comm.Allreduce(xs[k], y, SUM)
            if not np.array_equal(y, refs[k]):
                inexact = f"op {ops} at {time.time():.3f} not exact"
                break
            ops += 1
    except r2comm.R2commError as e:
        exc = f"{type(e).__name__}: {e}"
    row = {"rank": r, "ops": ops, "raised": exc, "inexact": inexact, "t_end": time.time(),
           "events": [{k: ev[k] for k in ("t", "kind", "peer", "rail", "detector", "cause", "info")}
                      for ev in comm.events]}
    _write(os.path.join(out, f"rank{r}.json"), row)
    if exc or inexact:
        sys.stdout.flush()
        os._exit(3)                                 # the other rank may wait on us: end the job
    return 1


def sc_selfpause(comm, args):
    """Loopback, 2 ranks, a short operation timeout (`op_timeout`, 2 s, set after start-up so
    that a slow start, as under a sanitizer, is not judged by it): rank 0 waits in an
    allreduce that rank 1 joins late; meanwhile rank 0 is stopped for `stop` s (longer than the
    timeout) and continued, by rank 1 (`who`=peer) or, with every rank stopped at once, by a
    helper process (`who`=both). Rank 0 ran for well under the timeout before rank 1 joined, so
    the allreduce must complete exactly on both ranks: its deadline counts running time, not
    the wall time of its own pause. Prints the elapsed time and each rank's events."""
    import subprocess
    n, r = comm.size, comm.rank
    stop, who = float(args.get("stop", 3)), args.get("who", "peer")
    x = data(f"self-{who}", r, 1 << 16, "float32", SUM)
    ref = reduce_ref(f"self-{who}", n, 1 << 16, "float32", SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)                            # warm-up
    comm.timeout = float(args.get("op_timeout", comm.timeout))
    pids = WORLD.allgather(os.getpid())
    WORLD.Barrier()
    t0 = time.time()
    if r == 1:
        time.sleep(0.3)                             # rank 0 is in the allreduce by now
        if who == "both":                           # everyone stopped at once, then continued
            subprocess.run([sys.executable, "-c",
                            "import os, signal, sys, time\n"
                            "pids = [int(p) for p in sys.argv[2:]]\n"
                            "[os.kill(p, signal.SIGSTOP) for p in pids]\n"
                            "time.sleep(float(sys.argv[1]))\n"
                            "[os.kill(p, signal.SIGCONT) for p in pids]\n",
                            str(stop), *map(str, pids)], timeout=stop + 30, start_new_session=True)
        else:
            os.kill(pids[0], signal.SIGSTOP)
            time.sleep(stop)
            os.kill(pids[0], signal.SIGCONT)
        time.sleep(0.2)
    y.fill(np.float32(-1.0))
    comm.Allreduce(x, y)
    check(np.array_equal(y, ref), f"rank {r}: allreduce across the pause exact")
    took = time.time() - t0
    evs = [(ev["kind"], ev["peer"], ev["rail"]) for ev in comm.events]
    print(f"SELFPAUSE who={who} rank={r} took={took:.2f} events={evs}", flush=True)
    check(took >= stop, f"rank {r}: the pause struck during the allreduce ({took:.2f} s)")
    check(not [e for e in evs if e[0] in ("rail_failed", "peer_lost")],
          f"rank {r}: no rail failed and no peer lost: {evs}")
    return 1


SCENARIOS = {"pause": sc_pause, "selfpause": sc_selfpause}


if __name__ == "__main__":
    _args = dict(a.split("=", 1) for a in sys.argv[2:])
    main(SCENARIOS, default_timeout=60, dump_after=600,
         comm_kwargs={"rails": _args["rails"].split(",")} if "rails" in _args else None)
