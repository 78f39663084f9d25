"""A rank's own pause (SIGSTOP) does not count against its peers (issue 28, item 8), on
loopback: deadlines are judged on the time the judging process was running.

Rank 0 waits in an allreduce that rank 1 joins late, with a 2 s operation timeout; rank 0 (or
every rank at once) is stopped for 3 s meanwhile. Rank 0 ran for well under the timeout
before rank 1 joined, so the allreduce completes exactly; before, rank 0's deadline ran on
while it was stopped and it timed out at the resume. The testbed runs (real NICs, pauses of the
peer and of the judge mid-stream): tests/test_pause_testbed.py.
"""
import re

import pytest

from conftest import run_mpi

pytestmark = pytest.mark.mpi

WORKER = str(__import__("pathlib").Path(__file__).parent / "pause_worker.py")
STOP, TIMEOUT = 3, 2        # s: the pause, the operation timeout


@pytest.mark.parametrize("who", ["peer", "both"])
def test_own_pause_does_not_time_out_the_operation(who):
    _, out = run_mpi(2, [WORKER, "selfpause", f"who={who}", f"stop={STOP}", f"op_timeout={TIMEOUT}",
                         "rails=127.0.0.1,127.0.0.2"], timeout=60)
    rows = re.findall(r"SELFPAUSE who=\w+ rank=(\d) took=([\d.]+)", out)
    assert sorted(r for r, _ in rows) == ["0", "1"], out[-3000:]
    for rank, took in rows:
        # the 3 s pause struck inside the allreduce, whose wall time then passed the 2 s
        # operation timeout without a timeout (running time counts); and nothing hung
        assert STOP <= float(took) < STOP + 15, (rank, took)
        assert float(took) > TIMEOUT, (rank, took)
    assert "OK selfpause 2" in out, out[-3000:]
