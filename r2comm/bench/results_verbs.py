"""The verbs section of bench/RESULTS.md (issue 19), from testbed_verbs.json of
bench/testbed_verbs.py: r2comm on soft-RoCE rails against raw verbs (perftest) on the same
rails, against TCP rails on the same guests, and the failover pause on verbs. Called by
results.render(); a missing or partial file makes the section say so, never raise."""
from .results_format import code, table

RAW_RATIO = 0.8      # issue 19: r2comm-verbs >= 0.8x raw verbs on the same emulated rails


def _mbit(v):
    return "–" if not v else f"{v:.1f}"


def _r2(row, key):
    d = row.get(key) or {}
    return d.get("p2p_mbit")


def verbs_section(res):
    """(lines, targets) of the verbs section."""
    out, doc = res.opening("testbed_verbs", "## Verbs rails on soft-RoCE (issue 19)",
                           "not run (needs root and the soft-RoCE testbed: scripts/rdma-deps.sh)")
    if not doc:
        return out, []
    cfg = doc.get("config", {})
    out += ["2 QEMU guests (software emulation, 1 vCPU each) × 2 rail NICs with a soft-RoCE (rxe) "
            "device each; ranks 0 and 1 on different guests. *raw* is perftest between the guests on "
            f"that rail ({cfg.get('message', 65536) // 1024} KiB messages, 32 deep, {cfg.get('perftest_count')} "
            "messages); *r2comm* is one-way `Send`/`Recv` of "
            f"{(cfg.get('size') or 0) >> 20} MiB messages through the engine ({cfg.get('reps')} per run), on "
            "verbs rails (`R2COMM_TRANSPORT=verbs`) and on TCP rails over the same NICs. Each rail's "
            "numbers ran back to back. Emulation makes absolute rates meaningless (tens of Mbit/s, and the "
            "host's 2 CPUs are shared with the guests): the ratio is the point.", ""]
    out += code(cfg.get("cmd", "sudo .venv/bin/python bench/testbed_verbs.py"))
    rows, targets = [], []
    for k, row in sorted((doc.get("rails") or {}).items()):
        raw = max([v for v in (row.get("ib_send_bw"), row.get("ib_write_bw")) if v] or [0])
        ours = _r2(row, "r2comm_verbs")
        ratio = ours / raw if ours and raw else None
        rows.append([f"rail {k}", _mbit(row.get("ib_send_bw")), _mbit(row.get("ib_write_bw")),
                     _mbit(ours), _mbit(_r2(row, "r2comm_tcp")),
                     "–" if ratio is None else f"{ratio:.2f}x"])
        if ratio is not None:
            targets.append((f"rail {k}: r2comm-verbs {ratio:.2f}x raw verbs (target ≥ {RAW_RATIO}x)",
                            ratio >= RAW_RATIO))
    both = doc.get("both") or {}
    rows.append(["both rails", "–", "–", _mbit((both.get("r2comm_verbs") or {}).get("p2p_mbit")),
                 _mbit((both.get("r2comm_tcp") or {}).get("p2p_mbit")), "–"])
    out += table(["", "raw ib_send_bw, Mbit/s", "raw ib_write_bw, Mbit/s", "r2comm verbs, Mbit/s",
                  "r2comm TCP, Mbit/s", "r2comm verbs / best raw"], rows) + [""]
    zrows = []
    for k, row in sorted((doc.get("rails") or {}).items()):
        zc, cp = row.get("r2comm_verbs") or {}, row.get("r2comm_verbs_copy") or {}
        if "p2p_mbit" not in zc or "p2p_mbit" not in cp:
            continue
        zrows.append([f"rail {k}", _mbit(zc["p2p_mbit"]), _mbit(cp["p2p_mbit"]),
                      f"{zc['p2p_mbit'] / cp['p2p_mbit']:.2f}x",
                      f"{zc.get('cpu_s_per_gib', 0):.2f}", f"{cp.get('cpu_s_per_gib', 0):.2f}",
                      f"{zc.get('zcopy_bytes', 0) / max(1, zc.get('zcopy_bytes', 0) + zc.get('copy_bytes', 0)):.0%}"])
    if zrows:
        out += ["Zero-copy sends (the registration cache) against the bounce slots, one-way "
                "`Send`/`Recv` as above, same rail back to back: the sender posts SENDs straight "
                "from the registered user buffer, or copies it into registered slots first "
                "(`R2COMM_VERBS_ZCOPY=0`). *CPU* is the sender process's CPU seconds per GiB sent "
                "(user + system, inside the guest). Soft-RoCE copies every byte in the guest's "
                "kernel either way, so this shows what the user-space copy costs, not what a "
                "hardware NIC would gain.", ""]
        out += table(["", "zero-copy, Mbit/s", "bounce, Mbit/s", "zero-copy / bounce",
                      "CPU s/GiB zero-copy", "CPU s/GiB bounce", "payload sent zero-copy"],
                     zrows) + [""]
    fo = doc.get("failover") or {}
    frows = []
    for mode, what in (("qp", "QP moved to error on rank 1 (`fail_rail(0, 'hard')`)"),
                       ("link", "host 1's NIC 0 link cut in QEMU, restored 1 s after the stream")):
        d = fo.get(mode) or {}
        for r in ("0", "1"):
            x = d.get(r) or {}
            if "pause_ms" in x:
                frows.append([what if r == "0" else "", r, x["median_ms"], x["slowest_ms"], x["pause_ms"],
                              "yes" if x.get("exact") else "NO", "yes" if x.get("restored") else "no",
                              x.get("failures", "")])
        if not d or "error" in d:
            frows.append([what, "–", "–", "–", "–", "–", "–", "did not run: " + str(d.get("error", "no data"))[:120]])
    out += ["Failover on verbs: a stream of 30 allreduces of 512 KiB (2 ranks), the rail failed at op 8; "
            "*pause* is the slowest op minus the median; results are compared bit for bit with a fault-free "
            "run of the same stream in the same job; *restored*: the rail came back (a new queue pair) and "
            "carried traffic.", ""]
    out += table(["fault", "rank", "median op, ms", "slowest op, ms", "pause, ms", "exact", "restored",
                  "failures seen (rail, peer, cause)"], frows) + [""]
    if doc.get("elapsed_s"):
        out += [f"The script took {doc['elapsed_s']:.0f} s.", ""]
    return out, targets
