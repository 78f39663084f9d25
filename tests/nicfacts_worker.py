"""NIC facts in a real job (issue 39): ranks on emulated hosts (R2COMM_HOST, set from the MPI rank
before the Communicator is made: `per_host` ranks a host), loopback rails, no shared memory.

    mpiexec -n N python tests/nicfacts_worker.py SCENARIO per_host=G [key=value ...]

nicdown   the ranks of host `victim` lose NIC `rail` (an injected fault on each of them: the
          emulated NIC goes dark) while every rank streams allreduces in bursts of Iallreduce
          (ranks skewed by per-rank pauses, so they are at different calls when it happens);
          every rank must adopt the same new epoch at the same call without any replan() call,
          count that host's NICs one fewer (topology()["rails_up_per_host"]), show the rail
          down towards every rank of that host (also those it never connected), not attempt
          it on a first use (an Alltoall that connects every peer), and keep every result
          exact; then the NIC comes back and the same happens the other way.
realdown  (netns=1, in the testbed) the same under a real `ip link set ... down`: rank 0
          writes `marker` once the stream runs; the test takes the NIC down and writes
          `marker`.down (its wall time), waits for `marker`.seen, brings the NIC up and writes
          `marker`.up; each rank reports when (wall time of its `replanned` event) and at which
          call it switched.
Prints "FACTS <json>" per rank (rank 0) and "OK <scenario> <count>"."""
import json
import os
import sys
import time

from mpi4py import MPI

_ARGS = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
if _ARGS.get("netns") != "1":             # the testbed's namespaces make the hosts themselves
    os.environ["R2COMM_HOST"] = f"emulated-{MPI.COMM_WORLD.rank // int(_ARGS.get('per_host', 2))}"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from mpi_worker import WORLD, check, data, main, reduce_ref  # noqa: E402
import r2comm  # noqa: E402


def switch_calls(comm):
    """{epoch: first call of that epoch} from this rank's `replanned` events."""
    out = {}
    for e in comm.events:
        if e["kind"] == "replanned" and e["info"].startswith(f"communicator {comm.channel.comm_id}:"):
            words = e["info"].split()
            out[int(words[3])] = int(words[6].rstrip(":"))
    return out


def burst(comm, case, width, pause):
    """`width` Iallreduces in flight, then every result checked (exact integer sums)."""
    n, r = comm.size, comm.rank
    cnt = 65536
    xs = [data(f"{case}-{i}", r, cnt, "float32", r2comm.SUM) for i in range(width)]
    ys = [np.empty_like(x) for x in xs]
    reqs = [comm.Iallreduce(x, y) for x, y in zip(xs, ys)]
    if pause:
        time.sleep(pause)
    r2comm.Request.Waitall(reqs)
    for i, y in enumerate(ys):
        check(np.array_equal(y, reduce_ref(f"{case}-{i}", n, cnt, "float32", r2comm.SUM)),
              f"{case}-{i}: exact")
    return width


def stream_until(comm, label, done, limit, rng):
    """Bursts until done() holds on every rank (the same decision everywhere) or `limit` s;
    -> (checks, bursts, seconds)."""
    t0 = time.monotonic()
    checks = bursts = 0
    while True:
        checks += burst(comm, f"{label}-{bursts}", 8, float(rng.choice([0, 0, 0.002, 0.01])))
        bursts += 1
        late = time.monotonic() - t0 > limit
        if WORLD.allreduce(1 if (done() or late) else 0, op=MPI.MIN) == 1:
            return checks, bursts, time.monotonic() - t0


def rails_up(comm):
    return comm.topology().get("rails_up_per_host")


