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
PRUNE = 1.6                 # replay only the candidates priced below this x the chosen replay
BIG_HOSTS = (32, 64, 128)   # big_grid(): the issue's range beyond grid()'s, a few points
BIG_NICS = (2, 8)
BIG_LOSSES = (1.0, 0.125)   # a NIC down, a NIC at 7/8
BIG_SIZES = (8 * MiB, 64 * MiB, 256 * MiB)


def grid(sample=40, seed=32):
    """The issue's two cases, every corner of the grid, and `sample` more drawn at random."""
    full = list(itertools.product(HOSTS, NICS, LOSSES, SIZES))
    corners = [c for c in full if c[0] in (HOSTS[0], HOSTS[-1]) and c[1] in (NICS[0], NICS[-1])
               and c[2] in (LOSSES[0], LOSSES[-1]) and c[3] in (SIZES[0], SIZES[-1])]
    rest = [c for c in full if c not in corners and c not in ISSUE_CASES]
    return list(ISSUE_CASES) + corners + random.Random(seed).sample(rest, sample)


def big_grid():
    """Every point of BIG_HOSTS x BIG_NICS x BIG_LOSSES x BIG_SIZES (36; with `prune`, about
    4 minutes of CPU on this machine, most of it the 8-NIC fabrics with a NIC at 7/8, which the
    rail state's tolerance leaves healthy: the ring and recursive doubling replayed at 64 and
    128 hosts, 64-256 MiB)."""
    return list(itertools.product(BIG_HOSTS, BIG_NICS, BIG_LOSSES, BIG_SIZES))


def point(H, K, loss, nbytes, rate=50e9, alpha=25e-6):
    """One point's fabric (H hosts x K NICs, the last host's NIC 0 at 1 - loss of its rate), its
    rail state and the planner's choice there: (fabric, state, eager, chosen algorithm)."""
    from .. import planner
    from ..config import Config
    from .fabric import Fabric
    from .predict import EFFICIENCY
    fab = Fabric(H, K, rate, 1, EFFICIENCY, alpha)
    fab.degrade(H - 1, 0, 1.0 - loss)
    st, eager = fab.state(), Config().eager
    return fab, st, eager, planner.choose("allreduce", H, nbytes, 4, st, eager=eager)


def case(H, K, loss, nbytes, rate=50e9, alpha=25e-6, segments=None, prune=PRUNE):
    """{"chosen", "replay": {algo: seconds}, "pruned": [algo], "ratio"} for one point of the
    sweep. The replay is exact (segments=None: one segment per chunk): with 8 segments per
    message it charged the tree fold, whose few large messages cross 2·log2(m) + 2 dependent
    hops, a fill of 1/8 of a message per hop (36.6 ms against 22.7 exact at 24 hosts x 2 NICs,
    1 GiB, which made the closed-form choice look 1.44x off). Candidates priced above `prune`
    times the chosen one's replay are not replayed; prune=None replays them all. A price reads
    at most 1.62x its replay on grid(40) (the degraded schedule at 4 x 2 NICs, loss 3/4,
    8 MiB), so a candidate pruned at 1.6 replays at least 1.6 / 1.62 = 0.988 of the chosen
    one's time: pruning can hide at most 1.3% of the 3% the sweep allows."""
    from .. import planner
    from .cluster import Cluster
    fab, st, eager, chosen = point(H, K, loss, nbytes, rate, alpha)
    prices = planner.evaluate("allreduce", H, nbytes, 4, st, eager=eager)

    def run(a):
        sc = planner.build_all("allreduce", H, nbytes, 4, eager=eager, algo=a, state=st)
        return Cluster(fab, segments=segments).run_schedules(sc)["time_s"]
    replay = {chosen: run(chosen)}
    pruned = []
    for a in planner.candidates("allreduce", H, st):
        if a == chosen:
            continue
        if prune is not None and prices.get(a, 0.0) > prune * replay[chosen]:
            pruned.append(a)
            continue
        replay[a] = run(a)
    return {"hosts": H, "nics": K, "loss": loss, "bytes": nbytes, "chosen": chosen,
            "prices": prices, "replay": replay, "pruned": pruned,
            "ratio": replay[chosen] / min(replay.values())}


def crosscheck(H, K, G, loss, nbytes, rate=1.25e9, alpha=25e-6, segments=None):
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


