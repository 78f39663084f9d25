"""The one-host shared-memory section of bench/RESULTS.md (issue 20): r2comm's allreduce
against MPICH over its shared memory in the same job, 2 ranks (allreduce_shm, also shown in
the loopback section) and 4 ranks (allreduce_shm4), judged against the issue's targets.
Called by results.render(); a missing file makes the section say so, never raise."""
from .results_format import (MiB, SMALL, code, evaluate_sizes, fgb, fratio, fsize, fus,
                             label_of, rows_by_size, speed, table)

BUSBW_OF_MPI = 0.8                 # issue 20: busbw >= 0.8x MPICH over shared memory
BUSBW_RANGE = (64 << 10, 64 * MiB)  # ... at 64 KiB - 64 MiB
LATENCY_OF_MPI = 2.0               # issue 20: 8 B allreduce within 2x of MPICH's time


def shm_section(res):
    """(lines, targets) of the shared-memory section."""
    out = ["## Shared memory on one host (issue 20)", "",
           "Ranks on one host exchange bytes through shared-memory rings (r2comm/transport/shm.py), MPICH "
           "through its own shared memory; each job interleaves the two size by size (median over "
           "rounds; a ratio is r2comm's speed ÷ MPICH's, taken round by round). With 4 ranks on "
           "this machine's 2 CPUs both libraries run oversubscribed.", ""]
    targets = []
    for name, what in (("allreduce_shm", "2 ranks"), ("allreduce_shm4", "4 ranks")):
        doc = res.doc(name)
        if not doc:
            out += [f"- `{name}` ({what}): {res.why_missing(name)}.", ""]
            continue
        r2, mpi = rows_by_size(doc, "r2comm"), rows_by_size(doc, label_of(doc, "mpi", "shm"))
        n = doc.get("nranks")
        out += [f"- `{name}` ({n} ranks, {doc.get('settings', {}).get('rounds')} rounds):"]
        out += code(res.command(name, doc))
        rows = []
        for s in sorted(set(r2) & set(mpi)):
            a, b = r2[s], mpi[s]
            key, fmt = ("time_us", fus) if s < SMALL else ("busbw_GBps", fgb)
            rows.append([fsize(s), "time" if s < SMALL else "busbw, GB/s", fmt(a[key]),
                         fmt(b[key]), fratio(speed(a, b))])
        if name != "allreduce_shm":      # the 2-rank table is in the loopback section
            out += table(["size", "shown", "r2comm", "MPICH-shm", "r2comm / MPICH-shm"], rows) + [""]
        if r2.get(8) and mpi.get(8):
            factor = r2[8]["time_us"] / mpi[8]["time_us"]
            targets.append((f"{n} ranks: 8 B allreduce within {LATENCY_OF_MPI:g}× of MPICH over "
                            f"shared memory: **{'met' if factor <= LATENCY_OF_MPI else 'not met'}** "
                            f"({fus(r2[8]['time_us'])} vs {fus(mpi[8]['time_us'])}: "
                            f"{factor:.2f}× MPICH's time)", factor <= LATENCY_OF_MPI))
        text, ok = evaluate_sizes([(s, speed(r2.get(s), mpi.get(s))) for s in mpi],
                                  *BUSBW_RANGE, threshold=BUSBW_OF_MPI)
        head = (f"{n} ranks: busbw ≥ {BUSBW_OF_MPI:g}× MPICH over shared memory at "
                f"{fsize(BUSBW_RANGE[0])}–{fsize(BUSBW_RANGE[1])}: ")
        targets.append((head + (f"**{'met' if ok else 'not met'}** — " if ok is not None else "")
                        + text, ok))
    out += ["**Against the targets** (issue 20):", ""]
    out += [f"- {line}." for line, _ in targets] + [""]
    return out, targets
