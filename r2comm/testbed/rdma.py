"""A soft-RoCE (rxe) cluster on one machine: one QEMU guest per host, real RDMA devices.

Why guests: rxe devices in different network namespaces of one kernel cannot
exchange traffic, nor can two rxe devices in one namespace, so each emulated
host is its own kernel.  virtme-ng boots the distribution's stock kernel
(``linux-image-amd64``, which has ``rdma_rxe``) under QEMU with software
emulation (TCG: hardware KVM hung here), sharing the host's filesystem
read-only over 9p, so the guest runs the very same Python, r2comm and
rdma-core as the host; nothing is installed in it.

Layout (as in the netns testbed, `fabric`):

* host h     -> guest ``r2rdma-<tag>-h<h>``, 1 vCPU, ``--memory`` MiB
* rail k     -> NIC ``nic<k>`` with 198.18.k.(h+1)/24 and soft-RoCE device
               ``rxe<k>`` on it; rail k of every guest is one L2 segment
* management -> NIC ``mgmt`` with 198.19.0.(h+1)/24 (never failed nor shaped)
* segments   -> QEMU ``-netdev dgram`` over UDP on 127.0.0.1 only: two hosts
               are wired point to point, more go through a small hub process
               (`hub`) that floods each frame to the other members
* faults     -> ``nic-down``/``nic-up`` are the QEMU monitor's ``set_link``
               (the guest sees carrier loss, the rxe port goes DOWN);
               ``degrade`` is a tbf qdisc on the guest's NIC, set by its agent

Everything lives in the state directory ``/tmp/r2comm-rdma/<tag>/``
(``$R2COMM_RDMA_DIR``), which every guest mounts read-write: the fabric's
description, QEMU monitor sockets, console logs, the command queue of each
guest's agent (`_rdma_guest`), rank output and the ranks' rendezvous store.
"""
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..control.ports import free_ports
from ._iproute import TestbedError
from .fabric import MAX_NICS, TAG_RE, mgmt_addr, rail_addr
from .rates import format_rate, parse_rate, tbf_args

