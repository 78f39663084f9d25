#!/usr/bin/env bash
# System packages for the soft-RoCE testbed (python -m r2comm.testbed rdma-run, tests marked rdma):
# QEMU, a stock kernel that has the rdma_rxe module (booted in the guests, not on the host),
# busybox-static (virtme-ng builds the guests' initramfs from it), rdma-core (the `rdma` tool,
# libibverbs and its rxe provider), ibverbs-utils (ibv_devinfo,
# ibv_rc_pingpong), pyverbs for the system Python, libibverbs-dev (header and library to build
# r2comm._core.verbs) and perftest (ib_write_bw, ib_send_bw: raw verbs numbers to compare
# with).  Debian/Ubuntu (apt) only.
# Run as root; idempotent: does nothing when everything is there.  scripts/env.sh calls it when
# R2COMM_RDMA=1.  virtme-ng, which boots the guests, is a pip package (the rdma and test extras).
# Measured on Debian 12: ~65 s and ~1.75 GB of disk on a machine with none of them.
set -euo pipefail
PKGS=(qemu-system-x86 busybox-static rdma-core ibverbs-utils ibverbs-providers python3-pyverbs libibverbs-dev perftest)
if [ -r /etc/os-release ] && grep -qi '^ID=ubuntu' /etc/os-release; then
    PKGS+=(linux-image-generic)
else
    PKGS+=(linux-image-amd64)
fi
missing=()
for pkg in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
    echo "r2comm: the RDMA testbed needs ${missing[*]} (Debian/Ubuntu packages); no apt-get here" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "r2comm: the RDMA testbed needs ${missing[*]}: run  sudo bash $0" >&2
    exit 1
fi
echo "r2comm: installing ${missing[*]} for the RDMA testbed (about a minute)" >&2
# --no-install-recommends: the kernel's firmware and QEMU's GUI are not needed (saves ~1 GB)
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null
