"""r2comm.testbed.rdma: real soft-RoCE (rxe) rails between QEMU guests, and faults on them.

The `rdma` tests boot TCG guests (virtme-ng + Debian's stock kernel); where
QEMU, the kernel with rdma_rxe, rdma-core or virtme-ng are missing they skip
and say which and how to install them (scripts/rdma-deps.sh).  Each boot costs
~1 minute of two vCPUs, so one fabric (2 guests x 2 rails) is shared by the
module's tests and torn down at the end; rdma-run's own boot and teardown are
tested with one guest (timeout) and an interrupted boot (Ctrl-C).  Every
command in a guest is bounded (coreutils `timeout` inside, a wait bound outside).
While developing, R2COMM_TEST_RDMA_FABRIC=T reuses a 2 x 2 fabric from `rdma-up --tag T`.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from r2comm.testbed import TestbedError
from r2comm.testbed import rdma
from r2comm.testbed.rdma import RdmaFabric
from r2comm.testbed.rdma_hub import serve as hub_serve

HELPERS = Path(__file__).parent / "testbed_helpers"
REPO = str(Path(__file__).resolve().parents[1])
TAG = f"t{os.getpid()}"
PINGPONG = ["ibv_rc_pingpong", "-s", "65536", "-n", "20", "-m", "4096"]


# --- without guests ----------------------------------------------------------------------
def test_rank_env_placement_and_rendezvous_variables(tmp_path, monkeypatch):
    monkeypatch.setattr(rdma, "STATE_ROOT", tmp_path)
    fab = RdmaFabric(hosts=2, nics=2, tag="never")
    assert [fab.host_of_rank(r, 4) for r in range(4)] == [0, 0, 1, 1]
    env = fab.rank_env(3, 4)
    assert env["R2COMM_RAILS"] == "198.18.0.2,198.18.1.2"
    assert env["R2COMM_CTRL_ADDR"] == "198.19.0.2"
    assert env["R2COMM_TESTBED_HOST"] == "1" and env["R2COMM_TRANSPORT"] == "verbs"
    assert (env["R2COMM_RANK"], env["R2COMM_SIZE"]) == ("3", "4")
    assert env["R2COMM_STORE_DIR"] == str(tmp_path / "never" / "store")
    assert env["R2COMM_RDMA_DEVICES"] == "rxe0,rxe1"
    with pytest.raises(TestbedError, match="outside"):
        fab.host_of_rank(4, 4)


def test_wiring_is_unique_and_on_loopback():
    desc = RdmaFabric(hosts=3, nics=2, tag="never")._describe()
    macs = [nic["mac"] for host in desc["hosts"] for nic in host["nics"]]
    assert len(set(macs)) == len(macs) == 3 * 3
    ports = [p for w in desc["wiring"].values() for p in w["guest"] + w["hub"]]
    assert len(set(ports)) == len(ports)
    addrs = [nic["addr"] for nic in desc["hosts"][2]["nics"]]
    assert addrs == ["198.18.0.3", "198.18.1.3", "198.19.0.3"]
    opts = RdmaFabric(hosts=3, nics=2, tag="never")._qemu_opts(desc, 1)
    assert "host=127.0.0.1" in opts and "0.0.0.0" not in opts
    two = RdmaFabric(hosts=2, nics=1, tag="never")
    opts2 = two._qemu_opts(two._describe(), 1)
    assert "stream" in opts2 and "server=off" in opts2 and "addr.type=unix" in opts2


def test_bad_shapes_and_missing_tools_are_clear_errors(monkeypatch):
    with pytest.raises(TestbedError, match="hosts"):
        RdmaFabric(hosts=0)
    with pytest.raises(TestbedError, match="tag"):
        RdmaFabric(tag="a-b")
    monkeypatch.setattr(rdma.shutil, "which", lambda *a, **k: None)
    with pytest.raises(TestbedError, match="qemu-system-x86_64.*rdma-deps.sh"):
        RdmaFabric(tag="never").up()


def test_hub_floods_frames_to_the_other_members_only(tmp_path):
    ports = rdma.free_ports(6, udp=True)
    guests = []
    for port in ports[:3]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", port))
        s.settimeout(5)
        guests.append(s)
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps({"wiring": {"0": {"guest": ports[:3], "hub": ports[3:]}}}))
    hub = threading.Thread(target=hub_serve, args=(str(path), 0.1), daemon=True)
    hub.start()
    try:
        time.sleep(0.3)
        guests[0].sendto(b"frame-from-0", ("127.0.0.1", ports[3]))
        assert guests[1].recvfrom(100) == (b"frame-from-0", ("127.0.0.1", ports[4]))
        assert guests[2].recvfrom(100) == (b"frame-from-0", ("127.0.0.1", ports[5]))
        guests[0].settimeout(0.5)
        with pytest.raises(socket.timeout):
            guests[0].recvfrom(100)
    finally:
        path.unlink()
        hub.join(timeout=5)
        for s in guests:
            s.close()
    assert not hub.is_alive()


def test_rdma_run_without_a_command_is_an_error():
    out = subprocess.run([sys.executable, "-m", "r2comm.testbed", "rdma-run", "-n", "2"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 1 and "needs a command" in out.stderr


# --- with guests -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rdma_ok():
    """Skip, saying what is missing and how to get it, where guests cannot be booted."""
    try:
        rdma.preflight()
    except TestbedError as exc:
        pytest.skip(f"cannot boot soft-RoCE guests here: {exc}")


# rdma-run's own boots come first: the shared fabric (rfab) is not up yet, fewer vCPUs compete
def _guest_qemus(tag):
    """QEMU processes of fabric TAG still running (their -name carries the tag)."""
    out = subprocess.run(["pgrep", "-f", f"qemu-system.*r2rdma-{tag}-h"], capture_output=True,
                         text=True, timeout=10)
    return out.stdout.split()


@pytest.mark.rdma
@pytest.mark.slow   # the testbed tool's own behaviour; the engine's verbs tests below stay in CI
def test_rdma_run_ctrl_c_during_boot_tears_everything_down(rdma_ok):
    tag = f"c{TAG}"
    proc = subprocess.Popen([sys.executable, "-m", "r2comm.testbed", "rdma-run", "--hosts", "2",
                             "--nics", "1", "-n", "2", "--tag", tag, "--", "sleep", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _guest_qemus(tag):  # both guests are being started
            assert time.monotonic() < deadline and proc.poll() is None, "no guest started"
            time.sleep(0.5)
        time.sleep(3)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert _guest_qemus(tag) == []
    assert not (rdma.STATE_ROOT / tag).exists()


@pytest.mark.rdma
@pytest.mark.slow   # a guest boot of its own (about 100 s under QEMU without KVM)
def test_rdma_run_timeout_kills_the_ranks_and_tears_down(rdma_ok):
    tag = f"o{TAG}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "r2comm.testbed", "rdma-run", "--hosts", "1",
                           "--nics", "1", "-n", "1", "--timeout", "5", "--tag", tag, "--",
                           "sh", "-c", "echo started; sleep 300"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "[0] started" in proc.stdout and "still running after 5 s" in proc.stderr
    assert _guest_qemus(tag) == [] and not (rdma.STATE_ROOT / tag).exists()
    assert time.monotonic() - started < 400


@pytest.fixture(scope="module")
def rfab(rdma_ok):
    reuse = os.environ.get("R2COMM_TEST_RDMA_FABRIC")
    if reuse:  # a 2 x 2 fabric booted by `rdma-up`, kept between runs while developing
        yield RdmaFabric.attach(reuse)
        return
    fab = RdmaFabric(hosts=2, nics=2, tag=TAG)
    started = time.monotonic()
    fab.up()
    print(f"\nboot of 2 guests: {time.monotonic() - started:.1f} s")
    try:
        yield fab
    finally:
        fab.down()
        assert not fab.dir.exists()


@pytest.fixture(autouse=True)
def _healthy_rails(request):
    """Before each test on the shared fabric: every rail link on and every path answering.  A
    test that died with a link cut (or a rail QEMU left broken) must not fail the ones after
    it; a fabric that cannot be healed is booted again, once, with what was wrong printed."""
    if "rfab" not in request.fixturenames:
        yield
        return
    fab = request.getfixturevalue("rfab")
    problems = fab.heal()
    if problems:
        print("\nrails broken before this test:", *problems, fab.diagnose(), sep="\n")
        if os.environ.get("R2COMM_TEST_RDMA_FABRIC"):
            pytest.fail(f"the reused fabric's rails are broken: {problems}")
        fab.down()
        fab.up()
        problems = fab.check_rails()
        assert not problems, f"rails broken after a fresh boot: {problems}"
    yield


def _pingpong(fab, nic, port, server_host=0, client_host=1, timeout=60):
    """ibv_rc_pingpong over rail NIC; the TCP exchange of QP numbers goes over the management
    network, so a dead rail fails the RDMA traffic itself.  Returns (ok, Mbit/s, outputs)."""
    gi = str(fab.ready_info(server_host)["gid_index"])
    args = PINGPONG + ["-d", f"rxe{nic}", "-g", gi, "-p", str(port)]
    server = fab.spawn(server_host, ["timeout", str(timeout), *args])
    rc = 1
    for _ in range(20):  # until the server listens (bounded)
        time.sleep(1)
        rc, out = fab.run(client_host, ["timeout", str(timeout), *args,
                                        fab.mgmt_addr(server_host)], timeout=timeout + 30)
        if "Couldn't connect" not in out:
            break
    server.wait(timeout + 30)
    speed = re.search(r"= ([\d.]+) Mbit/sec", out)
    return (rc == 0 and server.returncode == 0, float(speed.group(1)) if speed else None,
            out + server.output())


def _port_state(fab, host, nic):
    rc, out = fab.run(host, ["cat", f"/sys/class/infiniband/rxe{nic}/ports/1/state"])
    return out.strip()


def _wait_port(fab, host, nic, word, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if word in _port_state(fab, host, nic):
            return True
        time.sleep(1)
    return False


@pytest.mark.rdma
def test_devices_and_gids_seen_by_ibv_devinfo_and_pyverbs(rfab):
    for host in range(2):
        rc, out = rfab.run(host, ["ibv_devinfo", "-v"], timeout=60)
        assert rc == 0, out
        for k in range(2):
            assert f"hca_id:\trxe{k}" in out
            assert f"GID[  1]:\t\t::ffff:198.18.{k}.{host + 1}, RoCE v2" in out, out
        assert out.count("state:\t\t\tPORT_ACTIVE") == 2, out
        assert out.count("link_layer:\t\tEthernet") == 2, out
        # pyverbs from the project's virtualenv Python (sys.path gets the system's dist-packages)
        rc, out = rfab.run(host, [sys.executable, str(HELPERS / "rdma_devices.py")], timeout=120)
        assert rc == 0, out
        found = json.loads(out.strip().splitlines()[-1])
        assert sorted(found) == ["rxe0", "rxe1"]
        for k in range(2):
            assert found[f"rxe{k}"]["state"] == 4  # IBV_PORT_ACTIVE
            gids = found[f"rxe{k}"]["gids"]
            assert {"index": 1, "ipv4": f"198.18.{k}.{host + 1}"}.items() <= gids[1].items(), gids
            assert found[f"rxe{k}"]["link_layer"] == 2  # IBV_LINK_LAYER_ETHERNET: RoCE
        assert rfab.ready_info(host)["gid_index"] == 1


@pytest.mark.rdma
@pytest.mark.slow   # the testbed tool's own behaviour; the engine's verbs tests below stay in CI
def test_pingpong_on_each_rail_then_nic_down_and_up(rfab):
    for nic in range(2):
        ok, speed, out = _pingpong(rfab, nic, 18600 + nic)
        assert ok, out
        print(f"rail {nic}: ibv_rc_pingpong 20 x 64 KiB, {speed} Mbit/s")
    rfab.nic_down(1, 0)
    try:
        assert _wait_port(rfab, 1, 0, "DOWN"), "rxe0 of host 1 did not go DOWN on set_link off"
        assert rfab.status()[2]["state"] == "down"
        started = time.monotonic()
        ok, _, out = _pingpong(rfab, 0, 18610, timeout=40)
        assert not ok, f"pingpong over a cut rail succeeded:\n{out}"
        assert time.monotonic() - started < 120
        ok, _, out = _pingpong(rfab, 1, 18611)
        assert ok, f"rail 1 stopped working while rail 0 was down:\n{out}"
    finally:
        rfab.nic_up(1, 0)
    assert _wait_port(rfab, 1, 0, "ACTIVE"), "rxe0 of host 1 did not come back ACTIVE"
    ok, _, out = _pingpong(rfab, 0, 18620)
    assert ok, f"rail 0 did not work again after nic-up:\n{out}"


def _tcp_mbit(fab, port, seconds=6.0):
    """TCP throughput from host 0 to host 1 over rail 1 (tcp_probe source -> sink), Mbit/s."""
    probe = [sys.executable, str(HELPERS / "tcp_probe.py")]
    sink = fab.spawn(1, probe + ["sink", "198.18.1.2", str(port), "--max-seconds", "90"])
    deadline = time.monotonic() + 60
    while "ready" not in sink.output():
        assert time.monotonic() < deadline and sink.poll() is None, sink.output()
        time.sleep(0.2)
    rc, out = fab.run(0, probe + ["source", "198.18.1.2", str(port), "--seconds", str(seconds)],
                      timeout=seconds + 60)
    assert rc == 0, out
    assert sink.wait(90) == 0, sink.output()
    result = json.loads(sink.output().strip().splitlines()[-1])
    return result["bytes"] * 8 / result["seconds"] / 1e6


@pytest.mark.rdma
@pytest.mark.slow   # the testbed tool's own behaviour; the engine's verbs tests below stay in CI
def test_degrade_shapes_a_rail_and_unlimited_restores_it(rfab):
    """degrade = a tbf qdisc on the guest's NIC (its sending side).  Measured with TCP, which
    backs off: rxe has no congestion control, and through a slow bucket its retransmit timer
    (~67 ms in ibv_rc_pingpong) gives up, as RoCE without a lossless fabric would."""
    before = _tcp_mbit(rfab, 5401)
    rfab.degrade(0, 1, "2mbit")
    try:
        rc, out = rfab.run(0, ["tc", "qdisc", "show", "dev", "nic1"])
        assert "tbf" in out and "2Mbit" in out, out
        assert rfab.status()[1]["rate"] == "2mbit"
        slow = _tcp_mbit(rfab, 5402)
        print(f"\nrail 1 TCP: {before:.1f} Mbit/s unshaped, {slow:.2f} Mbit/s at 2mbit")
        # 6 s at 2 Mbit/s plus the bucket's 192 KiB burst is under 2.3 Mbit/s on average
        assert slow < 2.6 and slow < before / 2, (before, slow)
    finally:
        rfab.degrade(0, 1, "unlimited")
    rc, out = rfab.run(0, ["tc", "qdisc", "show", "dev", "nic1"])
    assert "tbf" not in out
    assert rfab.status()[1]["rate"] == "unlimited"


@pytest.mark.rdma
@pytest.mark.slow   # the testbed tool's own behaviour; the engine's verbs tests below stay in CI
def test_cli_faults_reach_a_running_rdma_fabric(rfab):
    env = {**os.environ, "PYTHONPATH": REPO}
    cli = [sys.executable, "-m", "r2comm.testbed"]
    out = subprocess.run(cli + ["nic-down", "0", "1", "--fabric", rfab.tag], env=env,
                         capture_output=True, text=True, timeout=60)
    try:
        assert out.returncode == 0, out.stderr
        assert _wait_port(rfab, 0, 1, "DOWN")
    finally:
        subprocess.run(cli + ["nic-up", "0", "1", "--fabric", rfab.tag], env=env,
                       capture_output=True, text=True, timeout=60)
    assert _wait_port(rfab, 0, 1, "ACTIVE")
    status = subprocess.run(cli + ["status", "--json", "--fabric", rfab.tag], env=env,
                            capture_output=True, text=True, timeout=60)
    rows = json.loads(status.stdout)
    assert [r["state"] for r in rows] == ["up"] * 4 and rows[3]["device"] == "rxe1"


@pytest.mark.rdma
@pytest.mark.slow   # the testbed tool's own behaviour; the engine's verbs tests below stay in CI
def test_rdma_run_pingpong_between_ranks_on_both_rails(rfab):
    """rdma-run's job part on the module's fabric (--keep: boot and teardown are the other
    rdma-run tests'), so CI boots guests three times, not four."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "r2comm.testbed", "rdma-run", "--keep",
                           "--fabric", rfab.tag, "-n", "2", "--timeout", "400", "--",
                           "sh", str(HELPERS / "rdma_pingpong.sh"), "3"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out  # rank 1's deliberate status, passed on
    assert "[0] rank 0/2 host 0 rails 198.18.0.1,198.18.1.1 ctrl 198.19.0.1 transport verbs" in out
    assert "[1] rank 1/2 host 1 rails 198.18.0.2,198.18.1.2 ctrl 198.19.0.2 transport verbs" in out
    for rank in range(2):
        for k in range(2):
            assert f"[{rank}] rail {k} (rxe{k}) ok" in out, out
    assert len(re.findall(r"\[\d\] .*bytes in .* Mbit/sec", out)) == 4, out
    assert rfab.dir.exists()  # --keep leaves the fabric up
    assert list(rfab.store_dir.glob("job-*/rails.0")), "rank 0's key not in a per-job store"
    print(f"\nrdma-run (2 rails x pingpong): {time.monotonic() - started:.1f} s")


@pytest.mark.rdma
@pytest.mark.slow
def test_three_guests_share_a_rail_through_the_hub(rdma_ok):
    """More than two hosts: the rails go through the UDP hub; host 0 reaches hosts 1 and 2."""
    with RdmaFabric(hosts=3, nics=1, tag=f"h{TAG}", memory_mb=512) as fab:
        for peer in (1, 2):
            ok, speed, out = _pingpong(fab, 0, 18800 + peer, server_host=peer, client_host=0)
            assert ok, out
            print(f"\nhub: host 0 -> host {peer} over rail 0: {speed} Mbit/s")


@pytest.mark.rdma
def test_verbs_layer_on_soft_roce(rfab):
    """r2comm's own verbs layer (r2comm/_core/verbs.pyx) between the guests: the checks live in
    tests/test_verbs.py, run here so that both files share one boot. Functional phases only,
    with 64 messages per bandwidth run (the comparison with perftest is the slow test below)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import test_verbs
    test_verbs.verbs_pair_checks(rfab, test_verbs.FUNCTIONAL, bw_count=64)


@pytest.mark.rdma
@pytest.mark.slow   # a speed comparison (perftest's ib_send_bw/ib_write_bw per rail) under TCG
def test_verbs_layer_bandwidth_against_perftest_on_soft_roce(rfab):
    sys.path.insert(0, str(Path(__file__).parent))
    import test_verbs
    test_verbs.verbs_pair_checks(rfab)


# --- r2comm's engine on verbs rails (tests/test_verbs_rails.py holds the checks) ----------------
def _verbs_rails():
    sys.path.insert(0, str(Path(__file__).parent))
    import test_verbs_rails
    return test_verbs_rails


@pytest.mark.rdma
def test_engine_collectives_and_pinned_memory_per_rank_on_verbs_rails(rfab):
    _verbs_rails().collectives_checks(rfab)


@pytest.mark.rdma
@pytest.mark.slow
def test_engine_pinned_memory_per_rank_with_four_ranks_per_guest(rdma_ok):
    """Issue 31: 4 ranks per guest pin what 1 and 2 do (its own boot: 1.5 GiB guests; about
    7 minutes here)."""
    with RdmaFabric(hosts=2, nics=2, tag=f"q{TAG}", memory_mb=1536) as fab:
        _verbs_rails().four_per_guest_checks(fab)


@pytest.mark.rdma
@pytest.mark.slow   # CI time: the verbs layer's test keeps the registration cache's phase
def test_engine_zero_copy_sends_and_registration_cache_on_verbs(rfab):
    _verbs_rails().regcache_checks(rfab)


@pytest.mark.rdma
@pytest.mark.slow   # CI time: a QP error's failover; the real link-down failover below stays in CI
def test_engine_qp_error_failover_and_failback_on_verbs(rfab):
    _verbs_rails().qp_error_checks(rfab)


@pytest.mark.rdma
def test_engine_real_link_down_failover_and_failback_on_verbs(rfab):
    _verbs_rails().link_down_checks(rfab)


@pytest.mark.rdma
@pytest.mark.slow   # CI time: the partition semantics are in CI over TCP rails (test_failover, test_control_mpi)
def test_engine_raises_on_a_partition_of_verbs_rails(rfab):
    _verbs_rails().partition_checks(rfab)


@pytest.mark.rdma
@pytest.mark.slow   # CI time: pools of a few slots through a QP failure: an edge of the pool logic
def test_engine_tiny_verbs_pools_through_a_qp_failure(rfab):
    _verbs_rails().pool_checks(rfab)
