"""Going on after a rank died, in torch: the survivors of an r2comm group revoke it, agree on
who failed and get a ProcessGroup over the shrunk Communicator (issue 44, ULFM's model).

    try:
        loss.backward()                    # DDP's allreduce: a rank died
    except RuntimeError:                   # R2commNetworkError / R2commRevokedError (torch's
        del ddp                            # DistError; DDP wraps it in a RuntimeError)
        pg = r2comm.torch.shrink(pg)       # every survivor; new ranks 0..k-1
        ddp = DDP(model, process_group=pg) # redo the step on the new group

r2comm.torch.shrink(group) (backend.py: shrink() here with the group's Communicator) is
`Revoke()` and `Agree()` on the group's Communicator and then torch's own
`dist.shrink_group(agreed failed ranks, group)`: the backend's shrink (backend.py's remake) sees
the revoked Communicator and makes the new group's Backend on `Communicator.Shrink()`
(survivors() here), so torch registers the new group as it registers any shrunk one
(dist.get_rank(pg); the default group, when it is the one shrunk, is replaced, and torch
destroys the other groups). r2comm sends nothing through the store, but torch clones the old
group's store for the new group: a TCPStore hosted by the rank that died cannot be cloned
(README, "After a rank died (torch)").

Errors reach torch code as torch's types (pyops: R2commError subclasses that are
DistBackendError, R2commNetworkError ones DistNetworkError)."""
import torch.distributed as dist

from ..errors import R2commError
from .pyops import raise_as_torchs

ATTEMPTS = 3      # agreements tried when further ranks die during one


class ShrinkRaceError(R2commError):
    """Another rank died between the agreement on the failed ranks and the Shrink (every
    survivor raises it alike: the agreement is uniform); shrink() tries again."""


def survivors(comm, excluded):
    """(the survivors' Communicator, a second one of the same ranks for point to point) of
    the revoked Communicator `comm`, whose agreed failed ranks must be `excluded` (ranks of
    comm). Collective over the survivors."""
    new = comm.Shrink()
    agreed = sorted(comm.Get_agreed_failed())
    if agreed != sorted(excluded):
        raise ShrinkRaceError(f"r2comm shrink: the survivors agreed that ranks {agreed} "
                              f"failed, not {sorted(excluded)}; shrink again")
    # the pt2pt twin: a Shrink()'s Communicator has no Dup (no bootstrap communicator); a
    # Shrink of it with nobody failed is a new communicator of the same ranks
    twin = new.Shrink() if new.size > 1 else new
    if twin.size != new.size:
        raise ShrinkRaceError("r2comm shrink: a rank died while the shrunk group was made; "
                              "shrink again")
    return new, twin


def shrink(comm, group=None):
    """The survivors' ProcessGroup of r2comm group `group` (None: the default group, which
    torch then replaces), whose Communicator is `comm`, after a rank of it died: revokes it
    (every rank's pending and later calls on it raise), agrees on the failed ranks and calls
    dist.shrink_group with them. Every survivor calls it; the survivors keep their order,
    renumbered 0..k-1. Raises torch's error types (DistBackendError) where it cannot (no rank
    failed, a timeout). (r2comm.torch.shrink(group) finds comm: backend.shrink.)"""
    try:
        comm.Revoke()
        for attempt in range(ATTEMPTS):
            comm.Agree(1)
            failed = comm.Get_agreed_failed()
            if not failed:
                raise R2commError("r2comm shrink: no rank of the group failed (the survivors "
                                  "agreed on an empty set)")
            try:
                return dist.shrink_group(list(failed), group=group)
            except ShrinkRaceError:
                if attempt + 1 == ATTEMPTS:
                    raise
            except dist.DistError as exc:
                if not isinstance(exc.__cause__, ShrinkRaceError) or attempt + 1 == ATTEMPTS:
                    raise
    except R2commError as exc:
        raise_as_torchs(exc)
