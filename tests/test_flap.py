"""A short NIC flap (issue 18): host 1's NIC 0 `ip link set down` for 0.3 s, then up, twice 1.4 s
apart, under a stream of 4 MiB allreduces on 2 hosts x 2 NICs at 500 Mbit/s
(bench/testbed_flap.py). The rail must leave the striping soon after the link went down and
carry traffic again soon after it came back, for both flaps.

Before the fix the rail stayed in the striping, stalled, until its 500 ms deadline (TCP backs
off its retransmissions: the old connection does not resume when the link returns), and was
re-admitted 0.3 s after the link came back on the first flap, 0.7 s on the second (its first
fail-back probe doubled, the second flap taken for a bouncing link)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.netns, pytest.mark.mpi]


def test_short_flap_rail_back_right_after_link(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to build network namespaces")
    if not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs iproute2 (ip, tc)")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "testbed_flap.py"),
                        "--out", str(tmp_path), "--seconds", "4.5"],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.load(open(tmp_path / "testbed_flap.json"))
    assert res["wrong"] == 0
    assert len(res["flaps"]) == 2, res["flaps"]
    for f in res["flaps"]:
        t_down, t_up = f["t"]
        for rank, evs in f["rail_events"].items():
            failed = [t for k, t in evs if k == "rail_failed"]
            restored = [t for k, t in evs if k == "rail_restored"]
            assert failed and restored, (rank, f)
            assert failed[0] < 0.2, (rank, f)              # deadline: 0.5 s after the link went down
            assert restored[-1] - (t_up - t_down) < 0.2, (rank, f)   # after the link came back
