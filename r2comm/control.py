"""r2comm's own control plane: small agreements between the ranks of a communicator that go
through the engine (not through the bootstrap MPI communicator).

Every Communicator has a hidden twin, plane(comm): same ranks, same engine, communicator id
CONTROL_BIT | id (comm_ids.py), so its operations have their own sequence numbers and tags and
never match the application's. The start-up bandwidth probe (probe.py), the rail-state
agreement (rail_state(): agree_rails, per-rank summaries of planner/agree.py) and the epoch check
of R2COMM_REPLAN run on it.

allgather() is a flooding allgather of one small float64 row per rank built from point-to-point
messages: each round every rank sends the rows it knows to every peer it can still reach and
merges what it receives. The engine makes each message lossless under rail failures (chunks of a
failed rail move to a surviving one). A message to or from a peer that lost every rail fails
alone, not the whole operation, and the second round brings that peer's row along a third rank.
So the agreement survives pairs with no common rail that the plans do not know about yet,
whenever each broken pair has a common working neighbour. Every rank ends with the same table,
or raises R2commNetworkError when it could not learn every row."""
import weakref

import numpy as np

from .errors import R2commError, R2commNetworkError

TAG_FLOOD = 0x52000000     # tags of flooding rounds (the probe uses 0x51......)
ROUNDS = 2                 # flooding rounds: enough when every broken pair has a common neighbour


_planes = weakref.WeakKeyDictionary()     # communicator -> its control-plane twin
_floods = weakref.WeakKeyDictionary()     # control-plane twin -> flooding rounds run


def plane(comm):
    """The control-plane twin of `comm` (created on first use, the same on every rank)."""
    ctl = _planes.get(comm)
    if ctl is None:
        ctl = _planes[comm] = comm.twin("control")
        _floods[ctl] = 0
    return ctl


def allgather(ctl, row, rounds=ROUNDS, timeout=None):
    """Every rank's `row` (1-D, the same length on every rank), as an (n, len) float64 array
    identical on every rank. Collective over the control plane `ctl`."""
    n, me = ctl.size, ctl.rank
    row = np.asarray(row, np.float64).ravel()
    width = row.size + 1                      # column 0: 1.0 where the row is known
    table = np.zeros((n, width))
    table[me, 0] = 1.0
    table[me, 1:] = row
    timeout = ctl.timeout if timeout is None else timeout
    eng, members = ctl.engine, ctl.global_ranks()
    for _ in range(rounds if n > 1 else 0):
        _floods[ctl] = rounds_run = _floods.get(ctl, 0) + 1
        tag = TAG_FLOOD + (rounds_run & 0xFFFFFF)
        peers = [p for p in range(n) if p != me and eng.peer_ok(members[p])]
        inbox = {p: np.zeros((n, width)) for p in peers}
        reqs = []
        out = table.copy()                    # what this round sends (the merge goes in table)
        for p in peers:
            try:
                reqs.append((p, ctl.Irecv(inbox[p], p, tag)))
            except R2commError:
                pass
        sends = []
        for p in peers:
            try:
                sends.append(ctl.Isend(out, p, tag))
            except R2commError:
                pass
        for p, rq in reqs:
            try:
                rq.Wait(timeout)
            except R2commError:              # that pair lost every rail: its rows come around
                continue
            got = inbox[p]
            new = (got[:, 0] > 0) & (table[:, 0] == 0)
            table[new] = got[new]
        for sq in sends:
            try:
                sq.Wait(timeout)
            except R2commError:
                pass
    missing = [r for r in range(n) if table[r, 0] == 0]
    if missing:
        raise R2commNetworkError(f"control plane: rank {me} could not learn the state of ranks "
                                 f"{missing} in {rounds} rounds (the fabric is partitioned)")
    return table[:, 1:].copy()


def allreduce_max(ctl, values, **kw):
    """Element-wise maximum over ranks of a small vector (through allgather)."""
    return allgather(ctl, values, **kw).max(axis=0)


def agree_rails(ctl, fixed, exceptions):
    """agree.agree_state's exchange for the control plane: every rank's fixed summary row
    (planner.agree.summarise; the last number its exception count) in one allgather, then the
    exceptions in a second one whose rows are as long as the most any rank has (none when no
    rank has any). Each rank contributes O(nrails + its exceptions) numbers, not O(n)."""
    from .planner import agree
    table = allgather(ctl, fixed)
    try:
        counts = agree.check_fixed(table, ctl.size, (len(fixed) - 1) // (2 * agree.FIELDS))
    except ValueError as exc:
        raise R2commNetworkError(f"control plane: {exc}") from None
    width = max(counts, default=0) * agree.EXC_FIELDS
    if not width:
        return table, [np.zeros((0, agree.EXC_FIELDS)) for _ in counts]
    row = np.zeros(width)
    row[:exceptions.size] = np.asarray(exceptions, np.float64).ravel()
    rows = allgather(ctl, row)
    return table, [rows[r, :c * agree.EXC_FIELDS].reshape(c, agree.EXC_FIELDS)
                   for r, c in enumerate(counts)]
