"""An emulated rail-optimised GPU cluster on one machine, built from network namespaces.

Why: r2comm's claims (striping over several NICs, surviving a NIC that dies
or goes silent) need several NICs per host, real rate limits and real link
failures, seen by the kernel's own TCP stack rather than by a mock.  GPU
clusters are wired "rail-optimised": NIC k of every host plugs into switch k,
so NIC k reaches NIC k of every other host and nothing else.  We build just
that:

* host h    -> netns ``r2tb-<tag>-h<h>``: veths ``nic0..nic{K-1}`` (rail k,
               198.18.k.(h+1)/24) and ``mgmt`` (198.19.0.(h+1)/24)
* switches  -> netns ``r2tb-<tag>-sw``: one bridge per rail (``rail<k>``) and
               one for the management network (``mgmt``); ports ``h<h>n<k>``, ``h<h>m``
* rates     -> a tbf root qdisc on both ends of every rail veth
* MTU       -> rail veths carry jumbo frames (9000 bytes by default), as the
               Ethernet back-end fabrics of GPU clusters are configured; tbf
               counts frame headers, so at 1500 bytes ~4.5% of a shaped rate
               is framing, at 9000 bytes under 1%
* faults    -> ``ip link set down`` (a dead link) or a ``blackhole`` root qdisc
               on both ends (a silent drop, link still UP).  The blackhole
               qdisc is built into every kernel with tc; the drop action of tc
               filters (act_gact) is not, and is missing here.

Addresses come only from the benchmarking range 198.18.0.0/15; no namespace
has a default route or a link to the root namespace, so nothing can leave
the machine.  The management network is never shaped nor failed: it stands
for a cluster's front-end network that r2comm uses for bootstrap and control.

Every name starts with ``r2tb-`` and the description lives in
``/run/r2comm-testbed/<tag>.json``, so other processes (the CLI, ``exec``
under mpiexec) can find a fabric, and ``down --all`` can remove one after a
crash.
"""
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import _iproute as iproute
from ._iproute import TestbedError
from .rates import format_rate, parse_rate, tbf_args

PREFIX = "r2tb-"
STATE_DIR = Path("/run/r2comm-testbed")
DEFAULT_TAG = "default"
MAX_HOSTS = 254  # host h is .(h+1) of a /24
MAX_NICS = 32
SIDES = ("host", "switch", "both")
RAIL_MTU = 9000   # default MTU of the rail NICs (jumbo frames, as on a GPU back-end fabric)
MTU_RANGE = (576, 65535)
MAX_FLAPS = 1000
FLAP_PERIOD_S = (0.02, 600.0)
MGMT = "mgmt"  # the host's management NIC and the switch's management bridge
TAG_RE = re.compile(r"^[A-Za-z0-9_]{1,24}$")  # no '-': it ends the tag in a netns name
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

# No IPv6 anywhere: no link-local chatter (DAD, router solicitations) on the fabric.
_NS_SYSCTLS = {"/proc/sys/net/ipv6/conf/all/disable_ipv6": 1,
               "/proc/sys/net/ipv6/conf/default/disable_ipv6": 1}
# A multi-homed host must answer ARP only on the NIC that owns the address,
# as multi-rail clusters are configured; otherwise host B's nic0 would answer
# for B's nic1 address and the rails would not be isolated.
_HOST_SYSCTLS = {"/proc/sys/net/ipv4/conf/all/arp_ignore": 1,
                 "/proc/sys/net/ipv4/conf/all/arp_announce": 2}


def rail_addr(nic, host):
    """Address of NIC of HOST: rail k is the subnet 198.18.k.0/24."""
    return f"198.18.{nic}.{host + 1}"


def mgmt_addr(host):
    return f"198.19.0.{host + 1}"


def nic_ifname(nic):
    return f"nic{nic}"


def _port(host, nic):
    """The switch-side end of HOST's NIC."""
    return f"h{host}n{nic}"


