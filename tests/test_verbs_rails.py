"""r2comm's engine on verbs rails (R2COMM_TRANSPORT=verbs): the transport choice and its errors
here, and, on soft-RoCE guests, collectives, failover and fail-back.

The checks that need guests are functions called by tests/test_rdma_testbed.py on its shared
2 x 2 fabric (one boot for every rdma test); each runs tests/verbs_worker.py as the ranks of an
`rdma-run --keep` job and checks its OK lines."""
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from r2comm import transport
from r2comm.transport import verbs as verbs_rails
from r2comm.errors import R2commArgumentError

HERE = Path(__file__).parent
REPO = str(HERE.parent)
WORKER = str(HERE / "verbs_worker.py")


# --- without RDMA ----------------------------------------------------------------------------
def test_decide_agrees_on_one_transport_or_raises_naming_ranks():
    ok = ("verbs", "verbs", None)
    no = ("verbs", "tcp", "no RDMA device carries rail 1 (198.18.1.2)")
    assert transport.decide([ok, ok]) == "verbs"
    with pytest.raises(R2commArgumentError, match=r"rank 1 has no usable RDMA device: no RDMA "
                                                  r"device carries rail 1"):
        transport.decide([ok, no])
    auto_ok, auto_no = ("auto", "verbs", None), ("auto", "tcp", "no RDMA device")
    assert transport.decide([auto_ok, auto_ok]) == "verbs"
    assert transport.decide([auto_ok, auto_no]) == "tcp"       # auto: TCP unless all can
    assert transport.decide([("tcp", "tcp", "R2COMM_TRANSPORT=tcp")] * 3) == "tcp"
    with pytest.raises(R2commArgumentError, match="differs between ranks"):
        transport.decide([ok, ("tcp", "tcp", "")])


def test_verbs_without_a_device_is_a_clear_error_on_every_rank():
    """No RDMA device on this machine: R2COMM_TRANSPORT=verbs must raise on every rank, never
    fall back to TCP; auto runs on TCP and comm.rails says so."""
    if verbs_rails.find_devices(["127.0.0.1"])[0][0] is not None:
        pytest.skip("this machine has an RDMA device for 127.0.0.1")
    sys.path.insert(0, str(HERE))
    from conftest import run_mpi
    script = HERE / "transport_choice.py"
    _, out = run_mpi(2, [str(script)], env={"R2COMM_TRANSPORT": "verbs"}, timeout=120)
    # (lines of the two ranks may interleave)
    assert sorted(re.findall(r"CHOICE (\d) R2commArgumentError R2COMM_TRANSPORT=verbs, but "
                             r"rank 0 has no usable RDMA device", out)) == ["0", "1"], out[-3000:]
    _, out = run_mpi(2, [str(script)], env={"R2COMM_TRANSPORT": "auto"}, timeout=120)
    assert sorted(re.findall(r"CHOICE (\d) transports tcp,tcp engine \['tcp'\]", out)) == \
        ["0", "1"], out[-3000:]


def test_min_rail_timeout_covers_two_qp_ack_timeouts():
    v, why = verbs_rails.load()
    if v is None:
        pytest.skip(why)
    assert verbs_rails.min_rail_timeout_ms() == pytest.approx(2 * 4.096e-3 * 2 ** v.DEFAULT_QP_TIMEOUT)


def test_verbs_pool_settings_validated_and_defaults_agree_with_the_transport(monkeypatch):
    """R2COMM_VERBS_RECV_SLOTS / _SEND_SLOTS / _CONN_SEND_SLOTS: a clear error when out of range,
    the per-connection cap clipped to the pool, and Config's defaults are the transport's."""
    from r2comm.config import Config
    for name, bad in (("R2COMM_VERBS_RECV_SLOTS", "1"), ("R2COMM_VERBS_SEND_SLOTS", "0"),
                      ("R2COMM_VERBS_CONN_SEND_SLOTS", "0"), ("R2COMM_VERBS_RECV_SLOTS", "x")):
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            with pytest.raises(R2commArgumentError, match=name):
                Config.from_env()
    monkeypatch.setenv("R2COMM_VERBS_SEND_SLOTS", "8")
    monkeypatch.setenv("R2COMM_VERBS_CONN_SEND_SLOTS", "100")
    c = Config.from_env()
    assert (c.verbs_send_slots, c.verbs_conn_send_slots) == (8, 8)
    v, why = verbs_rails.load()
    if v is None:
        pytest.skip(why)
    d = Config()
    assert v.transport_slots() == (64 * 1024, d.verbs_recv_slots, d.verbs_send_slots,
                                   d.verbs_conn_send_slots)


