"""Weighted direct AllReduce: reduce-scatter and allgather straight between every pair of ranks,
with blocks and per-pair rail weights such that a partly slow rank's NICs and every rail of
its peers finish together.

Rank i owns a block of s_i bytes (sum N): it sends block j of its input to rank j, reduces the
n - 1 blocks it receives into its own in ascending rank order, then sends the result to every
other rank. In each direction rank i's NICs move N - s_i + (n - 1)·s_i = N + (n - 2)·s_i, so a
slow rank (bandwidth b_d) owning a small block and the healthy ranks larger ones balance the
load: with s_i = (T·b_i - N)/(n - 2) the time is T = 2(n-1)N / Σb_i, the bound T*, wherever
T*·b_d >= N (else the slow rank owns nothing and T = N/b_d, the bound's other term).

The rails: the engine stripes a pair's traffic over its rails in proportion to their rates as
the pair sees them (the slower end's), so a healthy rank's traffic with a slow rank loads its
fast rails beyond their share, and with healthy pairs striped evenly those rails finish last
(g = K·w - 1 more time for D bytes to the slow rank, w the largest rail weight of the pair: 1/3
with one of 2 NICs at half rate, 1 with it down). The schedule therefore carries rail weights
(Schedule.rail_weights) for the healthy pairs: each pair stripes in proportion to what the
traffic with the slow ranks leaves free on both ends' rails (pair_weights()), so every healthy
rank's rails finish together at the bound T* instead of T*·(1 + g·(s_d + s_i)/(T*·b_i)).

Every element is reduced at its owner in one fixed order, then only copied: every rank holds
identical bits. 4(n - 1) messages per rank: offered up to MAX_RANKS ranks."""
import functools

from .overlap import hides_latency
from .schedule import Schedule, WORK, SEND, COPY, REDUCE, REDUCE_SEND

MAX_RANKS = 32              # offered up to this many ranks: above, the slow rank's stall,
                            # (n-1) chunks at its rate, outgrows the tree fold's fill in the
                            # replay without latency (48 hosts, a NIC at 1/2: 1.062 against
                            # 1.040), while the prices with α = 25 µs still favour it
SAME_SHARES = 1e-3          # rail weights this close to the engine's own striping are not declared
FILL_HOPS = 3               # the price's latencies: one per phase, one for the last acknowledgement


