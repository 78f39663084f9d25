"""The store bootstrap trusts nothing it reads (issue 28, item 2): no pickle (a fixed, bounded
encoding), an out-of-band job secret (R2COMM_JOB_SECRET / R2COMM_JOB_SECRET_FILE) that a
process reading the whole store still cannot get past, the salt's key deleted after start-up,
and a warning when mac integrity runs under a store without an out-of-band secret."""
import datetime
import hashlib
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from r2comm.control import bootstrap
from r2comm.transport import tcp
from r2comm.control.bootstrap_store import DirStore, StoreComm, decode, encode, MAX_VALUE_BYTES
from r2comm.errors import R2commArgumentError, R2commProtocolError

OOB = "5f0c2a9e8d7b6a5f4e3d2c1b0a998877"


class _Boom:
    """Unpickling this touches a file: proof that a store value was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_codec_round_trip_and_bounds():
    v = {"rails": [("127.0.0.1", 5)], (1, 2): None, "b": b"\x00\xff", "f": 1.5, "n": [True]}
    assert decode(encode(v)) == v
    for bad in (b"\x80\x04K\x01.", b"{}", b'{"x": 1}', b'{"d": [[[1], 2]]}', b"[" * 5000,
                b'{"b": "zz"}', b"x" * (MAX_VALUE_BYTES + 1), "text"):
        with pytest.raises(R2commProtocolError):
            decode(bad)
    with pytest.raises(R2commArgumentError, match="cannot send"):
        encode(object())


def test_store_values_are_never_unpickled(tmp_path):
    """Whoever writes a pickle into the store gets a clear error, not code run in the rank."""
    marker = tmp_path / "unpickled"
    store = DirStore(tmp_path / "st", timeout=5)
    store.set("job/1", pickle.dumps(_Boom(str(marker))))      # the key rank 1's bcast reads
    with pytest.raises(R2commProtocolError, match="job/1"):
        StoreComm(store, 1, 2, "job", timeout=5).bcast(None, root=0)
    assert not marker.exists()


def test_a_value_that_cannot_be_encoded_fails_every_rank(tmp_path):
    """A Python object the encoding does not carry: the sender raises R2commArgumentError, the
    other ranks R2commPeerError at once (not after their timeout)."""
    import numpy as np
    from r2comm.errors import R2commPeerError
    store = DirStore(tmp_path / "st", timeout=5)
    errs = [None, None]

    def rank(r):
        try:
            StoreComm(store, r, 2, "job", timeout=20).allgather(np.zeros(2) if r == 0 else r)
        except Exception as exc:     # handed to the test
            errs[r] = exc
    t0 = time.monotonic()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert isinstance(errs[0], R2commArgumentError) and "ndarray" in str(errs[0])
    assert isinstance(errs[1], R2commPeerError) and "rank 0" in str(errs[1])
    assert time.monotonic() - t0 < 5


def test_salt_key_is_deleted_from_a_torch_tcpstore():
    torch_dist = pytest.importorskip("torch.distributed", reason="torch is not installed")
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                 wait_for_workers=False)
    stores = [server, torch_dist.TCPStore("127.0.0.1", server.port, None, False,
                                          datetime.timedelta(seconds=30))]
    out = [None, None]

    def rank(r):
        c = StoreComm(stores[r], r, 2, "t", timeout=20)
        salt = c.bcast_secret(os.urandom(32) if r == 0 else None)
        c.allgather(r)                    # every rank has read the salt
        c.forget_secrets()
        out[r] = salt
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out[0] == out[1] and len(out[0]) == 32
    assert not server.check(["t/1"])                      # the salt's key is gone
    assert server.check(["t/2/0", "t/2/1"])               # the rest stays
    values = [server.get(k) for k in ("t/2/0", "t/2/1")]
    assert all(out[0].hex().encode() not in v for v in values)


def _launch(n, path, envs):
    env0 = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                R2COMM_INTEGRITY="mac")
    for k in ("R2COMM_JOB_SECRET", "R2COMM_JOB_SECRET_FILE"):
        env0.pop(k, None)
    worker = os.path.join(ROOT, "tests", "secret_worker.py")
    procs, lines = [], queue.Queue()
    for r in range(n):
        p = subprocess.Popen([sys.executable, worker, str(r), str(n), str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(env0, **envs[r]))
        threading.Thread(target=lambda p=p, r=r: [lines.put((r, ln)) for ln in p.stdout],
                         daemon=True).start()
        procs.append(p)
    return procs, lines


def _collect(lines, until, limit=90.0):
    got, deadline = [], time.monotonic() + limit
    while not until(got) and time.monotonic() < deadline:
        try:
            got.append(lines.get(timeout=0.2))
        except queue.Empty:
            pass
    return got


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _store_values(path):
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("oob", [True, False], ids=["out-of-band-secret", "store-only"])
def test_store_reader_cannot_join_with_an_out_of_band_secret(tmp_path, oob):
    """Two ranks over a store an attacker reads in full (every value ever set). With an
    out-of-band secret the attacker fails the handshake; without one it passes (what the
    README says), and mac integrity warns at start-up."""
    path = tmp_path / "st"
    env = {"R2COMM_JOB_SECRET": OOB} if oob else {}
    procs, lines = _launch(2, path, [env, env])
    try:
        got = _collect(lines, lambda g: sum(ln.startswith("INFO") for _, ln in g) == 2)
        info = {json.loads(ln[5:])["rank"]: json.loads(ln[5:]) for _, ln in got
                if ln.startswith("INFO")}
        assert len(info) == 2, "".join(ln for _, ln in got)[-3000:]
        warned = [ln for _, ln in got if ln.startswith("WARNING") and "INTEGRITY=mac under a store" in ln]
        assert len(warned) == (0 if oob else 2)
        # the attacker: everything ever published in the store, and what is left in it now
        seen = [decode(v) for v in _store_values(str(path) + ".seen").values()]
        salts = [v for v in seen if isinstance(v, bytes) and len(v) == bootstrap.SALT_LEN]
        assert len(salts) == 1
        salt = salts[0]
        left = _store_values(path)
        assert left and not any(salt.hex().encode() in v for v in left.values())
        guess = bootstrap.job_secret(salt, b"")        # all a store reader can derive
        job = bytes.fromhex(info[1]["job"])            # (no longer on the wire: issue 40)
        assert (job == hashlib.sha256(guess).digest()[:8]) == (not oob)
        addr, port = info[1]["ctrl"]
        if oob:
            with pytest.raises((tcp.HandshakeError, OSError)):
                fd, _ = tcp.connect(addr, port, None, guess, 0, 1, tcp.CTRL_RAIL, 5.0, 500)
                os.close(fd)
            open(str(path) + ".go", "w").close()
            done = _collect(lines, lambda g: sum(ln.startswith("OK secret") for _, ln in g) == 2)
            assert sum(ln.startswith("OK secret") for _, ln in done) == 2, \
                "".join(ln for _, ln in got + done)[-3000:]
        else:
            fd, _ = tcp.connect(addr, port, None, guess, 0, 1, tcp.CTRL_RAIL, 5.0, 500)
            os.close(fd)                                 # the store reader got in
    finally:
        _stop(procs)


@pytest.mark.parametrize("case", ["no-secret", "silenced", "out-of-band-secret"])
def test_a_store_job_without_a_secret_warns_once_on_rank_0(tmp_path, case):
    """checksum integrity over a store (issue 40, item 5): without an out-of-band secret rank 0
    warns once (R2commSecurityWarning) and rank 1 not; R2COMM_WARN_NO_SECRET=0 or a secret:
    no warning. Old code: no warning at all without mac."""
    env = {"R2COMM_INTEGRITY": "checksum",
           **({"R2COMM_WARN_NO_SECRET": "0"} if case == "silenced" else {}),
           **({"R2COMM_JOB_SECRET": OOB} if case == "out-of-band-secret" else {})}
    path = tmp_path / "st"
    procs, lines = _launch(2, path, [env, env])
    try:
        got = _collect(lines, lambda g: sum(ln.startswith("INFO") for _, ln in g) == 2)
        assert sum(ln.startswith("INFO") for _, ln in got) == 2, \
            "".join(ln for _, ln in got)[-3000:]
        warned = [r for r, ln in got if ln.startswith("WARNING")
                  and "without an out-of-band secret" in ln]
        assert warned == ([0] if case == "no-secret" else []), got
        assert not [ln for _, ln in got if ln.startswith("WARNING") and "mac" in ln], got
        open(str(path) + ".go", "w").close()
        done = _collect(lines, lambda g: sum(ln.startswith("OK secret") for _, ln in g) == 2)
        assert sum(ln.startswith("OK secret") for _, ln in done) == 2, done
    finally:
        _stop(procs)


def test_no_secret_left_in_a_torch_tcpstore_after_start_up():
    """A job over torch's TCPStore: once every rank is up, the salt's key (the first bcast:
    r2comm/0/1) is gone; the parameters and the endpoint records stay."""
    torch_dist = pytest.importorskip("torch.distributed", reason="torch is not installed")
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                                 wait_for_workers=False)
    procs, lines = _launch(2, f"tcp:{server.port}", [{}, {}])
    try:
        got = _collect(lines, lambda g: sum(ln.startswith("INFO") for _, ln in g) == 2)
        assert sum(ln.startswith("INFO") for _, ln in got) == 2, \
            "".join(ln for _, ln in got)[-3000:]
        assert not server.check(["r2comm/0/1"])                     # the salt: deleted
        assert server.check(["r2comm/0/2"])                         # the parameters
        keys = [f"r2comm/0/3/{r}" for r in range(2)]                # 3: the endpoint records
        assert server.check(keys)
        eps = [server.get(k) for k in keys]
        assert all("ctrl" in str(decode(ep)) for ep in eps)
    finally:
        _stop(procs)


def test_out_of_band_secrets_that_differ_fail_every_rank(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(OOB + "\n")
    secret_file.chmod(0o600)
    procs, lines = _launch(2, tmp_path / "st", [{"R2COMM_JOB_SECRET_FILE": str(secret_file)},
                                               {"R2COMM_JOB_SECRET": OOB[::-1]}])
    try:
        for p in procs:
            p.wait(90)
        out = "".join(ln for _, ln in _collect(lines, lambda g: False, limit=1.0))
        assert all(p.returncode != 0 for p in procs), out[-3000:]
        assert out.count("have another job secret than rank") == 2, out[-3000:]
    finally:
        _stop(procs)


def test_job_secret_variables_are_checked(tmp_path, monkeypatch):
    from r2comm.config import Config
    monkeypatch.setenv("R2COMM_JOB_SECRET", "short")
    with pytest.raises(R2commArgumentError, match="at least 16"):
        Config.from_env()
    monkeypatch.setenv("R2COMM_JOB_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(R2commArgumentError, match="both set"):
        Config.from_env()
    monkeypatch.delenv("R2COMM_JOB_SECRET")
    with pytest.raises(R2commArgumentError, match="R2COMM_JOB_SECRET_FILE"):
        Config.from_env()
    f = tmp_path / "s"
    f.write_bytes(b"  " + OOB.encode() + b"\n")
    f.chmod(0o644)
    monkeypatch.setenv("R2COMM_JOB_SECRET_FILE", str(f))
    with pytest.warns(UserWarning, match="other users"):
        assert Config.from_env().job_secret == OOB.encode()
    f.chmod(0o600)
    assert OOB not in repr(Config.from_env())
