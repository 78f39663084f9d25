#!/usr/bin/env bash
# Same-job A/B of two builds of r2comm's engine: another source tree's (its engine built in
# place, e.g. a worktree of main) against this tree's, allreduce on 2 ranks and 2 loopback rails
# with MPI over TCP alongside, in both build orders (bench/ab_settings.py's `package=` variant:
# the other tree's r2comm is copied as package r2base, so both engines run in one process).
#
#   bench/ab_builds.sh OTHER_TREE [SIZE...]        default sizes: 8 64K 1M 4M 16M; ROUNDS=11
#
# v0 is the other tree, v1 this one: "v0/v1 time per round" below 1 means this tree is slower.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OTHER="$(cd "$1" && pwd)"; shift
SIZES=("$@"); [ ${#SIZES[@]} -gt 0 ] || SIZES=(8 64K 1M 4M 16M)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
cp -r "$OTHER/r2comm" "$TMP/r2base"
ls "$TMP"/r2base/_core/engine*.so >/dev/null     # the other tree's engine must be built
export PYTHONPATH="$ROOT:$TMP" R2COMM_RAILS=127.0.0.1,127.0.0.2
export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo
cd "$ROOT"
for s in "${SIZES[@]}"; do
    for order in fwd rev; do
        "$(dirname "$PY")/mpiexec" -n 2 "$PY" bench/ab_settings.py --size "$s" \
            --rounds "${ROUNDS:-11}" --order "$order" "package=r2base" ""
    done
done
