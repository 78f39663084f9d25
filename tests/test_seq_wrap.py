"""Issue 28 item 5: counters that wrap, in real multi-rank jobs. A host communicator's uint32
sequence crosses 2**32 (old code: OverflowError from post, and every later call failed), and a
GPU twin id comes back after 2**30 device calls (old code: its frames dropped as stale, the call
timed out). The engine-level cases are in tests/test_engine_limits.py."""
import pytest

from conftest import ROOT, run_mpi, run_scenario

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_host_sequence_wraps_at_2_32(n):
    count, _ = run_scenario(n, "seqwrap", timeout=60)
    assert count == n * (16 + 5 + 4 + 2)


def test_gpu_twin_ids_come_back_after_2_30_calls():
    rc, out = run_mpi(2, [f"{ROOT}/tests/gpu_worker.py", "standin_twinwrap", "timeout=20"],
                      timeout=90, env={"R2COMM_GPU_SEGMENT": "4096"})
    lines = [ln for ln in out.splitlines() if ln.startswith("OK standin_twinwrap ")]
    assert lines, out[-4000:]
    assert int(lines[-1].split()[2]) == 2 * 20