def sc_nicdown(comm, args):
    n, r = comm.size, comm.rank
    G = int(args["per_host"])
    rail = int(args.get("rail", 1))
    victim = int(args.get("victim", n // G - 1))
    nhosts = n // G
    nrails = len(comm.rails)
    rng = np.random.default_rng(r)          # skews the ranks: different pauses per rank
    mine = [p for p in range(n) if p // G == victim]
    row = {"rank": r}
    checks, _, _ = stream_until(comm, "warm", lambda: True, 0, rng)
    check(comm.epoch == 0 and rails_up(comm) is None, f"healthy start: epoch {comm.epoch}")
    WORLD.Barrier()
    t_fail = time.monotonic()
    if r in mine:
        comm.fail_rail(rail, "hard")
    c, bursts, took = stream_until(comm, "fail", lambda: comm.epoch >= 1, 10.0, rng)
    checks += c
    row.update(epoch_down=comm.epoch, bursts_down=bursts, adopted_s=round(took, 3),
               rails_up_down=rails_up(comm), calls=switch_calls(comm))
    want = [nrails] * nhosts
    want[victim] -= 1
    check(comm.epoch == 1, f"rank {r}: epoch {comm.epoch} after the NIC failure")
    check(rails_up(comm) == want, f"rank {r}: rails_up_per_host {rails_up(comm)}, want {want}")
    # the rail towards every rank of the victim host is down, whether it ever carried a byte
    stats = comm.channel.engine.rail_stats()
    if r not in mine:
        rows = {p: stats[p][rail][0] for p in mine}
        check(all(v == "down" for v in rows.values()), f"rank {r}: rail {rail} to host "
                                                        f"{victim}: {rows}")
    # a first use after the fact does not try the rail towards that host (no 5 s wait)
    t = time.monotonic()
    blk = 1024
    x = np.arange(n * blk, dtype=np.int32) + r * 1000
    y = np.empty_like(x)
    comm.Alltoall(x, y)
    check(all(np.array_equal(y[p * blk:(p + 1) * blk],
                             np.arange(r * blk, (r + 1) * blk, dtype=np.int32) + p * 1000)
              for p in range(n)), "alltoall after the fact: exact")
    row["alltoall_s"] = round(time.monotonic() - t, 3)
    if r not in mine:
        states = {p: comm.channel.engine.links.link_state(p, rail) for p in mine}
        check(all(v in ("off", "down") for v in states.values()),
              f"rank {r}: rail {rail} to host {victim} after a first use: {states}")
    never = [e for e in comm.events if e["kind"] == "rail_never_up" and e["rail"] == rail]
    check(not never, f"rank {r}: a first use tried the announced rail: {never[:2]}")
    # the NIC comes back: announced up, every rank switches back at one call
    WORLD.Barrier()
    if r in mine:
        comm.restore_rail(rail)
    c, bursts, took = stream_until(comm, "back", lambda: comm.epoch >= 2, 15.0, rng)
    checks += c
    row.update(epoch_up=comm.epoch, restored_s=round(took, 3), rails_up_up=rails_up(comm),
               calls=switch_calls(comm), fail_s=round(time.monotonic() - t_fail, 3))
    check(comm.epoch == 2, f"rank {r}: epoch {comm.epoch} after the NIC came back")
    check(rails_up(comm) in (None, [nrails] * nhosts), f"rank {r}: {rails_up(comm)} at the end")
    rows = WORLD.gather(row, root=0)
    if r == 0:
        calls = {json.dumps(rw["calls"], sort_keys=True) for rw in rows}
        check(len(calls) == 1, f"the ranks switched at different calls: {[rw['calls'] for rw in rows]}")
        for rw in rows:
            print(f"FACTS {json.dumps(rw)}", flush=True)
    return checks


def _wait_file(path, limit):
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > limit:
            return None
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def _switched_at(comm, epoch):
    """Wall time of this rank's switch to `epoch` (its replanned event)."""
    for e in comm.events:
        if e["kind"] == "replanned" and f"epoch {epoch} from" in e["info"]:
            return e["t"]
    return None


def sc_realdown(comm, args):
    r = comm.rank
    marker = args["marker"]
    nrails = len(comm.rails)
    hosts = comm.topology()["nhosts"]
    victim = int(args.get("victim", hosts - 1))
    rng = np.random.default_rng(r)
    checks, _, _ = stream_until(comm, "warm", lambda: True, 0, rng)
    check(comm.epoch == 0, "healthy start")
    WORLD.Barrier()
    if r == 0:
        with open(marker + ".tmp", "w") as f:
            json.dump({"t0": time.time()}, f)
        os.replace(marker + ".tmp", marker)
    c, bursts, took = stream_until(
        comm, "down", lambda: comm.epoch >= 1 and os.path.exists(marker + ".down"), 20.0, rng)
    checks += c
    t_down = _wait_file(marker + ".down", 5.0)["t"]
    want = [nrails] * hosts
    want[victim] -= 1
    row = {"rank": r, "epoch_down": comm.epoch, "rails_up_down": rails_up(comm),
           "adopt_s": round(_switched_at(comm, 1) - t_down, 3), "calls": switch_calls(comm)}
    check(comm.epoch == 1 and rails_up(comm) == want,
          f"rank {r}: epoch {comm.epoch}, rails_up_per_host {rails_up(comm)}, want {want}")
    if r == 0:
        with open(marker + ".seen.tmp", "w") as f:
            json.dump({}, f)
        os.replace(marker + ".seen.tmp", marker + ".seen")
    c, bursts, took = stream_until(
        comm, "up", lambda: comm.epoch >= 2 and os.path.exists(marker + ".up"), 30.0, rng)
    checks += c
    t_up = _wait_file(marker + ".up", 5.0)["t"]
    row.update(epoch_up=comm.epoch, rails_up_up=rails_up(comm), calls=switch_calls(comm),
               back_s=round(_switched_at(comm, 2) - t_up, 3),
               facts_at=[(e["kind"], round(e["t"] - t_down, 3)) for e in comm.events
                         if e["kind"] in ("nic_down", "nic_up", "replanned", "rail_restored")])
    check(comm.epoch == 2 and rails_up(comm) in (None, [nrails] * hosts),
          f"rank {r}: epoch {comm.epoch}, rails_up_per_host {rails_up(comm)} at the end")
    rows = WORLD.gather(row, root=0)
    if r == 0:
        check(len({json.dumps(rw["calls"], sort_keys=True) for rw in rows}) == 1,
              f"the ranks switched at different calls: {[rw['calls'] for rw in rows]}")
        for rw in rows:
            print(f"FACTS {json.dumps(rw)}", flush=True)
    return checks


def sc_noreplan(comm, args):
    """R2COMM_REPLAN=0: the NIC's fact still reaches every rank (the rail down towards every
    rank of that host, no first use of it), but the plans stay: epoch 0, no state, until
    comm.replan(), which every rank calls at one call."""
    n, r = comm.size, comm.rank
    G, rail = int(args["per_host"]), int(args.get("rail", 1))
    victim = n // G - 1
    mine = [p for p in range(n) if p // G == victim]
    rng = np.random.default_rng(r)
    check(not comm.channel.config.replan_auto and comm.channel.config.replan_every == 0, "R2COMM_REPLAN=0")
    checks, _, _ = stream_until(comm, "warm", lambda: True, 0, rng)
    if r in mine:
        comm.fail_rail(rail, "hard")
    from r2comm.control import facts
    key = facts.nic_key(victim, rail)
    c, _, _ = stream_until(comm, "held", lambda: comm._world.facts.level(key) == 0, 10.0, rng)
    checks += c
    check(comm._world.facts.level(key) == 0, f"rank {r}: the NIC's fact arrived")
    c, _, _ = stream_until(comm, "more", lambda: False, 0.5, rng)
    checks += c
    check(comm.epoch == 0 and comm.channel.plan_state is None, f"rank {r}: the plans moved: {comm.epoch}")
    if r not in mine:
        stats = comm.channel.engine.rail_stats()
        check(all(stats[p][rail][0] == "down" for p in mine), f"rank {r}: rail {rail} to host "
              f"{victim}: {[stats[p][rail][0] for p in mine]}")
    st = comm.replan()
    check(comm.epoch == 1 and st.degraded_hosts() == [victim], f"replan(): {st.describe()}")
    checks += burst(comm, "after", 4, 0)
    return checks


SCENARIOS = {"nicdown": sc_nicdown, "realdown": sc_realdown, "noreplan": sc_noreplan}

if __name__ == "__main__":
    main(SCENARIOS, default_timeout=60)
