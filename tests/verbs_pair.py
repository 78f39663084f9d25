"""Two ranks on soft-RoCE rails exercise r2comm._core.verbs for real (one fabric boot, every case):

    python -m r2comm.testbed rdma-run --hosts 2 --nics 2 -n 2 -- python tests/verbs_pair.py

Rank r runs in guest r; they swap QP address bytes (and RDMA-writable regions) through the
job's rendezvous directory ($R2COMM_STORE_DIR, a DirStore on the shared filesystem).  Phases,
each printing one ``RESULT {json}`` line that tests/test_verbs.py asserts on:

  devices    port state, speed/width -> declared bandwidth, RoCE v2 IPv4 GID index per rail
  sendrecv   SEND of 1 B .. 1 MiB both ways on each rail into pre-posted receives, CRC32 checked
  writeimm   RDMA WRITE_WITH_IMM into a registered remote region: immediates and bytes checked
  regcache   the registration cache under buffers freed and reused (contents checked remotely)
  bandwidth  per rail, SEND vs WRITE_WITH_IMM streams (64 KiB messages, nogil loops)
  perftest   ib_send_bw / ib_write_bw on the same rails, when installed
  fault      rail 0 cut during traffic on both rails: error completions on rail 0 within a
             bounded time, rail 1 keeps completing; then a new QP on rail 0 works (fail-back)

The fault: ``--fault host`` asks the host to cut the link (QEMU set_link, the testbed's nic-down)
through files in the store directory, which `orchestrate` (run on the host, by the test or
``python tests/verbs_pair.py --orchestrate --fabric TAG``) answers; ``--fault guest`` (default)
has rank 1 take its NIC down itself (``ip link set nic0 down``); ``--fault none`` skips it.
Every wait is bounded.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

SIZES = [1, 100, 4096, 65536 + 3, 1 << 20]
SLOT = 1 << 20


def result(phase, **kw):
    print("RESULT " + json.dumps({"phase": phase, "rank": RANK, **kw}), flush=True)


def log(msg):
    print(f"{time.monotonic():.2f} {msg}", flush=True)


def pattern(seed, size):
    """SIZE deterministic pseudo-random bytes for SEED (any repr-able value), alike on both ranks."""
    return np.random.default_rng(zlib.crc32(repr(seed).encode())).integers(0, 256, size,
                                                                          dtype=np.uint8)


def crc(a):
    return zlib.crc32(memoryview(a).cast("B"))


class Pair:
    """This rank's side of the job: one Rail per device, the store, the peer's rank."""

    def __init__(self, args):
        from r2comm.control.bootstrap_store import DirStore
        self.args = args
        self.rank, self.size = int(os.environ["R2COMM_RANK"]), int(os.environ["R2COMM_SIZE"])
        assert self.size == 2, "verbs_pair runs with -n 2"
        self.peer = 1 - self.rank
        self.store = DirStore(os.environ["R2COMM_STORE_DIR"], timeout=args.store_timeout)
        self.store_dir = Path(os.environ["R2COMM_STORE_DIR"])
        self.devices = os.environ["R2COMM_RDMA_DEVICES"].split(",")
        self.ips = os.environ["R2COMM_RAILS"].split(",")
        self.rails = [Rail(self, k, dev, ip) for k, (dev, ip) in
                      enumerate(zip(self.devices, self.ips))]

    def exchange(self, key, value):
        self.store.set(f"{key}.{self.rank}", value)
        return self.store.get(f"{key}.{self.peer}")

    def barrier(self, key):
        self.exchange(key, b"1")


class Rail:
    def __init__(self, pair, k, dev, ip):
        from r2comm._core import verbs as V
        from mr_cache import RegCache
        self.V, self.pair, self.k, self.dev, self.ip = V, pair, k, dev, ip
        self.ctx = V.Context(dev)
        self.pd = V.PD(self.ctx)
        self.gid_index = self.ctx.roce_v2_ipv4_index(ip)
        self.cache = RegCache(lambda view, access: self.pd.register(view, access),
                              max_entries=16, max_bytes=64 << 20)
        self.qp = self.scq = self.rcq = None
        self.gen = 0

    def connect(self):
        """A fresh QP (and CQs) on this rail, connected to the peer's (generation self.gen)."""
        V, a = self.V, self.pair.args
        self.close_qp()
        self.scq, self.rcq = V.CQ(self.ctx, 1024), V.CQ(self.ctx, 1024)
        self.qp = V.QP(self.pd, self.scq, self.rcq, max_send=256, max_recv=256,
                       gid_index=self.gid_index, timeout=a.qp_timeout, retry_cnt=a.retry_cnt)
        peer = self.pair.exchange(f"qp.g{self.gen}.r{self.k}", self.qp.address())
        self.qp.connect(peer)
        self.gen += 1

    def close_qp(self):
        if self.qp is not None:
            self.qp.close()
            self.scq.close()
            self.rcq.close()
            self.qp = self.scq = self.rcq = None

    def wait(self, cq, n, timeout):
        """N completions from CQ (bounded); returns them (errors included)."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += cq.poll(64, timeout=0.2)
        return got


# --- phases ------------------------------------------------------------------------------------
def phase_devices(pair):
    env_gi = os.environ.get("R2COMM_RDMA_GID_INDEX")
    for r in pair.rails:
        port = r.ctx.query_port()
        result("devices", rail=r.k, device=r.dev, ip=r.ip, state=port["state"],
               active_mtu=port["active_mtu"], speed=port["active_speed"],
               width=port["active_width"], declared_gbps=port["declared_gbps"],
               link_layer=port["link_layer"], gid_index=r.gid_index,
               env_gid_index=None if env_gi is None else int(env_gi),
               gids=[g[1] for g in r.ctx.gids()])


def phase_sendrecv(pair, rail, sizes=SIZES, tag="sendrecv"):
    """Both ranks send every size to the other at once; CRC32 of each arrival checked."""
    V = rail.V
    rbuf = np.zeros(len(sizes) * SLOT, dtype=np.uint8)
    rmr = rail.pd.register(rbuf, V.ACCESS_LOCAL_WRITE)
    for i in range(len(sizes)):
        rail.qp.post_recv(rmr, i * SLOT, SLOT, wr_id=i)
    pair.barrier(f"{tag}.posted.g{rail.gen}.r{rail.k}")
    bufs = [pattern((rail.k, pair.rank, s), s) for s in sizes]
    for i, b in enumerate(bufs):
        mr = rail.cache.get(b)                       # registration cache: one MR per buffer
        rail.qp.post_send(mr, 0, b.nbytes, wr_id=100 + i)
    sends = rail.wait(rail.scq, len(sizes), pair.args.op_timeout)
    recvs = rail.wait(rail.rcq, len(sizes), pair.args.op_timeout)
    bad = []
    for wr_id, status, opcode, nbytes, imm, *_ in recvs:
        want = pattern((rail.k, pair.peer, sizes[wr_id]), sizes[wr_id])
        got = rbuf[wr_id * SLOT: wr_id * SLOT + nbytes]
        if status != V.WC_SUCCESS or opcode != V.WC_RECV or nbytes != want.nbytes or crc(got) != crc(want):
            bad.append({"wr_id": wr_id, "status": V.status_str(status), "bytes": nbytes})
    send_bad = [V.status_str(s[1]) for s in sends if s[1] != V.WC_SUCCESS]
    ok = len(sends) == len(recvs) == len(sizes) and not bad and not send_bad
    result(tag, rail=rail.k, ok=ok, sizes=sizes, sends=len(sends), recvs=len(recvs), bad=bad,
           send_errors=send_bad)
    rmr.close()
    return ok


def phase_writeimm(pair, rail):
    """Rank 1 writes three pieces with immediates into rank 0's registered region."""
    V = rail.V
    pieces = [(0, 4096), (8192, 65536 + 7), (2 << 20, 1 << 20)]     # (offset, length)
    if pair.rank == 0:
        dest = np.zeros(4 << 20, dtype=np.uint8)
        mr = rail.pd.register(dest, V.ACCESS_LOCAL_WRITE | V.ACCESS_REMOTE_WRITE)
        for i in range(len(pieces)):
            rail.qp.post_recv(None, wr_id=i)                # takes the immediate only
        pair.exchange(f"region.r{rail.k}", mr.region().encode())
        got = rail.wait(rail.rcq, len(pieces), pair.args.op_timeout)
        imms = sorted(c[4] for c in got if c[1] == V.WC_SUCCESS)
        opcodes_ok = all(c[2] == V.WC_RECV_RDMA_WITH_IMM for c in got)
        lens = sorted(c[3] for c in got)
        content = all(crc(dest[o:o + n]) == crc(pattern((rail.k, "w", i), n))
                      for i, (o, n) in enumerate(pieces))
        untouched = int(np.count_nonzero(dest[4096:8192]))
        ok = (imms == [7000 + i for i in range(len(pieces))] and opcodes_ok and content
              and lens == sorted(n for _, n in pieces) and untouched == 0)
        result("writeimm", rail=rail.k, ok=ok, imms=imms, lens=lens, content=content,
               opcodes_ok=opcodes_ok)
        mr.close()
    else:
        from r2comm._core.verbs_common import RegionDesc
        region = RegionDesc.decode(pair.exchange(f"region.r{rail.k}", b"-"))
        bufs = [pattern((rail.k, "w", i), n) for i, (o, n) in enumerate(pieces)]
        for i, ((off, n), b) in enumerate(zip(pieces, bufs)):
            rail.qp.post_send(rail.cache.get(b), 0, n, wr_id=i, opcode=V.WR_RDMA_WRITE_WITH_IMM,
                              imm=7000 + i, remote=region, remote_offset=off)
        sent = rail.wait(rail.scq, len(pieces), pair.args.op_timeout)
        ok = len(sent) == len(pieces) and all(c[1] == V.WC_SUCCESS for c in sent)
        result("writeimm", rail=rail.k, ok=ok, sent=len(sent))
    pair.barrier(f"writeimm.done.r{rail.k}")


