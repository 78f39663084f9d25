#!/usr/bin/env bash
# Build r2comm's engine with AddressSanitizer + UndefinedBehaviorSanitizer in a separate tree and
# run the memory-safety, fuzz and fault tests against it (a slow job: minutes).
#
#   scripts/asan.sh [pytest args...]      default: the tests below, slow ones included
#
# Environment: R2COMM_VENV (the project's venv, default .venv), ASAN_DIR (build tree, default
# build/asan), R2COMM_SANITIZE (default address,undefined), R2COMM_ASAN_FRAMES (fuzzed frames
# after the tests, default 200000; 0: none). The source tree's own build is not
# touched. Any sanitizer report fails the run: ASan and UBSan abort the process on the first
# error (-fno-sanitize-recover), and the log is searched for reports as well.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${R2COMM_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
DIR="${ASAN_DIR:-$ROOT/build/asan}"
SAN="${R2COMM_SANITIZE:-address,undefined}"

"$PY" -c "import Cython" 2>/dev/null || "$PY" -m pip install -q "Cython>=3.0"
mkdir -p "$DIR"
# a copy of the tracked (and new, not ignored) sources: the sanitized build lives only there
(cd "$ROOT" && git ls-files -co --exclude-standard -z r2comm tests setup.py setup.cfg pyproject.toml \
    | tar --null -T - -cf - | tar -xf - -C "$DIR")
cd "$DIR"
# the engine and the test extension (r2comm._core.testing: the tests' hooks), both sanitized
R2COMM_TEST_HOOKS=1 R2COMM_SANITIZE="$SAN" "$PY" setup.py build_ext --inplace -q 2>&1 \
    | grep -E "error" || true
test -f "$(ls r2comm/_core/engine*.so | head -1)"
test -f "$(ls r2comm/_core/testing*.so | head -1)"

LIBASAN="$(gcc -print-file-name=libasan.so)"
# libstdc++ loaded with it: otherwise ASan's __cxa_throw interceptor finds no real one, and the
# first C++ exception (torch throws some in normal runs) aborts the process
LIBSTDCXX="$(gcc -print-file-name=libstdc++.so.6)"
export LD_PRELOAD="$LIBASAN $LIBSTDCXX${LD_PRELOAD:+ $LD_PRELOAD}"
# Python itself "leaks" at exit by design: no leak checking. allocator_may_return_null: a huge
# allocation returns NULL as in production, so the engine's handling of that is what is tested.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$DIR"
export R2COMM_ASAN_BUILD=1
export R2COMM_SANITIZE="$SAN"    # the torch backend's C++ (r2comm/torch/native.py) too
"$PY" -c "import r2comm._core.engine as e, r2comm._core.testing as t
for m in (e, t):
    assert m.__file__.startswith('$DIR'), m.__file__"

LOG="$DIR/asan-pytest.log"
if [ $# -eq 0 ]; then
    set -- -m "not netns" tests/test_memsafe.py tests/test_fuzz.py tests/test_integrity.py tests/test_shm.py \
        tests/test_units.py tests/test_failover.py tests/test_engine_limits.py tests/test_seq_wrap.py \
        tests/test_any_source.py tests/test_self_pause.py tests/test_test_hooks.py \
        tests/test_mismatch_verdict.py tests/test_links_auth.py tests/test_mpi_conformance.py \
        tests/test_torch_backend.py::test_small_all_reduce_on_changing_memory \
        tests/test_torch_backend.py::test_dropped_async_works \
        -k "not test_random_faults_many_seeds and not atheris"
fi
set +e
"$PY" -m pytest -p no:cacheprovider -q -x "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
# then the wire fuzzer's frames (half of the inputs in mac mode), many more than the CI batch,
# under the sanitizers (random inputs: libFuzzer gets no coverage from atheris next to libasan;
# guided runs use the normal build, tests/test_fuzz.py)
FRAMES="${R2COMM_ASAN_FRAMES:-200000}"
if [ "$rc" = 0 ] && [ "$FRAMES" -gt 0 ]; then
    set +e
    "$PY" tests/fuzz_wire.py random frames "$FRAMES" 2>&1 | tee -a "$LOG" | tail -40
    rc=${PIPESTATUS[0]}
    set -e
fi
if grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" "$LOG"; then
    echo "asan.sh: sanitizer report(s) in $LOG" >&2
    exit 1
fi
exit "$rc"
