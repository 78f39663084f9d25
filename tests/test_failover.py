"""Lossless failover under randomised fault injection (tests/fault_worker.py).

Faults strike at random byte offsets (including before the first and inside the last chunk), on
random ranks and rails, hard (the connection is shut down) or silent (the NIC drops everything);
every result is compared bit for bit with the fault-free answer, and every run is bounded."""
import os
import re

import pytest

from conftest import run_scenario

pytestmark = pytest.mark.mpi
FAST = {"R2COMM_RAIL_TIMEOUT_MS": "150", "R2COMM_PROBE_MS": "30", "R2COMM_PROBE_MAX_MS": "300"}


def _faults(out):
    m = re.search(r"FAULTS injected=(\d+) struck_trials=(\d+) detected_trials=(\d+) "
                  r"missed_hard=(\d+) trials=(\d+) skipped=(\d+)", out)
    assert m, out[-3000:]
    return [int(g) for g in m.groups()]


@pytest.mark.parametrize("n,seed,trials", [(2, 11, 80), (3, 12, 80), (4, 13, 60)])
def test_random_faults_results_bit_identical(n, seed, trials):
    count, out = run_scenario(n, "random", timeout=150, env=FAST, seed=seed, trials=trials)
    injected, struck, detected, missed, total, skipped = _faults(out)
    assert count == trials * n                 # every trial's result checked on every rank
    assert injected >= trials and skipped <= trials // 10
    # (rank, trial) pairs where a fault took effect; some collectives send nothing from the
    # faulted rank, or less than the fault's offset, so not every injection strikes
    assert struck >= trials // 3, out[-3000:]
    assert detected >= struck // 2, out[-3000:]  # a silent fault may be hedged around unseen
    assert missed == 0, out[-3000:]            # a hard fault that struck always failed its rail


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_random_faults_many_seeds(n, seed):
    count, out = run_scenario(n, "random", timeout=300, env=FAST, seed=seed, trials=100)
    assert count == 100 * n


@pytest.mark.parametrize("n,mode", [(3, "hard"), (2, "silent"), pytest.param(2, "hard", marks=pytest.mark.slow),
                                    pytest.param(3, "silent", marks=pytest.mark.slow)])
def test_pair_losing_every_rail_raises_everywhere(n, mode):
    _, out = run_scenario(n, "partition", timeout=60, mode=mode)
    line = [ln for ln in out.splitlines() if ln.startswith("PARTITION")][0]
    assert line.count("R2commNetworkError") == n


@pytest.mark.parametrize("n", [2, 3])
def test_progress_survives_signals(n):
    # regression: epoll_wait's EINTR (SIGSTOP/SIGCONT, any handled signal) read as "engine
    # stopped" and ended the progress thread: acks then waited for the next blocking call
    count, out = run_scenario(n, "signals", timeout=60)
    assert count == n, out


@pytest.mark.parametrize("n", [2, 3])
def test_silent_rail_is_hedged_before_its_deadline(n):
    env = {"R2COMM_RAIL_TIMEOUT_MS": "4000", "R2COMM_PROBE_MS": "30"}
    count, out = run_scenario(n, "hedge", timeout=60, env=env, rails="127.0.0.1,127.0.0.2")
    assert count == 3 * n and "HEDGE took=" in out


@pytest.mark.parametrize("n", [2, 3])
def test_flapping_rail(n):
    count, out = run_scenario(n, "flap", timeout=90, env=FAST)
    assert count == 60 * n


def test_fault_from_environment_and_debug_log():
    env = dict(FAST, R2COMM_FAULT="rank=1,rail=0,after_ms=300,mode=silent", R2COMM_DEBUG="INFO")
    count, out = run_scenario(2, "envfault", timeout=60, env=env)
    assert re.search(r"ENVFAULT ops=\d+ rail_failed=[1-9]", out)
    assert "rail_failed" in out and "r2comm rank" in out      # R2COMM_DEBUG=INFO log lines


@pytest.mark.parametrize("n", [2, 3])
def test_peer_death_raises_on_survivors(n):
    from conftest import run_mpi, WORKER
    # hydra would kill the survivors when a rank exits early; keep them running
    rc, out = run_mpi(n, [WORKER, "peerdeath"], timeout=60, env=FAST, expect_ok=False,
                      mpiexec_args=["-disable-auto-cleanup"])
    oks = [ln for ln in out.splitlines() if ln.startswith("OK peerdeath")]
    assert len(oks) == n - 1, out[-3000:]
    assert all("R2commNetworkError" in ln for ln in oks)


def test_automatic_replan_after_nic_loss():
    """R2COMM_REPLAN: after a real NIC loss the ranks agree on the new rail state at an
    operation boundary and switch to the degraded-server allreduce; results stay exact."""
    count, out = run_scenario(4, "autoreplan", timeout=90, env=dict(FAST, R2COMM_REPLAN="2"),
                              rails="127.0.0.1,127.0.0.2")
    assert count == 48
    # before: the static plan of 4 ranks of one host at 3 MB (recursive halving)
    assert "AUTOREPLAN before=rabenseifner after=degraded" in out


