"""control.allgather over two trees (issue 31), run by n threads over an in-process network
whose pairs fail when a test says so (between any two phases, seen by both sides or with the
acknowledgement of a delivered message lost): every rank ends every call with the same table,
a single failed pair never makes anyone flood nor shifts a later call's tags, more failures
fall back to the flood on every rank, a partition raises on every rank, and a rank talks to at
most 4 peers (2 messages each) per healthy call. The real engine under mpiexec:
tests/test_control_mpi.py."""
import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from r2comm.control import tree as control
from r2comm.errors import R2commNetworkError, R2commTimeout
from r2comm.planner.state import RailState


class Net:
    """Messages between n in-process ranks: a send is delivered at once unless its pair is cut;
    `ack_lost` pairs deliver their next message but its sender sees a failure, then are cut."""

    def __init__(self, n):
        self.n = n
        self.cv = threading.Condition()
        self.boxes = defaultdict(list)        # (src, dst, tag) -> payloads
        self.cut, self.ack_lost = set(), set()
        self.log = []                         # (src, dst, tag) of every send posted
        self.limit, self.carried = {}, defaultdict(int)   # pair -> messages it carries, carried

    def fail(self, a, b, ack_lost=False):
        with self.cv:
            (self.ack_lost if ack_lost else self.cut).add(frozenset((a, b)))
            self.cv.notify_all()

    def send(self, src, dst, tag, buf):
        pair = frozenset((src, dst))
        with self.cv:
            self.log.append((src, dst, tag))
            if self.carried[pair] >= self.limit.get(pair, self.carried[pair] + 1):
                self.cut.add(pair)
            if pair in self.cut:
                return False
            self.carried[pair] += 1
            self.boxes[(src, dst, tag)].append(buf.copy())
            self.cv.notify_all()
            if pair in self.ack_lost:
                self.ack_lost.discard(pair)
                self.cut.add(pair)
                return False
            return True

    def recv(self, src, dst, tag, buf, timeout):
        with self.cv:
            ok = self.cv.wait_for(lambda: self.boxes[(src, dst, tag)] or
                                  frozenset((src, dst)) in self.cut, timeout)
            if self.boxes[(src, dst, tag)]:
                buf[...] = self.boxes[(src, dst, tag)].pop(0)
                return buf.nbytes
            if ok:
                raise R2commNetworkError(f"lost every rail to rank {src}")
            raise R2commTimeout("timed out")


class Req:
    def __init__(self, outcome):
        self._outcome, self.done = outcome, False

    def Wait(self, timeout=None):
        self.done = True
        self._outcome(timeout)


class Plane:
    """What control.allgather asks of a control-plane twin, over a Net."""

    def __init__(self, net, rank, state=None, timeout=5.0):
        self.net, self.rank, self.size = net, rank, net.n
        self.plan_state, self.timeout = state, timeout
        self.engine = SimpleNamespace(links=self)      # the engine's links face: peer_ok

    def peer_ok(self, g):
        return frozenset((self.rank, g)) not in self.net.cut

    def global_ranks(self):
        return list(range(self.size))

    def connect(self, ranks):
        pass

    def message(self, kind, buf, peer, tag, status=None, rail=None):
        if kind == "send":
            ok = self.net.send(self.rank, peer, tag, buf)

            def outcome(timeout):
                if not ok:
                    raise R2commNetworkError("send failed")
            return Req(outcome)

        def received(timeout):
            count = self.net.recv(peer, self.rank, tag, buf, timeout)
            if status is not None:
                status.count = count
        return Req(received)


def run(n, calls=4, hook=None, state=None, before=(), timeout=5.0, fn=control.allgather,
        limits=None):
    """Each rank runs `calls` allgathers of its own rows; per call, per rank: the table or the
    exception. `before`: pairs cut before the first call; `limits`: {pair: the messages it
    carries before it is cut}."""
    net = Net(n)
    for a, b in before:
        net.fail(a, b)
    net.limit.update({frozenset(p): k for p, k in (limits or {}).items()})
    planes = [Plane(net, r, state, timeout) for r in range(n)]
    out = [[None] * calls for _ in range(n)]

    def rank_main(r):
        for k in range(calls):
            try:
                out[r][k] = fn(planes[r], [r, 10.0 * r + k, -k])
            except R2commNetworkError as exc:
                out[r][k] = exc
    old = control.on_phase
    control.on_phase = None if hook is None else (lambda ctl, call, phase:
                                                  hook(net, ctl.rank, call, phase))
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        control.on_phase = old
    return out, net


