"""The modern PyTorch stack on the torch.distributed backend: FSDP2 (fp32, bf16 mixed
precision), a 2x2 DeviceMesh with DTensor redistribute, tensor parallel (parallelize_module),
FSDP x TP, sub-groups and destroy/re-init, functional collectives eager and compiled
(aot_eager, inductor), object collectives, gather/scatter, every ReduceOp x dtype, PowerSGD and
nested futures, Join with uneven inputs, 300 dropped async works.

Each backend runs one 4-rank torchrun job (tests/torch_modern_worker.py "stack") and one 2-rank
job for inductor; every check inside compares with the same computation on Gloo groups over the
same ranks, in the same job. One pytest test per check reports that check's outcome. The Gloo
parametrisation (where the reference is Gloo itself) checks the checks; it is slow-marked, to
keep the default suite's time for the backend under test."""
import os
import sys

import pytest


from conftest import ROOT
from r2comm.control.ports import free_port
from test_torch_backend import _run
from torch_helpers import TORCH as _TORCH, WHY as _WHY, gated_testbed_run, torch_env as _env

pytestmark = pytest.mark.skipif(not _TORCH, reason=_WHY)
WORKER = os.path.join(ROOT, "tests", "torch_modern_worker.py")
if _TORCH:
    from torch_modern_worker import JOBS
    STACK_CHECKS = [name for name, _ in JOBS["stack"]]
else:
    STACK_CHECKS = []
BACKENDS = ["r2comm", pytest.param("gloo", marks=pytest.mark.slow)]


def run_job(backend, job, nprocs, tmp_path, timeout, extra_env=None):
    """One torchrun job; {check: (outcome, detail)} from rank 0's CHECK lines, and the output.
    A port taken between choosing it and the rendezvous binding it is retried."""
    env = _env({"R2T_BACKEND": backend, "R2T_TMP": str(tmp_path), "R2T_TIMEOUT": "30",
                **(extra_env or {})})
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nprocs), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "--monitor-interval", "0.2", WORKER, job]
        rc, out = _run(cmd, env, timeout, f"torchrun {job} on {backend}")
        if not ("EADDRINUSE" in out and "next_rendezvous" in out):
            break
    checks = {}
    for line in out.splitlines():
        if line.startswith("CHECK "):
            _, name, outcome, *detail = line.split(" ", 3) + [""]
            checks[name] = (outcome, " ".join(detail).strip())
    return checks, rc, out


def _judge(results, name):
    checks, rc, out = results
    if name not in checks:
        pytest.fail(f"the job ended (rc {rc}) before check {name} reported:\n{out[-5000:]}")
    outcome, detail = checks[name]
    assert outcome == "pass", f"{name}: {detail}\n{out[-5000:]}"


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request, tmp_path_factory):
    return run_job(request.param, "stack", 4, tmp_path_factory.mktemp("stack"), 420)


@pytest.fixture(scope="module", params=BACKENDS)
def inductor(request, tmp_path_factory):
    return run_job(request.param, "inductor", 2, tmp_path_factory.mktemp("inductor"), 360)


@pytest.mark.parametrize("check", STACK_CHECKS)
def test_modern_stack(stack, check):
    """One check of the 4-rank job, equal to Gloo's result in the same job."""
    _judge(stack, check)


def test_funcol_compile_inductor(inductor):
    """Functional collectives under torch.compile(backend="inductor") (a C++ compiler builds
    the CPU kernels): equal to eager on a Gloo group."""
    _judge(inductor, "funcol_compile_inductor")


def test_fsdp_tp_losses_bitwise_through_rail_failure(tmp_path):
    """r2comm on two loopback rails, 4 ranks, FSDP2 x TP on a 2x2 mesh: rank 1's rail 0 fails
    for real (fail_rail, hard) before step 4 and comes back before step 10; the 14 losses equal
    the fault-free run's bitwise, and failover events were recorded."""
    rails = {"R2COMM_RAILS": "127.0.0.1,127.0.0.2", "R2COMM_CHUNK_SIZE": "16K"}
    _judge(run_job("r2comm", "failover", 4, tmp_path, 300, rails), "fsdp_tp_rail_failure")


def _testbed_fsdp(fabric, tmp_path, fail_at=None, restore_at=None, timeout=300):
    """The worker's "testbed" job through `python -m r2comm.testbed torchrun` (2 hosts x 2 ranks,
    a 2x2 mesh whose "dp" groups cross the hosts); from step fail_at to restore_at host 1's nic0
    is down for real (ip link set down). Rank 0 waits at both steps until the link changed."""
    rc, out = gated_testbed_run(
        fabric, [WORKER, "testbed"], 2,
        {"R2T_BACKEND": "r2comm", "R2T_TMP": str(tmp_path), "R2T_TIMEOUT": "60",
         "R2T_STEPS": "14", "R2COMM_CHUNK_SIZE": "16K",
         "GLOO_SOCKET_IFNAME": "mgmt"},      # the reference groups: never failed
        fail_at, restore_at, timeout)
    assert rc == 0 and "CHECK fsdp_tp_testbed_run pass" in out, out[-4000:]
    losses = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("LOSSES ")][-1]
    events = [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("EVENTS ")][-1]
    return losses, events, out


@pytest.mark.slow       # 80 s here; the DDP version (test_torch_backend.py) runs in CI
@pytest.mark.netns
def test_testbed_fsdp_tp_through_real_nic_failure(netns_ok, tmp_path):
    """The emulated cluster (2 hosts x 2 NICs, 4 ranks, FSDP2 over the hosts x TP within
    each): host 1's nic0 goes down for real at step 4 and comes back at step 10; the 14 losses
    equal the healthy run's bitwise, and failover events were recorded."""
    from r2comm.testbed.fabric import Fabric
    fabric = Fabric(hosts=2, nics=2, rate="1gbit", tag=f"t29{os.getpid() % 1000}").up()
    try:
        healthy, healthy_events, out = _testbed_fsdp(fabric, tmp_path)
        assert healthy_events == 0, out[-2000:]
        faulty, faulty_events, out = _testbed_fsdp(fabric, tmp_path, fail_at=4, restore_at=10)
    finally:
        fabric.down()
    assert faulty_events > 0, out[-2000:]
    assert len(healthy) == 14
    assert faulty == healthy
