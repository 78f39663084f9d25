"""Point-to-point messages: the argument checks of Send/Recv and their one-message plans."""
import numpy as np

from .args import ANY_SOURCE, check_root
from .errors import R2commArgumentError
from .planner.schedule import WORK


def check(kind, peer, tag, rail, rank, size, nrails):
    """Check a send's or receive's (peer, tag, rail) on rank `rank` of `size`; True for a
    receive from ANY_SOURCE."""
    if rail is not None and not (isinstance(rail, (int, np.integer)) and 0 <= rail < nrails):
        raise R2commArgumentError(f"rail {rail!r} is not a rail index (0 .. {nrails - 1})")
    any_source = kind == "recv" and isinstance(peer, (int, np.integer)) and peer == ANY_SOURCE
    if not any_source:
        check_root(peer, size)
    if peer == rank:
        raise R2commArgumentError("send/receive to self is not supported")
    if not isinstance(tag, (int, np.integer)) or tag < -1 or tag >= 1 << 31:
        raise R2commArgumentError(f"bad tag {tag!r}")
    if kind == "send" and tag < 0:
        raise R2commArgumentError("a send needs a tag >= 0")
    return any_source


def message_plan(Plan, kind, gpeer, nbytes, eager):
    """(the engine Plan of one message to/from global rank `gpeer`, whether the engine copies
    the payload: a send of at most `eager` bytes)."""
    owned = kind == "send" and nbytes <= eager
    return Plan([(kind, gpeer, 0, WORK, 0, nbytes, 0, owned)], [], "p2p"), owned
