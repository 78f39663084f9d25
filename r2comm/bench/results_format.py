"""What the sections of bench/RESULTS.md share: the reader of run_all.sh's output folder,
number and table formatting, sweep look-ups, target sentences and the 'Targets at a glance' rows.

Imports no section and not the report (results.py), so every section module
(results_<name>.py) imports only this one."""
import json
import os
import shlex

from .report import medians_ratio, speed_ratio

MiB = 1 << 20
SMALL = 64 << 10  # allreduce sizes below this are shown as time per call, from this on as busbw
TARGET_RANGE = (1 * MiB, 64 * MiB)  # issue 6: busbw targets at 1-64 MiB
SURVIVE_FRACTION = 0.90  # issue 3 / issue 6: >= 90% of a healthy single rail / surviving capacity
DEFAULT_RAIL_TIMEOUT_MS = 500.0  # r2comm.config default of R2COMM_RAIL_TIMEOUT_MS
NOT_ROOT = "not run (needs root: the testbed uses network namespaces; `sudo bash bench/run_all.sh`)"

# ------------------------------------------------------------------------------- loading

class Results:
    """The files of one output folder, loaded once; missing or unreadable files are None."""

    def __init__(self, folder):
        self.folder = folder
        self.docs, self.problems = {}, {}

    def path(self, name):
        return os.path.join(self.folder, name)

    def doc(self, name):
        """NAME.json as a dict, or None (the reason is kept for why_missing())."""
        if name not in self.docs:
            path = self.path(f"{name}.json")
            try:
                with open(path) as f:
                    self.docs[name] = json.load(f)
            except FileNotFoundError:
                self.docs[name] = None
            except (OSError, ValueError) as exc:
                self.docs[name] = None
                self.problems[name] = f"unreadable {name}.json ({exc})"
        return self.docs[name]

    def text(self, name):
        try:
            with open(self.path(name)) as f:
                return f.read().strip()
        except OSError:
            return None

    def why_missing(self, name, default=None):
        """Why NAME.json is absent: run_all.sh's NAME.skipped / NAME.failed note, or a default."""
        if name in self.problems:
            return self.problems[name]
        skipped = self.text(f"{name}.skipped")
        if skipped:
            return f"not run ({skipped})"
        failed = self.text(f"{name}.failed")
        if failed:
            return f"failed ({failed}); see `{name}.txt`"
        return default or f"not run (no `{name}.json` in the results folder)"

    def opening(self, name, title, default=None):
        """(lines, doc) that open a section built from NAME.json: its title, and when the file
        is missing the sentence that says why (then doc is None)."""
        doc = self.doc(name)
        out = [title, ""]
        if not doc:
            out += [f"{self.why_missing(name, default).capitalize()}.", ""]
        return out, doc

    def command(self, name, doc):
        """The command line of a step: NAME.cmd from run_all.sh, else rebuilt from the JSON."""
        cmd = self.text(f"{name}.cmd")
        if cmd:
            return cmd
        if doc is None:
            return None
        if doc.get("bench") in ("testbed_failover", "testbed_degraded"):
            return None
        env = {}
        for lib in doc.get("libraries", []):
            if lib.get("name") == "mpi" and lib.get("transport") != "shm":
                env.update(lib.get("env", {}))
        for key in ("R2COMM_ACKS",):
            value = _r2comm_env(doc).get(key)
            if value is not None:
                env[key] = value
        prefix = "".join(f"{k}={shlex.quote(str(v))} " for k, v in env.items())
        argv = " ".join(shlex.quote(str(a)) for a in doc.get("argv", []))
        return f"{prefix}mpiexec -n {doc.get('nranks', '?')} python -m r2comm.bench {argv}"


def _r2comm_env(doc):
    if "env" in doc:  # failover records
        return doc["env"]
    for lib in doc.get("libraries", []):
        if lib.get("name") == "r2comm":
            return lib.get("env", {})
    return {}


# ------------------------------------------------------------------------------- formatting

