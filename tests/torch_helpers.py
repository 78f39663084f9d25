"""What the torch tests share: whether torch.distributed is here (TORCH, WHY: the skip reason
where it is not), the ranks' environment, and a testbed torchrun job whose NIC changes wait on
its GATE lines."""
import os
import shutil
import subprocess
import sys
import tempfile

from conftest import ROOT
from r2comm.control.ports import free_port

try:
    import torch.distributed as _dist
    TORCH = _dist.is_available()
    WHY = "torch.distributed is not available in this torch build"
except ImportError as exc:
    TORCH, WHY = False, f"torch is not installed ({exc}); pip install -e '.[torch]'"


def torch_env(extra):
    """os.environ with the source tree on PYTHONPATH, one OpenMP thread, R2T_TIMEOUT 60 (unless
    set), and `extra`."""
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("R2T_TIMEOUT", "60")
    e.update(extra or {})
    return e


def gated_testbed_run(fabric, worker_args, nproc, extra_env, fail_at, restore_at, timeout):
    """`r2comm.testbed torchrun` of worker_args on `fabric` (nproc ranks per host): when a rank
    prints "GATE <step>" at step fail_at (restore_at) host 1's nic0 goes down (up), then the
    job is let on (R2T_GATE: the ranks wait at those steps until the link has changed, however
    late their output reaches us). (return code, output); bounded by the launcher's --timeout."""
    gate = tempfile.mkdtemp(prefix="r2t-gate-")
    steps = ",".join(str(s) for s in (fail_at, restore_at) if s is not None)
    env = torch_env({**extra_env, "R2COMM_TESTBED_FABRIC": fabric.tag,
                     "R2T_GATE": f"{gate}:{steps}"})
    cmd = [sys.executable, "-m", "r2comm.testbed", "torchrun", "--tag", fabric.tag,
           "--nproc-per-node", str(nproc), "--port", str(free_port()),
           "--timeout", str(timeout - 20), "--", *worker_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=ROOT)
    lines = []
    try:
        for line in p.stdout:                 # bounded: the launcher ends the job at --timeout
            lines.append(line)
            if line.startswith("GATE "):
                step = int(line.split()[1])
                if step == fail_at:
                    fabric.nic_down(1, 0)
                if step == restore_at:
                    fabric.nic_up(1, 0)
                open(os.path.join(gate, f"go.{step}"), "w").close()
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        shutil.rmtree(gate, ignore_errors=True)
    return rc, "".join(lines)
