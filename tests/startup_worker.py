"""Start-up with rails that do not connect (run under mpiexec by test_startup.py and
test_testbed.py).

    mpiexec -n N python tests/startup_worker.py SCENARIO [key=value ...]

Each rank times its own Communicator() (wall and CPU seconds) before anything else; with
start_marker=PATH rank 0 writes PATH just before it creates its Communicator.

dead_rail  the job starts with some rails dark (R2COMM_FAULT start=1 on loopback, a NIC down or
           blackholed in the netns testbed). down="a-b:k,..." names the (rank pair, rail)s
           expected down. Checks: the Communicator came up within max_up s; every expected
           rail has a rail_never_up event on both ends and shows in comm.rails; collectives
           are exact. With heal=1 rank 0 then writes `marker` (JSON) so that the driver can
           bring the NIC back (or restore_ms of the fault does), every rank waits up to
           restore_wait s for all its rails to be up, and bytes must flow on the re-admitted
           rails (their counters grow under allreduces). replan=1 calls comm.replan() first
           (needed when a pair had no rail at all: its traffic is relayed until re-planned).
partition  the rails cannot connect the ranks: Communicator() must raise R2commNetworkError on
           every rank within max_up s, naming the ranks.
bad_rails  R2COMM_RAILS names an address (addr=) this machine lacks: R2commArgumentError on
           every rank, naming the address and the variable.
late       rank `late` waits `sleep` s before creating its Communicator: the others must wait
           for it without a busy CPU (cpu_max s of CPU time at most).

Prints "STARTUP <json>" rows and "OK <scenario> <count>" on rank 0; a failed check raises."""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, MAX  # noqa: E402
from mpi_worker import WORLD, data, reduce_ref, check, same_everywhere  # noqa: E402


def parse_down(text):
    out = set()
    for part in filter(None, text.split(",")):
        pair, k = part.split(":")
        a, b = (int(x) for x in pair.split("-"))
        out.add((min(a, b), max(a, b), int(k)))
    return out


def collectives(comm, tag):
    n, r = comm.size, comm.rank
    done = 0
    for cnt in (1, 1000, 300_001):
        for dtype, op in (("float32", SUM), ("int32", MAX)):
            case = f"{tag}-ar-{cnt}-{dtype}"
            x = data(case, r, cnt, dtype, op)
            y = np.full_like(x, 77)
            comm.Allreduce(x, y, op=op)
            check(np.array_equal(y, reduce_ref(case, n, cnt, dtype, op)), case)
            same_everywhere(y, case)
            done += 1
    for root, cnt in ((0, 1000), (n - 1, 200_003)):
        case = f"{tag}-bc-{root}-{cnt}"
        b = data(case, root, cnt, "int32", SUM) if r == root else np.zeros(cnt, "int32")
        comm.Bcast(b, root)
        check(np.array_equal(b, data(case, root, cnt, "int32", SUM)), case)
        done += 1
    c = 50_001
    case = f"{tag}-ag"
    out = np.zeros(c * n, "int32")
    comm.Allgather(data(case, r, c, "int32", SUM), out)
    check(np.array_equal(out, np.concatenate([data(case, k, c, "int32", SUM) for k in range(n)])),
          case)
    case = f"{tag}-rs"
    out = np.zeros(c, "float64")
    comm.Reduce_scatter_block(data(case, r, c * n, "float64", SUM), out, SUM)
    check(np.array_equal(out, reduce_ref(case, n, c * n, "float64", SUM)[r * c:(r + 1) * c]), case)
    case = f"{tag}-a2a"
    out = np.zeros(c * n, "int32")
    comm.Alltoall(data(case, r, c * n, "int32", SUM), out)
    want = np.concatenate([data(case, k, c * n, "int32", SUM)[r * c:(r + 1) * c] for k in range(n)])
    check(np.array_equal(out, want), case)
    comm.Barrier()
    return done + 4


def rail_bytes(comm, peer_rails):
    """{(peer, rail): (sent, recv)} of this rank's engine (world ranks)."""
    stats = comm.channel.engine.rail_stats()
    return {(p, k): (stats[p][k][1], stats[p][k][2]) for (p, k) in peer_rails}


