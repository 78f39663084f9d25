"""Start-up bandwidth probe: each rank times each rail against its ring neighbours, both
directions at once, so a NIC's rate costs O(1) messages per rank (issue 31), not n - 1.

Run once by Communicator construction (R2COMM_PROBE bytes per probe message; 0 disables it), on
the communicator's control plane (its own communicator id, so it shares no sequence numbers or
tags with the application). The result seeds the engine's measured rate of every (peer, rail)
(Engine.tuning.set_rail_rate): the striping uses it from the first operation on, the acknowledgements
refine it online, and RailState (planner/state.py) reads it through rail_stats() row[7].

What it means. A rank's send rate to a partner on rail k is bounded by its own NIC k and the
partner's; the larger of its (one or two) partners' figures is its NIC k's rate (nic_rates).
The ranks exchange those (one row per rank), and every (peer, rail) the probe did not time is
seeded with min(this rank's NIC, the peer's NIC), the rate a transfer between the two NICs
can reach: the striping and RailState's per-rail weights get a figure for every pair, as when
every pair was timed.

Schedule. The ring's edges (i, i+1) meet in two rounds (three for odd n), every rank in at
most one pair per round (ring_rounds). In a round
the rails are timed one after the other (a pinned message waits for its rail, and one pair's
messages share one queue, so two rails of one pair timed at once would serialise), every pair of
the round at the same time, each rank sending to its partner while the partner sends back. When
all ranks are on one machine (one host name: loopback rails, the netns testbed) the pairs of a
round go one at a time instead: concurrent pairs there would measure how they share the CPUs,
not the rails. A barrier on the control plane starts every (slot, rail).

One measurement (a rank's rail k towards its partner) is `1 + reps` messages pinned to rail k,
back to back, each timed from posting to completion (its last chunk acknowledged):
  warm-up  nbytes: opens the TCP window and drains a shaper's token bucket (the netns
           testbed's tbf lets ~4 ms of line rate through at once), so that the messages that
           count see the steady rate; its time t_w also bounds the rest;
  reps     nbytes each (fewer bytes when t_w > MAX_MSG_S, so a slow rail takes about
           reps * MAX_MSG_S): the rate is the best of them (interference on shared CPUs only
           ever slows a transfer down, so the maximum is the least noisy figure).
Only messages above the eager limit are timed (an eager send completes before it is
acknowledged).

Bounded time: once a rank has spent BUDGET_S in the probe it sends 1-byte placeholders for the
rest (those rails stay unmeasured: rate 0, so the planner falls back to R2COMM_RAIL_BW for them).
Receivers post every receive with room for nbytes, so the sender alone decides the sizes and no
agreement is needed. A rail that is down is not timed (placeholder, unpinned)."""
import time

import numpy as np

MAX_MSG_S = 0.05           # a timed message takes at most about this long (slow rails: fewer bytes)
REPS = 2                   # timed messages per measurement after the warm-up (the best counts)
BUDGET_S = 2.0             # seconds a rank spends in the probe before it stops measuring
TAG0 = 0x51000000          # tags of probe messages (on the control plane's own communicator)