@pytest.mark.parametrize("n", [2, 3])
def test_failback_and_events_survive_slow_handshakes(n):
    """Clients that trickle a handshake into every listener (one byte every 0.5 s) no longer
    hold the links thread: a restored rail is re-admitted within the usual bound and events
    keep reaching on_event."""
    count, out = run_scenario(n, "slowloris", timeout=120, env=FAST)
    assert re.search(r"SLOWLORIS failback_s=\d", out), out[-3000:]
    assert count >= 5 * n
@pytest.mark.parametrize("n", [2, 3])
def test_failback_within_1s_under_an_idle_connection_flood(n):
    """Issue 28 item 4: 200 idle connections per rank from addresses of no rank (renewed when
    cut) and a trickling client per listener: a restored rail is re-admitted within 1 s
    (before: the 64 handshake slots stayed taken and every probe was closed at once)."""
    count, out = run_scenario(n, "idleflood", timeout=120, env=FAST, idle=200, limit=1.0, cycles=3)
    m = re.search(r"IDLEFLOOD failback_s=([\d.]+) ops=\d+ evicted_min=(\d+)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) < 1.0 and int(m.group(2)) >= 1
    assert count >= 5 * n


# --- a stalled process is not a dead NIC (SIGSTOP), a dead one still raises (SIGKILL) ---------
# default deadlines (500 ms per rail, 1.5 s for a peer): the stops outlast both many times over

@pytest.mark.parametrize("stop", [1, 3])
def test_stopped_process_is_not_a_dead_nic(stop):
    """Rank 1 stopped mid-stream: its kernel keeps acknowledging TCP, so no rail fails, the
    stream resumes with exact results, and peer_stalled / peer_resumed name rank 1."""
    count, out = run_scenario(3, "stall", timeout=60, stop=stop)
    assert count == 3
    # one row per rank per round (a round that gave the engine nothing to judge is run again,
    # up to 3): no rail failed in any of them
    rows = [ln for ln in out.splitlines() if ln.startswith("STALL ") and "{'rank'" in ln]
    assert rows and len(rows) % 3 == 0 and len(rows) <= 9, out[-3000:]
    assert all("'failed': []" in r for r in rows), out[-3000:]


@pytest.mark.slow
def test_stopped_process_10s():
    # fault scenarios run with a 60 s operation timeout (mpi_worker.main): waited out, not raised
    count, out = run_scenario(3, "stall", timeout=120, stop=10)
    assert count == 3


def test_stopped_process_with_full_receive_window():
    """Large messages into a small receive buffer: the stopped rank's kernel shuts its window,
    so nothing more is acknowledged, but it answers the window probes; that is told apart from
    a black hole (no answer at all) and the rail is held. One rail, so the evidence is that."""
    # under the sanitizer build (scripts/asan.sh) the sender is slow enough that the window may
    # still be closing at the deadline: the stall must still be told apart, by either evidence
    # a 16 KiB socket buffer fills within the stop even on a loaded machine (with 64 KiB the
    # sender sometimes had less than a window out at the deadline in all three rounds: the stall
    # was told apart by the other evidence, 1 in 3 quiet runs and in a loaded CI run)
    # (and a stop that lands while the sender has only a small frame out to the stopped rank is
    # told apart by "its kernel acknowledged 48 bytes": all three rounds of a quiet clean-clone
    # run at a823903 did so, hence up to six rounds)
    evidence = "" if os.environ.get("R2COMM_ASAN_BUILD") else "receive window shut"
    count, out = run_scenario(3, "stall", timeout=150, env={"R2COMM_SOCKBUF": "16384"}, stop=3,
                              count=4_000_000, rails="127.0.0.1", evidence=evidence, tries=6)
    assert count == 3


def test_killed_process_raises_on_every_survivor(tmp_path):
    """SIGKILL of rank 1 mid-stream: both survivors raise R2commNetworkError within 5 s of the
    kill, and record that rank 1's process is gone (peer_lost, cause peer_process)."""
    import sys
    from conftest import run_mpi, WORKER
    # each rank runs under a shell; the killed rank's shell waits (bounded) for the survivors'
    # reports, so hydra does not see a rank die by a signal and kill the survivors itself
    keep = ('"$@"; [ $? -eq 137 ] && for i in $(seq 150); do [ -e "$0/rank0.txt" ] && '
            '[ -e "$0/rank2.txt" ] && break; sleep 0.1; done; exit 0')
    _, out = run_mpi(3, ["-c", keep, str(tmp_path), sys.executable, WORKER, "sigkill",
                         f"out={tmp_path}"], timeout=60, expect_ok=False,
                     mpiexec_args=["-disable-auto-cleanup"], executable="sh")
    files = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert {"killed.txt", "rank0.txt", "rank2.txt"} <= set(files), out[-4000:]
    killed = float(files["killed.txt"])
    for r in (0, 2):
        line = files[f"rank{r}.txt"]
        took = float(re.search(r"raised_at=([\d.]+)", line).group(1)) - killed
        print(f"SIGKILL rank 1: rank {r} raised after {took:.2f} s")     # pytest -s
        assert 0 < took < 5, line
        assert "R2commNetworkError" in line and "cause=peer_process" in line, line
