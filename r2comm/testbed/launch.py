"""Launch a torchrun job across the fabric the way LLM jobs launch: one torchrun per host
namespace (node rank = host), --nproc-per-node ranks each, rendezvous over the management
network (host 0's management address). Every rank inherits its host's environment (exec:
R2COMM_RAILS, R2COMM_CTRL_ADDR, ...), so a training script runs unchanged.

Gloo, for comparison runs, picks its interface from GLOO_SOCKET_IFNAME, set to rail 0 (nic0)
unless given: Gloo then runs on one NIC, and a failure of that NIC hits it."""
import os
import signal
import subprocess
import sys
import time

from ._iproute import TestbedError


def torchrun_commands(fabric, argv, nproc=1, port=None, tag=None):
    """One command per host: `testbed exec --host h -- python -m torch.distributed.run ...`."""
    if not argv:
        raise TestbedError("torchrun needs a script after --")
    port = port or 29400 + os.getpid() % 1000
    cmds = []
    for h in range(fabric.hosts):
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(fabric.hosts),
               "--node-rank", str(h), "--nproc-per-node", str(nproc),
               "--master-addr", fabric.mgmt_addr(0), "--master-port", str(port),
               "--monitor-interval", "0.2", *argv]
        cmds.append([sys.executable, "-m", "r2comm.testbed", "exec", "--tag", fabric.tag,
                     "--host", str(h), "--", *run])
    return cmds


def torchrun(fabric, argv, nproc=1, port=None, timeout=None):
    """Run the job; returns the worst exit status. A host that fails, or the timeout, ends
    the others (SIGTERM, then SIGKILL)."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "nic0")
    procs = [subprocess.Popen(c, env=env, start_new_session=True)
             for c in torchrun_commands(fabric, argv, nproc, port)]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(abs(c) for c in codes)
            failed = any(c not in (None, 0) for c in codes)
            if failed or (deadline is not None and time.monotonic() > deadline):
                if not failed:
                    print(f"r2comm.testbed torchrun: timed out after {timeout:g} s",
                          file=sys.stderr)
                _stop(procs)
                return max(abs(p.returncode or 1) for p in procs)
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _stop(procs):
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)       # its own session: torchrun and its ranks
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)
