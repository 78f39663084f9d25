#!/usr/bin/env python3
"""FSDP2 x tensor parallel on r2comm through a real NIC failure in the emulated cluster, as root
(issue 29: the paper's demonstration on the modern stack).

    sudo .venv/bin/python bench/testbed_fsdp2.py [--rate 500mbit] [--steps 40] [--out DIR]

A fabric of 2 hosts x 2 rail NICs shaped to --rate; 4 ranks, 2 per host (one torchrun per host
in its namespace, as bench/testbed_torch.py starts them). The job is examples/torch_fsdp2_tp.py,
an ordinary FSDP2 + TP script: a 2 x 2 DeviceMesh whose "tp" groups are the two ranks of a host
and whose "dp" groups cross the hosts. Runs:

  r2comm healthy    fault-free
  r2comm nic_down   host 1's NIC 0 taken down for real (`ip link set nic0 down` in its
                    namespace) once rank 0 has finished step --fail-step - 1, brought back
                    after step --restore-step - 1
  gloo healthy      the same script on Gloo (GLOO_SOCKET_IFNAME=nic0,nic1), fault-free

The two r2comm runs must print the same loss-curve digest (bitwise identical losses); Gloo's
4-rank float sums may differ in the last bit (another reduction order). Writes
--out/testbed_fsdp2.json and testbed_fsdp2.png (step time per step, the outage marked)."""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
from testbed_torch import Job, compare, fault_recorder  # noqa: E402
from r2comm.bench.cycles import median  # noqa: E402

SCRIPT = REPO / "examples" / "torch_fsdp2_tp.py"


def step_line(k):
    return f"[fsdp] step {k:3d} "


def case(fab, args, workdir, backend, fault):
    """One run of the example; FAULT None or "nic_down". Returns its record."""
    name = f"fsdp_{backend}_{fault or 'healthy'}"
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    argv = [SCRIPT, "--backend", backend, "--steps", args.steps, "--width", args.width,
            "--depth", args.depth, "--batch", args.batch, "--timeout", args.op_timeout,
            "--json", result]
    env = {"GLOO_SOCKET_IFNAME": "nic0,nic1"} if backend == "gloo" else {}
    job = Job(fab, argv, env, workdir, name, args.job_timeout)
    faults = []
    act = fault_recorder(faults)
    if fault == "nic_down":
        job.on(step_line(args.fail_step - 1), act("nic_down", lambda: fab.nic_down(1, 0)))
        job.on(step_line(args.restore_step - 1), act("nic_up", lambda: fab.nic_up(1, 0)))
    started = time.time()
    try:
        rc = job.run()
    finally:
        fab.nic_up(1, 0)
    rec = {"name": name, "backend": backend, "fault": fault, "rc": rc,
           "timed_out": job.timed_out, "wall_s": time.time() - started, "faults": faults,
           "fail_step": args.fail_step if fault else None,
           "restore_step": args.restore_step if fault else None}
    if result.exists():
        rec.update(json.loads(result.read_text()))
    else:
        rec["error"] = "no result written"
    if rc != 0 or rec.get("error") or job.timed_out:
        rec["log_tail"] = job.tail()
    return rec


def summarize(cases):
    base, down = cases.get("fsdp_r2comm_healthy", {}), cases.get("fsdp_r2comm_nic_down", {})
    gloo = cases.get("fsdp_gloo_healthy", {})
    complete = [r for r in (base, down) if r.get("digest") and len(r.get("step_s", [])) ==
                r.get("steps")]
    return {"r2comm_healthy_median_s": median(base.get("step_s", [])[2:]),
            "gloo_healthy_median_s": median(gloo.get("step_s", [])[2:]),
            "nic_down": compare(down, base) if down and not down.get("error") else
            ({"error": down.get("error")} if down else None),
            "digests": {r.get("name"): r.get("digest") for r in (base, down, gloo) if r},
            "digests_equal": (base.get("digest") == down.get("digest"))
            if len(complete) == 2 else None,
            "failover_events": (down.get("event_kinds") or {}),
            "params": base.get("params")}


