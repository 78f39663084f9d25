"""Point-to-point between a pair that lost messages while failing and then recovered (rails
failed for real, every one, then restored): later messages both ways match in the order sent,
an eager send told success arrives, nothing twice (tests/p2p_recover_worker.py, 2 ranks over
two TCP rails). Old code: a send that failed had spent a number of the pair's sequence the
receiver never saw, and every later message of the pair waited for it until its timeout."""
import os

import pytest

from conftest import run_mpi

pytestmark = pytest.mark.mpi
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "p2p_recover_worker.py")
ENV = {"R2COMM_SHM": "0", "R2COMM_PEER_TIMEOUT_MS": "600", "R2COMM_PROBE_MS": "50"}


def test_point_to_point_after_the_pair_recovers():
    _, out = run_mpi(2, [WORKER, "recover", "timeout=5"], timeout=90, env=ENV)
    assert any(ln.startswith("OK recover 2") for ln in out.splitlines()), out[-4000:]
