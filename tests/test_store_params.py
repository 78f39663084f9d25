"""Rank 0's start-up parameters (chunk size, acknowledgements, integrity) are checked on every
rank and bound into the secret check every rank verifies of every other (issue 40, item 5;
bootstrap.py): a party that can write to the store changes what some ranks read, and every
rank fails start-up at once with a clear error, never a crash, a hang, or ranks running with
other parameters. The ranks are real processes (tests/tamper_worker.py), each one's view of the
store rewritten as the attacker would have rewritten the keys."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from r2comm.control import bootstrap
from r2comm.errors import R2commProtocolError, R2commSecurityWarning

OOB = "5f0c2a9e8d7b6a5f4e3d2c1b0a998877"
WORKER = os.path.join(ROOT, "tests", "tamper_worker.py")
STORE_S = 60          # each rank's store timeout: a rank left waiting would take this long
BOUND = 30            # s: every rank has raised by then


def _job(tmp_path, tampers, env=None):
    """Run len(tampers) ranks, rank r's view of the store rewritten by tampers[r]:
    [(returncode, output, seconds)] per rank."""
    base = dict(os.environ, PYTHONPATH=ROOT, R2T_STORE_S=str(STORE_S), **(env or {}))
    for k in ("R2COMM_JOB_SECRET", "R2COMM_JOB_SECRET_FILE"):
        if k not in (env or {}):
            base.pop(k, None)
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(len(tampers)),
                               str(tmp_path / "store")],
                              env=dict(base, R2T_TAMPER=json.dumps(t)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, t in enumerate(tampers)]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, STORE_S + 30 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text, time.monotonic() - t0))
    return out


def _all_refused(results, *why):
    """Every rank raised at start-up (never came up), within BOUND, with one of `why`."""
    text = "\n".join(f"--- rank {r} (rc {rc}, {s:.1f} s)\n{o[-1500:]}"
                     for r, (rc, o, s) in enumerate(results))
    for r, (rc, out, took) in enumerate(results):
        assert rc == 3 and f"ERR {r} " in out, text             # not a crash (SIGFPE: -8)
        assert not any(ln.startswith("UP ") for ln in out.splitlines()), text
        assert any(w in out for w in why), text
        assert took < BOUND, text                               # nobody waited out the store
    return text


@pytest.mark.parametrize("params,why", [
    ({"chunk_size": 0, "acks": True, "integrity": "checksum"}, "chunk_size 0 "),
    ({"chunk_size": "524288", "acks": True, "integrity": "checksum"}, "chunk_size '524288'"),
    ({"chunk_size": 1 << 40, "acks": True, "integrity": "checksum"}, "is not a multiple of 8"),
    ({"chunk_size": 524288, "acks": "yes", "integrity": "checksum"}, "acks 'yes'"),
    ({"chunk_size": 524288, "acks": True, "integrity": "none"}, "integrity 'none'"),
    ({"chunk_size": 524288}, "not {chunk_size, acks, integrity}"),
], ids=["chunk-0", "chunk-str", "chunk-huge", "acks-str", "integrity-none", "missing"])
def test_invalid_parameters_fail_every_rank_at_once(tmp_path, params, why):
    """Rank 1 reads invalid parameters: R2commProtocolError naming the value on both ranks.
    Old code: chunk_size 0 killed rank 1 with SIGFPE, a string gave rank 1 a TypeError and
    rank 0 waited out the store timeout."""
    results = _job(tmp_path, [{}, {"params": params}])
    _all_refused(results, "R2commProtocolError")
    assert all(why in out and "rank 0's parameters are invalid" in out for _, out, _ in results)


def test_a_downgraded_integrity_fails_every_rank(tmp_path):
    """Rank 0 runs mac with an out-of-band secret; rank 1 reads integrity=checksum: both fail
    start-up with R2commProtocolError naming the parameters. Old code: both came up and the
    allreduce failed with "no working NIC path"."""
    results = _job(tmp_path, [{}, {"params": {"chunk_size": 524288, "acks": True,
                                              "integrity": "checksum"}}],
                   {"R2COMM_INTEGRITY": "mac", "R2COMM_JOB_SECRET": OOB})
    text = _all_refused(results, "R2commProtocolError")
    assert all("run with other parameters" in out for _, out, _ in results), text


@pytest.mark.parametrize("forge", [False, True], ids=["check-copied", "record-forged"])
def test_ranks_cannot_be_split_off_unauthenticated(tmp_path, forge):
    """Three ranks, mac and an out-of-band secret; ranks 1 and 2 read integrity=checksum and a
    rank-0 record whose secret check is copied from their own (and, forged, whose parameters
    field is theirs too). Every rank fails start-up: the check is bound to the rank and the
    parameters, and a store writer without the secret cannot make rank 0's. Old code: ranks 1
    and 2 passed the check and came up with checksum integrity."""
    bad = {"chunk_size": 524288, "acks": True, "integrity": "checksum"}
    t = {"params": bad, "copy_check": True, "forge_params": forge}
    results = _job(tmp_path, [{}, t, t], {"R2COMM_INTEGRITY": "mac", "R2COMM_JOB_SECRET": OOB})
    text = _all_refused(results, "run with other parameters", "have another job secret")
    if forge:                    # ranks 1, 2: rank 0's record fails its check
        assert all("ranks [0] have another job secret" in out for _, out, _ in results[1:]), text


def test_untampered_parameters_still_start(tmp_path):
    results = _job(tmp_path, [{}, {}, {}], {"R2COMM_INTEGRITY": "mac", "R2COMM_JOB_SECRET": OOB})
    for r, (rc, out, _) in enumerate(results):
        assert rc == 0 and f"UP {r} mac" in out and f"OK tamper {r}" in out, out[-2000:]


def test_check_params_bounds():
    ok = {"chunk_size": 4096, "acks": False, "integrity": "mac"}
    assert bootstrap.check_params(dict(ok)) == ok
    for bad in (None, [], dict(ok, chunk_size=4095), dict(ok, chunk_size=4100),
                dict(ok, chunk_size=(64 << 20) + 8), dict(ok, chunk_size=True),
                dict(ok, chunk_size=4096.0), dict(ok, acks=1), dict(ok, integrity="MAC"),
                dict(ok, extra=1)):
        with pytest.raises(R2commProtocolError, match="rank 0's parameters are invalid"):
            bootstrap.check_params(bad)
    a = bootstrap.secret_check(b"k" * 32, 0, ok)
    assert a != bootstrap.secret_check(b"k" * 32, 1, ok)
    assert a != bootstrap.secret_check(b"k" * 32, 0, dict(ok, integrity="checksum"))
    assert a != bootstrap.secret_check(b"j" * 32, 0, ok)


def test_the_no_secret_warning_is_given_once(monkeypatch):
    monkeypatch.setattr(bootstrap, "_warned", set())
    with pytest.warns(R2commSecurityWarning, match="R2COMM_WARN_NO_SECRET=0") as got:
        bootstrap._warn_no_secret()
        bootstrap._warn_no_secret()
    assert len([w for w in got if issubclass(w.category, R2commSecurityWarning)]) == 1


def test_the_engine_refuses_a_chunk_size_of_0():
    """Below the bootstrap's check, the engine itself: ValueError, not SIGFPE at the first
    message (it divides by the chunk size)."""
    from r2comm._core import engine as eng
    with pytest.raises(ValueError, match="chunk_size"):
        eng.Engine(0, 2, [0, 2], 0, 5.0, 10.0, 1 << 20)