def plot(report, path):
    from r2comm.bench.plot import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for name, style in (("fsdp_r2comm_healthy", "o-"), ("fsdp_r2comm_nic_down", "s-"),
                        ("fsdp_gloo_healthy", "^--")):
        rec = report["cases"].get(name) or {}
        st = rec.get("step_s") or []
        if st:
            ax.plot(range(len(st)), [v * 1e3 for v in st], style, ms=3,
                    label=name.replace("fsdp_", "").replace("_", " "))
    cfg = report["config"]
    ax.axvspan(cfg["fail_step"] - 0.5, cfg["restore_step"] - 0.5, color="red", alpha=0.08,
               label="host 1's NIC 0 down")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, rank 0)")
    ax.set_title("FSDP2 x TP, 2 hosts x 2 NICs, 4 ranks: a NIC down and back")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="500mbit", help="per-NIC rate (default 500mbit)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fail-step", type=int, default=12)
    ap.add_argument("--restore-step", type=int, default=26)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--op-timeout", type=float, default=60.0)
    ap.add_argument("--job-timeout", type=float, default=150.0)
    ap.add_argument("--out", default=str(HERE / "out"))
    args = ap.parse_args()
    from r2comm.testbed import Fabric
    from testbed_failover import driver_dirs      # (this folder)
    out_dir, workdir = driver_dirs("bench/testbed_fsdp2.py", args.out, "r2tb-fsdp-")
    report = {"bench": "testbed_fsdp2", "time": time.time(),
              "command": "python bench/testbed_fsdp2.py " + " ".join(sys.argv[1:]),
              "config": {"hosts": 2, "nics": 2, "rate": args.rate, "ranks": 4,
                         "ranks_per_host": 2, "mesh": "dp 2 x tp 2", "steps": args.steps,
                         "fail_step": args.fail_step, "restore_step": args.restore_step,
                         "width": args.width, "depth": args.depth, "batch": args.batch,
                         "fault": "fab.nic_down(1, 0): ip link set nic0 down in host 1",
                         "gloo_ifnames": "nic0,nic1", "argv": sys.argv[1:]},
              "loadavg": [os.getloadavg()[0]], "cases": {}}
    started = time.monotonic()
    try:
        with Fabric(hosts=2, nics=2, rate=args.rate, tag=f"bf{os.getpid() % 100000}") as fab:
            for backend, fault in (("r2comm", None), ("r2comm", "nic_down"), ("gloo", None)):
                rec = case(fab, args, workdir, backend, fault)
                report["cases"][rec["name"]] = rec
                st = rec.get("step_s") or []
                print(f"# {rec['name']}: rc {rec['rc']}, {rec['wall_s']:.1f} s, median step "
                      f"{(median(st[2:]) or 0) * 1e3:.1f} ms, digest {rec.get('digest')}"
                      f"{', error: ' + rec['error'][:200] if rec.get('error') else ''}", flush=True)
                for line in rec.get("log_tail", [])[-15:]:
                    print(f"#   {line}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["loadavg"].append(os.getloadavg()[0])
    report["seconds"] = time.monotonic() - started
    report["summary"] = summarize(report["cases"])
    (out_dir / "testbed_fsdp2.json").write_text(json.dumps(report, indent=1))
    try:
        plot(report, out_dir / "testbed_fsdp2.png")
    except Exception as exc:  # the JSON is what matters
        print(f"# no figure: {exc!r}")
    s = report["summary"]
    nd = s.get("nic_down") or {}
    print(f"## r2comm healthy {(s['r2comm_healthy_median_s'] or 0) * 1e3:.1f} ms/step, Gloo "
          f"{(s['gloo_healthy_median_s'] or 0) * 1e3:.1f} ms/step; NIC down: during "
          f"{(nd.get('during_median_s') or 0) * 1e3:.1f} ms/step, after "
          f"{(nd.get('after_median_s') or 0) * 1e3:.1f}; digests equal: {s['digests_equal']} "
          f"{s['digests']}")
    print(f"# wrote {out_dir / 'testbed_fsdp2.json'} in {report['seconds']:.0f} s")
    return 0 if s["digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
