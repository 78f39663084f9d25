"""Print, as JSON, the RDMA devices pyverbs sees: per device its port 1 state, link layer,
active MTU, speed and width, and its GID table (non-zero entries, with the IPv4 address of
each IPv4-mapped GID).

pyverbs comes from Debian's python3-pyverbs, installed for the system Python
(/usr/lib/python3/dist-packages); a virtualenv does not see it, so that
directory is appended to sys.path when the import fails (same ABI: CPython 3.11).
"""
import ipaddress
import json
import sys

try:
    import pyverbs.device as dev
except ImportError:
    sys.path.append("/usr/lib/python3/dist-packages")
    import pyverbs.device as dev

found = {}
for d in dev.get_device_list():
    name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
    with dev.Context(name=name) as ctx:
        port = ctx.query_port(1)
        gids = []
        for index in range(min(port.gid_tbl_len, 16)):
            try:
                gid = str(ctx.query_gid(1, index))
            except Exception:
                continue
            if gid.strip("0:"):
                mapped = ipaddress.IPv6Address(gid).ipv4_mapped  # RoCE: GID of an IPv4 address
                gids.append({"index": index, "gid": gid, "ipv4": str(mapped) if mapped else None})
        found[name] = {"state": int(port.state), "link_layer": int(port.link_layer),
                       "active_mtu": int(port.active_mtu), "active_speed": int(port.active_speed),
                       "active_width": int(port.active_width), "gids": gids}
print(json.dumps(found))
