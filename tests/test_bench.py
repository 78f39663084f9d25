"""Tests of the benchmark harness, ``python -m r2comm.bench``.

Pure parts (sizes, references, tables, failover analysis) are tested in
process.  Every subcommand is also run for real under ``mpiexec -n 2`` with
--check, which validates each result against numpy; runs that use r2comm need
its engine built, runs of the MPI and Gloo peers alone do not.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from r2comm.bench import (data, failover, osu, peers, report, results, results_failover, results_format,
                          sizes)
from r2comm.bench.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
SWEEPS = data.COLLECTIVES + ("latency", "bw")
QUICK = ["--rounds", "1", "--budget", "0.02", "-i", "50", "-x", "2", "--check"]

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


def bench(args, n=2, timeout=240, env=None):
    """Run the harness under mpiexec; fail with its output if it does not exit 0."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "r2comm.bench", *args]
    env = {**os.environ, "MPIEXEC_TIMEOUT": str(timeout), **(env or {})}  # hydra kills all ranks
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 30, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout + 30} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)}\nrc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def table_rows(stdout):
    """Numeric rows of an OSU table: [[size, col1, col2, ...], ...]."""
    return [[float(v) for v in line.split()] for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def load(path):
    with open(path) as f:
        return json.load(f)


class Runs:
    """Short harness runs shared by the tests of this module (one per name and session), written into
    one folder under run_all.sh's file names, so the RESULTS.md generator can read what the
    subcommand tests produced instead of running its own jobs."""

    def __init__(self, folder):
        self.folder, self.stdout = folder, {}

    def get(self, name, args, env=None, png=False):
        """Path of NAME.json (run on first use), its stdout in self.stdout[name]."""
        out = self.folder / f"{name}.json"
        if name not in self.stdout:
            extra = ["--plot", str(self.folder / f"{name}.png")] if png else []
            self.stdout[name] = bench([*args, "--json", str(out), *extra], env=env)
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("runs"))


def shm_run(runs):
    """allreduce_shm: r2comm vs MPI (shm) vs Gloo, from 8 B (the latency target's size)."""
    return runs.get("allreduce_shm", ["allreduce", "--peer", "mpi", "--peer", "gloo", "-m", "8:64K", *QUICK])


def failover_run(runs, mode):
    return runs.get(f"failover_{mode}", ["failover", "--size", "1M", "--duration", "2.5", "--fail-at", "0.8",
                                         "--rail", "0", "--mode", mode, "--check", "--stall-timeout", "60"],
                    png=True)


def gloo_or_skip():
    reason = peers.gloo_unavailable()
    if reason:
        pytest.skip(f"gloo peer not installed: {reason}")


# ---------------------------------------------------------------- pure parts

def test_parse_size_and_range():
    assert sizes.parse_size("8") == 8
    assert sizes.parse_size("4K") == 4096
    assert sizes.parse_size("64M") == 64 << 20
    assert sizes.parse_size("1g") == 1 << 30
    assert sizes.parse_size("2MiB") == 2 << 20
    assert sizes.parse_range("8:64M") == (8, 64 << 20)
    assert sizes.parse_range("1M") == (None, 1 << 20)
    with pytest.raises(ValueError):
        sizes.parse_size("12Q")
    with pytest.raises(ValueError):
        sizes.parse_range("1M:8")


def test_sweep_doubles_like_osu():
    assert sizes.sweep(8, 64) == [8, 16, 32, 64]
    assert sizes.sweep(0, 4) == [0, 1, 2, 4]
    assert sizes.sweep(3, 20) == [3, 6, 12]
    assert sizes.human(64 << 20) == "64M" and sizes.human(1000) == "1000"


