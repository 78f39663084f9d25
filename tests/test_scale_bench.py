"""bench/scale.py (issue 31): real 2- and 4-rank jobs on loopback (the ring forced, as the issue's
mix asks); the table's fields are sane
and r2comm's fds follow today's full mesh (3 per peer with 2 rails, plus listeners and the
engine's own), as the model says."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, f"{ROOT}/bench")
import scale  # noqa: E402


def test_model_full_mesh():
    """The model's figures at the issue's scale: 1,024 ranks x 8 NICs."""
    tcp = scale.model(1024, 8)
    verbs = scale.model(1024, 8, "verbs")
    assert tcp["fds"] == 1023 * 9 + 9 + scale.ENGINE_FDS + scale.DETECTOR_FDS and tcp["qps"] == 0
    assert verbs["qps"] == 8184 and verbs["pinned_bytes"] == 8 * 6 * 2**20   # 8 device pools
    assert scale.model(8, 8, "verbs")["pinned_bytes"] == verbs["pinned_bytes"]  # whatever n
    from r2comm.config import Config
    cfg = Config()                      # the model's pool is the settings' defaults
    assert scale.VERBS_POOL == (cfg.verbs_recv_slots + cfg.verbs_send_slots) * 64 * 1024
    assert verbs["fds"] == 1023 * (8 * 3 + 1) + 9 + scale.ENGINE_FDS + scale.DETECTOR_FDS
    from r2comm.control import liveness
    assert scale.DETECTOR_FDS == liveness.STEADY_FDS
    assert scale.model(64, 8, "verbs")["qps"] == 504


def test_model_on_demand_is_logarithmic():
    """Connections on demand: ring (2) + binary tree (3) + log2 n partners, never the mesh."""
    assert scale.on_demand_peers(2) == 1 and scale.on_demand_peers(8) == 7
    assert scale.on_demand_peers(1024) == 15 and scale.on_demand_peers(8192) == 18
    m = scale.model_on_demand(1024, 8, "verbs")
    assert m["qps"] == 15 * 8 and m["pinned_bytes"] == 8 * scale.VERBS_POOL
    old = scale.model(1024, 8, "verbs", slab_per_qp=True)           # before issue 31
    assert old["pinned_bytes"] == 8184 * 3 * 2**20
    assert m["fds"] < scale.model(1024, 8, "verbs")["fds"] / 50


def test_records_cost_runs_start_ups_own_checks_on_valid_records():
    """records_cost's synthetic records pass the bootstrap's validation (so the figure is of
    the real checks), the records' bytes grow as n and every row is filled."""
    from r2comm.control import bootstrap
    eps = bootstrap.validate_endpoints([json.loads(b) for b in scale.synthetic_records(64)], 64)
    assert len({ep["host_key"] for ep in eps}) == 8 and len(eps[0]["rails"]) == 8
    rows = scale.records_cost((64, 256))
    assert [r["n"] for r in rows] == [64, 256]
    assert 3.9 < rows[1]["record_bytes"] / rows[0]["record_bytes"] < 4.1, rows
    assert all(r["ms"] > 0 and r["us_per_rank"] > 0 for r in rows), rows


@pytest.mark.mpi
def test_scale_bench_small(tmp_path):
    cmd = [sys.executable, f"{ROOT}/bench/scale.py", "--ns", "2,4", "--out", str(tmp_path),
           "--timeout", "90", "--budget", "200", "--algo", "ring"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "first 1 MiB ms" in p.stdout and "tcp   1024" in p.stdout, p.stdout
    report = json.loads((tmp_path / "scale.json").read_text())
    assert report["skipped"] == {}, report["skipped"]
    by_n = {s["n"]: s for s in report["summaries"]}
    assert sorted(by_n) == [2, 4]
    for n, s in by_n.items():
        assert s["ranks"] == n and s["rails_down"]["max"] == 0 and s["mix_algo"] == ["ring"], s
        assert 0 < s["startup_s"]["median"] <= s["startup_s"]["max"] < 60, s
        assert 0 < s["first_ms"]["median"] < 10_000 and s["pinned_kib"]["max"] == 0, s
        assert 20 < s["rss_mib"]["median"] < 4096, s
        assert s["fds_start"]["median"] > s["fds_before"]["median"], s
        assert s["fds_r2comm"]["median"] == s["fds_r2comm"]["max"] == s["model_fds"], s
    # the report's section and figure (bench/RESULTS.md, results_scale.py)
    from r2comm.bench.results_format import Results
    from r2comm.bench.results_scale import scale_section
    lines, targets = scale_section(Results(str(tmp_path)))
    text = "\n".join(lines)
    assert "| 2 |" in text and "| 4 |" in text and "on demand | verbs | 15 |" in text, text
    assert targets and targets[0][1] is None                    # n = 8 and 32 not measured
    assert "1,024 ranks" in text and "8,192 ranks" in text, text   # records_cost's sentence
    assert (tmp_path / "scale.png").stat().st_size > 10_000
    # two more peers: 2 x (2 rails + control) more fds per rank
    assert by_n[4]["fds_r2comm"]["median"] - by_n[2]["fds_r2comm"]["median"] == 6
