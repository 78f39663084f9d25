"""r2comm demo: a stream of allreduces that survives a NIC failure, every result checked.

    python examples/failover_demo.py            # picks the testbed when root, else loopback
    python examples/failover_demo.py --loopback # 4 ranks on loopback rails, injected silent fault

Testbed mode builds 2 hosts x 2 NICs (1 gbit each) in network namespaces, starts 4 ranks
(2 per host), takes NIC 0 of host 1 down for real (`ip link set down`) while they run, and brings
it back later. Loopback mode has rank 1 fail rail 0 silently (its NIC drops everything) and
restore it. Each rank compares every result with the fault-free answer, bit for bit.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NBYTES = 4 << 20


def rank_main(args):
    import numpy as np
    from mpi4py import MPI
    import r2comm

    world = MPI.COMM_WORLD
    if args.inject:
        # loopback: all 4 ranks share this machine; tell r2comm they sit on 2 emulated hosts, so
        # ranks 0,1 and 2,3 meet through shared memory and the pairs across hosts use the
        # loopback "NICs" that rank 1's injected failure hits
        os.environ["R2COMM_HOST"] = f"demo-host{world.rank // 2}"
    comm = r2comm.Communicator(world, timeout=60)
    r, n = comm.rank, comm.size
    count = NBYTES // 4
    x = ((np.arange(count, dtype=np.int64) * (r + 3)) % 1000).astype(np.float32)
    ref = sum(((np.arange(count, dtype=np.int64) * (k + 3)) % 1000).astype(np.float32)
              for k in range(n))
    y = np.empty_like(x)
    # agree on a number of operations that lasts about args.seconds
    t0 = time.perf_counter()
    for _ in range(5):
        comm.Allreduce(x, y)
    per_op = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 5
    iters = max(30, int(args.seconds / per_op))
    fail_at, restore_at = iters // 3, 2 * iters // 3
    if r == 0:
        print(f"[demo] {n} ranks, {len(comm.rails)} rails per rank "
              f"({', '.join(ra.address for ra in comm.rails)}), {iters} allreduces of "
              f"{NBYTES >> 20} MiB, ~{per_op * 1e3:.1f} ms each", flush=True)
    bad, times = 0, []
    for i in range(iters):
        if args.inject and r == 1 and i == fail_at:
            print(f"[demo] rank 1: failing rail 0 silently (its NIC drops every packet) at op {i}",
                  flush=True)
            comm.fail_rail(0, mode="silent")
        if args.inject and r == 1 and i == restore_at:
            print(f"[demo] rank 1: restoring rail 0 at op {i}", flush=True)
            comm.restore_rail(0)
        t = time.perf_counter()
        comm.Allreduce(x, y)
        times.append(time.perf_counter() - t)
        if not np.array_equal(y, ref):
            bad += 1
    bad = world.allreduce(bad)
    time.sleep(0.5)          # let fail-back probes finish before the summary
    rails = comm.rails
    events = comm.events
    summary = world.gather((r, [(ra.index, ra.address, ra.state, ra.bytes_sent, ra.failures)
                                for ra in rails],
                            [(e["kind"], e["peer"], e["rail"], e["detector"], e["nbytes"])
                             for e in events], max(times)), root=0)
    if r == 0:
        for rank, rl, evs, worst in summary:
            kinds = {}
            for e in evs:
                kinds[e[0]] = kinds.get(e[0], 0) + 1
            print(f"[demo] rank {rank}: rails " + "; ".join(
                f"#{i} {a} {st} sent {b / 2**20:.0f} MiB failures {f}" for i, a, st, b, f in rl)
                + f" | events {kinds} | slowest op {worst * 1e3:.0f} ms", flush=True)
        failures = sum(1 for _, _, evs, _ in summary for e in evs if e[0] == "rail_failed")
        print(f"[demo] {iters * n} results checked bit-for-bit: {bad} wrong; "
              f"{failures} rail failures seen by the ranks", flush=True)
        if bad or failures == 0:
            print("[demo] FAILED", flush=True)
    comm.Free()
    if bad:
        sys.exit(1)


def mpiexec():
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


def run_loopback(seconds):
    print("[demo] loopback rails 127.0.0.1 and 127.0.0.2; rank 1 will fail rail 0", flush=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "MPIEXEC_TIMEOUT": "180"}
    return subprocess.call([mpiexec(), "-n", "4", sys.executable, __file__, "--rank",
                            "--inject", "--seconds", str(seconds)], env=env)


def run_testbed(seconds):
    sys.path.insert(0, ROOT)
    from r2comm.testbed import Fabric
    with Fabric(hosts=2, nics=2, rate="1gbit", tag="demo") as fab:
        print(f"[demo] testbed up: 2 hosts x 2 NICs at 1 gbit; host 0 NICs {fab.rails(0)}, "
              f"host 1 NICs {fab.rails(1)}", flush=True)
        p = fab.mpiexec(4, [sys.executable, __file__, "--rank", "--seconds", str(seconds)],
                        timeout=240)
        time.sleep(3.0 + seconds / 3)
        print("[demo] ip link set nic0 down on host 1 (a real NIC failure)", flush=True)
        fab.nic_down(1, 0)
        time.sleep(seconds / 3)
        print("[demo] ip link set nic0 up on host 1", flush=True)
        fab.nic_up(1, 0)
        return p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inject", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loopback", action="store_true", help="do not use the netns testbed")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of the stream")
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    use_testbed = (not args.loopback and os.geteuid() == 0 and shutil.which("ip")
                   and shutil.which("tc"))
    rc = run_testbed(args.seconds) if use_testbed else run_loopback(args.seconds)
    sys.exit(rc)


if __name__ == "__main__":
    main()