def _rate_bps(rate):
    """Accept '1gbit', an int of bits/s, or None (unlimited)."""
    if rate is None or isinstance(rate, int):
        return rate
    return parse_rate(rate)


def _state_path(tag):
    return STATE_DIR / f"{tag}.json"


@contextlib.contextmanager
def _state_lock():
    """Serialise read-modify-write of state and qdiscs between processes."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fabric_tags():
    """Tags of the fabrics that have a state file (i.e. are up)."""
    return sorted(p.stem for p in STATE_DIR.glob("*.json"))


def resolve_tag(tag=None):
    """The fabric meant: TAG, else $R2COMM_TESTBED_FABRIC, else the only one up."""
    tag = tag or os.environ.get("R2COMM_TESTBED_FABRIC")
    if tag:
        return tag
    tags = fabric_tags()
    if len(tags) == 1:
        return tags[0]
    if not tags:
        raise TestbedError("no fabric is up; start one with `python -m r2comm.testbed up`")
    raise TestbedError(f"several fabrics are up ({', '.join(tags)}): choose one with --fabric TAG")


def _namespaces_of(tag):
    """Namespaces of fabric TAG as the kernel has them (found by name, so also after a crash)."""
    return [n for n in iproute.netns_names() if n.startswith(f"{PREFIX}{tag}-")]


def remove_fabric(tag):
    """Delete every namespace of fabric TAG and its state; returns the namespaces removed."""
    removed = _namespaces_of(tag)
    for name in removed:
        iproute.netns_del(name)
    for path in (_state_path(tag), _state_path(tag).with_suffix(".json.tmp")):
        path.unlink(missing_ok=True)
    return removed


def remove_all():
    """Delete every testbed namespace and state file, whoever made them (crash cleanup)."""
    removed = [n for n in iproute.netns_names() if n.startswith(PREFIX)]
    for name in removed:
        iproute.netns_del(name)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    return removed


def find_mpiexec():
    """The mpiexec beside this Python (a venv's mpich wheel) first, else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise TestbedError("mpiexec not found beside this Python nor on PATH (pip install mpich)")
    return found


class Fabric:
    """HOSTS hosts x NICS rail NICs, emulated with network namespaces.

    ``Fabric(...)`` only describes a fabric; ``up()`` (or ``with``) builds it
    and ``down()`` removes it.  ``Fabric.attach(tag)`` gives a handle on one
    that is already up, built by another process such as the CLI.  Hosts and
    NICs are 0-based indices.
    """

    def __init__(self, hosts=2, nics=2, rate=None, tag=DEFAULT_TAG, mtu=RAIL_MTU):
        if not TAG_RE.match(str(tag)):
            raise TestbedError(f"bad tag {tag!r}: 1-24 letters, digits or '_'")
        if not 1 <= hosts <= MAX_HOSTS or not 1 <= nics <= MAX_NICS:
            raise TestbedError(f"need 1..{MAX_HOSTS} hosts and 1..{MAX_NICS} NICs, "
                               f"got {hosts} x {nics}")
        if not isinstance(mtu, int) or not MTU_RANGE[0] <= mtu <= MTU_RANGE[1]:
            raise TestbedError(f"bad MTU {mtu!r}: an integer in {MTU_RANGE[0]}..{MTU_RANGE[1]}")
        self.tag, self.hosts, self.nics = str(tag), hosts, nics
        self.rate = _rate_bps(rate)
        self.mtu = mtu

    @classmethod
    def attach(cls, tag=None):
        """Handle on a fabric that is up, from its state file."""
        tag = resolve_tag(tag)
        state = cls._load(tag)
        return cls(hosts=state["hosts"], nics=state["nics"], rate=state["rate"], tag=tag,
                   mtu=state.get("mtu", 1500))

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def __repr__(self):
        return (f"Fabric(hosts={self.hosts}, nics={self.nics}, "
                f"rate={format_rate(self.rate)!r}, tag={self.tag!r}, mtu={self.mtu})")

    # --- names and addresses -------------------------------------------------
    def host_ns(self, host):
        return f"{PREFIX}{self.tag}-h{host}"

    @property
    def switch_ns(self):
        return f"{PREFIX}{self.tag}-sw"

    def namespaces(self):
        return [self.switch_ns] + [self.host_ns(h) for h in range(self.hosts)]

    def rails(self, host):
        """HOST's rail addresses in NIC order (what R2COMM_RAILS carries)."""
        self._check_host(host)
        return [rail_addr(k, host) for k in range(self.nics)]

    def mgmt_addr(self, host):
        self._check_host(host)
        return mgmt_addr(host)

    def host_of_rank(self, rank, size):
        """Ranks spread evenly, in blocks: 4 ranks on 2 hosts -> 0,0,1,1."""
        if not 0 <= rank < size:
            raise TestbedError(f"rank {rank} outside a job of size {size}")
        return rank * self.hosts // size

    def host_env(self, host):
        """Environment a process on HOST gets, telling r2comm which NICs are its own."""
        return {"R2COMM_RAILS": ",".join(self.rails(host)),
                "R2COMM_CTRL_ADDR": self.mgmt_addr(host),
                "R2COMM_TESTBED_HOST": str(host),
                "R2COMM_TESTBED_FABRIC": self.tag}

    # --- life cycle ------------------------------------------------------------
    def up(self):
        """Build the fabric; on any failure remove what was built and re-raise."""
        iproute.preflight()
        existing = _namespaces_of(self.tag)
        if existing or _state_path(self.tag).exists():
            found = ", ".join(existing) or "state file"
            raise TestbedError(f"fabric {self.tag!r} already exists ({found}); remove it with "
                               f"`python -m r2comm.testbed down --tag {self.tag}`")
        try:
            self._build()
            with _state_lock():
                self._save({"hosts": self.hosts, "nics": self.nics, "rate": self.rate,
                            "mtu": self.mtu,
                            "rates": [[self.rate] * self.nics for _ in range(self.hosts)]})
            for host in range(self.hosts):
                for nic in range(self.nics):
                    self._shape(host, nic, self.rate)
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        """Remove this fabric's namespaces (and so all its links) and state; idempotent."""
        return remove_fabric(self.tag)

    def _build(self):
        for ns in self.namespaces():
            iproute.netns_add(ns)
            iproute.write_sysctls(ns, _NS_SYSCTLS if ns == self.switch_ns
                                  else {**_NS_SYSCTLS, **_HOST_SYSCTLS})
            iproute.ip(ns, "link", "set", "lo", "up")
        for bridge in [f"rail{k}" for k in range(self.nics)] + [MGMT]:
            iproute.ip(self.switch_ns, "link", "add", bridge, "type", "bridge")
            iproute.ip(self.switch_ns, "link", "set", bridge, "up")
        for host in range(self.hosts):
            self._plug(host, MGMT, f"h{host}m", MGMT, mgmt_addr(host))
            for nic in range(self.nics):
                self._plug(host, nic_ifname(nic), _port(host, nic), f"rail{nic}",
                           rail_addr(nic, host), self.mtu)

    def _plug(self, host, ifname, port, bridge, addr, mtu=1500):
        """One cable: veth IFNAME (ADDR/24) in HOST, its peer PORT on the switch's BRIDGE."""
        ns, sw = self.host_ns(host), self.switch_ns
        iproute.ip(sw, "link", "add", port, "mtu", str(mtu), "type", "veth",
                   "peer", "name", ifname, "mtu", str(mtu), "netns", ns)
        iproute.ip(sw, "link", "set", port, "master", bridge, "up")
        iproute.ip(ns, "addr", "add", f"{addr}/24", "dev", ifname)
        iproute.ip(ns, "link", "set", ifname, "up")

    # --- state file ---------------------------------------------------------------
    @staticmethod
    def _load(tag):
        try:
            return json.loads(_state_path(tag).read_text())
        except FileNotFoundError:
            raise TestbedError(f"no fabric {tag!r} is up (no {_state_path(tag)})") from None

    def _save(self, state):
        """Atomic write, so a reader never sees half a file."""
        path = _state_path(self.tag)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"tag": self.tag, **state}, indent=1))
        os.replace(tmp, path)

    # --- faults and rates ---------------------------------------------------------
    def _check_host(self, host):
        if not 0 <= host < self.hosts:
            raise TestbedError(f"no host {host}: fabric {self.tag!r} has hosts 0..{self.hosts - 1}")

    def _ends(self, host, nic, side="both"):
        """(namespace, device) of the host end and/or the switch end of a rail NIC."""
        self._check_host(host)
        if not 0 <= nic < self.nics:
            raise TestbedError(f"no NIC {nic}: fabric {self.tag!r} has NICs 0..{self.nics - 1}")
        if side not in SIDES:
            raise TestbedError(f"bad side {side!r}: one of {', '.join(SIDES)}")
        host_end = (self.host_ns(host), nic_ifname(nic))
        switch_end = (self.switch_ns, _port(host, nic))
        return {"host": [host_end], "switch": [switch_end], "both": [host_end, switch_end]}[side]

    def nic_down(self, host, nic, side="host"):
        """Take a rail link down.

        side="host": the host's NIC is set down (its routes vanish, sends fail
        at once); "switch": the switch port is (the host sees NO-CARRIER, as
        for a pulled cable); "both".
        """
        for ns, dev in self._ends(host, nic, side):
            iproute.ip(ns, "link", "set", dev, "down")

    def nic_up(self, host, nic):
        """Bring both ends back up; rates and blackholes survive a down/up."""
        for ns, dev in self._ends(host, nic):
            iproute.ip(ns, "link", "set", dev, "up")

    def isolate(self, host):
        """Cut HOST off the network: the switch ports of its rail NICs and of its management
        NIC go down (the host sees no carrier; nothing it sends arrives, nothing refuses), while
        its processes run on: an unreachable host, not a dead one. reconnect() undoes it."""
        self._check_host(host)
        for port in [_port(host, nic) for nic in range(self.nics)] + [f"h{host}m"]:
            iproute.ip(self.switch_ns, "link", "set", port, "down")

    def reconnect(self, host):
        """Undo isolate(HOST)."""
        self._check_host(host)
        for port in [_port(host, nic) for nic in range(self.nics)] + [f"h{host}m"]:
            iproute.ip(self.switch_ns, "link", "set", port, "up")

    def flap(self, host, nic, period=1.0, count=3, side="host"):
        """COUNT cycles of down for PERIOD/2 then up for PERIOD/2 (blocking)."""
        lo, hi = FLAP_PERIOD_S
        if not (lo <= period <= hi and 1 <= count <= MAX_FLAPS):
            raise TestbedError(f"flap needs {lo} <= period <= {hi} s and 1 <= count <= {MAX_FLAPS}")
        self._ends(host, nic, side)  # validate before the first change
        for _ in range(count):
            self.nic_down(host, nic, side)
            time.sleep(period / 2)
            self.nic_up(host, nic)
            time.sleep(period / 2)

    def degrade(self, host, nic, rate):
        """Set a rail NIC's rate (both directions); kept, not applied, while blackholed."""
        self._ends(host, nic)  # validate before touching the state file
        bps = _rate_bps(rate)
        with _state_lock():
            state = self._load(self.tag)
            state["rates"][host][nic] = bps
            self._save(state)
            if not self._is_blackholed(host, nic):
                self._shape(host, nic, bps)

    def blackhole(self, host, nic):
        """Drop every packet both ways, silently: the link stays UP, nothing reports an error."""
        with _state_lock():
            for ns, dev in self._ends(host, nic):
                iproute.tc(ns, "qdisc", "replace", "dev", dev, "root", "blackhole")

    def unblackhole(self, host, nic):
        """Stop dropping; the NIC gets back its configured rate."""
        with _state_lock():
            self._shape(host, nic, self._load(self.tag)["rates"][host][nic])

    def _shape(self, host, nic, bps):
        for ns, dev in self._ends(host, nic):
            if bps is not None:
                iproute.tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bps))
            elif iproute.links(ns)[dev].get("qdisc") in ("tbf", "blackhole"):
                iproute.tc(ns, "qdisc", "del", "dev", dev, "root")

    def _is_blackholed(self, host, nic):
        return any(iproute.links(ns)[dev].get("qdisc") == "blackhole"
                   for ns, dev in self._ends(host, nic))

    # --- status -----------------------------------------------------------------------
    def status(self):
        """One dict per rail NIC, read from the kernel (links, qdiscs) and the state file (rates)."""
        rates = self._load(self.tag)["rates"]
        switch_links = iproute.links(self.switch_ns)
        rows = []
        for host in range(self.hosts):
            host_links = iproute.links(self.host_ns(host))
            for nic in range(self.nics):
                mine, peer = host_links[nic_ifname(nic)], switch_links[_port(host, nic)]
                rows.append({"host": host, "nic": nic, "ifname": nic_ifname(nic),
                             "addr": rail_addr(nic, host), "mgmt": mgmt_addr(host),
                             "host_link": _link_word(mine), "switch_link": _link_word(peer),
                             "state": _nic_state(mine, peer), "rate": format_rate(rates[host][nic]),
                             "mtu": mine.get("mtu")})
        return rows

    # --- running things inside ------------------------------------------------------
    def _in_host(self, host, argv, env):
        self._check_host(host)
        cmd = [iproute.tool("ip"), "netns", "exec", self.host_ns(host), *argv]
        return cmd, {**os.environ, **self.host_env(host), **(env or {})}

    def run_in_host(self, host, argv, timeout=60, env=None, **kwargs):
        """subprocess.run ARGV inside HOST (output captured as text unless told otherwise)."""
        cmd, full_env = self._in_host(host, argv, env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(cmd, env=full_env, timeout=timeout, **kwargs)

    def popen_in_host(self, host, argv, env=None, **kwargs):
        """subprocess.Popen ARGV inside HOST; the caller bounds it (communicate(timeout=...))."""
        cmd, full_env = self._in_host(host, argv, env)
        return subprocess.Popen(cmd, env=full_env, **kwargs)

    def mpiexec(self, nranks, argv, env=None, timeout=120, launcher=None, mpiexec_args=(),
                **kwargs):
        """Start ``mpiexec -n NRANKS`` whose ranks run ARGV placed in the fabric; returns the Popen.

        Each rank goes through ``python -m r2comm.testbed exec``, which moves
        it into its host's namespace.  MPIEXEC_TIMEOUT makes hydra kill the
        whole job after TIMEOUT seconds, so a hung rank cannot outlive a test.
        mpiexec_args go before ``-n`` (``-disable-auto-cleanup``: survivors live on).
        """
        cmd = [launcher or find_mpiexec(), *mpiexec_args, "-n", str(nranks), sys.executable,
               "-m", "r2comm.testbed", "exec", "--fabric", self.tag, "--", *argv]
        path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {}),
                    "MPIEXEC_TIMEOUT": str(max(1, int(timeout)))}
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(cmd, env=full_env, **kwargs)


def kill_job(proc):
    """End a job from Fabric.mpiexec(..., start_new_session=True) that is still running:
    mpiexec and its ranks, which share its process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _link_word(link):
    """'up', 'no-carrier' (admin up, peer down) or 'down' (admin down)."""
    flags = link.get("flags", [])
    if "UP" not in flags:
        return "down"
    return "up" if "LOWER_UP" in flags else "no-carrier"


def _nic_state(mine, peer):
    words = []
    if _link_word(mine) != "up" or _link_word(peer) != "up":
        words.append("down")
    if "blackhole" in (mine.get("qdisc"), peer.get("qdisc")):
        words.append("blackholed")
    return "+".join(words) or "up"
