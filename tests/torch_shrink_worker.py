"""r2comm.torch.shrink() in a real job (tests/test_torch_shrink.py): 3 ranks started by this
script (not torchrun, whose agent kills the survivors), meeting through a TCPStore the launcher
hosts; rank 2 SIGKILLs itself, ranks 0 and 1 get torch's error type from their all_reduce,
shrink the default group and all_reduce exactly on the new one; a call on the old group raises.

    python tests/torch_shrink_worker.py [deadline s]      # the launcher: prints RESULT lines
"""
import datetime
import os
import signal
import subprocess
import sys
import time

N, VICTIM = 3, 2


def rank_main(rank, port):
    import torch
    import torch.distributed as dist
    import r2comm
    import r2comm.torch

    store = dist.TCPStore("127.0.0.1", port, N, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("r2comm", store=store, rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [6.0] * 8, t
    if rank == VICTIM:
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    old = dist.group.WORLD
    try:
        dist.all_reduce(torch.ones(8))
        print(f"RESULT {rank} FAIL all_reduce after the death returned", flush=True)
        return 1
    except dist.DistError as exc:
        first = (type(exc).__name__, isinstance(exc, dist.DistNetworkError),
                 isinstance(exc, (r2comm.R2commNetworkError, r2comm.R2commRevokedError)))
    t0 = time.monotonic()
    pg = r2comm.torch.shrink()
    shrink_s = time.monotonic() - t0
    # values whose sum over the 2 survivors is exact in float32
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.25
    dist.all_reduce(x, group=pg)
    killed_at = float(store.get("killed_at").decode())
    kill_to_first = time.time() - killed_at
    want = torch.arange(1000, dtype=torch.float32) * 3 + 0.5
    exact = torch.equal(x, want)
    y = torch.full((4,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(y)                        # the default group is the new one
    try:
        old.allreduce([torch.ones(4)]).wait()
        old_err = "none"
    except dist.DistError as exc:
        old_err = type(exc).__name__ + ("/DistBackendError"
                                        if isinstance(exc, dist.DistBackendError) else "")
    print(f"RESULT {rank} first_error={first[0]} network={first[1]} r2comm_type={first[2]} "
          f"size={pg.size()} rank={pg.rank()} world={dist.get_world_size()} "
          f"get_rank={dist.get_rank(pg)} ranks={dist.get_process_group_ranks(pg)} "
          f"exact={exact} default={y.tolist() == [3.0] * 4} old_error={old_err} "
          f"shrink_s={shrink_s:.3f} kill_to_first_s={kill_to_first:.3f}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    # no exit handlers: the world's close drains the sends to the dead rank up to 10 s
    # (tests/shrink_worker.py ends the same way)
    os._exit(0)


def launch(deadline_s):
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, N, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, R2COMM_TIMEOUT=os.environ.get("R2COMM_TIMEOUT", "30"))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               str(store.port)], env=env) for r in range(N)]
    end = time.monotonic() + deadline_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(timeout=10))
    print("CODES " + " ".join(str(c) for c in codes), flush=True)
    return 0 if codes == [0, 0, -signal.SIGKILL] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.exit(rank_main(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(launch(float(sys.argv[1]) if len(sys.argv) > 1 else 90.0))
