"""r2comm's own control plane: small agreements between the ranks of a communicator that go
through the engine (not through the bootstrap MPI communicator).

Every communicator's Channel has a hidden twin, plane(chan): same ranks, same engine,
communicator id CONTROL_BIT | id (comm_ids.py), so its operations have their own sequence
numbers and tags and never match the application's. It follows its communicator's plans (the rail state of the
agreed epoch). The start-up bandwidth measurement (bandwidth.py), the facts agreement of
rail_state() / replan() and the epoch check of R2COMM_REPLAN=K run on it; the plan-switch
rounds of replan.py run on a second twin of their own (epoch_plane).

allgather() gathers one small float64 row per rank with point-to-point messages (issue 31):

- Call numbers. Every call takes the next number of its plane, first thing, on every rank, and
  every tag of the call is a function of (that number, the phase) only, so nothing that fails
  in one call can shift the tags of a later one; a receive that did not match is cancelled
  before the call returns, and a message that arrives late carries a tag no later call
  (within 2**24 calls) posts. Nothing is posted to a peer the engine holds lost.
- Two trees (n > FLOOD_MAX). Trees A and B (control_trees) both rooted at rank 0, with no pair
  in common, and routed around the pairs broken in the rail state the plans follow (the same
  on every rank). The phases, in this order on every rank: up A (a rank sends the rows it
  heard from its A-children to its A-parent), up B (the rows it knows, A's included, to its
  B-parent), then rank 0 decides (DONE: it knows every row; else FLOOD), down A and down B
  (a rank passes what it knows, with the verdict when it has it, to its children). At most 6
  peers and 2 messages per peer per rank, 4 * depth dependent steps at most.
- Why that is agreed: whatever one pair does (fail before, during or between any phases, seen
  by both sides or by one: a send whose acknowledgement was lost while its receive completed),
  every row still reaches rank 0 over the other tree (the up B messages carry the A rows too)
  and rank 0's table and verdict still reach every rank, so every rank ends with the same
  table, and no rank floods. A rank acts only on what it received, never on a failed send.
- Fallback, after more failures than that (rank 0 missed a row: verdict FLOOD), or on a rank
  that heard no verdict and misses rows: the flood (flood()): every rank sends what it knows to
  each of its flood peers it can still reach, round after round, and merges what it receives.
  The flood peers are every other rank up to FLOOD_MAX ranks, else the ranks at distance 1, 2,
  4, ... (powers of two below n) either way round the ring (flood_peers: at most 2·log2(n),
  symmetric), over which every rank is at most flood_diameter(n) hops from every other
  (about log2(n)/2); the flood runs that many rounds plus `rounds` − 1 more, enough when
  every pair has a working path at most `rounds` − 1 hops longer. Every rank that took part
  ends with the same table, or raises R2commNetworkError: a partition raises on every rank.
  O(log(n)^2) messages of O(n) numbers and O(log n) connections per rank, after failures only
  (it was every peer in two rounds: n − 1 connections, 2(n − 1) messages).
- n <= FLOOD_MAX: the flood alone (at most 6 peers, as the trees).

Every rank ends with the same table, or raises R2commNetworkError when it could not learn every
row. The engine makes each message lossless under rail failures (chunks of a failed rail move
to a surviving one); a message to or from a peer that lost every rail fails alone."""
import functools
import time
import weakref
from collections import deque

import numpy as np

from ..errors import R2commError, R2commNetworkError
from ..request import Status

TAG_BASE = 0x60000000       # tags of the allgather (the probe uses 0x51......)
CALL_BITS = 24              # a tag: TAG_BASE | phase << CALL_BITS | call number mod 2**24
CALL_MASK = (1 << CALL_BITS) - 1
UP_A, UP_B, DOWN_A, DOWN_B, FLOOD_PHASE = 0, 1, 2, 3, 4     # phases (FLOOD_PHASE + round)
ROUNDS = 2                  # flooding rounds beyond the flood peers' diameter, + 1: one hop of
                            # detour around broken pairs
MAX_ROUNDS = 8
FLOOD_ROUNDS_MAX = 16 - FLOOD_PHASE   # a call's flooding rounds in all (the phase field's room)
GROW_PASSES = 4             # passes of a tree's growth over the ranks not attached yet
FLOOD_MAX = 7               # up to 7 ranks the flood alone (6 peers, the trees' bound)
UNKNOWN, DONE, FLOOD = 0.0, 1.0, 2.0      # verdicts (the last row of a tree message)

