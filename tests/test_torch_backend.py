"""The torch.distributed backend "r2comm" (r2comm/torch) against Gloo, in real multi-rank jobs
launched by torchrun (env:// rendezvous, TCPStore) and by mpiexec (FileStore, no MPI_Init).
The scenarios are in tests/torch_worker.py."""
import ast
import os
import subprocess
import sys

import pytest


from conftest import ROOT, mpiexec_path
from r2comm.control.ports import free_port
from torch_helpers import TORCH as _TORCH, WHY as _WHY, gated_testbed_run, torch_env as _env

pytestmark = pytest.mark.skipif(not _TORCH, reason=_WHY)
WORKER = os.path.join(ROOT, "tests", "torch_worker.py")
# checks a "collectives" job passes (its OK line): every one of them ran, none was skipped
COLLECTIVE_CHECKS = {2: 194, 3: 212, 4: 232}


def _run(cmd, env, timeout, what):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                           timeout=timeout, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} did not finish in {timeout} s:\n{(exc.output or '')[-4000:]}")
    return p.returncode, p.stdout


def run_torchrun(n, scenario, env=None, timeout=180):
    """torchrun (torch.distributed.run) on one node, static rendezvous on loopback. A port
    lost to another socket between choosing it and the rendezvous listening on it (before any
    rank ran) is a launch failure, not a result: that launch is retried on a new port."""
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "--monitor-interval", "0.2", WORKER, scenario]
        rc, out = _run(cmd, _env(env), timeout, f"torchrun {scenario}")
        lost_port = "EADDRINUSE" in out and "next_rendezvous" in out
        if rc == 0 or not lost_port or attempt == 2:
            return _check(n, scenario, rc, out)


def run_mpiexec(n, scenario, tmp_path, env=None, timeout=180):
    extra = {"R2T_STORE": str(tmp_path / f"store-{scenario}-{n}"),
             "MPIEXEC_TIMEOUT": str(timeout - 10)}
    extra.update(env or {})
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, WORKER, scenario]
    return _check(n, scenario, *_run(cmd, _env(extra), timeout, f"mpiexec {scenario}"))


def _check(n, scenario, rc, out):
    assert rc == 0, f"{scenario} with {n} ranks failed (rc {rc}):\n{out[-6000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, f"{scenario}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow), 4])   # (3: CI time)
def test_collectives_match_gloo_torchrun(n):
    """allreduce (SUM, PRODUCT, MIN, MAX, AVG), broadcast, reduce, all_gather(_into_tensor),
    reduce_scatter(_tensor), all_to_all(_single, even and uneven), send/recv, barrier and a
    new_group, over 10 dtypes, non-contiguous tensors: equal to Gloo (bitwise on exact data)."""
    count, out = run_torchrun(n, "collectives")
    assert count == COLLECTIVE_CHECKS[n], out[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow), 4])   # (3: CI time)
def test_collectives_match_gloo_mpiexec(n, tmp_path):
    count, out = run_mpiexec(n, "collectives", tmp_path)
    assert count == COLLECTIVE_CHECKS[n], out[-3000:]


def test_async_any_order_torchrun():
    count, _ = run_torchrun(3, "async")
    assert count == 13


@pytest.mark.mpi
@pytest.mark.slow   # CI time: the same checks under torchrun stay in CI (the launch differs)
def test_async_any_order_mpiexec(tmp_path):
    count, _ = run_mpiexec(2, "async", tmp_path)
    assert count == 13


# (mpiexec in the slow tier for CI time: the MPI bootstrap is in CI through
#  test_collectives_match_gloo_mpiexec; the errors do not depend on the launcher)
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpiexec", marks=pytest.mark.slow)])
def test_errors_through_work_wait(launcher, tmp_path):
    """Unsupported ops/dtypes: R2commArgumentError at the call; an unanswered receive:
    R2commTimeout from Work.wait(); ranks with different sizes: an r2comm error from wait();
    calls on a freed group: R2commClosedError that is a DistBackendError, sync and async."""
    if launcher == "torchrun":
        count, out = run_torchrun(2, "errors")
    else:
        count, out = run_mpiexec(3, "errors", tmp_path)
    assert count == 8, out[-3000:]