def block_sizes(nbytes, bws, g=0.0, slow=()):
    """Per rank, the bytes of the block it owns (sum nbytes): the smallest T with
    N + (n-2)·s_d <= T·b_d for the slow ranks d and N + (n-2)·s_i + g·Σ_d(s_d + s_i) <= T·b_i
    for the others (bisection on T). Returns (sizes, finish_time() of them)."""
    n, N = len(bws), float(nbytes)
    if n <= 2:
        return [nbytes // n + (1 if i < nbytes % n else 0) for i in range(n)], 0.0
    slow = set(slow)
    k = len(slow)

    def sizes(T):
        sd = {i: max(0.0, (T * bws[i] - N) / (n - 2)) for i in slow}
        tot_d = sum(sd.values())
        out = []
        for i, b in enumerate(bws):
            if i in slow:
                out.append(sd[i])
            else:
                out.append(max(0.0, (T * b - N - g * tot_d) / (n - 2 + g * k)))
        return out
    lo, hi = 0.0, 2.0 * (n + g * n) * N / max(min(b for b in bws if b > 0), 1e-300)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(sizes(mid)) >= N:
            hi = mid
        else:
            lo = mid
    out = sizes(hi)
    return out, finish_time(nbytes, out, bws, g, slow)


def integer_blocks(count, sizes, itemsize):
    """Byte (offset, length) per rank of `count` elements cut in proportion to `sizes`."""
    if not sum(sizes) > 0:
        sizes = [1.0] * len(sizes)
    tot = sum(sizes)
    out, acc, lo = [], 0.0, 0
    for i, w in enumerate(sizes):
        acc += w
        hi = count if i == len(sizes) - 1 else min(count, int(round(acc / tot * count)))
        hi = max(hi, lo)
        out.append((lo * itemsize, (hi - lo) * itemsize))
        lo = hi
    return out


def rail_penalty(state, healthy, slow):
    """g = K·w - 1: w the largest rail weight of a (healthy, slow) pair, K the rails."""
    if not slow or not healthy:
        return 0.0
    w = max(max(state.rail_weights(healthy[0], d)) for d in slow)
    return max(0.0, state.nrails * w - 1.0)


def rank_rail_caps(state, r):
    """Bytes/s of each of rank r's rails towards other hosts (its host's NICs over its ranks)."""
    h = state.hosts[r]
    m = len(state.host_ranks(h))
    return [state.nic_bw(h, k) / m for k in range(state.nrails)]


def pair_weights(state, sizes, slow, T):
    """{(i, j): per-rail shares} (i < j, neither slow) that fill what each healthy rank's rails
    have left at time T after its traffic with the slow ranks (striped as the engine does,
    state.rail_weights): rank i's rail k keeps R_ik = T·c_ik - Σ_d (s_i + s_d)·w_idk free and
    the pair (i, j) puts min(R_ik, R_jk) / Σ_k min(...) of its s_i + s_j bytes on rail k. With
    the blocks balanced at T, Σ_k R_ik equals rank i's healthy traffic, so every rail of a
    healthy rank carries exactly T·c_ik (a pair whose free capacity is 0 everywhere: not named,
    the engine's own striping, as is one whose shares are within SAME_SHARES of it)."""
    n, K = len(sizes), state.nrails
    slow = set(slow)
    free = {}
    for i in range(n):
        if i in slow:
            continue
        caps = rank_rail_caps(state, i)
        load = [0.0] * K
        for d in slow:
            x = sizes[i] + sizes[d]
            for k, w in enumerate(state.rail_weights(i, d)):
                load[k] += x * w
        free[i] = [max(0.0, T * c - l) for c, l in zip(caps, load)]
    out = {}
    for i in free:
        for j in free:
            if j <= i:
                continue
            room = [min(free[i][k], free[j][k]) if state.rail_bw(i, j, k) > 0 else 0.0
                    for k in range(K)]
            tot = sum(room)
            if not tot > 0:
                continue
            w = tuple(x / tot for x in room)
            own = state.rail_weights(i, j)
            if max(abs(a - b) for a, b in zip(w, own)) > SAME_SHARES:
                out[(i, j)] = w
    return out


def rail_finish_time(state, sizes, weights):
    """Seconds until the busiest rail of any rank is done: rank i's rail k carries
    Σ_j (s_i + s_j)·w_ijk each way (w: `weights` for the pairs named, else the engine's
    striping, state.rail_weights)."""
    n, K = len(sizes), state.nrails
    t = 0.0
    for i in range(n):
        caps = rank_rail_caps(state, i)
        load = [0.0] * K
        for j in range(n):
            if j == i:
                continue
            w = weights.get((min(i, j), max(i, j))) or state.rail_weights(i, j)
            x = sizes[i] + sizes[j]
            for k in range(K):
                load[k] += x * w[k]
        for k in range(K):
            if load[k] > 0:
                t = max(t, load[k] / caps[k] if caps[k] > 0 else float("inf"))
    return t


def plan_sizes(n, nbytes, rank_bw, slow, state=None):
    """(block sizes, T, {pair: rail weights}) for n ranks of bandwidths rank_bw(r), the slow
    ranks `slow`: blocks balanced at the bound (no rail penalty), the healthy pairs' rail
    weights from pair_weights(), T the busiest rail's finish (rail_finish_time()). The sizes and
    T scale with nbytes (the balance is linear in N): the shares are computed once per state."""
    bws = tuple(rank_bw(r) for r in range(n))
    slow = tuple(sorted(set(slow)))
    if state is None:
        shares, t1 = _shares(bws, slow)
        return [x * nbytes for x in shares], t1 * nbytes, {}
    key = (state.fingerprint(), bws, slow)
    hit = _WEIGHTED.get(key)
    if hit is None:
        shares, t1 = _shares(bws, slow)
        weights = pair_weights(state, shares, slow, t1)
        hit = (shares, rail_finish_time(state, shares, weights), weights)
        if len(_WEIGHTED) >= 256:
            _WEIGHTED.clear()
        _WEIGHTED[key] = hit
    shares, t1, weights = hit
    return [x * nbytes for x in shares], t1 * nbytes, weights


_WEIGHTED = {}              # (state fingerprint, bandwidths, slow) -> plan_sizes() of one byte


@functools.lru_cache(maxsize=256)
def _shares(bws, slow):
    """(block sizes, finish time of the ranks' NICs) for one byte."""
    sizes, t = block_sizes(1.0, list(bws), 0.0, slow)
    return tuple(sizes), t


def finish_time(nbytes, sizes, bws, g, slow):
    """Seconds until the busiest rank's busiest rail is done, for given block sizes."""
    n, N = len(sizes), float(nbytes)
    slow = set(slow)
    tot_d = sum(sizes[d] for d in slow)
    t = 0.0
    for i, b in enumerate(bws):
        v = N + (n - 2) * sizes[i]
        if i not in slow:
            v += g * (tot_d + len(slow) * sizes[i])
        t = max(t, v / b if b > 0 else float("inf"))
    return t


def allreduce_direct(rank, n, nbytes, itemsize, eager, state=None, sizes=None, degraded=None):
    """This rank's schedule. sizes: the blocks' weights (default plan_sizes() from the state's
    rank bandwidths; equal without a state)."""
    s = Schedule("direct")
    if n == 1:
        return s
    weights = {}
    if sizes is None:
        if state is not None:
            slow = sorted(set(degraded if degraded is not None else state.degraded_ranks()))
            sizes, _, weights = plan_sizes(n, nbytes, state.rank_bw, slow, state)
        else:
            sizes = [1.0] * n
    blk = integer_blocks(nbytes // itemsize, sizes, itemsize)
    off, ln = blk[rank]
    own_small = max(ln for _, ln in blk) <= eager
    sent = {}
    for j in range(n):                                  # reduce-scatter: my input's block j
        if j != rank and blk[j][1]:
            sent[j] = s.send(j, 0, SEND, blk[j][0], blk[j][1], owned=own_small)
    prev = None
    if ln:
        for j in range(n):                              # fixed order: ascending rank
            if j != rank:
                ri = s.recv(j, 0, WORK, off, ln, REDUCE_SEND if prev is None else REDUCE)
                s.dep(prev, ri)
                prev = ri
        for j in range(n):                              # allgather: my block, final
            if j != rank:
                si = s.send(j, 1, WORK, off, ln, owned=own_small)
                s.dep(prev, si)
    for j in range(n):
        if j != rank and blk[j][1]:
            ri = s.recv(j, 1, WORK, blk[j][0], blk[j][1], COPY)
            s.dep(sent[j], ri)     # in place, SEND is WORK: never overwrite what is being sent
    for (i, j), w in weights.items():
        if rank in (i, j):
            s.rail_weights[j if rank == i else i] = w
    s.fills_work = True
    return s


def direct_time(n, nbytes, rank_bw, slow, state, chunk, alpha):
    """Closed-form seconds: the busiest rail's finish for the planned blocks and weights, plus
    the slow rank's stall (it streams a chunk to each of the n - 1 others at once, so the first
    reduced chunks, and the allgather behind them, wait n - 1 chunk times at its rate:
    1 + (n-1)·c/N x T* with a NIC down, as the replay gives) and FILL_HOPS latencies. Where the
    reduce-scatter is short (every pair's block on the wire before the first allgather chunk
    is ready, overlapped()), its bytes hide in that wait: overlapped_time()."""
    sizes, t, _ = plan_sizes(n, nbytes, rank_bw, slow, state)
    b = min(rank_bw(r) for r in range(n))
    c = min(chunk, max(sizes) if sizes else 0)
    stall = (n - 1) * c / b if b > 0 else float("inf")
    full = t + stall + FILL_HOPS * alpha
    if n > 2 and overlapped(n, sizes, rank_bw, chunk, alpha):
        return min(full, overlapped_time(n, nbytes, sizes, rank_bw, stall, alpha))
    return full


def overlapped(n, sizes, rank_bw, chunk, alpha):
    """Whether every pair's reduce-scatter block is on the wire before the first allgather
    chunk is ready (overlap.hides_latency() for the largest block at a pair's share of the
    fastest rank's NICs). If not, the engine sends the allgather's chunks (released by a
    dependency) ahead of the rest of the reduce-scatter: the full price."""
    b_pair = max(rank_bw(r) for r in range(n)) / (n - 1)
    return hides_latency(max(sizes), b_pair, alpha, chunk)


def overlapped_time(n, nbytes, sizes, rank_bw, stall, alpha):
    """Seconds of the direct schedule with a short reduce-scatter: per rank and direction, the
    reduce-scatter's bytes or the first chunks' wait (α + stall), whichever is longer, then the
    allgather's bytes, then its arrival and acknowledgement (2α). Rank i sends N - s_i and
    receives (n-1)·s_i in the reduce-scatter, the reverse in the allgather."""
    N, worst = float(nbytes), 0.0
    for i, s in enumerate(sizes):
        b = rank_bw(i)
        if not b > 0:
            return float("inf")
        for rs, ag in ((N - s, (n - 1) * s), ((n - 1) * s, N - s)):
            worst = max(worst, max(rs / b, alpha + stall) + ag / b)
    return worst + 2 * alpha
