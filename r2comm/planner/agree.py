"""Agreeing on the rail state with traffic that grows with the changes, not with n^2.

Each rank summarises what its engine reports about its own rails (rail_stats(), as
RailState.gather's `mine`: {peer: [(state, weight, rate), ...] per rail}) as

  a fixed row, per rail k and per peer class (peers on other hosts / on its own host):
      the class's usual (state, weight, measured) triple (a NIC fact: a NIC down shows as
      "down" towards nearly every peer) and one rate: the best measured rate of the class
      ("nic" and "declared" modes: all the "nic" model uses) or the upper median of
      rate / relative bandwidth ("scale" mode);
  plus its exceptions: the (peer, rail) entries whose triple differs from their class's
      (a pair whose rail is down while the NIC is fine, a peer not yet measured, ...).

So a rank contributes O(K) numbers plus 5 per exception, whatever the number of ranks
(row_size()). rebuild() turns every rank's summary back into per-rank stats that
RailState.from_rail_stats() reads: every entry gets its class's triple (or its exception's) and
its class's rate. In "nic" and "declared" mode that gives exactly the state of the dense gather
(the "nic" model reads only each NIC's best rate per class, and the counts); in "scale" mode the
overall scale is the median over the (rank, rail, class) medians instead of over every
measurement (it only sets the units of every link)."""
import numpy as np

STATES = {"up": 1.0, "down": 0.0}
FIELDS = 4                  # per (class, rail): state (1 up, 0 down, -1 no such rail), weight,
                            # measured (1/0), rate
EXC_FIELDS = 5              # per exception: peer, rail, state, weight, measured


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


def summarise(mine, me, hosts, nrails, rates="nic", rail_bw=None):
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
            exc.extend((p, k, *e[:3]) for p, e in cls if e[:3] != base)
    exc = np.array(exc, np.float64).reshape(-1, EXC_FIELDS)
    return np.append(fixed.ravel(), float(len(exc))), exc


def row_size(fixed, exc):
    """Numbers this rank contributes to the agreement."""
    return fixed.size + exc.size


def _check_exceptions(r, exc, n, nrails):
    """Validate one rank's received exceptions (they crossed the network)."""
    if exc.ndim != 2 or exc.shape[1] != EXC_FIELDS or not np.isfinite(exc).all():
        raise ValueError(f"rank {r}: malformed rail-state exceptions")
    for p, k, st, w, m in exc:
        if p != int(p) or not 0 <= p < n or p == r or k != int(k) or not 0 <= k < nrails \
                or st not in (-1.0, 0.0, 1.0) or m not in (0.0, 1.0) or (m and st != 1.0):
            raise ValueError(f"rank {r}: bad rail-state exception {(p, k, st, w, m)}")


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
        own = {(int(p), int(k)): (st, w, m) for p, k, st, w, m in exc}
        d = {}
        for p in range(n):
            if p == r:
                continue
            inside = int(hosts[p] == hosts[r])
            rows = []
            for k in range(nrails):
                base = body[r, inside, k]
                st, w, m = own.get((p, k), tuple(base[:3]))
                if st < 0:
                    break
                rate = 0.0
                if m:
                    rate = base[3] * _rel(w, k, rail_bw) if rates == "scale" else base[3]
                rows.append(("up" if st > 0 else "down", float(w), float(rate)))
            if rows:
                d[p] = rows
        stats.append(d)
    return stats
