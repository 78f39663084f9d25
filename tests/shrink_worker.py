"""One rank of a job that loses ranks and goes on (tests/test_shrink.py, bench/shrink.py).

usage: shrink_worker.py DIR RANK SIZE
The ranks meet through a DirStore in DIR/store (no MPI: a survivor must outlive a dead rank).
DIR/plan.json (the same for every rank) lists rounds; in each round every rank of the current
communicator loops the round's collective until it raises (a victim SIGKILLs itself, from a
thread, `delay` s into the loop: somewhere inside a collective), then every survivor revokes,
agrees and shrinks; victims marked "agree" or "shrink" die `delay` s after entering that call
(or, where the timer comes late, as the Shrink returns).
A shrunk communicator whose first allreduce fails (a rank died after the agreement) is revoked
and shrunk again, at most RETRIES times. Each rank writes DIR/res.<rank>.json after every
round (atomically) and DIR/err.<rank> with a traceback if it fails.

plan.json: {"timeout": s, "rounds": [{"coll": "allreduce", "victims": [[rank, "coll"|"agree"|
"shrink", delay], ...]}, ...], "revoke_test": bool, "nic": [rank, bytes], "cycles": K,
"nonblocking": bool}. nonblocking: the survivors call Iagree and Ishrink (then Wait).
nic: that rank's rail 0 fails (hard, injected) once it sent that many more bytes (a NIC failure
in the same run as the deaths). cycles: after the rounds, K shrinks with nobody failing, each
followed by an exact allreduce and a Free of the communicator before (what a rank holds is
recorded: threads, fds, shared-memory segments). revoke_test: before the rounds, rank 1
revokes the world while rank 0 is blocked in a receive from it and the others in a Barrier:
each records the error class and how long it was blocked; then every rank shrinks the world
(nobody failed) and the rounds run on that communicator."""
import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control.bootstrap_store import DirStore  # noqa: E402

RETRIES = 4
N = 1024          # elements of the small collectives


