"""α-β cost model: predicted seconds of a schedule set (one Schedule per rank) on a RailState.

A *transfer* is a matched (send on src, recv on dst) pair of messages, m bytes, over the pair's
aggregate bandwidth b = RailState.pair_bw(src, dst) (all usable rails; the engine stripes chunks
over them). α is the per-message latency, c the engine's chunk size, ct = min(c, m) / b.

Two bounds are computed and the larger is the prediction:

  P  pipelined critical path over the messages (the schedules' dependency graph, plus an
     edge from every send to its receive). Dependencies are chunk-level, so a send can start
     as soon as the first chunk of each predecessor is done, and cannot finish before its
     predecessors' last chunk (plus one chunk of its own):
        R1 = max over preds of D1(pred)        (first chunk ready; 0 without preds)
        RL = max over preds of DL(pred)        (last chunk ready)
        A1 = R1 + α + ct                       (first chunk arrives)
        AL = max(A1 + (m - c)/b, RL + α + ct)  (last chunk arrives)
     A receive's chunks are applied at max(arrival, its own gates' done times). Done times D:
     a receive once applied, a send once acknowledged (arrival + α), an owned send once copied
     (ready: R). P = max over receives of the last chunk's applied time.
  R  resource (bandwidth) bound plus latency: the busiest resource's bytes over its capacity,
        R = max( bytes(a->b) / pair_bw(a,b),                    every directed pair
                 off-host bytes out of h / host_bw(h),         every host NIC set, egress
                 off-host bytes into h / host_bw(h) )          and ingress
     plus α times the hop count H of the longest dependency chain.

  predict = max(P, R + H·α)

For a ring this is the slowest link carrying 2(p-1)/p·N (plus 2(p-1) pipeline hops); for
recursive doubling the host NIC carrying log2(p)·N; for schedules that keep a slow host's bytes
low (degraded.py) the slow host's NIC stops being the maximum. Contention is only counted in
aggregate (R), not in the timing of P; schedules are assumed to start together."""
import math

from .state import RailState

INF = math.inf


def lower_bound(nbytes, bw, beta, p):
    """T* = (N/B)·max(1/β, 2(p-1)/(p-1+β)): no AllReduce of N bytes over p hosts of bandwidth B,
    one of which has βB, can be faster (the slow host must move N at βB; all hosts together must
    move 2(p-1)·N over a total bandwidth (p-1+β)B)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if beta <= 0:
        return INF
    return (nbytes / bw) * max(1.0 / beta, 2.0 * (p - 1) / (p - 1 + beta))


def lower_bound_state(nbytes, state):
    """T* for a RailState: B the best host's bandwidth, β = state.beta(), p hosts."""
    hosts = state.host_list()
    bw = max(state.host_bw(h) for h in hosts)
    return lower_bound(nbytes, bw, state.beta(), len(hosts))


def transfers(schedules):
    """Match every send with its receive. Returns a list of dicts (src, dst, step, nbytes,
    send index, recv index, owned) and raises ValueError on an unmatched or mis-sized message."""
    recvs = {}
    for r, s in enumerate(schedules):
        for i, m in enumerate(s.msgs):
            if m[0] == "recv":
                recvs[(m[1], r, m[2])] = (i, m[5])
    out, used = [], set()
    for r, s in enumerate(schedules):
        for i, m in enumerate(s.msgs):
            if m[0] != "send":
                continue
            key = (r, m[1], m[2])
            if key not in recvs:
                raise ValueError(f"send {key} (src, dst, step) has no matching receive")
            j, nb = recvs[key]
            if nb != m[5]:
                raise ValueError(f"send {key} has {m[5]} bytes, its receive {nb}")
            used.add(key)
            out.append({"src": r, "dst": m[1], "step": m[2], "nbytes": m[5], "si": i, "ri": j,
                        "owned": bool(m[7])})
    extra = set(recvs) - used
    if extra:
        raise ValueError(f"receives {sorted(extra)[:5]} have no matching send")
    return out