# (mpiexec in the slow tier for CI time, as test_errors_through_work_wait's)
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpiexec", marks=pytest.mark.slow)])
def test_ddp_matches_gloo(launcher, tmp_path):
    """DDP, a few steps of a tiny MLP in small gradient buckets: parameters equal Gloo's."""
    if launcher == "torchrun":
        count, out = run_torchrun(2, "ddp")
    else:
        count, out = run_mpiexec(3, "ddp", tmp_path)
    assert count == 6, out[-3000:]


def test_torch_machinery_group_names_funcol_compile_devicemesh():
    """Group names, functional collectives eager and under torch.compile (aot_eager), a
    DeviceMesh with DTensor (distribute_tensor scatters, redistribute all-gathers), sub-groups
    destroyed and made again: results equal Gloo's."""
    count, out = run_torchrun(2, "modern")
    assert count == 11, out[-3000:]


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow), 4])   # (3: CI time)
def test_new_collectives_match_gloo(n):
    """gather, scatter, gather_object, scatter_object_list, all_gather_coalesced, coalesced
    all_gather_into_tensor, BAND/BOR/BXOR (all_reduce, reduce) on integers and bool, sparse
    all_reduce, barrier(device_ids), batch_isend_irecv, recv without src (any source),
    new_subgroups(group=) with gather_object in the sub-groups (even sizes)."""
    count, out = run_torchrun(n, "newcolls")
    assert count == {2: 41, 3: 33, 4: 36}[n], out[-3000:]


def test_nested_futures_and_powersgd():
    """A future callback that starts collectives and waits on their futures completes (no
    deadlock on the completion thread); DDP with the PowerSGD hook equals Gloo's."""
    count, out = run_torchrun(2, "futures", timeout=240)
    assert count == 5, out[-3000:]


def test_dropped_async_works():
    """300 all_reduce(async_op=True) whose Works are dropped unwaited: no heap corruption,
    and the tensors hold the sums."""
    count, out = run_torchrun(2, "dropped")
    assert count == 30, out[-3000:]


def test_small_all_reduce_on_changing_memory():
    """Synchronous small all_reduces stay right where the memory under an address changes
    (reallocation, views, set_, 300 tensors), give every dtype and op exactly, match a peer's
    asynchronous call, and take tensors of other shapes; tensors past their storage raise
    R2commBufferError (4 cases)."""
    count, out = run_torchrun(2, "lean")
    assert count == 48 + 35 + 2 + 4 + 4, out[-3000:]


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_comm_debug_counts_equal_gloos(n):
    """CommDebugMode's counts (c10d.allreduce_, c10d._allgather_base_,
    c10d._reduce_scatter_base_, ...) and the profiler's c10d ops of one step on the r2comm
    group equal those of the same step on a Gloo group, results too (reduce_scatter_tensor
    with BAND, BOR, BXOR included), and an FSDP2 step with gradient accumulation counts the
    same collectives on both (issue 42: was {} on the Python group)."""
    count, out = run_torchrun(n, "debug_counts")
    assert count == 14, out[-3000:]


def test_shrink_and_abort():
    """dist.shrink_group on an r2comm group (3 ranks, the last excluded: the others' group of
    2 reduces their tensors) and a group's abort() ending a Work in flight with torch's error
    type at once; later calls raise."""
    count, out = run_torchrun(3, "shrink_abort")
    assert count == 4, out[-3000:]


def test_group_timeout_is_the_groups_own():
    """new_group(timeout=1 s): its barrier without peers raises torch's DistBackendError (and
    R2commTimeout) saying "timed out" within seconds, not after the world's 60 s."""
    count, out = run_torchrun(2, "group_timeout", env={"R2T_TIMEOUT": "60"})
    assert count == 1 and "sub-group barrier raised after" in out, out[-3000:]


def _losses(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("LOSSES ")]
    assert lines, out[-3000:]
    return lines[-1].split()[1:]


def _failures(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("EVENTS ")]
    assert lines, out[-3000:]
    return int(lines[-1].split()[1])


_FAILURE_KINDS = ("rail_failed", "peer_lost", "rail_never_up", "peer_stalled")


