"""r2comm's own control plane: small agreements between the ranks of a communicator that go
through the engine (not through the bootstrap MPI communicator).

Every Communicator has a hidden twin, plane(comm): same ranks, same engine, communicator id
CONTROL_BIT | id (comm_ids.py), so its operations have their own sequence numbers and tags and
never match the application's. The start-up bandwidth probe (probe.py), the rail-state
agreement (rail_state(): agree_rails, per-rank summaries of planner/agree.py) and the epoch check
of R2COMM_REPLAN run on it.

allgather() gathers one small float64 row per rank with point-to-point messages over a tree
(issue 31): a fan-in of the known rows to rank 0 over a binary tree in rank order (the Bcast
agreement's tree, plans.agreement_peers, so no new connections), then a fan-out of the whole
table: at most 3 peers and 2 messages per peer per rank, 2 * depth dependent steps. The tree
routes around the pairs broken in the rail state the plans follow (the same on every rank): a
rank whose tree parent it cannot reach there is attached to another (tree_parents). The engine
makes each message lossless under rail failures (chunks of a failed rail move to a surviving
one). A tree message to or from a peer that lost every rail (a pair the plans do not know about
yet) fails alone, and the ranks fall back to flooding: a rank whose child or parent exchange
failed marks the table it passes on, rank 0 passes the mark down with the fan-out and a cut-off
rank down its own subtree, so every rank that took part floods: each round every rank sends the
rows it knows to every peer it can still reach and merges what it receives (ROUNDS rounds:
enough when each broken pair has a common working neighbour, as before the tree). Kept: that
guarantee, for a pair that fails before or during the fan-in; a pair that fails between a
rank's fan-in and its fan-out leaves that rank's subtree flooding alone (it raises after the
timeout). Every rank ends with the same table, or raises R2commNetworkError when it could not
learn every row."""
import weakref

import numpy as np

from .errors import R2commError, R2commNetworkError
from .plans import agreement_peers

TAG_FLOOD = 0x52000000     # tags of flooding rounds (the probe uses 0x51......)
TAG_TREE = 0x53000000      # tags of the tree's fan-in (+ 0) and fan-out (+ 1 << 23)
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


def tree_parents(n, working=None):
    """Each rank's parent in the control tree (rank 0: None), the same on every rank: the binary
    tree in rank order (rank r under (r - 1) // 2), except that a rank is attached to the
    earliest attached rank with room (under 2 children, else any) that `working(a, b)` says it
    can reach; None for a rank no attached rank reaches (working None: every pair works)."""
    if working is None:
        return [agreement_peers(r, n)[0] for r in range(n)]
    parent, order, kids = [None] * n, [0], [0] * n
    waiting = list(range(1, n))
    while waiting:
        left = []
        for r in waiting:
            fits = [q for q in order if working(q, r)]
            if not fits:
                left.append(r)
                continue
            q = next((q for q in fits if kids[q] < 2), fits[0])
            parent[r] = q
            kids[q] += 1
            order.append(r)
        if len(left) == len(waiting):
            break
        waiting = left
    return parent


def _tree(ctl, n):
    """This rank's (parent, children, every rank attached) in the control tree."""
    state = ctl.plan_state
    healthy = state is None or not state.has_broken_pairs()
    parents = tree_parents(n, None if healthy else state.working)
    me = ctl.rank
    children = [r for r in range(1, n) if parents[r] == me]
    return parents[me], children, all(p is not None for p in parents[1:])


def _exchange(ctl, peer, out, inbox, tag, timeout):
    """Send `out` to `peer` (None: no send) and/or receive into `inbox` (None: no receive);
    False when the pair failed (lost every rail, or the timeout passed)."""
    try:
        rq = ctl.Irecv(inbox, peer, tag) if inbox is not None else None
        sq = ctl.Isend(out, peer, tag) if out is not None else None
        if rq is not None:
            rq.Wait(timeout)
        if sq is not None:
            sq.Wait(timeout)
        return True
    except R2commError:
        return False


def _merge(table, got):
    """Copy into `table` the rows `got` knows that `table` does not."""
    new = (got[:, 0] > 0) & (table[:, 0] == 0)
    table[new] = got[new]


def _tree_round(ctl, table, timeout):
    """Fan-in then fan-out over the control tree; True when every rank must flood (a tree
    exchange failed somewhere this rank hears of, or the tree does not reach every rank)."""
    n, me = ctl.size, ctl.rank
    parent, children, complete = _tree(ctl, n)
    if not complete:
        return True
    _floods[ctl] = count = _floods.get(ctl, 0) + 1
    up, down = TAG_TREE + (count & 0x7FFFFF), TAG_TREE + (1 << 23) + (count & 0x7FFFFF)
    n1, width = table.shape[0] + 1, table.shape[1]
    msg = np.zeros((n1, width))               # the table, then row n: [flood needed]
    flood = False
    inboxes = {c: np.zeros((n1, width)) for c in children}
    reqs = []
    for c in children:
        try:
            reqs.append((c, ctl.Irecv(inboxes[c], c, up)))
        except R2commError:
            flood = True
    for c, rq in reqs:
        try:
            rq.Wait(timeout)
        except R2commError:
            flood = True
            continue
        _merge(table, inboxes[c][:-1])
        flood = flood or inboxes[c][-1, 0] > 0
    if parent is not None:
        msg[:-1], msg[-1, 0] = table, float(flood)
        flood = not _exchange(ctl, parent, msg.copy(), None, up, timeout) or flood
        got = np.zeros((n1, width))
        if _exchange(ctl, parent, None, got, down, timeout):
            _merge(table, got[:-1])
            flood = flood or got[-1, 0] > 0
        else:
            flood = True
    else:
        flood = flood or bool((table[:, 0] == 0).any())
    msg[:-1], msg[-1, 0] = table, float(flood)
    sends = []
    for c in children:
        try:
            sends.append(ctl.Isend(msg, c, down))
        except R2commError:
            pass
    for sq in sends:
        try:
            sq.Wait(timeout)
        except R2commError:
            pass
    return flood


def _flood(ctl, table, rounds, timeout):
    """`rounds` flooding rounds: every rank sends the rows it knows to every peer it can still
    reach and merges what it receives."""
    n, me = ctl.size, ctl.rank
    eng, members = ctl.engine, ctl.global_ranks()
    for _ in range(rounds):
        _floods[ctl] = rounds_run = _floods.get(ctl, 0) + 1
        tag = TAG_FLOOD + (rounds_run & 0xFFFFFF)
        peers = [p for p in range(n) if p != me and eng.peer_ok(members[p])]
        inbox = {p: np.zeros(table.shape) for p in peers}
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
            _merge(table, inbox[p])
        for sq in sends:
            try:
                sq.Wait(timeout)
            except R2commError:
                pass


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
    if n > 1 and _tree_round(ctl, table, timeout):
        _flood(ctl, table, rounds, timeout)
    missing = [r for r in range(n) if table[r, 0] == 0]
    if missing:
        raise R2commNetworkError(f"control plane: rank {me} could not learn the state of ranks "
                                 f"{missing} over the tree and {rounds} flooding rounds (the "
                                 f"fabric is partitioned)")
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
