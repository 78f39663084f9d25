"""torch's own conformance suite for a c10d backend (DistributedTest._DistTestBase from
torch.testing._internal.distributed.distributed_test), driven in spawn mode as upstream's
test/distributed/test_distributed_spawn.py drives it, against "gloo" or "r2comm".

    python tests/torch_conformance.py --backend r2comm --world-size 2 [--as-gloo]
        [--tests test_a,test_b | --tests-file F] [--out results.txt] [--timeout 120]

prints `RESULT <test> <pass|fail|skip>` per test and a `COUNTS` line, and writes the same to
--out. Configuration travels to the spawned ranks through the environment (BACKEND,
WORLD_SIZE, TEMP_DIR, INIT_METHOD, R2COMM_CONFORMANCE_AS_GLOO), which every rank reads when it
imports this module (spawn re-imports it), so each rank registers r2comm (import r2comm.torch)
before torch's test base calls init_process_group.

Two changes from upstream's driver, both on purpose:
- every rank's exit code is checked, not rank 0's alone (torch's MultiProcessTestCase judges
  rank 0 only, so a test whose rank 1 fails "passes");
- --as-gloo: torch's test base decides at import time, from BACKEND, which tests a backend
  gets (its feature tables DistTestCases.backend_feature/skip_collective name torch's own
  backends, and many decorators test BACKEND != "gloo"). With --as-gloo the test base is
  imported with BACKEND=gloo, so r2comm is offered every test Gloo is, and then its BACKEND is
  set to "r2comm", so every process group the tests create (init_process_group, new_group with
  the default backend) is an r2comm one; that name compares equal to "gloo" too, for the test
  bodies that branch on `BACKEND == "gloo"` to build their model (the no_sync tests do). Tests
  that name "gloo" explicitly (a side group for monitored_barrier, for example) still get a
  Gloo group for that part.
"""
import os
import sys
import tempfile
import time
import unittest


def _configure_from_argv():
    """Parent process only: turn the command line into the environment the ranks inherit."""
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="r2comm", choices=["gloo", "r2comm"])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--as-gloo", action="store_true")
    ap.add_argument("--tests", default="", help="comma-separated test names (default: all)")
    ap.add_argument("--tests-file", default="", help="a file of test names, one per line")
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test (all ranks)")
    ap.add_argument("--fork", action="store_true",
                    help="start the ranks by fork, not spawn (upstream's way): much faster on a "
                         "loaded machine, as they need not import torch again")
    ap.add_argument("--list-static", action="store_true",
                    help="print `<test> run|skip` as the test base decides before starting "
                         "ranks (feature tables, decorators, GPUs, world size) for this "
                         "backend, and run nothing")
    args = ap.parse_args()
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="r2c-conf-"))
    os.environ.setdefault("INIT_METHOD", "env://")
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    os.environ["R2COMM_CONFORMANCE_AS_GLOO"] = "1" if args.as_gloo else "0"
    os.environ["R2COMM_CONFORMANCE_START"] = "fork" if args.fork else "spawn"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, root)
    return args


if __name__ == "__main__":
    ARGS = _configure_from_argv()
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import r2comm.torch  # noqa: E402,F401  (registers the "r2comm" backend in every rank)

_BACKEND = os.environ["BACKEND"]
_AS_GLOO = os.environ.get("R2COMM_CONFORMANCE_AS_GLOO") == "1" and _BACKEND != "gloo"
if _AS_GLOO:
    os.environ["BACKEND"] = "gloo"          # the test base decides its skips from this
from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402



