"""bench/RESULTS.md, written from the JSON files of bench/run_all.sh.

    python -m r2comm.bench results bench/out -o bench/RESULTS.md

Reads the files that bench/run_all.sh writes into its output folder (the names
are in the section modules), and for each section prints
the command that produced it, tables of the medians with the ratios r2comm /
peer, and the issues' targets evaluated from these numbers.  A file that is
missing makes its section say "not run" (with the reason run_all.sh left in
NAME.skipped or NAME.failed, when there is one); nothing here raises on a
missing or partial result.  Every number in the output comes from the JSON;
the prose around the tables is fixed text.

Next to each NAME.json run_all.sh leaves NAME.cmd, the exact command line of
the step.  Without it (files made by hand) the command is rebuilt from the
JSON's argv and recorded environment.

The report is this module: the header, the sections in SECTIONS order and the "Targets at a
glance" table. Each section lives in a results_<name>.py module that imports only
results_format.py (the shared reader and formatting); adding one is a line in SECTIONS.
"""
import datetime
import os
import shutil
from typing import Callable, NamedTuple, Optional

from .results_failover import failover_section
from .results_failure import failure_section
from .results_format import Results, glance_rows, not_run_note
from .results_hier import hier_section
from .results_planner import planner_section
from .results_scale import scale_section
from .results_loopback import COLLECTIVES, allreduce_section, collectives_section, p2p_section
from .results_shm import shm_section
from .results_testbed import degraded_section, slow_rail_section, testbed_section
from .results_torch import sim_section, torch_section
from .results_torchdist import torchdist_section
from .results_verbs import verbs_section

FIGURES = ("allreduce.png", "failover_hard.png", "failover_silent.png", "testbed_timeline.png",
           "scale.png", "failure_scale.png", "testbed_fsdp2.png",
           "testbed_torch.png")


class Section(NamedTuple):
    """One section of the report: `build(res)` returns (lines, targets), targets being
    [(sentence, met: True/False/None)], listed under `area` in "Targets at a glance" (area None:
    not listed). When the section has no targets and `note_when_empty`, its "not run" sentence
    takes their place there."""
    build: Callable
    area: Optional[str] = None
    note_when_empty: bool = True


SECTIONS = (
    Section(allreduce_section, "Loopback allreduce", note_when_empty=False),
    Section(p2p_section),
    Section(collectives_section),
    Section(failover_section, "Loopback failover", note_when_empty=False),
    Section(testbed_section, "Testbed"),
    Section(degraded_section, "Degraded server"),
    Section(torch_section, "torch.distributed"),
    Section(torchdist_section, "torch backend vs Gloo"),
    Section(sim_section),
    Section(shm_section, "Shared memory"),
    Section(hier_section, "Hierarchical"),
    Section(planner_section, "Planner at scale"),
    Section(failure_section, "NIC failure at scale"),
    Section(scale_section, "Connections at scale"),
    Section(verbs_section, "Verbs rails"),
    Section(slow_rail_section),
)


