"""mpi4py's own buffer tests (tests/mpi4py/, vendored unmodified) on r2comm: the adapter.

    mpiexec -n N python tests/mpi4py_suite.py [--files cco_buf,cco_nb_buf,p2p_buf]
        [--typecodes i,d,F] [--methods testGather,testScan] [--out results.txt]
        [--map-constants]

It only maps names, in a stand-in for the mpi4py.MPI module that the test files import:
MPI.COMM_WORLD is r2comm.Communicator(MPI.COMM_WORLD) (a Dup of it after a case that did not
pass, so nothing left over from one case reaches the next), MPI.Request and MPI.Prequest are
r2comm's where r2comm has them (their class methods, Startall and Waitany, take r2comm
requests). Every other name is mpi4py's own: r2comm accepts MPI.IN_PLACE, MPI.PROC_NULL,
MPI.ANY_SOURCE, MPI.Status, ... itself. --map-constants also maps IN_PLACE and ANY_SOURCE to
r2comm's (the mapping issue 41's first run used). Only the classes on COMM_WORLD run (the
COMM_SELF ones and TestReduceLocal never reach r2comm), numpy arrays only.

A case is one test method with one typecode (arrayimpl.loop narrowed to it), or the method once
if it loops over none. After a case, a buffer it left attached for buffered sends is detached. Outcomes, agreed over every rank (through mpi4py's COMM_WORLD):
  pass   every rank passed
  skip   a rank skipped (mpi4py's own skips) and none failed
  oos    a rank was refused with R2commArgumentError as outside r2comm's scope (derived
         datatypes, long double / complex256, buffered sends, intercommunicators); the other
         ranks may fail from that (a peer error, a receive that timed out)
  wrong  an assertion failed on a rank: a wrong result
  error  anything else (the exception's type is printed)
Rank 0 prints `CASE <file> <Class.method> <typecode> <outcome> <detail>` per case and
`COUNTS <file> pass=.. skip=.. oos=.. wrong=.. error=.. total=..` per file, and writes the
same lines to --out."""
import argparse
import inspect
import os
import sys
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE_DIR = os.path.join(HERE, "mpi4py")
FILES = ("cco_buf", "cco_nb_buf", "p2p_buf")
OUT_OF_SCOPE = "outside r2comm's scope"      # r2comm.errors.unsupported()'s wording


class _Outcome(unittest.TestResult):
    """The first failure or error of one case (an assertion: wrong; an exception: its type)."""

    def __init__(self):
        super().__init__()
        self.outcome, self.detail = "pass", ""

    def _note(self, kind, err):
        if self.outcome in ("wrong", "error", "oos"):
            return
        exc = err[1]
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if kind == "error" and OUT_OF_SCOPE in str(exc) and \
                "R2commArgumentError" in [c.__name__ for c in type(exc).__mro__]:
            kind = "oos"
        self.outcome, self.detail = kind, text

    def addFailure(self, test, err):
        self._note("wrong", err)

    def addError(self, test, err):
        self._note("error", err)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._note("wrong" if issubclass(err[0], test.failureException) else "error", err)

    def addSkip(self, test, reason):
        if self.outcome == "pass":
            self.outcome, self.detail = "skip", reason[:200]


def combine(per_rank):
    """One outcome for a case from every rank's (outcome, detail)."""
    kinds = [o for o, _ in per_rank]
    for kind in ("oos", "wrong", "error", "skip"):
        if kind in kinds:
            i = kinds.index(kind)
            return kind, f"rank {i}: {per_rank[i][1]}"
    return "pass", ""


class _Narrow:
    """arrayimpl.loop narrowed to one typecode (None: all of them)."""

    def __init__(self, arrayimpl):
        self.real = arrayimpl.loop
        self.wanted = None

    def __call__(self, *args):
        for item in self.real(*args):
            if self.wanted is None or item[1] == self.wanted:
                yield item


