"""The Bcast/Reduce call agreement (plans.agreement, issue 31): a binary tree over rank order,
fan-in then fan-out. Checked on the schedules themselves: bounded peers per rank whatever n,
every send matched by the peer's receive, and every rank's call ends only after a chain from
every rank's frame reached it (nobody leaves before all arrived)."""
import pytest

from r2comm.front import plans
from r2comm.planner.state import RailState


def _peers(rank, n):
    msgs, _ = plans.agreement(rank, n, 0)
    return {m[1] for m in msgs}


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 33, 1024])
def test_each_rank_exchanges_with_at_most_three_peers(n):
    for r in range(n):
        peers = _peers(r, n)
        assert r not in peers and len(peers) <= 3, (r, peers)
        assert peers == {p for p in range(n) if r in _peers(p, n)}      # symmetric


def _ends_after(n):
    """For each rank, the ranks whose first frame causally precedes all of its messages."""
    sched = [plans.agreement(r, n, 0) for r in range(n)]
    sends = {}
    for r, (msgs, _) in enumerate(sched):
        for i, m in enumerate(msgs):
            if m[0] == "send":
                key = (r, m[1], m[2])
                assert key not in sends and m[5] == 0
                sends[key] = (r, i)
    matched = set()
    preds = {}                                  # (rank, msg) -> messages it waits for
    for r, (msgs, deps) in enumerate(sched):
        for i, m in enumerate(msgs):
            preds[(r, i)] = [(r, a) for a, b in deps if b == i]
            if m[0] == "recv":
                src = sends[(m[1], r, m[2])]
                matched.add(src)
                preds[(r, i)].append(src)
    assert matched == set(sends.values())       # every send has its receive
    memo = {}

    def origins(node):
        if node not in memo:
            memo[node] = {node[0]}.union(*[origins(p) for p in preds[node]])
        return memo[node]

    return [set().union(*[origins((r, i)) for i in range(len(sched[r][0]))]) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 13, 16, 32])
def test_no_rank_ends_before_every_rank_arrived(n):
    assert all(got == set(range(n)) for got in _ends_after(n))


def test_dependent_steps_are_twice_the_depth():
    n, depth = 16, 4                             # rank 15 is 4 levels below rank 0
    msgs, deps = plans.agreement(15, n, 0)
    assert [m[0] for m in msgs] == ["send", "recv"] and not deps
    msgs, deps = plans.agreement(0, n, 100)
    assert [m[0] for m in msgs] == ["recv", "recv", "send", "send"]
    assert sorted(deps) == [(100, 102), (100, 103), (101, 102), (101, 103)]
    assert depth == (n - 1).bit_length()


def test_reachable_only_when_every_tree_pair_works():
    """A broken pair outside the tree leaves the agreement on; a broken tree pair skips it."""
    state = RailState.uniform(8, 2)
    assert plans._agreement_reachable(state, 8) and plans._agreement_reachable(None, 8)
    off_tree = state.copy()
    off_tree.break_pair(3, 4)                   # 3 and 4 are not parent and child
    assert plans._agreement_reachable(off_tree, 8)
    on_tree = state.copy()
    on_tree.break_pair(3, 1)                    # 3's parent is 1
    assert not plans._agreement_reachable(on_tree, 8)


@pytest.mark.parametrize("n", [2, 5, 8, 9, 16, 33, 1024])
def test_control_allgather_exchanges_with_at_most_four_peers(n):
    """The control plane's allgather (control.py: two trees, 2 messages per tree peer; up to
    7 ranks the flood): at most 4 peers per rank from 8 ranks on, symmetric, and from 8 ranks
    on never every peer. Its messages on a run: tests/test_control_tree.py."""
    from r2comm.control import tree as control
    peers = [control.tree_peers(r, n) for r in range(n)]
    for r in range(n):
        assert r not in peers[r] and len(peers[r]) <= (4 if n > control.FLOOD_MAX else 6)
        assert all(r in peers[p] for p in peers[r])