def rounds(n):
    """Round-robin tournament: a list of rounds, each a list of disjoint pairs (a, b), a < b;
    every pair of 0..n-1 appears exactly once."""
    if n < 2:
        return []
    ranks = list(range(n)) + ([None] if n % 2 else [])
    m = len(ranks)
    out = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = ranks[i], ranks[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        out.append(sorted(pairs))
        ranks = [ranks[0], ranks[-1]] + ranks[1:-1]
    return out


class ProbeResult:
    """What the probe measured on this rank: rates[(peer, rail)] = bytes/s of this rank's
    sends on `rail` to `peer` (communicator ranks), and how long it took."""

    def __init__(self, rates, seconds, nbytes, skipped):
        self.rates = rates
        self.seconds = seconds
        self.nbytes = nbytes
        self.skipped = skipped            # (peer, rail) left unmeasured (down or over budget)
        self.nic_rates = []               # per rail: this rank's NIC (set by the communicator)

    def __repr__(self):
        return (f"ProbeResult({len(self.rates)} rails measured in {self.seconds * 1e3:.1f} ms, "
                f"{len(self.skipped)} skipped)")


def ring_rounds(n):
    """The ring's edges (i, (i + 1) % n) as pairs (a, b), a < b, in rounds of disjoint pairs:
    two rounds for even n, three for odd n (the closing edge alone), one edge for n = 2."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    even = [(i, i + 1) for i in range(0, n - 1, 2)]
    odd = [(i, i + 1) for i in range(1, n - 1, 2)]
    closing = [(0, n - 1)]
    if n % 2 == 0:
        return [even, sorted(odd + closing)]
    return [even, odd, closing]


def partners(n, me):
    """The ranks this rank's rails are timed against: its ring neighbours."""
    return sorted({(me - 1) % n, (me + 1) % n} - {me}) if n > 1 else []


def slots(n, hosts=None):
    """The pairs that are timed together, slot after slot: the rounds of ring_rounds(n); but
    when every rank is on one machine (loopback rails, or the netns testbed: one host name),
    one pair at a time, since concurrent pairs would only measure how they share the CPUs."""
    rr = ring_rounds(n)
    if hosts is not None and n > 2 and len(set(hosts)) == 1:
        return [[p] for rnd in rr for p in rnd]
    return rr


def run(comm, nbytes, rail_up, nrails, eager, timeout=30.0, reps=REPS, max_msg_s=MAX_MSG_S,
        budget_s=BUDGET_S, hosts=None, max_rails=None, reachable=None):
    """Probe every rail to the ring neighbours of `comm` (collective: every rank calls it).

    comm: a Channel (the control plane, tree.plane), rail_up(peer, rail) -> bool, nrails(peer) ->
    rails towards that peer, eager: the eager limit (timed messages must be larger), hosts:
    each rank's host name (slots()), max_rails: the most rails any rank has (it sets the
    number of barriers, so it must be the same on every rank, as must nbytes), reachable(peer)
    -> False for a pair with no common rail at start-up (not probed; the same on both ends).
    Returns a ProbeResult; the caller seeds the engine with it."""
    n, me = comm.size, comm.rank
    t_start = time.perf_counter()
    smallest = min(eager + 4096, nbytes)
    sbuf = np.ones(nbytes, np.uint8)          # written, so no page faults while timed
    rbufs = [np.ones(nbytes, np.uint8) for _ in range(1 + reps)]
    rates, skipped = {}, []
    maxr = max((nrails(p) for p in range(n) if p != me), default=0) if max_rails is None \
        else max_rails
    for rnd in slots(n, hosts):
        partner = None
        for a, b in rnd:
            if me in (a, b):
                partner = b if me == a else a
        for k in range(maxr):
            comm.barrier()
            if partner is None or k >= nrails(partner) or \
                    (reachable is not None and not reachable(partner)):
                continue
            tag = TAG0 + (k << 8)
            recvs = [comm.message("recv", rbufs[i], partner, tag + i) for i in range(1 + reps)]
            measure = rail_up(partner, k) and time.perf_counter() - t_start < budget_s
            best, size = 0.0, nbytes
            for i in range(1 + reps):
                if not measure:
                    comm.message("send", sbuf[:1], partner, tag + i).Wait(timeout)
                    continue
                t = time.perf_counter()
                comm.message("send", sbuf[:size], partner, tag + i, rail=k).Wait(timeout)
                dt = max(time.perf_counter() - t, 1e-9)
                if i == 0:                        # the warm-up: sizes the rest
                    if dt > max_msg_s:
                        size = max(int(nbytes * max_msg_s / dt), smallest)
                else:
                    best = max(best, size / dt)
                measure = time.perf_counter() - t_start < budget_s
            for rq in recvs:
                rq.Wait(timeout)
            if best > 0 and rail_up(partner, k):
                rates[(partner, k)] = best
            else:
                skipped.append((partner, k))
    comm.barrier()
    return ProbeResult(rates, time.perf_counter() - t_start, nbytes, skipped)


def nic_rates(res, nrails):
    """This rank's NIC rates from a ProbeResult: per rail, the best rate to a partner (0 where
    none was measured)."""
    return [max((v for (p, k), v in res.rates.items() if k == rail), default=0.0)
            for rail in range(nrails)]


def pair_rate(mine, theirs, rail):
    """The rate a transfer from a NIC measured at `mine` to one at `theirs` (per-rail lists)
    can reach on `rail`: the slower of the two (0: one of them unmeasured)."""
    a = mine[rail] if rail < len(mine) else 0.0
    b = theirs[rail] if rail < len(theirs) else 0.0
    return min(a, b) if a > 0 and b > 0 else 0.0