def die_after(delay, d, rank):
    def run():
        time.sleep(delay)
        with open(os.path.join(d, f"kill.{rank}"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=run, daemon=True).start()


def one_call(comm, coll, it):
    n, r = comm.size, comm.rank
    if coll == "allreduce":
        a = np.full(N, r + it, np.float64)
        out = np.empty_like(a)
        comm.Allreduce(a, out)
    elif coll == "allreduce_big":
        a = np.full(1 << 17, r, np.float64)
        out = np.empty_like(a)
        comm.Allreduce(a, out)
    elif coll == "bcast":
        a = np.full(N, it, np.int64)
        comm.Bcast(a, root=it % n)
    elif coll == "allgather":
        out = np.empty(n * 16, np.int64)
        comm.Allgather(np.full(16, r, np.int64), out)
    elif coll == "alltoall":
        out = np.empty(n * 16, np.int64)
        comm.Alltoall(np.full(n * 16, r, np.int64), out)
    else:
        comm.Barrier()


def exact_allreduce(comm):
    """An allreduce on `comm`, checked bit for bit against numpy: int64 and float64."""
    g = comm.channel.global_ranks()
    rng = np.random.default_rng(1234)
    base = rng.integers(-2**20, 2**20, size=(max(g) + 1, 4096))
    mine = base[g[comm.rank]]
    out = np.empty(4096, np.int64)
    comm.Allreduce(mine.astype(np.int64), out)
    want = base[g].sum(axis=0)
    f = mine.astype(np.float64) / 8.0          # exact in float64 in any order
    fout = np.empty_like(f)
    comm.Allreduce(f, fout)
    return bool(np.array_equal(out, want) and
                np.array_equal(fout.view(np.uint64), (want / 8.0).view(np.uint64)))


def write(d, rank, res):
    tmp = os.path.join(d, f"res.{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(d, f"res.{rank}.json"))


def failed(d, tag, res):
    """Record a failure: the traceback in DIR/err.<tag>, the results so far."""
    with open(os.path.join(d, f"err.{tag}"), "w") as f:
        f.write(traceback.format_exc())
    write(d, tag, res)


def done(d, g):
    try:
        with open(os.path.join(d, f"res.{g}.json")) as f:
            return bool(json.load(f).get("done"))
    except (OSError, ValueError):
        return False


def revoke_test(comm, res):
    """Rank 1 revokes while rank 0 waits in a receive from it and the others in a Barrier."""
    t0 = time.monotonic()
    err = None
    try:
        if comm.rank == 1:
            time.sleep(0.3)
            comm.Revoke()
        elif comm.rank == 0:
            comm.Recv(np.empty(4, np.int64), source=1, tag=77)
        else:
            comm.Barrier()
    except r2comm.R2commError as exc:
        err = type(exc).__name__
    blocked = time.monotonic() - t0
    later = None
    try:
        comm.Allreduce(np.ones(4), np.empty(4))
    except r2comm.R2commError as exc:
        later = type(exc).__name__
    res["revoke"] = {"err": err, "blocked_s": blocked, "later": later,
                     "is_revoked": comm.Is_revoked()}


def held():
    """(threads, open fds, r2comm shared-memory segments of this job's processes) now."""
    segs = [f for f in os.listdir("/dev/shm") if f.startswith("r2comm-")] \
        if os.path.isdir("/dev/shm") else []
    return threading.active_count(), len(os.listdir("/proc/self/fd")), len(segs)


def shrink_cycles(comm, cycles, res):
    """`cycles` times: Shrink (nobody failed: the same ranks, a new id), an exact allreduce on
    the new communicator, Free the old one (not the world's: it holds the world). What this
    rank holds is recorded after the 5th cycle and after the last."""
    first, out = comm, {"exact": True}
    for k in range(cycles):
        new = comm.Shrink()
        out["exact"] = out["exact"] and exact_allreduce(new)
        if comm is not first:
            comm.Free()
        comm = new
        if k == 4:
            out["after5"] = held()
    out["after"] = held()
    out["size"] = comm.size
    res["cycles"] = out
    return comm


def main():
    d, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(os.path.join(d, "plan.json")) as f:
        plan = json.load(f)
    timeout = float(plan.get("timeout", 20))
    res = {"rank": rank, "rounds": []}
    try:
        comm = r2comm.Communicator.from_store(DirStore(os.path.join(d, "store"), timeout=60),
                                              rank, size, timeout=timeout)
        res["up"] = time.time()
        write(d, rank, res)
        if plan.get("revoke_test"):
            revoke_test(comm, res)
            comm = comm.Shrink()           # nobody failed: the same ranks, a new id
            res["revoke"]["shrunk"] = [comm.channel.comm_id, comm.channel.global_ranks()]
            try:                           # one rank's bad flag: every rank raises
                comm.Agree("no int" if rank == 0 else 1)
                res["revoke"]["bad_agree"] = None
            except r2comm.R2commError as exc:
                res["revoke"]["bad_agree"] = type(exc).__name__
            res["revoke"]["agree_after"] = comm.Agree(3)
            write(d, rank, res)
        nic = plan.get("nic")          # [rank, bytes]: that rank's rail 0 fails after them
        if nic and nic[0] == rank:
            comm.fail_rail(0, "hard", after_bytes=nic[1])
        for rnd in plan["rounds"]:
            me = {v[1]: v[2] for v in rnd["victims"] if v[0] == rank}
            rec = {"coll": rnd["coll"], "members_before": comm.channel.global_ranks()}
            res["rounds"].append(rec)
            if "coll" in me:
                die_after(me["coll"], d, rank)
            t0 = time.time()
            it, until = 0, time.monotonic() + timeout
            rail_seen, after_rail = False, 0     # calls done after this rank saw its rail fail
            while True:
                if time.monotonic() > until:
                    raise RuntimeError("no rank died within the timeout")
                try:
                    one_call(comm, rnd["coll"], it)
                except r2comm.R2commError as exc:
                    rec["error"] = type(exc).__name__
                    rec["message"] = str(exc)[:300]
                    break
                it += 1
                if nic and nic[0] == rank:
                    after_rail += rail_seen
                    rail_seen = rail_seen or any(e["kind"] == "rail_failed" for e in comm.events)
            rec["calls"], rec["calls_after_rail"] = it, after_rail
            if "coll" in me:                 # another victim died first: this one's timer
                time.sleep(5)                # fires soon (while the others recover)
                raise RuntimeError("a victim outlived its timer")
            rec["t_start"], rec["t_detect"] = t0, time.time()
            comm.Revoke()
            rec["t_revoke"] = time.time()
            rec["is_revoked"] = comm.Is_revoked()
            try:
                comm.Barrier()
                rec["after_revoke"] = None
            except r2comm.R2commError as exc:
                rec["after_revoke"] = type(exc).__name__
            rec["get_failed"] = [comm.channel.global_ranks()[r] for r in comm.Get_failed()]
            if "agree" in me:
                die_after(me["agree"], d, rank)
            flag = ~(1 << (rank % 62))
            if plan.get("nonblocking"):          # Iagree into a buffer, then Wait
                cell = np.array([flag], np.int64)
                comm.Iagree(cell).Wait()
                rec["flag"] = int(cell[0])
            else:
                rec["flag"] = comm.Agree(flag)
            rec["agree_failed"] = [comm.channel.global_ranks()[r] for r in comm.Get_agreed_failed()]
            rec["t_agree"] = time.time()
            if "shrink" in me:
                die_after(me["shrink"], d, rank)
            shrinks = []
            if plan.get("nonblocking"):
                new, req = comm.Ishrink()
                req.Wait()
            else:
                new = comm.Shrink()
            if "agree" in me or "shrink" in me:
                die_after(0.0, d, rank)          # its timer came late (a loaded machine): it
                time.sleep(5)                    # dies at the end of the call, as planned, not
                raise RuntimeError("a victim outlived its SIGKILL")   # in a later one
            rec["t_shrink"] = time.time()
            for attempt in range(RETRIES + 1):
                shrinks.append({"id": new.channel.comm_id, "members": new.channel.global_ranks(),
                                "failed": [comm.channel.global_ranks()[r]
                                           for r in comm.Get_agreed_failed()]})
                try:
                    new.Allreduce(np.ones(N), np.empty(N))
                    rec.setdefault("t_first", time.time())
                    rec["exact"] = exact_allreduce(new)
                    break
                except r2comm.R2commError as exc:
                    if attempt == RETRIES:
                        raise
                    shrinks[-1]["error"] = type(exc).__name__
                    new.Revoke()
                    comm, new = new, new.Shrink()
            rec["shrinks"] = shrinks
            rec["id"], rec["members"], rec["rank"] = new.channel.comm_id, new.channel.global_ranks(), new.rank
            try:
                new.bcast(1)
                rec["lowercase"] = None
            except r2comm.R2commError as exc:
                rec["lowercase"] = type(exc).__name__ + ": " + str(exc)[:80]
            except Exception as exc:          # noqa: BLE001 (the test fails on it)
                rec["lowercase"] = "WRONG " + type(exc).__name__
            rec["mpi_comm"] = repr(new.mpi_comm)
            try:
                new.Dup()
                rec["dup"] = None
            except r2comm.R2commError as exc:
                rec["dup"] = type(exc).__name__
            rec["acked"] = comm.Ack_failed()
            rec["failed_now"] = [comm.channel.global_ranks()[r] for r in comm.Get_failed()]
            write(d, rank, res)
            comm = new
        if plan.get("cycles"):
            comm = shrink_cycles(comm, plan["cycles"], res)
        res["events"] = sorted({e["kind"] for e in comm.events})
        comm.Barrier()
        res["done"] = True
        write(d, rank, res)
        until = time.monotonic() + 15     # exit once every survivor is done (an exit is a death)
        while time.monotonic() < until and not all(done(d, g) for g in comm.channel.global_ranks()):
            time.sleep(0.02)
    except BaseException:
        failed(d, rank, res)
        raise
    os._exit(0)        # (no Free: the dead ranks' world cannot close collectively)


if __name__ == "__main__":
    main()
