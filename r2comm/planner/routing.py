"""Routing around broken pairs (ranks with no common working rail).

Two tools, both deterministic functions of the RailState (every rank computes the same thing):

  ring_order()  re-ranks a ring so that no ring neighbours form a broken pair: a Hamiltonian
                cycle in the graph of working pairs, found by backtracking search (small n), the
                one whose slowest link is fastest (bottleneck search over bandwidth thresholds).
  relay()       rewrites a whole schedule set so that every message between a broken pair goes
                through one or more relay ranks: the relay receives into its SCRATCH buffer and
                sends on, with a chunk dependency (so it is pipelined chunk by chunk). Works for
                any collective (recursive doubling, trees, alltoall, a ring with no Hamiltonian
                cycle, ...).

Both fail with PartitionedError only when the working pairs do not connect every rank."""
from .algorithms import blocks
from .schedule import Schedule, WORK, SEND, SCRATCH, COPY, REDUCE, REDUCE_SEND
from .state import HostHops, PartitionedError

RELAY_STEP0 = 1 << 23          # relayed messages use steps above every algorithm's own steps
MAX_STEP = 1 << 24             # the engine's limit (steps share a 64-bit key with the sequence)
SEARCH_BUDGET = 50_000         # backtracking expansions per bandwidth threshold


# -- a ring over any order of ranks and any region of the work buffer ------------------------------
def ring_region(s, order, me, off, count, itemsize, step0=0, own=False, fold=None,
                from_send=False):
    """Ring allreduce (reduce-scatter then allgather, chunk-pipelined) of `count` elements of
    WORK at byte offset `off` among the ranks of `order` (ring neighbours are consecutive
    entries). Equals algorithms.allreduce_ring for order = range(n), off = 0, step0 = 0.

    Block b's value is reduced along the ring starting at order[b] and is final at order[b-1];
    `fold(s, prev, boff, blen)` is called on that owner with `prev` the message that completed
    its block (None for a ring of one) and returns the message the allgather must wait for (a
    hook to fold in contributions from outside the ring and to hand the result out).

    from_send: the first send and the reductions read the input from SEND, so WORK needs no
    copy of it beforehand (every byte of the region is written by a receive)."""
    n = len(order)
    pos = order.index(me)
    blk = [(off + o, ln) for o, ln in blocks(count, n, itemsize)]
    if n == 1:
        if fold is not None:
            fold(s, None, blk[0][0], blk[0][1])
        return
    right, left = order[(pos + 1) % n], order[(pos - 1) % n]
    prev = None
    for st in range(n - 1):                       # reduce-scatter
        sb, rb = (pos - st) % n, (pos - st - 1) % n
        src = SEND if from_send and st == 0 else WORK
        si = s.send(right, step0 + st, src, blk[sb][0], blk[sb][1], owned=own)
        s.dep(prev, si)
        ri = s.recv(left, step0 + st, WORK, blk[rb][0], blk[rb][1],
                    REDUCE_SEND if from_send else REDUCE)
        if own and blk[sb][1] == blk[rb][1]:
            s.dep(si, ri)          # keeps the copies ordered (dependencies need equal sizes)
        prev = ri
    if fold is not None:
        mine = (pos + 1) % n
        prev = fold(s, prev, blk[mine][0], blk[mine][1])
    for st in range(n - 1):                       # allgather
        sb, rb = (pos + 1 - st) % n, (pos - st) % n
        si = s.send(right, step0 + n - 1 + st, WORK, blk[sb][0], blk[sb][1], owned=own)
        s.dep(prev, si)
        prev = s.recv(left, step0 + n - 1 + st, WORK, blk[rb][0], blk[rb][1], COPY)


def owner_block(order, rank):
    """Index of the block `rank` holds the final value of after the reduce-scatter."""
    return (order.index(rank) + 1) % len(order)