def install(real_mpi, comm, r2comm, map_constants):
    """The stand-in mpi4py.MPI module the test files import."""
    proxy = types.ModuleType("mpi4py.MPI")
    proxy.__getattr__ = lambda name: getattr(real_mpi, name)
    proxy.COMM_WORLD = comm
    for name in ("Request", "Prequest"):
        if hasattr(r2comm, name) and hasattr(getattr(r2comm, name), "Startall" if
                                             name == "Prequest" else "Waitall"):
            setattr(proxy, name, getattr(r2comm, name))
    if map_constants:
        proxy.IN_PLACE, proxy.ANY_SOURCE = r2comm.IN_PLACE, r2comm.ANY_SOURCE
    import mpi4py
    sys.modules["mpi4py.MPI"] = proxy
    mpi4py.MPI = proxy
    return proxy


def detach_buffer(mpi):
    """Detach the buffer a case attached for buffered sends and left attached when r2comm
    refused those (outside its scope), so the next case's MPI.Attach_buffer works."""
    try:
        mpi.Detach_buffer()
    except Exception:           # nothing attached
        pass


def loops_over_typecodes(cls, name):
    """Whether the test loops over typecodes (its own source or the one it overrides)."""
    return any("arrayimpl.loop(" in inspect.getsource(vars(c)[name])
               for c in cls.__mro__ if name in vars(c))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default=",".join(FILES))
    ap.add_argument("--typecodes", default="", help="comma-separated (default: every one)")
    ap.add_argument("--methods", default="", help="comma-separated test names (default: all)")
    ap.add_argument("--out", default="")
    ap.add_argument("--map-constants", action="store_true")
    args = ap.parse_args()

    from mpi4py import MPI
    import r2comm
    world = MPI.COMM_WORLD
    base = r2comm.Communicator(world)
    proxy = install(MPI, base, r2comm, args.map_constants)
    sys.path.insert(0, SUITE_DIR)
    import arrayimpl
    arrayimpl.ArrayBackends[:] = [arrayimpl.ArrayNumPy]
    narrow = arrayimpl.loop = _Narrow(arrayimpl)
    typecodes = list(arrayimpl.ArrayNumPy.TypeMap)
    if args.typecodes:
        typecodes = [t for t in typecodes if t in args.typecodes.split(",")]
    methods = set(filter(None, args.methods.split(",")))

    rank0 = world.Get_rank() == 0
    lines = []

    def say(line):
        if rank0:
            print(line, flush=True)
            lines.append(line)

    current = base
    for fname in filter(None, args.files.split(",")):
        mod = __import__(f"test_{fname}")
        counts = dict.fromkeys(("pass", "skip", "oos", "wrong", "error"), 0)
        classes = [c for _, c in sorted(vars(mod).items()) if isinstance(c, type) and
                   issubclass(c, unittest.TestCase) and "World" in c.__name__]
        t0 = time.monotonic()
        for cls in classes:
            names = unittest.TestLoader().getTestCaseNames(cls)
            for name in names:
                if methods and name not in methods:
                    continue
                for tc in (typecodes if loops_over_typecodes(cls, name) else ["-"]):
                    narrow.wanted = None if tc == "-" else tc
                    cls.COMM = current
                    proxy.COMM_WORLD = current
                    res = _Outcome()
                    cls(name).run(res)
                    detach_buffer(MPI)
                    outcome, detail = combine(world.allgather((res.outcome, res.detail)))
                    counts[outcome] += 1
                    say(f"CASE {fname} {cls.__name__}.{name} {tc} {outcome} {detail}".rstrip())
                    if outcome not in ("pass", "skip"):
                        old, current = current, base.Dup()   # a clean one for the next case
                        if old is not base:
                            old.Free()
        total = sum(counts.values())
        say(f"COUNTS {fname} " + " ".join(f"{k}={v}" for k, v in counts.items()) +
            f" total={total} seconds={time.monotonic() - t0:.0f}")
    if rank0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    world.Barrier()
    base.Free()


if __name__ == "__main__":
    main()