def _rank0_failures(out):
    """Rank 0's rail and peer failures (EVENT_KINDS): a healthy run has none, though on a
    loaded machine the start-up bandwidth probe may measure a NIC slow and the plans adapt
    (nic_down at a fraction, replanned), which changes no result."""
    lines = [ln for ln in out.splitlines() if ln.startswith("EVENT_KINDS rank 0 ")]
    assert lines, out[-3000:]
    kinds = ast.literal_eval(lines[-1][len("EVENT_KINDS rank 0 "):].split("}", 1)[0] + "}")
    return sum(kinds.get(k, 0) for k in _FAILURE_KINDS)


_TWO_RAILS = {"R2COMM_RAILS": "127.0.0.1,127.0.0.2", "R2T_STEPS": "20", "R2T_NO_GLOO": "1"}


@pytest.fixture(scope="module")
def clean_run():
    """20 DDP steps on two rails, no failure: the reference losses."""
    _, out = run_torchrun(3, "ddp", env=_TWO_RAILS)
    assert _failures(out) == 0, out[-2000:]
    assert len(_losses(out)) == 20
    return out


# (the R2COMM_FAULT variant in the slow tier for CI time: the injected byte-count fault is in
#  CI through the engine's own tests, test_failover.py)
@pytest.mark.parametrize("how", [pytest.param("R2COMM_FAULT", marks=pytest.mark.slow),
                                 "fail_rail"])
def test_ddp_losses_bitwise_through_nic_failure(how, clean_run):
    """Two rails; rank 1's rail 0 fails (hard) mid-training: by R2COMM_FAULT (after a byte
    count) or by fail_rail() before step 5 and restore_rail() before step 12. The losses are
    bitwise those of the fault-free run, and the failure really happened (engine events)."""
    env = dict(_TWO_RAILS)
    if how == "R2COMM_FAULT":
        env["R2COMM_FAULT"] = "rank=1,rail=0,after_bytes=1000,mode=hard"
    else:
        env["R2T_FAIL"] = "5:12"
    _, faulty = run_torchrun(3, "ddp", env=env)
    assert _failures(faulty) > 0, faulty[-2000:]
    assert _losses(faulty) == _losses(clean_run)


def _testbed_ddp(fabric, fail_at=None, restore_at=None, timeout=200):
    """torch_worker ddp on the fabric through `testbed torchrun` (2 hosts x 1 rank); from step
    fail_at to step restore_at, host 1's nic0 is down for real (ip link set down). Rank 0 waits
    at both steps until the link has changed (R2T_GATE), however late its output reaches us."""
    # Width 256 and one bucket: some 280 KB of gradients per step, in 16 KiB chunks striped
    # over both rails. With the tiny default model every allreduce is a single chunk, which
    # the scheduler puts on the rail measured fastest: nic0 then may carry nothing while it is
    # down, and no failure happens (CI, stop 24).
    rc, out = gated_testbed_run(
        fabric, [WORKER, "ddp"], 1,
        {"R2T_STEPS": "20", "R2T_NO_GLOO": "1", "R2T_PRINT_STEPS": "1", "R2T_WIDTH": "256",
         "R2T_BUCKET_MB": "4", "R2COMM_CHUNK_SIZE": "16K", "R2T_STEP_SLEEP": "0.1"},
        fail_at, restore_at, timeout)
    assert rc == 0 and "OK ddp" in out, out[-4000:]
    return out


@pytest.mark.netns
def test_testbed_torchrun_ddp_through_real_nic_failure(netns_ok):
    """`python -m r2comm.testbed torchrun`: one torchrun per host namespace, rendezvous over
    the management network. Host 1's nic0 goes down for real mid-training and comes back:
    the losses equal the healthy run's bitwise."""
    from r2comm.testbed.fabric import Fabric
    fabric = Fabric(hosts=2, nics=2, rate="1gbit", tag=f"t18{os.getpid() % 1000}").up()
    try:
        healthy = _testbed_ddp(fabric)
        assert _rank0_failures(healthy) == 0, healthy[-2000:]
        faulty = _testbed_ddp(fabric, fail_at=4, restore_at=12)
    finally:
        fabric.down()
    assert _failures(faulty) > 0, faulty[-2000:]
    assert len(_losses(healthy)) == 20
    assert _losses(faulty) == _losses(healthy)
