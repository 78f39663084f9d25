"""Transports: the data movers. Each kind is one object (kind.Transport: offer, dial/attach,
fds per rail, deadline floor, registration cache), the cold-path counterpart of its C table
behind r2comm/_core/transport.pxd; KINDS lists them. The control plane (r2comm.control) asks
for a kind here and never imports a kind's module: CONTROL (TCP: every connection's handshake,
the control connections), LOCAL (the links between ranks of one host), kind_of(name) (the
job's NIC rails), offer/decide (bootstrap's choice of that kind). rails.py finds the rails'
addresses and sums their statistics; select.py is what a job's world asks of its transports."""
from ..errors import R2commArgumentError
from . import shm, tcp, verbs
from .kind import Transport

__all__ = ["Transport", "KINDS", "CONTROL", "LOCAL", "CTRL_RAIL", "HandshakeError", "kind_of",
           "for_hello", "offer", "decide"]
KINDS = {t.name: t for t in (tcp.TRANSPORT, verbs.TRANSPORT, shm.TRANSPORT)}
NIC_ORDER = ("verbs", "tcp")   # the NIC rails' kinds, preferred first (tcp: every rank can)
CONTROL = tcp.TRANSPORT        # the handshake of every connection; the control connections
LOCAL = shm.TRANSPORT          # ranks of one host
CTRL_RAIL = tcp.CTRL_RAIL      # a control connection's rail code in a HELLO
HandshakeError = tcp.HandshakeError


def kind_of(name):
    """The Transport object of kind `name` ("tcp", "verbs", "shm")."""
    return KINDS[name]


def for_hello(rail, nic):
    """The kind of an accepted connection from its HELLO's rail code; nic: the job's NIC
    kind (data rails 0..k)."""
    if rail == CTRL_RAIL:
        return CONTROL
    if rail in LOCAL.hello_rails:
        return LOCAL
    return nic


def offer(want, rail_addrs, cfg=None):
    """What this rank brings to bootstrap for its NIC rails, R2COMM_TRANSPORT=want (tcp, verbs
    or auto): (the kind it can run, that kind's devices or None, why not a preferred one).
    cfg: the settings each kind reads for itself (None: its defaults)."""
    if want == "tcp":
        return "tcp", None, "R2COMM_TRANSPORT=tcp"
    whys = []
    for name in NIC_ORDER:
        devices, why = KINDS[name].offer(rail_addrs, cfg)
        if why is None:
            return name, devices, "; ".join(whys) or None
        whys.append(why)
    raise AssertionError("tcp offers always")


def decide(offers):
    """The job's NIC kind from every rank's (want, can, why) (the same on every rank): raises
    R2commArgumentError when ranks want different kinds, or one was asked for that a rank
    cannot run; `auto` takes the first kind of NIC_ORDER that every rank can."""
    wants = {w for w, _, _ in offers}
    if len(wants) > 1:
        raise R2commArgumentError(
            "R2COMM_TRANSPORT differs between ranks: " +
            ", ".join(f"rank {r}: {w}" for r, (w, _, _) in enumerate(offers)))
    want = wants.pop()
    if want != "auto":
        cannot = [(r, why) for r, (_, can, why) in enumerate(offers) if can != want]
        if cannot:
            raise R2commArgumentError(
                f"R2COMM_TRANSPORT={want}, but " +
                "; ".join(f"rank {r} {KINDS[want].missing}: {why}" for r, why in cannot))
        return want
    # a rank that can run a kind can run every kind after it in NIC_ORDER
    lowest = max(NIC_ORDER.index(can) for _, can, _ in offers)
    return NIC_ORDER[lowest]
