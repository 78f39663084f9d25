"""r2comm.testbed: the emulated multi-NIC cluster really isolates, shapes and fails links.

The netns tests build real namespaces (root + iproute2 needed, else skipped
with the reason).  Every subprocess has a timeout, every fabric is removed in
a finally, and fabric tags carry the pid so parallel runs do not collide.
"""
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r2comm.testbed import Fabric, TestbedError, parse_rate, format_rate
from r2comm.testbed import _iproute as iproute

HELPERS = Path(__file__).parent / "testbed_helpers"
PROBE = [sys.executable, str(HELPERS / "tcp_probe.py")]
TAG = f"t{os.getpid()}"
REPO = str(Path(__file__).resolve().parents[1])


# --- without namespaces -----------------------------------------------------------
def test_parse_and_format_rates():
    assert parse_rate("500mbit") == 500_000_000
    assert parse_rate("1Gbit") == 10**9
    assert parse_rate("100mbps") == 800_000_000
    assert parse_rate("unlimited") is None
    assert format_rate(parse_rate("2.5gbit")) == "2500mbit"
    for bad in ("100", "fast", "1xbit", "1bit"):
        with pytest.raises(TestbedError):
            parse_rate(bad)


def test_clear_errors_when_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        Fabric(tag="never").up()


def test_clear_errors_when_iproute2_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(iproute.shutil, "which", lambda *a, **k: None)
    with pytest.raises(TestbedError, match="iproute2"):
        Fabric(tag="never").up()


