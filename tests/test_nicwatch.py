"""What a rank announces about NICs and pairs, and how it applies the facts to its engine
(r2comm/control/nicwatch.py, issue 39), against a stand-in engine: who speaks for a host, which
evidence makes a NIC fact and which a pair exception, the hysteresis of a flapping NIC, and
that a fact reaches every pair through the NIC, connected or not."""
import pytest

from r2comm.control import facts as F
from r2comm.control import nicwatch


class FakeEngine:
    """What NicWatch asks of an Engine: failures, kernel-free NIC faults, marks (through its
    links and faults, as Engine.links and Engine.faults), events. The state is kept here."""

    def __init__(self, size, nrails=2):
        self.size, self.nrails = size, nrails
        self.down = []                 # [(peer, rail, age, nic_off)]
        self.injected = set()          # rails an injected fault darkens (faults.nic_injected)
        self.rates = [0.0] * nrails
        self.off = {}                  # (peer, rail) -> off
        self.failed_up = []            # (peers, rail): set_nic_off that would fail up rails
        self.events = []
        self.states = {}               # (peer, rail) -> link_state
        self.links = FakeLinks(self)
        self.faults = FakeFaults(self)

    def note_event(self, kind, peer, rail, info, seconds=0.0):
        self.events.append((kind, peer, rail))


class FakeLinks:
    """Engine.links as NicWatch asks it, over the FakeEngine's state."""

    def __init__(self, eng):
        self.eng = eng

    def set_same_host(self, peers):
        self.eng.same = set(peers)

    def down_rails(self):
        return list(self.eng.down)

    def nic_rates(self, nrails):
        return list(self.eng.rates)

    def link_state(self, peer, rail):
        return self.eng.states.get((peer, rail), "up")

    def rails_to(self, peer):
        return self.eng.nrails

    def set_nic_off(self, peers, rail, off, reason, fail_up=True, cause_local=False,
                    idle_only=False):
        for p in peers:
            self.eng.off[(p, rail)] = off
        if off and fail_up:
            self.eng.failed_up.append((sorted(peers), rail))
        return len(peers)


class FakeFaults:
    """Engine.faults as NicWatch asks it, over the FakeEngine's state."""

    def __init__(self, eng):
        self.eng = eng

    def nic_injected(self, k):
        return k in self.eng.injected


def watch(me, host_of, kernel=None, monkeypatch=None, nrails=2):
    eng = FakeEngine(len(host_of), nrails)
    book = F.FactBook(len(host_of), max(host_of) + 1, nrails)
    spreads = []
    w = nicwatch.NicWatch(eng, book, me, host_of, [f"198.18.{k}.{me + 1}" for k in range(nrails)],
                          nrails, spread=lambda: spreads.append(1))
    state = {"kernel": kernel or [1] * nrails}
    monkeypatch.setattr(nicwatch, "_nic_states", lambda addrs: list(state["kernel"]))
    return w, eng, book, state, spreads


HOSTS = [0, 0, 1, 1, 2, 2, 3, 3]


def test_kernel_down_is_announced_at_once_by_the_leader_only(monkeypatch):
    w, eng, book, state, spreads = watch(0, HOSTS, [1, 0], monkeypatch)
    w.evaluate(10.0)
    assert book.level(F.nic_key(0, 1)) == 0 and spreads == [1] and w.announced == 1
    # applied: this host's idle rails towards every other host are off (not failed: its own
    # failed rails stay probed)
    assert all(eng.off[(p, 1)] for p in range(2, 8)) and not eng.failed_up
    assert ("nic_down", 0, 1) in eng.events
    # rank 1 shares the host: the leader (rank 0) speaks for it
    w1, _, book1, _, _ = watch(1, HOSTS, [1, 0], monkeypatch)
    w1.evaluate(10.0)
    assert len(book1) == 0
    # ... unless rank 0 is dead
    w1.dead = lambda: {0}
    w1.evaluate(10.1)
    assert book1.level(F.nic_key(0, 1)) == 0


def test_failures_towards_two_hosts_are_the_nic_one_host_is_a_pair(monkeypatch):
    w, eng, book, state, spreads = watch(0, HOSTS, monkeypatch=monkeypatch)
    eng.down = [(2, 1, 0.6, False), (3, 1, 0.6, False)]         # one other host (host 1)
    w.evaluate(1.0)
    assert not [k for k in book.snapshot()[1] if k[0] == F.NIC]
    eng.down.append((4, 1, 0.6, False))                          # and host 2: the NIC
    w.evaluate(1.1)
    assert book.level(F.nic_key(0, 1)) == 0
    # too fresh (under TRAFFIC_HOLD_S): nothing yet
    w2, eng2, book2, _, _ = watch(0, HOSTS, monkeypatch=monkeypatch)
    eng2.down = [(2, 1, 0.1, False), (4, 1, 0.1, False)]
    w2.evaluate(1.0)
    assert len(book2) == 0
    # failures that another host's NIC fact explains are not this NIC's
    w3, eng3, book3, _, _ = watch(0, HOSTS, monkeypatch=monkeypatch)
    book3.merge({F.nic_key(1, 1): F.Fact(1, 2, 0), F.nic_key(2, 1): F.Fact(1, 4, 0)})
    eng3.down = [(2, 1, 0.6, True), (4, 1, 0.6, False)]
    w3.evaluate(1.0)
    assert book3.level(F.nic_key(0, 1)) == F.FULL


