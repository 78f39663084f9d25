"""What the ranks know about NICs, as facts about (host, NIC) and a short list of pair exceptions
(issue 39), and the plan state they give.

A fact is one key and its value:
  (NIC, host, 0, rail)   the host's NIC `rail` (every rank of that host lists its host's NICs at
                         the same rail index): level 0 down, FULL up at its rate, in between a
                         NIC at level/FULL of its rate;
  (PAIR, a, b, rail)     rail `rail` between world ranks a < b when neither end's NIC explains
                         it (a path fault): level 0 down, FULL up again.
Values are (version, origin, level); the one with the highest (version, origin) wins, so every
rank that has seen the same announcements holds the same table whatever order they came in
(last writer wins per key; a rank announces a key at one more than the version it holds). Keys
are never removed: an UP fact is kept, so an older DOWN that arrives late loses to it.

The table is O(facts), never O(ranks): a NIC failure is one entry whatever the job's size. It
travels whole (encode/decode: 21 bytes a fact, validated on arrival) in the failure detector's
frames (control/liveness.py), and its digest rides in every heartbeat, so a rank that missed
an announcement gets the table from a ring neighbour a period later.

plan_state() turns a table into the planner's NicRailState of a communicator's ranks (or None
when no fact holds against them: the static plans are right). A NIC announced down or at a
fraction of its rate makes its host degraded by exactly that fraction (degraded_tol 0.02, not
the measurement noise: measurements are the announcer's business, not the planner's).
startup_facts() derives the facts of the agreed start-up table (startup.py): a rail that did not
connect is a NIC fact where the kernel said the NIC is down or its failures reach two or more
other hosts, otherwise a pair exception."""
import hashlib
import struct
import threading
from typing import NamedTuple

NIC, PAIR = 0, 1
FULL = 64                      # the level of a NIC at its full rate (0: down)
ENTRY = struct.Struct("!BIIHIIH")   # kind, x, y, rail, version, origin, level
MAX_FACTS = 3000               # a table fits one detector frame (64 KiB)
MAX_VERSION = (1 << 31) - 1
DEGRADED_TOL = 0.02            # planner.state.RailState.degraded_tol of a state from facts
DIGEST_BITS = 52               # digests travel as float64 (the control plane's rows)


class FactError(ValueError):
    """A facts payload that fails its checks (it crossed a process boundary)."""


class Fact(NamedTuple):
    version: int
    origin: int                # the world rank that announced it
    level: int                 # 0 .. FULL


def nic_key(host, rail):
    return (NIC, int(host), 0, int(rail))


def pair_key(a, b, rail):
    a, b = int(a), int(b)
    return (PAIR, min(a, b), max(a, b), int(rail))


def level_of(fraction):
    """A rate fraction as a level (0 .. FULL, rounded down; a NIC that is up never reads 0)."""
    if fraction <= 0:
        return 0
    return max(1, min(FULL, int(fraction * FULL)))


