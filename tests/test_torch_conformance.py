"""torch's own conformance suite (DistributedTest._DistTestBase) on the "r2comm" backend, 2 ranks,
spawn mode, driven by tests/torch_conformance.py (--as-gloo: r2comm is offered every test Gloo
is; every rank's exit code judged).

The expectation is tests/data/gloo_conformance_pass.txt: the tests Gloo passes here (its header
says how it was made). Every one of them must pass on r2comm, except those torch's API keeps for
Gloo (GLOO_ONLY, named in the README). The default suite runs SUBSET (gather, scatter, the
coalesced forms, sub-groups, destroying groups, any-source receive, barrier timeout, batched
point-to-point, sparse all_reduce); the whole list is slow-marked."""
import os
import subprocess
import sys

import pytest


from conftest import ROOT
from torch_helpers import TORCH as _TORCH, WHY as _WHY

pytestmark = pytest.mark.skipif(not _TORCH, reason=_WHY)
HARNESS = os.path.join(ROOT, "tests", "torch_conformance.py")
EXPECT = {2: os.path.join(ROOT, "tests", "data", "gloo_conformance_pass.txt"),
          4: os.path.join(ROOT, "tests", "data", "gloo_conformance_pass_4.txt")}
# monitored_barrier is implemented by Gloo alone (torch's API); these call it on the default group
GLOO_ONLY = {"test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
             "test_monitored_barrier_gloo_subgroup"}
SUBSET = ["test_gather", "test_gather_full_group", "test_scatter", "test_scatter_full_group",
          "test_scatter_object_list", "test_all_gather_object_subgroup",
          "test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty",
          "test_all_reduce_coalesced_sum", "test_get_rank_size_group", "test_destroy_group",
          "test_destroy_full_group", "test_send_recv_any_source",
          "test_barrier_timeout_full_group", "test_batch_isend_irecv_gloo",
          "test_sparse_all_reduce_sum"]
# with 4 ranks: object collectives with a group, sub-groups given a group, any-source receive
SUBSET_4 = ["test_gather_object", "test_gather_object_subgroup", "test_scatter_object_list",
            "test_new_subgroups_with_group_param", "test_send_recv_any_source",
            "test_send_recv_any_source_autograd_profiler",
            "test_send_recv_any_source_torch_profiler", "test_barrier_timeout_full_group"]


def gloo_passes(ranks=2):
    with open(EXPECT[ranks]) as f:
        return [ln.split()[0] for ln in f if ln.strip() and not ln.startswith("#")]


def run_harness(backend, tests, tmp_path, timeout, as_gloo=True, ranks=2, fork=False):
    """{test: pass|fail|skip} from one run of the harness over `tests`, and its output."""
    out_file = tmp_path / f"conformance-{backend}.txt"
    cmd = [sys.executable, HARNESS, "--backend", backend, "--world-size", str(ranks),
           "--timeout", "90", "--tests", ",".join(tests), "--out", str(out_file)]
    cmd += (["--as-gloo"] if as_gloo else []) + (["--fork"] if fork else [])
    env = dict(os.environ, TEMP_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the conformance harness did not finish in {timeout} s:\n"
                    f"{(exc.output or '')[-4000:]}")
    assert p.returncode == 0 and out_file.exists(), f"harness failed:\n{p.stdout[-6000:]}"
    with open(out_file) as f:
        outcome = dict(ln.split()[:2] for ln in f if ln.strip() and not ln.startswith("#"))
    return outcome, p.stdout


def _excerpt(out, test):
    """The part of the harness output about one test (its ranks' tracebacks)."""
    lines = out.splitlines()
    hits = [i for i, ln in enumerate(lines) if test in ln]
    if not hits:
        return out[-3000:]
    return "\n".join(lines[max(0, hits[0] - 60):hits[-1] + 5])[-6000:]