def local_rdma_rails():
    """IPv4 addresses of this machine's active RoCE ports (a real RDMA device), or None."""
    v, _ = verbs_rails.load()
    if v is None or not v.device_names():
        return None
    addrs = []
    for name in v.device_names():
        try:
            ctx = v.Context(name)
        except v.VerbsError:
            continue
        if ctx.query_port()["state"] == "ACTIVE":
            for _idx, gid, typ in ctx.gids():
                parts = gid.split(":")
                if typ == 2 and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
                    hi, lo = int(parts[6], 16), int(parts[7], 16)
                    addrs.append(f"{hi >> 8}.{hi & 255}.{lo >> 8}.{lo & 255}")
        ctx.close()
    return addrs or None


def test_collectives_on_this_machines_rdma_device():
    """Where this machine has an RDMA device (any `ibv_devices` output), the engine's verbs
    collectives run on it too: 2 ranks under mpiexec, one rail per active RoCE port."""
    rails = local_rdma_rails()
    if not rails:
        pytest.skip("no RDMA device with an active RoCE port on this machine (ibv_devices lists "
                    "none; this kernel has no RDMA modules): the soft-RoCE guests run these checks")
    sys.path.insert(0, str(HERE))
    from conftest import run_mpi
    _, out = run_mpi(2, [WORKER, "collectives", "sizes=1,1000,300001"], timeout=300,
                     env={"R2COMM_TRANSPORT": "verbs", "R2COMM_RAILS": ",".join(rails[:2])})
    assert len(re.findall(r"^OK collectives \d", out, re.M)) == 2, out[-4000:]


