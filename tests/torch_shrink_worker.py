"""r2comm.torch.shrink() in a real job (tests/test_torch_shrink.py): N ranks started by this
script (not torchrun, whose agent kills the survivors), meeting through a TCPStore the launcher
hosts. For each victim in turn (a rank of the current group), the victim SIGKILLs itself; the
others get torch's error type from their next all_reduce, shrink the default group and go on
on the new one. At the end the survivors all_reduce exactly on it, a call on the first group
raises torch's error type, and each prints a RESULT line. With no victims, shrink() raises
torch's error type (nobody failed).

With GROW (one victim), the launcher starts a replacement once the victim is gone; it joins
(r2comm.torch.join) while the survivors, after their shrink, grow the default group back to
RANKS (r2comm.torch.grow); then every rank checks a broadcast of rank 0's state, an exact
all_reduce, a sub-group made after the growth, and prints a GROWN line.

With NOJOINER (no victims), every rank grows the default group by one rank that never comes:
grow raises torch's type after its store_timeout, and the default group works on (NOJOINER line).

    python tests/torch_shrink_worker.py RANKS VICTIMS DEADLINE_S [grow|nojoiner]
    # 3 1 90; 4 2,2 120; 2 "" 60; 3 1 90 grow; 2 "" 60 nojoiner
"""
import datetime
import os
import signal
import subprocess
import sys
import time

from proc_jobs import wait_all     # (this folder: bounded waits for a job's processes)


def say(line):
    """One line in one write (atomic on a pipe): the ranks share the launcher's stdout."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def after_growth(pg, tag, grow_s):
    """The checks every rank of the grown default group makes (its GROWN line)."""
    import torch
    import torch.distributed as dist
    me, n = pg.rank(), pg.size()
    state = torch.arange(1000, dtype=torch.float64) * 7 + 0.5 if me == 0 else \
        torch.empty(1000, dtype=torch.float64)
    dist.broadcast(state, 0)                       # a survivor's state reaches the joiner
    state_ok = torch.equal(state, torch.arange(1000, dtype=torch.float64) * 7 + 0.5)
    x = torch.arange(1000, dtype=torch.float32) * (me + 1) + 0.25
    dist.all_reduce(x)
    want = torch.arange(1000, dtype=torch.float32) * sum(range(1, n + 1)) + 0.25 * n
    sub = dist.new_group([n - 2, n - 1])           # a sub-group of the grown world
    sub_ok = "-"
    if me >= n - 2:
        t = torch.full((4,), float(me))
        dist.all_reduce(t, group=sub)
        sub_ok = str(t.tolist() == [float(2 * n - 3)] * 4)
    say(f"GROWN {tag} rank={me} size={n} world={dist.get_world_size()} "
        f"get_rank={dist.get_rank()} state={state_ok} exact={torch.equal(x, want)} "
        f"sub={sub_ok} grow_s={grow_s:.3f}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def join_main(size, port):
    """The replacement: joins the survivors' growth and checks the grown group."""
    import torch.distributed as dist
    import r2comm.torch
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    t0 = time.monotonic()
    pg = r2comm.torch.join(store, prefix="grow-0", timeout=30, store_timeout=60)
    after_growth(pg, "joiner", time.monotonic() - t0)


