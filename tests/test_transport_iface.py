"""The rail transport interface (r2comm/_core/transport.pxd) against the fake transport
(fake_transport.pxi: TCP underneath, seeded faults): multi-rank collectives whose posts are
refused or accepted in part, whose send completions come late, shuffled or never, and whose
connections fail at a random byte, checked bit for bit against numpy (tests/transport_worker.py),
with the failures' chunks migrated to surviving rails."""
import json
import os

import pytest

from conftest import ROOT, run_mpi

WORKER = os.path.join(ROOT, "tests", "transport_worker.py")
FAST = {"R2COMM_RAIL_TIMEOUT_MS": "300", "R2COMM_PROBE_MS": "30", "R2COMM_PROBE_MAX_MS": "300"}


def _run(n, spec, trials, seed=1, timeout=120):
    env = dict(FAST, R2COMM_TEST_TRANSPORT=spec, R2COMM_SHM="0")   # (tests/fake_transport.py)
    _, out = run_mpi(n, [WORKER, "fake", f"trials={trials}", f"seed={seed}"], timeout=timeout,
                     env=env)
    ok = [ln for ln in out.splitlines() if ln.startswith("OK fake ")]
    assert ok, out[-4000:]
    assert int(ok[-1].split()[2]) > 0                      # results were checked
    return json.loads([ln for ln in out.splitlines() if ln.startswith("FAKE ")][-1][5:])


def test_spec_parsing():
    from fake_transport import parse
    from r2comm.errors import R2commArgumentError
    assert parse("") == {}
    assert parse("fake:seed=3,short=0.5,fail_bytes=2M,max_fails=1") == {
        "seed": 3, "short": 0.5, "fail_bytes": 2 << 20, "max_fails": 1}
    with pytest.raises(R2commArgumentError):
        parse("verbs:seed=1")
    with pytest.raises(R2commArgumentError):
        parse("fake:sed=1")


def test_engine_selects_its_transport():
    from r2comm._core import testing
    from r2comm._core.engine import Engine
    e = Engine(0, 2, [0, 1], 65536, 0.5, 1.5, 1 << 20)
    try:
        assert testing.transport_stats(e)["transport"] == "tcp"
        testing.use_fake_transport(e, 7, short=0.5)
        st = testing.transport_stats(e)
        assert st["transport"] == "fake" and st["conns"] == 0
        testing.fuzz_attach(e, 1, 0, 1)
        assert testing.transport_stats(e)["transport"] == "fuzz"
    finally:
        e.close()


@pytest.mark.mpi
@pytest.mark.parametrize("n,seed", [(2, 1), (3, 2)])
def test_collectives_exact_over_short_posts_and_late_completions(n, seed):
    rep = _run(n, f"fake:seed={seed},block=0.2,short=0.4,delay=0.6", trials=18, seed=seed)
    st = rep["stats"]
    assert st["blocked"] > 0 and st["shorts"] > 0 and st["delayed"] > 0, rep
    assert st["completed"] > 0 and st["failed"] == 0 and st["lost"] == 0, rep
    assert "rail_failed" not in rep["events"], rep         # faults below the engine, no failover


@pytest.mark.mpi
@pytest.mark.parametrize("n,seed", [(2, 3), (3, 4)])
def test_connections_failing_at_a_random_byte_migrate_their_chunks(n, seed):
    rep = _run(n, f"fake:seed={seed},short=0.3,delay=0.3,fail=1,fail_bytes=3M,max_fails=3",
               trials=18, seed=seed)
    assert rep["stats"]["failed"] > 0 and rep["events"].get("rail_failed", 0) > 0, rep
    assert rep["resent"] > 0 or rep["events"].get("migrated", 0) > 0, rep


@pytest.mark.mpi
def test_lost_completions_fail_the_rail_and_chunks_are_resent():
    rep = _run(3, "fake:seed=5,delay=0.3,lose=0.05", trials=18, seed=5)
    assert rep["stats"]["lost"] > 0, rep
    assert "no send completion within the rail deadline" in rep["why"], rep
