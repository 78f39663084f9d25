"""The "Connections at scale" section of bench/RESULTS.md (issue 31), from scale.json
(bench/scale.py: one mpiexec job per rank count on loopback, shared memory off, every rank
measuring its start-up, its fds, RSS and pinned memory and its first allreduce) and the
figure scale.png (measured fds per rank and start-up time against n, with the full-mesh and the
connections-on-demand models to 1,024 ranks x 8 NICs). Called by results.render(); a missing
file makes the section say so, never raise."""
from .results_format import code, table

FDS_RATIO = 1.25        # issue 31: fds per rank at n = 32 within 1.25x of n = 8 ...
FDS_MAX = 64            # ... and at most 64
STARTUP_RATIO = 2.0     # start-up at n = 32 at most 2x that at n = 8
TITLE = "## Connections at scale (issue 31)"


def _mm(s, key, fmt):
    v = s.get(key) or {}
    if "median" not in v:
        return "–"
    return f"{v['median']:{fmt}} / {v['max']:{fmt}}"


def _bytes(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _targets(by):
    """[(sentence, met)] of the issue's targets that the summaries at n = 8 and 32 decide."""
    a, b = by.get(8), by.get(32)
    if not (a and b):
        return [("fds and start-up at 32 ranks against 8: not measured (needs n = 8 and 32)",
                 None)]
    out = []
    for stat in ("median", "max"):
        x, y = a["fds_r2comm"][stat], b["fds_r2comm"][stat]
        ok = y <= FDS_RATIO * x and b["fds_mix"][stat] <= FDS_MAX + b["fds_before"][stat]
        out.append((f"r2comm's fds per rank at 32 ranks within {FDS_RATIO:g}x of 8 and at most "
                    f"{FDS_MAX} ({stat} over ranks): **{'met' if ok else 'not met'}** "
                    f"({y:.0f} against {x:.0f}, {y / x:.2f}x)", ok))
    x, y = a["startup_s"]["max"], b["startup_s"]["max"]
    ok = y <= STARTUP_RATIO * x
    out.append((f"start-up at 32 ranks at most {STARTUP_RATIO:g}x that at 8 (slowest rank): "
                f"**{'met' if ok else 'not met'}** ({y:.2f} s against {x:.2f} s, {y / x:.2f}x)",
                ok))
    return out


def scale_section(res):
    """(lines, targets) of the connections-at-scale section."""
    out, doc = res.opening("scale", TITLE)
    if not doc:
        return out, []
    cfg = doc.get("config") or {}
    loads = [v for v in doc.get("loadavg") or [] if isinstance(v, (int, float))]
    out += [f"One mpiexec job per rank count on this machine ({doc.get('cpus', '?')} CPUs): "
            f"{cfg.get('rails', '?')} loopback rails, shared memory off (every pair a network "
            "pair, as between hosts), "
            + (f"`R2COMM_ALGO={cfg['algo']}`, " if cfg.get("algo") else "")
            + "a rank's fds counted in /proc/self/fd. *r2comm fds*: after start-up and a mix "
            "(4 MiB allreduce, 1 MiB bcast, 64 KiB-per-rank allgather, 8 B allreduce) less "
            "before the Communicator; *start-up*: `Communicator()` from a common barrier, and the CPU "
            "time the rank's process spent in it (the n ranks share this machine's cores); "
            "*model*: what today's connections-on-demand model gives (bench/scale.py "
            "`model_on_demand`) and what the full mesh held before issue 31. Median / max over "
            "ranks."
            + (f" Load average (1 min) during the run: {min(loads):.1f}–{max(loads):.1f}."
               if loads else ""), ""]
    out += code(doc.get("command"))
    rows, by = [], {}
    for s in doc.get("summaries") or []:
        by[s["n"]] = s
        rows.append([str(s["n"]), _mm(s, "startup_s", ".2f"), _mm(s, "startup_cpu_ms", ".1f"),
                     _mm(s, "fds_r2comm", ".0f"),
                     str(s.get("on_demand_fds", "–")), str(s.get("model_fds", "–")),
                     _mm(s, "rss_mib", ".0f"), f"{(s.get('pinned_kib') or {}).get('max', 0):.0f}",
                     _mm(s, "first_ms", ".1f"), str((s.get("rails_down") or {}).get("max", "–"))])
    out += table(["ranks", "start-up, s", "its CPU, ms", "r2comm fds", "model (on demand)", "full mesh",
                  "RSS, MiB", "pinned, KiB", "first 1 MiB allreduce, ms", "rails down"], rows)
    for n, why in (doc.get("skipped") or {}).items():
        out.append(f"- n = {n}: {why}")
    out.append("")
    cpus = doc.get("cpus")
    busy = [(n, s) for n, s in sorted(by.items()) if (s.get("startup_cpu_ms") or {}).get("median")]
    if cpus and busy:
        parts = [f"{n} ranks: {n * s['startup_cpu_ms']['median'] / 1e3 / cpus:.2f} s against "
                 f"{s['startup_s']['max']:.2f} s" for n, s in busy]
        out += ["Every rank runs on this machine's " f"{cpus} CPUs at once, so a start-up cannot "
                "take less wall time than the ranks' CPU time shared over them (n x its CPU / "
                f"CPUs): {'; '.join(parts)}. With more ranks than cores the start-up here is that "
                "CPU, not waiting (on a cluster each rank has its own cores).", ""]
    models = doc.get("model_1024") or []
    big = [m for m in models if m.get("n") == 1024]
    if big:
        out += ["Extrapolated to 1,024 ranks x 8 NICs per rank (the models above; fds without "
                "MPI's and Python's own; verbs: one RC queue pair per peer and rail; *full mesh*: "
                "before issue 31, every pair connected and a registered slab of 3 MiB per queue "
                "pair; *on demand*: the peers the plans use, and one slot pool per device "
                "shared by its queue pairs):", ""]
        out += table(["connections", "transport", "peers", "fds", "verbs QPs", "pinned"],
                     [[m.get("model", "full_mesh").replace("_", " "), m["transport"],
                       str(m.get("peers", 1023)), str(m["fds"]), str(m["qps"]),
                       _bytes(m["pinned_bytes"])] for m in big])
        out.append("")
    cost = [r for r in doc.get("records_cost") or [] if r.get("n")]
    if cost:
        out += ["What of a rank's start-up grows with n: the three collectives take log2 n rounds "
                "each, and every rank decodes and validates every rank's endpoint record (then "
                "judges the fd budgets, finds its local peers and the communicator's topology; "
                "bench/scale.py `records_cost`, synthetic records of "
                f"{cost[0].get('nics', 8)} NICs, CPU in one process): "
                + "; ".join(f"{r['n']:,} ranks {r['ms']:.0f} ms ({r['us_per_rank']:.0f} µs a "
                            f"rank, {r['record_bytes'] / 2**20:.1f} MiB of records)" for r in cost)
                + ".", ""]
    out += ["![fds and start-up against the number of ranks](figures/scale.png)", ""]
    return out, _targets(by)
