"""What mpi4py users pass: buffer specifications, any buffer-protocol object, bad settings and an
unbuilt engine. Each gets the buffer it names or an R2commError that says what to fix."""
import array
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from r2comm.front.buffers import as_array
from r2comm.config import Config
from r2comm.errors import R2commArgumentError, R2commBufferError

from conftest import ROOT, run_mpi

SHM_OK = True           # run and passing over shared memory between local ranks (conftest)


def test_spec_with_datatype_views_the_same_memory():
    a = np.arange(8, dtype=np.float32)
    v = as_array([a, MPI.FLOAT], True, "buf")
    assert v.dtype == np.float32 and v.size == 8 and np.shares_memory(v, a)
    v = as_array((a, "f"), True, "buf")
    assert v.dtype == np.float32 and v.size == 8
    raw = bytearray(32)                  # bytes given a type by the spec
    v = as_array([raw, MPI.DOUBLE], True, "buf")
    assert v.dtype == np.float64 and v.size == 4
    v[:] = 1.5
    assert np.frombuffer(raw, np.float64).tolist() == [1.5] * 4


def test_spec_with_count_and_displacement():
    a = np.arange(10, dtype=np.int32)
    assert as_array([a, 3, MPI.INT], False, "b").tolist() == [0, 1, 2]
    assert as_array([a, (3, 4), MPI.INT], False, "b").tolist() == [4, 5, 6]
    assert as_array([a, (3, 4), None], False, "b").tolist() == [4, 5, 6]
    assert as_array([a, 5], False, "b").tolist() == [0, 1, 2, 3, 4]
    v = as_array([a, (2, 8), MPI.INT], True, "b")
    v[:] = -1
    assert a[8:].tolist() == [-1, -1]


def test_any_buffer_protocol_object():
    f = array.array("f", [1.0, 2.0])
    v = as_array(f, True, "b")
    assert v.dtype == np.float32 and v.tolist() == [1.0, 2.0]
    v = as_array(memoryview(bytearray(16)).cast("q"), True, "b")
    assert v.dtype == np.int64 and v.size == 2


@pytest.mark.parametrize("spec, words", [
    ([np.zeros(4, np.float32), 5, MPI.FLOAT], "needs 20 bytes"),
    ([np.zeros(4, np.float32), (2, 3), MPI.FLOAT], "displacement 3"),
    ([np.zeros(4, np.float32), [1, 2], [0, 1], MPI.FLOAT], "vector collective"),
    ([np.zeros(4, np.float32), ([1, 2], [0, 1]), MPI.FLOAT], "vector collective"),
    ([np.zeros(4, np.float32), MPI.DOUBLE_INT], "no plain numpy element type"),
    ([np.zeros(4, np.float32), "not-a-type"], "not a datatype"),
    ([np.zeros(4, np.float32), 1.5, MPI.FLOAT], "not an integer"),
    ([np.zeros(4, np.float32)], "[buf, datatype]"),
    ([1, 2, 3], "int does not expose a buffer"),
    ({"a": 1}, "dict does not expose a buffer"),
    (np.zeros((4, 4), np.float32)[:, 1], "not contiguous"),
    ([np.zeros(3, np.uint8), MPI.INT], "not whole int32 elements"),
])
def test_bad_specs_name_what_to_fix(spec, words):
    with pytest.raises(R2commBufferError) as ei:
        as_array(spec, True, "Allreduce recvbuf")
    assert words in str(ei.value) and "Allreduce recvbuf" in str(ei.value)


def test_read_only_spec_is_refused_for_output():
    with pytest.raises(R2commBufferError, match="read-only"):
        as_array([b"\0" * 16, MPI.FLOAT], True, "Recv buf")
    assert as_array([b"\0" * 16, MPI.FLOAT], False, "Send buf").size == 4


@pytest.mark.parametrize("var, val", [("R2COMM_TIMEOUT", "soon"), ("R2COMM_CHUNK_SIZE", "big"),
                                      ("R2COMM_REPLAN", "1.5"), ("R2COMM_RAIL_BW", "1,x"),
                                      ("R2COMM_EAGER", "64Q")])
def test_bad_setting_names_the_variable(monkeypatch, var, val):
    monkeypatch.setenv(var, val)
    with pytest.raises(R2commArgumentError) as ei:
        Config.from_env()
    assert var in str(ei.value) and repr(val) in str(ei.value)


def test_unbuilt_engine_says_what_to_do(tmp_path):
    """A copy of the source tree without the compiled engine: Communicator() names the fix."""
    import shutil
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "r2comm"), dst / "r2comm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = ("import r2comm, sys\n"
            "try:\n    r2comm.Communicator()\n"
            "except r2comm.R2commBuildError as e:\n"
            "    assert isinstance(e, ImportError) and isinstance(e, r2comm.R2commError)\n"
            "    print('MSG', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=dst, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(dst)})
    assert p.returncode == 0, p.stderr
    assert "not built" in p.stdout and "scripts/test.sh" in p.stdout and "build_ext" in p.stdout


@pytest.mark.mpi
def test_buffer_specs_in_collectives_and_p2p_three_ranks():
    rc, out = run_mpi(3, [os.path.join(ROOT, "tests", "api_worker.py")], timeout=60)
    assert "OK specs 3" in out, out[-3000:]


def test_every_public_method_has_a_docstring():
    """help() shows a description for every public name users call (not a source comment)."""
    import inspect
    from r2comm.communicator import Communicator
    from r2comm.front.pt2pt import Message, PointToPoint
    from r2comm.request import BaseRequest, GroupRequest, LocalRequest, Prequest, Request, Status
    from r2comm.front.vcoll import VectorCollectives
    missing = []
    for cls in (Communicator, VectorCollectives, PointToPoint, Message, BaseRequest, Request,
                Prequest, LocalRequest, GroupRequest, Status):
        for name, obj in vars(cls).items():
            if name.startswith("_"):
                continue
            f = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
            if callable(f) and not (f.__doc__ or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"no docstring: {missing}"
    assert inspect.getdoc(Communicator.Dup).startswith("A new communicator")
