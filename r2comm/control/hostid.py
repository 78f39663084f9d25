"""Which ranks share a host: a key equal for two processes exactly when they can reach each
other through shared memory and the same network stack.

The kernel's boot id tells machines (and boots) apart; the network namespace tells the testbed's
emulated hosts apart on one machine (each host is a namespace, r2comm.testbed), so ranks placed
on different emulated hosts never count as local. R2COMM_HOST overrides the key (tests that
emulate several hosts on loopback)."""
import os
import socket


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _netns():
    try:
        return os.readlink("/proc/self/ns/net")      # e.g. "net:[4026531840]"
    except OSError:
        return ""


def host_key():
    """This process's host key (a string); equal keys = same host."""
    forced = os.environ.get("R2COMM_HOST", "").strip()
    if forced:
        return "forced:" + forced
    boot = _read("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    return f"{boot}/{_netns()}"


def host_groups(keys):
    """Ranks grouped by host key: (host index of every rank, list of ranks per host), hosts
    numbered in order of their lowest rank."""
    index, groups = {}, []
    host_of = []
    for rank, key in enumerate(keys):
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        host_of.append(index[key])
        groups[index[key]].append(rank)
    return host_of, groups
