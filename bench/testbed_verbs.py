"""r2comm on verbs rails against raw verbs, on the soft-RoCE testbed (issue 19's figures).

Boots a 2-host x 2-NIC RDMA fabric (QEMU guests with rxe rails; or uses one from `rdma-up`,
--fabric T) and measures, back to back so that both see the same machine load:
  raw        perftest's ib_send_bw / ib_write_bw between the hosts on each rail (64 KiB
             messages, 32 deep), the best a verbs program gets from that rail;
  r2comm     one-way Send/Recv throughput of 8 MiB messages between ranks on different hosts
             over verbs, on each rail alone and on both rails striped, zero-copy from the
             registered user buffer, and on each rail also with zero-copy off (the sender
             copies into bounce slots: R2COMM_VERBS_ZCOPY=0), with the sender's CPU time; the
             same over TCP rails on the same guests (R2COMM_TRANSPORT=tcp);
  failover   a 2-rank stream of 512 KiB allreduces with a rail failed mid-stream: its QP moved
             to error on one rank, and a real link cut in QEMU; the pause (slowest op minus the
             median) and the failure's cause, results bitwise equal to the fault-free run.
Soft-RoCE under software emulation is ~100x slower than hardware: the ratios are the point.

    python bench/testbed_verbs.py [--fabric T] [--out bench/out]     (root; QEMU, rdma-deps.sh)
Writes OUT/testbed_verbs.json; r2comm/bench/results_verbs.py renders it into RESULTS.md."""
import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from r2comm.testbed.rdma import RdmaFabric   # noqa: E402

MSG = 65536


def perftest(fab, tool, nic, port, count):
    """Mbit/s of TOOL between host 0 (server) and host 1 on rail NIC, or None."""
    gi = str(fab.ready_info(0)["gid_index"])
    argv = [tool, "-d", f"rxe{nic}", "-x", gi, "-s", str(MSG), "-n", str(count), "-p", str(port),
            "-u", "17", "-F", "-t", "32"]
    server = fab.spawn(0, ["timeout", "120", *argv])
    text = ""
    try:
        for _ in range(20):
            time.sleep(1)
            rc, text = fab.run(1, ["timeout", "120", *argv, fab.mgmt_addr(0)], timeout=150)
            if "Couldn't connect" not in text and "Unable to" not in text:
                break
    finally:
        server.wait(150)
    m = re.search(rf"^\s*{MSG}\s+(\d+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
    return float(m.group(3)) * 8 * 1.048576 if m else None     # MiB/s -> Mbit/s


def job(fab, args, timeout=300):
    from test_verbs_rails import rdma_job
    rc, out = rdma_job(fab, 2, args + ["watchdog=%d" % (timeout - 20)], timeout=timeout)
    lines = re.findall(r"^\[(\d)\] OK \S+ \d+ (.*)$", out, re.M)
    if rc != 0 or len(lines) != 2:
        return None, out[-3000:]
    return {int(r): text for r, text in lines}, None


def r2comm_bw(fab, rails, transport, size, reps, zcopy=1):
    got, err = job(fab, ["bw", f"rails={rails}", f"transport={transport}", f"size={size}",
                         f"reps={reps}", f"zcopy={zcopy}"])
    if got is None:
        return {"error": err}
    return {**json.loads(got[0]), "receiver": json.loads(got[1])}


def failover(fab, mode, nic=0, host=1):
    from test_verbs_rails import link_cut_on_marker
    marker = str(fab.dir / f"bench{os.getpid()}")
    with link_cut_on_marker(fab, marker, host, nic):     # (the qp mode writes no marker)
        got, err = job(fab, ["fault", f"mode={mode}", "failback=1", "n=131072", "ops=30", "at=8",
                             f"marker={marker}", f"rail={nic}"])
    if got is None:
        return {"error": err}
    out = {}
    for r, text in got.items():
        m = re.search(r"slowest op (\d+) ms \(median (\d+) ms, pause (\d+) ms\); failures (.*); "
                      r"restored=(\w+)", text)
        out[r] = {"slowest_ms": int(m.group(1)), "median_ms": int(m.group(2)),
                  "pause_ms": int(m.group(3)), "failures": m.group(4),
                  "restored": m.group(5) == "True", "exact": "bitwise equal" in text} if m else \
            {"raw": text}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fabric", help="use this booted fabric (rdma-up --tag T)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--count", type=int, default=2000, help="perftest messages")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    started = time.monotonic()
    fab = RdmaFabric.attach(a.fabric) if a.fabric else RdmaFabric(hosts=2, nics=2,
                                                                   tag=f"bv{os.getpid()}")
    booted = not a.fabric
    if booted:
        fab.up()
    res = {"config": {"hosts": 2, "nics": 2, "message": MSG, "size": a.size, "reps": a.reps,
                      "perftest_count": a.count,
                      "cmd": " ".join(["python", "bench/testbed_verbs.py"] + sys.argv[1:])},
           "rails": {}, "both": {}, "failover": {}}
    try:
        for k in (0, 1):
            row = {}
            row["ib_send_bw"] = perftest(fab, "ib_send_bw", k, 18950 + 2 * k, a.count)
            row["r2comm_verbs"] = r2comm_bw(fab, str(k), "verbs", a.size, a.reps)
            row["r2comm_verbs_copy"] = r2comm_bw(fab, str(k), "verbs", a.size, a.reps, zcopy=0)
            row["ib_write_bw"] = perftest(fab, "ib_write_bw", k, 18951 + 2 * k, a.count)
            row["r2comm_tcp"] = r2comm_bw(fab, str(k), "tcp", a.size, a.reps)
            res["rails"][str(k)] = row
            print(f"rail {k}: {json.dumps(row)}", flush=True)
        res["both"]["r2comm_verbs"] = r2comm_bw(fab, "0+1", "verbs", a.size, a.reps)
        res["both"]["r2comm_tcp"] = r2comm_bw(fab, "0+1", "tcp", a.size, a.reps)
        print(f"both rails: {json.dumps(res['both'])}", flush=True)
        for mode in ("qp", "link"):
            res["failover"][mode] = failover(fab, mode)
            print(f"failover {mode}: {json.dumps(res['failover'][mode])}", flush=True)
    finally:
        if booted:
            fab.down()
    res["elapsed_s"] = time.monotonic() - started
    path = os.path.join(a.out, "testbed_verbs.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path} ({res['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
