"""The loopback sections of bench/RESULTS.md (issue 2, issue 6): allreduce against MPI over TCP,
MPI over shared memory and Gloo; point-to-point latency and bandwidth; the other collectives.
Called by results.render(); a missing file makes a section say so, never raise."""
import os

from .results_format import (MiB, SMALL, TARGET_RANGE, code, disagreement, evaluate_sizes, fgb,
                             fnum, fratio, fsize, fus, label_of, rows_by_size, span, speed, table,
                             verdict)

LATENCY_FACTOR = 3.0  # issue 6: 8 B allreduce within 3x of MPI over TCP
COLLECTIVES = ("allgather", "reduce_scatter", "bcast", "alltoall")


def allreduce_section(res):
    """(lines, targets) of the loopback allreduce section."""
    shm, tcp = res.doc("allreduce_shm"), res.doc("allreduce_tcp")
    out = ["## Allreduce on one host, loopback (issue 2, issue 6)", ""]
    if not shm and not tcp:
        return out + [f"Not run: allreduce_shm {res.why_missing('allreduce_shm')}; "
                      f"allreduce_tcp {res.why_missing('allreduce_tcp')}.", ""], []
    out += ["Two jobs, each interleaving r2comm with its peers size by size (median over rounds, "
            "time of the slowest rank). A ratio is r2comm's speed ÷ the peer's, measured in the "
            "same job: > 1 means r2comm is faster. It is taken round by round (each round runs "
            "both libraries back to back) and the median over rounds is shown: this VM's speed "
            "drifts between rounds for both libraries at once, which the per-round ratio cancels. "
            "The time and busbw columns are each library's own median, so where the machine "
            "drifted a ratio can differ from the quotient of two columns; the targets below name "
            "the sizes where the ratio of the medians falls on the other side of 1. busbw in GB/s "
            "as in nccl-tests (algbw × 2(n−1)/n).", ""]
    for name, doc, what in (("allreduce_tcp", tcp, "r2comm vs MPI forced onto TCP over 127.0.0.1"),
                            ("allreduce_shm", shm, "r2comm vs MPI over shared memory vs Gloo")):
        if doc:
            rounds = doc.get("settings", {}).get("rounds")
            out += [f"- `{name}` ({what}, {doc.get('nranks')} ranks, {rounds} round{'' if rounds == 1 else 's'}):"]
            out += code(res.command(name, doc))
        else:
            out += [f"- `{name}` ({what}): {res.why_missing(name)}.", ""]
    tcp_r2, tcp_mpi = rows_by_size(tcp, "r2comm"), rows_by_size(tcp, label_of(tcp, "mpi", "tcp"))
    shm_r2, shm_mpi = rows_by_size(shm, "r2comm"), rows_by_size(shm, label_of(shm, "mpi", "shm"))
    gloo = rows_by_size(shm, label_of(shm, "gloo"))
    sizes = sorted(set(tcp_r2) | set(shm_r2))

    def cells(size, value):
        return [value(tcp_r2.get(size)), value(tcp_mpi.get(size)), fratio(speed(tcp_r2.get(size), tcp_mpi.get(size))),
                value(shm_r2.get(size)), value(shm_mpi.get(size)), fratio(speed(shm_r2.get(size), shm_mpi.get(size))),
                value(gloo.get(size)), fratio(speed(shm_r2.get(size), gloo.get(size)))]

    head = ["r2comm", "MPI-TCP", "r2comm / MPI-TCP", "r2comm", "MPI-shm", "r2comm / MPI-shm", "Gloo",
            "r2comm / Gloo"]
    small = [s for s in sizes if s < SMALL]
    big = [s for s in sizes if s >= SMALL]
    out += ["The first three columns are from the TCP job, the others from the shm/Gloo job.", ""]
    if small:
        out += [f"**Small messages: time per allreduce** (µs){'' if gloo else '; Gloo not in this run'}", ""]
        out += table(["size"] + head, [[fsize(s)] + cells(s, lambda r: fnum(r["time_us"]) if r else "–")
                                       for s in small]) + [""]
    if big:
        out += ["**Large messages: busbw** (GB/s)", ""]
        out += table(["size"] + head, [[fsize(s)] + cells(s, lambda r: fgb(r["busbw_GBps"]) if r else "–")
                                       for s in big]) + [""]
    out += ["**Against the targets** (issue 6):", ""]
    targets = []
    lat = (tcp_r2.get(8), tcp_mpi.get(8))
    if all(lat):
        factor = lat[0]["time_us"] / lat[1]["time_us"]
        ok = factor <= LATENCY_FACTOR
        line = (f"8 B allreduce latency within {LATENCY_FACTOR:g}× of MPI over TCP: **{verdict(ok)}** "
                f"({fus(lat[0]['time_us'])} vs {fus(lat[1]['time_us'])}: r2comm takes {factor:.2f}× MPI's time)")
    else:
        ok, line = None, ("8 B allreduce latency within 3× of MPI over TCP: not evaluated "
                          "(no 8 B result of both r2comm and MPI-TCP)")
    targets.append((line, ok))
    for title, r2rows, peer_rows in (("MPI over TCP", tcp_r2, tcp_mpi), ("Gloo", shm_r2, gloo)):
        text, ok = evaluate_sizes([(s, speed(r2rows.get(s), peer_rows.get(s))) for s in peer_rows], *TARGET_RANGE)
        text += disagreement(r2rows, peer_rows)
        head = f"busbw ≥ 1.0× {title} at {fsize(TARGET_RANGE[0])}–{fsize(TARGET_RANGE[1])}: "
        if ok is None:
            targets.append((head + text, None))
        elif ok or text.startswith("at no size"):
            targets.append((head + f"**{verdict(ok)}** {text}", ok))
        else:
            targets.append((head + f"**not met** — {text}", ok))
    shm_pairs = [(s, speed(shm_r2.get(s), shm_mpi.get(s))) for s in shm_mpi]
    inside = [r for s, r in shm_pairs if TARGET_RANGE[0] <= s <= TARGET_RANGE[1] and r is not None]
    if inside:
        out_line = (f"Ratio to MPI over shared memory (the ceiling on one machine, no target) at 1–64 MiB: "
                    f"{span(inside)}")
    else:
        out_line = "Ratio to MPI over shared memory: not measured at 1–64 MiB"
    out += [f"- {line}." for line, _ in targets] + [f"- {out_line}.", ""]
    out += ["On one machine the loopback rails share the same CPUs, so a second rail adds no bandwidth "
            "here; the multi-NIC gain is measured in the testbed section.", ""]
    if os.path.exists(res.path("allreduce.png")):
        out += ["![allreduce busbw vs size](figures/allreduce.png)", ""]
    return out, targets