class FactBook:
    """The facts this rank holds (thread-safe). size: world ranks; nhosts: hosts; nrails: the
    most rails a rank lists (bounds for what arrives)."""

    def __init__(self, size, nhosts, nrails, entries=None):
        self.size, self.nhosts, self.nrails = int(size), int(nhosts), int(nrails)
        self._entries = {}
        self._digest = None
        self.changes = 0                      # local count of changes (waiters compare it)
        self.cond = threading.Condition()
        if entries:
            self.merge(entries)

    # -- reading ---------------------------------------------------------------------------------
    def get(self, key):
        with self.cond:
            return self._entries.get(key)

    def level(self, key):
        """The key's level (FULL when no fact names it)."""
        f = self.get(key)
        return FULL if f is None else f.level

    def snapshot(self):
        """(digest, {key: Fact}) at one instant."""
        with self.cond:
            return self._digest_locked(), dict(self._entries)

    def digest(self):
        with self.cond:
            return self._digest_locked()

    def _digest_locked(self):
        if self._digest is None:
            self._digest = digest_of(self._entries)
        return self._digest

    def __len__(self):
        return len(self._entries)

    # -- writing ---------------------------------------------------------------------------------
    def announce(self, key, level, origin):
        """Set `key` to `level` as rank `origin`'s new word (a version above the one held):
        the Fact, or None when the table already says so."""
        self.check_key(key)
        if not 0 <= level <= FULL:
            raise ValueError(f"level {level} out of range")
        with self.cond:
            old = self._entries.get(key)
            if old is not None and old.level == level:
                return None
            if old is None and level == FULL:
                return None                     # no fact: up at full rate already
            if old is None and len(self._entries) >= MAX_FACTS:
                raise FactError(f"the facts table holds {MAX_FACTS} facts already")
            fact = Fact(1 if old is None else min(old.version + 1, MAX_VERSION), origin, level)
            self._put(key, fact)
            return fact

    def merge(self, entries):
        """Take what `entries` ({key: Fact}, validated) knows newer; the keys that changed."""
        changed = []
        with self.cond:
            for key, fact in entries.items():
                old = self._entries.get(key)
                if old is None and len(self._entries) >= MAX_FACTS:
                    continue
                if old is None or (fact.version, fact.origin) > (old.version, old.origin):
                    if old is None or old != fact:
                        self._put(key, fact)
                        changed.append(key)
        return changed

    def _put(self, key, fact):
        self._entries[key] = fact
        self._digest = None
        self.changes += 1
        self.cond.notify_all()

    def wait_change(self, seen, timeout):
        """Wait until `changes` passes `seen` (at most `timeout` s); the count then."""
        with self.cond:
            if self.changes == seen:
                self.cond.wait(timeout)
            return self.changes

    # -- the wire --------------------------------------------------------------------------------
    def check_key(self, key):
        kind, x, y, k = key
        if kind == NIC:
            ok = 0 <= x < self.nhosts and y == 0 and 0 <= k < self.nrails
        elif kind == PAIR:
            ok = 0 <= x < y < self.size and 0 <= k < self.nrails
        else:
            ok = False
        if not ok:
            raise FactError(f"a fact key out of range: {key}")

    def encode(self):
        with self.cond:
            items = sorted(self._entries.items())
        return b"".join(ENTRY.pack(*key, *fact) for key, fact in items)

    def decode(self, payload):
        """A received table, validated: {key: Fact}. Raises FactError."""
        if len(payload) % ENTRY.size or len(payload) // ENTRY.size > MAX_FACTS:
            raise FactError(f"a facts payload of {len(payload)} bytes")
        out = {}
        for off in range(0, len(payload), ENTRY.size):
            kind, x, y, k, version, origin, level = ENTRY.unpack_from(payload, off)
            key = (kind, x, y, k)
            self.check_key(key)
            if not (0 < version <= MAX_VERSION and origin < self.size and level <= FULL):
                raise FactError(f"a fact out of range: {key} {(version, origin, level)}")
            if key in out:
                raise FactError(f"a facts payload names {key} twice")
            out[key] = Fact(version, origin, level)
        return out


def digest_of(entries):
    """A 52-bit digest of a table (0 for the empty one): equal tables, equal digests."""
    if not entries:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for key, fact in sorted(entries.items()):
        h.update(ENTRY.pack(*key, *fact))
    return int.from_bytes(h.digest(), "big") & ((1 << DIGEST_BITS) - 1)


def active(entries):
    """The facts that hold against a NIC or pair (level below FULL)."""
    return {key: f for key, f in entries.items() if f.level < FULL}


def plan_state(entries, host_of, members, nrails, rail_bw, intra_bw, always=False, **kw):
    """The planner's NicRailState of the world ranks `members` (communicator order) from a facts
    table, or None when no fact holds against them (unless `always`). host_of: the world host
    index of every world rank; rail_bw[k]: rail k's figure in bytes/s when up at full rate;
    intra_bw: a pair of one host."""
    from ..planner.state import NicRailState
    facts = active(entries)
    if not facts and not always:
        return None
    hosts = [host_of[g] for g in members]
    present = set(hosts)
    index = {g: i for i, g in enumerate(members)}
    nic_facts = {(x, k): f.level for (kind, x, _, k), f in facts.items()
                 if kind == NIC and x in present}
    exc = {}
    for (kind, a, b, k), f in facts.items():
        if kind == PAIR and a in index and b in index and k < nrails:
            ca, cb = index[a], index[b]
            exc[(min(ca, cb), max(ca, cb), k)] = (f.level > 0, rail_bw[k] * f.level / FULL)
    if not nic_facts and not exc and not always:
        return None
    order = list(dict.fromkeys(hosts))            # hosts in order of their first member
    full = [float(rail_bw[k]) for k in range(nrails)]
    hit = {h for h, _ in nic_facts}
    nic = [[rail_bw[k] * nic_facts.get((h, k), FULL) / FULL for k in range(nrails)]
           if h in hit else full[:] for h in order]
    kw.setdefault("degraded_tol", DEGRADED_TOL)
    st = NicRailState(hosts, nic, intra_bw, exceptions=exc, **kw)
    if st.has_broken_pairs() and splits(st):
        # facts that leave no path between some ranks cannot all hold while they still run
        # (a NIC announced up again lags behind it, UP_HOLD_S): no plan can follow them; the
        # static plans do, and the engine raises where a pair really is cut off
        return None
    return st


DENSE_SPLIT_MAX = 256          # ranks: splits() checks every pair up to here


