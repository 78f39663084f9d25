"""Rails: one NIC each, named by a local IPv4 address or an interface name."""
import fcntl
import ipaddress
import socket
import struct
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import R2commArgumentError

DEFAULT_LOOPBACK_RAILS = ["127.0.0.1", "127.0.0.2"]
SIOCGIFADDR = 0x8915


def interface_address(name):
    """IPv4 address of a network interface (ioctl SIOCGIFADDR), or None."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def resolve(spec, what="R2COMM_RAILS"):
    """An address stays as it is; an interface name becomes its IPv4 address. `what` names the
    setting the spec came from, for the messages. A wildcard address (0.0.0.0, also from an
    interface) is accepted with a warning: such a "rail" is no NIC, its traffic takes whatever
    route the kernel picks, and a peer on another host would connect to its own machine."""
    try:
        ipaddress.IPv4Address(spec)
        addr = spec
    except ValueError:
        addr = interface_address(spec)
        if addr is None:
            raise R2commArgumentError(f"{what}: {spec!r} is neither an IPv4 address nor a network "
                                      "interface with one (see `ip -4 addr`)") from None
    if ipaddress.IPv4Address(addr).is_unspecified:
        via = "" if addr == spec else f" (interface {spec!r} resolves to it)"
        warnings.warn(f"{what}: {addr}{via} is the wildcard address, not one NIC: traffic through it "
                      "takes whatever route the kernel picks, and peers on other hosts cannot "
                      "reach it; name each NIC's own address or interface", RuntimeWarning,
                      stacklevel=3)
    return addr


def resolve_all(specs, what="R2COMM_RAILS"):
    addrs = [resolve(s, what) for s in (specs or DEFAULT_LOOPBACK_RAILS)]
    if len(set(addrs)) != len(addrs):
        raise R2commArgumentError(f"{what}: rails must be distinct addresses, got {addrs}")
    return addrs


def listen_on(addr, what, index=None):
    """A listening socket on addr, or an R2commArgumentError naming the address, the setting
    and what to do (typically EADDRNOTAVAIL: the address is not on this machine)."""
    from . import tcp
    try:
        return tcp.listen(addr)
    except OSError as exc:
        name = f"rail {index} address {addr}" if index is not None else f"address {addr}"
        raise R2commArgumentError(
            f"{what}: cannot listen on {name} on host {socket.gethostname()}: {exc}; set "
            f"{what} to addresses (or interface names) of this machine's NICs "
            "(see `ip -4 addr`)") from exc


@dataclass
class Rail:
    """One of this rank's NICs, with live state and counters summed over all peers."""
    index: int
    address: str
    state: str
    weight: float
    bytes_sent: int
    bytes_recv: int
    bytes_resent: int
    failures: int
    peers_up: int
    peers: int
    bytes_hedged: int = 0       # copies of a slower rail's tail chunks sent on this one
    transport: str = "tcp"      # what its connections run on: "tcp" or "verbs"
    device: str = ""            # verbs: the RDMA device and port (e.g. "rxe0:1")
    gpu_path: str = "staged-pipelined"   # how device buffers reach this rail: staged through
                                         # pinned host memory (GPUDirect RDMA: not implemented)


class RailStats(NamedTuple):
    """One row of Engine.rail_stats(): one peer's connection on one rail (still a tuple, so
    positional readers keep working)."""
    state: str              # "up" or "down"
    bytes_sent: int
    bytes_recv: int
    bytes_resent: int
    inflight: int           # bytes sent and not yet acknowledged
    weight: float           # the engine's striping weight
    failures: int
    rate: float             # measured bytes/s (0: none yet)
    bytes_hedged: int


def rail_stats(engine):
    """engine.rail_stats() with named rows: {global rank: [RailStats of each rail]}."""
    return {peer: [RailStats(*row) for row in rows] for peer, rows in engine.rail_stats().items()}


def summarize(stats, peers, addrs, transport, devices):
    """This rank's Rail per NIC address in `addrs`, summed over `peers` (global ranks) from
    `stats` (rail_stats()); `devices`: each rail's verbs device, or empty."""
    out = []
    for k, addr in enumerate(addrs):
        rows = [stats[p][k] for p in peers if k < len(stats[p])]
        up = sum(1 for r in rows if r.state == "up")
        state = "up" if up == len(rows) else ("down" if up == 0 else "degraded")
        out.append(Rail(k, addr, state, rows[0].weight if rows else 1.0,
                        sum(r.bytes_sent for r in rows), sum(r.bytes_recv for r in rows),
                        sum(r.bytes_resent for r in rows), sum(r.failures for r in rows), up,
                        len(rows), sum(r.bytes_hedged for r in rows), transport,
                        devices[k].describe() if devices else ""))
    return out
