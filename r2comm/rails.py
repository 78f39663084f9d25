"""Rails: one NIC each, named by a local IPv4 address or an interface name."""
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

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


def resolve(spec):
    """An address stays as it is; an interface name becomes its IPv4 address."""
    try:
        ipaddress.IPv4Address(spec)
        return spec
    except ValueError:
        addr = interface_address(spec)
        if addr is None:
            raise ValueError(f"rail {spec!r} is neither an IPv4 address nor an interface with one")
        return addr


def resolve_all(specs):
    addrs = [resolve(s) for s in (specs or DEFAULT_LOOPBACK_RAILS)]
    if len(set(addrs)) != len(addrs):
        raise ValueError(f"rails must be distinct addresses, got {addrs}")
    return addrs


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
