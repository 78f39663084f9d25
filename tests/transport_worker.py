"""Collectives over the fake transport (run by test_transport_iface.py under mpiexec, with
R2COMM_TEST_TRANSPORT=fake:...): every result checked bit for bit against numpy, then the
fake transport's counts and the failover that its faults caused, per job.

    mpiexec -n N python tests/transport_worker.py fake trials=T seed=S
"""
import json
import time

import numpy as np

import fake_transport
from mpi_worker import WORLD, main
from r2comm._core import testing
from fault_worker import run_collective, COLLS


def sc_fake(comm, args):
    seed, trials = int(args.get("seed", 1)), int(args.get("trials", 20))
    checks = 0
    stats = testing.transport_stats(comm.channel.engine)
    assert stats["transport"] == "fake", stats
    for t in range(trials):
        rng = np.random.default_rng([seed, t])           # the same plan on every rank
        coll = COLLS[t % len(COLLS)]
        nbytes = int(rng.choice([8, 4096, 200_000, 1_000_000, 2_500_000]))
        checks += run_collective(comm, coll, nbytes, f"tp-{seed}-{t}", rng)
    # a completion lost near the end fails its rail a rail deadline later: wait for that
    time.sleep(float(args.get("settle", 0.8)))
    WORLD.Barrier()
    stats = testing.transport_stats(comm.channel.engine)
    kinds = {}
    for ev in comm.events:
        kinds[ev["kind"]] = kinds.get(ev["kind"], 0) + 1
    infos = sorted({ev["info"] for ev in comm.events if ev["kind"] == "rail_failed"})
    resent = sum(ra.bytes_resent for ra in comm.rails)
    rows = WORLD.gather({"stats": stats, "events": kinds, "resent": resent, "why": infos[:6]})
    if WORLD.rank == 0:
        total = {k: sum(r["stats"][k] for r in rows) for k in stats if k != "transport"}
        ev = {}
        for r in rows:
            for k, v in r["events"].items():
                ev[k] = ev.get(k, 0) + v
        why = sorted({w for r in rows for w in r["why"]})
        print("FAKE " + json.dumps({"stats": total, "events": ev,
                                    "resent": sum(r["resent"] for r in rows), "why": why}),
              flush=True)
    return checks


def comm_kwargs(args):
    return {"rails": args.get("rails", "127.0.0.1,127.0.0.2,127.0.0.3").split(",")}


if __name__ == "__main__":
    import sys
    fake_transport.install()            # R2COMM_TEST_TRANSPORT: every engine's rails
    main({"fake": sc_fake}, default_timeout=60,
         comm_kwargs=comm_kwargs(dict(a.split("=", 1) for a in sys.argv[2:])))