def expected(n, k):
    return np.array([[r, 10.0 * r + k, -k] for r in range(n)])


def flooded(net):
    """The call numbers in which some rank sent a flooding message."""
    return {t & control.CALL_MASK for _, _, t in net.log
            if (t >> control.CALL_BITS) & 0xF >= control.FLOOD_PHASE}


def edges(n):
    a, b = control.control_trees(n)
    return [(p[c], c, name) for name, p in (("A", a), ("B", b)) for c in range(n)
            if p[c] is not None]


@pytest.mark.parametrize("n", [8, 13, 33])
def test_healthy_calls_use_the_trees_only(n):
    out, net = run(n, calls=3)
    for k in range(3):
        for r in range(n):
            assert np.array_equal(out[r][k], expected(n, k))
    assert not flooded(net)
    talks, sends = defaultdict(set), defaultdict(int)
    for src, dst, t in net.log:
        talks[src].add(dst)
        talks[dst].add(src)
        sends[src] += 1
        assert t & control.CALL_MASK < 3 and (t >> control.CALL_BITS) & 0xF < control.FLOOD_PHASE
    for r in range(n):
        assert talks[r] == control.tree_peers(r, n) and len(talks[r]) <= 4
        assert sends[r] <= 2 * len(talks[r]) * 3          # 2 messages per peer per call