def _simulate(kind, cases, op):
    """What each rank must receive, computed from all ranks' send buffers alone."""
    n = len(cases)
    sends = [c.send.copy() for c in cases]
    ufunc = data.OPS[op]
    if kind == "allreduce":
        total = sends[0]
        for s in sends[1:]:
            total = ufunc(total, s)
        return [total] * n
    if kind in ("allgather", "allgatherv"):
        return [np.concatenate(sends)] * n
    if kind == "gather":
        root = cases[0].root
        return [np.concatenate(sends) if r == root else sends[r][:0] for r in range(n)]
    if kind == "scatter":
        c, root = cases[0].count, cases[0].root
        return [sends[root][r * c:(r + 1) * c] for r in range(n)]
    if kind == "scan":
        out, acc = [], None
        for s in sends:
            acc = s if acc is None else ufunc(acc, s)
            out.append(acc)
        return out
    if kind == "reduce_scatter":
        c = cases[0].count
        full = sends[0]
        for s in sends[1:]:
            full = ufunc(full, s)
        return [full[r * c:(r + 1) * c] for r in range(n)]
    if kind == "bcast":
        return [sends[cases[0].root]] * n
    if kind in ("alltoall", "alltoallv"):
        c = cases[0].count
        return [np.concatenate([sends[j][r * c:(r + 1) * c] for j in range(n)]) for r in range(n)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", data.COLLECTIVES)
@pytest.mark.parametrize("op", sorted(data.OPS))
def test_references_match_a_simulated_collective(kind, op):
    n, nbytes = 3, 4096
    cases = [data.make_case(kind, nbytes, r, n, "float32", op, root=1) for r in range(n)]
    for case, want in zip(cases, _simulate(kind, cases, op)):
        np.testing.assert_array_equal(case.expected, want)
        if kind in ("gather", "scatter"):       # n blocks at the root, one elsewhere
            assert case.nbytes == case.count * n * 4
        else:
            assert case.nbytes == max(case.send.nbytes, case.recv.nbytes)
        case.reset()
        assert not case.check() or (kind == "bcast" and case.is_root) or not case.expected.size
        case.recv[...] = case.expected
        assert case.check()


def test_small_sizes_round_up_to_one_element_per_rank():
    case = data.make_case("allgather", 8, 0, 4, "float64")
    assert case.count == 1 and case.nbytes == 32


def test_busbw_factors_are_nccl_tests():
    f = {k: osu.BUSBW_FACTOR[k](4) for k in osu.BUSBW_FACTOR}
    assert f == {"allreduce": 1.5, "allgather": 0.75, "reduce_scatter": 0.75, "bcast": 1.0, "alltoall": 0.75,
                 "gather": 0.75, "scatter": 0.75, "allgatherv": 0.75, "alltoallv": 0.75, "scan": 1.0}


def test_settings_plan_respects_budget_and_bounds():
    s = osu.Settings(iters=1000, warmup=10, budget=0.25)
    assert s.plan(1e-6) == (1000, 10)
    assert s.plan(0.1) == (3, 1)  # min_iters, at least one warm-up
    assert osu.Settings(iters=7, warmup=2, budget=0).plan(5.0) == (7, 2)


class _Bench:
    messages_per_iteration = 1
    factor = 1.0
    time_of = staticmethod(osu.Collective.time_of)


def _result(lib, size, seconds):
    r = osu.Result(lib, size, size // 4, 100, 10)
    r.rounds = [(seconds, seconds * 0.9, seconds * 1.1)] * 3
    return r


def test_table_has_osu_columns_then_bandwidths_and_ratio(capsys):
    t = report.Table("allreduce", ["r2comm", "mpi-shm"], full=True)
    t.header(["test run"])
    rows = [report.metrics(_Bench(), _result("r2comm", 1 << 20, 1e-3)),
            report.metrics(_Bench(), _result("mpi-shm", 1 << 20, 2e-3))]
    t.row(rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# OSU MPI Allreduce Latency Test"
    assert out[2].startswith("# Size") and "Avg Latency(us)" in out[2] and "Iterations" in out[2]
    assert out[2].index("Avg Latency(us)") < out[2].index("busbw(GB/s)") < out[2].index("r2comm/mpi-shm")
    size, avg, lo, hi, iters, algbw, busbw, peer_us, peer_busbw, ratio = map(float, out[3].split())
    assert size == 1 << 20 and iters == 100
    assert avg == pytest.approx(1000.0) and lo == pytest.approx(900.0) and hi == pytest.approx(1100.0)
    assert algbw == pytest.approx((1 << 20) / 1.1e-3 / 1e9, rel=1e-3)  # slowest rank's time
    assert ratio == pytest.approx(2.0)


def test_parse_peers():
    assert peers.parse_peers(["mpi,gloo", "mpi"]) == ["mpi", "gloo"]
    assert peers.parse_peers(["mpi", "none"]) == []
    assert peers.parse_peers(None) == []
    assert peers.parse_peers(["r2comm-noack"]) == ["r2comm-noack"]
    with pytest.raises(ValueError):
        peers.parse_peers(["nccl"])


def test_mpi_transport_names():
    assert peers.mpi_transport({}) == "shm"
    assert peers.mpi_transport(peers.TCP_ENV) == "tcp"
    assert peers.mpi_transport({"MPIR_CVAR_NOLOCAL": "1"}) == "netmod"  # UCX still uses shm
    assert peers.mpi_transport({"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}) == "tcp"


def test_failover_window_finds_pause_and_rates():
    nbytes = 1 << 20
    ops = list(np.arange(1, 101) * 0.01)  # 100 ops, 10 ms apart, from t=0
    ops += list(1.3 + np.arange(0, 50) * 0.02)  # 300 ms pause after t=1.0, then half the rate
    w = failover.window(ops, 0.0, 1.005, ops[-1], nbytes)
    assert w["ops_before"] == 100
    assert w["rate_before"] == pytest.approx(nbytes / 0.01)
    assert w["pause_s"] == pytest.approx(0.3)
    assert w["rate_after"] == pytest.approx(nbytes / 0.02)
    assert w["gap_before_s"] == pytest.approx(0.01)


def test_failover_analysis_uses_events_without_injection():
    t0 = 100.0
    ops = list(t0 + np.arange(1, 51) * 0.01) + list(t0 + 0.7 + np.arange(50) * 0.01)
    rank = {"rank": 0, "t0": t0, "ops": ops, "wrong_results": 0, "errors": [], "t_fault": None,
            "t_restore": None, "samples": {"error": None},
            "rails": [{"index": 0, "bytes_resent": 512}, {"index": 1, "bytes_resent": 0}],
            "events": [{"t": t0 + 0.52, "kind": "rail_failed", "rank": 0, "rail": 0, "detector": 0,
                        "info": "send error"},
                       {"t": t0 + 0.6, "kind": "migrated", "rank": 0, "rail": 0, "nbytes": 4096}]}
    t_fault, t_restore, rows = failover.analyze([rank], 1 << 20, 1.0)
    assert t_fault == pytest.approx(t0 + 0.52) and t_restore is None
    row = rows[0]
    assert row["detect_s"] == 0.0 and row["detect_by"] == (0, "send error")
    assert row["migrated_s"] == pytest.approx(0.08)
    assert row["bytes_requeued"] == 4096 and row["bytes_resent"] == 512
    assert row["pause_s"] == pytest.approx(0.2)


def test_rates_interpolates_counters():
    from r2comm.bench.plot import rates
    t = [0.0, 0.1, 0.2, 0.4]
    counters = [[0, 0], [100, 0], [200, 50], [400, 50]]
    centres, r = rates(t, counters, 0.1)
    assert len(centres) == r.shape[0] == 4
    np.testing.assert_allclose(r[:, 0], [1000, 1000, 1000, 1000])
    np.testing.assert_allclose(r[:, 1], [0, 500, 0, 0])


def test_cli_parses_every_subcommand():
    p = build_parser()
    for kind in SWEEPS:
        a = p.parse_args([kind, "-m", "8:64M", "--peer", "mpi,gloo", "-f"])
        assert a.message_size == (8, 64 << 20) and a.full
    a = p.parse_args(["failover", "--mode", "silent", "--fail-at", "0.5", "--no-inject"])
    assert a.mode == "silent" and a.no_inject and a.size == 4 << 20


# ---------------------------------------------------- MPI peer (no engine needed)

@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("kind", SWEEPS)
def test_mpi_peer_sweep_checks_and_writes_json(kind, tmp_path):
    out = tmp_path / f"{kind}.json"
    stdout = bench([kind, "--no-r2comm", "--peer", "mpi", "-m", "8:64K", "-f", *QUICK, "--json", str(out)])
    rows = table_rows(stdout)
    assert rows and all(r[1] > 0 for r in rows)
    doc = load(out)
    assert doc["bench"] == kind and doc["nranks"] == 2 and doc["settings"]["check"]
    assert doc["libraries"][0]["transport"] == "shm"
    results = doc["results"]["mpi-shm"]
    assert [r["size"] for r in results] == [int(r[0]) for r in rows]
    assert all(r["time_us"] > 0 and r["iters"] >= 1 for r in results)


@needs_mpiexec
@pytest.mark.mpi
def test_mpi_tcp_environment_is_labelled(tmp_path):
    out = tmp_path / "tcp.json"
    bench(["allreduce", "--no-r2comm", "--peer", "mpi", "-m", "8:4K", *QUICK, "--json", str(out)],
          env=peers.TCP_ENV)
    doc = load(out)
    assert list(doc["results"]) == ["mpi-tcp"]
    assert doc["libraries"][0]["env"]["FI_PROVIDER"] == "tcp"


@needs_mpiexec
@pytest.mark.mpi
def test_plot_from_json_files(tmp_path):
    a, b, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "both.png"
    bench(["allreduce", "--no-r2comm", "--peer", "mpi", "-m", "8:1K", *QUICK, "--json", str(a),
           "--plot", str(tmp_path / "a.png")])
    bench(["allreduce", "--no-r2comm", "--peer", "mpi", "-m", "8:1K", *QUICK, "--json", str(b)],
          env=peers.TCP_ENV)
    assert (tmp_path / "a.png").stat().st_size > 0
    subprocess.run([sys.executable, "-m", "r2comm.bench", "plot", str(a), str(b), "-o", str(png)],
                   cwd=ROOT, check=True, timeout=120, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allreduce", pytest.param("latency", marks=pytest.mark.slow)])
def test_gloo_peer(kind, tmp_path):
    gloo_or_skip()
    out = tmp_path / "gloo.json"
    stdout = bench([kind, "--no-r2comm", "--peer", "mpi,gloo", "-m", "8:16K", *QUICK, "--json", str(out)])
    header = [line for line in stdout.splitlines() if line.startswith("# Size")][0]
    assert "mpi-shm/gloo" in header
    assert set(load(out)["results"]) == {"mpi-shm", "gloo"}


# ------------------------------------------------------- r2comm (needs the engine)

@needs_mpiexec
@pytest.mark.mpi
# CI runs the allreduce, latency and bandwidth sweeps; the other collectives' in the slow tier
# (CI time: the bench's code path is one per kind, tested by the three)
@pytest.mark.parametrize("kind", [k if k in ("allreduce", "latency", "bw") else
                                  pytest.param(k, marks=pytest.mark.slow) for k in SWEEPS])
def test_r2comm_sweep_against_mpi(kind, tmp_path):
    out, png = tmp_path / f"{kind}.json", tmp_path / f"{kind}.png"
    plot = ["--plot", str(png)] if kind == "allreduce" else []     # (one plot: CI time)
    stdout = bench([kind, "--peer", "mpi", "-m", "8:64K", "-f", *QUICK, "--json", str(out), *plot])
    header = [line for line in stdout.splitlines() if line.startswith("# Size")][0]
    assert "r2comm/mpi-shm" in header
    assert table_rows(stdout)
    doc = load(out)
    assert set(doc["results"]) == {"r2comm", "mpi-shm"}
    assert doc["libraries"][0]["name"] == "r2comm" and len(doc["libraries"][0]["rails"]) >= 1
    assert all(r["time_us"] > 0 for r in doc["results"]["r2comm"])
    assert not plot or png.stat().st_size > 0


@needs_mpiexec
@pytest.mark.mpi
def test_ack_overhead_in_one_job(tmp_path):
    """r2comm against itself without acknowledgements, interleaved; the report evaluates it."""
    out = tmp_path / "acks.json"
    stdout = bench(["allreduce", "--peer", "r2comm-noack", "-m", "1M:1M", "-f", "--rounds", "3",
                    "--budget", "0.05", "--check", "--json", str(out)])
    header = [line for line in stdout.splitlines() if line.startswith("# Size")][0]
    assert "r2comm/r2comm-noack" in header.split()
    doc = load(out)
    assert set(doc["results"]) == {"r2comm", "r2comm-noack"}
    assert doc["libraries"][1]["acks"] is False
    md = tmp_path / "R.md"
    proc = subprocess.run([sys.executable, "-m", "r2comm.bench", "results", str(tmp_path), "-o", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in md.read_text().splitlines() if ln.startswith("- Ack overhead")][0]
    assert "at 1 MiB" in line and "r2comm built first; round by round" in line and "over 3 rounds" in line
    one = results_failover.ack_overhead(doc)
    # the other build order, in a second job: the figure becomes the geometric mean of both
    rev = tmp_path / "acks_rev.json"
    bench(["allreduce", "--peer", "r2comm-noack", "--r2comm-last", "-m", "1M:1M", "--rounds", "3",
           "--budget", "0.05", "--json", str(rev)])
    two = results_failover.ack_overhead(load(rev))
    assert set(load(rev)["results"]) == {"r2comm", "r2comm-noack"}
    assert [lib["built"] for lib in doc["libraries"]] == [0, 1]
    assert [(lib["name"], lib["built"]) for lib in load(rev)["libraries"]] == [("r2comm", 1), ("r2comm-noack", 0)]
    proc = subprocess.run([sys.executable, "-m", "r2comm.bench", "results", str(tmp_path), "-o", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in md.read_text().splitlines() if ln.startswith("- Ack overhead")][0]
    both = 1 - ((1 - one[1]) * (1 - two[1])) ** 0.5
    assert f"— {results_format.fpct(both).replace('-', '−')}" in line, line
    assert "both build orders" in line and "over 6 rounds" in line
    # on one rail both stripe alike: that figure is the target's, the two-rail one is told next to it
    one_rail = tmp_path / "acks1.json"
    bench(["allreduce", "--peer", "r2comm-noack", "-m", "1M:1M", "--rounds", "3", "--budget", "0.05",
           "--json", str(one_rail)], env={"R2COMM_RAILS": "127.0.0.1"})
    assert [len(lib["rails"]) for lib in load(one_rail)["libraries"]] == [1, 1]
    proc = subprocess.run([sys.executable, "-m", "r2comm.bench", "results", str(tmp_path), "-o", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in md.read_text().splitlines() if ln.startswith("- Ack overhead")][0]
    single = results_failover.ack_overhead(load(one_rail))[1]
    assert f"— on one rail {results_format.fpct(single).replace('-', '−')}" in line, line
    assert f"On two loopback rails {results_format.fpct(both).replace('-', '−')}" in line, line
    assert "r2comm's bytes went" in line and "r2comm-noack's" in line
    assert ("**met**" in line) == (single <= results_failover.ACK_OVERHEAD)


@needs_mpiexec
@pytest.mark.mpi
def test_ab_settings_pairs_variants_in_one_job(tmp_path):
    """bench/ab_settings.py: two r2comm variants (an env setting, an engine attribute) and MPI,
    in rounds; per-round times for each, and the paired ratio lines."""
    out = tmp_path / "ab.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "bench", "ab_settings.py"), "--size", "64K",
           "--rounds", "2", "--seconds", "0.02", "--barrier", "--order", "rev", "--json", str(out),
           "R2COMM_CHUNK_SIZE=16K", "engine.tuning.spin_extend=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MPIEXEC_TIMEOUT": "100"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# 64K allreduce, 2 ranks, 2 rounds x") and "build order rev" in lines[0]
    assert lines[1].startswith("v0 R2COMM_CHUNK_SIZE=16K") and lines[2].startswith("v1 engine.tuning.spin_extend=0")
    assert any(ln.startswith("v0/v1 time per round: median ") for ln in lines)
    doc = json.loads(out.read_text())
    assert set(doc["rounds_us"]) == {"v0", "v1", "mpi"}
    assert all(len(v) == 2 and min(v) > 0 for v in doc["rounds_us"].values())
    bad = subprocess.run([MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "bench", "ab_settings.py"),
                          "engine.no_such=1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MPIEXEC_TIMEOUT": "100"})
    assert bad.returncode != 0 and "Engine has no attribute 'no_such'" in bad.stdout + bad.stderr


@needs_mpiexec
@pytest.mark.mpi
def test_r2comm_gloo_three_way(runs):
    gloo_or_skip()
    assert set(load(shm_run(runs))["results"]) == {"r2comm", "mpi-shm", "gloo"}


@needs_mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["hard", pytest.param("silent", marks=pytest.mark.slow)])
def test_failover_stream(mode, runs):
    out = failover_run(runs, mode)
    png = out.with_suffix(".png")
    assert "# r2comm failover test" in runs.stdout[f"failover_{mode}"]
    doc = load(out)
    assert doc["t_fault"] is not None
    for row in doc["analysis"]:
        assert row["wrong_results"] == 0 and row["ops_before"] > 0 and row["ops_after"] > 0
        assert row["pause_s"] is not None and row["rate_after"] > 0
    assert any(e["kind"] == "rail_failed" for r in doc["ranks"] for e in r["events"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_mpiexec
@pytest.mark.mpi
def test_failover_restore_readmits_the_rail(tmp_path):
    out = tmp_path / "restore.json"
    stdout = bench(["failover", "--size", "1M", "--duration", "2.5", "--fail-at", "0.6", "--restore-at", "1.2",
                    "--check", "--json", str(out), "--plot", ""])
    assert "after restore" in stdout
    doc = load(out)
    assert doc["t_restore"] is not None
    for row in doc["analysis"]:
        assert row["wrong_results"] == 0 and row["rate_restored"] > 0
    assert any(e["kind"] == "rail_restored" for r in doc["ranks"] for e in r["events"])


@needs_mpiexec
@pytest.mark.mpi
def test_failover_external_fault_is_found_from_events(tmp_path):
    """--no-inject: the fault comes from outside (here r2comm's own R2COMM_FAULT timer)."""
    out = tmp_path / "external.json"
    bench(["failover", "--size", "1M", "--duration", "2.5", "--no-inject", "--check", "--json", str(out),
           "--plot", ""], env={"R2COMM_FAULT": "rank=1,rail=1,after_ms=1000,mode=hard"})
    doc = load(out)
    assert doc["t_fault"] is not None and doc["t_restore"] is None
    assert all(r["t_fault"] is None for r in doc["ranks"])  # the harness injected nothing
    for row in doc["analysis"]:
        assert row["wrong_results"] == 0 and row["pause_s"] is not None and row["detect_s"] is not None


# ------------------------------------------------- bench/RESULTS.md generator

def test_results_target_sentences():
    M = 1 << 20
    text, ok = results_format.evaluate_sizes([(M, 1.1), (2 * M, 1.2), (4 * M, 1.05), (8 * M, 0.93), (64 << 10, 0.5)],
                                      M, 8 * M)
    assert not ok and text == "met at 1, 2, 4 MiB (1.05–1.20×), not met at 8 MiB (0.93×)"
    text, ok = results_format.evaluate_sizes([(M, 1.1), (4 * M, 1.3)], M, 4 * M)
    assert ok and "not measured: 2 MiB" in text
    assert results_format.evaluate_sizes([(64 << 10, 2.0)], M, 4 * M)[1] is None
    assert results_format.fsize(8) == "8 B" and results_format.fsize(64 << 20) == "64 MiB"


def test_ratio_is_per_round_median_and_disagreement_is_named():
    """Both libraries drift between rounds: the per-round ratio stays > 1 while the ratio of the
    medians falls below 1; the target sentence says both."""
    M = 1 << 20
    r2 = {"time_us": 231.0, "round_us": [242, 245, 231, 174, 178]}
    mpi = {"time_us": 213.0, "round_us": [284, 346, 209, 213, 210]}
    assert report.speed_ratio(r2, mpi) == pytest.approx(210 / 178)   # median of the five ratios
    assert report.medians_ratio(r2, mpi) == pytest.approx(213 / 231)
    assert results_format.speed(r2, mpi) == pytest.approx(210 / 178)
    assert results_format.speed(r2, mpi, paired=False) == pytest.approx(213 / 231)
    # rounds that do not pair (older files, or a different count): the ratio of the medians
    assert report.speed_ratio({"time_us": 2.0}, {"time_us": 3.0}) == 1.5
    assert report.speed_ratio({"time_us": 2.0, "round_us": [1, 2]}, {"time_us": 3.0, "round_us": [3]}) == 1.5
    assert results_format.disagreement({M: r2}, {M: mpi}) == "; the ratio of the two medians is 0.92× at 1 MiB"
    assert results_format.disagreement({M: r2}, {M: dict(mpi, time_us=300.0)}) == ""
    assert results_format.disagreement({64 << 10: r2}, {64 << 10: mpi}) == ""   # outside the target range


def test_results_with_nothing_measured_says_not_run(tmp_path):
    """An empty folder, a broken file and a skipped step: every section says why, nothing raises."""
    (tmp_path / "bcast.json").write_text("{not json")
    (tmp_path / "testbed_failover.skipped").write_text("needs root: the testbed uses network namespaces")
    md = tmp_path / "R.md"
    proc = subprocess.run([sys.executable, "-m", "r2comm.bench", "results", str(tmp_path), "-o", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = md.read_text()
    for title in ("## Targets at a glance", "## Allreduce on one host", "## Other collectives",
                  "## Failover on loopback rails", "## Multi-rail and NIC failover in the netns testbed",
                  "## Degraded-server allreduce in the testbed"):
        assert title in text
    assert "Not run: allreduce_shm not run (no `allreduce_shm.json`" in text
    assert "bcast unreadable bcast.json" in text
    assert "Not run (needs root: the testbed uses network namespaces)." in text
    assert "Not run (needs root" in text.split("## Degraded-server")[1]
    assert "✅" not in text and "❌" not in text  # nothing evaluated, nothing claimed
    assert not (tmp_path / "figures").exists()


def test_results_section_is_one_registration(tmp_path, monkeypatch):
    """A section added to results.SECTIONS appears in the document, in order, with its targets
    (or its 'not run' sentence) listed under its area in 'Targets at a glance'."""
    def example(res):
        doc = res.doc("example_section")
        out, targets = ["## Example area", ""], []
        if doc:
            out += [f"{doc['ranks']} items.", ""]
            targets.append((f"holds {doc['ranks']} items: **met**", True))
        else:
            out += [f"{res.why_missing('example_section').capitalize()}.", ""]
        return out, targets

    monkeypatch.setattr(results, "SECTIONS", results.SECTIONS + (results.Section(example, "Example area"),))
    text = results.render(str(tmp_path))
    assert text.rstrip().endswith("Not run (no `example_section.json` in the results folder).")
    assert "| Example area | Not run (no `example_section.json` in the results folder) | – not evaluated |" in text
    (tmp_path / "example_section.json").write_text(json.dumps({"ranks": 4096}))
    text = results.render(str(tmp_path))
    assert "| Example area | holds 4096 items: met | ✅ met |" in text
    assert text.index("## A slow (degraded) rail") < text.index("## Example area")


@needs_mpiexec
@pytest.mark.mpi
def test_results_from_short_runs(runs, tmp_path):
    """The generator on real short-run JSON: sections, numbers and targets computed from the files."""
    with_gloo = peers.gloo_unavailable() is None
    if with_gloo:
        shm_run(runs)
    tcp = load(runs.get("allreduce_tcp", ["allreduce", "--peer", "mpi", "-m", "8:1M", *QUICK], env=peers.TCP_ENV))
    hard = load(failover_run(runs, "hard"))
    md = tmp_path / "RESULTS.md"
    text = results.write(str(runs.folder), str(md), elapsed_s=12.0)
    assert md.read_text() == text
    r2 = {r["size"]: r for r in tcp["results"]["r2comm"]}
    mpi = {r["size"]: r for r in tcp["results"]["mpi-tcp"]}
    # the 1 MiB busbw row: r2comm and MPI-TCP busbw and their ratio, from the TCP job
    row = [line for line in text.splitlines() if line.startswith("| 1 MiB |")][0].split(" | ")
    ratio = report.speed_ratio(r2[1 << 20], mpi[1 << 20])  # per round, median over rounds
    assert row[1:4] == [f"{r2[1 << 20]['busbw_GBps']:.3f}", f"{mpi[1 << 20]['busbw_GBps']:.3f}", results_format.fratio(ratio)]
    target = [line for line in text.splitlines() if line.startswith("- busbw ≥ 1.0× MPI over TCP")][0]
    assert ("**met**" if ratio >= 1 else "**not met**") in target and "not measured: 2, 4, 8, 16, 32, 64 MiB" in target
    lat = r2[8]["time_us"] / mpi[8]["time_us"]
    assert f"r2comm takes {lat:.2f}× MPI's time" in text
    assert ("8 B allreduce latency within 3× of MPI over TCP: **met**" in text) == (lat <= 3)
    assert "MPIR_CVAR_NOLOCAL=1" in text and "-m 8:1M" in text  # the command, rebuilt from the JSON
    # failover: the failing rank's pause, and the wrong-result count
    fail_row = [r for r in hard["analysis"] if r["rank"] == hard["plot_rank"]][0]
    row = [line for line in text.splitlines() if line.startswith("| hard |")][0]
    assert f"{fail_row['pause_s'] * 1e3:.1f} ms" in row and row.endswith("| 0 |")
    assert "Failover pause, hard fault, < 20 ms:" in text
    assert "(figures/failover_hard.png)" in text and (tmp_path / "figures" / "failover_hard.png").exists()
    if with_gloo:
        assert "busbw ≥ 1.0× Gloo" in text and "| Gloo |" in text
    # what these runs did not produce is reported, not invented
    assert "healthy single rail: not evaluated (not run (no `single_rail.json`" in text
    assert "Ack overhead ≤ 3% busbw at 16 MiB: not evaluated" in text
    assert "- `failover_silent`: not run" in text or "| silent |" in text
    assert "not run (needs root" in text.lower()  # no testbed JSON among these runs
    assert "Multi-rail and NIC failover in the netns testbed" in text
    assert f"{tcp['machine']['cpus']} CPUs" in text and "took 12 s" in text


def _fake_sweep(nranks, rows):
    """An allreduce sweep JSON of r2comm vs MPICH over shared memory: rows (size, r2 us, mpi us)."""
    def row(size, us, n=nranks):
        return {"size": size, "time_us": us, "busbw_GBps": size / us / 1e3 * 2 * (n - 1) / n}
    return {"nranks": nranks, "settings": {"rounds": 5},
            "libraries": [{"name": "r2comm", "label": "r2comm"},
                          {"name": "mpi", "transport": "shm", "label": "mpi-shm"}],
            "results": {"r2comm": [row(s, a) for s, a, _ in rows],
                        "mpi-shm": [row(s, b) for s, _, b in rows]}}


def test_results_shm_section_from_fake_json(tmp_path):
    """Issue 20's one-host targets, 2 and 4 ranks, met and not met, and their glance rows."""
    M = 1 << 20
    (tmp_path / "allreduce_shm.json").write_text(json.dumps(_fake_sweep(2, [
        (8, 4.0, 2.5), (64 << 10, 30.0, 27.0), (M, 300.0, 320.0), (64 * M, 2e4, 2.1e4)])))
    (tmp_path / "allreduce_shm4.json").write_text(json.dumps(_fake_sweep(4, [
        (8, 9.0, 4.0), (64 << 10, 50.0, 35.0), (M, 500.0, 450.0)])))
    text = results.render(str(tmp_path))
    sec = text.split("## Shared memory on one host (issue 20)")[1].split("\n## ")[0]
    assert "2 ranks: 8 B allreduce within 2× of MPICH over shared memory: **met** (4.0 µs vs 2.5 µs: 1.60×" in sec
    assert "4 ranks: 8 B allreduce within 2× of MPICH over shared memory: **not met** (9.0 µs vs 4.0 µs: 2.25×" in sec
    assert "2 ranks: busbw ≥ 0.8× MPICH over shared memory at 64 KiB–64 MiB: **met** — at every size measured" in sec
    four = [ln for ln in sec.splitlines() if ln.startswith("- 4 ranks: busbw")][0]
    assert "**not met**" in four and "not met at 64 KiB (0.70×)" in four and "not measured" in four
    assert "| 1 MiB | busbw, GB/s |" in sec          # the 4-rank table (the 2-rank one is elsewhere)
    glance = text.split("## Targets at a glance")[1].split("\n## ")[0]
    assert glance.count("| Shared memory |") == 4 and glance.count("| Shared memory | 4 ranks") == 2
    os.remove(tmp_path / "allreduce_shm4.json")
    (tmp_path / "allreduce_shm4.failed").write_text("rc 124: stopped by its 900 s timeout")
    sec = results.render(str(tmp_path)).split("## Shared memory on one host")[1].split("\n## ")[0]
    assert "- `allreduce_shm4` (4 ranks): failed (rc 124: stopped by its 900 s timeout)" in sec


def _fake_torch_doc():
    """A testbed_torch.json as bench/testbed_torch.py writes it (summary part), numbers made up."""
    def nic_down(during, base, own_before, hit=0.9):
        return {"during_median_s": during, "base_same_steps_median_s": base, "before_median_s": base,
                "overhead_during": during / base - 1, "overhead_vs_own_before": own_before,
                "hit_step_s": hit, "after_median_s": base, "run_overhead": 0.01, "base_drift": 0.002}
    shapes = {
        "compute": {"r2comm_healthy_median_s": 0.200, "gloo_healthy_median_s": 0.210, "grad_bytes": 655 << 10,
                    "nic_down": nic_down(0.2010, 0.2000, 0.004), "degraded": nic_down(0.202, 0.200, 0.01),
                    "gloo_nic_down": {"text": "stalled: the step in flight took 3.3 s (the NIC was down 3.0 s), "
                                              "then Gloo went on after nic-up", "healthy_median_s": 0.21},
                    "digests": {"compute_r2comm_healthy": "aa", "compute_r2comm_nic_down": "aa"}},
        "network": {"r2comm_healthy_median_s": 0.150, "gloo_healthy_median_s": 0.120, "grad_bytes": 5 << 20,
                    "nic_down": nic_down(0.240, 0.150, 0.55), "degraded": nic_down(0.2, 0.15, 0.3),
                    "digests": {"network_r2comm_healthy": "bb", "network_r2comm_nic_down": "bc"}},
    }
    flap = {"healthy_median_s": 0.15, "down_median_s": 0.22, "slow_factor": 1.5, "flaps": [
        {"step": 12, "window": [12, 13, 14], "step_s": [0.6, 0.3, 0.15], "down_steps": [13], "slow_steps": [12],
         "slow_count": 1, "over_healthy_x1.5": 2},
        {"step": 26, "window": [26, 27, 28], "step_s": [0.6, 0.5, 0.15], "slow_steps": [26, 27], "slow_count": 2}]}
    return {"config": {"hosts": 2, "nics": 2, "rate": "500mbit", "ranks": 4, "ranks_per_host": 2,
                       "shapes": {"compute": {"size": "tiny", "batch": 96, "bucket_mb": 0.25},
                                  "network": {"size": "small", "batch": 2, "bucket_mb": 1.0}},
                       "fail_step": {"compute": 11, "network": 12}, "restore_step": {"compute": 22, "network": 26},
                       "gloo_ifnames": "nic0,nic1", "fault": "fab.nic_down(1, 0)", "serve_warmup_tokens": 30},
            "cases": {"network_gloo_nic_dead": {"backend": "gloo", "fault": "nic_dead", "error": "RuntimeError: timed out"}},
            "seconds": 300.0,
            "summary": {"shapes": shapes, "digests_equal": {"compute": True, "network": False}, "flap": flap,
                        "gloo_nic_dead": {"text": "failed 18 s after the NIC went down: 5 of 40 steps done"}}}


def _fake_cycles_doc():
    """A testbed_torch_cycles.json (bench/testbed_torch.py --part cycles), summary part, made up."""
    def cmp(ratio, lo, hi, a, n_a=400, n_b=300):
        return {"ratio": ratio, "lo": lo, "hi": hi, "a": a, "b": a / (1 + ratio), "n_a": n_a, "n_b": n_b}
    phases = {"H0": {"n": 8, "p50_s": 0.14, "p99_s": 0.15, "max_s": 0.15},
              "hit": {"n": 16, "p50_s": 0.16, "p99_s": 0.2, "max_s": 0.2},
              "D": {"n": 400, "p50_s": 0.14, "p99_s": 0.16, "max_s": 0.17}}
    lm = {"counts": {"D": 400, "A": 50, "H": 300}, "phases": phases, "digest": "cc", "fault_free_digest": "cc",
          "down": cmp(0.003, -0.001, 0.008, 0.1404), "after": cmp(0.01, -0.01, 0.02, 0.141, 50),
          "placebo_down": cmp(0.002, -0.004, 0.009, 0.14), "placebo_after": cmp(0.0, -0.02, 0.02, 0.14, 50)}
    sv = {"ranks": 2, "layers": 8, "allreduce_bytes": 32 << 10, "tokens": 16250, "checksum": "0x1p+0",
          "fault_free_checksum": "0x1p+0", "counts": {"D": 8000, "A": 3200, "H": 4800}, "phases": phases,
          "down": cmp(0.01, -0.005, 0.025, 0.0165, 8000, 4800), "after": cmp(0.02, -0.01, 0.05, 0.0167, 3200, 4800),
          "down_p50": cmp(0.002, -0.001, 0.004, 0.0126, 8000, 4800), "method": "groups",
          "placebo_down": cmp(0.0, -0.02, 0.02, 0.016), "placebo_after": cmp(0.01, -0.02, 0.03, 0.016),
          "calibration": {"runs": 32, "held": 27, "width": 0.041, "abs_ratio": 0.01}}
    for key in ("down", "after", "down_p50", "placebo_down", "placebo_after"):
        sv[key]["coverage"] = 0.890625
    return {"config": {"part": "cycles", "cycle_lm": {"block": 8, "cycles": 64, "settle": 1, "nproc": 2},
                       "cycle_serve": {"block": 250, "cycles": 32, "settle": 100, "nproc": 1}},
            "cases": {}, "seconds": 700.0, "summary": {"shapes": {}, "digests_equal": {}, "cycle_lm": lm,
                                                       "serving": sv}}


def test_results_torch_section_from_fake_json(tmp_path):
    """The issue-18 section and its glance rows, met and not met, from a made-up testbed_torch.json;
    the simulator section from a made-up sim_validate.json and testbed_failover.json."""
    (tmp_path / "testbed_torch.json").write_text(json.dumps(_fake_torch_doc()))
    (tmp_path / "testbed_torch.cmd").write_text("bench/testbed_torch.py --out bench/out")
    (tmp_path / "sim_validate.json").write_text(json.dumps({"efficiency": 0.962, "alpha": 2.5e-5, "rows": [
        {"scenario": "multi-rail, 2 ranks, 1 NIC", "unit": "busbw GB/s", "measured": 0.121, "predicted": 0.120},
        {"scenario": "multi-rail, 2 ranks, 2 NICs", "unit": "busbw GB/s", "measured": 0.237, "predicted": 0.240},
        {"scenario": "failover timeline, 2 ranks: op hit by the fault", "unit": "ms", "measured": 340,
         "predicted": 419}]}))
    (tmp_path / "testbed_failover.json").write_text(json.dumps({"config": {}, "runs": {"2": {
        "single_rail": {"busbw_GBps": 0.100}, "healthy": {"busbw_GBps": 0.240}}}}))
    text = results.render(str(tmp_path))
    glance = text.split("## Targets at a glance")[1].split("\n## ")[0]
    sec = text.split("## torch.distributed on r2comm in the netns testbed (issue 18)")[1].split("\n## ")[0]
    rows = {line.split(" | ")[1][:60]: line for line in glance.splitlines() if line.startswith("| torch.distributed")}
    assert len(rows) == 8, glance                                # no interleaved runs: no serving rows
    compute = [r for k, r in rows.items() if k.startswith("compute-bound")][0]
    assert "+0.5%" in compute and compute.endswith("✅ met |")                     # 201 vs 200 ms, own +0.4%
    assert "**Small overheads, interleaved** (compute step and serving): not run" in sec
    network = [r for k, r in rows.items() if k.startswith("network-dominant")][0]
    assert "1.60×" in network and "1.55×" in network and network.endswith("✅ met |")
    gloo = [line for line in glance.splitlines() if "at least as fast as Gloo" in line]
    assert [g.endswith("✅ met |") for g in gloo] == [True, False]                 # 200 < 210; 150 > 120 ms
    assert "150.0 ms vs 120.0 ms (0.80× Gloo's speed)" in gloo[1]
    digests = [line for line in glance.splitlines() if "bitwise identical" in line]
    assert digests[0].endswith("✅ met |") and digests[1].endswith("❌ not met |") and "bb, bc" in digests[1]
    flaps = [line for line in glance.splitlines() if "NIC flap" in line]
    assert flaps[0].endswith("✅ met |") and flaps[1].endswith("❌ not met |") and "2 slow step(s)" in flaps[1]
    assert "| 12 | 600, 300*, 150 | 12 | 1 | 2 |" in sec and "NIC-down run's median step (220.0 ms)" in sec
    # the section: table, Gloo's behaviour, digests, the command
    assert "| compute (tiny LM, 96 sequences per rank, 0.25 MiB buckets; 655 KiB of gradients) | 200.0 ms | 210.0 ms |" in sec
    assert "201.0 ms (+0.5%)" in sec and "| **no** |" in sec
    assert "stalled: the step in flight took 3.3 s" in sec and "the NIC down for good: failed 18 s" in sec
    assert "bench/testbed_torch.py --out bench/out" in sec and "noise floor" in sec
    assert "cannot resolve" not in text                       # the fault-free runs drifted < the targets
    doc = _fake_torch_doc()
    doc["summary"]["shapes"]["compute"]["nic_down"]["base_drift"] = -0.25
    (tmp_path / "testbed_torch.json").write_text(json.dumps(doc))
    assert ("the fault-free run itself moved -25.0% between the same ranges, so this run cannot resolve a 1% "
            "difference") in results.render(str(tmp_path))
    # with the interleaved runs: they judge the compute step and serving
    (tmp_path / "testbed_torch_cycles.json").write_text(json.dumps(_fake_cycles_doc()))
    text = results.render(str(tmp_path))
    glance = text.split("## Targets at a glance")[1].split("\n## ")[0]
    sec = text.split("## torch.distributed on r2comm in the netns testbed (issue 18)")[1].split("\n## ")[0]
    rows = [line for line in glance.splitlines() if line.startswith("| torch.distributed")]
    assert len(rows) == 10, glance
    compute = [r for r in rows if "compute-bound" in r]
    assert len(compute) == 1 and "+0.3% [-0.1%, +0.8%]" in compute[0] and compute[0].endswith("✅ met |")
    serve = [r for r in rows if "serving p99" in r]
    assert "with the NIC down" in serve[0] and "+1.0% [-0.5%, +2.5%]" in serve[0] and serve[0].endswith("✅ met |")
    assert "its 89% interval under the target" in serve[0] and "held zero 27 times and were 4.1% wide" in serve[0]
    assert "after the NIC came back" in serve[1] and "not resolved (its interval reaches +5.0%, past 3%)" in serve[1]
    assert serve[1].endswith("❌ not met |")
    assert "| compute step, median | +0.3% [-0.1%, +0.8%] | +1.0% [-1.0%, +2.0%] | 90% | 400 / 50 / 300 |" in sec
    assert "| serving token, p50 | +0.2% [-0.1%, +0.4%] |  | 89% |" in sec and "64 cycles of 8 steps" in sec
    assert "| 27 of 32 held 0, width 4.1% |" in sec
    assert "loss-curve digest of the job with 128 link changes `cc`, equal to the fault-free job's" in sec
    assert "output checksum `0x1p+0`, equal to the fault-free job's" in sec
    doc = _fake_cycles_doc()
    doc["summary"]["serving"]["calibration"]["held"] = 23          # 72% against a stated 89%
    (tmp_path / "testbed_torch_cycles.json").write_text(json.dumps(doc))
    serve = [line for line in results.render(str(tmp_path)).splitlines() if line.startswith("| torch.distributed | serving p99")]
    assert all("not resolved (the run failed its calibration" in r and r.endswith("❌ not met |") for r in serve)
    doc = _fake_cycles_doc()
    doc["summary"]["cycle_lm"]["down"].update(ratio=0.012, hi=0.02)
    (tmp_path / "testbed_torch_cycles.json").write_text(json.dumps(doc))
    text = results.render(str(tmp_path))
    assert [line for line in text.splitlines() if "| compute-bound" in line][0].endswith("❌ not met |")
    assert [line for line in text.splitlines() if line.startswith("- compute-bound")][0].startswith(
        "- compute-bound DDP step, one of 2 NICs failed: overhead < 1% (interleaved, its 90% interval under "
        "the target): **not met** — +1.2% [-0.1%, +2.0%]")
    # the simulator: recorded and this run's measurements
    sim = text.split("## The failure simulator against the testbed (issue 21)")[1].split("\n## ")[0]
    assert "2 of 3 scenarios predicted within 15%" in sim and "op hit by the fault*, predicted / measured = 1.232" in sim
    assert "1 of 2 scenarios within 15%" in sim and "multi-rail, 2 ranks, 1 NIC*, predicted / measured = 1.200" in sim


def test_results_torch_and_sim_sections_say_not_run(tmp_path):
    (tmp_path / "testbed_torch.skipped").write_text("needs root: the testbed uses network namespaces")
    text = results.render(str(tmp_path))
    assert "## torch.distributed on r2comm in the netns testbed (issue 18)\n\nNot run (needs root" in text
    assert "| torch.distributed | not run (needs root" in text.lower()
    assert "## The failure simulator against the testbed (issue 21)\n\nNot run (no `sim_validate.json`" in text


# ------------------------------------------------------------------ interleaved fault blocks
def _cycle_run(block=5, n_cycles=4, warm=2, overhead=0.0, drift=0.0, noise=0.0, seed=3):
    """Items of 1 s each, the NIC down over the blocks cycles.marks() names (link changes
    taking 10 ms, landing 0.3 s into the marked item); item i costs 1 + drift*i (+ overhead
    while down) (+ noise)."""
    import random
    from r2comm.bench import cycles
    rng = random.Random(seed)
    n = cycles.total(warm, block, n_cycles)
    faults = [{"what": f"nic_{w}", "t": k + 0.3, "done": k + 0.31}
              for k, w in cycles.marks(warm, block, n_cycles)]
    starts = [float(i) for i in range(n)]
    ends = [s + 1.0 for s in starts]
    down = [any(f["what"] == "nic_down" and f["t"] < s + 0.5 and not any(
        g["what"] == "nic_up" and f["t"] < g["t"] < s + 0.5 for g in faults) for f in faults)
        for s in starts]
    vals = [(1 + drift * i) * (1 + overhead * d) + rng.gauss(0, noise) for i, d in enumerate(down)]
    return starts, ends, faults, vals


def test_cycle_labels_follow_the_link_changes():
    from r2comm.bench import cycles
    starts, ends, faults, _ = _cycle_run(block=5, n_cycles=2, warm=2)
    labs = cycles.labels(starts, ends, faults, warm=2, settle=2)
    got = "".join({"warm": "w", "H0": "0", "hit": "x", "D": "D", "A": "A", "H": "H"}[lab]
                  for lab, _ in labs)
    # down before items 7 and 17, up before 12 and 22 (0.3 s into them: those items are hit)
    assert got == "w" * 2 + "0" * 5 + "xDDDD" + "xAAHH" + "xDDDD" + "xAAHH"
    assert [c for _, c in labs][7:12] == [0] * 5 and [c for _, c in labs][17:] == [1] * 10
    assert cycles.counts(labs) == {"warm": 2, "H0": 5, "hit": 4, "D": 8, "A": 4, "H": 4}


def test_cycle_compare_sees_a_small_overhead_through_drift():
    """1% while the NIC is down, under a drift of 10% over the run: the interleaved estimate
    finds the 1% and its bootstrap interval holds it; without a fault it finds none."""
    from r2comm.bench import cycles
    starts, ends, faults, vals = _cycle_run(block=8, n_cycles=10, overhead=0.01, drift=0.0006,
                                            noise=0.002)
    labs = cycles.labels(starts, ends, faults, warm=2, settle=1)
    c = cycles.compare(vals, labs, cycles.DOWN, cycles.HEALTHY)
    assert abs(c["ratio"] - 0.01) < 0.003 and c["lo"] < 0.01 < c["hi"] and c["cycles"] == 10
    pooled = cycles.compare(vals, labs, cycles.DOWN, cycles.HEALTHY, detrend=False)
    assert pooled["ratio"] < 0.008      # pooling alone: the drift takes a share of the 1%
    first, second = vals[2:len(vals) // 2], vals[len(vals) // 2:]
    assert sum(second) / len(second) / (sum(first) / len(first)) - 1 > 0.04   # drift >> 1%
    _, _, _, flat = _cycle_run(block=8, n_cycles=10, overhead=0.0, drift=0.0006, noise=0.002)
    p = cycles.compare(flat, labs, cycles.DOWN, cycles.HEALTHY)
    assert abs(p["ratio"]) < 0.003 and p["lo"] < 0 < p["hi"]
    noisy = cycles.compare(_cycle_run(block=8, n_cycles=10, noise=0.05)[3], labs,
                           cycles.DOWN, cycles.HEALTHY, q=99)
    assert noisy["hi"] - noisy["lo"] > 0.01 and noisy["q"] == 99


def _bursty_tokens(n_cycles, block, settle, overhead, seed, bursts=()):
    """Tokens of an interleaved serving run labelled by index (cycles.relabel, warm 10):
    exponential-tailed noise (p99 1.3x the median, as in the serving runs), the NIC-down tokens OVERHEAD longer, and in each cycle of BURSTS a
    load burst that doubles the first 20 of its healthy tokens (a second of a busy host)."""
    import random
    from r2comm.bench import cycles
    rng = random.Random(seed)
    labs = cycles.relabel(10 + (2 * n_cycles + 1) * block, 10, block, settle, n_cycles)
    vals, run = [], 0
    for lab, c in labs:
        v = 0.014 * (1 + 0.08 * rng.expovariate(1))
        if lab == cycles.DOWN:
            v *= 1 + overhead
        run = run + 1 if lab == cycles.HEALTHY else 0
        if c in bursts and 0 < run <= 20:
            v *= 2
        vals.append(v)
    return vals, labs


def test_cycle_quantile_and_sign_coverage():
    from r2comm.bench import cycles
    xs = list(range(1, 100))                        # 99 items: rank q/100 * 100
    assert cycles.quantile(xs, 50) == 50 and cycles.quantile(xs, 99) == 99 and cycles.quantile(xs, 1) == 1
    assert cycles.quantile(xs[:9], 50) == 5 and abs(cycles.quantile([1.0, 2.0], 50) - 1.5) < 1e-12
    assert cycles.quantile([], 99) is None and cycles.quantile([7], 99) == 7
    assert cycles.sign_coverage(10, 3) == 1 - 2 * 56 / 1024 and cycles.sign_coverage(10, 1) == 1 - 2 / 1024
    labs = cycles.relabel(2 + 5 * 4, 2, 4, 1, 2)
    got = "".join({"warm": "w", "H0": "0", "D": "D", "A": "A", "H": "H"}[lab] for lab, _ in labs)
    assert got == "ww" + "0000" + "DDDD" + "AHHH" + "DDDD" + "AHHH"
    assert [c for _, c in labs][6:] == [0] * 8 + [1] * 8


def test_cycle_compare_groups_is_robust_to_a_load_burst():
    """A p99 set by two bursts: the bootstrap over cycles (compare) reads them as a large
    negative overhead; compare_groups reads the fault-free run near zero with zero inside (the
    bursts are two groups of ten), and still finds a real 4% overhead."""
    from r2comm.bench import cycles
    vals, labs = _bursty_tokens(40, 100, 40, 0.0, seed=3, bursts=(7, 23))
    boot = cycles.compare(vals, labs, cycles.DOWN, cycles.HEALTHY, q=99, boot=300)
    assert boot["ratio"] < -0.2
    g = cycles.compare_groups(vals, labs, cycles.DOWN, cycles.HEALTHY, q=99)
    assert g["groups"] == 10 and abs(g["coverage"] - 0.890625) < 1e-9 and len(g["ratios"]) == 10
    assert g["lo"] <= 0 <= g["hi"] and abs(g["ratio"]) < 0.03 and g["ratios"][0] < -0.2
    slow, labs = _bursty_tokens(40, 100, 40, 0.04, seed=3, bursts=(7, 23))
    h = cycles.compare_groups(slow, labs, cycles.DOWN, cycles.HEALTHY, q=99)
    assert 0.01 < h["ratio"] < 0.07 and h["lo"] < 0.04 < h["hi"]
    few = cycles.compare_groups(vals[:10 + 7 * 100], labs[:10 + 7 * 100], cycles.DOWN, cycles.HEALTHY)
    assert few["groups"] == 3 and few["coverage"] == 0.75 and few["lo"] == min(few["ratios"])


def test_cycle_calibrate_counts_intervals_that_hold_zero():
    """On a fault-free run, calibrate relabels at several offsets: compare_groups' intervals
    hold zero about as often as they claim; intervals made too narrow are caught."""
    from r2comm.bench import cycles
    vals, _ = _bursty_tokens(40, 100, 40, 0.0, seed=5)
    cal = cycles.calibrate(vals, 10, 100, 40, 40, lambda v, la, lab: cycles.compare_groups(
        v, la, lab, cycles.HEALTHY, q=99), shifts=8)
    assert cal["runs"] == 16 and cal["held"] >= 12 and 0 < cal["width"] < 0.2

    def narrow(v, la, lab):
        x = cycles.compare_groups(v, la, lab, cycles.HEALTHY, q=99)
        return {**x, "lo": x["ratio"] - 1e-4, "hi": x["ratio"] + 1e-4}
    assert cycles.calibrate(vals, 10, 100, 40, 40, narrow, shifts=8)["held"] <= 2


def test_flap_analysis_judges_steps_inside_the_outage_by_the_nic_down_pace():
    """bench/testbed_torch.py: a step that ran wholly while the flapped NIC was down is slow only
    over 1.5x the NIC-down step; the one the flap hit, and those after it, over 1.5x healthy."""
    import argparse
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "testbed_torch", os.path.join(os.path.dirname(__file__), "..", "bench", "testbed_torch.py"))
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    steps = [0.1] * 10 + [0.16, 0.16, 0.17, 0.1, 0.16, 0.1]     # flap before step 10, down 0.35 s
    ends, t = [], 100.0
    for v in steps:
        t += v
        ends.append(t)
    flap_t = ends[9] + 0.001                                  # as step 10 starts
    rec = {"step_s": steps, "step_end": ends,
           "faults": [{"what": "flap@10", "t": flap_t, "done": flap_t + 0.35}]}
    args = argparse.Namespace(flap_steps=[10])
    got = tt.flap_analysis(rec, args, down_pace=0.14)["flaps"][0]
    assert got["down_steps"] == [11]          # 10 began before the flap, 12 ended after the link was up
    assert got["slow_steps"] == [10, 12, 14] and got["over_healthy_x1.5"] == 4
    assert tt.flap_analysis(rec, args)["flaps"][0]["slow_count"] == 4    # no NIC-down run: healthy pace


def test_results_planner_section_from_fake_json(tmp_path):
    """Issue 32's plan-time targets rendered from planner_scale.json: met, not met, the sweep."""
    def row(n, down, first, later, algo="hierarchical_tree"):
        return {"hosts": n // 8, "ranks": n, "nic_down": down, "algo": algo, "later_algo": algo,
                "messages": 62, "first_ms": first, "later_ms": later, "predicted_ms": 15.0}
    doc = {"rows": [row(64, False, 0.5, 0.1), row(64, True, 0.6, 0.1),
                    row(1024, False, 5.0, 0.2), row(1024, True, 25.0, 0.3),
                    row(8192, False, 40.0, 0.4), row(8192, True, 150.0, 0.5)],
           "bytes": 64 << 20, "later_bytes": (64 << 20) + 4096, "ranks_per_host": 8, "nics": 8,
           "sweep": {"points": 34, "cpu_s": 100.0, "ratios": [],
                     "worst": {"hosts": 3, "nics": 4, "loss": 0.125, "bytes": 256 << 20,
                               "chosen": "ring", "ratio": 1.004}}}
    (tmp_path / "planner_scale.json").write_text(json.dumps(doc))
    text = results.render(str(tmp_path))
    sec = text.split("## Planner at scale (issue 32)")[1].split("\n## ")[0]
    assert "first plan at 1024 ranks ≤ 20 ms (healthy and a NIC down): **not met** (5.00 / 25 ms)" in sec
    assert "first plan at 8192 ranks ≤ 200 ms (healthy and a NIC down): **met**" in sec
    assert "a later size of the same class ≤ 1 ms at 1,024 and 8,192 ranks: **met**" in sec
    assert "no flat plan over every rank at 1,024 ranks and more: **met**" in sec
    assert "worst 1.004" in sec and "| 8192 | 1024 | hierarchical_tree |" in sec
    glance = text.split("## Targets at a glance")[1].split("\n## ")[0]
    assert glance.count("| Planner at scale |") == 5
    # the exact-replay sweep split at 256 MiB, and replay/T* of the choice per host count
    doc["sweep"]["ratios"] = [[24, 2, 1.0, 1 << 30, "treefold", 1.0],
                              [6, 4, 0.125, 64 << 20, "ring", 1.16]]
    doc["sweep"]["worst"] = {"hosts": 6, "nics": 4, "loss": 0.125, "bytes": 64 << 20,
                             "chosen": "ring", "ratio": 1.16}
    doc["bound"] = [{"hosts": H, "nic_rate": v, "bytes": 256 << 20, "nics": 2, "chosen": c,
                     "ratio": q} for H, v, c, q in ((3, 0.0, "degraded", 1.004),
                                                    (512, 0.0, "treefold", 1.035),
                                                    (3, 0.5, "ring", 1.222),
                                                    (512, 0.5, "treefold", 1.037))]
    (tmp_path / "planner_scale.json").write_text(json.dumps(doc))
    sec = results.render(str(tmp_path)).split("## Planner at scale (issue 32)")[1].split("\n## ")[0]
    assert "from 256 MiB on: **met** (worst 1.000, hosts 3-24)" in sec
    assert "(1 MiB-1 GiB): **not met** (worst 1.160" in sec
    assert "| 512 | 1.035 (treefold) | 1.037 (treefold) |" in sec
    assert "with a NIC down: **met** (all of 3-512 hosts)" in sec
    assert "with a NIC at 0.5: **not met** (over at 3 hosts 1.222)" in sec
    # the sweep at 32-128 hosts (planner_scale --sweep-big) joins the every-size target
    doc["sweep"]["ratios"][1][5] = doc["sweep"]["worst"]["ratio"] = 1.02
    doc["sweep_big"] = {"points": 2, "cpu_s": 300.0,
                        "ratios": [[128, 2, 1.0, 8 << 20, "treefold", 1.04],
                                   [32, 8, 0.125, 256 << 20, "ring", 1.0]],
                        "worst": {"hosts": 128, "nics": 2, "loss": 1.0, "bytes": 8 << 20,
                                  "chosen": "treefold", "ratio": 1.04}}
    (tmp_path / "planner_scale.json").write_text(json.dumps(doc))
    sec = results.render(str(tmp_path)).split("## Planner at scale (issue 32)")[1].split("\n## ")[0]
    assert "At 32-128 hosts (`sweep.big_grid`, 2 points" in sec
    assert "1 of 2 points above 1.03: 128x2 1 8 MiB 1.04" in sec
    assert "(1 MiB-1 GiB): **not met** (worst 1.020 on hosts 3-24; 1.040 at 32-128" in sec
    os.remove(tmp_path / "planner_scale.json")
    assert "Planner at scale" in results.render(str(tmp_path))


def test_results_planner_section_with_half_rate_and_collectives(tmp_path):
    """Issue 39's rows: a NIC at half rate beside healthy and down, and the first plan of every
    collective, each cold and all in turn, against the 50 / 200 ms budgets."""
    def row(n, nic, first, later=0.1, algo="hierarchical_tree"):
        return {"hosts": n // 8, "ranks": n, "nic": nic, "nic_down": nic == "down",
                "algo": algo, "later_algo": algo, "messages": 62, "first_ms": first,
                "later_ms": later, "predicted_ms": 15.0}
    colls = {c: {"first_ms": 3.0, "algo": "hierarchical", "messages": 10, "bytes": 1}
             for c in ("allreduce", "allgather", "bcast")}
    doc = {"rows": [row(1024, "healthy", 1.0), row(1024, "down", 4.0), row(1024, "half", 30.0)],
           "bytes": 64 << 20, "later_bytes": (64 << 20) + 4096, "ranks_per_host": 8, "nics": 8,
           "colls": [{"hosts": 128, "ranks": 1024, "nic": "down", "colls": colls,
                      "sequence_ms": 12.0},
                     {"hosts": 1024, "ranks": 8192, "nic": "half", "colls": colls,
                      "sequence_ms": 250.0}]}
    (tmp_path / "planner_scale.json").write_text(json.dumps(doc))
    sec = results.render(str(tmp_path)).split("## Planner at scale (issue 32)")[1].split("\n## ")[0]
    assert "| 1024 | 128 | hierarchical_tree | 62 | 1.00 | 0.10 | 4.00 | 0.10 | " \
           "hierarchical_tree | 30 | 0.10 | hierarchical_tree | – |" in sec
    assert "(healthy and a NIC down or at 1/2): **not met** (1.00 / 4.00 / 30 ms)" in sec
    assert "| 1024 | down | 3.00 (hierarchical) | 3.00 (hierarchical) | 3.00 (hierarchical) | " \
           "12 |" in sec
    assert "at 1024 ranks, NIC down, in turn from cold ≤ 50 ms: **met** (12 ms)" in sec
    assert "at 8192 ranks, NIC at 1/2, in turn from cold ≤ 200 ms: **not met** (250 ms)" in sec


def test_results_torchdist_section_from_fake_json(tmp_path):
    """Issue 29's torch.distributed vs Gloo section from the three benches' JSON: the per-size
    medians and paired ratios, the 8 B target met / not met, the FSDP2 losses' equality."""
    def job(scale):
        return {op: {"8": 10e-6 * scale, str(1 << 20): 2e-3 * scale}
                for op in ("all_reduce", "all_gather", "reduce_scatter")}
    sizes = {"bench": "torch_sizes", "command": "python bench/torch_sizes.py --rounds 3",
             "nproc": 2, "budget_s": 0.3, "ops": ["all_reduce", "all_gather", "reduce_scatter"],
             "sizes": [8, 1 << 20], "loadavg": [0.5, 1.5],
             "runs": {"r2comm": [job(1), job(1), job(3)], "gloo": [job(2), job(4), job(2)]}}
    small = {"bench": "torch_small_call", "command": "torchrun bench/torch_small_call.py",
             "nproc": 2, "iters": 3000, "rounds": 3,
             "rounds_us": {"numpy Communicator.Allreduce": [4.0, 5.0, 4.0],
                           "torch dist.all_reduce": [10.0, 9.0, 11.0],
                           "gloo dist.all_reduce": [30.0, 31.0, 29.0],
                           "backend pg.allreduce": [6.0, 7.0, 6.0]},
             "ratio_torch_numpy": [2.5, 1.8, 2.75]}
    fsdp = {"bench": "torch_fsdp2", "command": "python bench/torch_fsdp2.py --steps 3",
            "nproc": 2, "width": 64, "depth": 2, "batch": 8, "params": 9360, "warmup": 1,
            "step_s": {"r2comm": [0.010, 0.012, 0.011], "gloo": [0.020, 0.020, 0.011]},
            "losses": {"r2comm": [1.5, 1.25, 1.0], "gloo": [1.5, 1.25, 1.0]}}
    for name, doc in (("torch_sizes", sizes), ("torch_small_call", small), ("torch_fsdp2", fsdp)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    text = results.render(str(tmp_path))
    sec = text.split("## torch.distributed on r2comm vs Gloo (issue 29)")[1].split("\n## ")[0]
    # medians over rounds; the ratio is the median of the rounds' ratios (0.5, 0.25, 1.5 -> 0.5),
    # not the ratio of the medians (10/20)
    assert "| 8 B | 10.0 µs | 20.0 µs | 0.50 | 10.0 µs | 20.0 µs | 0.50 |" in sec
    assert "| 1 MiB | 2.00 ms | 4.00 ms | 0.50 |" in sec
    assert "    python bench/torch_sizes.py --rounds 3" in sec
    assert "Load average (1 min) during the run: 0.5–1.5." in sec
    assert ("8 B all_reduce through torch ≤ 2× the numpy path: **not met** (10.0 µs vs 4.0 µs: "
            "2.50×)") in sec
    assert "| gloo dist.all_reduce | 30.0 µs |" in sec
    assert ("Of the 6.0 µs a call through torch costs beyond the numpy path, 4.0 µs are torch's "
            "own `dist.all_reduce`") in sec and "and 2.0 µs the backend's method" in sec
    assert "bitwise equal." in sec and "| r2comm | 11.0 ms | 3 |" in sec
    assert "the same losses as on Gloo, bit for bit: **met** (step 0.60× Gloo's time)" in sec
    glance = text.split("## Targets at a glance")[1].split("\n## ")[0]
    assert glance.count("| torch backend vs Gloo |") == 2 and "❌ not met" in glance
    # met under 2x; losses that differ are said; a missing file says why
    small["ratio_torch_numpy"] = [1.9, 1.8, 2.5]
    fsdp["losses"]["gloo"][2] = 1.0000001
    for name, doc in (("torch_small_call", small), ("torch_fsdp2", fsdp)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    os.remove(tmp_path / "torch_sizes.json")
    sec = results.render(str(tmp_path)).split("Gloo (issue 29)")[1].split("\n## ")[0]
    assert "the numpy path: **met** (10.0 µs vs 4.0 µs: 1.90×)" in sec
    assert "**not** equal." in sec and "bit for bit: **not met**" in sec
    assert "Not run (no `torch_sizes.json` in the results folder)." in sec
    for name in ("torch_small_call", "torch_fsdp2"):
        os.remove(tmp_path / f"{name}.json")
    text = results.render(str(tmp_path))
    assert ("| torch backend vs Gloo | Not run (no `torch_small_call.json` in the results "
            "folder); no target evaluated | – not evaluated |") in text


def test_results_failure_section_from_fake_json(tmp_path):
    """Issue 39's targets rendered from failure_scale.json: met, not met, an error row."""
    from r2comm.bench.results_failure import failure_section
    from r2comm.bench.results_format import Results

    def row(n, case, total, heap, rss):
        return {"ranks": n, "case": case, "learn_ms": 0.1, "agree_ms": 1.0, "state_ms": 1.0,
                "plans_ms": total - 2.1, "total_ms": total, "heap_peak_mib": heap,
                "rss_added_mib": rss, "algos": {"allreduce": "hierarchical_tree"}}
    doc = {"rows": [row(1024, "nic_down", 27.0, 1.4, 2.8), row(1024, "nic_half", 16.0, 1.4, 2.9),
                    row(8192, "nic_down", 98.0, 10.9, 10.5), row(512, "start_rail", 15.0, 2, 3),
                    {"ranks": 4096, "case": "nic_down", "error": "boom"}],
           "command": "python bench/failure_scale.py --json x"}
    (tmp_path / "failure_scale.json").write_text(json.dumps(doc))
    lines, targets = failure_section(Results(str(tmp_path)))
    text = "\n".join(lines)
    assert "| 4096 | nic_down | error |" in text and "python bench/failure_scale.py" in text
    assert [ok for _, ok in targets] == [True, True, True], targets
    assert "(27 ms, 2.9 MiB)" in targets[0][0]
    doc["rows"][2]["total_ms"] = 250.0                    # over 200 ms at 8,192
    doc["rows"][0]["rss_added_mib"] = 25.0                # over 20 MB at 1,024
    (tmp_path / "failure_scale.json").write_text(json.dumps(doc))
    _, targets = failure_section(Results(str(tmp_path)))
    assert [ok for _, ok in targets] == [False, False, True], targets
    os.remove(tmp_path / "failure_scale.json")
    lines, targets = failure_section(Results(str(tmp_path)))
    assert not targets and "not run" in "\n".join(lines).lower()