def test_expectation_lists_are_consistent():
    """The subset and the Gloo-only names are tests Gloo passes here (no stale names)."""
    passes = set(gloo_passes())
    assert len(passes) >= 80, len(passes)
    assert set(SUBSET) <= passes, set(SUBSET) - passes
    assert GLOO_ONLY <= passes, GLOO_ONLY - passes
    assert set(SUBSET_4) <= set(gloo_passes(4)), set(SUBSET_4) - set(gloo_passes(4))


def test_as_gloo_offers_every_gloo_test(tmp_path):
    """--as-gloo: the test base decides for r2comm exactly what it decides for Gloo (which tests
    run, which skip before starting ranks); without it, torch's tables skip some."""
    runs = {key: subprocess.Popen([sys.executable, HARNESS, "--list-static", *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=dict(os.environ, TEMP_DIR=str(tmp_path)))
            for key, args in (("gloo", ["--backend", "gloo"]),
                              ("as_gloo", ["--backend", "r2comm", "--as-gloo"]),
                              ("plain", ["--backend", "r2comm"]))}     # at once: 3 imports

    def listing(key):
        out, _ = runs[key].communicate(timeout=180)
        assert runs[key].returncode == 0, out[-2000:]
        return {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if ln.strip()}
    gloo = listing("gloo")
    assert listing("as_gloo") == gloo
    plain = listing("plain")
    assert {t for t, v in plain.items() if v == "skip"} > {t for t, v in gloo.items() if v == "skip"}
    assert set(gloo_passes()) <= {t for t, v in gloo.items() if v == "run"}


# The default suite starts the subsets' ranks by fork (a second a test, against 5 s to over a
# minute by spawn on a loaded machine); test_conformance_spawn_mode and the slow runs spawn them.
@pytest.fixture(scope="module")
def subset_on_r2comm(tmp_path_factory):
    return run_harness("r2comm", SUBSET, tmp_path_factory.mktemp("conf"), 600, fork=True)


@pytest.fixture(scope="module")
def subset4_on_r2comm(tmp_path_factory):
    return run_harness("r2comm", SUBSET_4, tmp_path_factory.mktemp("conf4"), 600, ranks=4,
                       fork=True)


@pytest.mark.parametrize("test", SUBSET)
def test_conformance_subset(subset_on_r2comm, test):
    """One of torch's conformance tests that Gloo passes, on r2comm (every rank exits 0)."""
    outcome, out = subset_on_r2comm
    assert outcome.get(test) == "pass", f"{test}: {outcome.get(test)}\n{_excerpt(out, test)}"


@pytest.mark.parametrize("test", SUBSET_4)
def test_conformance_subset_4_ranks(subset4_on_r2comm, test):
    """As test_conformance_subset, with 4 ranks."""
    outcome, out = subset4_on_r2comm
    assert outcome.get(test) == "pass", f"{test}: {outcome.get(test)}\n{_excerpt(out, test)}"


def test_conformance_spawn_mode(tmp_path):
    """Upstream's spawn mode: each rank a fresh interpreter that imports the harness, which
    registers r2comm there (test_gather)."""
    outcome, out = run_harness("r2comm", ["test_gather"], tmp_path, 600)
    assert outcome.get("test_gather") == "pass", _excerpt(out, "test_gather")


@pytest.mark.slow
def test_conformance_full_r2comm(tmp_path):
    """Every test Gloo passes here passes on r2comm, but those torch's API keeps for Gloo."""
    want = [t for t in gloo_passes() if t not in GLOO_ONLY]
    outcome, out = run_harness("r2comm", want, tmp_path, timeout=3600)
    failed = [t for t in want if outcome.get(t) != "pass"]
    assert not failed, f"{len(failed)} of {len(want)} fail on r2comm: {failed}\n{out[-6000:]}"


@pytest.mark.slow
def test_conformance_full_gloo(tmp_path):
    """Gloo still passes every test of the expectation (the list is not stale for this torch)."""
    want = gloo_passes()
    outcome, out = run_harness("gloo", want, tmp_path, timeout=3600, as_gloo=False)
    failed = [t for t in want if outcome.get(t) != "pass"]
    assert not failed, f"{failed}\n{out[-6000:]}"
