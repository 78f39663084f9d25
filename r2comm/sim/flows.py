"""Flow-level discrete-event core: links with capacities, flows over weighted link sets, max-min
fair rates by progressive filling, timed events.

A flow moves `size` bytes; at rate r it loads link l with coef[l]·r bytes/s (a flow striped over
K rails in fixed proportions w_k loads rail k's links with w_k·r, so one flow object stands for
all of a message's stripes). Between two events every rate is constant, so the next event is the
earliest of: a timed callback, a flow completion. Rates are recomputed (vectorised, numpy) only
when the set of flows or a capacity changed. Flows live in rows of growable arrays; nothing is
done per byte or per chunk."""
import heapq
import itertools
import math

import numpy as np

INF = math.inf


def maxmin_rates(links, coefs, cap):
    """Weighted max-min fair rates by progressive filling.

    links: (A, P) int array of link indices (-1: unused slot); coefs: (A, P) load per unit of
    rate; cap: (L,) capacities (bytes/s). Every unfrozen flow's rate grows at the same pace until
    some link is full; flows crossing a full link freeze; repeat. A flow crossing a link of
    capacity 0 gets rate 0; a flow without links gets math.inf."""
    A = links.shape[0]
    rate = np.zeros(A)
    if A == 0:
        return rate
    valid = (links >= 0) & (coefs > 0)
    rows = np.nonzero(valid)[0]
    used_links, cols = np.unique(links[valid], return_inverse=True)   # only the links in use
    cf = coefs[valid]
    L = len(used_links)
    resid = np.maximum(cap[used_links].astype(float), 0.0)
    active = np.zeros(A, bool)
    active[rows] = True
    rate[~active] = INF
    mask = np.ones(len(rows), bool)
    for _ in range(L + 1):
        if not mask.any():
            break
        w = np.bincount(cols[mask], cf[mask], minlength=L)
        used = w > 0
        lvl = np.full(L, INF)
        lvl[used] = resid[used] / w[used]
        delta = lvl.min()
        if not math.isfinite(delta):
            break
        rate[active] += delta
        resid = np.maximum(resid - delta * w, 0.0)
        sat = used & (lvl <= delta * (1 + 1e-9))
        active[rows[mask & sat[cols]]] = False
        mask = active[rows]
    return rate


