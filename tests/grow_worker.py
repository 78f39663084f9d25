"""One process of a job that loses a rank and grows back, cycle after cycle (tests/test_grow.py,
issue 44 item 2).

usage: grow_worker.py DIR SIZE start RANK      a rank of the first job
       grow_worker.py DIR SIZE join CYCLE      the replacement started for cycle CYCLE
The processes meet through a DirStore in DIR/store (no MPI). DIR/plan.json: {"cycles":
[victim rank, ...], "timeout": s, "state": elements}. In cycle k every rank of the current
communicator loops an allreduce until it raises; the cycle's victim (a rank of it) SIGKILLs
itself inside that loop (writing DIR/kill.<k> first, so the harness starts the replacement).
The survivors Revoke, Shrink, check an allreduce on the shrunk communicator, then Grow it by one
rank (prefix "grow-<k>") while the replacement joins; rank 0 sends the model state (a Bcast of
`state` float64 elements) and every rank checks an exact allreduce on the grown communicator.
The communicators left behind are freed. Each process writes DIR/res.<tag>.json (tag: its first
rank, or "j<cycle>") after every cycle: per cycle its rank, the members' tags, the grow time,
the checks; and what it holds (threads, fds, shared-memory segments) before its first
communicator, after the first cycle, after the last, and once it freed every communicator."""
import json
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control.bootstrap_store import DirStore  # noqa: E402
from shrink_worker import failed, held, write  # noqa: E402  (what a rank holds; results)

N = 4096


def fd_kinds():
    """{what an open fd is (socket, eventfd, a file): how many}."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            what = os.readlink(f"/proc/self/fd/{fd}").split("[")[0].split(":")[0]
        except OSError:
            continue
        out[what] = out.get(what, 0) + 1
    return out


def sockets():
    """The sockets this process holds: TCP as (local port, remote port, state), unix ones (what
    a failed leak check shows)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    out = []
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6", "/proc/self/net/unix"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            c = row.split()
            if "unix" in name:
                if len(c) > 6 and c[6] in inodes:
                    out.append(("unix", c[-1] if len(c) > 7 else ""))
            elif c[9] in inodes:
                out.append((int(c[1].split(":")[1], 16), int(c[2].split(":")[1], 16), c[3]))
    return out


def exact(comm, salt):
    """An allreduce on `comm` checked bit for bit: each rank adds (its rank + salt)."""
    x = np.full(N, comm.rank + salt, np.int64)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    want = sum(r + salt for r in range(comm.size))
    return bool((y == want).all())


def loop_until_error(comm, victim, d, k, timeout):
    """Allreduces until one raises; the victim kills itself 0.2 s in."""
    if comm.rank == victim:
        def die():
            time.sleep(0.2)
            with open(os.path.join(d, f"kill.{k}"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    x, y = np.ones(N), np.empty(N)
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            comm.Allreduce(x, y)
        except r2comm.R2commError as exc:
            return type(exc).__name__
    raise RuntimeError("no rank died within the timeout")


def main():
    d, size, mode, arg = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    with open(os.path.join(d, "plan.json")) as f:
        plan = json.load(f)
    timeout, cycles = float(plan["timeout"]), plan["cycles"]
    store = DirStore(os.path.join(d, "store"), timeout=60)
    tag = str(arg) if mode == "start" else f"j{arg}"
    res = {"tag": tag, "cycles": [], "held_base": held()}     # before any communicator
    try:
        if mode == "start":
            comm = r2comm.Communicator.from_store(store, arg, size, timeout=timeout)
            first = 0
        else:
            res["t_start"] = time.time()
            comm = r2comm.Communicator.join(store, prefix=f"grow-{arg}", timeout=timeout)
            res["t_grown"] = time.time()
            first = arg + 1
            state = np.empty(plan["state"], np.float64)
            comm.Bcast(state, root=0)
            res["t_state"] = time.time()
            want = np.arange(plan["state"], dtype=np.float64) * (arg + 1)
            res["state_ok"] = bool(np.array_equal(state, want))
            res["grown_exact"] = exact(comm, arg)
        worlds = [comm]                      # communicators to free once a cycle is over
        for k in range(first, len(cycles)):
            rec = {"cycle": k, "rank_before": comm.rank}
            rec["error"] = loop_until_error(comm, cycles[k], d, k, timeout)
            comm.Revoke()
            small = comm.Shrink()
            rec["shrunk_size"], rec["shrunk_exact"] = small.size, exact(small, 100 + k)
            t0 = time.monotonic()
            big = small.Grow(store, 1, prefix=f"grow-{k}", timeout=timeout)
            rec["grow_s"] = time.monotonic() - t0
            rec["t_shrunk"], rec["t_grown"] = time.time() - rec["grow_s"], time.time()
            state = np.arange(plan["state"], dtype=np.float64) * (k + 1) if big.rank == 0 \
                else np.empty(plan["state"], np.float64)
            big.Bcast(state, root=0)
            rec["t_state"] = time.time()
            rec["state_ok"] = bool(np.array_equal(
                state, np.arange(plan["state"], dtype=np.float64) * (k + 1)))
            rec["grown"] = [big.rank, big.size]
            rec["grown_exact"] = exact(big, k)
            t0 = time.monotonic()
            small.Free()
            for w in worlds:                 # the old world: its dead rank cannot answer
                w.Free()
            rec["free_s"] = time.monotonic() - t0
            comm, worlds = big, [big]
            if k == first:
                res["held_first"] = held()
                res["fds_first"] = fd_kinds()
            res["cycles"].append(rec)
            write(d, tag, res)
        res["held_last"] = held()
        res["fds_last"] = fd_kinds()
        comm.Barrier()
        comm.Free()
        res["held_end"] = held()             # every communicator freed
        res["fds_end"] = fd_kinds()
        res["sockets_end"] = sockets()
        res["done"] = True
        write(d, tag, res)
        until = time.monotonic() + 15        # leave once every rank is done (an exit is a death)
        while time.monotonic() < until and not all(
                os.path.exists(os.path.join(d, f"done.{r}")) for r in range(comm.size)
                if r != comm.rank):
            open(os.path.join(d, f"done.{comm.rank}"), "w").close()
            time.sleep(0.02)
    except BaseException:
        failed(d, tag, res)
        raise
    os._exit(0)


if __name__ == "__main__":
    main()