def sc_dead_rail(comm, args, took, cpu):
    r = comm.rank
    down = parse_down(args.get("down", ""))
    mine = {(b if a == r else a, k) for (a, b, k) in down if r in (a, b)}
    evs = comm.events
    never = {(e["peer"], e["rail"]): e["info"] for e in evs if e["kind"] == "rail_never_up"}
    check(set(never) == mine, f"rank {r}: rail_never_up events {sorted(never)} != expected "
                              f"{sorted(mine)}: {evs}")
    check(all("did not connect at start-up" in why for why in never.values()), str(never))
    rails = comm.rails
    for k, ra in enumerate(rails):
        down_peers = {p for (p, kk) in mine if kk == k}
        check(ra.peers_up == ra.peers - len(down_peers),
              f"rank {r}: rail {k} up to {ra.peers_up} of {ra.peers} peers, expected "
              f"{ra.peers - len(down_peers)} ({rails})")
        check(ra.state == ("up" if not down_peers else
                           "down" if len(down_peers) == ra.peers else "degraded"), str(ra))
    done = collectives(comm, "start")
    dup = comm.Dup()                    # a derived communicator plans for the start state too
    check((dup.channel.plan_state is None) == (comm.channel.plan_state is None), "Dup follows the start-up state")
    done += collectives(dup, "dup")
    dup.Free()
    row = {"rank": r, "took_s": round(took, 3), "cpu_s": round(cpu, 3),
           "never_up": sorted(never), "rails": [(ra.state, ra.peers_up) for ra in rails],
           "epoch_state": None if comm.channel.plan_state is None else comm.channel.plan_state.describe(),
           "kinds": sorted({e["kind"] for e in evs})}
    if args.get("heal") == "1":
        before = rail_bytes(comm, mine)
        WORLD.Barrier()
        if r == 0 and args.get("marker"):
            tmp = args["marker"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"t": time.time()}, f)
            os.replace(tmp, args["marker"])
        t_heal = time.monotonic()
        limit = float(args.get("restore_wait", 20))
        up = False
        while time.monotonic() - t_heal < limit:
            if all(ra.state == "up" for ra in comm.rails):
                up = True
                break
            time.sleep(0.02)
        row["restored_after_s"] = round(time.monotonic() - t_heal, 3)
        check(up, f"rank {r}: rails back up within {limit} s: {comm.rails} {comm.events[-10:]}")
        evs = comm.events
        restored = {(e["peer"], e["rail"]) for e in evs if e["kind"] == "rail_restored"}
        check(mine <= restored, f"rank {r}: rail_restored for {sorted(mine)}: {sorted(restored)}")
        if args.get("replan") == "1":              # relays stay until the plans follow the
            deadline = time.monotonic() + 10       # pair's facts again: by themselves, at
            k = 0                                  # one call on every rank (replan.py)
            while True:
                done += collectives(comm, f"follow{k}")
                k += 1
                st = comm.channel.plan_state
                relayed = st is not None and bool(st.broken_pairs())
                late = time.monotonic() > deadline
                if WORLD.allreduce(1 if relayed and not late else 0) == 0:
                    break
            check(not relayed, f"rank {r}: the plans still relay after 10 s: {st and st.describe()}")
            epochs = WORLD.allgather(comm.epoch)
            check(len(set(epochs)) == 1 and epochs[0] > 0, f"epochs agreed: {epochs}")
            row["replanned"] = "static" if st is None else st.describe()
        done += collectives(comm, "healed")
        x = np.ones(4 << 20, np.float32)           # 16 MiB: every rail gets chunks
        y = np.empty_like(x)
        for _ in range(3):
            comm.Allreduce(x, y)
            check(np.all(y == comm.size), "healed 16 MiB allreduce")
        after = rail_bytes(comm, mine)
        grew = {f"{p}/{k}": (after[(p, k)][0] - before[(p, k)][0],
                             after[(p, k)][1] - before[(p, k)][1]) for (p, k) in mine}
        row["bytes_on_readmitted"] = grew
        check(all(s > 0 or rcv > 0 for s, rcv in grew.values()),
              f"rank {r}: bytes flow on the re-admitted rails: {grew}")
    rows = WORLD.gather(row)
    if r == 0:
        for rw in rows:
            print(f"STARTUP {json.dumps(rw)}", flush=True)
    return done


