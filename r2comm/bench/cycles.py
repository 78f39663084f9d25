"""Interleaved fault blocks for small overheads: a NIC goes down for BLOCK items (training steps,
served tokens), comes back for BLOCK items, and so on, within one job. On a shared machine the
load drifts by more than the 1-3% to be judged between jobs and even between the halves of one;
alternating the states every few seconds puts the same drift into both. A bootstrap over the
cycles says how far a median can be trusted, groups of cycles how far a p99 can (compare_groups),
and calibrate() checks either on a fault-free job. Pure Python: bench/testbed_torch.py records the
items and the wall times of the link changes, this module labels and compares them."""
import math
import random

WARM = "warm"      # left out: start-up
BEFORE = "H0"      # healthy, before the first fault (not interleaved: shown, not compared)
HIT = "hit"        # the item in flight when the link changed (failover or fail-back inside it)
DOWN = "D"         # the NIC was down for the whole item
AFTER = "A"        # the first SETTLE items after the NIC came back
HEALTHY = "H"      # healthy again, settled: the state the next fault starts from


def marks(warm, block, cycles):
    """[(item, 'down' | 'up')]: the NIC goes down before item warm + (2c+1)*block and comes
    back before warm + (2c+2)*block, for c < cycles (one healthy block first, one last)."""
    out = []
    for c in range(cycles):
        out += [(warm + (2 * c + 1) * block, "down"), (warm + (2 * c + 2) * block, "up")]
    return out


def total(warm, block, cycles):
    """Items in a job of CYCLES down/up cycles."""
    return warm + (2 * cycles + 1) * block


def labels(starts, ends, faults, warm, settle):
    """[(label, cycle)] per item from its wall-clock span and the link changes FAULTS
    ([{'what': 'nic_down' | 'nic_up', 't': begun, 'done': finished}]); cycle counts the
    nic_down events before the item (-1: none yet)."""
    events = sorted(faults, key=lambda f: f["t"])
    out, since_up = [], 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        cycle = sum(1 for f in events if f["what"] == "nic_down" and f["t"] <= e) - 1
        if i < warm:
            out.append((WARM, cycle))
            continue
        if any(s <= f["done"] and e >= f["t"] for f in events):
            out.append((HIT, cycle))
            since_up = 0
            continue
        last = [f for f in events if f["done"] < s]
        if not last:
            out.append((BEFORE, cycle))
        elif last[-1]["what"] == "nic_down":
            out.append((DOWN, cycle))
        else:
            out.append((AFTER if since_up < settle else HEALTHY, cycle))
            since_up += 1
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def median(xs):
    xs, n = sorted(xs), len(xs)
    if not n:
        return None
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def baseline(values, labs):
    """Per item, the healthy level at its place: a line through the medians of the runs of
    healthy items (H0 and H), each at its middle item, flat beyond the first and the last.
    Dividing by it takes out a drift that pooling would leave in (the down blocks and the
    settled ones sit at different places in each cycle)."""
    knots, run = [], []
    for i, (v, (lab, _)) in enumerate(zip(values, labs)):
        if lab in (HEALTHY, BEFORE):
            run.append((i, v))
        elif run:
            knots.append((sum(i for i, _ in run) / len(run), median([v for _, v in run])))
            run = []
    if run:
        knots.append((sum(i for i, _ in run) / len(run), median([v for _, v in run])))
    if not knots:
        return [1.0] * len(values)
    out, k = [], 0
    for i in range(len(values)):
        while k + 1 < len(knots) and knots[k + 1][0] <= i:
            k += 1
        (x0, y0), (x1, y1) = knots[k], knots[min(k + 1, len(knots) - 1)]
        out.append(y0 if i <= x0 or x1 == x0 else y0 + (y1 - y0) * (i - x0) / (x1 - x0))
    return out


def relative(values, labs):
    """VALUES over baseline(), times the median healthy value (so they keep their unit)."""
    level = baseline(values, labs)
    scale = median([v for v, (lab, _) in zip(values, labs) if lab in (HEALTHY, BEFORE)]) or 1.0
    return [v / x * scale if x else v for v, x in zip(values, level)]


def by_cycle(values, labs, a, b, detrend=True):
    """{cycle: {A: [values], B: [values]}}, the values relative() first if DETREND."""
    if detrend:
        values = relative(values, labs)
    by = {}
    for v, (lab, cyc) in zip(values, labs):
        if lab in (a, b):
            by.setdefault(cyc, {a: [], b: []})[lab].append(v)
    return by


def compare(values, labs, a, b, q=50, boot=2000, seed=1, ci=90, detrend=True):
    """The q-th percentile of VALUES labelled A against those labelled B, each value taken
    relative to baseline(): {'a', 'b' (in VALUES' unit: the percentiles of the relative values
    times the median healthy level), 'n_a', 'n_b', 'ratio' (a / b - 1), 'lo', 'hi' (the CI%
    bootstrap interval of the ratio, cycles drawn with replacement, each taking all its A and
    B items)}. Calibrated for medians (bench/NOTES.md); for a tail use compare_groups()."""
    by = by_cycle(values, labs, a, b, detrend)
    f = median if q == 50 else (lambda xs: pct(xs, q))
    xa = [v for c in by.values() for v in c[a]]
    xb = [v for c in by.values() for v in c[b]]
    out = {"a": f(xa), "b": f(xb), "n_a": len(xa), "n_b": len(xb), "cycles": len(by), "q": q}
    if not xa or not xb or not out["b"]:
        return out
    out["ratio"] = out["a"] / out["b"] - 1
    rng, keys, draws = random.Random(seed), list(by), []
    for _ in range(boot if len(keys) > 1 else 0):
        pick = [rng.choice(keys) for _ in keys]
        da = [v for k in pick for v in by[k][a]]
        db = [v for k in pick for v in by[k][b]]
        if da and db and f(db):
            draws.append(f(da) / f(db) - 1)
    if draws:
        draws.sort()
        tail = (100 - ci) / 200
        out["lo"] = draws[int(tail * (len(draws) - 1))]
        out["hi"] = draws[int((1 - tail) * (len(draws) - 1))]
    return out