def phase_regcache(pair, rail):
    """Rank 1 sends from buffers that are freed and reallocated (same size) through the cache;
    rank 0 checks that every arrival has the new contents, never a stale MR's."""
    V, n, rounds = rail.V, 1 << 20, 4
    if pair.rank == 0:
        rbuf = np.zeros(rounds * n, dtype=np.uint8)
        rmr = rail.pd.register(rbuf, V.ACCESS_LOCAL_WRITE)
        for i in range(rounds):
            rail.qp.post_recv(rmr, i * n, n, wr_id=i)
        pair.barrier("regcache.posted")
        got = rail.wait(rail.rcq, rounds, pair.args.op_timeout)
        good = [c[0] for c in got if c[1] == V.WC_SUCCESS and
                crc(rbuf[c[0] * n:(c[0] + 1) * n]) == crc(pattern(("rc", c[0]), n))]
        result("regcache", ok=sorted(good) == list(range(rounds)), good=sorted(good))
        rmr.close()
        return
    pair.barrier("regcache.posted")
    cache, addrs, fresh = rail.cache, [], []
    cache.clear()
    for i in range(rounds):
        buf = pattern(("rc", i), n)               # a new allocation each round
        addr = buf.__array_interface__["data"][0]
        misses = cache.misses
        mr = cache.get(buf)
        fresh.append(cache.misses > misses)
        addrs.append(addr)
        rail.qp.post_send(mr, 0, n, wr_id=i)
        done = rail.wait(rail.scq, 1, pair.args.op_timeout)
        assert done and done[0][1] == V.WC_SUCCESS, done
        del buf, mr                               # the user frees it (the cache still pins it)
        if i == 1:
            cache.clear()                          # evicted: MR deregistered, memory released
    result("regcache", ok=all(fresh), fresh=fresh, addresses=[hex(a) for a in addrs],
           reused_address=len(set(addrs)) < len(addrs), hits=cache.hits, misses=cache.misses)


