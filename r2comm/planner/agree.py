"""Agreeing on the rail state with traffic that grows with the changes, not with n^2.

Each rank summarises what its engine reports about its own rails (rail_stats(), as
RailState.gather's `mine`: {peer: [(state, weight, rate), ...] per rail}) as

  a fixed row, per rail k and per peer class (peers on other hosts / on its own host):
      the class's usual (state, weight, measured) triple (a NIC fact: a NIC down shows as
      "down" towards nearly every peer) and one rate: the best measured rate of the class
      ("nic" and "declared" modes: all the "nic" model uses) or the upper median of
      rate / relative bandwidth ("scale" mode);
  plus its exceptions: the (peer, rail) entries whose triple differs from their class's
      (a pair whose rail is down while the NIC is fine, a peer not yet measured, ...), and in
      "nic" mode the slow pairs towards other hosts (a measured rate below (1 - noise) x the
      class's best, state.is_slow), which carry that rate.

So a rank contributes O(K) numbers plus EXC_FIELDS per exception, whatever the number of ranks
(row_size()): a NIC that slows down adds, on each rank of another host that measured it slow,
one exception per rank behind that NIC, as a NIC that goes down does. rebuild() turns every rank's
summary back into per-rank stats that RailState.from_rail_stats() reads: every entry gets its
class's triple (or its exception's) and its class's rate (a slow pair its own rate). In "nic"
and "declared" mode that gives exactly the state of the dense gather (the "nic" model reads
only each NIC's best rate per class, which peers it measured fast, the slow pairs' rates and
the counts: step 1b in state.py); in "scale" mode the
overall scale is the median over the (rank, rail, class) medians instead of over every
measurement (it only sets the units of every link). direct_state() computes the same compact
state from the summaries without going over every pair (O(n·K·(ranks per host + exceptions)));
rebuild() + from_rail_stats() + compact() is the fall-back where it does not apply."""
import numpy as np

from .state import (DEFAULT_BW, MEASURE_NOISE, NicRailState, RailState, is_slow, nic_figures,
                    own_rows, reported_nic)

FIELDS = 4                  # per (class, rail): state (1 up, 0 down, -1 no such rail), weight,
                            # measured (1/0), rate
EXC_FIELDS = 6              # per exception: peer, rail, state, weight, measured, slow-pair rate
                            # (0: not a slow pair)


def _rel(weight, k, rail_bw):
    return float(rail_bw[k] if rail_bw and k < len(rail_bw) else (weight or 1.0))


def _entries(mine, me, n, nrails):
    """(peer, rail) -> (state, weight, measured, rate) for every other rank and rail k < nrails
    (state -1: no such rail towards that peer)."""
    out = {}
    for p in range(n):
        if p == me:
            continue
        rows = mine.get(p, ())
        for k in range(nrails):
            if k < len(rows):
                rec = rows[k]
                up = rec[0] == "up"
                rate = float(rec[2]) if len(rec) > 2 and rec[2] else 0.0
                out[(p, k)] = (1.0 if up else 0.0, float(rec[1]), 1.0 if up and rate > 0 else 0.0,
                               rate)
            else:
                out[(p, k)] = (-1.0, 0.0, 0.0, 0.0)
    return out


def _usual(triples):
    """The most common triple (ties: the smallest), deterministic."""
    counts = {}
    for t in triples:
        counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: (-counts[t], t))


