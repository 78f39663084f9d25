"""The demo (examples/failover_demo.py, run by scripts/demo.sh): its report waits, bounded, for
fail-back before it prints the rails, and says so for a rail that did not come back in time."""
import importlib.util
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "failover_demo.py")


def load_demo():
    spec = importlib.util.spec_from_file_location("failover_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeComm:
    """comm.rails whose rail 0 is 'degraded' until `up_after` seconds have passed."""

    def __init__(self, up_after):
        self.t0, self.up_after, self.reads = time.monotonic(), up_after, 0

    @property
    def rails(self):
        self.reads += 1
        back = time.monotonic() - self.t0 >= self.up_after
        return [SimpleNamespace(index=0, state="up" if back else "degraded"),
                SimpleNamespace(index=1, state="up")]


def test_report_waits_for_failback():
    demo = load_demo()
    comm = FakeComm(up_after=0.3)
    rails, waited = demo.wait_for_failback(comm, limit_s=5.0)
    assert [r.state for r in rails] == ["up", "up"]
    assert 0.3 <= waited < 2.0 and comm.reads > 1


def test_report_wait_is_bounded_and_says_pending():
    demo = load_demo()
    t0 = time.monotonic()
    rails, waited = demo.wait_for_failback(FakeComm(up_after=60), limit_s=0.4)
    assert 0.4 <= waited and time.monotonic() - t0 < 2.0
    assert [demo.state_text(r.state) for r in rails] == ["degraded (fail-back pending)", "up"]


@pytest.mark.mpi
def test_loopback_demo_reports_rails_after_failback():
    """The demo on loopback (4 ranks, rank 1 fails rail 0 silently and restores it): every
    result right, and no rail reported down or degraded without saying fail-back is pending."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, DEMO, "--loopback", "--seconds", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "results checked bit-for-bit: 0 wrong" in out and "FAILED" not in out, out
    assert re.search(r"\[demo\] fail-back: (every rail up again|\d+ rail\(s\) still pending)", out), out
    states = re.findall(r"#\d+ \S+ (up|degraded|down)( \(fail-back pending\))?", out)
    assert len(states) == 8, out                      # 4 ranks x 2 rails
    assert all(s == "up" or pending for s, pending in states), out
