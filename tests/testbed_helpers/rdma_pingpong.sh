#!/bin/sh
# Run by `rdma-run -n 2` on two guests: rank 0 serves ibv_rc_pingpong on every rail in turn,
# rank 1 connects to rank 0's rail address, which it learns through the rendezvous directory.
# Rank 1 exits with $1 (default 0) when every rail worked, so the caller can check that
# rdma-run passes the ranks' status on.  Every wait is bounded.
set -u
echo "rank $R2COMM_RANK/$R2COMM_SIZE host $R2COMM_TESTBED_HOST rails $R2COMM_RAILS" \
     "ctrl $R2COMM_CTRL_ADDR transport $R2COMM_TRANSPORT"
gi=${R2COMM_RDMA_GID_INDEX:?}
if [ "$R2COMM_RANK" = 0 ]; then
    echo "$R2COMM_RAILS" > "$R2COMM_STORE_DIR/rails.0.tmp"
    mv "$R2COMM_STORE_DIR/rails.0.tmp" "$R2COMM_STORE_DIR/rails.0"
fi
k=0
for dev in $(echo "$R2COMM_RDMA_DEVICES" | tr , ' '); do
    port=$((18515 + k))
    if [ "$R2COMM_RANK" = 0 ]; then
        timeout 180 ibv_rc_pingpong -d "$dev" -g "$gi" -p "$port" -s 65536 -n 20 -m 4096 || exit 1
    else
        tries=0
        while [ ! -s "$R2COMM_STORE_DIR/rails.0" ] && [ $tries -lt 120 ]; do
            sleep 1; tries=$((tries + 1))
        done
        server=$(cut -d, -f$((k + 1)) "$R2COMM_STORE_DIR/rails.0")
        tries=0
        until timeout 120 ibv_rc_pingpong -d "$dev" -g "$gi" -p "$port" -s 65536 -n 20 -m 4096 \
                "$server"; do
            tries=$((tries + 1))
            [ $tries -lt 30 ] || exit 1
            sleep 1   # the server was not listening yet
        done
    fi
    echo "rail $k ($dev) ok"
    k=$((k + 1))
done
[ "$R2COMM_RANK" = 0 ] || exit "${1:-0}"