def quantile(xs, q):
    """The q-th percentile read at rank q/100 * (n + 1), interpolated: an order statistic's
    expected share of the distribution is its rank over n + 1, so samples of different sizes
    are read at the same point of it (a nearest-rank p99 of 600 items sits lower in the tail
    than one of 900)."""
    xs, n = sorted(xs), len(xs)
    if not n:
        return None
    r = q / 100 * (n + 1) - 1
    if r <= 0 or n == 1:
        return xs[0]
    if r >= n - 1:
        return xs[-1]
    i = int(r)
    return xs[i] + (xs[i + 1] - xs[i]) * (r - i)


GROUPS, GROUP_K = 10, 3      # compare_groups: 10 groups, interval from the 3rd to the 8th ratio


def sign_coverage(groups, k):
    """Chance that the k-th smallest and the k-th largest of GROUPS independent estimates
    bracket their common median: 1 - 2 P(Binomial(groups, 1/2) < k)."""
    below = sum(math.comb(groups, i) for i in range(k)) / 2 ** groups
    return 1 - 2 * below


def compare_groups(values, labs, a, b, q=99, groups=GROUPS, k=GROUP_K, detrend=True):
    """A tail percentile of the items labelled A against those labelled B, robust to load
    bursts: the cycles are cut into GROUPS runs of consecutive cycles, in each the q-th
    quantile() of its A items is divided by that of its B items, and the ratio is the median of
    these GROUPS ratios; the interval runs from the k-th smallest to the k-th largest of them,
    distribution-free (sign_coverage: 89% for 10 and 3). Why not compare()'s bootstrap: a p99
    of a few thousand tokens is set by a few load bursts of seconds, which it takes for
    independent draws; on three fault-free jobs, relabelled, its 90% intervals held zero in
    about 75% of cases, these in 84% (bench/NOTES.md). Same keys as compare() ('a', 'b': the pooled
    percentiles, for show), plus 'groups', 'coverage' and 'ratios' (the group ratios, sorted)."""
    by = by_cycle(values, labs, a, b, detrend)
    xa = [v for c in by.values() for v in c[a]]
    xb = [v for c in by.values() for v in c[b]]
    out = {"a": quantile(xa, q), "b": quantile(xb, q), "n_a": len(xa), "n_b": len(xb),
           "cycles": len(by), "q": q, "groups": groups, "coverage": sign_coverage(groups, k)}
    keys = sorted(k2 for k2, c in by.items() if c[a] and c[b])
    if not xa or not xb or not out["b"] or len(keys) < 2:
        return out
    groups = min(groups, len(keys))          # a short run (smoke test): fewer, wider
    while k > 1 and sign_coverage(groups, k) < 0.85:
        k -= 1
    out.update(groups=groups, coverage=sign_coverage(groups, k))
    ratios = []
    for g in range(groups):
        part = keys[g * len(keys) // groups:(g + 1) * len(keys) // groups]
        ratios.append(quantile([v for c in part for v in by[c][a]], q) /
                      quantile([v for c in part for v in by[c][b]], q) - 1)
    ratios.sort()
    out.update(ratio=median(ratios), lo=ratios[k - 1], hi=ratios[groups - k], ratios=ratios)
    return out


def relabel(n, warm, block, settle, cycles):
    """[(label, cycle)] of N items by their index alone, as marks() schedules the link changes
    (no hit items; items past CYCLES cycles are WARM, left out): a fault-free job labelled
    as if its NIC had gone down, at any offset (a larger WARM)."""
    out = []
    for i in range(n):
        j = i - warm
        b, pos = (j // block, j % block) if j >= 0 else (-1, 0)
        c = (b - 1) // 2
        if b < 0 or c >= cycles:
            out.append((WARM, c if b > 0 else -1))
        elif b == 0:
            out.append((BEFORE, -1))
        elif b % 2:
            out.append((DOWN, c))
        else:
            out.append((AFTER if pos < settle else HEALTHY, c))
    return out


def calibrate(values, warm, block, settle, cycles, measure, shifts=16):
    """How MEASURE's interval behaves where nothing changed: the fault-free job VALUES is
    labelled by relabel() at SHIFTS offsets spread over a cycle (one cycle fewer, so each
    fits), and MEASURE(values, labs, label) (a compare() or compare_groups() for DOWN or
    AFTER against HEALTHY) run on each, both labels. {'runs', 'held' (intervals holding
    zero), 'width' (median hi - lo), 'abs_ratio' (median |ratio|)}. The offsets overlap, so
    'held' / 'runs' is a rough figure: far below the stated coverage means the intervals are
    too narrow."""
    rows = []
    for s in range(shifts):
        labs = relabel(len(values), warm + s * 2 * block // shifts, block, settle, cycles - 1)
        for lab in (DOWN, AFTER):
            x = measure(values, labs, lab)
            if x.get("lo") is not None:
                rows.append((x["ratio"], x["lo"], x["hi"]))
    if not rows:
        return {"runs": 0}
    return {"runs": len(rows), "held": sum(lo <= 0 <= hi for _, lo, hi in rows),
            "width": median([hi - lo for _, lo, hi in rows]),
            "abs_ratio": median([abs(r) for r, _, _ in rows])}


def counts(labs):
    """{label: items}."""
    out = {}
    for lab, _ in labs:
        out[lab] = out.get(lab, 0) + 1
    return out