def splits(st):
    """The working pairs of NicRailState `st` leave the ranks in more than one group. Up to
    DENSE_SPLIT_MAX ranks every pair is looked at; above, hosts (one group each, their ranks
    share the host's links) are joined where their NIC sets meet: O(distinct NIC sets^2)."""
    if st.n <= DENSE_SPLIT_MAX:
        return st.partitioned()
    masks = [sum(1 << k for k, v in enumerate(row) if v > 0) for row in st.nic]
    kinds = sorted(set(masks))
    if 0 in kinds and len(masks) > 1:
        return True
    group = {m: m for m in kinds}

    def find(m):
        while group[m] != m:
            group[m] = group[group[m]]
            m = group[m]
        return m
    for i, a in enumerate(kinds):
        for b in kinds[i + 1:]:
            if a & b:
                group[find(a)] = find(b)
    return len({find(m) for m in kinds}) > 1


def fact_hosts(host_of):
    """The host index facts use for every rank: its host's, or, where every rank runs on one
    host (a test machine), its own (NIC loss then still shows as a slow "host", as the planner
    has always treated one machine's loopback rails)."""
    host_of = list(host_of)
    return host_of if len(set(host_of)) > 1 else list(range(len(host_of)))


def rails_up(entries, host, nrails):
    """How many of `host`'s NICs no fact holds down."""
    return sum(1 for k in range(nrails)
               if (entries.get(nic_key(host, k)) or Fact(0, 0, FULL)).level > 0)


def localise(failures, host_of, at_least=2):
    """Where failed rails point: failures {(a, b, rail)} (world ranks, a on the side judged) ->
    (NIC keys, pair keys). Rank a's NIC `rail` is down where a's failures on that rail reach
    peers on `at_least` distinct other hosts; the rest are pair exceptions, except a pair
    that a NIC key of either end explains. Pairs within one host are never a NIC's (their bytes
    do not leave the host): their failures are pair exceptions."""
    reach = {}
    for a, b, k in failures:
        if host_of[a] != host_of[b]:
            reach.setdefault((host_of[a], k), set()).add(host_of[b])
    nics = {nic_key(h, k) for (h, k), others in reach.items() if len(others) >= at_least}
    pairs = set()
    for a, b, k in failures:
        if nic_key(host_of[a], k) in nics or nic_key(host_of[b], k) in nics:
            continue
        pairs.add(pair_key(a, b, k))
    return nics, pairs


PROBE_NOISE = 0.5              # the start-up probe's spread between equal NICs (one short
                               # transfer each: up to ~2x in the netns testbed, tests/test_probe)


def probe_facts(nic_rates, host_of, noise=PROBE_NOISE):
    """The slow NICs that the start-up bandwidth probe measured, the same on every rank:
    nic_rates[r] = rank r's best measured rate per rail (0: none), as every rank received
    them. A host's NIC is the best of its ranks' figures; rail k's typical figure the median
    over hosts; a NIC below (1 - noise) of it is announced at that fraction (origin: the
    host's lowest rank). -> ({key: Fact}, typical figure per rail)."""
    best = {}
    for r, rates in enumerate(nic_rates):
        for k, v in enumerate(rates):
            if v > 0:
                key = (host_of[r], k)
                if v > best.get(key, (0.0, r))[0]:
                    best[key] = (float(v), r)
    nrails = max((len(x) for x in nic_rates), default=0)
    typical = []
    for k in range(nrails):
        vals = sorted(v for (h, kk), (v, _) in best.items() if kk == k)
        typical.append(vals[len(vals) // 2] if vals else 0.0)
    out = {}
    for (h, k), (v, _) in sorted(best.items()):
        if typical[k] > 0 and v < (1 - noise) * typical[k]:
            origin = min(r for r, x in enumerate(host_of) if x == h)
            out[nic_key(h, k)] = Fact(1, origin, level_of(v / typical[k]))
    return out, typical


def startup_facts(failed, host_of, kernel_down, nrails):
    """The facts of the agreed start-up table, the same on every rank: failed {(a, b, rail):
    why} (a < b, data rails), kernel_down {rank: rails its kernel reported down}, nrails: the
    most rails a rank lists (a pair of one host has one link, shared memory or loopback: its
    failure breaks the pair on every rail). Returns {key: Fact}, versions 1, origin the lower
    rank of the failure (the reporting rank for a kernel report)."""
    out = {}
    for r in sorted(kernel_down):
        for k in kernel_down[r]:
            key = nic_key(host_of[r], k)
            if key not in out:
                out[key] = Fact(1, r, 0)
    sides = set()
    local = []
    for (a, b, k) in failed:
        if host_of[a] == host_of[b]:
            local.append((a, b))
            continue
        if nic_key(host_of[a], k) in out or nic_key(host_of[b], k) in out:
            continue
        sides.add((a, b, k))
        sides.add((b, a, k))
    nics, pairs = localise(sides, host_of)
    for key in sorted(nics):
        origin = min(a for a, b, k in sides if nic_key(host_of[a], k) == key)
        out[key] = Fact(1, origin, 0)
    for key in sorted(pairs):
        out[key] = Fact(1, key[1], 0)
    for a, b in sorted(set(local)):
        for k in range(nrails):
            out[pair_key(a, b, k)] = Fact(1, min(a, b), 0)
    return out