on_phase = None             # test instrumentation: on_phase(ctl, call, phase) before each tree
                            # phase (tests fail a pair between phases); None in production

_planes = weakref.WeakKeyDictionary()     # communicator -> its control-plane twin
_epoch_planes = weakref.WeakKeyDictionary()   # communicator -> its plan-switch twin
_calls = weakref.WeakKeyDictionary()      # control-plane twin -> allgather call numbers taken
_tree_cache = weakref.WeakKeyDictionary()  # control-plane twin -> (state, size, trees)


def plane(comm):
    """The control-plane twin of channel `comm` (channel.Channel; created on first use, the
    same on every rank); it follows `comm`'s plans (the rail state of its agreed epoch)."""
    ctl = _planes.get(comm)
    if ctl is None:
        ctl = _planes[comm] = comm.twin("control")
    ctl.follow(comm.plan_state)
    return ctl


def epoch_plane(comm):
    """The plan-switch twin of channel `comm` (replan.py's rounds; created on first use, the same on
    every rank). Its caller sets the state its trees follow (the one last agreed)."""
    ctl = _epoch_planes.get(comm)
    if ctl is None:
        ctl = _epoch_planes[comm] = comm.twin("epoch")
    return ctl


def tag(call, phase):
    """The tag of `phase` of allgather call number `call`."""
    return TAG_BASE | (phase << CALL_BITS) | (call & CALL_MASK)


def _take_calls(ctl, count=1):
    """The first of `count` consecutive call numbers of `ctl` (the same on every rank)."""
    first = _calls.get(ctl, 0)
    _calls[ctl] = first + count
    return first


# -- the trees ---------------------------------------------------------------------------------
def _grow(order, n, usable):
    """Parents (None: root or not attached) of a tree grown in `order` from order[0]: each rank
    goes under the earliest attached rank with fewer than 2 children that `usable(q, r)`
    allows (with every pair usable and order 0..n-1: the binary tree r -> (r - 1) // 2).
    Ranks that nothing attached yet are tried again after each pass while any attaches (at
    most GROW_PASSES passes: a rank left out is carried by the other tree or the flood)."""
    parent, kids = [None] * n, [0] * n
    room = deque([order[0]])
    waiting = list(order[1:])
    for _ in range(GROW_PASSES):
        left = []
        for r in waiting:
            for q in room:                   # (a plain loop: this runs once per rank, 8,192
                if usable(q, r):             # of them in ~10 ms; the first room mostly takes)
                    break
            else:
                left.append(r)
                continue
            parent[r] = q
            kids[q] += 1
            if kids[q] == 2:
                room.remove(q)
            room.append(r)
        if not left or len(left) == len(waiting):
            break
        waiting = left
    return parent


def control_trees(n, working=None):
    """(parents in tree A, parents in tree B) over ranks 0..n-1, both rooted at rank 0 (None:
    the root, or a rank the tree could not attach): A grows in rank order (the Bcast agreement's
    binary tree when every pair works), B in reverse rank order; B uses no pair of A, neither
    uses a pair `working(a, b)` rejects (None: every pair works). At most 2 children per rank
    in each, so at most 6 peers per rank."""
    if working is None:
        return _plain_trees(n)
    a = _grow(list(range(n)), n, working)

    def usable_b(q, r):
        return a[q] != r and a[r] != q and working(q, r)
    b = _grow([0] + list(range(n - 1, 0, -1)), n, usable_b)
    return a, b