def phase_bandwidth(pair, rail, opcode_name):
    V, a = rail.V, pair.args
    size, count, depth = a.bw_size, a.bw_count, 32
    key = f"bw.{opcode_name}.r{rail.k}"
    write = opcode_name == "write_imm"
    if pair.rank == 0:              # receiver
        slots = np.zeros(64 * size, dtype=np.uint8)
        mr = rail.pd.register(slots, V.ACCESS_LOCAL_WRITE | V.ACCESS_REMOTE_WRITE)
        V.stream_recv(rail.qp, None if write else mr, size, 0, 64, prepost=True, seconds=0,
                      write_imm=write)
        pair.exchange(key, mr.region().encode())
        r = V.stream_recv(rail.qp, None if write else mr, size, count, 64, prepost=False,
                          seconds=a.op_timeout * 4, write_imm=write)
        # drain the receives still posted: a fresh QP gets them back, here they just stay
        result("bandwidth", rail=rail.k, op=opcode_name, side="recv", ok=r["ok"] == count,
               mbit=r["bytes"] * 8 / r["elapsed"] / 1e6 if r["elapsed"] else None,
               received=r["ok"], errors=r["errors"])
        pair.barrier(key + ".done")
        rail.close_qp()              # the posted receives go with the QP
        rail.connect()
        mr.close()
        return
    from r2comm._core.verbs_common import RegionDesc
    region = RegionDesc.decode(pair.exchange(key, b"-"))
    src = pattern(("bw", rail.k), size)
    mr = rail.cache.get(src)
    r = V.stream_send(rail.qp, mr, size, count, depth,
                      opcode=V.WR_RDMA_WRITE_WITH_IMM if write else V.WR_SEND, remote=region)
    mbit = r["bytes"] * 8 / r["elapsed"] / 1e6 if r["elapsed"] else None
    result("bandwidth", rail=rail.k, op=opcode_name, side="send", ok=r["ok"] == count,
           mbit=mbit, size=size, count=count, depth=depth, seconds=r["elapsed"],
           errors=r["statuses"])
    pair.barrier(key + ".done")
    rail.close_qp()
    rail.connect()


