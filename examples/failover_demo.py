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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NBYTES = 4 << 20
STREAM_STARTS = "[demo] streaming: "     # rank 0's line as the stream starts (the fault's clock)


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
    # agree on a number of operations that lasts about args.seconds (timed after a warm-up)
    for _ in range(3):
        comm.Allreduce(x, y)
    t0 = time.perf_counter()
    for _ in range(5):
        comm.Allreduce(x, y)
    per_op = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 5
    iters = max(30, int(args.seconds / per_op))
    fail_at, restore_at = iters // 3, 2 * iters // 3
    if r == 0:
        print(f"{STREAM_STARTS}{n} ranks, {len(comm.rails)} rails per rank "
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
    rails, waited = wait_for_failback(comm, args.failback_wait)
    events = comm.events
    summary = world.gather((r, [(ra.index, ra.address, ra.state, ra.bytes_sent, ra.failures)
                                for ra in rails],
                            [(e["kind"], e["peer"], e["rail"], e["detector"], e["nbytes"])
                             for e in events], max(times), waited), root=0)
    if r == 0:
        for rank, rl, evs, worst, _ in summary:
            kinds = {}
            for e in evs:
                kinds[e[0]] = kinds.get(e[0], 0) + 1
            print(f"[demo] rank {rank}: rails " + "; ".join(
                f"#{i} {a} {state_text(st)} sent {b / 2**20:.0f} MiB failures {f}"
                for i, a, st, b, f in rl)
                + f" | events {kinds} | slowest op {worst * 1e3:.0f} ms", flush=True)
        failures = sum(1 for _, _, evs, _, _ in summary for e in evs if e[0] == "rail_failed")
        pending = sum(1 for _, rl, _, _, _ in summary for ra in rl if ra[2] != "up")
        longest = max(w for *_, w in summary)
        print("[demo] fail-back: " + (f"every rail up again ({longest:.1f} s after the stream)"
                                      if not pending else
                                      f"{pending} rail(s) still pending after {longest:.0f} s"),
              flush=True)
        print(f"[demo] {iters * n} results checked bit-for-bit: {bad} wrong; "
              f"{failures} rail failures seen by the ranks", flush=True)
        if bad or failures == 0:
            print("[demo] FAILED", flush=True)
    comm.Free()
    if bad:
        sys.exit(1)


def wait_for_failback(comm, limit_s):
    """(comm.rails, seconds waited): polls until every rail is up again or limit_s passed."""
    t0 = time.monotonic()
    rails = comm.rails
    while any(ra.state != "up" for ra in rails) and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)
        rails = comm.rails
    return rails, time.monotonic() - t0


def state_text(state):
    """A rail's state for the report: a rail not up after the wait is still to come back."""
    return state if state == "up" else f"{state} (fail-back pending)"


def mpiexec():
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


def run_loopback(seconds, failback_args):
    print("[demo] loopback rails 127.0.0.1 and 127.0.0.2; rank 1 will fail rail 0", flush=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "MPIEXEC_TIMEOUT": "180"}
    return subprocess.call([mpiexec(), "-n", "4", sys.executable, __file__, "--rank",
                            "--inject", "--seconds", str(seconds), *failback_args], env=env)


def run_testbed(seconds, failback_args):
    sys.path.insert(0, ROOT)
    from r2comm.testbed import Fabric
    with Fabric(hosts=2, nics=2, rate="1gbit", tag="demo") as fab:
        print(f"[demo] testbed up: 2 hosts x 2 NICs at 1 gbit; host 0 NICs {fab.rails(0)}, "
              f"host 1 NICs {fab.rails(1)}", flush=True)
        p = fab.mpiexec(4, [sys.executable, __file__, "--rank", "--seconds", str(seconds),
                            *failback_args], timeout=240, stdout=subprocess.PIPE, text=True)
        fault = None
        for line in p.stdout:       # the ranks' output, passed on; the fault is timed from the
            print(line, end="", flush=True)     # line rank 0 prints as the stream starts
            if fault is None and line.startswith(STREAM_STARTS):
                fault = threading.Thread(target=nic_flap, args=(fab, p, seconds), daemon=True)
                fault.start()
        rc = p.wait()
        if fault is not None:
            fault.join()
        return rc


def nic_flap(fab, job, seconds):
    """Take host 1's NIC 0 down a third into the stream and up again at two thirds (skipped
    once the job has ended)."""
    for pause, up in ((seconds / 3, False), (seconds / 3, True)):
        time.sleep(pause)
        if job.poll() is not None:
            return
        if up:
            print("[demo] ip link set nic0 up on host 1", flush=True)
            fab.nic_up(1, 0)
        else:
            print("[demo] ip link set nic0 down on host 1 (a real NIC failure)", flush=True)
            fab.nic_down(1, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inject", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loopback", action="store_true", help="do not use the netns testbed")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of the stream")
    ap.add_argument("--failback-wait", type=float, default=10.0,
                    help="after the stream, wait up to this long for every rail to be up again "
                         "before the report (a rail still down is reported as fail-back pending)")
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    use_testbed = (not args.loopback and os.geteuid() == 0 and shutil.which("ip")
                   and shutil.which("tc"))
    failback_args = ["--failback-wait", str(args.failback_wait)]
    rc = (run_testbed(args.seconds, failback_args) if use_testbed
          else run_loopback(args.seconds, failback_args))
    sys.exit(rc)


if __name__ == "__main__":
    main()
