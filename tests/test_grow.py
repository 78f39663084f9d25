"""Grow back after a rank died (issue 44 item 2): survivors Revoke, Shrink and Grow by one while a
replacement process joins (Communicator.Grow / Communicator.join through the job's store), the
model state goes to it, and collectives on the grown communicator are exact; cycle after cycle,
with nothing left behind (tests/grow_worker.py runs the processes)."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from proc_jobs import collect, wait_all
from r2comm.control.bootstrap_store import DirStore, announce_growth, claim_growth
from r2comm.errors import R2commArgumentError

WORKER = os.path.join(ROOT, "tests", "grow_worker.py")


def run_cycles(d, n, victims, limit, state=1 << 16):
    """Run a job of n ranks through len(victims) kill-and-grow cycles; {tag: result}."""
    with open(os.path.join(d, "plan.json"), "w") as f:
        json.dump({"cycles": victims, "timeout": 20, "state": state}, f)
    env = dict(os.environ, R2COMM_PROBE="0")

    def spawn(*args):
        return subprocess.Popen([sys.executable, WORKER, d, str(n), *map(str, args)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs = {str(r): spawn("start", r) for r in range(n)}
    until = time.monotonic() + limit
    started = 0
    while time.monotonic() < until and started < len(victims):
        if os.path.exists(os.path.join(d, f"kill.{started}")):    # the victim is gone:
            procs[f"j{started}"] = spawn("join", started)          # its replacement starts
            started += 1
        else:
            time.sleep(0.02)
    hung = wait_all(procs, until)
    results, errors = collect(d, procs)
    assert not errors, f"processes failed: {errors}"
    assert not hung, f"{hung} still ran after {limit} s: {results}"
    assert started == len(victims), f"only {started} replacements started: {results}"
    return results, {tag: p.returncode for tag, p in procs.items()}


def check_cycles(results, codes, n, victims):
    finishers = [t for t, r in results.items() if r.get("done")]
    assert len(finishers) == n, (sorted(finishers), results)
    for tag in finishers:
        res = results[tag]
        assert codes[tag] == 0, (tag, codes[tag])
        if tag.startswith("j"):
            assert res["state_ok"] and res["grown_exact"], res
        for rec in res["cycles"]:
            assert rec["shrunk_size"] == n - 1 and rec["shrunk_exact"], (tag, rec)
            assert rec["grown"][1] == n and rec["grown_exact"] and rec["state_ok"], (tag, rec)
            # the death itself, or a survivor that found it first revoking the communicator
            assert rec["error"] in ("R2commNetworkError", "R2commRevokedError"), (tag, rec)
    for k in range(len(victims)):        # some survivor found the death itself
        assert any(rec["error"] == "R2commNetworkError" for res in results.values()
                   for rec in res["cycles"] if rec["cycle"] == k), k
    dead = {t for t, c in codes.items() if c == -9}
    assert len(dead) == len(victims), codes


def test_shrink_then_grow_back_with_a_replacement(tmp_path):
    """4 ranks; rank 2 dies; the 3 survivors shrink, then grow by one as a fresh process
    joins: it gets the model state (a Bcast from rank 0) and the grown communicator of 4 runs
    exact collectives; then the replacement's rank dies in turn and is replaced again."""
    victims = [2, 3]
    results, codes = run_cycles(str(tmp_path), 4, victims, 120)
    check_cycles(results, codes, 4, victims)
    grows = [rec["grow_s"] for res in results.values() for rec in res["cycles"]]
    assert max(grows) < 20, grows          # (the bench measures it; this only bounds it)


@pytest.mark.slow
def test_fifty_shrink_grow_cycles_hold_nothing_more(tmp_path):
    """50 kill / shrink / grow / free cycles on 3 ranks (the victim rotates): every result
    exact; rank 0 holds no more threads or segments after the last cycle than after the first
    (its live world's sockets vary with the connections made on first use), and every process
    that finished holds no more threads, fds or segments once it freed its last communicator
    than before its first."""
    victims = [1 + k % 2 for k in range(50)]          # rank 0 survives every cycle
    results, codes = run_cycles(str(tmp_path), 3, victims, 1500, state=1024)
    check_cycles(results, codes, 3, victims)
    for tag, res in results.items():
        if res.get("done"):        # all freed: what it held before its first communicator
            base, end = res["held_base"], res["held_end"]
            assert end[0] <= base[0] and end[1] <= base[1] and end[2] <= base[2], \
                (tag, base, end, res["fds_end"], res["sockets_end"])
    first, last = results["0"]["held_first"], results["0"]["held_last"]
    assert last[0] <= first[0] and last[2] <= first[2], (first, last)     # (live sockets vary)


def test_growth_records_are_checked(tmp_path):
    """The store's growth record is checked, not trusted; a prefix names one growth; a joiner
    beyond the announced count is refused."""
    store = DirStore(str(tmp_path / "s"), timeout=5)
    announce_growth(store, "g1", 3, 4)
    assert claim_growth(store, "g1", 5) == (3, 4)
    with pytest.raises(R2commArgumentError, match="would be joiner number 2"):
        claim_growth(store, "g1", 5)
    with pytest.raises(R2commArgumentError, match="used by an earlier growth"):
        announce_growth(store, "g1", 3, 4)
    for bad in (b"x y", b"4 3", b"0 2", b"3", b"\xff\xfe"):
        store.set("g2/size", bad)
        with pytest.raises(R2commArgumentError):
            claim_growth(store, "g2", 5)
