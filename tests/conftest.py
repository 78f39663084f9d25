"""Shared helpers: launching real multi-rank jobs under the mpiexec that ships with the mpich
wheel (a project dependency, so it is never skipped)."""
import os
import shutil
import subprocess
import sys

import pytest

# mpi4py's own test files (tests/mpi4py/, vendored unmodified) run under tests/mpi4py_suite.py
# (mpiexec, the adapter), never collected by pytest directly.
collect_ignore = ["mpi4py"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mpi_worker.py")


@pytest.fixture(autouse=True)
def _nic_rails_between_local_ranks(request, monkeypatch):
    """Every rank of a test job runs on this one host, so by default each pair of ranks would
    talk through shared memory (issue 20), with no NIC rail between them to fail, probe or
    measure. Most tests exercise NIC rails: they run with R2COMM_SHM=0 (everything over TCP, as
    before shared memory), unless their module sets SHM_OK = True (it has been run and passes
    over shared memory: test_shm.py, test_collectives.py, ...) or the test sets R2COMM_SHM."""
    if not getattr(request.module, "SHM_OK", False) and "R2COMM_SHM" not in os.environ:
        monkeypatch.setenv("R2COMM_SHM", "0")


def mpiexec_path():
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = cand if os.path.exists(cand) else shutil.which("mpiexec")
    if path is None:
        pytest.fail("mpiexec not found: the mpich wheel (an install requirement) provides it")
    return path


def run_mpi(n, argv, timeout=240, env=None, expect_ok=True, mpiexec_args=(), executable=None):
    """Run `mpiexec -n n python argv...` (or `executable argv...`), bounded in time; return
    (returncode, output)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["MPIEXEC_TIMEOUT"] = str(int(timeout))
    e.update(env or {})
    cmd = [mpiexec_path(), *mpiexec_args, "-n", str(n), executable or sys.executable] + list(argv)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                           timeout=timeout + 30, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout + 30} s:\n{exc.output}")
    if expect_ok and p.returncode != 0:
        # every rank's raised error first: the tail is often other ranks' event dumps
        errs = [ln for ln in p.stdout.splitlines() if "Error: " in ln and "event:" not in ln]
        seen = ("errors raised:\n" + "\n".join(errs[:12]) + "\n...\n") if errs else ""
        pytest.fail(f"{' '.join(argv)} with {n} ranks failed (rc {p.returncode}):\n{seen}"
                    f"{p.stdout[-6000:]}")
    return p.returncode, p.stdout


def run_scenario(n, scenario, timeout=240, env=None, **kw):
    args = [f"{k}={v}" for k, v in kw.items()]
    rc, out = run_mpi(n, [WORKER, scenario] + args, timeout=timeout, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, f"{scenario}: no OK line:\n{out[-4000:]}"
    return int(lines[-1].split()[2]), out


@pytest.fixture(scope="module")
def netns_ok():
    """Skip, saying why, where network namespaces cannot be built (not root, no iproute2);
    the testbed tests that need them take this fixture."""
    from r2comm.testbed import TestbedError
    from r2comm.testbed import _iproute as iproute
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces")
    try:
        iproute.tool("ip")
        iproute.tool("tc")
    except TestbedError as exc:
        pytest.skip(str(exc))


class NoFaults:
    """Engine.faults as control/links.py asks it, for the tests' stand-in engines: no
    injected faults."""

    def injected(self, rail, peer):
        return False
