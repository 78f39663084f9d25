#!/usr/bin/env bash
# Install r2comm, then run the main job: 4 ranks stream allreduces over 2 rails while a NIC
# fails mid-run; every result is checked. As root with iproute2 the ranks run in an emulated
# 2-host x 2-NIC cluster and the NIC is taken down for real (ip link set down); otherwise on
# loopback rails with an injected failure.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" examples/failover_demo.py "$@"
