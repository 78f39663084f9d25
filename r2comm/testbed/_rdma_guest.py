"""The agent that runs inside each guest of an RDMA fabric (see `rdma`); stdlib only.

Started by virtme-ng as the guest's only command: ``python _rdma_guest.py STATE_DIR HOST``.
STATE_DIR is the fabric's directory, shared read-write with the host and every
other guest over 9p (mounted ``sync``, so a write is on the host at once).

1. Networking from ``STATE_DIR/fabric.json``: every NIC is found by its MAC,
   renamed (``nic<k>``, ``mgmt``), given its MTU and address and set up; one
   soft-RoCE device ``rxe<k>`` is created on each rail NIC.
2. ``h<H>.ready`` (JSON: devices, GIDs, GID index) tells the host it is up;
   a failure is written to ``h<H>.failed`` instead.
3. Then it serves requests: the host drops ``cmd/h<H>/<id>.json``
   (argv, env, cwd, output file); the agent runs it, its stdout and stderr
   going to that file, and writes ``<id>.rc`` when it ends.  ``<id>.kill``
   kills it.  ``STATE_DIR/stop`` ends the agent, and with it the guest.

Polling a directory is the whole protocol because the shared filesystem is the
only channel between host and guest (the guests have no network to the host).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.1
SBIN = "/usr/sbin:/sbin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin"


def _sh(*argv, check=True):
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": SBIN + ":" + os.environ.get("PATH", "")})
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _write_atomic(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _by_mac():
    found = {}
    for name in os.listdir("/sys/class/net"):
        try:
            with open(f"/sys/class/net/{name}/address") as f:
                found[f.read().strip().lower()] = name
        except OSError:
            pass
    return found


def _sysctl(path, value):
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError:
        pass


def setup_network(fabric, host):
    """Rename, address and raise every NIC of HOST; returns the rxe device names."""
    # one address per NIC and ARP answered only by the NIC that owns it, as in the netns testbed
    _sysctl("/proc/sys/net/ipv4/conf/all/arp_ignore", 1)
    _sysctl("/proc/sys/net/ipv4/conf/all/arp_announce", 2)
    macs = _by_mac()
    nics = fabric["hosts"][host]["nics"]
    for nic in nics:
        current = macs.get(nic["mac"].lower())
        if current is None:
            raise RuntimeError(f"no interface with MAC {nic['mac']} (have {sorted(macs)})")
        if current != nic["ifname"]:
            _sh("ip", "link", "set", current, "name", nic["ifname"])
        # no IPv6: no link-local chatter, and the rxe GID table holds only the IPv4 GIDs
        _sysctl(f"/proc/sys/net/ipv6/conf/{nic['ifname']}/disable_ipv6", 1)
        _sh("ip", "link", "set", nic["ifname"], "mtu", str(nic["mtu"]))
        _sh("ip", "addr", "add", f"{nic['addr']}/24", "dev", nic["ifname"])
        _sh("ip", "link", "set", nic["ifname"], "up")
    _sh("ip", "link", "set", "lo", "up")
    _sh("modprobe", "rdma_rxe")
    devices = []
    for nic in nics:
        if nic.get("rxe"):
            _sh("rdma", "link", "add", nic["rxe"], "type", "rxe", "netdev", nic["ifname"])
            devices.append(nic["rxe"])
    return devices


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def describe_devices(devices, timeout=30.0):
    """Per device: port state and its GID table (non-zero entries), once every port is ACTIVE."""
    deadline = time.monotonic() + timeout
    info = {}
    for dev in devices:
        port = f"/sys/class/infiniband/{dev}/ports/1"
        while "ACTIVE" not in _read(f"{port}/state") and time.monotonic() < deadline:
            time.sleep(0.2)
        gids = []
        for index in range(16):
            gid = _read(f"{port}/gids/{index}")
            if gid and gid.strip("0:"):
                gids.append({"index": index, "gid": gid,
                             "type": _read(f"{port}/gid_attrs/types/{index}")})
        info[dev] = {"state": _read(f"{port}/state"), "gids": gids}
    return info


def roce_v2_ipv4_index(info):
    """The GID index that is RoCE v2 over the IPv4 address, if the same on every device."""
    indices = set()
    for dev in info.values():
        for g in dev["gids"]:
            if g["type"] == "RoCE v2" and g["gid"].startswith("0000:0000:0000:0000:0000:ffff:"):
                indices.add(g["index"])
                break
    return indices.pop() if len(indices) == 1 else None


class Agent:
    def __init__(self, state_dir, host):
        self.state_dir, self.host = state_dir, host
        self.cmd_dir = os.path.join(state_dir, "cmd", f"h{host}")
        self.procs = {}
        self.lock = threading.Lock()

    def _start(self, rid):
        base = os.path.join(self.cmd_dir, rid)
        try:
            with open(base + ".json") as f:
                req = json.load(f)
            out = open(req.get("output") or base + ".out", "ab", buffering=0)
            proc = subprocess.Popen(req["argv"], env=req.get("env") or None,
                                    cwd=req.get("cwd") or "/", stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            out.close()
        except Exception as exc:  # tell the host, never die
            _write_atomic(base + ".err", f"{type(exc).__name__}: {exc}\n")
            _write_atomic(base + ".rc", "127")
            return
        with self.lock:
            self.procs[rid] = proc
        threading.Thread(target=self._reap, args=(rid, proc), daemon=True).start()

    def _reap(self, rid, proc):
        rc = proc.wait()
        with self.lock:
            self.procs.pop(rid, None)
        _write_atomic(os.path.join(self.cmd_dir, rid + ".rc"), str(rc if rc >= 0 else 128 - rc))

    def _kill(self, rid):
        with self.lock:
            proc = self.procs.get(rid)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def serve(self):
        os.makedirs(self.cmd_dir, exist_ok=True)
        seen, killed = set(), set()
        stop = os.path.join(self.state_dir, "stop")
        while not os.path.exists(stop):
            for name in sorted(os.listdir(self.cmd_dir)):
                rid, ext = os.path.splitext(name)
                if ext == ".json" and rid not in seen:
                    seen.add(rid)
                    self._start(rid)
                elif ext == ".kill" and rid not in killed:
                    killed.add(rid)
                    self._kill(rid)
            time.sleep(POLL_S)
        with self.lock:
            rids = list(self.procs)
        for rid in rids:
            self._kill(rid)


def main(argv):
    state_dir, host = argv[1], int(argv[2])
    with open(os.path.join(state_dir, "fabric.json")) as f:
        fabric = json.load(f)
    prefix = os.path.join(state_dir, f"h{host}")
    try:
        devices = setup_network(fabric, host)
        info = describe_devices(devices)
        _write_atomic(prefix + ".ready",
                      json.dumps({"host": host, "devices": info,
                                  "gid_index": roce_v2_ipv4_index(info)}, indent=1))
    except Exception as exc:
        _write_atomic(prefix + ".failed", f"{type(exc).__name__}: {exc}\n")
        print(f"r2comm rdma guest {host}: set-up failed: {exc}", file=sys.stderr)
        return 1
    Agent(state_dir, host).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