def phase_perftest(pair, rail, tool, events=False):
    """ib_send_bw / ib_write_bw between the ranks on this rail (same message size, QP timeout
    and count as ours), busy-polling (perftest's default) or sleeping on CQ events (-e, as
    stream_send/stream_recv do); perftest's TCP exchange goes over the management network."""
    import shutil
    import re
    a = pair.args
    if shutil.which(tool) is None:
        result("perftest", rail=rail.k, tool=tool, ok=False, skipped="not installed")
        return
    port = 18900 + 10 * rail.k + (0 if tool == "ib_send_bw" else 2) + events
    argv = [tool, "-d", rail.dev, "-x", str(rail.gid_index), "-s", str(a.bw_size),
            "-n", str(a.bw_count), "-p", str(port), "-u", str(a.qp_timeout), "-F", "-t", "32"]
    argv += ["-e"] if events else []
    tool = tool + (" -e" if events else "")
    ctrl = pair.exchange(f"ctrl.{tool}.r{rail.k}", os.environ["R2COMM_CTRL_ADDR"].encode())
    if pair.rank == 0:
        subprocess.run(["timeout", "120", *argv], capture_output=True, text=True)
        pair.barrier(f"{tool}.r{rail.k}.done")
        return
    text, rc = "", 1
    for _ in range(30):
        time.sleep(1)
        p = subprocess.run(["timeout", "120", *argv, ctrl.decode()], capture_output=True, text=True)
        text, rc = p.stdout + p.stderr, p.returncode
        if "Couldn't connect" not in text and "Unable to" not in text:
            break
    m = re.search(rf"^\s*{a.bw_size}\s+(\d+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
    mbit = float(m.group(3)) * 8 * 1.048576 if m else None      # MiB/s -> Mbit/s
    result("perftest", rail=rail.k, tool=tool, ok=rc == 0 and m is not None, mbit=mbit,
           output=None if m else text[-800:])
    pair.barrier(f"{tool}.r{rail.k}.done")


def _fault_file(pair, name):
    return pair.store_dir / f"fault.{name}"


def _wait_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def phase_fault(pair):
    """Traffic on both rails from rank 1; rail 0 of host 1 cut; errors on rail 0 only; then
    fail-back with a new QP once the link is back."""
    V, a = pair.rails[0].V, pair.args
    size, depth = a.bw_size, 16
    results = {}
    if pair.rank == 0:
        slots = [np.zeros(64 * size, dtype=np.uint8) for _ in pair.rails]
        mrs = [r.pd.register(s, V.ACCESS_LOCAL_WRITE) for r, s in zip(pair.rails, slots)]
        for r, mr in zip(pair.rails, mrs):
            V.stream_recv(r.qp, mr, size, 0, 64, prepost=True, seconds=0)
        pair.barrier("fault.posted")
        got = [0] * len(pair.rails)
        deadline = time.monotonic() + a.fault_seconds + 120
        while not (pair.store_dir / "fault.senddone").exists() and time.monotonic() < deadline:
            for i, (r, mr) in enumerate(zip(pair.rails, mrs)):
                got[i] += V.stream_recv(r.qp, mr, size, 1 << 40, 64, prepost=False,
                                        seconds=0.2)["ok"]
        for _ in range(10):  # the sender's last completions may still sit in our receive CQs
            more = [V.stream_recv(r.qp, mr, size, 1 << 40, 64, prepost=False,
                                  seconds=0.2)["ok"] for r, mr in zip(pair.rails, mrs)]
            got = [g + m for g, m in zip(got, more)]
            if not any(more):
                break
        result("fault", side="recv", received=got)
    else:
        src = pattern(("fault",), size)
        mrs = [r.cache.get(src) for r in pair.rails]
        pair.barrier("fault.posted")

        def run(i):
            results[i] = V.stream_send(pair.rails[i].qp, mrs[i], size, 1 << 40, depth,
                                       seconds=a.fault_seconds, drain_s=15.0)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pair.rails))]
        for t in threads:
            t.start()
        time.sleep(3.0)
        if a.fault == "host":
            _fault_file(pair, "request").touch()
            cut = _wait_file(_fault_file(pair, "down"), 60)
        else:
            cut = subprocess.run(["ip", "link", "set", "nic0", "down"]).returncode == 0
        t_down = time.monotonic()
        log(f"rail 0 cut ({a.fault}): {cut}")
        # The rail fails at whichever comes first: an error completion (the sender thread ends
        # with it), or the port's async PORT_ERR event, upon which the QP is moved to ERR so
        # that every outstanding work request comes back at once as a flush error (rxe does
        # not time a QP out while its carrier is down: it drops the packets silently).
        ctx0, events, t_event, moved = pair.rails[0].ctx, [], None, False
        deadline = time.monotonic() + a.fault_seconds + 30
        while threads[0].is_alive() and time.monotonic() < deadline:
            new = ctx0.read_async_events()
            events += new
            if t_event is None and any(e["type"] == V.EVENT_PORT_ERR for e in new):
                t_event = time.monotonic()
                pair.rails[0].qp.to_error()
                moved = True
            time.sleep(0.02)
        for t in threads:
            t.join(a.fault_seconds + 60)
        if any(t.is_alive() for t in threads):          # never destroy a QP still in use
            result("fault", side="send", ok=False, stuck=True)
            sys.stdout.flush()
            os._exit(3)
        (pair.store_dir / "fault.senddone").touch()
        r0, r1 = results.get(0, {}), results.get(1, {})
        events += ctx0.read_async_events()
        last_ok_1 = r1.get("started", 0) + r1.get("elapsed", 0)
        t_err = r0.get("first_error_at")
        result("fault", side="send", cut=cut, mode=a.fault,
               rail0_first_error=r0.get("first_error"), rail0_statuses=r0.get("statuses"),
               rail0_detect_s=(t_err - t_down) if t_err else None,
               rail0_event_s=(t_event - t_down) if t_event else None, moved_to_error=moved,
               rail0_ok=r0.get("ok"), rail0_posted=r0.get("posted"),
               rail0_qp_state=pair.rails[0].qp.state,
               rail1_ok=r1.get("ok"), rail1_errors=r1.get("errors"),
               rail1_ok_after_error_s=(last_ok_1 - t_err) if t_err else None,
               rail1_mbit=r1["bytes"] * 8 / r1["elapsed"] / 1e6 if r1.get("elapsed") else None,
               async_events=[e["name"] for e in events],
               timeout=a.qp_timeout, retry_cnt=a.retry_cnt)
        if a.fault == "host":
            _fault_file(pair, "seen").touch()
            _wait_file(_fault_file(pair, "up"), 120)
        else:
            subprocess.run(["ip", "link", "set", "nic0", "up"])
    # fail-back: wait until this side's port is ACTIVE again, then a new QP on rail 0
    rail = pair.rails[0]
    deadline = time.monotonic() + 90
    t0 = time.monotonic()
    while rail.ctx.query_port()["state"] != "ACTIVE" and time.monotonic() < deadline:
        time.sleep(0.2)
    while rail.ctx.roce_v2_ipv4_index(rail.ip) is None and time.monotonic() < deadline:
        time.sleep(0.2)                       # the GID comes back with the address
    rail.gid_index = rail.ctx.roce_v2_ipv4_index(rail.ip)
    active_s = time.monotonic() - t0
    events = rail.ctx.read_async_events()
    rail.connect()
    ok = phase_sendrecv(pair, rail, sizes=[4096, 1 << 20], tag="failback_sendrecv")
    result("failback", ok=ok, port_active_wait_s=active_s, async_events=[e["name"] for e in events],
           qp_state=rail.qp.state)


