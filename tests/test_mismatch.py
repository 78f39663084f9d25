"""Mismatched collective calls fail at once, on every rank, naming both calls; a rank whose own
arguments are bad raises locally and its peers raise too; the sequence stays in step (issue 17
item 3). 3 ranks under mpiexec, 8 B, 4 KiB, 128 KiB and 1 MiB; every rank must raise within
BOUND seconds while the operation timeout is 30 s (tests/mismatch_worker.py)."""
import os

import pytest

from conftest import run_mpi

SHM_OK = True           # run and passing over shared memory between local ranks (conftest)

pytestmark = pytest.mark.mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mismatch_worker.py")
BOUND = 5          # seconds; measured 0.001-0.02 s on loopback (generous for shared CPUs)


def run(scenario, n=3, env=None, **kw):
    args = [f"{k}={v}" for k, v in {"bound": BOUND, **kw}.items()]
    _, out = run_mpi(n, [WORKER, scenario] + args, timeout=180, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith(f"OK {scenario} ")]
    assert lines, out[-4000:]
    return int(lines[-1].split()[2]), out


def test_every_rank_its_own_bcast_root():
    """Used to return without error at 8 B, every rank keeping its own data."""
    count, _ = run("all_roots")
    assert count == 3 * 4


def test_allreduce_against_bcast():
    """Used to wait for the full operation timeout at 8 B and 4 KiB (root 0)."""
    count, _ = run("allreduce_vs_bcast")
    assert count == 3 * 8


def test_receive_buffer_too_small_on_one_rank():
    """Used to let the other ranks' Allreduce return, and the next collective to mismatch."""
    count, _ = run("small_buffer")
    assert count == 3 * 4


def test_iallreduce_and_allreduce_in_different_orders():
    """Used to complete, with different results on different ranks."""
    count, _ = run("order")
    assert count == 3 * 4


def test_other_mismatched_pairs():
    count, _ = run("other_kinds")
    assert count == 3 * 4


def test_two_ranks_all_roots_and_order():
    run("all_roots", n=2, sizes="8,1048576")
    run("order", n=2, sizes="8,1048576")


def test_four_ranks():
    """Two agreement rounds, and recursive doubling on a power of two."""
    run("all_roots", n=4, sizes="8,1048576")
    run("small_buffer", n=4, sizes="8,1048576")


def test_racing_detectors_raise_one_report():
    """Six ranks, ring allreduce and Bcast, 12 rounds in which two to six ranks detect one
    mismatch at once (rank 3 odd; ranks 1 and 4 odd; every rank its own Bcast root): every
    rank raises R2commMismatchError within BOUND with the same message in every round (the
    judge's verdict), and the next Allreduce works. Old code: each rank raised with the first
    report to reach it (different messages in a round of 3 of 3 runs)."""
    for _ in range(3):      # a loaded machine can serialise every round: then run again
        count, out = run("racing_detectors", n=6, env={"R2COMM_ALGO": "ring"}, rounds=12)
        assert count == 6 * 12
        races = [ln.split() for ln in out.splitlines() if ln.startswith("RACES ")][0]
        if int(races[1]) >= 1:
            break
    assert int(races[1]) >= 1, out[-3000:]         # two detectors or more really raced
