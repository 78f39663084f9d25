"""The wire fuzzer (tests/fuzz_wire.py): frames into a real Engine's rails and the TCP
handshake. CI runs a fixed-seed random batch (seconds); the slow tests run the coverage-guided
fuzzer (atheris) for 1,000,000 frames and 100,000 handshakes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuzz_wire  # noqa: E402

ROOT = os.path.dirname(HERE)


def test_fuzz_frames_random_batch():
    """~10,000 frames from 1,000 random inputs: no crash or hang, every malformed header
    refused with bad_frame, no user buffer byte from outside a well-formed frame's payload."""
    before = dict(fuzz_wire.STATS)
    n, dt = fuzz_wire.random_run("frames", count=1000, seed=17, mac=False)
    got = {k: fuzz_wire.STATS[k] - before[k] for k in before}
    assert n == 1000 and got["frames"] > 5000
    # the batch reaches past the checksum: refusals, and operations completed with delivered data
    assert got["bad_frames"] > 100 and got["delivered_ops"] > 10, got
    # and what the engine wrote back (acks, chunks, notices) parsed as well-formed frames
    assert got["tx_frames"] > 3000, got


def test_fuzz_frames_mac_random_batch():
    """R2COMM_INTEGRITY=mac: ~10,000 frames from 600 random inputs (about a second), sealed
    with the connection's key and counter or with wrong, truncated, replayed or foreign tags and
    edits after sealing, read back with partial writes. No crash or hang; every malformed header or tag that does not verify
    closes the rail with bad_frame; a correctly sealed stream is never refused for its MAC; no
    user buffer byte from a frame whose tag did not verify."""
    before = dict(fuzz_wire.STATS)
    n, dt = fuzz_wire.random_run("frames", count=600, seed=29, mac=True)
    got = {k: fuzz_wire.STATS[k] - before[k] for k in before}
    assert n == 600 and got["mac_inputs"] == 600 and got["mac_frames"] > 5000, got
    # past verification into the DATA / ack / abort paths, and refusals for bad tags
    assert got["mac_verified"] > 1500 and got["delivered_ops"] > 10, got
    assert got["mac_refused"] > 200 and got["mac_bad_tags"] > 50, got
    # every frame the engine wrote carried the right tag for its connection's counter
    assert got["tx_frames"] > 2000, got


def test_fuzz_handshake_random_batch():
    before = dict(fuzz_wire.STATS)
    n, dt = fuzz_wire.random_run("handshake", count=2000, seed=5)
    got = {k: fuzz_wire.STATS[k] - before[k] for k in before}
    assert got["handshakes"] == 2000 and got["hs_accepted"] > 50 and got["hs_refused"] > 500, got


def _atheris(kind, until, timeout, tmp_path):
    try:
        import atheris  # noqa: F401  (pip install -e .[fuzz])
    except ImportError:                       # same counts, random inputs, not coverage guided
        key = "frames" if kind == "frames" else "handshakes"
        before = dict(fuzz_wire.STATS)
        while fuzz_wire.STATS[key] - before[key] < until:
            fuzz_wire.random_run(kind, count=1000, seed=fuzz_wire.STATS[key])
        return {k: fuzz_wire.STATS[k] - before[k] for k in before}
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(3)
    for i in range(64):                       # seeds long enough to reach several segments
        (corpus / f"seed{i}").write_bytes(bytes(rng.integers(0, 256, int(rng.integers(64, 900)),
                                                             dtype=np.uint8)))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_wire.py"), kind,
                        f"--until={until}", "-max_len=2048", "-seed=7", "-timeout=20",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    stats = None
    for line in p.stdout.splitlines():
        if line.startswith("FUZZSTATS "):
            stats = json.loads(line[10:])
    out = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0 and stats is not None, f"fuzzer finding (rc {p.returncode}):\n{out}"
    print(f"\n{kind}: {json.dumps(stats)}")
    return stats