@functools.lru_cache(maxsize=8)
def _plain_trees(n):
    """control_trees(n) where every pair works: A is the binary tree r -> (r - 1) // 2 in closed
    form, B grown around it; made once per size (every communicator of n ranks shares them)."""
    a = [None] + [(r - 1) // 2 for r in range(1, n)]
    b = _grow([0] + list(range(n - 1, 0, -1)), n, lambda q, r: a[q] != r and a[r] != q)
    return a, b


def tree_peers(rank, n, working=None):
    """The ranks `rank` exchanges with in the control trees (what allgather connects)."""
    if n <= FLOOD_MAX:
        return {p for p in range(n) if p != rank}
    out = set()
    for parents in control_trees(n, working):
        out |= {c for c in range(n) if parents[c] == rank}
        if parents[rank] is not None:
            out.add(parents[rank])
    return out


def _trees(ctl):
    """This plane's trees for its current plans (cached until they change)."""
    state, n = ctl.plan_state, ctl.size
    hit = _tree_cache.get(ctl)
    if hit is None or hit[0] is not state or hit[1] != n:
        broken = state is not None and state.has_broken_pairs()
        hit = (state, n, control_trees(n, state.working if broken else None))
        _tree_cache[ctl] = hit
    return hit[2]


# -- messages ------------------------------------------------------------------------------------
class _Exchange:
    """The messages of one allgather call on this rank: every request it posts is waited for or
    cancelled before the call ends (close)."""

    def __init__(self, ctl, shape, deadline):
        self.ctl, self.shape, self.deadline = ctl, shape, deadline
        self.engine, self.members = ctl.engine, ctl.global_ranks()
        self.pending = []

    def reachable(self, peer):
        """False for a peer the engine holds lost (every rail to it failed): nothing is posted
        to it (the engine would fail such a send or receive at once)."""
        return self.engine.links.peer_ok(self.members[peer])

    def post_recv(self, peer, phase_tag):
        """(buffer, request, status) of a receive from `peer`; request None if it failed."""
        box, status = np.zeros(self.shape), Status()
        if not self.reachable(peer):
            return box, None, status
        try:
            rq = self.ctl.message("recv", box, peer, phase_tag, status)
        except R2commError:
            return box, None, status
        self.pending.append(rq)
        return box, rq, status

    def send(self, table, peer, phase_tag):
        """Send a copy of `table` to `peer` (its outcome is not waited for here)."""
        if not self.reachable(peer):
            return
        try:
            self.pending.append(self.ctl.message("send", table.copy(), peer, phase_tag))
        except R2commError:
            pass

    def arrived(self, posted):
        """True when receive `posted` (post_recv's triple) ended with a whole message."""
        box, rq, status = posted
        if rq is None:
            return False
        try:
            rq.Wait(max(self.deadline - time.monotonic(), 0.0))
        except R2commError:          # the pair lost every rail, or the deadline passed
            return False
        return status.count == box.nbytes

    def close(self):
        """Wait for (or cancel, past the deadline) every request still in flight."""
        for rq in self.pending:
            if not rq.done:
                try:
                    rq.Wait(max(self.deadline - time.monotonic(), 0.0))
                except R2commError:
                    pass
        self.pending = []


def _merge(table, got):
    """Copy into `table` the rows `got` knows that `table` does not (column 0: 1.0 where known;
    anything else in column 0 is ignored); take its verdict if `table` has none."""
    n = table.shape[0] - 1
    known = got[:n, 0] == 1.0
    new = known & (table[:n, 0] == 0)
    table[:n][new] = got[:n][new]
    verdict = got[n, 0]
    if table[n, 0] == UNKNOWN and verdict in (DONE, FLOOD):
        table[n, 0] = verdict


def _complete(table):
    return bool((table[:-1, 0] == 1.0).all())


def _tree_call(ctl, table, call, timeout):
    """The four tree phases on this rank (module doc); the verdict this rank ends with."""
    n, me = ctl.size, ctl.rank
    trees = _trees(ctl)
    kids = [[c for c in range(n) if parents[c] == me] for parents in trees]
    ex = _Exchange(ctl, table.shape, time.monotonic() + timeout)
    try:
        ctl.connect(sorted({p for parents in trees for p in (parents[me], *kids[0], *kids[1])
                            if p is not None}))
        ups = [[ex.post_recv(c, tag(call, UP_A + t)) for c in kids[t]] for t in (0, 1)]
        downs = [ex.post_recv(parents[me], tag(call, DOWN_A + t))
                 if parents[me] is not None else None for t, parents in enumerate(trees)]
        for t, parents in enumerate(trees):
            _hook(ctl, call, UP_A + t)
            for posted in ups[t]:
                if ex.arrived(posted):
                    _merge(table, posted[0])
            if parents[me] is not None:
                ex.send(table, parents[me], tag(call, UP_A + t))
        if me == 0:
            table[n, 0] = DONE if _complete(table) else FLOOD
        for t in (0, 1):
            _hook(ctl, call, DOWN_A + t)
            if downs[t] is not None and ex.arrived(downs[t]):
                _merge(table, downs[t][0])
            for c in kids[t]:
                ex.send(table, c, tag(call, DOWN_A + t))
    finally:
        ex.close()
    return table[n, 0]


def _hook(ctl, call, phase):
    if on_phase is not None:
        on_phase(ctl, call, phase)


def flood_peers(rank, n):
    """The ranks `rank` floods to: every other rank up to FLOOD_MAX ranks, else rank ± 2^i
    (mod n) for every 2^i < n (at most 2·log2(n) ranks; q is rank's flood peer iff rank is q's)."""
    if n <= FLOOD_MAX:
        return {p for p in range(n) if p != rank}
    return {(rank + s * (1 << i)) % n for i in range((n - 1).bit_length()) for s in (1, -1)} - {rank}


@functools.lru_cache(maxsize=64)
def flood_diameter(n):
    """The most hops between two ranks over the flood peers (a breadth-first search from rank
    0: the ring of offsets looks the same from every rank)."""
    if n <= 1:
        return 0
    steps = flood_peers(0, n)           # rank 0's peers are the offsets
    seen, frontier, hops = {0}, {0}, 0
    while len(seen) < n:
        frontier = {(r + s) % n for r in frontier for s in steps} - seen
        seen |= frontier
        hops += 1
    return hops


def flood_rounds(n, rounds=ROUNDS):
    """Flooding rounds of a call over n ranks: the flood peers' diameter plus `rounds` − 1."""
    return min(flood_diameter(n) + rounds - 1, FLOOD_ROUNDS_MAX)


def _flood(ctl, table, call, rounds, timeout):
    """The flood of call `call` (module doc): flood_rounds() rounds in which every rank sends
    the rows it knows to each flood peer it can still reach and merges what it receives."""
    n, me = ctl.size, ctl.rank
    ex = _Exchange(ctl, table.shape, time.monotonic() + timeout)
    mine = sorted(flood_peers(me, n))
    try:
        ctl.connect(mine)
        for rnd in range(flood_rounds(n, rounds)):
            phase_tag = tag(call, FLOOD_PHASE + rnd)
            peers = [p for p in mine if ex.reachable(p)]
            posted = [ex.post_recv(p, phase_tag) for p in peers]
            out = table.copy()                # what this round sends (the merge goes in table)
            for p in peers:
                ex.send(out, p, phase_tag)
            for got in posted:
                if ex.arrived(got):           # else: that pair lost every rail, rows come around
                    _merge(table, got[0])
    finally:
        ex.close()


def _gather(ctl, row, call, rounds, timeout, tree):
    """allgather() under call number `call` (tree False: the flood alone)."""
    n, me = ctl.size, ctl.rank
    row = np.asarray(row, np.float64).ravel()
    if not 0 < rounds <= MAX_ROUNDS:
        raise ValueError(f"control plane: rounds must be 1 .. {MAX_ROUNDS}, not {rounds}")
    table = np.zeros((n + 1, row.size + 1))   # column 0: 1.0 where the row is known; row n:
    table[me, 0] = 1.0                        # the tree's verdict
    table[me, 1:] = row
    timeout = ctl.timeout if timeout is None else timeout
    if n > 1:
        verdict = _tree_call(ctl, table, call, timeout) if tree and n > FLOOD_MAX else FLOOD
        if verdict == FLOOD or not _complete(table):
            _flood(ctl, table, call, rounds, timeout)
    missing = [r for r in range(n) if table[r, 0] != 1.0]
    if missing:
        raise R2commNetworkError(f"control plane: rank {me} could not learn the state of ranks "
                                 f"{missing} (the fabric is partitioned, or more pairs failed "
                                 f"during the call than the trees and "
                                 f"{flood_rounds(n, rounds)} flooding rounds route around)")
    return table[:n, 1:].copy()


def allgather(ctl, row, rounds=ROUNDS, timeout=None):
    """Every rank's `row` (1-D, the same length on every rank), as an (n, len) float64 array
    identical on every rank. Collective over the control plane `ctl` (module doc)."""
    return _gather(ctl, row, _take_calls(ctl), rounds, timeout, tree=True)


def flood(ctl, row, rounds=ROUNDS, timeout=None):
    """allgather() by flooding alone (its fallback): the same table, O(log(n)^2) messages per
    rank.
    Collective; takes a call number like allgather()."""
    return _gather(ctl, row, _take_calls(ctl), rounds, timeout, tree=False)


def allreduce_max(ctl, values, **kw):
    """Element-wise maximum over ranks of a small vector (through allgather)."""
    return allgather(ctl, values, **kw).max(axis=0)
