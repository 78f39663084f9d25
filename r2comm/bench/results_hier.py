"""The hierarchical-collectives section of bench/RESULTS.md (issue 20), from testbed_hier.json
of bench/testbed_hier.py: hierarchical vs flat-ring allreduce on the netns testbed, healthy and
with one NIC of one host down. Called by results.render(); a missing or partial file makes the
section say so, never raise."""
from .results_format import NOT_ROOT, code, table

HIER_OVER_FLAT = 1.3     # issue 20: hierarchical busbw >= 1.3x the flat ring at 64 MiB
OF_SURVIVING = 0.9       # issue 20: after a NIC of one host fails, >= 0.9x what the NICs allow


def hier_section(res):
    """(lines, targets) of the hierarchical section."""
    out, doc = res.opening("testbed_hier", "## Hierarchical allreduce in the testbed (issue 20)",
                           NOT_ROOT)
    if not doc:
        return out, []
    cfg = doc.get("config", {})
    size = cfg.get("size", 0)
    out += [f"{cfg.get('hosts')} hosts × {cfg.get('nics')} rail NICs at {cfg.get('rate')} (tbf) × "
            f"{cfg.get('ranks_per_host')} ranks per host; allreduce of {size >> 20} MiB float32, the plan "
            "forced hierarchical (intra-host reduce-scatter, inter-host allreduce per slice, intra-host "
            "allgather) or flat (the ring), interleaved round by round in one job per phase "
            f"({cfg.get('rounds')} rounds of {cfg.get('iters')}); time = the slowest rank's; busbw = size / time "
            "× 2(n−1)/n. *NIC bound*: what host 0's NICs allow the hierarchical plan (each NIC carries "
            "1.0 × size per direction, against 1.5 × for the ring over 4 ranks). Every result checked.", ""]
    out += code(res.text("testbed_hier.cmd") or "sudo .venv/bin/python bench/testbed_hier.py")
    rows, targets = [], []
    for phase, label in (("healthy", "healthy"), ("host0_nic1_down", "host 0's nic1 down")):
        p = (doc.get("phases") or {}).get(phase)
        if not p:
            rows.append([label, "–", "–", "–", "–", "not run"])
            continue
        mb, bound = p.get("median_busbw", {}), p.get("nic_bound_busbw", {})
        h, f = mb.get("hierarchical"), mb.get("flat")
        of_bound = h / bound["hierarchical"] if h and bound.get("hierarchical") else None
        rows.append([label, f"{h / 1e6:.0f}" if h else "–", f"{f / 1e6:.0f}" if f else "–",
                     f"{p.get('median_ratio', 0):.2f}x",
                     f"{of_bound:.2f}" if of_bound else "–", p.get("wrong", "?")])
        if phase == "healthy" and p.get("median_ratio"):
            targets.append((f"hierarchical allreduce busbw {p['median_ratio']:.2f}x the flat ring at "
                            f"{size >> 20} MiB (target ≥ {HIER_OVER_FLAT}x)",
                            p["median_ratio"] >= HIER_OVER_FLAT))
        if phase != "healthy" and of_bound:
            targets.append((f"with a NIC of one host down, hierarchical busbw {of_bound:.2f} of what the "
                            f"surviving NIC allows (target ≥ {OF_SURVIVING})", of_bound >= OF_SURVIVING))
    out += table(["phase", "hierarchical busbw, MB/s", "flat ring busbw, MB/s",
                  "flat time / hierarchical time (median round)", "hierarchical / NIC bound",
                  "wrong results"], rows) + [""]
    return out, targets