def orchestrate(fabric, store_dir, host=1, nic=0, timeout=600.0, stop=None):
    """Host side of ``--fault host``: cut HOST's rail NIC when a rank asks (fault.request),
    restore it once the rank saw the errors (fault.seen).  Returns what it did."""
    store_dir = Path(store_dir)
    done, job, deadline, since = [], None, time.monotonic() + timeout, time.time() - 1
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        if job is None:       # a job (this directory, or one per job below it) asking now
            asking = [p.parent for p in [store_dir / "fault.request",
                                         *store_dir.glob("*/fault.request")]
                      if p.exists() and not (p.parent / "fault.down").exists()
                      and p.stat().st_mtime >= since]      # not a request of an older job
            if asking:
                job = asking[0]
                try:
                    fabric.nic_down(host, nic)
                except Exception as exc:   # said in the test's report, not lost with a thread
                    done.append(f"down failed: {exc!r}")
                    break
                (job / "fault.down").touch()
                done.append("down")
        elif (job / "fault.seen").exists():
            try:
                fabric.nic_up(host, nic)
            except Exception as exc:
                done.append(f"up failed: {exc!r}")
                break
            (job / "fault.up").touch()
            done.append("up")
            break
        time.sleep(0.1)
    return done


def main():
    global RANK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fault", choices=("host", "guest", "none"), default="guest")
    ap.add_argument("--qp-timeout", type=int, default=17)
    ap.add_argument("--retry-cnt", type=int, default=7)
    ap.add_argument("--bw-size", type=int, default=65536)
    ap.add_argument("--bw-count", type=int, default=1024)
    ap.add_argument("--fault-seconds", type=float, default=20.0)
    ap.add_argument("--op-timeout", type=float, default=60.0)
    ap.add_argument("--store-timeout", type=float, default=180.0)
    ap.add_argument("--phases", default="devices,sendrecv,writeimm,regcache,bandwidth,perftest,fault")
    ap.add_argument("--orchestrate", action="store_true", help="host side of --fault host")
    ap.add_argument("--fabric", help="with --orchestrate: the RDMA fabric's tag")
    args = ap.parse_args()
    if args.orchestrate:
        from r2comm.testbed.rdma import RdmaFabric
        fab = RdmaFabric.attach(args.fabric)
        print(orchestrate(fab, fab.store_dir))
        return 0
    RANK = int(os.environ.get("R2COMM_RANK", "-1"))
    phases = args.phases.split(",")
    started = time.monotonic()
    pair = Pair(args)
    if "devices" in phases:
        phase_devices(pair)
    for r in pair.rails:
        r.connect()
    if "sendrecv" in phases:
        for r in pair.rails:
            phase_sendrecv(pair, r)
    if "writeimm" in phases:
        for r in pair.rails:
            phase_writeimm(pair, r)
    if "regcache" in phases:
        phase_regcache(pair, pair.rails[0])
    for r in pair.rails:     # ours and perftest back to back per rail: same machine load
        if "bandwidth" in phases:
            for op in ("send", "write_imm"):
                phase_bandwidth(pair, r, op)
        if "perftest" in phases:
            for tool in ("ib_send_bw", "ib_write_bw"):
                for events in ((False, True) if tool == "ib_send_bw" else (False,)):
                    phase_perftest(pair, r, tool, events)   # ib_write_bw has no -e
    if "fault" in phases and args.fault != "none" and len(pair.rails) > 1:
        phase_fault(pair)
    for r in pair.rails:
        r.close_qp()
        r.cache.clear()
    result("done", seconds=time.monotonic() - started)
    return 0


RANK = -1
if __name__ == "__main__":
    sys.exit(main())