def allreduce_ring_ordered(rank, order, nbytes, itemsize, eager=0, algo="ring_rerouted"):
    s = Schedule(algo)
    if len(order) > 1:
        ring_region(s, list(order), rank, 0, nbytes // itemsize, itemsize,
                    own=nbytes // len(order) <= eager, from_send=True)
        s.fills_work = True
    return s


# -- Hamiltonian ring search ---------------------------------------------------------------------
def _ham_cycle(members, ok, budget):
    """A Hamiltonian cycle through `members` using only pairs with ok(a, b), starting at the
    smallest member and preferring the next rank up (so a healthy graph gives the identity)."""
    n = len(members)
    if n <= 2:
        if n == 2 and not ok(members[0], members[1]):
            return None
        return list(members)
    idx = {r: i for i, r in enumerate(members)}
    adj = {a: [b for b in members if b != a and ok(a, b)] for a in members}
    if any(len(v) < 2 for v in adj.values()):
        return None
    for a in members:            # prefer the next rank up in the original numbering
        adj[a].sort(key=lambda b: (idx[b] - idx[a]) % n)
    start = members[0]
    path, used = [start], {start}
    left = [budget]

    def dfs():
        if len(path) == n:
            return ok(path[-1], start)
        left[0] -= 1
        if left[0] < 0:
            return False
        u = path[-1]
        for v in adj[u]:
            if v in used:
                continue
            path.append(v)
            used.add(v)
            # prune: every unvisited rank still needs two free neighbours (in and out)
            dead = False
            for w in members:
                if w in used:
                    continue
                free = sum(1 for x in adj[w] if x not in used or x in (v, start))
                if free < 2:
                    dead = True
                    break
            if not dead and dfs():
                return True
            path.pop()
            used.discard(v)
        return False

    return list(path) if dfs() else None


def ring_order(state, members=None, budget=SEARCH_BUDGET):
    """The ring order of `members` (default: every rank) whose slowest ring link is fastest and
    which uses no broken pair; None when no such cycle was found (then relay() must help)."""
    members = list(range(state.n)) if members is None else sorted(members)
    if len(members) <= 1:
        return members
    bw = {(a, b): state.pair_bw(a, b) for a in members for b in members if a != b}
    levels = sorted({v for v in bw.values() if v > 0}, reverse=True)

    def at(i):
        return _ham_cycle(members, lambda a, b: bw[(a, b)] >= levels[i], budget)
    if not levels:
        return None
    if _identity_is_best(members, bw, levels, budget):
        return list(members)
    best = at(len(levels) - 1)                  # every working pair allowed
    if best is None:
        return None
    lo, hi = 0, len(levels) - 1                 # binary search for the fastest level with one
    while lo < hi:
        mid = (lo + hi) // 2
        cyc = at(mid)
        if cyc is not None:
            best, hi = cyc, mid
        else:
            lo = mid + 1
    return best


def _identity_is_best(members, bw, levels, budget):
    """True when the search in ring_order() is sure to return `members` in their own order, so
    it can be skipped (it costs O(n^3) on a healthy ring of n ranks, which a simulation of
    hundreds of hosts cannot afford): the identity cycle uses only working pairs, and at the
    next level faster than its slowest link some member has fewer than two neighbours, so no
    Hamiltonian cycle exists there or at any faster level. At every level the identity reaches,
    _ham_cycle() returns the identity: it tries the next rank up first, and the identity's
    path is never pruned (each unvisited rank keeps its two ring neighbours free)."""
    n = len(members)
    if n < 3 or n > budget:
        return False
    worst = min(bw[(members[i], members[(i + 1) % n])] for i in range(n))
    if worst <= 0:
        return False
    j = levels.index(worst)
    if j == 0:
        return True
    faster = levels[j - 1]
    return any(sum(1 for b in members if b != a and bw[(a, b)] >= faster) < 2 for a in members)


def best_ring_order(state, members=None):
    """ring_order(), or when no Hamiltonian cycle of working pairs exists, a greedy order that
    always moves on to the fastest unvisited neighbour (relay() then carries the broken ones)."""
    members = list(range(state.n)) if members is None else sorted(members)
    order = ring_order(state, members)
    if order is not None:
        return order
    left, order = set(members[1:]), [members[0]]
    while left:
        u = order[-1]
        nxt = sorted(left, key=lambda v: (-state.pair_bw(u, v), v))[0]
        order.append(nxt)
        left.discard(nxt)
    return order


def broken_neighbours(state, order):
    n = len(order)
    if n < 2:
        return []
    pairs = {tuple(sorted((order[i], order[(i + 1) % n]))) for i in range(n)}
    return sorted(p for p in pairs if not state.working(*p))


# -- relaying -----------------------------------------------------------------------------------
def _hops(state, src):
    """Hop distance from src over working pairs: {rank: hops} (a dict), or for a state held per
    host and NIC (host_indices()) a HostHops answering the same per rank, made in O(H·K)."""
    if hasattr(state, "host_indices"):
        return HostHops(state, src)
    dist, frontier = {src: 0}, [src]
    while frontier:
        nxt = []
        for a in frontier:
            for b in state.neighbours(a):
                if b not in dist:
                    dist[b] = dist[a] + 1
                    nxt.append(b)
        frontier = nxt
    return dist


def route(state, a, b, nbytes=1, load=None, _dist=None):
    """A shortest (in hops) path a -> ... -> b over working pairs; among equal-length next hops
    the one that would finish its relayed bytes soonest (load: bytes already relayed per rank).
    On a state held per host and NIC, O(H·K) per hop (HostHops), not O(n)."""
    if state.working(a, b):
        return [a, b]
    dist = _dist if _dist is not None else _hops(state, b)
    if a not in dist:
        state.check_connected()
        raise PartitionedError(f"no working path between ranks {a} and {b}")
    load = {} if load is None else load
    path = [a]
    while path[-1] != b:
        u = path[-1]
        if isinstance(dist, HostHops):
            path.append(dist.next_hop(u, nbytes, load))
            continue
        cands = [c for c in state.neighbours(u) if dist.get(c, -1) == dist[u] - 1]

        def score(c):
            if c == b:
                return (0.0, c)
            bott = min(state.pair_bw(u, c), state.pair_bw(c, b) if state.working(c, b)
                       else state.pair_bw(u, c))
            return ((load.get(c, 0) + nbytes) / bott, c)
        path.append(min(cands, key=score))
    return path


def uses_broken_pair(schedules, state):
    """Whether a send of `schedules` (a list indexed by rank, or {rank: Schedule}) crosses a
    broken pair."""
    items = schedules.items() if isinstance(schedules, dict) else enumerate(schedules)
    for r, s in items:
        bad = state.broken_peers(r)
        if bad and any(m[0] == "send" and m[1] in bad for m in s.msgs):
            return True
    return False


def relay(schedules, state, suffix="+relay"):
    """Rewrite `schedules` (one per rank, all ranks) so that no message crosses a broken pair.
    Returns new Schedule objects (the inputs are not modified). Every schedule gets the same
    new algo name (the engine checks that peers run the same algorithm)."""
    n = len(schedules)
    if not uses_broken_pair(schedules, state):
        return schedules
    state.check_connected()
    out = {r: s.copy(algo=s.algo + suffix) for r, s in enumerate(schedules)}
    recv_at = [{(m[1], m[2]): i for i, m in enumerate(s.msgs) if m[0] == "recv"}
               for s in schedules]
    _check_steps(schedules)
    for a, i, m, path, S in _relayed(dict(enumerate(schedules)), range(n), state):
        _rewrite(out, recv_at, a, i, m, path, S)
    return [out[r] for r in range(n)]


def relay_rank(rank, build, senders, state, suffix="+relay"):
    """relay()'s schedule of one rank, made from the schedules of `senders` alone: build(r) ->
    rank r's schedule (unrelayed); senders: every rank with a broken pair, the only ones whose
    messages relay() rewrites. Equal to relay([build(r) for r in range(n)], state)[rank], in
    time proportional to the senders' schedules, not every rank's."""
    scheds = {a: build(a) for a in senders}
    mine = scheds[rank] if rank in scheds else build(rank)
    if not uses_broken_pair(scheds, state):
        return mine
    state.check_connected()
    out = {rank: mine.copy(algo=mine.algo + suffix)}
    recv_at = {rank: {(m[1], m[2]): i for i, m in enumerate(mine.msgs) if m[0] == "recv"}}
    _check_steps(list(scheds.values()) + [mine])
    for a, i, m, path, S in _relayed(scheds, sorted(scheds), state):
        if rank in path:
            _rewrite(out, recv_at, a, i, m, path, S)
    return out[rank]


def _check_steps(schedules):
    top = max((m[2] for s in schedules for m in s.msgs), default=0)
    if top >= RELAY_STEP0:
        raise ValueError(f"cannot relay: the schedule already uses step {top}")


def _relayed(schedules, senders, state):
    """(sender, message index, message, path, relay step) of every message of `schedules`
    ({rank: Schedule}) over a broken pair, senders in the order given, messages in schedule
    order: the route of each (route(), the relays' load so far weighing the choice) and its
    own step above every algorithm's."""
    load, dists = {}, {}
    nrelayed = 0
    for a in senders:
        bad = state.broken_peers(a)
        for i, m in enumerate(schedules[a].msgs):
            b, nbytes = m[1], m[5]
            if m[0] != "send" or b not in bad:
                continue
            if b not in dists:
                dists[b] = _hops(state, b)
            path = route(state, a, b, max(nbytes, 1), load, dists[b])
            S = RELAY_STEP0 + nrelayed          # one step per relayed message: unique on
            nrelayed += 1                       # every link of its path
            if S >= MAX_STEP:
                raise ValueError("schedule too large to relay (step numbers overflow)")
            for c in path[1:-1]:
                load[c] = load.get(c, 0) + nbytes
            yield a, i, m, path, S


def _rewrite(out, recv_at, a, i, m, path, S):
    """Apply one relayed message to the schedules in `out` ({rank: Schedule}, those present):
    the sender's send and the receiver's receive move to the path's first and last hop, each
    relay receives into its scratch and sends on, chunk by chunk."""
    _, b, step, buf, off, nbytes, _mode, owned = m
    if a in out:
        out[a].msgs[i] = ("send", path[1], S, buf, off, nbytes, COPY, owned)
    if b in out:
        j = recv_at[b].get((a, step))
        if j is None:
            raise ValueError(f"send {a}->{b} step {step} has no receive to relay to")
        rm = out[b].msgs[j]
        out[b].msgs[j] = ("recv", path[-2], S, rm[3], rm[4], rm[5], rm[6], rm[7])
    for k in range(1, len(path) - 1):
        c = path[k]
        if c in out:
            s = out[c]
            so = s.scratch
            s.scratch += nbytes
            ri = s.recv(path[k - 1], S, SCRATCH, so, nbytes, COPY)
            si = s.send(path[k + 1], S, SCRATCH, so, nbytes, owned=owned)
            s.dep(ri, si)
