"""The AddressSanitizer/UBSan job: scripts/asan.sh builds the engine with
R2COMM_SANITIZE=address,undefined in build/asan and runs the memory-safety regression tests, the
wire fuzzer's batches (checksum and mac mode), the integrity tests and the unit and fault
tests against it. Any sanitizer report fails it."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_engine_under_asan_and_ubsan():
    if os.environ.get("R2COMM_ASAN_BUILD"):
        pytest.skip("already running under the sanitized build")
    if shutil.which("gcc") is None:
        pytest.skip("gcc (with libasan) is needed for the sanitized build")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "asan.sh")], capture_output=True,
                       text=True, timeout=3600, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:]
    assert "AddressSanitizer" not in out and "runtime error:" not in out, out[-8000:]
    assert " passed" in out and " failed" not in out, out[-3000:]