@pytest.mark.slow
def test_fuzz_frames_atheris_million(tmp_path):
    s = _atheris("frames", 1_000_000, 3000, tmp_path)
    assert s["frames"] >= 1_000_000 and s["bad_frames"] > 1000 and s["delivered_ops"] > 100, s
    # about half the inputs run in mac mode (the input's first byte)
    assert s["mac_inputs"] > s["inputs"] // 5 and s["mac_verified"] > 10_000, s
    assert s["mac_bad_tags"] > 1000 and s["tx_frames"] > 100_000, s


@pytest.mark.slow
def test_fuzz_handshake_atheris(tmp_path):
    s = _atheris("handshake", 100_000, 1500, tmp_path)
    assert s["handshakes"] >= 100_000 and s["hs_accepted"] > 100, s


def test_ack_on_another_rail_for_a_chunk_still_being_written_is_ignored():
    """Found by the frame fuzzer under ASan once the fuzz transport read back what the engine
    writes (heap-use-after-free): an eager Isend's last chunk is on rail X, sealed but not yet
    written (socket full); an ack for it arrives on rail Y. It was counted (the guard looked
    at rail Y only), the message completed and its owned copy was freed, and rail X then wrote
    the chunk from freed memory. Its only copy is not received yet: the ack is ignored, and the
    chunk goes out intact."""
    from r2comm._core import engine as eng, testing
    CS, HDR = fuzz_wire.CS, fuzz_wire.HDR
    e = eng.Engine(0, 2, [0, 2], CS, 5.0, 10.0, CS)          # window: one chunk per rail
    keep = []
    try:
        for k in (0, 1, 2):
            testing.fuzz_attach(e, 1, k, 7 + k)
        src = (np.arange(3 * CS) % 97).astype(np.uint8)
        plan = eng.Plan([("send", 1, 0, 0, 0, 3 * CS, 0, True)], [], "t")
        bw = eng.Buffer(src, True)
        keep += [plan, bw]
        oid = e.post(plan, bw.ptr, 0, 0, fuzz_wire.U8, 0, 1, 0, 0, 5.0, [0, 1], 1, 5, 3 * CS)
        e.release(oid)
        testing.fuzz_feed(e, 1, 2, b"")

        def chunks(rail):
            out, pos, buf = [], 0, testing.fuzz_sent(e, rail)
            while pos + 48 <= len(buf):
                h = HDR.unpack(buf[pos:pos + 48])
                if h[1] == fuzz_wire.F_DATA:
                    out.append((h[9], buf[pos + 48:pos + 48 + h[10]]))
                pos += 48 + h[10]
            return out
        sent = {k: chunks(k) for k in (0, 1)}
        assert sorted(c for k in (0, 1) for c, _ in sent[k]) == [0, 1], sent
        x = 0 if sent[0][0][0] == 0 else 1                    # rail X carries chunk 0
        y = 1 - x

        def ack(c):
            return testing.encode_header(fuzz_wire.F_ACK, 1, 0, 0, 1, 0, 0, 0, c, 0, 0, 0)
        # chunk 0 acked on X: X takes chunk 2, but cannot write it yet
        assert testing.fuzz_feed(e, 1, x, ack(0), 0, True)[1]
        # chunk 1 acked on Y, and a premature ack of chunk 2 on Y
        assert testing.fuzz_feed(e, 1, y, ack(1) + ack(2), 0, True)[1]
        assert testing.debug_state(e)["sends"] == 1, \
            "the message completed before its last chunk went out"
        testing.fuzz_feed(e, 1, 2, b"")                                # X's socket drains
        last = chunks(x)
        assert [c for c, _ in last] == [2] and last[0][1] == src[2 * CS:].tobytes()
        assert testing.fuzz_feed(e, 1, x, ack(2))[1]                   # the real ack completes it
        assert testing.debug_state(e)["sends"] == 0
    finally:
        e.close()
        for b in keep:
            if isinstance(b, eng.Buffer):
                b.release()