def test_rank_placement_is_blocked_and_even():
    fab = Fabric(hosts=2, nics=1, tag="never")
    assert [fab.host_of_rank(r, 4) for r in range(4)] == [0, 0, 1, 1]
    three = Fabric(hosts=3, nics=1, tag="never")
    assert [three.host_of_rank(r, 6) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert fab.rails(1) == ["198.18.0.2"] and fab.mgmt_addr(1) == "198.19.0.2"


# --- with namespaces ----------------------------------------------------------------
@pytest.fixture(scope="session")
def netns_ok():
    """Skip, saying why, where namespaces cannot be built; otherwise they must work."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces")
    try:
        ip = iproute.tool("ip")
        iproute.tool("tc")
    except TestbedError as exc:
        pytest.skip(str(exc))
    probe = f"r2tb-probe{os.getpid()}"
    made = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
    subprocess.run([ip, "netns", "del", probe], capture_output=True, timeout=10)


@pytest.fixture
def fab(netns_ok):
    fabric = Fabric(hosts=2, nics=2, rate="1gbit", tag=TAG).up()
    try:
        yield fabric
    finally:
        fabric.down()


def _ours():
    return [n for n in iproute.netns_names() if n.startswith(f"r2tb-{TAG}-")]


def _root_links():
    return sorted(iproute.links(None))


def _wait_ready(proc, timeout=10):
    """Block until a listener printed 'ready' (bounded); fail with its stderr otherwise."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        pytest.fail(f"listener not ready: {line!r} {proc.stderr.read()}")


@pytest.fixture
def listener(fab):
    """A TCP listener on host 1, every address, port 5301, for the connect tests."""
    proc = fab.popen_in_host(1, PROBE + ["listen", "0.0.0.0", "5301", "--max-seconds", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_ready(proc)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def _connects(fab, host, addr, port=5301, timeout=1.5):
    out = fab.run_in_host(host, PROBE + ["connect", addr, str(port), "--timeout", str(timeout)],
                          timeout=timeout + 10)
    return out.returncode == 0


def _connects_within(fab, host, addr, seconds=5.0):
    """Bounded retry, for right after a link comes back."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _connects(fab, host, addr, timeout=1.0):
            return True
    return False


def _flags(ns, dev):
    return iproute.links(ns)[dev]["flags"]


def _row(fab, host, nic):
    return next(r for r in fab.status() if r["host"] == host and r["nic"] == nic)


@pytest.mark.netns
def test_up_down_twice_leaves_nothing(netns_ok):
    root_before = _root_links()
    for _ in range(2):
        fabric = Fabric(hosts=2, nics=2, rate="1gbit", tag=TAG).up()
        try:
            assert sorted(_ours()) == sorted(fabric.namespaces())
            assert [r["state"] for r in fabric.status()] == ["up"] * 4
            with pytest.raises(TestbedError, match="already exists"):
                Fabric(hosts=2, nics=2, tag=TAG).up()
        finally:
            fabric.down()
        assert _ours() == []
        assert not Path(f"/run/r2comm-testbed/{TAG}.json").exists()
        assert _root_links() == root_before


@pytest.mark.netns
def test_failed_up_and_crash_leave_nothing(netns_ok, monkeypatch):
    def broken_plug(*args):
        raise TestbedError("injected")
    with monkeypatch.context() as patch:
        patch.setattr(Fabric, "_plug", broken_plug)
        with pytest.raises(TestbedError, match="injected"):
            Fabric(hosts=2, nics=2, tag=TAG).up()
    assert _ours() == []
    Fabric(hosts=2, nics=1, tag=TAG).up()
    Path(f"/run/r2comm-testbed/{TAG}.json").unlink()  # as if its owner had crashed
    down = subprocess.run([sys.executable, "-m", "r2comm.testbed", "down", "--tag", TAG], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "removed 3 namespaces" in down.stdout, down.stderr
    assert _ours() == []


@pytest.mark.netns
def test_layout_no_route_out(fab):
    routes = fab.run_in_host(0, ["ip", "-j", "route", "show"], timeout=10, check=True)
    dests = sorted(r["dst"] for r in json.loads(routes.stdout))
    assert dests == ["198.18.0.0/24", "198.18.1.0/24", "198.19.0.0/24"]  # no default route
    for nic in range(2):
        ports = iproute.ip(fab.switch_ns, "-j", "link", "show", "master", f"rail{nic}")
        assert sorted(p["ifname"] for p in json.loads(ports)) == [f"h0n{nic}", f"h1n{nic}"]


@pytest.mark.netns
def test_layout_mtu(fab, listener):
    """Rail NICs carry jumbo frames end to end (both veth ends); mgmt keeps 1500."""
    assert fab.mtu == 9000
    assert {row["mtu"] for row in fab.status()} == {9000}
    links = iproute.links(fab.switch_ns)
    for nic in range(2):
        assert links[f"h0n{nic}"]["mtu"] == 9000 and links[f"h1n{nic}"]["mtu"] == 9000
    assert iproute.links(fab.host_ns(0))["mgmt"]["mtu"] == 1500
    # a TCP connection across rail 1 negotiates a jumbo MSS
    code = ("import socket; s = socket.create_connection(('198.18.1.2', 5301), timeout=5); "
            "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))")
    out = fab.run_in_host(0, [sys.executable, "-c", code], timeout=20)
    assert out.returncode == 0, out.stderr
    assert 8000 < int(out.stdout) < 9000, out.stdout


def test_bad_mtu_is_refused():
    for bad in (100, 70000, "9000"):
        with pytest.raises(TestbedError, match="MTU"):
            Fabric(hosts=2, nics=1, mtu=bad)


@pytest.mark.netns
def test_rate_limit_holds(netns_ok):
    rate = 500_000_000
    with Fabric(hosts=2, nics=1, rate="500mbit", tag=TAG) as fabric:
        sink = fabric.popen_in_host(1, PROBE + ["sink", "198.18.0.2", "5302", "--max-seconds", "20"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_ready(sink)
            sent = fabric.run_in_host(0, PROBE + ["source", "198.18.0.2", "5302", "--seconds", "1.5"],
                                      timeout=30)
            assert sent.returncode == 0, sent.stderr
            result = json.loads(sink.communicate(timeout=30)[0])
        finally:
            sink.kill()
    measured = result["bytes"] * 8 / result["seconds"]
    # tbf counts Ethernet/IP/TCP headers too, so goodput lands ~4% under the rate.
    assert abs(measured - rate) <= 0.15 * rate, f"measured {measured / 1e6:.0f} Mbit/s"


@pytest.mark.netns
def test_rails_are_isolated(fab, listener):
    assert _connects(fab, 0, "198.18.0.2")  # nic0 <-> nic0
    assert _connects(fab, 0, "198.18.1.2")  # nic1 <-> nic1
    # Force host 0 to reach host 1's NIC 1 through its NIC 0: rail 0's switch
    # has no such host, so ARP goes unanswered and the connect must fail.
    fab.run_in_host(0, ["ip", "route", "add", "198.18.1.2/32", "dev", "nic0"], timeout=10, check=True)
    assert not _connects(fab, 0, "198.18.1.2")


@pytest.mark.netns
def test_nic_down_and_up(fab, listener):
    assert _connects(fab, 0, "198.18.1.2")
    fab.nic_down(0, 1)
    assert "UP" not in _flags(fab.host_ns(0), "nic1")
    assert _row(fab, 0, 1)["state"] == "down"
    assert not _connects(fab, 0, "198.18.1.2")
    assert _connects(fab, 0, "198.18.0.2") and _connects(fab, 0, "198.19.0.2")  # others unharmed
    fab.nic_up(0, 1)
    assert _connects_within(fab, 0, "198.18.1.2")

    fab.nic_down(1, 1, side="switch")  # a pulled cable: host 1 sees no carrier
    assert _row(fab, 1, 1)["host_link"] == "no-carrier"
    assert not _connects(fab, 0, "198.18.1.2")
    fab.nic_up(1, 1)
    assert _connects_within(fab, 0, "198.18.1.2")
    assert iproute.links(fab.host_ns(1))["nic1"]["qdisc"] == "tbf"  # rate survived


@pytest.mark.netns
def test_blackhole_is_silent(fab, listener):
    fab.blackhole(1, 1)
    for ns, dev in ((fab.host_ns(1), "nic1"), (fab.switch_ns, "h1n1")):
        assert {"UP", "LOWER_UP"} <= set(_flags(ns, dev))
    assert _row(fab, 1, 1)["state"] == "blackholed"
    assert not _connects(fab, 0, "198.18.1.2")
    assert _connects(fab, 0, "198.18.0.2")
    fab.degrade(1, 1, "200mbit")  # kept while blackholed, applied after
    assert _row(fab, 1, 1)["state"] == "blackholed"
    fab.unblackhole(1, 1)
    assert _connects_within(fab, 0, "198.18.1.2")
    shown = iproute.tc(fab.host_ns(1), "-j", "qdisc", "show", "dev", "nic1")
    assert json.loads(shown)[0]["options"]["rate"] == 200_000_000 // 8  # bytes/s
    assert _row(fab, 1, 1)["rate"] == "200mbit"


@pytest.mark.netns
def test_flap_is_bounded_and_restores(fab):
    start = time.monotonic()
    fab.flap(0, 0, period=0.1, count=3)
    assert time.monotonic() - start < 5
    assert _row(fab, 0, 0)["state"] == "up"
    with pytest.raises(TestbedError):
        fab.flap(0, 0, period=0.1, count=10**6)


@pytest.mark.netns
@pytest.mark.mpi
def test_exec_places_ranks(fab, tmp_path):
    proc = fab.mpiexec(4, [sys.executable, str(HELPERS / "rank_report.py"), str(tmp_path)],
                       timeout=60, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rep in reports:
        host = rep["rank"] * 2 // 4
        assert rep["host"] == host
        assert rep["netns_inode"] == os.stat(f"/var/run/netns/{fab.host_ns(host)}").st_ino
        assert rep["rails"] == fab.rails(host) and rep["ctrl"] == fab.mgmt_addr(host)
        assert rep["owns_rails"] and rep["owns_ctrl"]
        assert rep["allreduce"] == 6


@pytest.mark.netns
def test_cli_round_trip(netns_ok):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "r2comm.testbed", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    try:
        made = cli("up", "--hosts", "2", "--nics", "1", "--rate", "1gbit", "--tag", TAG)
        assert made.returncode == 0, made.stderr
        assert cli("nic-down", "1", "0", "--tag", TAG).returncode == 0
        rows = json.loads(cli("status", "--json", "--tag", TAG).stdout)
        assert [r["state"] for r in rows] == ["up", "down"]
        placed = cli("exec", "--fabric", TAG, "--host", "1", "--",
                     sys.executable, "-c", "import os; print(os.environ['R2COMM_RAILS'])")
        assert placed.stdout.strip() == "198.18.0.2", placed.stderr
        bad = cli("nic-down", "5", "0", "--tag", TAG)
        assert bad.returncode == 1 and "no host 5" in bad.stderr
    finally:
        cli("down", "--tag", TAG)
    assert _ours() == []
