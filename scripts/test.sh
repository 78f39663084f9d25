#!/usr/bin/env bash
# Install r2comm (and what it needs) into a virtualenv, then run the test suite.
# As root the tests also get the soft-RoCE testbed's system packages (QEMU, a kernel with rdma_rxe,
# rdma-core; scripts/rdma-deps.sh, about a minute once); R2COMM_RDMA=0 skips them, and then the
# tests marked rdma skip saying so.
if [ "$(id -u)" = 0 ]; then export R2COMM_RDMA="${R2COMM_RDMA:-1}"; fi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