def machine_facts(res):
    """Header lines: machine and versions from the first JSON that has them, dates of all."""
    names = (["allreduce_shm", "allreduce_shm4", "allreduce_tcp", "latency_shm", "latency_tcp", "bw_shm"] + list(COLLECTIVES)
             + ["failover_hard", "failover_silent", "single_rail", "acks", "acks_rev", "acks1", "acks1_rev"])
    docs = [d for d in (res.doc(n) for n in names) if d]
    times = [d["time"] for d in docs if isinstance(d.get("time"), (int, float))]
    lines = []
    m = next((d["machine"] for d in docs if d.get("machine")), None)
    libs = {}
    for d in docs:
        for lib in d.get("libraries", []):
            libs.setdefault(lib.get("name"), lib)
    if times:
        fmt = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")  # noqa
        when = fmt(min(times)) if fmt(min(times)) == fmt(max(times)) else f"{fmt(min(times))} – {fmt(max(times))}"
        lines.append(f"- **Measured:** {when} UTC, on host `{docs[0].get('host', '?')}`.")
    if m:
        cpus = f"{m.get('cpus')} CPUs" + (f" ({m['cpus_usable']} usable)" if m.get("cpus_usable") not in
                                          (None, m.get("cpus")) else "")
        lines.append(f"- **Machine:** {cpus}" + (f", {m['cpu_model']}" if m.get("cpu_model") else "")
                     + f"; {m.get('platform', '?')}.")
        v = m.get("versions", {})
        soft = [f"Python {m.get('python', '?')}"]
        soft += [f"{k} {v[k]}" for k in ("numpy", "mpi4py", "mpich", "torch") if k in v]
        lines.append("- **Software:** " + ", ".join(soft) + ".")
        mpi_lib = m.get("mpi_library") or libs.get("mpi", {}).get("library")
        if mpi_lib:
            lines.append(f"- **MPI library:** {' '.join(mpi_lib.split())}.")
        if m.get("r2comm_commit"):
            dirty = m["r2comm_commit"].endswith("+")
            lines.append(f"- **r2comm:** commit `{m['r2comm_commit'].rstrip('+')}`"
                         + (" with uncommitted changes in the working tree" if dirty else "") + ".")
    elif docs:
        lines.append(f"- **Python:** {docs[0].get('python', '?')} (these JSON files carry no machine record).")
    r2 = libs.get("r2comm")
    if r2:
        rails = ", ".join(r.get("address", "?") for r in r2.get("rails", []))
        lines.append(f"- **r2comm rails:** {rails}; environment "
                     + (", ".join(f"`{k}={v}`" for k, v in r2.get("env", {}).items()) or "default") + ".")
    return lines



def render(folder, elapsed_s=None):
    """The whole RESULTS.md as a string."""
    res = Results(folder)
    shown = folder.rstrip("/")
    lines = ["# r2comm benchmark results", "",
             "<!-- Generated by bench/run_all.sh (`python -m r2comm.bench results`) from the JSON files it "
             "wrote; edit r2comm/bench/results.py, not this file. -->", "",
             f"Regenerate with `bash bench/run_all.sh` (as root it also runs the testbed benches). Every number "
             f"below comes from the JSON files in `{shown}/`{' (not kept in git)' if shown == 'bench/out' else ''}, "
             f"which also holds the printed tables (`*.txt`), each step's command (`*.cmd`) and the plots. "
             f"2 ranks unless stated.", ""]
    lines += machine_facts(res)
    if elapsed_s is not None:
        lines.append(f"- **Run time:** bench/run_all.sh took {elapsed_s:.0f} s up to writing this file.")
    lines += ["", "Timings on a shared, small VM move from run to run, so compare libraries **within one table**: "
              "the harness interleaves the libraries size by size, starting each round with a different one, "
              "and reports the median over rounds.", ""]
    body, summary = [], []
    for section in SECTIONS:
        sec, targets = section.build(res)
        body += sec
        if section.area is not None:
            summary += glance_entries(section, sec, targets)
    lines += ["## Targets at a glance", ""] + glance_rows(summary) + [""]
    return "\n".join(lines + body).rstrip() + "\n"


def glance_entries(section, lines, targets):
    """[(area, target)] of one section for "Targets at a glance"."""
    if not targets and section.note_when_empty:
        return [(section.area, (not_run_note(lines), None))]
    return [(section.area, target) for target in targets]


def figures_shown(folder):
    return [f for f in FIGURES if os.path.exists(os.path.join(folder, f))]


def write(folder, output, elapsed_s=None, copy_figures=True):
    """Write OUTPUT from FOLDER; copy the figures it shows to figures/ next to OUTPUT. Returns the text."""
    text = render(folder, elapsed_s)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, output)
    if copy_figures:
        dest = os.path.join(os.path.dirname(os.path.abspath(output)), "figures")
        for name in figures_shown(folder):
            os.makedirs(dest, exist_ok=True)
            src = os.path.join(folder, name)
            if os.path.abspath(src) != os.path.abspath(os.path.join(dest, name)):
                shutil.copyfile(src, os.path.join(dest, name))
    return text


def results_cmd(args):
    text = write(args.folder, args.output, args.elapsed, not args.no_figures)
    print(f"# wrote {args.output} ({len(text.splitlines())} lines) from {args.folder}")
    return 0
