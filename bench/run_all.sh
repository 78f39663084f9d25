#!/usr/bin/env bash
# r2comm comparison suite on one host: 2 ranks over loopback, about 6-8 minutes on 2 cores.
#
#   bench/run_all.sh                # everything, results in bench/out/
#   OUT=/tmp/r2 NP=2 bench/run_all.sh
#
# Writes per step: <name>.txt (the OSU table as printed), <name>.json, and PNGs:
#   allreduce_shm    r2comm vs MPI (shared memory) vs Gloo, 8 B .. 64 MiB
#   allreduce_tcp    r2comm vs MPI forced onto TCP over 127.0.0.1, 8 B .. 64 MiB
#   allreduce.png    busbw and time vs size, all of the above
#   latency_*        ping-pong, same peers; latency.png
#   bw_shm           streaming bandwidth rank 0 -> 1 vs MPI
#   <collective>     allgather, reduce_scatter, bcast, alltoall vs MPI shm, 8 B .. 16 MiB
#   failover_hard    4 MiB allreduce stream, rail 0 failed (connection error) at 2 s
#   failover_silent  same, rail 0 goes silent (no error: bytes just stop)
#
# MPI over TCP: the MPICH wheel uses shared memory between local ranks, and with
# MPIR_CVAR_NOLOCAL=1 alone its UCX netmod still picks shared memory.  The OFI
# netmod with libfabric's tcp provider bound to lo really uses TCP on 127.0.0.1
# (checked with ss; 8 B allreduce ~20 us instead of ~7 us, 64 MiB ~35% slower).
# Every step has a timeout; a failed step is reported and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=${MPIEXEC:-$VENV/bin/mpiexec}
OUT=${OUT:-bench/out}
NP=${NP:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
export R2COMM_RAILS=${R2COMM_RAILS:-127.0.0.1,127.0.0.2}
export R2COMM_TIMEOUT=${R2COMM_TIMEOUT:-30}  # a hung collective fails its step sooner
TCP_ENV=(MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo)

mkdir -p "$OUT"
failed=()
start=$SECONDS

# step NAME [VAR=value ...] -- ARGS...: one harness run under mpiexec, table saved to NAME.txt
step() {
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    echo "=== $name: $* ${envs[*]}"
    env "${envs[@]}" timeout --kill-after=10 "$STEP_TIMEOUT" \
        "$MPIEXEC" -n "$NP" "$PY" -m r2comm.bench "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    [[ $rc == 0 ]] || { echo "!!! $name failed (rc=$rc)"; failed+=("$name"); }
}

plot() {
    local png=$1; shift
    "$PY" -m r2comm.bench plot "$@" -o "$OUT/$png" || failed+=("$png")
}

SWEEP=(--rounds 3 --budget 0.2 -f)

step allreduce_shm -- allreduce -m 8:64M --peer mpi,gloo "${SWEEP[@]}" --json "$OUT/allreduce_shm.json"
step allreduce_tcp "${TCP_ENV[@]}" -- allreduce -m 8:64M --peer mpi "${SWEEP[@]}" --json "$OUT/allreduce_tcp.json"
plot allreduce.png "$OUT/allreduce_shm.json" "$OUT/allreduce_tcp.json"

step latency_shm -- latency -m 1:1M --peer mpi,gloo "${SWEEP[@]}" --json "$OUT/latency_shm.json"
step latency_tcp "${TCP_ENV[@]}" -- latency -m 1:1M --peer mpi "${SWEEP[@]}" --json "$OUT/latency_tcp.json"
plot latency.png "$OUT/latency_shm.json" "$OUT/latency_tcp.json"

step bw_shm -- bw -m 1K:4M --peer mpi --rounds 2 --budget 0.2 --json "$OUT/bw_shm.json" --plot "$OUT/bw.png"

for coll in allgather reduce_scatter bcast alltoall; do
    step "$coll" -- "$coll" -m 8:16M --peer mpi --rounds 2 --budget 0.1 --check \
        --json "$OUT/$coll.json" --plot "$OUT/$coll.png"
done

for mode in hard silent; do
    step "failover_$mode" -- failover --size 4M --duration 6 --fail-at 2 --rail 0 --mode "$mode" \
        --check --stall-timeout 60 --json "$OUT/failover_$mode.json" --plot "$OUT/failover_$mode.png"
done

# issue-3 figures: a healthy single rail (baseline for "after 1 of 2 rails failed") and the cost
# of the acknowledgement machinery (R2COMM_ACKS=0 trusts TCP: benchmark only)
step single_rail R2COMM_RAILS=127.0.0.1 -- failover --size 4M --duration 4 --no-inject \
    --check --stall-timeout 60 --json "$OUT/single_rail.json" --plot "$OUT/single_rail.png"
for acks in 1 0; do
    step "acks_$acks" R2COMM_ACKS=$acks -- allreduce -m 16M:16M --rounds 5 --budget 0.5 -f \
        --json "$OUT/acks_$acks.json"
done

echo "=== done in $((SECONDS - start)) s; results in $OUT"
if ((${#failed[@]})); then
    echo "!!! failed: ${failed[*]}"
    exit 1
fi