def rank_main(rank, size, victims, port, grow=None):
    import torch
    import torch.distributed as dist
    import r2comm
    import r2comm.torch

    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("r2comm", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=30))
    first_group = pg = dist.group.WORLD
    if grow == "nojoiner":                      # grow with no joiner coming: torch's type,
        t0 = time.monotonic()                   # and the group works on as before
        try:
            r2comm.torch.grow(store, 1, prefix="grow-none", store_timeout=2)
            err = "none"
        except dist.DistError as exc:
            err = f"{type(exc).__name__}:{isinstance(exc, dist.DistBackendError)}"
        waited = time.monotonic() - t0
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        say(f"NOJOINER {rank} error={err} waited={waited:.1f} "
            f"works={t.tolist() == [float(size * (size + 1) // 2)] * 4} "
            f"same_group={dist.group.WORLD is first_group}")
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
    if not victims:                             # nobody died: shrink raises torch's type
        try:
            r2comm.torch.shrink()
            say(f"RESULT {rank} FAIL: shrink with nobody failed returned")
        except dist.DistError as exc:
            say(f"RESULT {rank} error={type(exc).__name__}:"
                  f"{isinstance(exc, dist.DistBackendError)}:"
                  f"{'no_rank_failed' if 'no rank of the group failed' in str(exc) else '?'} "
                  f"revoked={r2comm.torch.communicator(pg).Is_revoked()}")
        sys.stdout.flush()
        os._exit(0)
    alive = list(range(size))                  # the original ranks of the current group
    errors, shrinks, kill_to_first = [], [], []
    for round_, victim in enumerate(victims):
        t = torch.full((8,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        assert t.tolist() == [float(sum(a + 1 for a in alive))] * 8, t
        if pg.rank() == victim:
            store.set(f"killed_at{round_}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(torch.ones(8), group=pg)
            say(f"RESULT {rank} FAIL: all_reduce after the death returned")
            return 1
        except dist.DistError as exc:
            kind = ("DistNetworkError" if isinstance(exc, dist.DistNetworkError) else
                    "DistBackendError" if isinstance(exc, dist.DistBackendError) else "?")
            ours = isinstance(exc, (r2comm.R2commNetworkError, r2comm.R2commRevokedError))
            errors.append(f"{type(exc).__name__}:{kind}:{ours}")
        t0 = time.monotonic()
        pg = r2comm.torch.shrink()
        shrinks.append(time.monotonic() - t0)
        del alive[victim]
        one = torch.ones(1)
        dist.all_reduce(one, group=pg)              # the first collective on the new group
        kill_to_first.append(time.time() - float(store.get(f"killed_at{round_}").decode()))
        assert one.item() == len(alive), one
    # values whose sum over the survivors is exact in float32
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.25
    dist.all_reduce(x, group=pg)
    want = torch.arange(1000, dtype=torch.float32) * sum(a + 1 for a in alive) + 0.25 * len(alive)
    y = torch.full((4,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(y)                          # the default group is the new one
    try:
        first_group.allreduce([torch.ones(4)]).wait()
        old_err = "none"
    except dist.DistError as exc:
        old_err = type(exc).__name__ + ("/DistBackendError"
                                        if isinstance(exc, dist.DistBackendError) else "")
    if grow == "grow":
        old_world = r2comm.torch.communicator()
        t0 = time.monotonic()
        pg = r2comm.torch.grow(store, 1, prefix="grow-0", store_timeout=60)
        grow_s = time.monotonic() - t0
        try:
            first_group.allreduce([torch.ones(4)]).wait()
            old_err = "none"
        except dist.DistError as exc:
            old_err = type(exc).__name__
        say(f"FREED {rank} old_world_closed={old_world.channel.closed} old_error={old_err}")
        after_growth(pg, f"survivor{rank}", grow_s)
    say(f"RESULT {rank} errors={','.join(errors)} size={pg.size()} rank={pg.rank()} "
          f"want_rank={alive.index(rank)} world={dist.get_world_size()} "
          f"get_rank={dist.get_rank(pg)} "
          f"ranks={','.join(map(str, dist.get_process_group_ranks(pg)))} "
          f"alive={','.join(map(str, alive))} exact={torch.equal(x, want)} "
          f"default={y.tolist() == [float(sum(a + 1 for a in alive))] * 4} old_error={old_err} "
          f"shrink_s={','.join(f'{s:.3f}' for s in shrinks)} "
          f"kill_to_first_s={','.join(f'{s:.3f}' for s in kill_to_first)}")
    dist.destroy_process_group()
    sys.stdout.flush()
    # no exit handlers: the world's close is collective and the dead ranks cannot take part
    # (tests/shrink_worker.py ends the same way)
    os._exit(0)


def launch(size, victims, deadline_s, grow=None):
    """Start the ranks (and, with grow "grow", a replacement once the victim is gone); print
    their exit codes (CODES line, the replacement's last); 0 when the victims were killed and
    the others exited 0."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, R2COMM_TIMEOUT=os.environ.get("R2COMM_TIMEOUT", "30"))
    until = time.monotonic() + deadline_s
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               str(size), ",".join(map(str, victims)), str(store.port)]
                              + ([grow] if grow else []), env=env) for r in range(size)]
    if grow == "grow":              # the replacement, once the victim is gone
        while procs[victims[0]].poll() is None and time.monotonic() < until:
            time.sleep(0.05)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--join",
                                       str(size), str(store.port)], env=env))
    wait_all(dict(enumerate(procs)), until)
    codes = [p.returncode for p in procs]
    print("CODES " + " ".join(str(c) for c in codes), flush=True)
    alive = list(range(size))
    want = [0] * len(procs)
    for v in victims:
        want[alive.pop(v)] = -signal.SIGKILL
    return 0 if codes == want else 1


def _ranks(text):
    return [int(v) for v in text.split(",") if v]


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        sys.exit(rank_main(int(sys.argv[2]), int(sys.argv[3]), _ranks(sys.argv[4]),
                           int(sys.argv[5]), (sys.argv[6:] or [None])[0]))
    if sys.argv[1] == "--join":
        sys.exit(join_main(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(launch(int(sys.argv[1]), _ranks(sys.argv[2]), float(sys.argv[3]),
                    (sys.argv[4:] or [None])[0]))
