"""The netns testbed sections of bench/RESULTS.md: multi-rail and NIC failover (issue 4,
issue 6), the degraded-server allreduce (issue 5), and where the slow-rail measurements are.
Called by results.render(); a missing file makes a section say so, never raise."""
import glob
import os
import shlex

from .results_format import (DEFAULT_RAIL_TIMEOUT_MS, MiB, NOT_ROOT, SURVIVE_FRACTION, code, fgb,
                             fms, fnum, fpct, fratio, fsize, table, verdict)

TWO_NIC_SPEEDUP = 1.8  # issue 6 "busbw ~ 2x a single rail": read here as >= 1.8x (within 10% of 2x)
TSTAR_FACTOR = 1.15  # issue 5: within 15% of T*


def testbed_section(res):
    """(lines, targets) of the testbed multi-rail and failover section."""
    out = ["## Multi-rail and NIC failover in the netns testbed (issue 4, issue 6)", ""]
    doc = res.doc("testbed_failover")
    if not doc:
        return out + [f"{res.why_missing('testbed_failover', NOT_ROOT).capitalize()}.", ""], []
    cfg = doc.get("config", {})
    cmd = res.text("testbed_failover.cmd") or ("sudo .venv/bin/python bench/testbed_failover.py "
                                               + " ".join(shlex.quote(a) for a in cfg.get("argv", [])))
    out += [f"{cfg.get('hosts')} hosts × {cfg.get('nics')} rail NICs, each NIC shaped to {cfg.get('rate')} by tbf, "
            f"{fsize(cfg.get('size', 0))} float32 allreduce; *1 NIC* is a job given only NIC 0, *2 NICs* the "
            f"healthy job, *after failure* the same job after host 1's NIC 0 was taken down for real "
            f"(`{cfg.get('fault', 'ip link set down')}`) mid-stream. busbw as in nccl-tests, over "
            f"{cfg.get('iters')} back-to-back ops. Run in {doc.get('seconds', 0):.0f} s by:"] + code(cmd)
    rows, targets = [], []
    for n, run in sorted(doc.get("runs", {}).items(), key=lambda kv: int(kv[0])):
        fo = run.get("failover", {})
        det = fo.get("detect_s", {})
        one, two, after = (run.get(k, {}).get("busbw_GBps") for k in ("single_rail", "healthy", "after_failure"))
        frac = after / one if after and one else None
        rows.append([n, fgb(one), fgb(two), fratio(run.get("speedup_2nics_vs_1")), fgb(after), fpct(frac),
                     fms(det.get("rail_failed"), 0), fms(det.get("redelivered"), 0),
                     f"{fms(fo.get('op_healthy_median_s'), 0)} / {fms(fo.get('op_hit_by_fault_s'), 0)} / "
                     f"{fms(fo.get('op_after_median_s'), 0)}", run.get("wrong_results")])
        sp = run.get("speedup_2nics_vs_1")
        if sp is not None:
            targets.append((f"{n} ranks, both NICs used (busbw ≈ 2× one NIC, read as ≥ {TWO_NIC_SPEEDUP:g}×): "
                            f"**{verdict(sp >= TWO_NIC_SPEEDUP)}** — {fgb(two)} vs {fgb(one)} GB/s = {sp:.2f}×",
                            sp >= TWO_NIC_SPEEDUP))
        if frac is not None:
            ok = frac >= SURVIVE_FRACTION and not run.get("wrong_results")
            targets.append((f"{n} ranks, after one NIC failed ≥ {SURVIVE_FRACTION:.0%} of the surviving capacity "
                            f"(one NIC): **{verdict(ok)}** — {fgb(after)} vs {fgb(one)} GB/s = {fpct(frac)}; "
                            f"{run.get('wrong_results')} wrong results", ok))
    out += ["busbw in GB/s; detection = fault → first `rail_failed`, re-delivered = fault → first re-sent chunk "
            "acknowledged; op times are rank 0's stream: healthy median / the op hit by the fault / after.", ""]
    out += table(["ranks", "1 NIC", "2 NICs", "2 NICs / 1 NIC", "after failure", "after / 1 NIC", "detection",
                  "re-delivered", "op healthy / hit / after", "wrong results"], rows) + [""]
    out += ["A downed link gives TCP no error, so the failure is found by the silent-stall deadline "
            f"(R2COMM_RAIL_TIMEOUT_MS={cfg.get('R2COMM_RAIL_TIMEOUT_MS', DEFAULT_RAIL_TIMEOUT_MS):g}).", ""]
    out += ["**Against the targets** (issue 6):", ""] + [f"- {t}." for t, _ in targets] + [""]
    if os.path.exists(res.path("testbed_timeline.png")):
        out += ["![testbed timeline: per-rail throughput, NIC 0 of host 1 down at t=0](figures/testbed_timeline.png)",
                ""]
    return out, targets