def test_pair_exceptions_by_the_lower_rank(monkeypatch):
    w, eng, book, _, _ = watch(2, HOSTS, monkeypatch=monkeypatch)
    eng.down = [(5, 0, 0.5, False), (0, 1, 5.0, False)]           # (0 < 2: rank 0 speaks)
    w.evaluate(1.0)
    assert len(book) == 0                                         # under PAIR_HOLD_S
    eng.down = [(5, 0, nicwatch.PAIR_HOLD_S, False)]
    w.evaluate(2.0)
    assert book.level(F.pair_key(2, 5, 0)) == 0 and not eng.failed_up   # plans only
    # every rail of a pair down: announced sooner (its traffic must be relayed)
    w2, eng2, book2, _, _ = watch(2, HOSTS, monkeypatch=monkeypatch)
    eng2.down = [(6, 0, nicwatch.PAIR_CUT_HOLD_S, False), (6, 1, nicwatch.PAIR_CUT_HOLD_S, False)]
    w2.evaluate(1.0)
    assert book2.level(F.pair_key(2, 6, 0)) == 0 and book2.level(F.pair_key(2, 6, 1)) == 0
    # the rail comes back: lifted after UP_HOLD_S
    eng2.down = []
    w2.evaluate(2.0)
    assert book2.level(F.pair_key(2, 6, 0)) == 0
    w2.evaluate(2.0 + nicwatch.UP_HOLD_S)
    assert book2.level(F.pair_key(2, 6, 0)) == F.FULL


def test_another_hosts_nic_is_applied_to_every_pair_through_it(monkeypatch):
    w, eng, book, _, _ = watch(0, HOSTS, monkeypatch=monkeypatch)
    book.merge({F.nic_key(3, 0): F.Fact(1, 6, 0)})
    w.apply()
    assert eng.off == {(6, 0): True, (7, 0): True} and eng.failed_up == [([6, 7], 0)]
    book.merge({F.nic_key(3, 0): F.Fact(2, 6, F.FULL)})
    w.apply()
    assert eng.off == {(6, 0): False, (7, 0): False}


def test_a_flapping_nic_is_held_down_longer_each_time(monkeypatch):
    """Each flap within FLAP_WINDOW_S doubles how long the NIC must stay up before it is
    announced up: no storm of plans."""
    w, eng, book, state, _ = watch(0, HOSTS, monkeypatch=monkeypatch)
    t, holds = 100.0, []
    for _ in range(4):
        state["kernel"] = [0, 1]
        w.evaluate(t)
        assert book.level(F.nic_key(0, 0)) == 0
        state["kernel"] = [1, 1]
        t += 0.01
        w.evaluate(t)
        start = t
        while book.level(F.nic_key(0, 0)) == 0:
            t += 0.05
            w.evaluate(t)
            assert t - start < 60
        holds.append(t - start)
        t += 0.5
    assert holds[0] == pytest.approx(nicwatch.UP_HOLD_S, abs=0.06)
    assert all(b > 1.8 * a for a, b in zip(holds, holds[1:])), holds
    assert book.get(F.nic_key(0, 0)).version == 8               # 4 downs, 4 ups


def test_slow_nic_from_live_rates(monkeypatch):
    """Off loopback, a NIC measured well below the host's other NICs for SLOW_HOLD_S is
    announced at that fraction; not at all without another NIC to compare with."""
    w, eng, book, _, _ = watch(0, HOSTS, monkeypatch=monkeypatch, nrails=4)
    w.measure_rates = True
    eng.rates = [1e9, 1e9, 1e9, 0.25e9]
    w.evaluate(1.0)
    assert len(book) == 0
    w.evaluate(1.0 + nicwatch.SLOW_HOLD_S)
    assert book.level(F.nic_key(0, 3)) == F.level_of(0.25)
    eng.rates = [1e9, 1e9, 1e9, 0.9e9]                           # back: up after the hold
    w.evaluate(3.0)
    w.evaluate(3.0 + nicwatch.UP_HOLD_S)
    assert book.level(F.nic_key(0, 3)) == F.FULL
    w2, eng2, book2, _, _ = watch(0, HOSTS, monkeypatch=monkeypatch, nrails=1)
    w2.measure_rates = True
    eng2.rates = [0.1e9]
    w2.evaluate(1.0)
    w2.evaluate(5.0)
    assert len(book2) == 0