# --- on a soft-RoCE fabric (called by tests/test_rdma_testbed.py) ------------------------------
def rdma_job(fab, nranks, args, timeout=400, env=None):
    """Run verbs_worker.py ARGS as NRANKS ranks on the booted fabric; returns (rc, output)."""
    proc = subprocess.run([sys.executable, "-m", "r2comm.testbed", "rdma-run", "--keep",
                           "--fabric", fab.tag, "-n", str(nranks), "--timeout", str(timeout),
                           "--", sys.executable, WORKER, *args],
                          capture_output=True, text=True, timeout=timeout + 120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def ok_lines(out, scenario, nranks):
    lines = [m.group(1) for m in re.finditer(rf"^\[\d+\] OK {scenario} (.*)$", out, re.M)]
    assert len(lines) == nranks, out[-6000:]
    return lines


def collectives_checks(fab):
    """Every collective exact against numpy over verbs rails: 2 ranks (one per host) and 4
    ranks (two per host: same-host pairs share the host's rxe devices). Pinned memory per rank
    is independent of the peer count: 1 and 2 ranks per guest (1 and 2 QPs per device) pin the
    same bytes per rank, the devices' slot pools (R2COMM_VERBS_* defaults); 4 ranks per guest:
    four_per_guest_checks (slow)."""
    from r2comm._core import verbs as v
    slot, nrecv, nsend, _ = v.transport_slots()
    want = 2 * (nrecv + nsend) * slot                    # 2 rails: one device each
    seen = {}
    for n, sizes in ((2, "1,1000,300001"), (4, "1,1000,300001")):
        started = time.monotonic()
        rc, out = rdma_job(fab, n, ["collectives", f"sizes={sizes}", "watchdog=300", "pool=1"])
        assert rc == 0, out[-6000:]
        lines = ok_lines(out, "collectives", n)
        assert all("rxe0:1" in ln and "rxe1:1" in ln for ln in lines), lines
        print(f"\nverbs collectives, {n} ranks: {time.monotonic() - started:.1f} s; {lines[0]}")
        pools = pool_lines(out, n)
        assert {p["live"]["pinned_bytes"] for p in pools.values()} == {want}, pools
        qps = {d["conns"] for p in pools.values() for d in p["live"]["devices"].values()}
        assert min(qps) >= n // 2, qps               # a QP per peer on the other guest at least
        assert_pools_whole(pools)
        seen[n] = qps
        print(f"verbs pools, {n} ranks: {want} pinned bytes per rank, QPs per device {qps}")
    assert min(seen[4]) > max(seen[2]), seen        # more QPs, the same pinned bytes


SLOW_GUEST_DEADLINES = {"R2COMM_CONNECT_TIMEOUT": "30", "R2COMM_RAIL_TIMEOUT_MS": "6000",
                        "R2COMM_PEER_TIMEOUT_MS": "30000", "R2COMM_LIVENESS_PERIOD_MS": "1000",
                        "R2COMM_LIVENESS_SUSPECT_MS": "15000"}


def four_per_guest_checks(fab):
    """8 ranks on 2 guests (4 per guest, 4 QPs per device): every collective exact, and each
    rank pins the same bytes as with 1 or 2 ranks per guest (its devices' slot pools). Four
    Python ranks on one emulated vCPU answer slowly: with the default deadlines the start-up
    connections (5 s) and the failure detector (2 s) gave up on starved ranks under load, so
    the job runs with longer ones (SLOW_GUEST_DEADLINES); the guests need 1.5 GiB."""
    from r2comm._core import verbs as v
    slot, nrecv, nsend, _ = v.transport_slots()
    want = 2 * (nrecv + nsend) * slot
    rc, out = rdma_job(fab, 8, ["collectives", "sizes=1,1000,300001", "watchdog=700", "pool=1"],
                       timeout=800, env=SLOW_GUEST_DEADLINES)
    assert rc == 0, out[-6000:]
    lines = ok_lines(out, "collectives", 8)
    assert all("rxe0:1" in ln and "rxe1:1" in ln for ln in lines), lines
    pools = pool_lines(out, 8)
    assert {p["live"]["pinned_bytes"] for p in pools.values()} == {want}, pools
    qps = {d["conns"] for p in pools.values() for d in p["live"]["devices"].values()}
    assert min(qps) >= 4, qps                      # a QP per peer on the other guest at least
    assert_pools_whole(pools)
    print(f"verbs pools, 8 ranks on 2 guests: {want} pinned bytes per rank, QPs per device {qps}")


def regcache_checks(fab):
    """Zero-copy sends from registered user memory (the registration cache): arrays freed and
    allocated again at the same addresses, overwritten between sends, more than the cache
    holds (1 MiB arrays, a 3 MiB cache: evictions); every result exact and equal to the same
    job's pass with zero-copy off; registrations dropped as their arrays go."""
    rc, out = rdma_job(fab, 2, ["regcache", "watchdog=300"],
                       env={"R2COMM_VERBS_REG_CACHE": "3M"})
    assert rc == 0, out[-6000:]
    lines = ok_lines(out, "regcache", 2)
    assert all("equal" in ln for ln in lines), lines
    reused = [int(re.search(r"reused=(\d+)", ln).group(1)) for ln in lines]
    zc = [int(re.search(r"zcopy=(\d+)", ln).group(1)) for ln in lines]
    assert max(reused) > 0, lines        # the allocator did hand the same addresses out again
    assert min(zc) > 0, lines
    print("\nverbs registration cache:", *lines, sep="\n  ")


def qp_error_checks(fab):
    """A rail's QP moved to error mid-stream (fail_rail hard on one rank: QP to ERR, its
    companion socket shut): the stream's results are bitwise equal to the fault-free run, both
    ends record the failure at once, and the rail is re-admitted with a new QP (fail-back)."""
    rc, out = rdma_job(fab, 2, ["fault", "mode=qp", "failback=1", "n=131072", "ops=30", "at=8"])
    assert rc == 0, out[-6000:]
    lines = ok_lines(out, "fault", 2)
    assert all("bitwise equal" in ln and "restored=True" in ln for ln in lines), lines
    print("\nverbs QP error:", *lines, sep="\n  ")


@contextlib.contextmanager
def link_cut_on_marker(fab, marker, host, nic, timeout=400):
    nics = list(nic) if isinstance(nic, (list, tuple)) else [nic]
    """While the body runs, cut HOST's NIC (or NICs) when a rank writes MARKER.down (then answer with
    MARKER.cut) and restore it a second after MARKER.up: a real link failure at the point of
    a job the job chooses. Yields the list of what was done ("down", "up"); the link is up and
    the markers gone afterwards, whatever happened."""
    did, stop = [], threading.Event()

    def orchestrate():
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            if os.path.exists(marker + ".down") and "down" not in did:
                for k in nics:
                    fab.nic_down(host, k)
                did.append("down")
                with open(marker + ".cut", "w") as f:
                    f.write("cut")
            if os.path.exists(marker + ".up") and "down" in did and "up" not in did:
                time.sleep(1.0)
                for k in nics:
                    fab.nic_up(host, k)
                did.append("up")
                return
            time.sleep(0.05)
    orch = threading.Thread(target=orchestrate)
    orch.start()
    try:
        yield did
    finally:
        stop.set()
        orch.join(30)
        if "down" in did and "up" not in did:
            for k in nics:
                fab.nic_up(host, k)
        for suffix in (".down", ".cut", ".up"):
            if os.path.exists(marker + suffix):
                os.unlink(marker + suffix)


def link_down_checks(fab, host=1, nic=0):
    """A real link cut in QEMU (the rxe port goes down) mid-stream, brought back later:
    bitwise-equal results, the failure seen, and fail-back onto the restored link."""
    marker = str(fab.dir / f"mark{os.getpid()}")
    with link_cut_on_marker(fab, marker, host, nic) as did:
        rc, out = rdma_job(fab, 2, ["fault", "mode=link", "failback=1", "n=131072", "ops=30",
                                    "at=8", f"marker={marker}", f"rail={nic}"])
    assert rc == 0, out[-6000:]
    assert did == ["down", "up"], did
    lines = ok_lines(out, "fault", 2)
    assert all("bitwise equal" in ln and "restored=True" in ln for ln in lines), lines
    print("\nverbs link down:", *lines, sep="\n  ")


def partition_checks(fab, host=1):
    """Every rail between the two hosts cut (both of host 1's NICs down) while a collective
    waits: no common rail is left and no third rank to relay through, so both ranks raise
    R2commNetworkError within the peer deadline, never hang."""
    marker = str(fab.dir / f"part{os.getpid()}")
    with link_cut_on_marker(fab, marker, host, (0, 1)) as did:
        rc, out = rdma_job(fab, 2, ["partition", f"marker={marker}", "watchdog=200"])
    assert rc == 0, out[-6000:]
    assert did == ["down", "up"], did
    lines = ok_lines(out, "partition", 2)
    print("\nverbs partition:", *lines, sep="\n  ")


def pool_lines(out, nranks):
    """The POOL json of every rank (verbs_worker.py pool=1), by rank."""
    pools = {int(m.group(1)): json.loads(m.group(2))
             for m in re.finditer(r"^\[\d+\] POOL (\d+) (\{.*\})$", out, re.M)}
    assert sorted(pools) == list(range(nranks)), out[-6000:]
    return pools


def assert_pools_whole(pools):
    """Every slot of every device back in its pool once the connections are closed."""
    for rank, p in pools.items():
        for addr, d in p["closed"]["devices"].items():
            assert (d["recv_posted"], d["recv_held"], d["send_free"], d["conns"]) == \
                (d["recv_slots"], 0, d["send_slots"], 0), (rank, addr, d)


def pool_checks(fab):
    """A rail's QP failed mid-stream with tiny pools (the SRQ runs dry: RNR flow control; send
    slots shared by waiters): results bitwise equal and every slot back in the pool (the pools
    at their defaults: collectives_checks)."""
    from r2comm._core import verbs as v
    slot = v.transport_slots()[0]
    tiny = {"R2COMM_VERBS_RECV_SLOTS": "4", "R2COMM_VERBS_SEND_SLOTS": "3",
            "R2COMM_VERBS_CONN_SEND_SLOTS": "2"}
    rc, out = rdma_job(fab, 2, ["fault", "mode=qp", "failback=1", "n=131072", "ops=30", "at=8",
                                "pool=1"], env=tiny)
    assert rc == 0, out[-6000:]
    lines = ok_lines(out, "fault", 2)
    assert all("bitwise equal" in ln and "restored=True" in ln for ln in lines), lines
    pools = pool_lines(out, 2)
    assert {p["live"]["pinned_bytes"] for p in pools.values()} == {2 * 7 * slot}, pools
    assert min(d["recv_low"] for p in pools.values()
               for d in p["live"]["devices"].values()) == 0    # the SRQ did run dry
    assert_pools_whole(pools)
    print("\nverbs pools after a QP failure (4 receive, 3 send slots):", *lines, sep="\n  ")
