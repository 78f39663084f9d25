"""comm.rails from the engine's per-peer rail rows (rails.rail_stats / rails.summarize): named
rows that still read positionally, and the per-NIC summary over remote peers."""
from types import SimpleNamespace

from r2comm.transport.rails import RailStats, rail_stats, summarize


class FakeEngine:
    def __init__(self, rows):
        self.rows = rows

    def rail_stats(self):
        return self.rows


def row(state, sent, failures=0, weight=1.0, hedged=0):
    return (state, sent, sent // 2, sent // 10, 0, weight, failures, 5e8, hedged)


def test_rows_are_named_and_still_positional():
    stats = rail_stats(FakeEngine({1: [row("up", 100, weight=0.75)], 2: [row("down", 40, failures=3)]}))
    first = stats[1][0]
    assert isinstance(first, RailStats) and first.state == "up" and first.weight == 0.75
    assert first[5] == 0.75 and first[7] == first.rate == 5e8        # positional readers (planner)
    assert stats[2][0].failures == 3 and stats[2][0][6] == 3


def test_summary_per_nic_over_the_given_peers():
    stats = rail_stats(FakeEngine({
        1: [row("up", 100, weight=0.6), row("up", 50, hedged=7)],
        2: [row("down", 40, failures=2), row("up", 60)],
        3: [row("down", 1000, failures=9), row("down", 1000)],        # not a NIC peer: left out
    }))
    dev = SimpleNamespace(describe=lambda: "rxe0:1")
    r0, r1 = summarize(stats, [1, 2], ["198.18.0.1", "198.18.1.1"], "verbs", [dev, dev])
    assert (r0.index, r0.address, r0.state, r0.weight) == (0, "198.18.0.1", "degraded", 0.6)
    assert (r0.bytes_sent, r0.bytes_recv, r0.bytes_resent) == (140, 70, 14)
    assert (r0.failures, r0.peers_up, r0.peers) == (2, 1, 2)
    assert (r1.state, r1.bytes_hedged, r1.transport, r1.device) == ("up", 7, "verbs", "rxe0:1")
    down, = summarize(stats, [3], ["198.18.0.1"], "tcp", [])
    assert (down.state, down.peers_up, down.device) == ("down", 0, "")
    alone, = summarize(stats, [], ["127.0.0.1"], "tcp", [])          # no NIC peer: up, weight 1
    assert (alone.state, alone.weight, alone.peers) == ("up", 1.0, 0)
