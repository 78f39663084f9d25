"""The test hooks live in their own extension (r2comm._core.testing), not in the production engine
(issue 30): the engine module and its Engine class expose none of them, the test extension has
them all, and setup.py leaves the test extension out of a wheel's build."""
import os
import runpy

import pytest

from conftest import ROOT
from r2comm._core import engine, testing

# what moved out of the engine module (module-level names) and out of Engine (its methods)
MODULE_HOOKS = ["ShmEnd", "validate_header", "encode_header", "reduce_local", "blake2s",
                "poly1305", "frame_tag"]
PLAN_HOOKS = ["messages", "nmsgs"]
ENGINE_HOOKS = ["fuzz_attach", "fuzz_sent", "fuzz_feed", "fake_transport", "transport_stats",
                "_test_corrupt", "_p2p_start", "debug_state", "shm_bells", "set_unexpected_limit"]
TESTING_NAMES = MODULE_HOOKS + ["fuzz_attach", "fuzz_sent", "fuzz_feed", "use_fake_transport",
                                "transport_stats", "corrupt_next", "p2p_start", "debug_state",
                                "plan_messages", "shm_bells", "set_unexpected_limit"]


def test_production_engine_exposes_no_test_hooks():
    assert [n for n in MODULE_HOOKS if hasattr(engine, n)] == []
    assert [n for n in ENGINE_HOOKS if hasattr(engine.Engine, n)] == []
    assert [n for n in PLAN_HOOKS if hasattr(engine.Plan, n)] == []
    # nothing of the fuzz or fake transports is compiled into it either
    names = [n for n in dir(engine) if "fuzz" in n.lower() or "fake" in n.lower()]
    assert names == []


def test_test_extension_has_the_hooks_and_drives_the_engine():
    assert [n for n in TESTING_NAMES if not hasattr(testing, n)] == []
    e = engine.Engine(0, 2, [0, 1], 65536, 0.5, 1.5, 1 << 20)
    try:
        assert testing.transport_stats(e)["transport"] == "tcp"
        testing.fuzz_attach(e, 1, 0, 1)
        state = testing.debug_state(e)
        assert state["unsent"][1][0][0] == 1         # the rail is up, on the fuzz transport
        assert testing.transport_stats(e)["transport"] == "fuzz"
        assert testing.shm_bells(e) == {}            # no shared-memory link
    finally:
        e.close()
    with pytest.raises(TypeError):
        testing.debug_state(object())                # an Engine or nothing
    msgs = [("send", 1, 3, 1, 0, 4096, 0, True), ("recv", 1, 3, 0, 64, 8, 1, False)]
    assert testing.plan_messages(engine.Plan(msgs, [(0, 1)], "t")) == msgs


def _built_extensions(monkeypatch, env, inplace=False, editable=False):
    """The extensions setup.py's build_ext builds, with `env` set (nothing is compiled)."""
    import setuptools
    import Cython.Build
    from setuptools.dist import Distribution
    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.setattr(Cython.Build, "cythonize", lambda exts, **kw: exts)
    for key, val in env.items():
        if val is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, val)
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"))
    cmd = got["cmdclass"]["build_ext"](Distribution({"ext_modules": got["ext_modules"]}))
    cmd.initialize_options()
    cmd.inplace = inplace
    if editable:
        cmd.editable_mode = True
    cmd.finalize_options()
    return {x.name for x in cmd.extensions}


def test_a_wheel_build_leaves_the_test_extension_out(monkeypatch):
    test_ext = "r2comm._core.testing"
    wheel = _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": None})
    assert "r2comm._core.engine" in wheel and test_ext not in wheel
    assert test_ext in _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": None}, inplace=True)
    assert test_ext in _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": None}, editable=True)
    assert test_ext in _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": "1"})
    assert test_ext not in _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": "0"}, inplace=True)
    with pytest.raises(SystemExit):
        _built_extensions(monkeypatch, {"R2COMM_TEST_HOOKS": "yes"})


def test_corrupt_next_flips_one_byte_of_the_next_data_frame_only():
    """corrupt_next puts the corrupting transport in front of a live connection: the next DATA
    frame leaves with the byte in the middle of its payload flipped (the sender's buffer is left
    alone), the frames after it are intact, and a rail with no connection is not armed."""
    import numpy as np
    import fuzz_wire
    cs = fuzz_wire.CS
    e = engine.Engine(0, 2, [0, 1], cs, 5.0, 10.0, 1 << 20)
    keep = []
    try:
        assert testing.corrupt_next(e, 1, 0) is False          # nothing attached yet
        testing.fuzz_attach(e, 1, 0, 7)
        testing.fuzz_attach(e, 1, 1, 8)                          # the control connection
        assert testing.corrupt_next(e, 1, 0) is True
        assert testing.transport_stats(e)["transport"] == "fuzz"
        assert e.links.transports() == {1: ["fuzz"]}                   # the rail's name is kept
        src = (np.arange(2 * cs) % 251).astype(np.uint8)
        plan = engine.Plan([("send", 1, 0, 0, 0, 2 * cs, 0, True)], [], "t")
        buf = engine.Buffer(src, True)
        keep += [plan, buf]
        oid = e.post(plan, buf.ptr, 0, 0, fuzz_wire.U8, 0, 1, 0, 0, 5.0, [0, 1], 1, 5, 2 * cs)
        e.release(oid)
        testing.fuzz_feed(e, 1, 1, b"")
        wire, payloads, pos = testing.fuzz_sent(e, 0), [], 0
        while pos + 48 <= len(wire):
            h = fuzz_wire.HDR.unpack(wire[pos:pos + 48])
            if h[1] == fuzz_wire.F_DATA:
                payloads.append((h[9], wire[pos + 48:pos + 48 + h[10]]))
            pos += 48 + h[10]
        assert [c for c, _ in payloads] == [0, 1], payloads
        want = src.tobytes()
        first = bytearray(want[:cs])
        first[cs // 2] ^= 0x10
        assert payloads[0][1] == bytes(first)                   # one byte, in the middle
        assert payloads[1][1] == want[cs:]                      # the next frame intact
        assert src.tobytes() == want                            # the sender's memory untouched
    finally:
        e.close()


def test_fake_transport_setting_without_the_test_extension_is_refused(monkeypatch):
    """R2COMM_TEST_TRANSPORT (read by the tests' fake_transport.py, never by r2comm) on an
    install without the test extension (a wheel) is a clear argument error when the spec is
    read, not an ImportError in the middle of set-up."""
    import importlib.util
    from fake_transport import parse as _test_transport
    from r2comm.errors import R2commArgumentError
    assert _test_transport("fake:seed=2")["seed"] == 2
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "r2comm._core.testing" else real(name, *a))
    with pytest.raises(R2commArgumentError, match="test extension"):
        _test_transport("fake:seed=2")