def degraded_docs(res):
    """{hosts: (name, doc)} from testbed_degraded_<H>hosts.json (run_all.sh) or testbed_degraded.json."""
    found = {}
    paths = sorted(glob.glob(res.path("testbed_degraded_*hosts.json"))) + [res.path("testbed_degraded.json")]
    for path in paths:
        name = os.path.basename(path)[:-5]
        doc = res.doc(name)
        if doc and doc.get("hosts") is not None:
            found.setdefault(doc["hosts"], (name, doc))
    return found


def degraded_section(res):
    """(lines, targets) of the degraded-server section."""
    out = ["## Degraded-server allreduce in the testbed (issue 5)", ""]
    found = degraded_docs(res)
    if not found:
        names = [os.path.basename(p)[:-5] for p in sorted(glob.glob(res.path("testbed_degraded_*hosts.*")))]
        notes = sorted({res.why_missing(n, NOT_ROOT) for n in names if not n.endswith(".cmd")}) or [NOT_ROOT]
        return out + [f"{'; '.join(notes).capitalize()}.", ""], []
    out += ["H hosts × 2 NICs, one rank per host; NIC 1 of the last host is taken down for real once the job runs. "
            "After the engines detect it, the allreduce is timed with the static ring (*ring*: the engine's "
            "striping moves the lost NIC's share onto the surviving one, but the degraded host stays on the "
            "critical path) and with the schedule the planner picks after `comm.replan()` (*replanned*). "
            "T* = (N/B)·max(1/β, 2(p−1)/(p−1+β)) is the lower bound, B = a healthy host's bandwidth. "
            "Every result is checked.", ""]
    rows, targets = [], []
    goodput = any(doc.get("T_star_goodput_s") for _, doc in found.values())  # newer testbed_degraded.py
    for hosts, (name, doc) in sorted(found.items()):
        cmd = res.text(f"{name}.cmd") or (f"sudo .venv/bin/python bench/testbed_degraded.py --hosts {hosts} "
                                          f"--rate {doc.get('rate')} --mib {doc.get('mib')}")
        out += [f"- {hosts} hosts (`{name}.json`):"] + code(cmd)
        tstar = doc.get("T_star_s")
        r = doc.get("results", {})
        ring, rep = r.get("ring", {}), r.get("replanned", {})
        rs, ps = ring.get("median_s"), rep.get("median_s")
        beta = fnum(doc.get("beta")) + (f" (planner {fnum(doc['beta_planner'])})"
                                        if doc.get("beta_planner") is not None else "")
        rate = f"{doc.get('rate')}" + (f", MTU {doc['mtu']}" if doc.get("mtu") else "")
        row = [hosts, rate, fsize((doc.get("mib") or 0) * MiB), beta, fms(tstar, 0)]
        t_good = doc.get("T_star_goodput_s")
        if goodput:
            row.append(fms(t_good, 0))
        row += [f"{fms(rs, 0)} = {fratio(rs / tstar) if rs and tstar else '–'} × T* ({ring.get('algo', '?')})",
                f"{fms(ps, 0)} = {fratio(ps / tstar) if ps and tstar else '–'} × T* ({rep.get('algo', '?')})",
                len(rep.get("all_s", []))]
        rows.append(row)
        if ps and tstar:
            ok = ps / tstar <= TSTAR_FACTOR
            targets.append((f"{hosts} hosts, replanned within 15% of T*: **{verdict(ok)}** "
                            f"({ps / tstar:.2f}× T*" + (f"; {ps / t_good:.2f}× T* at the measured NIC goodput"
                                                        if t_good else "") + ")", ok))
        if ps and rs:
            ok = ps <= rs
            diff = (1 - ps / rs) * 100
            targets.append((f"{hosts} hosts, never slower than plain ring: **{verdict(ok)}** "
                            f"({fms(ps, 0)} vs {fms(rs, 0)}: {abs(diff):.0f}% {'less' if diff >= 0 else 'more'} "
                            f"time than ring)", ok))
    head = ["hosts", "NIC rate", "size", "β", "T*"] + (["T* at measured goodput"] if goodput else [])
    out += table(head + ["ring (median)", "replanned (median)", "reps"], rows) + [""]
    out += ["Rail NICs use jumbo frames (the testbed's default MTU 9000, as on GPU back-end fabrics); "
            "tbf counts frame headers, so under 1% of the gap to T* is framing. *T\\* at measured "
            "goodput* comes from timing the degraded host's bare traffic (N/(p−1) bytes to and from "
            "every healthy host at once, no reductions) in the same job. It is an estimate, not a "
            "bound: on 2 shared cores that exchange is partly CPU-limited too, and a ratio below "
            "1.0 means the allreduce beat it. The target is judged on the nominal T*.", ""]
    out += ["**Against the targets** (issue 5):", ""] + [f"- {t}." for t, _ in targets] + [""]
    return out, targets


def slow_rail_section(res):
    """(lines, no targets): the slow-rail measurements live in a test and a commit message."""
    return ["## A slow (degraded) rail in the testbed (issue 3 \"degraded\", issue 5)", "",
            "Not part of this script: `tests/test_slow_rail.py` (root) checks that a rail degraded to a tenth "
            "of its rate gets proportionally less traffic; the hand-run measurements behind that change are in "
            "the message of commit e2e3f46 (`git show e2e3f46`).", ""], []
