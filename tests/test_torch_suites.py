"""torch's own test files, unmodified, with the default group on r2comm (issue 42): each file
runs twice under pytest, once as written (Gloo) and once with tests/torch_suites/sitecustomize.py
turning the default group's "gloo" into "r2comm"; every test Gloo passes must pass on r2comm.

The files are torch's, not this project's: R2COMM_TORCH_TEST_DIR names a folder laid out as
torch's `test/` folder (a pytorch checkout's, of the installed torch's version), holding at
least the files below; without it these tests skip saying so. Slow-marked (minutes each)."""
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT
from torch_helpers import TORCH as _TORCH, WHY as _WHY, torch_env as _env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _TORCH, reason=_WHY)]
SITE = os.path.join(ROOT, "tests", "torch_suites")
TEST_DIR = os.environ.get("R2COMM_TORCH_TEST_DIR", "")
# (file under torch's test/, pytest -k expression or None, timeout s per backend)
SUITES = {
    "dtensor": ("distributed/tensor/test_dtensor.py", "DTensorTest", 1500),
    "checkpoint_cpu": ("distributed/checkpoint/test_file_system_checkpoint_cpu.py", None, 1500),
    "fsdp2_training": ("distributed/_composable/fsdp/test_fully_shard_training.py",
                       os.environ.get("R2T_FSDP2_K") or None, 2400),
}
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+?)(?:\s+-\s.*)?$")
_VERBOSE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def run_suite(path, select, backend, timeout):
    """{test id: outcome} of one pytest run of torch's file `path` with the default group on
    `backend`, and the output's tail."""
    env = _env({"R2T_SUITE_BACKEND": backend, "R2COMM_WARN_NO_SECRET": "0"})
    env["PYTHONPATH"] = os.pathsep.join([SITE, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA",
           "--override-ini", "addopts=", os.path.basename(path)]
    if select:
        cmd += ["-k", select]
    # its own session: on a timeout the whole run (torch's spawned ranks too, which hold the
    # output pipe) is killed, and the rest of the output is read with a bound
    p = subprocess.Popen(cmd, cwd=os.path.dirname(path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out = ""
        out = (out or "") + f"\n(the run did not finish in {timeout} s)"
    got = {}
    for line in out.splitlines():
        m = _LINE.match(line.strip())
        if m:
            got[m.group(2).split("::", 1)[-1]] = m.group(1)
            continue
        m = _VERBOSE.match(line.strip())      # (-v's line per test: a run cut short counts too)
        if m:
            got.setdefault(m.group(1).split("::", 1)[-1], m.group(2))
    return got, out[-6000:]


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_torch_suite_gloo_passes_pass_on_r2comm(suite):
    rel, select, timeout = SUITES[suite]
    path = os.path.join(TEST_DIR, rel)
    if not TEST_DIR or not os.path.exists(path):
        pytest.skip(f"R2COMM_TORCH_TEST_DIR does not hold torch's {rel} (a pytorch checkout's "
                    "test/ folder of the installed torch's version)")
    gloo, gloo_out = run_suite(path, select, "gloo", timeout)
    ours, ours_out = run_suite(path, select, "r2comm", timeout)
    passed = sorted(t for t, o in gloo.items() if o == "PASSED")
    lost = [t for t in passed if ours.get(t) != "PASSED"]
    summary = (f"{suite}: Gloo passed {len(passed)} of {len(gloo)}, r2comm passed "
               f"{sum(o == 'PASSED' for o in ours.values())} of {len(ours)}")
    print("SUITE", summary)
    assert passed, f"{summary}: Gloo passed nothing\n{gloo_out}"
    assert not lost, f"{summary}; not passed on r2comm: {lost}\n{ours_out}"
