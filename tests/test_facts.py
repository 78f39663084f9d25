"""The NIC facts (r2comm/control/facts.py, issue 39): the table every rank holds, its wire form, and the
plan state it gives; pure functions, no sockets. The multi-rank behaviour is in
tests/test_nic_facts.py."""
import itertools
import random

import pytest

from r2comm.control import facts as F
from r2comm.planner.state import NicRailState

BW = [1.25e9] * 8


def book(size=16, nhosts=4, nrails=8, entries=None):
    return F.FactBook(size, nhosts, nrails, entries)


def test_last_writer_wins_whatever_the_order():
    """Every rank that saw the same announcements holds the same table, whatever order they
    came in (a version per key, ties broken by the announcer)."""
    a = book()
    d1 = a.announce(F.nic_key(2, 3), 0, origin=8)             # down
    a2 = book(entries={F.nic_key(2, 3): d1})
    u = a2.announce(F.nic_key(2, 3), F.FULL, origin=8)        # up again, version 2
    p = a.announce(F.pair_key(5, 1, 0), 0, origin=1)
    assert d1.version == 1 and u.version == 2 and F.pair_key(5, 1, 0) == (F.PAIR, 1, 5, 0)
    news = [{F.nic_key(2, 3): d1}, {F.nic_key(2, 3): u}, {F.pair_key(1, 5, 0): p},
            {F.nic_key(2, 3): F.Fact(2, 3, 0)}]               # a concurrent word: origin 3
    digests = set()
    for order in itertools.permutations(news):
        b = book()
        for n in order:
            b.merge(n)
        digests.add(b.digest())
        assert b.get(F.nic_key(2, 3)) == u                    # (2, 8) beats (2, 3) and (1, 8)
    assert len(digests) == 1 and digests != {0}
    assert book().digest() == 0


def test_announce_only_what_changes():
    b = book()
    assert b.announce(F.nic_key(0, 1), F.FULL, origin=0) is None     # up: no fact needed
    f = b.announce(F.nic_key(0, 1), 0, origin=0)
    assert b.announce(F.nic_key(0, 1), 0, origin=0) is None
    assert b.changes == 1 and b.level(F.nic_key(0, 1)) == 0 and f.version == 1
    assert b.level(F.nic_key(1, 1)) == F.FULL


def test_wire_round_trip_and_validation():
    """decode() takes only what encode() can make, for this job's sizes; everything else is a
    FactError (it crossed a process boundary)."""
    b = book()
    b.announce(F.nic_key(3, 7), 0, origin=12)
    b.announce(F.nic_key(1, 0), 32, origin=4)
    b.announce(F.pair_key(2, 9, 5), 0, origin=2)
    wire = b.encode()
    assert len(wire) == 3 * F.ENTRY.size
    assert book().decode(wire) == b.snapshot()[1]
    bad = [
        wire[:-1],                                            # a partial entry
        F.ENTRY.pack(F.NIC, 4, 0, 0, 1, 0, 0),                # host out of range
        F.ENTRY.pack(F.NIC, 0, 1, 0, 1, 0, 0),                # y must be 0
        F.ENTRY.pack(F.NIC, 0, 0, 8, 1, 0, 0),                # rail out of range
        F.ENTRY.pack(F.PAIR, 5, 5, 0, 1, 0, 0),               # a pair with itself
        F.ENTRY.pack(F.PAIR, 9, 2, 0, 1, 0, 0),               # not a < b
        F.ENTRY.pack(F.PAIR, 2, 16, 0, 1, 0, 0),              # rank out of range
        F.ENTRY.pack(2, 0, 0, 0, 1, 0, 0),                    # unknown kind
        F.ENTRY.pack(F.NIC, 0, 0, 0, 0, 0, 0),                # version 0
        F.ENTRY.pack(F.NIC, 0, 0, 0, 1, 16, 0),               # origin out of range
        F.ENTRY.pack(F.NIC, 0, 0, 0, 1, 0, F.FULL + 1),       # level out of range
        F.ENTRY.pack(F.NIC, 0, 0, 0, 1, 0, 0) * 2,            # a key twice
        b"\0" * F.ENTRY.size * (F.MAX_FACTS + 1),             # too many
    ]
    for payload in bad:
        with pytest.raises(F.FactError):
            book().decode(payload)


def test_decode_fuzz():
    """Random bytes and mutated tables: decode() returns a valid table or raises FactError,
    nothing else (no other exception, nothing out of range)."""
    rng = random.Random(5)
    b = book(size=64, nhosts=8, nrails=4)
    for k in range(4):
        b.announce(F.nic_key(k, k), 0, origin=k)
        b.announce(F.pair_key(k, 40 + k, k), 0, origin=k)
    base = bytearray(b.encode())
    for i in range(3000):
        if i % 2:
            payload = bytes(rng.randrange(256) for _ in range(rng.choice([21, 42, 5, 63])))
        else:
            payload = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                payload[rng.randrange(len(payload))] = rng.randrange(256)
            payload = bytes(payload)
        try:
            got = b.decode(payload)
        except F.FactError:
            continue
        for key, f in got.items():
            b.check_key(key)
            assert 0 < f.version and f.origin < 64 and 0 <= f.level <= F.FULL


