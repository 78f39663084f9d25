# Shared by demo.sh and test.sh: system packages, a virtualenv, the project installed in it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${R2COMM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ "$(id -u)" = 0 ] && { ! command -v ip >/dev/null || ! command -v tc >/dev/null; }; then
    # the netns testbed needs ip and tc (iproute2)
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2) >/dev/null
fi
if [ "${R2COMM_RDMA:-0}" = 1 ]; then
    # the soft-RoCE testbed (QEMU guests with rxe rails); without it the rdma tests skip
    bash "$ROOT/scripts/rdma-deps.sh"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
LOG="$VENV/install.log"
# pip's and setuptools' chatter goes to a log, shown only when the install fails
"$VENV/bin/python" -m pip install -q --upgrade pip >"$LOG" 2>&1 || true   # a newer pip is optional
# R2COMM_TEST_HOOKS=1: the test extension (r2comm._core.testing) is built too (setup.py)
if ! R2COMM_TEST_HOOKS=1 "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >>"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "r2comm: installing into $VENV failed (log: $LOG)" >&2
    exit 1
fi
"$VENV/bin/python" -c "import r2comm._core.engine" || { echo "r2comm did not build" >&2; exit 1; }
# the torch backend's C++ c10d::Backend (r2comm/torch/native.py), built once per torch version
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if ! MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" -m r2comm.torch build >>"$LOG" 2>&1; then
        cat "$LOG" >&2
        echo "r2comm: the torch backend did not build (log: $LOG)" >&2
        exit 1
    fi
fi
export PATH="$VENV/bin:$PATH"