class FlowSim:
    """Links (capacities), flows and timed events on one clock (seconds)."""

    def __init__(self, capacities, max_links=8, t0=0.0):
        self.cap = np.array(capacities, dtype=float)
        self.P = int(max_links)
        self.now = float(t0)
        self._ev = []
        self._seq = itertools.count()
        n0 = 256
        self._links = np.full((n0, self.P), -1, np.int64)
        self._coef = np.zeros((n0, self.P))
        self._rem = np.zeros(n0)
        self._size = np.zeros(n0)
        self._alive = np.zeros(n0, bool)
        self._rate = np.zeros(n0)
        self._cb = [None] * n0
        self._n = 0
        self._dirty = True
        self._idx = np.zeros(0, np.int64)
        self.link_bytes = np.zeros(len(self.cap))     # bytes carried per link (coef-weighted)
        self.delivered = 0.0                          # bytes of completed flows
        self.events = 0
        self.recomputes = 0
        self.stop = False                             # set by a callback: run() returns
        self._moved = None                            # bytes moved per active flow since

    # -- events ---------------------------------------------------------------------------------
    def at(self, t, fn, *args):
        """Call fn(*args) at time t (not before now)."""
        heapq.heappush(self._ev, (max(t, self.now), next(self._seq), fn, args))

    # -- flows ----------------------------------------------------------------------------------
    def _grow(self):
        n = len(self._rem) * 2
        def g(a, fill):
            out = np.full((n,) + a.shape[1:], fill, a.dtype)
            out[:len(a)] = a
            return out
        self._links, self._coef = g(self._links, -1), g(self._coef, 0.0)
        self._rem, self._size = g(self._rem, 0.0), g(self._size, 0.0)
        self._alive, self._rate = g(self._alive, False), g(self._rate, 0.0)
        self._cb.extend([None] * (n - len(self._cb)))

    def add(self, path, nbytes, cb, *args):
        """Start a flow of nbytes over path = [(link, coef), ...]; cb(*args) when it is done.
        Returns its id. A flow of 0 bytes completes at once (cb called before returning)."""
        if nbytes <= 0:
            cb(*args)
            return -1
        if self._n == len(self._rem):
            self._grow()
        f = self._n
        self._n += 1
        lk, cf = path if isinstance(path, tuple) else self.row(path)
        self._links[f] = lk
        self._coef[f] = cf
        self._rem[f] = self._size[f] = float(nbytes)
        self._alive[f] = True
        self._cb[f] = (cb, args)
        self._dirty = True
        return f

    def row(self, path):
        """(links, coefs) arrays of one padded row for path = [(link, coef), ...]; add()
        takes either form (the arrays are cheaper to reuse)."""
        if len(path) > self.P:
            raise ValueError(f"path of {len(path)} links, the simulator holds {self.P}")
        lk = np.full(self.P, -1, np.int64)
        cf = np.zeros(self.P)
        for j, (l, c) in enumerate(path):
            lk[j] = l
            cf[j] = c
        return lk, cf

    def remaining(self, f):
        return float(self._rem[f]) if f >= 0 and self._alive[f] else 0.0

    def path(self, f):
        return [(int(l), float(c)) for l, c in zip(self._links[f], self._coef[f]) if l >= 0]

    def repath(self, f, path, nbytes=None):
        """Move flow f onto another path (and optionally change its remaining bytes)."""
        self._active()
        self._flush()
        if self._moved is not None:
            self._moved[:] = 0.0
        self._links[f], self._coef[f] = self.row(path)
        if nbytes is not None:
            self._size[f] += nbytes - self._rem[f]
            self._rem[f] = nbytes
        self._dirty = True

    def cancel(self, f):
        """Stop flow f without calling its callback; returns the bytes it had left."""
        if f < 0 or not self._alive[f]:
            return 0.0
        self._alive[f] = False
        self._cb[f] = None
        self._dirty = True
        left = float(self._rem[f])
        self._size[f] -= left            # only what it moved counts as delivered
        self.delivered += float(self._size[f])
        return left

    def flows_on(self, links):
        """Ids of live flows that use any of `links`."""
        idx = self._active()
        if not len(idx):
            return []
        hit = np.isin(self._links[idx], list(links)).any(1)
        return [int(x) for x in idx[hit]]

    def set_capacity(self, link, c):
        self.cap[link] = float(c)
        self._dirty = True

    def _active(self):
        if self._dirty:
            self._flush()
            self._moved = None
            self._idx = np.flatnonzero(self._alive[:self._n])
        return self._idx

    def _flush(self):
        """Add the bytes moved since the last recompute to link_bytes."""
        idx = self._idx
        if len(idx) and self._moved is not None:
            m = self._moved[:len(idx)]
            if m.any():
                lk = self._links[idx]
                ok = lk >= 0
                self.link_bytes += np.bincount(lk[ok], (self._coef[idx] * m[:, None])[ok],
                                               minlength=len(self.cap))

    def _recompute(self):
        idx = self._active()
        self._rate[idx] = maxmin_rates(self._links[idx], self._coef[idx], self.cap)
        self._moved = np.zeros(len(idx))
        self._dirty = False
        self.recomputes += 1

    def rates(self):
        if self._dirty:
            self._recompute()
        idx = self._active()
        return {int(f): float(self._rate[f]) for f in idx}

    # -- the loop -------------------------------------------------------------------------------
    def run(self, until=INF, max_events=50_000_000):
        """Advance until no event and no moving flow is left, until `until`, or until a
        callback sets .stop (cleared here). Returns now."""
        self.stop = False
        while self.events < max_events and not self.stop:
            if self._dirty:
                self._recompute()
            idx = self._idx
            t_done = INF
            if len(idx):
                r = self._rate[idx]
                mov = r > 0
                if mov.any():
                    t_done = self.now + float((self._rem[idx][mov] / r[mov]).min())
            t_ev = self._ev[0][0] if self._ev else INF
            t = min(t_done, t_ev, until)
            if t == INF:
                break
            dt = t - self.now
            if len(idx) and dt > 0:
                moved = self._rate[idx] * dt
                moved = np.minimum(moved, self._rem[idx])
                self._rem[idx] -= moved
                self._moved[:len(idx)] += moved          # per-link bytes: summed lazily
            self.now = t
            if t >= until and t_ev > until and t_done > until:
                break
            self.events += 1
            if len(idx):
                tol = 1e-9 * self._size[idx] + 1e-6
                fin = idx[self._rem[idx] <= tol]
                if len(fin):
                    self._alive[fin] = False
                    self._dirty = True
                    self.delivered += float(self._size[fin].sum())
                    self._rem[fin] = 0.0
                    for f in fin:
                        cb, args = self._cb[f]
                        self._cb[f] = None
                        cb(*args)
            while self._ev and self._ev[0][0] <= self.now and not self.stop:
                _, _, fn, args = heapq.heappop(self._ev)
                fn(*args)
        self.stop = False
        return self.now

    def next_event(self):
        return self._ev[0][0] if self._ev else INF

    def skip_to(self, t):
        """Jump the clock to t (no flow may be moving, no event may fall before t)."""
        if len(self._active()) or self.next_event() < t:
            raise RuntimeError("skip_to over live flows or events")
        self.now = max(self.now, t)

    def bytes_on_links(self):
        """link_bytes including the flows still moving."""
        self._flush()
        self._moved = np.zeros(len(self._idx)) if self._moved is not None else None
        return self.link_bytes

    def busy(self):
        return bool(len(self._active())) or bool(self._ev)
