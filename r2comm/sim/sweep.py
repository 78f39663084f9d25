"""The choice against the simulator's replay (issue 32, item 4): on host-level fabrics (one rank
per host, H hosts x K NICs, one NIC of one host losing `loss` of its rate, 1: down), the
planner's closed-form choice is replayed with every other candidate, and the ratio of the chosen
one's replay to the best replay is reported. Used by tests/test_planner_scale.py and
bench/planner_scale.py."""
import itertools
import random

MiB = 1 << 20
HOSTS = (3, 4, 5, 6, 8, 12, 16, 24)
NICS = (2, 4, 8)
LOSSES = (0.125, 0.25, 0.5, 0.75, 1.0)
SIZES = (1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)
ISSUE_CASES = ((16, 8, 1.0, 256 * MiB), (4, 8, 1.0, 1024 * MiB))


def grid(sample=40, seed=32):
    """The issue's two cases, every corner of the grid, and `sample` more drawn at random."""
    full = list(itertools.product(HOSTS, NICS, LOSSES, SIZES))
    corners = [c for c in full if c[0] in (HOSTS[0], HOSTS[-1]) and c[1] in (NICS[0], NICS[-1])
               and c[2] in (LOSSES[0], LOSSES[-1]) and c[3] in (SIZES[0], SIZES[-1])]
    rest = [c for c in full if c not in corners and c not in ISSUE_CASES]
    return list(ISSUE_CASES) + corners + random.Random(seed).sample(rest, sample)


def case(H, K, loss, nbytes, rate=50e9, alpha=25e-6, segments=8):
    """{"chosen", "replay": {algo: seconds}, "ratio"} for one point of the sweep."""
    from .. import planner
    from ..config import Config
    from .cluster import Cluster
    from .fabric import Fabric
    from .predict import EFFICIENCY
    fab = Fabric(H, K, rate, 1, EFFICIENCY, alpha)
    fab.degrade(H - 1, 0, 1.0 - loss)
    st = fab.state()
    eager = Config().eager
    chosen = planner.choose("allreduce", H, nbytes, 4, st, eager=eager)
    replay = {}
    for a in planner.candidates("allreduce", H, st):
        sc = planner.build_all("allreduce", H, nbytes, 4, eager=eager, algo=a, state=st)
        replay[a] = Cluster(fab, segments=segments).run_schedules(sc)["time_s"]
    return {"hosts": H, "nics": K, "loss": loss, "bytes": nbytes, "chosen": chosen,
            "prices": planner.evaluate("allreduce", H, nbytes, 4, st, eager=eager),
            "replay": replay, "ratio": replay[chosen] / min(replay.values())}


def crosscheck(H, K, G, loss, nbytes, rate=1.25e9, alpha=25e-6, segments=8):
    """The closed-form prices (choose()) against cost.py's model over every rank's schedules on
    a small fabric (H hosts x G ranks, K NICs, NIC 0 of the last host losing `loss`): both
    choices and prices, and where the choices differ, both replayed (the simulator decides)."""
    from .. import planner
    from ..config import Config
    from .cluster import Cluster
    from .fabric import Fabric
    from .predict import EFFICIENCY
    fab = Fabric(H, K, rate, G, EFFICIENCY, alpha, intra_bw=8e9)
    fab.degrade(H - 1, 0, 1.0 - loss)
    flat = G > 1
    st = fab.state(flat=flat)
    n, eager = st.n, Config().eager
    new = planner.evaluate("allreduce", n, nbytes, 4, st, eager=eager)
    old = {a: planner.build_all("allreduce", n, nbytes, 4, eager=eager, algo=a, state=st)[0].cost
           for a in new}
    cn, co = planner.price.cheapest(new), planner.price.cheapest(old)
    out = {"hosts": H, "nics": K, "ranks_per_host": G, "loss": loss, "bytes": nbytes,
           "new": new, "old": old, "chosen": cn, "old_choice": co, "replay": {}}
    if cn != co:
        for a in (cn, co):
            sc = planner.build_all("allreduce", n, nbytes, 4, eager=eager, algo=a, state=st)
            out["replay"][a] = Cluster(fab, flat=flat, segments=segments).run_schedules(sc)[
                "time_s"]
    return out
