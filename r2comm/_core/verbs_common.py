"""What the verbs transport needs that is not libibverbs itself: plain Python, importable (and
unit-tested) where no RDMA device or header exists.

* `QpAddress`: a queue pair's connection address as opaque bytes (Gloo-style), exchanged over
  the authenticated bootstrap/TCP path or a store; `RegionDesc`: a remote-writable region.
* `declared_gbps`: a port's active speed and width as the rail's declared bandwidth.

(The one registration cache of user memory is r2comm/transport/regcache.py, the verbs kind's;
the tests' MR cache of the raw verbs pair is tests/mr_cache.py.)
"""
import struct

from ..errors import R2commArgumentError, R2commError, R2commProtocolError

ADDR_MAGIC = b"R2QA"
ADDR_VERSION = 1
_ADDR = struct.Struct("<4sBBBBIIHH16s")       # 36 bytes
REGION_MAGIC = b"R2RD"
_REGION = struct.Struct("<4sIQQ")              # magic, rkey, addr, length: 24 bytes

# enum ibv_mtu -> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
# enum ibv_port_state
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
# active_speed (enum ibv_port_attr::active_speed) -> data Gbit/s per lane (after line coding)
_LANE_GBPS = {1: 2.0, 2: 4.0, 4: 8.0, 8: 10.0, 16: 13.64, 32: 25.0, 64: 50.0, 128: 100.0,
              256: 200.0}
# active_width -> lanes
_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}


class VerbsError(R2commError):
    """A libibverbs call failed (device, registration, QP set-up, post)."""


def declared_gbps(active_speed, active_width):
    """Data rate of a port in Gbit/s from its active speed and width (0.0 if unknown)."""
    return _LANE_GBPS.get(int(active_speed), 0.0) * _LANES.get(int(active_width), 0)


class QpAddress:
    """What a peer needs to connect its RC queue pair to ours."""
    __slots__ = ("qpn", "psn", "gid", "lid", "port", "gid_index", "mtu")

    def __init__(self, qpn, psn, gid, lid=0, port=1, gid_index=0, mtu=5):
        self.qpn, self.psn, self.gid = int(qpn), int(psn), bytes(gid)
        self.lid, self.port, self.gid_index, self.mtu = int(lid), int(port), int(gid_index), int(mtu)
        if len(self.gid) != 16:
            raise R2commArgumentError(f"GID must be 16 bytes, got {len(self.gid)}")
        if not 0 < self.qpn < 1 << 24 or not 0 <= self.psn < 1 << 24:
            raise R2commArgumentError(f"bad QP number {self.qpn} or PSN {self.psn} (24 bits)")
        if self.mtu not in MTU_BYTES:
            raise R2commArgumentError(f"bad path MTU enum {self.mtu} (1..5)")
        if not 0 <= self.gid_index < 256 or not 0 < self.port < 256 or not 0 <= self.lid < 65536:
            raise R2commArgumentError("bad GID index, port or LID")

    def encode(self):
        return _ADDR.pack(ADDR_MAGIC, ADDR_VERSION, self.mtu, self.port, self.gid_index,
                          self.qpn, self.psn, self.lid, 0, self.gid)

    @classmethod
    def decode(cls, data):
        data = bytes(data)
        if len(data) != _ADDR.size:
            raise R2commProtocolError(f"QP address is {len(data)} bytes, expected {_ADDR.size}")
        magic, ver, mtu, port, gidx, qpn, psn, lid, _, gid = _ADDR.unpack(data)
        if magic != ADDR_MAGIC or ver != ADDR_VERSION:
            raise R2commProtocolError(f"not an r2comm QP address (magic {magic!r}, version {ver})")
        try:
            return cls(qpn, psn, gid, lid, port, gidx, mtu)
        except R2commArgumentError as exc:
            raise R2commProtocolError(f"corrupt QP address: {exc}") from None

    def __eq__(self, other):
        return isinstance(other, QpAddress) and self.encode() == other.encode()

    def __repr__(self):
        return (f"QpAddress(qpn={self.qpn}, psn={self.psn}, gid={gid_str(self.gid)}, "
                f"gid_index={self.gid_index}, mtu={MTU_BYTES[self.mtu]})")


class RegionDesc:
    """A registered region a peer may RDMA-write into: address, length and rkey."""
    __slots__ = ("addr", "length", "rkey")

    def __init__(self, addr, length, rkey):
        self.addr, self.length, self.rkey = int(addr), int(length), int(rkey)
        if not (0 <= self.addr < 1 << 64 and 0 <= self.length < 1 << 64 and 0 <= self.rkey < 1 << 32):
            raise R2commArgumentError("bad region address, length or rkey")

    def encode(self):
        return _REGION.pack(REGION_MAGIC, self.rkey, self.addr, self.length)

    @classmethod
    def decode(cls, data):
        data = bytes(data)
        if len(data) != _REGION.size or data[:4] != REGION_MAGIC:
            raise R2commProtocolError(f"not an r2comm region descriptor ({len(data)} bytes)")
        _, rkey, addr, length = _REGION.unpack(data)
        return cls(addr, length, rkey)

    def check(self, offset, length):
        """Raise unless [offset, offset + length) lies in the region."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise R2commArgumentError(f"write of {length} bytes at {offset} outside the remote "
                                      f"region of {self.length} bytes")


def gid_str(gid):
    h = bytes(gid).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def buffer_address(view):
    """(address, length) of a C-contiguous memoryview's bytes."""
    import numpy as np
    if not view.c_contiguous:
        raise R2commArgumentError("registration needs a contiguous buffer")
    if view.nbytes == 0:
        raise R2commArgumentError("cannot register an empty buffer")
    arr = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view,
                        dtype=np.uint8)
    return arr.__array_interface__["data"][0], view.nbytes