def analyse(schedules, state):
    """Everything predict() computes: {"P", "R", "hops", "time", "bottleneck"}."""
    n = len(schedules)
    if n != state.n:
        raise ValueError(f"{n} schedules for a RailState of {state.n} ranks")
    ts = transfers(schedules)
    if not ts:
        return {"P": 0.0, "R": 0.0, "hops": 0, "time": 0.0, "bottleneck": None}
    alpha, chunk = state.alpha, state.chunk
    bwc = {}

    def bw(a, b):
        key = (a, b) if a < b else (b, a)
        if key not in bwc:
            bwc[key] = state.pair_bw(a, b)
        return bwc[key]

    # the dependency graph over messages: (rank, index) nodes; each send feeds its receive
    node = {}
    for t, x in enumerate(ts):
        node[(x["src"], x["si"])] = ("send", t)
        node[(x["dst"], x["ri"])] = ("recv", t)
    preds = {k: [] for k in node}
    for r, s in enumerate(schedules):
        for a, b in s.deps:
            preds[(r, b)].append((r, a))
    for t, x in enumerate(ts):
        if bw(x["src"], x["dst"]) <= 0:
            return {"P": INF, "R": INF, "hops": 0, "time": INF,
                    "bottleneck": ("broken pair", x["src"], x["dst"])}
    succ = {k: [] for k in node}
    indeg = {k: 0 for k in node}
    for k, ps in preds.items():
        for p in ps:
            succ[p].append(k)
            indeg[k] += 1
    for x in ts:
        s_, r_ = (x["src"], x["si"]), (x["dst"], x["ri"])
        succ[s_].append(r_)
        indeg[r_] += 1
    order = [k for k in node if indeg[k] == 0]
    for k in order:
        for u in succ[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                order.append(u)
    if len(order) != len(node):
        raise ValueError("schedule dependencies form a cycle across ranks (it would deadlock)")
    D1, DL, hops = {}, {}, {}          # chunk 0 / last chunk done; transfers on the chain
    arr = [None] * len(ts)             # (first, last) chunk arrival of each transfer
    AL = [0.0] * len(ts)
    for k in order:
        kind, t = node[k]
        x = ts[t]
        r1 = max((D1[p] for p in preds[k]), default=0.0)
        rl = max((DL[p] for p in preds[k]), default=0.0)
        h = max((hops[p] for p in preds[k]), default=0)
        if kind == "send":
            m, b = x["nbytes"], bw(x["src"], x["dst"])
            ct = min(chunk, m) / b
            a1 = r1 + alpha + ct
            al = max(a1 + max(m - chunk, 0) / b, rl + alpha + ct)
            arr[t] = (a1, al)
            D1[k], DL[k] = (r1, rl) if x["owned"] else (a1 + alpha, al + alpha)
            hops[k] = h
        else:
            a1, al = arr[t]
            sk = (x["src"], x["si"])
            D1[k], DL[k] = max(a1, r1), max(al, rl)
            AL[t] = DL[k]
            hops[k] = max(h, hops[sk] + 1)
    P = max(AL)
    H = max(hops.values())
    # resource bound
    pair_bytes, out_bytes, in_bytes = {}, {}, {}
    for x in ts:
        a, b, m = x["src"], x["dst"], x["nbytes"]
        pair_bytes[(a, b)] = pair_bytes.get((a, b), 0) + m
        ha, hb = state.hosts[a], state.hosts[b]
        if ha != hb:
            out_bytes[ha] = out_bytes.get(ha, 0) + m
            in_bytes[hb] = in_bytes.get(hb, 0) + m
    R, where_max = 0.0, None
    for (a, b), m in pair_bytes.items():
        v = m / bw(a, b)
        if v > R:
            R, where_max = v, ("pair", a, b)
    hbw = {}
    for tbl, what in ((out_bytes, "host egress"), (in_bytes, "host ingress")):
        for h, m in tbl.items():
            if h not in hbw:
                hbw[h] = state.host_bw(h)
            v = m / hbw[h] if hbw[h] > 0 else INF
            if v > R:
                R, where_max = v, (what, h)
    T = max(P, R + H * alpha)
    return {"P": P, "R": R, "hops": H, "time": T, "bottleneck": where_max}


def predict(schedules, state):
    """Predicted seconds for one schedule per rank on `state` (see the module docstring);
    math.inf when a transfer uses a broken pair."""
    return analyse(schedules, state)["time"]


def ring_time(nbytes, n, bw_min, alpha=0.0):
    """Closed form for a ring allreduce: 2(n-1)/n·N over the slowest link, 2(n-1) hops."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw_min + 2 * (n - 1) * alpha


__all__ = ["predict", "analyse", "lower_bound", "lower_bound_state", "transfers", "ring_time",
           "RailState"]