class _LikeGloo(str):
    """The backend's name, equal to "gloo" as well in the test base's runtime comparisons
    (`if BACKEND == "gloo":` branches that prepare a test's model or data)."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


if _AS_GLOO:
    os.environ["BACKEND"] = _BACKEND
    _dt.BACKEND = _LikeGloo(_BACKEND)       # ... and creates its groups with this

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """Upstream's spawn-mode driver, judging every rank's exit code."""

    def setUp(self):
        super().setUp()
        if os.environ.get("R2COMM_CONFORMANCE_START") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def _check_return_codes(self, fn, elapsed_time):
        super()._check_return_codes(fn, elapsed_time)
        if fn in self.skip_return_code_checks:
            return
        codes = [p.exitcode for p in self.processes]
        if any(c != codes[0] for c in codes):
            raise AssertionError(f"ranks exited with different codes {codes} (rank 0's "
                                 "alone is what torch's test base checks)")


class _Recorder(unittest.TextTestResult):
    """Keeps one outcome per test name: pass, fail (failure or error) or skip."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outcome, self.started = {}, {}

    def startTest(self, test):
        self.started[test._testMethodName] = time.monotonic()
        super().startTest(test)

    def _note(self, test, what):
        name = getattr(test, "_testMethodName", str(test))
        self.outcome[name] = (what, time.monotonic() - self.started.get(name, time.monotonic()))
        print(f"RESULT {name} {what} {self.outcome[name][1]:.1f}s", flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "fail")

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "fail")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skip")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "pass")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "fail")


def _selected(args):
    names = [t for t in args.tests.split(",") if t]
    if args.tests_file:
        with open(args.tests_file) as f:
            names += [ln.split()[0] for ln in f if ln.strip() and not ln.startswith("#")]
    every = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    unknown = sorted(set(names) - set(every))
    if unknown:
        sys.exit(f"unknown tests: {unknown}")
    return names or every


def static_skips():
    """{test: reason} for the tests the test base skips before spawning any rank."""
    out = {}
    for name in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn):
        fn = getattr(TestDistBackendWithSpawn, name)
        if getattr(fn, "__unittest_skip__", False):
            out[name] = getattr(fn, "__unittest_skip_why__", "")
    return out


# decorators of the test base whose skip depends only on this machine and the world size: their
# ranks would start, find it and exit with a skip code; the harness skips them without spawning
_RANK_SKIPS = {"skip_if_lt_x_gpu", "skip_if_no_gpu", "skip_if_small_worldsize",
               "skip_if_odd_worldsize"}


def rank_skip(name):
    """The reason a rank of this test would exit with a skip code at once, or None."""
    import inspect
    fn, size = getattr(TestDistBackendWithSpawn, name), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    while getattr(fn, "__wrapped__", None) is not None:
        maker = fn.__code__.co_qualname.split(".<locals>")[0]
        if maker in _RANK_SKIPS:
            free = inspect.getclosurevars(fn).nonlocals
            if maker == "skip_if_lt_x_gpu" and not free.get("allow_cpu") and gpus < free["x"]:
                return f"needs {free['x']} GPUs"
            if maker == "skip_if_no_gpu" and gpus < size:
                return "needs a GPU per rank"
            if maker == "skip_if_small_worldsize" and size < 8:
                return "needs 8 ranks"
            if maker == "skip_if_odd_worldsize" and size % 2:
                return "needs an even world size"
        fn = fn.__wrapped__
    return None


def main(args):
    if args.list_static:
        skips = static_skips()
        for name in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn):
            why = skips.get(name) or rank_skip(name)
            print(f"{name} {'skip ' + why if why else 'run'}")
        return 0
    names = _selected(args)
    pre = {n: rank_skip(n) for n in names}
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names if not pre[n])
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=0, stream=sys.stderr)
    result = runner.run(suite)
    for n in names:
        if pre[n]:
            result.outcome[n] = ("skip", 0.0)
            print(f"RESULT {n} skip 0.0s ({pre[n]}, decided without starting ranks)")
    counts = {k: sum(1 for o, _ in result.outcome.values() if o == k)
              for k in ("pass", "fail", "skip")}
    summary = (f"COUNTS backend={_BACKEND} as_gloo={int(_AS_GLOO)} "
               f"start={os.environ['R2COMM_CONFORMANCE_START']} "
               f"world_size={os.environ['WORLD_SIZE']} " +
               " ".join(f"{k}={v}" for k, v in counts.items()))
    print(summary, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# {summary}\n")
            for name in sorted(result.outcome):
                f.write(f"{name} {result.outcome[name][0]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