def test_the_trees_are_the_agreement_tree_and_share_no_pair():
    from r2comm.front import plans
    for n in list(range(8, 70)) + [255, 256, 1000, 1024]:
        a, b = control.control_trees(n)
        assert a == [plans.agreement_peers(r, n)[0] for r in range(n)]
        pairs_a = {frozenset((r, a[r])) for r in range(1, n)}
        pairs_b = {frozenset((r, b[r])) for r in range(1, n)}
        assert None not in a[1:] and None not in b[1:] and not pairs_a & pairs_b
        assert max(len(control.tree_peers(r, n)) for r in range(0, n, max(1, n // 50))) <= 4
        for parents in (a, b):
            for r in range(n):
                depth, x = 0, r
                while parents[x] is not None:
                    x, depth = parents[x], depth + 1
                assert depth <= n.bit_length(), (n, r, depth)


def test_the_trees_route_around_broken_pairs():
    state = RailState.uniform(12, 2)
    broken = [(0, 1), (1, 3), (0, 11), (2, 5), (4, 9)]
    for a, b in broken:
        state.break_pair(a, b)
    ta, tb = control.control_trees(12, state.working)
    for parents in (ta, tb):
        assert None not in parents[1:]
        assert all(state.working(r, parents[r]) for r in range(1, 12))
    assert not {frozenset((r, ta[r])) for r in range(1, 12)} & \
        {frozenset((r, tb[r])) for r in range(1, 12)}
    assert max(len(control.tree_peers(r, 12, state.working)) for r in range(12)) <= 6


@pytest.mark.parametrize("ack_lost", [False, True])
@pytest.mark.parametrize("phase", [control.UP_A, control.UP_B, control.DOWN_A, control.DOWN_B])
def test_one_pair_failing_at_any_phase_leaves_every_call_agreed(phase, ack_lost):
    """Each tree pair in turn fails as its parent starts `phase` of call 1 (seen by both
    sides, or after a delivered message whose acknowledgement was lost): that call and the
    three after it end with the same, right table on every rank, and nobody floods."""
    n = 10
    for parent, child, name in edges(n):
        def hook(net, rank, call, ph, parent=parent, child=child):
            if call == 1 and ph == phase and rank == parent:
                net.fail(parent, child, ack_lost)
        out, net = run(n, calls=5, hook=hook)
        for k in range(5):
            for r in range(n):
                assert isinstance(out[r][k], np.ndarray), (name, parent, child, k, r, out[r][k])
                assert np.array_equal(out[r][k], expected(n, k)), (name, parent, child, k, r)
        assert not flooded(net), (name, parent, child)


@pytest.mark.parametrize("child", [1, 2, 3, 4, 6, 9])
def test_a_tree_pair_cut_after_its_up_message_of_the_second_call(child):
    """Counted in messages, not phases (so it applies to any protocol): the pair of `child`
    and its binary-tree parent carries call 0 (up, down) and call 1's up message, then is
    cut. The reverted tree allgather (ab7982c) fails here (its later calls' tags no longer
    lined up); now every call ends with the same table on every rank."""
    n = 10
    out, _ = run(n, calls=4, limits={((child - 1) // 2, child): 3}, timeout=3.0)
    for k in range(4):
        for r in range(n):
            assert isinstance(out[r][k], np.ndarray), (k, r, out[r][k])
            assert np.array_equal(out[r][k], expected(n, k)), (k, r)


def test_a_pair_failing_between_up_and_down_seen_by_the_child_first():
    """The child cuts the pair as it starts the down phases (its up message was delivered):
    the same outcome as when the parent does."""
    n = 12
    for parent, child, name in edges(n):
        def hook(net, rank, call, ph, parent=parent, child=child):
            if call == 0 and ph == control.DOWN_A and rank == child:
                net.fail(parent, child)
        out, net = run(n, calls=3, hook=hook)
        assert all(np.array_equal(out[r][k], expected(n, k)) for r in range(n) for k in range(3))
        assert not flooded(net)


def test_a_rank_cut_off_in_both_trees_makes_every_rank_flood():
    """Rank 4's parents in both trees are cut before the call: rank 0 misses its row and says
    FLOOD; every rank floods (rank 4 heard no verdict and misses rows) and all end with the
    same table through rank 4's other neighbours."""
    n = 10
    a, b = control.control_trees(n)
    out, net = run(n, calls=2, before=[(4, a[4]), (4, b[4])])
    assert all(np.array_equal(out[r][k], expected(n, k)) for r in range(n) for k in range(2))
    assert flooded(net) == {0, 1}


def test_a_partition_raises_on_every_rank():
    """Ranks 0-4 and 5-9 cannot reach each other: every rank raises, in every call, well within
    the timeout (each failed pair is known at once), and the calls after stay in step."""
    n = 10
    cut = [(x, y) for x in range(5) for y in range(5, 10)]
    out, _ = run(n, calls=3, before=cut, timeout=20.0)
    assert all(isinstance(out[r][k], R2commNetworkError) for r in range(n) for k in range(3))


def test_two_failures_in_one_call_after_the_up_phases_still_agree():
    """Both tree pairs of rank 7 fail as the down phases start: the flood is not needed by
    rank 0 (it knows every row), rank 7 heard no verdict and misses rows: it floods alone and
    raises; the others end with the table. Documented limit: more than one failed pair in one
    call may leave ranks disagreeing. In the next call (rank 7 still cut off in both trees,
    and late by its lone flood's timeout) a rank may raise, but none returns a wrong table."""
    n = 10
    a, b = control.control_trees(n)

    def hook(net, rank, call, ph):
        if call == 0 and ph == control.DOWN_A and rank == 7:
            net.fail(7, a[7])
            net.fail(7, b[7])
    out, net = run(n, calls=2, hook=hook, timeout=2.0)
    assert isinstance(out[7][0], R2commNetworkError)
    assert all(np.array_equal(out[r][0], expected(n, 0)) for r in range(n) if r != 7)
    assert all(np.array_equal(out[r][1], expected(n, 1)) for r in range(n)
               if not isinstance(out[r][1], R2commNetworkError))


def test_flood_and_tree_give_the_same_table():
    for n in (3, 7, 9):
        tree, _ = run(n, calls=2)
        flood, _ = run(n, calls=2, fn=control.flood)
        assert all(np.array_equal(tree[r][k], flood[r][k]) for r in range(n) for k in range(2))


def test_tags_depend_on_the_call_and_phase_only():
    assert control.tag(5, control.UP_A) != control.tag(5, control.DOWN_A)
    assert control.tag(5, control.UP_A) != control.tag(6, control.UP_A)
    assert control.tag(5 + (1 << control.CALL_BITS), 3) == control.tag(5, 3)
    top = control.tag(control.CALL_MASK, control.FLOOD_PHASE + control.FLOOD_ROUNDS_MAX - 1)
    assert top < 1 << 31 and top >> 24 < 0x70
    assert control.flood_rounds(1 << 20, control.MAX_ROUNDS) == control.FLOOD_ROUNDS_MAX


def _hops(n, src, cut=()):
    """Hops from `src` to every rank over the flood peers, without the `cut` pairs."""
    cut = {frozenset(p) for p in cut}
    dist, frontier = {src: 0}, [src]
    while frontier:
        nxt = []
        for r in frontier:
            for q in control.flood_peers(r, n):
                if q not in dist and frozenset((r, q)) not in cut:
                    dist[q] = dist[r] + 1
                    nxt.append(q)
        frontier = nxt
    return dist


def test_flood_peers_are_few_symmetric_and_close():
    """At most 2·log2(n) flood peers per rank (every other rank up to 7), symmetric, and every
    rank within flood_diameter(n) <= log2(n) hops of every other, from any rank (the search
    from rank 0 that flood_diameter makes stands for all)."""
    for n in list(range(2, 70)) + [255, 1000, 1024]:
        bound = n - 1 if n <= control.FLOOD_MAX else 2 * (n - 1).bit_length()
        for r in {0, 1, n // 3, n - 1}:
            peers = control.flood_peers(r, n)
            assert r not in peers and len(peers) <= bound and peers <= set(range(n))
            assert all(r in control.flood_peers(q, n) for q in peers)
            assert max(_hops(n, r).values()) == control.flood_diameter(n)
        assert control.flood_diameter(n) <= max(1, (n - 1).bit_length())
    assert len(control.flood_peers(0, 1024)) == 19 and control.flood_rounds(1024) == 6


@pytest.mark.parametrize("n", [16, 64])
def test_the_flood_talks_to_flood_peers_only_and_routes_around_broken_pairs(n):
    """Rank 4 is cut off in both trees and pairs of the overlay fail before the calls: every
    rank floods (O(log n) peers, O(log(n)^2) messages per call, not every peer) and ends with
    the full table, since every rank still reaches every other within the flood's rounds."""
    a, b = control.control_trees(n)
    cut = [(4, a[4]), (4, b[4]), (0, 1), (5, 7), (9, 10), (3, (3 + n // 2) % n)]
    rounds = control.flood_rounds(n)
    assert all(max(_hops(n, r, cut).values()) <= rounds for r in range(n))
    out, net = run(n, calls=2, before=cut, timeout=10.0)
    assert all(np.array_equal(out[r][k], expected(n, k)) for r in range(n) for k in range(2))
    assert flooded(net) == {0, 1}
    talks, sends = defaultdict(set), defaultdict(int)
    for src, dst, t in net.log:
        if (t >> control.CALL_BITS) & 0xF >= control.FLOOD_PHASE:
            talks[src].add(dst)
            sends[src] += 1
    for r in range(n):
        assert talks[r] <= control.flood_peers(r, n)
        assert sends[r] <= 2 * len(control.flood_peers(r, n)) * rounds


def test_a_flood_that_cannot_reach_a_rank_in_its_rounds_raises():
    """Rank 5 keeps one flood peer (rank 4), and rank 4 is cut from every rank that would pass
    rank 5's row on in time: ranks that cannot learn every row raise, none returns a wrong
    table."""
    n = 16
    keep = 4
    cut = [(5, q) for q in control.flood_peers(5, n) if q != keep]
    cut += [(keep, q) for q in control.flood_peers(keep, n) if q not in (5, 3)]
    out, _ = run(n, calls=1, before=cut, timeout=3.0, fn=control.flood)
    assert any(isinstance(out[r][0], R2commNetworkError) for r in range(n))
    assert all(np.array_equal(out[r][0], expected(n, 0)) for r in range(n)
               if not isinstance(out[r][0], R2commNetworkError))
