"""control.allgather over its two trees on the real engine under mpiexec
(tests/control_worker.py; the protocol over every failure timing: tests/test_control_tree.py).
Loopback, shared memory off (every pair a network pair), 10 ranks: the trees, not the flood of
up to 7 ranks."""
import os

import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.mpi
WORKER = os.path.join(ROOT, "tests", "control_worker.py")


def scenario(n, name, timeout=200, env=None, **kw):
    _, out = run_mpi(n, [WORKER, name] + [f"{k}={v}" for k, v in kw.items()], timeout=timeout,
                     env=env)
    assert any(ln.startswith(f"OK {name} ") for ln in out.splitlines()), out[-4000:]
    return out


def test_tree_and_flood_agree_and_only_tree_peers_connect():
    scenario(10, "same")


@pytest.mark.parametrize("tree,child,mode", [("A", 3, "hard"), pytest.param("A", 1, "hard", marks=pytest.mark.slow),
                                             pytest.param("B", 9, "hard", marks=pytest.mark.slow),
                                             ("A", 3, "silent")])
def test_a_pair_failing_between_up_and_down_leaves_every_later_call_agreed(tree, child, mode):
    """The reverted tree (ab7982c) desynchronised the ranks' tags here and every later
    rail_state() failed; now that call and the later ones agree, without flooding. Silent:
    the parent's NIC drops everything to the child without an error (the engine's stall
    detection fails the rails, and tells the child)."""
    out = scenario(10, "updown", tree=tree, child=child, mode=mode)
    assert "UPDOWN pair" in out


def test_a_partition_raises_on_every_rank_within_the_timeout():
    out = scenario(10, "partition", timeout=240)
    assert "PARTITION slowest" in out


def test_a_local_argument_error_reaches_every_rank_over_the_plans_connections():
    """Telling the peers about a local argument error (channel.post_error) connected every
    peer; now the ring neighbours hear it and relay it: no new connection, all raise at once."""
    scenario(10, "argerr", env={"R2COMM_ALGO": "ring"})
