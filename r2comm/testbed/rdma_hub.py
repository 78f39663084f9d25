"""An Ethernet hub on 127.0.0.1 for RDMA fabrics of more than two guests.

``python -m r2comm.testbed.rdma_hub STATE_DIR/fabric.json``: for every segment
(rail or management) with hub ports, guest h sends its frames to hub port h;
every frame is flooded to all the other members of that segment, each from
its own hub port (so each guest hears from the one address it sends to).
Two guests need no hub: their NICs are wired point to point.  Only loopback
sockets are used.  The hub ends when its description file disappears.
"""
import json
import os
import select
import socket
import sys

MAX_FRAME = 65536


def build(desc):
    """(socket -> (segment, member)), members per segment, guest ports per segment."""
    owner, members = {}, {}
    for seg, wire in desc["wiring"].items():
        if not wire.get("hub"):
            continue
        socks = []
        for member, port in enumerate(wire["hub"]):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", port))
            owner[s] = (seg, member)
            socks.append(s)
        members[seg] = (socks, [("127.0.0.1", p) for p in wire["guest"]])
    return owner, members


def serve(path, poll_s=1.0):
    with open(path) as f:
        owner, members = build(json.load(f))
    while os.path.exists(path):
        ready, _, _ = select.select(list(owner), [], [], poll_s)
        for s in ready:
            frame = s.recv(MAX_FRAME)
            seg, src = owner[s]
            socks, guests = members[seg]
            for dst, (out, addr) in enumerate(zip(socks, guests)):
                if dst != src:
                    try:
                        out.sendto(frame, addr)
                    except OSError:
                        pass  # a guest not listening yet: a lost frame, as on a real hub


if __name__ == "__main__":
    serve(sys.argv[1])
