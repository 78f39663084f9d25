"""Weighted direct AllReduce: reduce-scatter and allgather straight between every pair of ranks,
with blocks sized so that a partly slow rank's NICs and its peers' busiest rails finish together.

Rank i owns a block of s_i bytes (sum N): it sends block j of its input to rank j, reduces the
n - 1 blocks it receives into its own in ascending rank order, then sends the result to every
other rank. In each direction rank i's NICs move N - s_i + (n - 1)·s_i = N + (n - 2)·s_i, so a
slow rank (bandwidth b_d) owning a small block and the healthy ranks larger ones balance the
load: with s_i = (T·b_i - N)/(n - 2) the time is T = 2(n-1)N / Σb_i, the bound T*, wherever
T*·b_d >= N (else the slow rank owns nothing and T = N/b_d, the bound's other term).

The rails: the engine stripes a pair's traffic over its rails in proportion to the slower end's
rates, so a healthy rank's traffic with a slow rank loads its fast rails beyond their share:
of D bytes to the slow rank its busiest rail carries w·D (w the largest rail weight of that
pair) where a healthy pair puts D/K on each of its K rails. That costs the healthy rank
g·D more in time, g = K·w - 1 (1/3 with one of 2 NICs at half rate, 1 with it down). With few
ranks the blocks are sized for that (rail_penalty()); from RAIL_AWARE_MAX ranks on the penalty
spreads over many peers and the plain weights replay better (bench/SIM.md).

Every element is reduced at its owner in one fixed order, then only copied: every rank holds
identical bits. 4(n - 1) messages per rank: offered up to MAX_RANKS ranks."""
import functools

from .schedule import Schedule, WORK, SEND, COPY, REDUCE, REDUCE_SEND

MAX_RANKS = 16              # offered up to this many ranks (above, the tree fold replays
                            # closer to T*: 1.02 against 1.06 at 32 hosts with a NIC down)
RAIL_AWARE_MAX = 12         # blocks sized for the rail penalty below this many ranks
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


def plan_sizes(n, nbytes, rank_bw, slow, state=None):
    """(block sizes, T, g) for n ranks of bandwidths rank_bw(r), the slow ranks `slow`. The
    sizes and T scale with nbytes (the balance is linear in N): the shares are computed once
    per set of bandwidths."""
    bws = tuple(rank_bw(r) for r in range(n))
    slow = tuple(sorted(set(slow)))
    healthy = [r for r in range(n) if r not in set(slow)]
    g_true = rail_penalty(state, healthy, slow) if state is not None else 0.0
    g = g_true if n < RAIL_AWARE_MAX else 0.0
    shares, t1 = _shares(bws, g, g_true, slow)
    return [x * nbytes for x in shares], t1 * nbytes, g


@functools.lru_cache(maxsize=256)
def _shares(bws, g, g_true, slow):
    """(block sizes, finish time under the rails' penalty g_true) for one byte."""
    sizes, _ = block_sizes(1.0, list(bws), g, slow)
    return tuple(sizes), finish_time(1.0, sizes, bws, g_true, slow)


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
    if sizes is None:
        if state is not None:
            slow = sorted(set(degraded if degraded is not None else state.degraded_ranks()))
            sizes = plan_sizes(n, nbytes, state.rank_bw, slow, state)[0]
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
    s.fills_work = True
    return s


def direct_time(n, nbytes, rank_bw, slow, state, chunk, alpha):
    """Closed-form seconds: finish_time() of the planned blocks, plus the slow rank's stall
    (it streams a chunk to each of the n - 1 others at once, so the first reduced chunks, and
    the allgather behind them, wait n - 1 chunk times at its rate: 1 + (n-1)·c/N x T* with a
    NIC down, as the replay gives) and FILL_HOPS latencies."""
    sizes, t, _ = plan_sizes(n, nbytes, rank_bw, slow, state)
    b = min(rank_bw(r) for r in range(n))
    c = min(chunk, max(sizes) if sizes else 0)
    return t + ((n - 1) * c / b if b > 0 else float("inf")) + FILL_HOPS * alpha
