"""r2comm inside the network-namespace testbed (run by test_fabric_collectives.py).

    Fabric.mpiexec(N, [python, tests/fabric_worker.py, SCENARIO, key=value ...])

Each rank runs inside its host's namespace with R2COMM_RAILS naming that host's NICs, so
r2comm's rails are real (rate-limited) veths: faults are injected from outside the job
(ip link down, tc blackhole), never with comm.fail_rail().

collectives  every collective, several sizes and dtypes, bit-identical to numpy references on
             every rank; both rails must have carried bytes
stream       back-to-back allreduces for `seconds` (all ranks agree when to stop); rank 0 writes
             `marker` (JSON {"t0": ...}) when the stream starts so the test can time its fault.
             Every result is checked bit for bit (the output buffer is poisoned before each op
             and the inputs rotate, so a chunk that never arrived cannot pass).  expect=fail
             checks that some rank saw a rail_failed event on rail `rail`; restore_wait=S then
             waits up to S seconds for every rail to be 'up' again (fail-back)

Prints "OK <scenario> <count>" on rank 0 when all checks passed; a failed check raises, so the
job exits non-zero.
"""
import collections
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm import SUM, MAX  # noqa: E402
from mpi_worker import WORLD, wait_rails_up, data, reduce_ref, check, same_everywhere, main  # noqa: E402

MAX_OPS = 5000          # a stream never runs more ops than this, whatever the clock says


def sc_collectives(comm, args):
    n, r = comm.size, comm.rank
    done = 0
    big = (3 << 20) // 4 + 3                      # several chunks, not divisible by n
    for cnt in (1, 7, 1000, big):
        for dtype, op in (("float32", SUM), ("float64", SUM), ("int32", MAX)):
            case = f"ar-{cnt}-{dtype}-{op.name}"
            x = data(case, r, cnt, dtype, op)
            y = np.full_like(x, 77)
            comm.Allreduce(x, y, op=op)
            check(np.array_equal(y, reduce_ref(case, n, cnt, dtype, op)), case)
            same_everywhere(y, case)
            done += 1
    for root, cnt in ((0, 1000), (n - 1, 600_003)):
        case = f"bc-{root}-{cnt}"
        b = data(case, root, cnt, "int32", SUM) if r == root else np.zeros(cnt, "int32")
        comm.Bcast(b, root)
        check(np.array_equal(b, data(case, root, cnt, "int32", SUM)), case)
        done += 1
    for c in (5, 250_001):
        case = f"ag-{c}"
        out = np.zeros(c * n, "int32")
        comm.Allgather(data(case, r, c, "int32", SUM), out)
        check(np.array_equal(out, np.concatenate([data(case, k, c, "int32", SUM)
                                                  for k in range(n)])), case)
        case = f"rs-{c}"
        out = np.zeros(c, "float64")
        comm.Reduce_scatter_block(data(case, r, c * n, "float64", SUM), out, SUM)
        check(np.array_equal(out, reduce_ref(case, n, c * n, "float64", SUM)[r * c:(r + 1) * c]),
              case)
        case = f"a2a-{c}"
        out = np.zeros(c * n, "int32")
        comm.Alltoall(data(case, r, c * n, "int32", SUM), out)
        want = np.concatenate([data(case, k, c * n, "int32", SUM)[r * c:(r + 1) * c]
                               for k in range(n)])
        check(np.array_equal(out, want), case)
        done += 3
    reqs, outs = [], []
    for k in range(3):
        x = data(f"iar-{k}", r, 400_001, "float32", SUM)
        outs.append(np.zeros_like(x))
        reqs.append(comm.Iallreduce(x, outs[-1], SUM))
    r2comm.Request.Waitall(reqs[::-1])
    for k in range(3):
        want = reduce_ref(f"iar-{k}", n, 400_001, "float32", SUM)
        check(np.array_equal(outs[k], want), f"iar-{k}")
        done += 1
    # striping really happened: every rail of every rank carried traffic, none failed
    rails = comm.rails
    check(all(ra.bytes_sent > 0 and ra.bytes_recv > 0 for ra in rails),
          f"rank {r}: every rail carried bytes: {rails}")
    check(all(ra.state == "up" for ra in rails), f"rank {r}: rails up: {rails}")
    sent = WORLD.gather([ra.bytes_sent for ra in rails])
    if r == 0:
        print(f"COLLECTIVES rails={[ra.address for ra in rails]} bytes_sent_per_rank={sent}",
              flush=True)
    return done


