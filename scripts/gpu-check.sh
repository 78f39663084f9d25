#!/usr/bin/env bash
# The GPU check of r2comm's device-buffer path, for a session that has a GPU machine: one short,
# bounded run. Writes everything to $R2COMM_GPU_OUT (default: $OUT if set, else bench/gpu-check)
# /gpu-check.txt and bench.jsonl.
#
#   bash scripts/gpu-check.sh            # at most ~9 min; every step has its own time limit
#   R2COMM_GPU_DRYRUN=1 bash scripts/gpu-check.sh   # without a GPU: the benchmark harness on the
#                                                   # host stand-in device (checks the script only)
#
# Steps: 1. is there a GPU (nvidia-smi / /dev/nvidia*)? If not: print "GPU CHECK: no GPU" and
# exit 0 before installing anything. 2. a Python with cupy: the one named by R2COMM_PYTHON, else
# .venv/bin/python, else python3; cupy is used as installed, else `pip install cupy-cuda12x`
# (from R2COMM_WHEELS, a folder of wheels, when set: the GPU machines here have no network).
# 3. build the engine in place. 4. pytest -m gpu (tests/test_gpu.py: every collective with
# cupy arrays, streams, float16/bfloat16, a rail failure, the kernels, torch CUDA tensors).
# 5. scripts/gpu_bench.py: 64 MiB float32 allreduce on 2 ranks, cupy pipelined vs numpy vs the
# old whole-buffer staging, a segment-size sweep, and the GPU reduction throughput per dtype.
# The GPU machines here have no network: where cupy or mpiexec is missing, carry wheels (cupy-
# cuda12x, mpich; /work/.library/device/README.md says how) and set R2COMM_WHEELS to their folder.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${R2COMM_GPU_OUT:-${OUT:-$ROOT/bench/gpu-check}}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu-check.txt"
: > "$LOG"
say() { echo "[gpu-check] $*" | tee -a "$LOG"; }
run() {   # run LIMIT_S CMD...: bounded, output to the log and the terminal
    local limit="$1"; shift
    say "\$ $*  (limit ${limit} s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "rc $rc"
    return "$rc"
}

# 1. a GPU?
gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; then
    gpu="$(timeout 20 nvidia-smi -L | head -4)"
elif ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    gpu="$(ls /dev/nvidia[0-9]* | tr '\n' ' ')"
fi
if [ -z "$gpu" ]; then
    say "GPU CHECK: no GPU on $(hostname) (no working nvidia-smi, no /dev/nvidia*): nothing GPU-side was run or verified"
    if [ "${R2COMM_GPU_DRYRUN:-0}" = 1 ]; then    # the harness alone, on the host stand-in device
        PY="${R2COMM_PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}"
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
        run 200 "$PY" scripts/gpu_bench.py --standin --mib 4 --iters 2 --out "$OUTDIR/bench-standin.jsonl"
        say "dry run on the stand-in device: rc $? (harness check only; its numbers mean nothing)"
    fi
    exit 0
fi
say "GPU: $gpu"

# 2. python and cupy
PY="${R2COMM_PYTHON:-}"
[ -z "$PY" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
[ -z "$PY" ] && PY="$(command -v python3)"
say "python: $PY ($("$PY" --version 2>&1))"
if ! timeout 120 "$PY" -c "import cupy" >/dev/null 2>&1; then
    if [ -n "${R2COMM_WHEELS:-}" ]; then
        run 150 "$PY" -m pip install -q --no-index --find-links "$R2COMM_WHEELS" cupy-cuda12x
    else
        run 150 "$PY" -m pip install -q cupy-cuda12x
    fi
fi
if ! run 120 "$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount(), 'runtime', cupy.cuda.runtime.runtimeGetVersion(), 'driver', cupy.cuda.runtime.driverGetVersion())"; then
    say "GPU CHECK: cupy is not usable here: stopping (nothing GPU-side verified)"
    exit 1
fi
for mod in numpy mpi4py Cython pytest; do
    timeout 60 "$PY" -c "import $mod" >/dev/null 2>&1 || say "missing Python module: $mod"
done

# 3. the engine
if ! timeout 60 "$PY" -c "import sys; sys.path.insert(0, '.'); import r2comm._core.engine" >/dev/null 2>&1; then
    run 200 "$PY" setup.py build_ext --inplace >/dev/null || { say "GPU CHECK: engine build failed"; exit 1; }
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 4. the gpu-marked tests (mpiexec for the multi-rank ones: the mpich wheel's, or the system's)
MPIBIN="$(dirname "$PY")"
[ -x "$MPIBIN/mpiexec" ] || MPIBIN="$(dirname "$(command -v mpiexec 2>/dev/null || echo /none/x)")"
if [ ! -x "$MPIBIN/mpiexec" ] && [ -n "${R2COMM_WHEELS:-}" ]; then   # the mpich wheel, carried
    run 120 "$PY" -m pip install -q --no-index --find-links "$R2COMM_WHEELS" --target /tmp/r2comm-mpich mpich
    [ -x /tmp/r2comm-mpich/bin/mpiexec ] && MPIBIN=/tmp/r2comm-mpich/bin
fi
[ -x "$MPIBIN/mpiexec" ] && export PATH="$MPIBIN:$PATH" || say "no mpiexec: the multi-rank gpu tests will fail to launch (carry the mpich wheel)"
run 300 "$PY" -m pytest tests/test_gpu.py -m gpu -q -rs -x -p no:cacheprovider
tests_rc=$?

# 5. the benchmark (2 ranks through a DirStore: no MPI needed)
run 150 "$PY" scripts/gpu_bench.py --mib 64 --iters 10 --out "$OUTDIR/bench.jsonl"
bench_rc=$?
say "GPU CHECK DONE: tests rc $tests_rc, bench rc $bench_rc; log $LOG, results $OUTDIR/bench.jsonl"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
