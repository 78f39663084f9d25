"""examples/torch_fsdp2_tp.py, the FSDP2 x TP demo users start from: under torchrun (4 ranks, a
2 x 2 mesh, two loopback rails) it trains, and a run whose rank 1 loses rail 0 for real at step 3
and gets it back at step 6 prints the fault-free run's loss-curve digest (bitwise equal losses)."""
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from torch_helpers import TORCH, WHY, free_port, torch_env

pytestmark = pytest.mark.skipif(not TORCH, reason=WHY)
EXAMPLE = f"{ROOT}/examples/torch_fsdp2_tp.py"


def _run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), EXAMPLE,
           "--steps", "8", "--width", "64", "--batch", "16", "--timeout", "60", "--json",
           str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=torch_env({"R2COMM_RAILS": "127.0.0.1,127.0.0.2",
                                      "R2COMM_CHUNK_SIZE": "16K"}))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    digest = re.search(r"loss-curve digest ([0-9a-f]{16})", p.stdout)
    assert digest, p.stdout[-3000:]
    return digest.group(1), json.loads(out.read_text()), p.stdout


@pytest.mark.slow   # CI time (30 s): FSDP2 + TP bitwise through a rail failure stays in CI
#   (test_torch_modern.py::test_fsdp_tp_losses_bitwise_through_rail_failure)
def test_fsdp2_tp_example_survives_a_rail_failure_bitwise(tmp_path):
    healthy, rec, _ = _run(tmp_path, "healthy")
    faulty, frec, text = _run(tmp_path, "faulty", "--fail-step", "3", "--restore-step", "6")
    assert "taking rail 0 down before step 3" in text and "bringing rail 0 back" in text, text
    assert faulty == healthy == rec["digest"] == frec["digest"]
    assert len(rec["losses"]) == 8 and rec["losses"][-1] < rec["losses"][0], rec["losses"]
    assert frec["event_kinds"], frec             # rank 0 saw the failure's events