def fsize(n):
    """8 B, 64 KiB, 1 MiB, 1.5 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def fnum(v, digits=3):
    """A number with `digits` significant digits ('–' for None)."""
    if v is None:
        return "–"
    if abs(v) >= 10 ** digits:
        return f"{v:.0f}"
    return f"{v:.{digits}g}" if abs(v) >= 1 else f"{v:.{digits}f}".rstrip("0").rstrip(".") or "0"


def fratio(v):
    """Ratios: two decimals, fewer digits for big ones."""
    if v is None:
        return "–"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def fms(seconds, digits=1):
    return "–" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def fus(us):
    return "–" if us is None else (f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs")


def fgb(v):
    return "–" if v is None else f"{v:.3f}"


def fbytes(n):
    return "–" if n is None else fsize(int(n))


def fpct(v):
    return "–" if v is None else f"{v * 100:.1f}%"


def span(values, fmt=fratio, suffix="×"):
    values = sorted(values)
    if not values:
        return ""
    if len(values) == 1 or fmt(values[0]) == fmt(values[-1]):
        return f"{fmt(values[0])}{suffix}"
    return f"{fmt(values[0])}–{fmt(values[-1])}{suffix}"


def sizes_list(sizes):
    """'1, 2, 4 MiB' when all share a unit, else '512 KiB, 1 MiB'."""
    parts = [fsize(s).split(" ") for s in sizes]
    if len({p[1] for p in parts}) == 1:
        return ", ".join(p[0] for p in parts) + " " + parts[0][1]
    return ", ".join(" ".join(p) for p in parts)


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def verdict(ok):
    return "met" if ok else "not met"


def code(cmd):
    """A command as a Markdown code block (indented: keeps long lines intact)."""
    return ["", *("    " + line for line in cmd.splitlines()), ""]


# ------------------------------------------------------------------------------- sweeps

def rows_by_size(doc, label):
    """{size: metrics row} of one library in a sweep JSON (empty when absent)."""
    if not doc:
        return {}
    return {r["size"]: r for r in doc.get("results", {}).get(label, [])}


def label_of(doc, name, transport=None):
    """The result label of library NAME (mpi: with the given transport) in DOC, or None."""
    for lib in (doc or {}).get("libraries", []):
        if lib.get("name") == name and (transport is None or lib.get("transport") == transport):
            return lib.get("label")
    return None


def speed(a, b, paired=True):
    """How many times faster row a is than row b: peer time / r2comm time in each round, median
    over rounds (report.speed_ratio), or with paired=False the ratio of the two medians; None
    if either is absent."""
    if not a or not b or not a.get("time_us") or not b.get("time_us"):
        return None
    return speed_ratio(a, b) if paired else medians_ratio(a, b)


def disagreement(r2rows, peer_rows, lo=TARGET_RANGE[0], hi=TARGET_RANGE[1], threshold=1.0):
    """'; the ratio of the medians is ... at SIZE' for the sizes in lo..hi where it falls on the
    other side of the threshold from the per-round ratio; '' where they agree."""
    odd = []
    for s in sorted(peer_rows):
        a, b = r2rows.get(s), peer_rows.get(s)
        p, m = speed(a, b), speed(a, b, paired=False)
        if lo <= s <= hi and p is not None and m is not None and (p >= threshold) != (m >= threshold):
            odd.append(f"{fratio(m)}× at {fsize(s)}")
    return f"; the ratio of the two medians is {', '.join(odd)}" if odd else ""


def evaluate_sizes(pairs, lo, hi, threshold=1.0):
    """Sentence for a '>= threshold at lo..hi' target from [(size, ratio)]; (text, met or None)."""
    inside = [(s, r) for s, r in sorted(pairs) if lo <= s <= hi and r is not None]
    if not inside:
        return f"not evaluated (no sizes in {fsize(lo)}–{fsize(hi)} were measured)", None
    good = [(s, r) for s, r in inside if r >= threshold]
    bad = [(s, r) for s, r in inside if r < threshold]
    missing = ""
    measured = {s for s, _ in inside}
    want = [s for s in (lo << k for k in range(64)) if s <= hi]
    absent = [s for s in want if s not in measured]
    if absent:
        missing = f" (not measured: {sizes_list(absent)})"
    if not bad:
        return f"at every size measured ({sizes_list([s for s, _ in good])}: {span([r for _, r in good])}){missing}", True
    if not good:
        return f"at no size ({sizes_list([s for s, _ in bad])}: {span([r for _, r in bad])}){missing}", False
    return (f"met at {sizes_list([s for s, _ in good])} ({span([r for _, r in good])}), "
            f"not met at {sizes_list([s for s, _ in bad])} ({span([r for _, r in bad])}){missing}", False)


# ------------------------------------------------------------------------------- the glance table

def not_run_note(section):
    """The first paragraph of a section that has no results (its 'not run' sentence)."""
    return next((line.rstrip(".") for line in section[1:] if line), "not run")


def glance_rows(summary):
    """'Targets at a glance' rows from [(area, (sentence, met: True/False/None))]."""
    return table(["area", "target and result", "status"],
                 [[area, text.replace("**", "").replace("|", "\\|"),
                   ("✅ met" + (" where measured" if "not measured" in text else "")) if ok else
                   ("❌ not met" if ok is False else "– not evaluated")]
                  for area, (text, ok) in summary])