EMULATION_DEADLINES = {"R2COMM_RAIL_TIMEOUT_MS": "3000", "R2COMM_PEER_TIMEOUT_MS": "15000"}
STATE_ROOT = Path(os.environ.get("R2COMM_RDMA_DIR", "/tmp/r2comm-rdma"))
DEFAULT_TAG = "rdma"
MAX_HOSTS = 16
DEFAULT_MEMORY_MB = 768
DEFAULT_MTU = 9000
BOOT_TIMEOUT_S = 300.0
GUEST_AGENT = Path(__file__).with_name("_rdma_guest.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
DEPS_HINT = ("install them with `sudo bash scripts/rdma-deps.sh` (apt: qemu-system-x86 "
             "busybox-static linux-image-amd64 rdma-core ibverbs-utils ibverbs-providers; "
             "pip: r2comm[rdma])")
MGMT = "mgmt"


def state_dir(tag):
    return STATE_ROOT / tag


def rdma_tags():
    """Tags of the RDMA fabrics that are up (have a description)."""
    return sorted(p.parent.name for p in STATE_ROOT.glob("*/fabric.json"))


def resolve_rdma_tag(tag=None):
    tag = tag or os.environ.get("R2COMM_TESTBED_FABRIC")
    if tag:
        return tag
    tags = rdma_tags()
    if len(tags) == 1:
        return tags[0]
    if not tags:
        raise TestbedError("no RDMA fabric is up; start one with "
                           "`python -m r2comm.testbed rdma-up` (or rdma-run)")
    raise TestbedError(f"several RDMA fabrics are up ({', '.join(tags)}): choose one with --fabric")


def find_kernel():
    """The newest /boot/vmlinuz-* whose modules include rdma_rxe (or $R2COMM_RDMA_KERNEL)."""
    forced = os.environ.get("R2COMM_RDMA_KERNEL")
    if forced:
        if not os.path.exists(forced):
            raise TestbedError(f"R2COMM_RDMA_KERNEL={forced!r} does not exist")
        return forced
    found = []
    for path in glob.glob("/boot/vmlinuz-*"):
        release = path[len("/boot/vmlinuz-"):]
        if glob.glob(f"/lib/modules/{release}/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*"):
            found.append(path)
    if not found:
        raise TestbedError("no kernel with the rdma_rxe module under /boot; " + DEPS_HINT)
    return sorted(found, key=os.path.getmtime)[-1]


def find_vng():
    for cand in (Path(sys.executable).parent / "vng", shutil.which("vng")):
        if cand and os.access(str(cand), os.X_OK):
            return str(cand)
    raise TestbedError("virtme-ng (vng) not found beside this Python nor on PATH; " + DEPS_HINT)


def preflight():
    """Fail early, saying what is missing, where guests cannot be booted."""
    missing = [t for t in ("qemu-system-x86_64", "busybox", "rdma", "ibv_devinfo") if shutil.which(t) is None]
    if missing:
        raise TestbedError(f"missing {', '.join(missing)}; " + DEPS_HINT)
    if not os.path.isdir("/etc/libibverbs.d"):
        raise TestbedError("no libibverbs providers (/etc/libibverbs.d); " + DEPS_HINT)
    return find_vng(), find_kernel()


def _mac(tag_byte, segment, host):
    return f"52:54:{tag_byte:02x}:{segment:02x}:00:{host + 1:02x}"


def _netdev_id(segment):
    return MGMT if segment == MGMT else f"r{segment}"


class RdmaFabric:
    """HOSTS guests x NICS soft-RoCE rails.  Like `Fabric`: describe, then ``up()`` or ``with``;
    ``RdmaFabric.attach(tag)`` gives a handle on one that another process started."""

    def __init__(self, hosts=2, nics=2, tag=DEFAULT_TAG, memory_mb=DEFAULT_MEMORY_MB,
                 mtu=DEFAULT_MTU):
        if not TAG_RE.match(str(tag)):
            raise TestbedError(f"bad tag {tag!r}: 1-24 letters, digits or '_'")
        if not 1 <= hosts <= MAX_HOSTS or not 1 <= nics <= MAX_NICS:
            raise TestbedError(f"need 1..{MAX_HOSTS} hosts and 1..{MAX_NICS} NICs, "
                               f"got {hosts} x {nics}")
        if not 256 <= int(memory_mb) <= 65536:
            raise TestbedError(f"bad guest memory {memory_mb!r} MiB: 256..65536")
        if not 1280 <= int(mtu) <= 9000:
            raise TestbedError(f"bad MTU {mtu!r}: 1280..9000")
        self.tag, self.hosts, self.nics = str(tag), hosts, nics
        self.memory_mb, self.mtu = int(memory_mb), int(mtu)
        self.dir = state_dir(self.tag)
        self._procs = []

    @classmethod
    def attach(cls, tag=None):
        tag = resolve_rdma_tag(tag)
        desc = cls._load_desc(tag)
        return cls(hosts=desc["nhosts"], nics=desc["nnics"], tag=tag,
                   memory_mb=desc["memory_mb"], mtu=desc["mtu"])

    @staticmethod
    def _load_desc(tag):
        try:
            return json.loads((state_dir(tag) / "fabric.json").read_text())
        except FileNotFoundError:
            raise TestbedError(f"no RDMA fabric {tag!r} is up "
                               f"(no {state_dir(tag) / 'fabric.json'})") from None

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def __repr__(self):
        return f"RdmaFabric(hosts={self.hosts}, nics={self.nics}, tag={self.tag!r})"

    # --- names and addresses (the same as the netns testbed's) ---------------------------
    def _check(self, host, nic=None):
        if not 0 <= host < self.hosts:
            raise TestbedError(f"no host {host}: fabric {self.tag!r} has hosts 0..{self.hosts - 1}")
        if nic is not None and not 0 <= nic < self.nics:
            raise TestbedError(f"no NIC {nic}: fabric {self.tag!r} has NICs 0..{self.nics - 1}")

    def rails(self, host):
        self._check(host)
        return [rail_addr(k, host) for k in range(self.nics)]

    def mgmt_addr(self, host):
        self._check(host)
        return mgmt_addr(host)

    def devices(self):
        return [f"rxe{k}" for k in range(self.nics)]

    def host_of_rank(self, rank, size):
        if not 0 <= rank < size:
            raise TestbedError(f"rank {rank} outside a job of size {size}")
        return rank * self.hosts // size

    @property
    def store_dir(self):
        return self.dir / "store"

    def host_env(self, host):
        """What a process on HOST is told (R2COMM_RAILS etc., as under the netns `exec`)."""
        env = {"R2COMM_RAILS": ",".join(self.rails(host)),
               "R2COMM_CTRL_ADDR": self.mgmt_addr(host),
               "R2COMM_TESTBED_HOST": str(host),
               "R2COMM_TESTBED_FABRIC": self.tag,
               "R2COMM_TRANSPORT": "verbs",
               "R2COMM_RDMA_DEVICES": ",".join(self.devices())}
        # software emulation runs the guests ~100x slower than hardware, and their kernels
        # acknowledge a TCP segment a second late when the host is busy: deadlines to match
        # (the caller's own values win)
        for var, val in EMULATION_DEADLINES.items():
            env[var] = os.environ.get(var, val)
        ready = self.ready_info(host)
        if ready and ready.get("gid_index") is not None:
            env["R2COMM_RDMA_GID_INDEX"] = str(ready["gid_index"])
        return env

    def rank_env(self, rank, size):
        """host_env of the rank's host plus the rendezvous variables (no MPI in the guests)."""
        env = self.host_env(self.host_of_rank(rank, size))
        env.update({"R2COMM_RANK": str(rank), "R2COMM_SIZE": str(size),
                    "R2COMM_STORE_DIR": str(self.store_dir),
                    "R2COMM_TESTBED_RANK": str(rank), "R2COMM_TESTBED_SIZE": str(size)})
        return env

    # --- life cycle -----------------------------------------------------------------------
    def _describe(self):
        """The wiring: each host's NICs (MAC, address, rxe) and, with a hub, each segment's UDP
        ports."""
        tag_byte = uuid.uuid4().int & 0xfe  # locally administered, unicast, differs per fabric
        segments = list(range(self.nics)) + [MGMT]
        wiring = {str(seg): {"guest": None, "hub": None} for seg in segments}
        if self.hosts > 2:  # UDP ports of the guests and of the hub (two hosts: Unix sockets)
            ports = iter(free_ports(2 * len(segments) * self.hosts, udp=True))
            for seg in segments:
                wiring[str(seg)] = {"guest": [next(ports) for _ in range(self.hosts)],
                                    "hub": [next(ports) for _ in range(self.hosts)]}
        hosts = []
        for h in range(self.hosts):
            nics = [{"ifname": f"nic{k}", "segment": k, "mac": _mac(tag_byte, k, h),
                     "addr": rail_addr(k, h), "mtu": self.mtu, "rxe": f"rxe{k}"}
                    for k in range(self.nics)]
            nics.append({"ifname": MGMT, "segment": MGMT, "mac": _mac(tag_byte, 0xff, h),
                         "addr": mgmt_addr(h), "mtu": 1500, "rxe": None})
            hosts.append({"name": f"r2rdma-{self.tag}-h{h}", "nics": nics})
        return {"tag": self.tag, "nhosts": self.hosts, "nnics": self.nics,
                "memory_mb": self.memory_mb, "mtu": self.mtu, "hosts": hosts, "wiring": wiring,
                "links": [[True] * self.nics for _ in range(self.hosts)],
                "rates": [[None] * self.nics for _ in range(self.hosts)], "pids": []}

    def _qemu_opts(self, desc, host):
        """QEMU options wiring HOST's NICs.

        Two hosts: a Unix stream socket per segment (host 0 listens): lossless with
        back-pressure.  UDP datagrams to a slow TCG guest overflow the socket buffer (a fifth
        of the frames were lost, and rxe's retransmit timer cut pingpong to ~10 Mbit/s), and a
        TCP stream (QEMU sets no TCP_NODELAY) added ~40 ms Nagle delays to every round trip.
        More hosts: UDP datagrams on 127.0.0.1 through the hub."""
        opts = []
        for nic in desc["hosts"][host]["nics"]:
            seg = nic["segment"]
            wire = desc["wiring"][str(seg)]
            netdev = _netdev_id(seg)
            if self.hosts <= 2:
                server = "on" if host == 0 else "off"
                opts += ["-netdev", f"stream,id={netdev},server={server},addr.type=unix,"
                         f"addr.path={self._wire_path(seg)}"]
            else:
                opts += ["-netdev", f"dgram,id={netdev},local.type=inet,local.host=127.0.0.1,"
                         f"local.port={wire['guest'][host]},remote.type=inet,"
                         f"remote.host=127.0.0.1,remote.port={wire['hub'][host]}"]
            opts += ["-device", f"virtio-net-pci,netdev={netdev},mac={nic['mac']},rx_queue_size=1024"]
        opts += ["-monitor", f"unix:{self.dir / f'h{host}.mon'},server=on,wait=off"]
        return " ".join(opts)

    def up(self, boot_timeout=BOOT_TIMEOUT_S):
        """Boot every guest and wait until each has its rails and rxe devices; on any failure
        tear down what was started and re-raise."""
        vng, kernel = preflight()
        if (self.dir / "fabric.json").exists():
            raise TestbedError(f"RDMA fabric {self.tag!r} already exists ({self.dir}); remove it "
                               f"with `python -m r2comm.testbed rdma-down --fabric {self.tag}`")
        shutil.rmtree(self.dir, ignore_errors=True)
        for sub in ("cmd", "out", "store"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        desc = self._describe()
        desc["kernel"] = kernel
        self._save(desc)
        try:
            if self.hosts > 2:
                self._start_hub(desc)
            for host in range(self.hosts):
                self._start_guest(desc, host, vng, kernel)
                if host == 0 and self.hosts == 2:
                    # host 1's QEMU connects at start: host 0's must listen by then
                    self._wait_listening([self._wire_path(seg) for seg in desc["wiring"]])
            self._wait_ready(boot_timeout)
        except BaseException:
            self.down()
            raise
        return self

    @contextlib.contextmanager
    def _locked_desc(self):
        """fabric.json for a read-modify-write, serialised between processes (CLI, tests)."""
        with open(self.dir / "fabric.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            desc = self._load_desc(self.tag)
            yield desc
            self._save(desc)

    def check_alive(self):
        """Raise if a guest this process started has exited (QEMU crashed, or was killed)."""
        for proc in self._procs:
            if proc.poll() is not None:
                raise TestbedError(f"a process of RDMA fabric {self.tag!r} exited "
                                   f"(rc {proc.returncode}): {' '.join(proc.args[:3])} ...; see "
                                   f"the consoles in {self.dir}")

    def _spawn(self, argv, log, desc_key="pids"):
        # vng runs its helpers (virtme-run) from PATH: those beside this Python first
        env = {**os.environ, "PATH": os.pathsep.join([str(Path(argv[0]).parent),
                                                      os.environ.get("PATH", "")])}
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=PACKAGE_ROOT, env=env)
        self._procs.append(proc)
        with self._locked_desc() as desc:
            desc[desc_key].append(proc.pid)
        return proc

    def _start_hub(self, desc):
        self._spawn([sys.executable, "-m", "r2comm.testbed.rdma_hub", str(self.dir / "fabric.json")],
                    self.dir / "hub.log")

    def _start_guest(self, desc, host, vng, kernel):
        agent = f"{sys.executable} {GUEST_AGENT} {self.dir} {host}"
        argv = [vng, "--run", kernel, "--disable-kvm", "--user", "root",
                "--name", desc["hosts"][host]["name"], "--memory", f"{self.memory_mb}M",
                "--cpus", "1", "--rwdir", str(self.dir), f"--qemu-opts={self._qemu_opts(desc, host)}",
                "--exec", agent]
        self._spawn(argv, self.dir / f"h{host}.console")

    def _wire_path(self, segment):
        return self.dir / f"wire-{segment}.sock"

    def _wait_listening(self, paths, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            if any(p.poll() is not None for p in self._procs):
                raise TestbedError("guest 0 exited at start; console: "
                                   f"{self._tail(self.dir / 'h0.console')}")
            if time.monotonic() > deadline:
                raise TestbedError(f"guest 0's QEMU did not listen on {paths} in {timeout:.0f} s")
            time.sleep(0.1)

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        pending = set(range(self.hosts))
        while pending:
            for host in sorted(pending):
                if (self.dir / f"h{host}.ready").exists():
                    pending.discard(host)
                elif (self.dir / f"h{host}.failed").exists():
                    raise TestbedError(f"guest {host} failed to set up its rails: "
                                       f"{(self.dir / f'h{host}.failed').read_text().strip()}")
            dead = [p for p in self._procs if p.poll() is not None]
            if pending and dead:
                raise TestbedError(f"a guest exited during boot (rc {dead[0].returncode}); "
                                   f"console: {self._tail(self.dir / f'h{min(pending)}.console')}")
            if pending and time.monotonic() > deadline:
                raise TestbedError(f"guests {sorted(pending)} not up after {timeout:.0f} s; console: "
                                   f"{self._tail(self.dir / f'h{min(pending)}.console')}")
            time.sleep(0.2)

    @staticmethod
    def _tail(path, chars=1500):
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(none)"

    def down(self, grace=10.0):
        """Stop the guests (asked first, then killed) and remove the state; idempotent."""
        removed = remove_rdma_fabric(self.tag, grace=grace, procs=self._procs)
        self._procs = []            # all gone: a later up() boots anew with this handle
        return removed

    # --- state ------------------------------------------------------------------------------
    def _save(self, desc):
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "fabric.json.tmp"
        tmp.write_text(json.dumps(desc, indent=1))
        os.replace(tmp, self.dir / "fabric.json")

    def ready_info(self, host):
        """What guest HOST reported once up: its rxe devices, their GIDs and the RoCE v2 index."""
        try:
            return json.loads((self.dir / f"h{host}.ready").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    # --- running commands in a guest ------------------------------------------------------------
    def spawn(self, host, argv, env=None, output=None, cwd=None):
        """Start ARGV in guest HOST (through its agent); returns a `GuestProcess`.

        The command gets this process's environment plus `host_env` and ENV; its
        stdout and stderr go to OUTPUT (a path on the shared state directory).
        """
        self._check(host)
        if not argv:
            raise TestbedError("nothing to run (empty command)")
        rid = uuid.uuid4().hex[:12]
        base = self.dir / "cmd" / f"h{host}" / rid
        base.parent.mkdir(parents=True, exist_ok=True)
        out = Path(output) if output else base.with_suffix(".out")
        out.touch()
        path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "PYTHONPATH": path, **self.host_env(host), **(env or {})}
        full_env["PATH"] = full_env.get("PATH", "") + ":/usr/sbin:/sbin"
        req = {"argv": [str(a) for a in argv], "env": full_env, "output": str(out),
               "cwd": str(cwd or os.getcwd())}
        tmp = base.with_suffix(".tmp")
        tmp.write_text(json.dumps(req))
        os.replace(tmp, base.with_suffix(".json"))
        return GuestProcess(self, host, base, out)

    def run(self, host, argv, env=None, timeout=60.0):
        """Run ARGV in guest HOST to completion (killed after TIMEOUT s); returns (rc, output)."""
        proc = self.spawn(host, argv, env=env)
        try:
            rc = proc.wait(timeout)
        except TestbedError:
            proc.kill()
            raise
        return rc, proc.output()

    # --- faults and rates ----------------------------------------------------------------------
    def monitor(self, host, command, timeout=30.0, tries=3):
        """Send one HMP command to guest HOST's QEMU monitor; returns its reply text.  Only for
        idempotent commands: a monitor that does not answer in TIMEOUT s (a TCG guest under
        load) is asked again, TRIES times in all."""
        self._check(host)
        path = str(self.dir / f"h{host}.mon")
        for attempt in range(tries):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                try:
                    sock.connect(path)
                    _read_prompt(sock)
                    sock.sendall(command.encode() + b"\n")
                    reply = _read_prompt(sock)
                    break
                except OSError as exc:
                    if attempt == tries - 1:
                        raise TestbedError(f"QEMU monitor of guest {host} ({path}), "
                                           f"{command!r}: {exc}") from None
        # the monitor echoes the command line first
        lines = [ln for ln in reply.splitlines() if command not in ln]
        return "\n".join(lines).strip()

    def _set_link(self, host, nic, up):
        self._check(host, nic)
        reply = self.monitor(host, f"set_link {_netdev_id(nic)} {'on' if up else 'off'}")
        if reply:
            raise TestbedError(f"set_link on guest {host} NIC {nic}: {reply}")
        with self._locked_desc() as desc:
            desc["links"][host][nic] = up

    def nic_down(self, host, nic):
        """Cut rail NIC of HOST (QEMU set_link off: carrier lost, rxe port goes DOWN)."""
        self._set_link(host, nic, False)

    def nic_up(self, host, nic):
        self._set_link(host, nic, True)

    def degrade(self, host, nic, rate, timeout=60.0):
        """Shape NIC of HOST to RATE ('200mbit', or 'unlimited') with tbf in the guest."""
        self._check(host, nic)
        bps = rate if (rate is None or isinstance(rate, int)) else parse_rate(rate)
        dev = f"nic{nic}"
        if bps is None:
            argv = ["sh", "-c", f"tc qdisc del dev {dev} root 2>/dev/null; true"]
        else:
            argv = ["tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(bps)]
        rc, out = self.run(host, argv, timeout=timeout)
        if rc != 0:
            raise TestbedError(f"degrade guest {host} {dev}: {out.strip()}")
        with self._locked_desc() as desc:
            desc["rates"][host][nic] = bps

    def check_rails(self, timeout=5.0):
        """What is wrong with the rails, as a list of lines ([] when all work): every rxe port
        ACTIVE, and from every guest each other guest's rail address answering (a TCP connect
        to a closed port is refused at once where the path works and times out where not)."""
        probe = ("import socket,sys\n"
                 "nics,addrs,t=int(sys.argv[1]),sys.argv[2].split(','),float(sys.argv[3])\n"
                 "for k in range(nics):\n"
                 "    st=open(f'/sys/class/infiniband/rxe{k}/ports/1/state').read().split()[-1]\n"
                 "    if st!='ACTIVE': print(f'rxe{k} port {st}')\n"
                 "for a in filter(None,addrs):\n"
                 "    s=socket.socket(); s.settimeout(t)\n"
                 "    try: s.connect((a,9))\n"
                 "    except ConnectionRefusedError: pass\n"
                 "    except OSError as e: print(f'{a} does not answer ({e})')\n"
                 "    finally: s.close()\n")
        problems = []
        for h in range(self.hosts):
            others = [rail_addr(k, g) for k in range(self.nics) for g in range(self.hosts) if g != h]
            try:
                rc, out = self.run(h, [sys.executable, "-c", probe, str(self.nics), ",".join(others),
                                       str(timeout)], timeout=60 + timeout * len(others))
            except TestbedError as exc:
                problems.append(f"guest {h}: {exc}")
                continue
            problems += [f"guest {h}: {ln}" for ln in out.splitlines() if ln.strip()]
            if rc != 0 and not out.strip():
                problems.append(f"guest {h}: the rail check exited {rc}")
        return problems

    def heal(self, timeout=90.0):
        """Every rail link set on again (idempotent: a test that cut one and died before it
        restored it leaves no trace) and shaping kept; waits until `check_rails` finds nothing
        or TIMEOUT s pass.  Returns what is still wrong ([] when healthy)."""
        for h in range(self.hosts):
            for k in range(self.nics):
                self._set_link(h, k, True)
        deadline = time.monotonic() + timeout
        while True:
            problems = self.check_rails()
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(2)

    def diagnose(self):
        """Text for a failure report: each guest's links, addresses, neighbours, RDMA links
        and its QEMU's view of the network."""
        parts = []
        for h in range(self.hosts):
            with contextlib.suppress(TestbedError):
                parts.append(f"--- guest {h}: QEMU info network\n" + self.monitor(h, "info network"))
            with contextlib.suppress(TestbedError):
                rc, out = self.run(h, ["sh", "-c", "ip -s -br link; ip -br addr; ip neigh; "
                                   "rdma link show"], timeout=60)
                parts.append(f"--- guest {h}: links (rc {rc})\n{out}")
        return "\n".join(parts)

    def status(self):
        desc = self._load_desc(self.tag)
        rows = []
        for h in range(self.hosts):
            ready = self.ready_info(h) or {}
            for k in range(self.nics):
                dev = (ready.get("devices") or {}).get(f"rxe{k}", {})
                rows.append({"host": h, "nic": k, "ifname": f"nic{k}", "addr": rail_addr(k, h),
                             "mgmt": mgmt_addr(h), "device": f"rxe{k}",
                             "gids": [g["gid"] for g in dev.get("gids", [])],
                             "state": "up" if desc["links"][h][k] else "down",
                             "rate": format_rate(desc["rates"][h][k]),
                             "booted": bool(ready)})
        return rows


class GuestProcess:
    """A command running in a guest, as far as the host can see it (Popen-like)."""

    def __init__(self, fabric, host, base, output_path):
        self.fabric, self.host, self.base, self.output_path = fabric, host, base, output_path
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                text = self.base.with_suffix(".rc").read_text().strip()
            except FileNotFoundError:
                return None
            if text:
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TestbedError(f"command in guest {self.host} still running after {timeout} s")
            time.sleep(0.1)
        return self.returncode

    def kill(self):
        self.base.with_suffix(".kill").touch()

    def output(self):
        text = self.output_path.read_text(errors="replace")
        err = self.base.with_suffix(".err")
        return text + (err.read_text() if err.exists() else "")


def _read_prompt(sock):
    buf = b""
    while not buf.endswith(b"(qemu) "):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    # drop terminal escapes the monitor sends
    return re.sub(rb"\x1b\[[0-9;]*[A-Za-z]", b"", buf).decode(errors="replace").replace("(qemu) ", "")


def _killpg(pid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def remove_rdma_fabric(tag, grace=10.0, procs=()):
    """Stop fabric TAG's guests and hub (asked, then SIGKILLed) and delete its state."""
    path = state_dir(tag)
    pids = {p.pid for p in procs}
    try:
        pids.update(json.loads((path / "fabric.json").read_text()).get("pids", []))
    except (OSError, json.JSONDecodeError):
        pass
    if path.exists():
        with contextlib.suppress(OSError):
            (path / "stop").touch()
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline and any(_alive(pid, procs) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        _killpg(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    shutil.rmtree(path, ignore_errors=True)
    return sorted(pids)


def _alive(pid, procs):
    for proc in procs:
        if proc.pid == pid:
            return proc.poll() is None
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def remove_all_rdma():
    """Every RDMA fabric with a state directory (also after a crash)."""
    removed = []
    for tag in sorted(p.name for p in STATE_ROOT.glob("*") if p.is_dir()):
        remove_rdma_fabric(tag, grace=2.0)
        removed.append(tag)
    return removed


# --- rdma-run: N ranks on the guests, without MPI ------------------------------------------------
def run_job(fabric, nranks, argv, timeout=600.0, out=None, env=None):
    """Run ARGV as NRANKS ranks on FABRIC (rank r on host r*H//N), relaying their output line by
    line as ``[r] ...``.  Returns the exit status: 0 if every rank exited 0, else the status of
    the lowest failing rank; 124 if the job was still running after TIMEOUT s (then killed)."""
    out = out or sys.stdout
    if not 1 <= nranks <= 64 * fabric.hosts:
        raise TestbedError(f"-n {nranks}: need 1..{64 * fabric.hosts} ranks")
    if not argv:
        raise TestbedError("rdma-run needs a command after --")
    procs, tails = [], []
    job = f"job-{uuid.uuid4().hex[:8]}"  # each job its own rendezvous store and logs
    store = fabric.store_dir / job
    store.mkdir(parents=True)
    (fabric.dir / "out" / job).mkdir(parents=True)
    try:
        for rank in range(nranks):
            log = fabric.dir / "out" / job / f"rank{rank}.log"
            rank_env = {**fabric.rank_env(rank, nranks), "R2COMM_STORE_DIR": str(store)}
            procs.append(fabric.spawn(fabric.host_of_rank(rank, nranks), argv, output=log,
                                      env={**rank_env, **(env or {})}))
            tails.append([log, 0, b""])
        deadline = time.monotonic() + timeout
        while True:
            running = [p for p in procs if p.poll() is None]
            _relay(tails, out, final=not running)
            if not running:
                break
            fabric.check_alive()
            if time.monotonic() > deadline:
                print(f"r2comm.testbed: rdma-run: ranks {[procs.index(p) for p in running]} "
                      f"still running after {timeout:.0f} s; killing the job", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [p.returncode for p in procs if p.returncode != 0]
    return failed[0] if failed else 0


def _relay(tails, out, final=False):
    for rank, tail in enumerate(tails):
        path, pos, partial = tail
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
        except FileNotFoundError:
            continue
        tail[1] = pos + len(data)
        data = partial + data
        lines = data.split(b"\n")
        tail[2] = lines.pop()  # an unfinished line waits for its end
        if final and tail[2]:
            lines.append(tail[2])
            tail[2] = b""
        for line in lines:
            out.write(f"[{rank}] {line.decode(errors='replace')}\n")
    out.flush()