def test_plan_state_from_facts():
    """A NIC down is one entry whatever the size; its host is degraded by exactly 1/8 (tol 0.02,
    not the measurement noise); pair exceptions travel as a list; no fact, no state."""
    host_of = [r // 8 for r in range(64)]                     # 8 hosts x 8 ranks
    members = list(range(64))
    assert F.plan_state({}, host_of, members, 8, BW, 8e9) is None
    down = {F.nic_key(5, 3): F.Fact(1, 40, 0)}
    st = F.plan_state(down, host_of, members, 8, BW, 8e9)
    assert isinstance(st, NicRailState) and not st.exceptions and not st.link
    assert st.nic_bw(5, 3) == 0 and st.nic_bw(4, 3) == BW[3]
    assert st.degraded_hosts() == [5] and st.host_bw(5) == pytest.approx(7 / 8 * st.host_bw(0))
    assert F.rails_up(down, 5, 8) == 7 and F.rails_up(down, 4, 8) == 8
    half = {F.nic_key(2, 0): F.Fact(1, 16, F.FULL // 2)}
    st = F.plan_state(half, host_of, members, 8, BW, 8e9)
    assert st.nic_bw(2, 0) == BW[0] / 2 and st.degraded_hosts() == [2]
    pair = {F.pair_key(3, 17, 1): F.Fact(1, 3, 0)}
    st = F.plan_state(pair, host_of, members, 8, BW, 8e9)
    assert st.exceptions == {(3, 17, 1): (False, 0.0)} and st.rail_bw(3, 17, 1) == 0
    assert not st.broken_pairs()
    # a sub-communicator sees only its members' hosts and pairs, renumbered
    sub = [17, 3, 40, 41]
    st = F.plan_state({**pair, **down}, host_of, sub, 8, BW, 8e9)
    assert st.hosts == [2, 0, 5, 5] and st.exceptions == {(0, 1, 1): (False, 0.0)}
    assert st.degraded_ranks() == [2, 3]
    # a fact that no member is concerned with gives no state
    assert F.plan_state({F.nic_key(7, 0): F.Fact(1, 56, 0)}, host_of, sub, 8, BW, 8e9) is None
    # an UP fact (kept as a tombstone) holds against nothing
    assert F.plan_state({F.nic_key(5, 3): F.Fact(2, 40, F.FULL)}, host_of, members, 8, BW,
                        8e9) is None


def test_plan_state_never_partitions():
    """Facts that cut the ranks in groups cannot all hold while the job runs (an UP lags its
    hold time): no plan follows them (None: the static plans), at small and large n."""
    for nhosts, per in ((4, 1), (512, 8)):
        host_of = [r // per for r in range(nhosts * per)]
        members = list(range(len(host_of)))
        # host 0 keeps only NIC 1, every other host only NIC 0: host 0 is cut off
        cut = {F.nic_key(0, 0): F.Fact(1, 0, 0),
               **{F.nic_key(h, 1): F.Fact(1, h * per, 0) for h in range(1, nhosts)}}
        assert F.plan_state(cut, host_of, members, 2, BW[:2], 8e9) is None
        # relayable: hosts 0 and 1 share no NIC, but each shares one with the others
        relay = {F.nic_key(0, 0): F.Fact(1, 0, 0), F.nic_key(1, 1): F.Fact(1, per, 0)}
        st = F.plan_state(relay, host_of, members, 3, BW[:3], 8e9)
        assert st is not None and not F.splits(st)


def test_localise():
    """Failures towards ranks of two or more other hosts are the NIC's; of one other host, pair
    exceptions (that host's own NIC, or a path: its owner decides); within a host, pairs."""
    host_of = [0, 0, 1, 1, 2, 2, 3, 3]
    nics, pairs = F.localise({(0, 2, 1), (0, 4, 1)}, host_of)
    assert nics == {F.nic_key(0, 1)} and not pairs
    nics, pairs = F.localise({(0, 2, 1), (0, 3, 1)}, host_of)     # one other host only
    assert not nics and pairs == {F.pair_key(0, 2, 1), F.pair_key(0, 3, 1)}
    nics, pairs = F.localise({(0, 1, 0)}, host_of)
    assert not nics and pairs == {F.pair_key(0, 1, 0)}
    # a pair that a NIC fact explains adds no exception
    nics, pairs = F.localise({(0, 2, 1), (0, 4, 1), (2, 0, 1), (6, 7, 1)}, host_of)
    assert nics == {F.nic_key(0, 1)} and pairs == {F.pair_key(6, 7, 1)}


def test_probe_facts():
    """The start-up probe's NIC rates (the same on every rank) give the slow NICs of the start:
    a host's NIC is the best of its ranks'; one below half its rail's median is slow."""
    host_of = [0, 0, 1, 1, 2, 2]
    gb = 125e6
    rates = [[gb, gb], [gb * 0.9, 0], [gb * 1.1, gb * 0.8], [0, gb], [gb, gb / 10], [0, 0]]
    got, typical = F.probe_facts(rates, host_of)
    assert got == {F.nic_key(2, 1): F.Fact(1, 4, F.level_of(0.1))}
    assert typical == [gb * 1.1, gb] or typical[1] == gb
    assert F.probe_facts([[0, 0]] * 6, host_of)[0] == {}


def test_fact_hosts():
    assert F.fact_hosts([0, 0, 0]) == [0, 1, 2]           # one machine: a rank is a "host"
    assert F.fact_hosts([0, 0, 1]) == [0, 0, 1]
