"""Regression tests for the engine's memory-safety bugs of issue 17 (item 7): frames from a peer
that lie about a message's size or a chunk's length, and an ack for a chunk never sent.

Each scenario runs in a child process on a real Engine whose rail is one end of a socketpair
(the test plays the peer on the other end), so a crash is a failed test, not a dead test run.
The same scenarios run under the AddressSanitizer build (scripts/asan.sh, tests/test_asan.py)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_scenario(name, timeout=60, env=None):
    """Run memsafe_worker.py <name> in a child; returns (returncode, parsed JSON result or None,
    output)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, os.path.join(HERE, "memsafe_worker.py"), name],
                       capture_output=True, text=True, timeout=timeout, env=e)
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    return p.returncode, res, p.stdout + p.stderr


def test_huge_total_is_refused_not_a_crash():
    """A DATA header whose `total` needs a ~32 GB unexpected-chunk table: the old engine used
    the NULL from calloc and died of SIGSEGV. Now the frame is refused: bad_frame, rail closed."""
    rc, res, out = run_scenario("huge_total")
    assert rc == 0, f"worker died (rc {rc}):\n{out[-3000:]}"
    assert res["rail"] == "down" and "bad_frame" in res["kinds"], res
    assert res["closed"], res                       # the engine closed its end
    assert res["alive_after"], res                  # the engine still works afterwards


def test_short_unexpected_chunk_never_reaches_the_user_buffer():
    """An unexpected chunk shorter than its header's message layout says (10 bytes where the
    1000-byte message's only chunk is 1000): the old engine buffered 10 bytes, then copied 1000
    from that heap block into the user's buffer when the receive was posted, and completed the
    receive with no error. Now the frame is refused and the buffer is untouched."""
    rc, res, out = run_scenario("short_chunk")
    assert rc == 0, f"worker died (rc {rc}):\n{out[-3000:]}"
    assert res["rail"] == "down" and "bad_frame" in res["kinds"], res
    assert res["state"] != "done", res             # the receive did not complete on garbage
    assert res["untouched"], res                   # not one byte of the user buffer written


def test_short_unexpected_p2p_chunk_is_refused():
    """The same lie on a point-to-point message (buffered before its receive is posted)."""
    rc, res, out = run_scenario("short_chunk_p2p")
    assert rc == 0, f"worker died (rc {rc}):\n{out[-3000:]}"
    assert res["rail"] == "down" and "bad_frame" in res["kinds"], res
    assert res["state"] != "done" and res["untouched"], res


def test_ack_for_queued_chunks_does_not_free_the_eager_send():
    """Acks for the chunks of a released eager Isend that are still queued for sending (window
    of one chunk): the old engine counted them, freed the message while the ready queue still
    held its chunks, then read freed memory (ASan: heap-use-after-free) and never sent the rest.
    Now acks for chunks never sent are ignored, and every chunk still goes out, intact."""
    rc, res, out = run_scenario("ack_queued")
    assert rc == 0, f"worker died (rc {rc}):\n{out[-3000:]}"
    assert res["chunks"] == res["nchunks"], res    # every chunk was sent ...
    assert res["payload_ok"], res                  # ... with the user's bytes
    assert res["drained"], res                     # and the real acks completed it