def summarise(mine, me, hosts, nrails, rates="nic", rail_bw=None, noise=MEASURE_NOISE):
    """This rank's summary: (fixed row of 2 * nrails * FIELDS + 1 floats, the last the number of
    exceptions; exceptions as an (m, EXC_FIELDS) array). hosts: one label per rank (as
    RailState.gather uses them)."""
    n = len(hosts)
    ent = _entries(mine, me, n, nrails)
    fixed = np.zeros((2, nrails, FIELDS))
    exc = []
    for inside in (0, 1):
        peers = [p for p in range(n) if p != me and (hosts[p] == hosts[me]) == bool(inside)]
        for k in range(nrails):
            if not peers:
                fixed[inside, k, 0] = -1.0
                continue
            cls = [(p, ent[(p, k)]) for p in peers]
            base = _usual([e[:3] for _, e in cls])
            meas = [e[3] for _, e in cls if e[2] > 0]
            if rates == "scale":
                rel = sorted(e[3] / _rel(e[1], k, rail_bw) for _, e in cls if e[2] > 0)
                rate = rel[len(rel) // 2] if rel else 0.0
            else:
                rate = max(meas, default=0.0)
            fixed[inside, k] = (*base, rate)
            for p, e in cls:
                slow = e[3] if rates == "nic" and not inside and e[2] > 0 and \
                    is_slow(e[3], rate, noise) else 0.0
                if e[:3] != base or slow:
                    exc.append((p, k, *e[:3], slow))
    exc = np.array(exc, np.float64).reshape(-1, EXC_FIELDS)
    return np.append(fixed.ravel(), float(len(exc))), exc


def row_size(fixed, exc):
    """Numbers this rank contributes to the agreement."""
    return fixed.size + exc.size


def _check_exceptions(r, exc, n, nrails):
    """Validate one rank's received exceptions (they crossed the network)."""
    if exc.ndim != 2 or exc.shape[1] != EXC_FIELDS or not np.isfinite(exc).all():
        raise ValueError(f"rank {r}: malformed rail-state exceptions")
    for p, k, st, w, m, slow in exc:
        if p != int(p) or not 0 <= p < n or p == r or k != int(k) or not 0 <= k < nrails \
                or st not in (-1.0, 0.0, 1.0) or m not in (0.0, 1.0) or (m and st != 1.0) \
                or slow < 0 or (slow and not m):
            raise ValueError(f"rank {r}: bad rail-state exception {(p, k, st, w, m, slow)}")


def _check_slow(r, p, k, slow, body, hosts):
    """A slow pair is towards another host and below its class's best rate."""
    if slow and (hosts[p] == hosts[r] or not slow < body[r][0][k][3]):
        raise ValueError(f"rank {r}: bad slow-pair rate {slow} towards {p} on rail {k}")


def check_fixed(table, n, nrails):
    """Validate every rank's fixed row (an (n, 2 * nrails * FIELDS + 1) array): the exception
    counts as ints."""
    table = np.asarray(table, np.float64)
    if table.shape != (n, 2 * nrails * FIELDS + 1) or not np.isfinite(table).all():
        raise ValueError(f"rail-state summaries of shape {table.shape}, wanted "
                         f"{(n, 2 * nrails * FIELDS + 1)}")
    counts = table[:, -1]
    if any(c != int(c) or not 0 <= c <= n * nrails for c in counts):
        raise ValueError(f"bad rail-state exception counts {counts.tolist()}")
    body = table[:, :-1].reshape(n, 2, nrails, FIELDS)
    if not np.isin(body[..., 0], (-1.0, 0.0, 1.0)).all() or \
            not np.isin(body[..., 2], (0.0, 1.0)).all() or (body[..., 3] < 0).any():
        raise ValueError("malformed rail-state summaries")
    return [int(c) for c in counts]


def rebuild(table, excs, hosts, nrails, rail_bw=None, rates="nic"):
    """Every rank's stats ({peer: [(state, weight, rate), ...]}, for RailState.from_rail_stats)
    from every rank's summary: table (n fixed rows), excs[r] rank r's exceptions."""
    n = len(hosts)
    check_fixed(table, n, nrails)
    body = np.asarray(table, np.float64)[:, :-1].reshape(n, 2, nrails, FIELDS)
    stats = []
    for r in range(n):
        exc = np.asarray(excs[r], np.float64)
        _check_exceptions(r, exc, n, nrails)
        own = {(int(p), int(k)): (st, w, m, slow) for p, k, st, w, m, slow in exc}
        for (p, k), e in own.items():
            _check_slow(r, p, k, e[3], body, hosts)
        d = {}
        for p in range(n):
            if p == r:
                continue
            inside = int(hosts[p] == hosts[r])
            rows = []
            for k in range(nrails):
                base = body[r, inside, k]
                st, w, m, slow = own.get((p, k), (*base[:3], 0.0))
                if st < 0:
                    break
                rate = 0.0
                if m:
                    rate = base[3] * _rel(w, k, rail_bw) if rates == "scale" else base[3]
                    rate = slow or rate
                rows.append(("up" if st > 0 else "down", float(w), float(rate)))
            if rows:
                d[p] = rows
        stats.append(d)
    return stats


class _Agreed:
    """The agreed summaries, queried per (rank, peer, rail) as from_rail_stats would see the
    rebuilt stats: the entry's triple, its class's NIC figure, the link's bandwidth."""

    def __init__(self, table, excs, hosts, nrails, rail_bw):
        n = len(hosts)
        self.hosts, self.nrails, self.rail_bw = hosts, nrails, rail_bw
        self.body = np.asarray(table, np.float64)[:, :-1].reshape(n, 2, nrails, FIELDS).tolist()
        self.exc, self.slow = {}, {}               # (r, p, k) -> triple / slow-pair rate
        for r in range(n):
            exc = np.asarray(excs[r], np.float64)
            _check_exceptions(r, exc, n, nrails)
            for p, k, st, w, m, slow in exc:
                _check_slow(r, int(p), int(k), slow, self.body, hosts)
                self.exc[(r, int(p), int(k))] = (st, w, m)
                if slow:
                    self.slow[(r, int(p), int(k))] = slow
        self.fig, self.scale = {}, 0.0

    def inside(self, r, p):
        return int(self.hosts[r] == self.hosts[p])

    def entry(self, r, p, k):
        e = self.exc.get((r, p, k))
        return e if e is not None else tuple(self.body[r][self.inside(r, p)][k][:3])

    def rel(self, w, k):
        return _rel(w, k, self.rail_bw)

    def fast(self, r, p, k):
        """r measured p on rail k, not slow (p on another host)."""
        return self.entry(r, p, k)[2] == 1.0 and (r, p, k) not in self.slow

    def reported(self, raw, size, by_class):
        """raw {(rank, rail, False): best} with step 1b of the "nic" model applied (state.py):
        each NIC that slow pairs were reported towards, from the summaries alone (size: the
        class sizes, by_class: the exceptions' peers per (rank, class, rail))."""
        reports = {}                                # (rank, rail) -> {reporter: rate}
        for (a, b, k), rate in self.slow.items():
            reports.setdefault((b, k), {})[a] = rate
        for (b, k), rep in reports.items():
            key = (b, k, False)
            if key not in raw:
                continue
            own = by_class.get((b, 0, k), ())
            fast = (size[(b, 0)] - len(own) if self.body[b][0][k][2] == 1.0 else 0) + \
                sum(1 for p in own if self.fast(b, p, k))
            raw[key] = reported_nic(raw[key], fast, sum(1 for a in rep if self.fast(b, a, k)),
                                    rep.values())

    def bw(self, r, p, k):
        """from_rail_stats' bandwidth of the link (r, p, k)."""
        c = self.inside(r, p)
        ends = [self.fig[x] for x in ((r, k, c), (p, k, c)) if x in self.fig]
        return min(ends) if ends else self.rel(self.entry(r, p, k)[1], k) * self.scale

    def rail(self, a, b, k):
        """RailState.rail_bw of the rebuilt state."""
        if self.entry(a, b, k)[0] != 1.0 or self.entry(b, a, k)[0] != 1.0:
            return 0.0
        x, y = self.bw(a, b, k), self.bw(b, a, k)
        return min(x, y) if x > 0 and y > 0 else 0.0


def _weighted_upper_median(pairs):
    """Upper median of the multiset {value: count} given as (value, count) pairs."""
    pairs = sorted(pairs)
    half = sum(c for _, c in pairs) // 2
    for v, c in pairs:
        if half < c:
            return v
        half -= c
    raise ValueError("empty")


def direct_state(table, excs, hosts, nrails, rail_bw=None, nominal_bw=None, noise=None,
                 rates="nic", **kw):
    """RailState.from_rail_stats(hosts, rebuild(...)).compact() computed from the summaries in
    O(n·K·(ranks per host + exceptions)) instead of over every pair, or None where that does
    not apply ("scale" mode, a rail missing towards some peer, a NIC with a rate beside one
    without in "nic" mode): then the caller takes the rebuild path. The result carries no raw
    measurements (`measured` is empty)."""
    nominal_bw = DEFAULT_BW if nominal_bw is None else nominal_bw
    noise = MEASURE_NOISE if noise is None else noise
    n = len(hosts)
    check_fixed(table, n, nrails)
    if rates not in ("nic", "declared") or n < 2 or not nrails:
        return None
    ag = _Agreed(table, excs, hosts, nrails, rail_bw)
    on_host = {}
    for h in hosts:
        on_host[h] = on_host.get(h, 0) + 1
    size = {}                                       # (rank, class) -> its peers in the class
    for r in range(n):
        for c, cnt in enumerate((n - on_host[hosts[r]], on_host[hosts[r]] - 1)):
            if cnt:
                size[(r, c)] = cnt
    by_class = {}                                   # (rank, class, rail) -> its exceptions
    for (r, p, k), e in ag.exc.items():
        if e[0] < 0:
            return None
        by_class.setdefault((r, ag.inside(r, p), k), []).append(p)
    raw, weights = {}, []
    for (r, c), cnt in size.items():
        for k in range(nrails):
            st, w, m, rate = ag.body[r][c][k]
            if st < 0:
                return None
            own = [ag.exc[(r, p, k)] for p in by_class.get((r, c, k), ())]
            nb = cnt - len(own)
            meas = ([(w, nb)] if m and nb else []) + [(e[1], 1) for e in own if e[2]]
            if meas:
                raw[(r, k, bool(c))] = rate
                weights += [((r, k, bool(c)), ww, cc) for ww, cc in meas]
    degraded_tol = kw.pop("degraded_tol", noise if rates == "nic" and raw else 0.02)
    ag.scale = nominal_bw
    if rates == "nic" and raw:
        ag.reported(raw, size, by_class)
        fig = nic_figures(raw, noise)
        ag.fig = {(r, k, int(c)): v for (r, k, c), v in fig.items()}
        ag.scale = _weighted_upper_median(
            [(fig[key] / (ag.rel(w, key[1]) or 1.0), cnt) for key, w, cnt in weights])
    return _compact(ag, n, nrails, NicRailState, degraded_tol, **kw)


def _rank_nics(ag, n, nrails):
    """Per rail, each rank's figure towards other hosts when no exception is involved
    (0: down), or None when a pair's bandwidth is not the smaller of two such figures."""
    out = []
    for k in range(nrails):
        row = []
        figs = [(r, k, 0) in ag.fig for r in range(n)]
        for r in range(n):
            st, w = ag.body[r][0][k][:2]
            if st != 1.0:
                row.append(0.0)
            elif ag.fig and not figs[r]:
                return None
            else:
                v = ag.fig[(r, k, 0)] if ag.fig else ag.rel(w, k) * ag.scale
                row.append(v if v > 0 else 0.0)
        out.append(row)
    return out


def _compact(ag, n, nrails, nic_cls, degraded_tol, **kw):
    hosts = ag.hosts
    hl, hidx = [], {}
    for h in hosts:
        if h not in hidx:
            hidx[h] = len(hl)
            hl.append(h)
    hi = [hidx[h] for h in hosts]
    members = [[] for _ in hl]
    for r in range(n):
        members[hi[r]].append(r)
    N = _rank_nics(ag, n, nrails) if len(hl) > 1 else [[0.0] * n for _ in range(nrails)]
    if N is None:
        return None
    cross = [{} for _ in range(nrails)]           # rail -> {(a, b) a < b: bandwidth}
    for (r, p, k) in ag.exc:
        if hi[r] != hi[p]:
            a, b = min(r, p), max(r, p)
            cross[k][(a, b)] = ag.rail(a, b, k)
    nic = [[0.0] * nrails for _ in hl]
    for k in range(nrails):
        order = sorted((r for r in range(n) if N[k][r] > 0), key=lambda r: -N[k][r])
        for a in order:
            for b in order:
                if hi[b] != hi[a] and (min(a, b), max(a, b)) not in cross[k]:
                    v = min(N[k][a], N[k][b])
                    nic[hi[a]][k] = max(nic[hi[a]][k], v)
                    break
        for (a, b), v in cross[k].items():
            for r in (a, b):
                nic[hi[r]][k] = max(nic[hi[r]][k], v)
    local, pairs_in = {}, {}
    for rs in members:
        for x, a in enumerate(rs):
            for b in rs[x + 1:]:
                vals = [ag.rail(a, b, k) for k in range(nrails)]
                pairs_in[(a, b)] = vals
                pb = sum(vals)
                local[pb] = local.get(pb, 0) + 1
    intra = max(sorted(local), key=lambda v: local[v]) if local else 0.0
    out = nic_cls(hosts, nic, intra, degraded_tol=degraded_tol, **kw)
    exc = {}
    for (a, b), vals in pairs_in.items():
        for k, v in enumerate(vals):
            if v != out.rail_bw(a, b, k):
                exc[(a, b, k)] = (v > 0, v)
    for k in range(nrails):
        for (a, b), v in cross[k].items():
            if v != out.rail_bw(a, b, k):
                exc[(a, b, k)] = (v > 0, v)
        odd = [r for r in range(n) if N[k][r] != nic[hi[r]][k]]
        for a in odd:
            for b in range(n):
                if hi[b] == hi[a] or (min(a, b), max(a, b)) in cross[k]:
                    continue
                v = min(N[k][a], N[k][b]) if N[k][a] > 0 and N[k][b] > 0 else 0.0
                if v != out.rail_bw(a, b, k):
                    exc[(min(a, b), max(a, b), k)] = (v > 0, v)
    out.exceptions = exc
    return out


def agree_state(exchange, rank, members, rail_stats, hosts, nrails, rail_bw=None,
                nominal_bw=DEFAULT_BW, rates="nic", **kw):
    """RailState.gather()'s state, compacted, agreed through per-rank summaries: each rank
    contributes O(nrails) numbers plus EXC_FIELDS per exception, not a row per peer.
    exchange(fixed, exceptions) -> (every rank's fixed row as an (n, len) array, the list of
    every rank's exceptions array); e.g. control.agree_rails. Collective."""
    hosts = list(hosts) if len(set(hosts)) > 1 else list(range(len(members)))
    fixed, exc = summarise(own_rows(rank, members, rail_stats), rank, hosts, nrails, rates,
                           rail_bw, kw.get("noise", MEASURE_NOISE))
    table, excs = exchange(fixed, exc)
    st = direct_state(table, excs, hosts, nrails, rail_bw, nominal_bw, rates=rates, **kw)
    if st is not None:
        return st
    stats = rebuild(table, excs, hosts, nrails, rail_bw, rates)
    return RailState.from_rail_stats(hosts, stats, rail_bw, nominal_bw, rates=rates,
                                     **kw).compact()
