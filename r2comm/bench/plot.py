"""PNG output: bandwidth (or latency) vs message size, and the failover timeline.

matplotlib is imported here only, with the Agg backend, so benchmarks run on
headless nodes and the timing modules do not pay for the import.
"""
import numpy as np

from .sizes import human


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# (result key, axis label, log y) of the panels drawn for each kind of sweep
PANELS = {
    "latency": [("time_us", "latency (us)", True)],
    "bw": [("MBps", "bandwidth (MB/s)", False)],
}
COLLECTIVE_PANELS = [("busbw_GBps", "busbw (GB/s)", False), ("time_us", "time (us)", True)]


def plot_sweep(docs, path, names=None):
    """Bandwidth (and, for collectives, time) vs size: one line per library per document.

    Labels repeated across documents (r2comm in a shm run and a TCP run, say)
    get the document's name appended.
    """
    plt = _pyplot()
    kinds = sorted({d["bench"] for d in docs})
    panels = PANELS.get(kinds[0], COLLECTIVE_PANELS) if len(kinds) == 1 else COLLECTIVE_PANELS[:1]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(8, 3.2 + 2.6 * len(panels)))
    used = set()
    for i, doc in enumerate(docs):
        for label, rows in doc["results"].items():
            shown = label if label not in used else f"{label} ({names[i] if names else i})"
            used.add(label)
            sizes = [r["size"] for r in rows]
            for ax, (key, _, _) in zip(axes[:, 0], panels):
                ax.plot(sizes, [r[key] for r in rows], marker="o", markersize=3, label=shown)
    ticks = sorted({r["size"] for d in docs for rows in d["results"].values() for r in rows})
    ticks = ticks[::max(1, len(ticks) // 12)]
    for ax, (_, ylabel, logy) in zip(axes[:, 0], panels):
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    bottom = axes[-1, 0]
    bottom.set_xticks(ticks)
    bottom.set_xticklabels([human(t) for t in ticks], rotation=45)
    bottom.set_xlabel("message size (bytes)")
    axes[0, 0].legend()
    axes[0, 0].set_title(f"{'/'.join(kinds)}, {docs[0]['nranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rates(t, counters, bin_s):
    """Throughput (bytes/s) per bin from cumulative counters sampled at times `t`.

    Counters are interpolated at the bin edges, so uneven sampling (a late
    sampler tick) moves bytes between neighbouring bins instead of creating spikes.
    counters: array (samples, rails).  Returns (bin centres, rates (bins, rails)).
    """
    t = np.asarray(t, float)
    c = np.asarray(counters, float)
    full_bins = int(np.floor((t[-1] - t[0]) / bin_s + 1e-9))  # a partial last bin would dip
    edges = t[0] + np.arange(full_bins + 1) * bin_s
    at = np.column_stack([np.interp(edges, t, c[:, k]) for k in range(c.shape[1])])
    return (edges[1:] + edges[:-1]) / 2, np.diff(at, axis=0) / bin_s


def plot_failover(report, path, bin_s=0.05):
    """Two panels sharing time: per-rail and total send throughput of one rank, and op times.

    The injected fault (or the first detection) and later events are marked.
    """
    plt = _pyplot()
    rank = report["plot_rank"]
    data = report["ranks"][rank]
    t0 = data["t0"]
    samples = data["samples"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[3, 2])
    if len(samples["t"]) >= 2:
        centres, r = rates(np.asarray(samples["t"]) - t0, samples["bytes_sent"], bin_s)
        for k in range(r.shape[1]):
            top.plot(centres, r[:, k] / 1e9, label=f"rail {k}")
        top.plot(centres, r.sum(axis=1) / 1e9, color="black", linewidth=1.5, label="total")
    top.set_ylabel(f"rank {rank} send GB/s ({int(bin_s * 1e3)} ms bins)")
    ops = np.asarray(data["ops"]) - t0
    if ops.size >= 2:
        bottom.plot(ops[1:], np.diff(ops) * 1e3, ".", markersize=3, color="tab:blue")
    bottom.set_ylabel("op time (ms)")
    bottom.set_xlabel("time since start (s)")
    fault = report.get("t_fault")
    for ax in (top, bottom):
        if fault is not None:
            ax.axvline(fault - t0, color="red", linestyle="--", label="fault" if ax is top else None)
        if report.get("t_restore") is not None:
            ax.axvline(report["t_restore"] - t0, color="green", linestyle="--",
                       label="restore" if ax is top else None)
        ax.grid(True, alpha=0.3)
    for ev in data.get("events", []):
        if ev.get("t") is not None:
            top.axvline(ev["t"] - t0, color="grey", linewidth=0.6, alpha=0.6)
    top.legend(loc="upper right", fontsize=8)
    top.set_title(report["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scale(report, path):
    """bench/scale.py's report: r2comm's fds per rank (median and max over ranks) and start-up
    time against n, with the full-mesh and connections-on-demand models out to 1,024 ranks."""
    plt = _pyplot()
    sums = sorted(report.get("summaries") or [], key=lambda s: s["n"])
    models = report.get("model_1024") or []
    rails = (report.get("config") or {}).get("rails", 2)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    if sums:
        ns = [s["n"] for s in sums]
        ax1.plot(ns, [s["fds_r2comm"]["median"] for s in sums], "o-", label="measured, median")
        ax1.plot(ns, [s["fds_r2comm"]["max"] for s in sums], "s--", label="measured, max")
        ax1.plot(ns, [s["model_fds"] for s in sums], "x:", label=f"full mesh ({rails} rails)")
        ax2.plot(ns, [s["startup_s"]["median"] for s in sums], "o-", label="median")
        ax2.plot(ns, [s["startup_s"]["max"] for s in sums], "s--", label="slowest rank")
    for kind, style in (("full_mesh", "^-"), ("on_demand", "v-")):
        rows = sorted((m for m in models if m.get("model") == kind and m["transport"] == "tcp"),
                      key=lambda m: m["n"])
        if rows:
            ax1.plot([m["n"] for m in rows], [m["fds"] for m in rows], style, alpha=0.6,
                     label=f"model, {kind.replace('_', ' ')}, {rows[0]['nics']} NICs")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("ranks")
    ax1.set_ylabel("r2comm's fds per rank")
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("start-up (s)")
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)
    fig.suptitle("Connections at scale (loopback, shared memory off)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