def p2p_section(res):
    """(lines, no targets): ping-pong latency and streaming bandwidth, briefly."""
    out = ["## Point to point: ping-pong latency and streaming bandwidth", ""]
    lat_shm, lat_tcp, bw = res.doc("latency_shm"), res.doc("latency_tcp"), res.doc("bw_shm")
    if not (lat_shm or lat_tcp or bw):
        return out + ["Not run: " + "; ".join(f"{n} {res.why_missing(n)}" for n in
                                              ("latency_shm", "latency_tcp", "bw_shm")) + ".", ""], []
    for name, doc in (("latency_shm", lat_shm), ("latency_tcp", lat_tcp), ("bw_shm", bw)):
        if doc:
            out += [f"- `{name}`:"] + code(res.command(name, doc))
        else:
            out += [f"- `{name}`: {res.why_missing(name)}.", ""]
    if lat_shm or lat_tcp:
        r_t, m_t = rows_by_size(lat_tcp, "r2comm"), rows_by_size(lat_tcp, label_of(lat_tcp, "mpi", "tcp"))
        r_s, m_s = rows_by_size(lat_shm, "r2comm"), rows_by_size(lat_shm, label_of(lat_shm, "mpi", "shm"))
        g = rows_by_size(lat_shm, label_of(lat_shm, "gloo"))
        sizes = [s for s in (1, 8, 1024, 65536, MiB) if s in r_t or s in r_s]
        out += ["**One-way latency** (µs; ratio = r2comm speed ÷ peer speed, same job)", ""]
        out += table(["size", "r2comm", "MPI-TCP", "r2comm / MPI-TCP", "r2comm", "MPI-shm", "r2comm / MPI-shm",
                      "Gloo", "r2comm / Gloo"],
                     [[fsize(s), fnum(r_t[s]["time_us"]) if s in r_t else "–",
                       fnum(m_t[s]["time_us"]) if s in m_t else "–", fratio(speed(r_t.get(s), m_t.get(s))),
                       fnum(r_s[s]["time_us"]) if s in r_s else "–", fnum(m_s[s]["time_us"]) if s in m_s else "–",
                       fratio(speed(r_s.get(s), m_s.get(s))), fnum(g[s]["time_us"]) if s in g else "–",
                       fratio(speed(r_s.get(s), g.get(s)))] for s in sizes]) + [""]
    if bw:
        r, m = rows_by_size(bw, "r2comm"), rows_by_size(bw, label_of(bw, "mpi"))
        sizes = [s for s in (65536, MiB, 4 * MiB) if s in r]
        out += ["**Streaming bandwidth rank 0 → 1** (MB/s, window of "
                f"{bw.get('window', '?')} messages)", ""]
        out += table(["size", "r2comm", label_of(bw, "mpi") or "MPI", "ratio"],
                     [[fsize(s), fnum(r[s]["MBps"], 4), fnum(m[s]["MBps"], 4) if s in m else "–",
                       fratio(speed(r.get(s), m.get(s)))] for s in sizes]) + [""]
    return out, []


def collectives_section(res):
    """(lines, no targets): busbw of the other collectives against MPI over shared memory."""
    out = ["## Other collectives vs MPI over shared memory", ""]
    docs = {c: res.doc(c) for c in COLLECTIVES}
    if not any(docs.values()):
        return out + ["Not run: " + "; ".join(f"{c} {res.why_missing(c)}" for c in COLLECTIVES) + ".", ""], []
    rows = []
    for c, doc in docs.items():
        if not doc:
            out += [f"- `{c}`: {res.why_missing(c)}.", ""]
            continue
        out += [f"- `{c}`:"] + code(res.command(c, doc))
        r2, mpi = rows_by_size(doc, "r2comm"), rows_by_size(doc, label_of(doc, "mpi"))
        common = sorted(set(r2) & set(mpi))
        if not common:
            continue
        picks = sorted({s for s in common if s == MiB} | {common[-1]})
        for s in picks:
            rows.append([c, fsize(s), fgb(r2[s]["busbw_GBps"]), fgb(mpi[s]["busbw_GBps"]),
                         fratio(speed(r2[s], mpi[s]))])
    if rows:
        out += ["busbw in GB/s (nccl-tests factors); ratio = r2comm speed ÷ MPI speed, same job.", ""]
        out += table(["collective", "size", "r2comm busbw", "MPI-shm busbw", "r2comm / MPI-shm"], rows) + [""]
    return out, []
