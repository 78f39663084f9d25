"""Point-to-point messages: the argument checks of Send/Recv and their one-message plans."""
import numpy as np

from .args import check_root, is_any_source
from ..errors import R2commArgumentError
from ..planner.schedule import WORK


def check(kind, peer, tag, rail, rank, size, nrails, self_ok=False):
    """Check a send's or receive's (peer, tag, rail) on rank `rank` of `size`; True for a
    receive from ANY_SOURCE (r2comm's or mpi4py's). self_ok: `peer` may be `rank` (messages to
    this rank stay in pt2pt.py; the engine never gets one)."""
    if rail is not None and not (isinstance(rail, (int, np.integer)) and 0 <= rail < nrails):
        raise R2commArgumentError(f"rail {rail!r} is not a rail index (0 .. {nrails - 1})")
    any_source = kind == "recv" and is_any_source(peer)
    if not any_source:
        if kind == "send" and is_any_source(peer):
            raise R2commArgumentError("a send needs a destination rank, not ANY_SOURCE")
        check_root(peer, size)
    if peer == rank and not self_ok:
        raise R2commArgumentError("a message to this rank itself does not go to the engine")
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