def main():
    name = sys.argv[1]
    args = dict(a.split("=", 1) for a in sys.argv[2:])
    import faulthandler
    faulthandler.dump_traceback_later(float(args.get("dump_after", 100)), exit=False)
    if name == "late" and WORLD.rank == int(args.get("late", 1)):
        time.sleep(float(args.get("sleep", 3)))
    if args.get("start_marker") and WORLD.rank == 0:     # the driver times faults from here
        with open(args["start_marker"] + ".tmp", "w") as f:
            json.dump({"t": time.time()}, f)
        os.replace(args["start_marker"] + ".tmp", args["start_marker"])
    t0, c0 = time.monotonic(), time.process_time()
    try:
        comm = r2comm.Communicator(MPI.COMM_WORLD, timeout=float(args.get("timeout", 30)))
        err = None
    except r2comm.R2commError as exc:
        comm, err = None, exc
    took, cpu = time.monotonic() - t0, time.process_time() - c0
    max_up = float(args.get("max_up", 15))
    if name == "bad_rails":
        msg = str(err)
        check(isinstance(err, r2comm.R2commArgumentError) and args["addr"] in msg and
              "R2COMM_RAILS" in msg, f"rank {WORLD.rank}: expected an R2commArgumentError "
                                     f"naming {args['addr']} and R2COMM_RAILS, got {err!r}")
        count = WORLD.allreduce(1)
        if WORLD.rank == 0:
            print(f"STARTUP {json.dumps({'error': msg})}", flush=True)
            print(f"OK {name} {count}", flush=True)
        return
    if name == "partition":
        check(isinstance(err, r2comm.R2commNetworkError),
              f"rank {WORLD.rank}: expected R2commNetworkError, got {err!r}")
        msg = str(err)
        check("disconnected groups" in msg and all(w in msg for w in args.get("words", "").split("|")),
              f"rank {WORLD.rank}: message names the ranks and rails: {msg}")
        check(took < max_up, f"rank {WORLD.rank}: raised after {took:.1f} s (bound {max_up})")
        msgs = WORLD.allgather(msg)
        check(len(set(msgs)) == 1, f"every rank raises the same error: {msgs}")
        if WORLD.rank == 0:
            print(f"STARTUP {json.dumps({'took_s': round(took, 3), 'error': msg})}", flush=True)
            print(f"OK {name} {WORLD.size}", flush=True)
        return
    if err is not None:
        raise err
    try:
        check(took < max_up, f"rank {comm.rank}: Communicator() took {took:.1f} s (bound {max_up})")
        if name == "late":
            cpu_max = float(args.get("cpu_max", 1.0))
            late = int(args.get("late", 1))
            rows = WORLD.gather({"rank": comm.rank, "took_s": round(took, 3), "cpu_s": round(cpu, 3)})
            if comm.rank == 0:
                for rw in rows:
                    print(f"STARTUP {json.dumps(rw)}", flush=True)
                for rw in rows:
                    if rw["rank"] != late:
                        check(rw["cpu_s"] < cpu_max, f"rank {rw['rank']} used {rw['cpu_s']} s of CPU "
                                                     f"waiting {rw['took_s']} s at start-up")
            count = collectives(comm, "late")
        else:
            count = sc_dead_rail(comm, args, took, cpu)
            cpu_max = args.get("cpu_max")
            if cpu_max is not None:
                check(cpu < float(cpu_max), f"rank {comm.rank}: {cpu:.2f} s of CPU in a {took:.2f} s "
                                            "start-up")
    except BaseException:
        for ev in comm.events[-30:]:
            print(f"rank {WORLD.rank} event: {ev}", file=sys.stderr)
        sys.stderr.flush()
        raise
    total = WORLD.allreduce(count)
    if WORLD.rank == 0:
        print(f"OK {name} {total}", flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
