"""The "A NIC failure at scale" section of bench/RESULTS.md (issue 39), from failure_scale.json
(bench/failure_scale.py: one rank's production code from a NIC failure to the new plans, with
synthetic peers, 64 to 8,192 ranks x 8 NICs, every cache cold) and the figure
failure_scale.png. Called by results.render(); a missing file makes the section say so, never
raise."""
from .results_format import code, table

TITLE = "## A NIC failure at scale (issue 39)"
CPU_MS = {1024: 50.0, 8192: 200.0}        # issue 39: NIC failure to the new plan, per rank
ADDED_MIB = {1024: 20.0, 8192: 100.0}     # ... and the memory it adds
START_MS = {512: 1000.0}                  # start-up with a failed rail, per rank
PHASES = ("learn", "agree", "state", "plans")


def _ms(v):
    return "–" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.0f}")


def _added(r):
    """The memory a point adds: the larger of the Python heap's peak and the RSS grown."""
    vals = [r.get("heap_peak_mib"), r.get("rss_added_mib")]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return max(vals) if vals else None


def failure_section(res):
    """(lines, targets) of the NIC-failure-at-scale section."""
    out, doc = res.opening("failure_scale", TITLE)
    if not doc:
        return out, []
    out += ["One rank's production code from a NIC failure to its new plans, driven with "
            f"synthetic peers: {doc.get('ranks_per_host', 8)} ranks a host, "
            f"{doc.get('nics', 8)} NICs, the rank on host 0, NIC {doc.get('rail', 3)} of host "
            "H/2 announced down (*nic_down*), at half its rate (*nic_half*), or failed at "
            "start-up towards its ring neighbours' hosts (*start_rail*). Each point runs in a "
            "fresh process (every cache cold; the Engine of n peers and the Topology made "
            "before the timing). *learn*: the facts frame decoded and merged and applied to the "
            "Engine (start_rail: the start-up exchange's n reports validated and the facts "
            "derived); *agree*: the switch round's control-plane allgather of (limit, digest) "
            "as this rank runs it (every message there at once: no sockets) and the decision; "
            "*state*: the plan state from the facts; *plans*: the first plan of allreduce, "
            "allgather, reduce_scatter_block, bcast, reduce and alltoall (planner and the "
            "engine's Plan). CPU ms (process time); the memory a rank adds is the larger of "
            "the Python heap's peak (a second process traced) and the RSS grown.", ""]
    out += code(res.text("failure_scale.cmd") or doc.get("command") or "")
    rows, by = [], {}
    for r in doc.get("rows", []):
        if "error" in r:
            rows.append([str(r.get("ranks")), r.get("case", ""), "error"] + [""] * 7)
            continue
        by[(r["ranks"], r["case"])] = r
        rows.append([str(r["ranks"]), r["case"]] + [_ms(r.get(p + "_ms")) for p in PHASES] +
                    [_ms(r.get("total_ms")), f"{_added(r):.1f}" if _added(r) is not None
                     else "–", (r.get("algos") or {}).get("allreduce", "")])
    out += table(["ranks", "case", "learn", "agree", "state", "plans", "total CPU ms",
                  "MiB added", "allreduce plan"], rows) + [""]
    out += ["![CPU and memory per rank against n](figures/failure_scale.png)", ""]
    targets = []
    for n, lim in CPU_MS.items():
        got = [(r["total_ms"], _added(r)) for (m, c), r in by.items()
               if m == n and c in ("nic_down", "nic_half")]
        if not got:
            continue
        cpu, mem = max(g[0] for g in got), max(g[1] or 0.0 for g in got)
        ok = cpu <= lim and mem <= ADDED_MIB[n]
        targets.append((f"NIC failure to the new plans at {n} ranks x 8 NICs ≤ {lim:g} ms CPU "
                        f"and ≤ {ADDED_MIB[n]:g} MB added per rank: **{'met' if ok else 'not met'}"
                        f"** ({cpu:.0f} ms, {mem:.1f} MiB)", ok))
    for n, lim in START_MS.items():
        r = by.get((n, "start_rail"))
        if r:
            ok = r["total_ms"] <= lim
            targets.append((f"start-up with a failed rail at {n} ranks ≤ {lim / 1e3:g} s CPU per "
                            f"rank: **{'met' if ok else 'not met'}** ({r['total_ms']:.0f} ms)",
                            ok))
    return out, targets
