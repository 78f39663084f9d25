"""The one allocator of communicator ids (r2comm/control/comm_ids.py, issue 30): agreed normal ids as Dup,
Split and the torch backend's groups take them, and the ids of control-plane and staging twins."""
import ast
import os

import pytest

from r2comm.control.comm_ids import CONTROL_BIT, GPU_BIT, CommIds
from r2comm.errors import R2commArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_agreed_ids_follow_the_highest_rank():
    """Two ranks that created different numbers of communicators agree on the next id (the
    maximum) and both continue above it; a Split's block of ids is skipped as a whole."""
    a, b = CommIds(), CommIds()
    assert a.agree(lambda v: v) == 1                       # a alone made one (Dup on a sub-job)
    top = max(a.next_free, b.next_free)                    # what an allreduce MAX gives both
    assert a.agree(lambda v: max(v, top)) == b.agree(lambda v: max(v, top)) == 2
    assert a.next_free == b.next_free == 3
    assert a.agree(lambda v: v, count=4) == 3 and a.next_free == 7   # Split: 3 colours + 1


def test_twin_ids():
    assert CommIds.control(5) == CONTROL_BIT | 5
    assert CommIds.gpu_twin(5, 3) == GPU_BIT | (3 << 24) | 5
    for cid, gen in ((1 << 24, 0), (5, 64)):
        with pytest.raises(R2commArgumentError, match="staging twin"):
            CommIds.gpu_twin(cid, gen)


def test_no_other_module_makes_twin_ids():
    """The twin id bits are spelled in comm_ids.py only (they were in control.py and
    gpu/pipeline.py, and the torch backend re-did the agreement)."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "r2comm")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("control", "comm_ids.py")) \
                    or path.endswith(os.path.join("testbed", "place.py")):   # CLONE_NEWNET
                continue
            with open(path) as f:
                tree = ast.parse(f.read())
            found += [(path, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                      and type(n.value) is int and n.value in (CONTROL_BIT, GPU_BIT)]
            found += [(path, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and n.attr == "next_comm_id"]
    assert found == []
