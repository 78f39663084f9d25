"""Every collective, point-to-point call and error path, under mpiexec with 2, 3 and 4 ranks.
Each scenario checks results against numpy and bit-identity across ranks (tests/mpi_worker.py)."""
import pytest

from conftest import run_scenario

pytestmark = pytest.mark.mpi
SHM_OK = True           # local ranks talk through shared memory here (conftest)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_dtypes_ops_sizes(n):
    count, _ = run_scenario(n, "collectives", timeout=30)
    assert count >= 300 * n      # every (collective, dtype, op, size) case, summed over ranks


@pytest.mark.parametrize("n", [2, 3])
def test_prepared_allreduce(n):
    """Communicator.prepare_allreduce: exact for every dtype and op, matched with a peer's
    Iallreduce, errors on every rank, exact where the general path runs it, closed when freed."""
    count, _ = run_scenario(n, "prepared", timeout=90)
    assert count == n * (11 * 4 * 2 + 11)


@pytest.mark.parametrize("n", [2, 4])
def test_send_and_receive_buffers_that_overlap_raise(n):
    """Buffers that share memory: R2commBufferError on that rank, R2commPeerError on the others
    (fast path, prepared call, general path of every collective with both), then in step;
    torch's in-place forms of all-gather and reduce-scatter stay allowed and exact."""
    count, _ = run_scenario(n, "aliased", timeout=90)
    assert count == n * 13


@pytest.mark.parametrize("n", [2, 3])
def test_small_allreduce_fast_path(n):
    """Small blocking Allreduce in one engine call: exact for every dtype and op, in step with
    calls around it, and every error of the general path on every rank."""
    count, _ = run_scenario(n, "fastpath", timeout=60)
    assert count == n * (11 * 4 * 3 * 3 + 30)


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_recursive_doubling_at_every_size(n):
    """The latency algorithm forced for big messages too (it then sends straight from the
    send buffer and reduces from it, with no copy into the result first)."""
    count, _ = run_scenario(n, "collectives", timeout=30,
                            env={"R2COMM_ALGO": "recursive_doubling"})
    assert count >= 300 * n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_point_to_point(n):
    count, _ = run_scenario(n, "p2p", timeout=30)
    assert count >= 19 * n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nonblocking_in_flight_any_order(n):
    count, _ = run_scenario(n, "nonblocking", timeout=30)
    assert count == 13 * n


@pytest.mark.parametrize("n", [2, 3])
def test_bad_input_raises_on_every_rank(n):
    count, _ = run_scenario(n, "errors", timeout=20)
    assert count >= 15 * n


@pytest.mark.parametrize("n", [3, 4])
def test_dup_split_free(n):
    count, _ = run_scenario(n, "comms", timeout=30)
    assert count == 4 * n


@pytest.mark.parametrize("n", [2, 3])
def test_drain_sends_delayed_acks_and_free_is_quick(n):
    count, _ = run_scenario(n, "drain", timeout=30)
    assert count == 30 * n


def test_wait_spins_on_while_sockets_are_busy():
    count, _ = run_scenario(2, "spinon", timeout=60, env={"R2COMM_SPIN_US": "20"})
    assert count == 2 * 10


def test_spin_backs_off_under_cpu_contention():
    count, out = run_scenario(2, "contended", timeout=60)
    assert count == 2 and "CONTENDED" in out, out
