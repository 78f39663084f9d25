"""Ports for a process we start to listen on (torchrun's rendezvous, a Gloo store, QEMU's
socket NICs). Binding port 0 and handing the number on races every socket that connects in
the meantime: the kernel gives connecting sockets ports from the same ephemeral range, and
one took a rendezvous port once in CI (EADDRINUSE). Ports below that range are never handed
out automatically, so one that binds now stays free unless somebody asks for it by number."""
import random
import socket

_FALLBACK = (32768, 60999)


def ephemeral_range():
    """The kernel's automatic port range (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _FALLBACK


def _binds(addr, port, kind):
    with socket.socket(socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def free_ports(count=1, addr="127.0.0.1", udp=False):
    """COUNT distinct ports on ADDR that bind now for TCP (and for UDP too when UDP), taken
    at random below the ephemeral range (from 10000 up)."""
    lo = 10000
    hi = min(ephemeral_range()[0], 65536)
    if hi - lo < 1000:                        # an unusual range setting: anything outside it
        lo, hi = ephemeral_range()[1] + 1, 65536
    rng = random.Random()
    found = []
    for _ in range(200 * count):
        port = rng.randrange(lo, hi)
        if port in found or not _binds(addr, port, socket.SOCK_STREAM):
            continue
        if udp and not _binds(addr, port, socket.SOCK_DGRAM):
            continue
        found.append(port)
        if len(found) == count:
            return found
    raise OSError(f"no {count} free ports in {lo}-{hi - 1} on {addr}")


def free_port(addr="127.0.0.1"):
    return free_ports(1, addr)[0]