COLL_GRID = ((2, 3, 4, 8, 16), (2, 4, 8), (2, 8), (0.0, 0.5, 1.0), (1.25e9, 50e9),
             ("allgather", "reduce_scatter_block", "bcast"), (64 << 10, 4 * MiB))


def collective_grid(max_ranks=64):
    """Every point of COLL_GRID (hosts, ranks per host, NICs, loss, NIC rate, collective,
    bytes per rank) of at most max_ranks ranks: 1,008 points."""
    return [c for c in itertools.product(*COLL_GRID) if c[0] * c[1] <= max_ranks]


def collective_case(H, G, K, loss, rate, coll, nbytes, alpha=25e-6, intra_bw=8e9):
    """The flat and the hierarchical plan of `coll` on H hosts x G ranks (K NICs at `rate`,
    NIC 0 of the last host losing `loss`), every rank planned (a flat fabric): both replayed
    exactly, the closed-form choice (planner.choose) and cost.py's over every rank's
    schedules. {"chosen", "cost_py", "replay": {algo: s}, "ratio", "cost_py_ratio"}."""
    from .. import planner
    from ..planner import cost
    from .cluster import Cluster
    from .fabric import Fabric
    from .predict import EFFICIENCY
    fab = Fabric(H, K, rate, G, EFFICIENCY, alpha, intra_bw=intra_bw)
    if loss:
        fab.degrade(H - 1, 0, 1.0 - loss)
    st = fab.state(flat=True)
    n, replay, old = st.n, {}, {}
    for a in ("flat", "hierarchical"):
        sc = planner.build_all(coll, n, nbytes, 4, 0, 64 << 10, a, st)
        old[a] = cost.predict(sc, st)
        replay[a] = Cluster(fab, flat=True).run_schedules(sc)["time_s"]
    chosen = planner.choose(coll, n, nbytes, 4, st, 0, 64 << 10)
    chosen = chosen if chosen in replay else "flat"
    by_cost = planner.price.cheapest(old)
    best = min(replay.values())
    return {"hosts": H, "ranks_per_host": G, "nics": K, "loss": loss, "rate": rate,
            "coll": coll, "bytes": nbytes, "chosen": chosen, "cost_py": by_cost,
            "replay": replay, "ratio": replay[chosen] / best,
            "cost_py_ratio": replay[by_cost] / best}


BOUND_HOSTS = (3, 4, 8, 16, 32, 64, 128, 256, 512)
BOUND_RATES = (0.0, 0.25, 0.5, 0.875)      # the slow NIC's rate: 0 down, else that fraction


def bound_case(H, nic_rate, nbytes=256 * MiB, nics=2, rate=50e9, ranks_per_host=1):
    """replay/T* of the planner's own choice (issue 32 item 3's target: <= 1.05 at every host
    count): H hosts x `nics` NICs, the last host's last NIC down (nic_rate 0) or at nic_rate of
    its rate; every rank's schedule from planner.build() (closed-form choice, this rank's
    schedule only), replayed exactly with no per-message latency in the fabric (T* has none;
    the planner still prices with its α), as bench/SIM.md. ranks_per_host > 1: every rank of
    H x ranks_per_host planned (the hosts' local links at the fabric's intra_bw, which T*, a
    bound between hosts, does not count)."""
    import time
    from .. import planner
    from ..config import Config
    from ..planner import cost
    from .cluster import Cluster
    from .fabric import Fabric
    from .predict import EFFICIENCY
    G = ranks_per_host
    fab = Fabric(H, nics, rate, G, EFFICIENCY, 0.0)
    if nic_rate == 0:
        fab.down(H - 1, nics - 1)
    else:
        fab.degrade(H - 1, nics - 1, nic_rate)
    st = fab.state(flat=G > 1)
    n, eager = st.n, Config().eager
    t0 = time.process_time()
    sc = [planner.build("allreduce", r, n, nbytes, 4, 0, eager, state=st) for r in range(n)]
    plan_s = time.process_time() - t0
    res = Cluster(fab, flat=G > 1).run_schedules(sc)
    tstar = cost.lower_bound_state(nbytes, st)
    return {"hosts": H, "nic_rate": nic_rate, "bytes": nbytes, "nics": nics,
            "ranks_per_host": G, "chosen": sc[0].algo, "ratio": res["time_s"] / tstar,
            "messages": res["messages"], "plan_s": plan_s, "cpu_s": time.process_time() - t0}
