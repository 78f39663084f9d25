"""Interleaved fault blocks for small overheads: a NIC goes down for BLOCK items (training steps,
served tokens), comes back for BLOCK items, and so on, within one job. On a shared machine the
load drifts by more than the 1-3% to be judged between jobs and even between the halves of one;
alternating the states every few seconds puts the same drift into both, and a bootstrap over the
cycles says how far the estimate can be trusted. Pure Python: bench/testbed_torch.py records the
items and the wall times of the link changes, this module labels and compares them."""
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


def compare(values, labs, a, b, q=50, boot=2000, seed=1, ci=90, detrend=True):
    """The q-th percentile of VALUES labelled A against those labelled B, each value taken
    relative to baseline(): {'a', 'b' (in VALUES' unit: the percentiles of the relative values
    times the median healthy level), 'n_a', 'n_b', 'ratio' (a / b - 1), 'lo', 'hi' (the CI%
    bootstrap interval of the ratio, cycles drawn with replacement, each taking all its A and
    B items)}."""
    if detrend:
        level = baseline(values, labs)
        scale = median([v for v, (lab, _) in zip(values, labs) if lab in (HEALTHY, BEFORE)]) or 1.0
        values = [v / x * scale if x else v for v, x in zip(values, level)]
    by = {}
    for v, (lab, cyc) in zip(values, labs):
        if lab in (a, b):
            by.setdefault(cyc, {a: [], b: []})[lab].append(v)
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


def counts(labs):
    """{label: items}."""
    out = {}
    for lab, _ in labs:
        out[lab] = out.get(lab, 0) + 1
    return out
