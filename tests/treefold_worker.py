"""The tree-fold AllReduce (planner/treefold.py) on the real engine under mpiexec.

    mpiexec -n N python tests/treefold_worker.py treefold [slow=R] [beta=B]

For a RailState with one slow rank (or two with slow2=), the tree fold at several split
fractions, dtypes, ops and sizes (up to several engine chunks), checked against numpy and bit for
bit across ranks (planner_worker's helpers); then through planner.build(algo="treefold").
Rank 0 prints "OK treefold <count>"."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from r2comm import planner  # noqa: E402
from r2comm.planner import treefold  # noqa: E402
from r2comm.planner.state import RailState  # noqa: E402
from mpi_worker import check, main  # noqa: E402
from planner_worker import CASES, allreduce_case  # noqa: E402


def sc_treefold(comm, args):
    n, r = comm.size, comm.rank
    slow = [int(args.get("slow", n - 1))] + ([int(args["slow2"])] if "slow2" in args else [])
    st = RailState.uniform(n, 2)
    for s in slow:
        st.scale_host(s, float(args.get("beta", 0.5)))
    check(st.degraded_ranks() == sorted(slow), f"degraded ranks seen: {st.describe()}")
    count = 0
    for frac in (None, 0.0, 0.4):
        for cnt, dtype, op in CASES:
            def fn(nbytes, isz, frac=frac):
                return treefold.allreduce_treefold(r, n, nbytes, isz, comm.channel.config.eager, st,
                                                   frac=frac)
            s = allreduce_case(comm, fn, f"tf-{frac}-{cnt}-{dtype}", cnt, dtype, op)
            check(s.algo == "treefold", s.algo)
            count += 1
    for cnt, dtype, op in CASES[2:]:
        def fn(nbytes, isz):
            return planner.build("allreduce", r, n, nbytes, isz, 0, comm.channel.config.eager, "treefold",
                                 st)
        s = allreduce_case(comm, fn, f"tf-build-{cnt}", cnt, dtype, op)
        check(s.algo == "treefold", s.algo)
        count += 1
    comm.Barrier()
    return count


SCENARIOS = {"treefold": sc_treefold}


if __name__ == "__main__":
    main(SCENARIOS, dump_after=120)
