"""Point-to-point receives from any source (r2comm.ANY_SOURCE) under mpiexec with 3 and 4
ranks: stored and not yet arrived messages, arrival order across senders, each sender's order,
named-source receives posted in between, tags, a cancelled receive (tests/any_source_worker.py)."""
import os

import pytest

from conftest import run_mpi

pytestmark = pytest.mark.mpi
SHM_OK = True
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "any_source_worker.py")


def run_anysrc(n, env=None):
    _, out = run_mpi(n, [WORKER, "anysrc"], timeout=60, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith("OK anysrc ")]
    assert lines, out[-4000:]
    return int(lines[-1].split()[2])


@pytest.mark.parametrize("n", [3, 4])
def test_any_source_shared_memory(n):
    assert run_anysrc(n) == 5            # rank 0 counts its five checked parts


@pytest.mark.parametrize("n", [3, 4])
def test_any_source_tcp_small_chunks(n):
    """Over TCP with 16 KiB chunks: big messages arrive as many frames, matched on the first."""
    assert run_anysrc(n, env={"R2COMM_SHM": "0", "R2COMM_CHUNK_SIZE": "16K"}) == 5


def test_any_source_two_rails():
    """Two TCP rails: a message's chunks are striped over both, its first frame on either."""
    assert run_anysrc(4, env={"R2COMM_SHM": "0", "R2COMM_CHUNK_SIZE": "16K",
                              "R2COMM_RAILS": "127.0.0.1,127.0.0.2"}) == 5