def _write_marker(path, payload):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def sc_stream(comm, args):
    n, r = comm.size, comm.rank
    seconds = float(args.get("seconds", 3.0))
    cnt = int(args.get("count", 1 << 20))          # float32 elements per allreduce (4 MiB)
    expect = args.get("expect", "none")
    rail = int(args.get("rail", 0))
    cases = [f"st-{k}" for k in range(3)]
    xs = [data(c, r, cnt, "float32", SUM) for c in cases]
    refs = [reduce_ref(c, n, cnt, "float32", SUM) for c in cases]
    y = np.empty_like(xs[0])
    comm.Allreduce(xs[0], y)                        # warm-up: connections, buffers
    check(np.array_equal(y, refs[0]), "warm-up allreduce")
    WORLD.Barrier()
    t0 = time.time()
    t_end = WORLD.bcast(t0 + seconds, root=0)
    if r == 0 and args.get("marker"):
        _write_marker(args["marker"], {"t0": t0, "t_end": t_end})
    done, ops = [], 0
    while ops < MAX_OPS and WORLD.allreduce(time.time() < t_end, op=MPI.LAND):
        k = ops % len(cases)
        y.fill(np.float32(-1.0))                    # poison: a missing chunk cannot look right
        comm.Allreduce(xs[k], y, op=SUM)
        check(np.array_equal(y, refs[k]), f"rank {r}: stream op {ops} bit-identical")
        done.append(time.time())
        ops += 1
    restored = True
    if float(args.get("restore_wait", 0)) > 0:
        restored = wait_rails_up(comm, float(args["restore_wait"]))
    evs = comm.events
    kinds = collections.Counter(e["kind"] for e in evs)
    failed_here = [e for e in evs if e["kind"] == "rail_failed"]
    first_fail = min((e["t"] for e in failed_here), default=None)
    marks = np.concatenate([[t0], done])
    pause = float(np.max(np.diff(marks))) if len(done) else None
    row = {"rank": r, "ops": ops, "kinds": dict(kinds),
           "failed_rails": sorted({e["rail"] for e in failed_here}),
           # where this rank located the failures it detected itself (local/remote NIC)
           "causes": sorted({e.get("cause") for e in failed_here if e["detector"] == r}, key=str),
           "first_fail_s": None if first_fail is None else round(first_fail - t0, 3),
           "longest_gap_s": None if pause is None else round(pause, 3),
           "restored": restored,
           "rails": [(ra.state, ra.bytes_sent, ra.bytes_resent, ra.failures) for ra in comm.rails]}
    rows = WORLD.allgather(row)
    if r == 0:
        for rw in rows:
            print(f"STREAM {json.dumps(rw)}", flush=True)
    check(len({rw["ops"] for rw in rows}) == 1, "every rank ran the same number of ops")
    check(ops >= 3, f"the stream ran ({ops} ops)")
    n_failed = sum(rw["kinds"].get("rail_failed", 0) for rw in rows)
    on_rail = any(rail in rw["failed_rails"] for rw in rows)
    if expect in ("fail", "flap"):
        check(n_failed >= 1 and on_rail, f"a rail_failed event on rail {rail}: {rows}")
    elif expect == "none":
        check(n_failed == 0, f"no rail failed on a healthy fabric: {rows}")
    if float(args.get("restore_wait", 0)) > 0:
        check(all(rw["restored"] for rw in rows), f"every rail back up (fail-back): {rows}")
    return ops


def sc_idle(comm, args):
    """A NIC that goes down while nothing runs: after one allreduce every rank stops calling
    r2comm (rank 0 writes `marker` so the test takes host 1's NIC 0 down) and only watches
    comm.rails; the rail must leave "up" on every rank without a single operation. Rank 0 then
    writes `marker`.seen (the test brings the NIC back), every rail comes back up by fail-back
    alone, and an allreduce over all rails is exact."""
    n, r = comm.size, comm.rank
    rail = int(args.get("rail", 0))
    limit = float(args.get("limit", 5.0))
    cnt = 1 << 16
    x = data("idle", r, cnt, "float32", SUM)
    ref = reduce_ref("idle", n, cnt, "float32", SUM)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    check(np.array_equal(y, ref), "warm-up allreduce")
    check(all(ra.state == "up" for ra in comm.rails), f"rails up before the fault: {comm.rails}")
    n0 = len(comm.events)
    WORLD.Barrier()
    if r == 0:
        _write_marker(args["marker"], {"t0": time.time()})
    seen, deadline = None, time.monotonic() + limit
    while time.monotonic() < deadline:              # no r2comm operation in this loop
        if comm.rails[rail].state != "up":
            seen = time.time()
            break
        time.sleep(0.005)
    failed = [e for e in comm.events[n0:] if e["kind"] == "rail_failed"]
    row = {"rank": r, "seen": seen, "state": comm.rails[rail].state,
           "failed": sorted({(e["peer"], e["rail"], e["detector"] == r, e.get("cause"))
                             for e in failed}, key=str)}
    rows = WORLD.allgather(row)
    if r == 0:
        for rw in rows:
            print(f"IDLE {json.dumps(rw)}", flush=True)
        _write_marker(args["marker"] + ".seen", {"rows": rows})
    check(all(rw["seen"] is not None for rw in rows),
          f"a NIC down on an idle rail was not noticed within {limit} s: {rows}")
    check(all(any(f[1] == rail for f in rw["failed"]) for rw in rows),
          f"every rank recorded rail {rail} failed: {rows}")
    back = wait_rails_up(comm, float(args.get("restore_wait", 20)))
    check(back, f"rank {r}: rails back up by fail-back: {comm.rails}")
    WORLD.Barrier()
    y.fill(np.float32(-1.0))
    comm.Allreduce(x, y)
    check(np.array_equal(y, ref), "allreduce after fail-back")
    check(comm.rails[rail].bytes_sent > 0, "the restored rail carries traffic")
    return 1                                        # (summed over the ranks by main)


SCENARIOS = {"collectives": sc_collectives, "stream": sc_stream, "idle": sc_idle}


def fabric_main():
    rails = os.environ.get("R2COMM_RAILS", "")
    check(rails.startswith("198.18."), f"not placed in the fabric: R2COMM_RAILS={rails!r}")
    main(SCENARIOS, dump_after=50)


if __name__ == "__main__":
    fabric_main()
