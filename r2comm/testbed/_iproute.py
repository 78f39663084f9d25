"""Thin, bounded wrappers around iproute2 (`ip`, `tc`).

Why a wrapper: every kernel change the testbed makes goes through one
function that has a timeout and turns a failure into a `TestbedError` that
names the command and the kernel's complaint, instead of a bare
CalledProcessError deep inside a test.
"""
import json
import os
import shutil
import subprocess

#: Where iproute2 lives on Debian-like systems, even when it is not on PATH.
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
#: No single `ip`/`tc` call may hang the caller for longer than this.
COMMAND_TIMEOUT_S = 20
NETNS_DIR = "/var/run/netns"


class TestbedError(RuntimeError):
    """Raised for anything the testbed cannot do, with a message saying why."""

    __test__ = False  # not a pytest test class, despite the name


def tool(name):
    """Absolute path of an iproute2 tool, or a TestbedError saying how to get it."""
    path = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))
    if path is None:
        raise TestbedError(f"'{name}' not found: the testbed needs iproute2 "
                           "(apt-get install iproute2)")
    return path


def preflight():
    """Fail early, with a clear message, when namespaces cannot be built here."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) "
                           "to create network namespaces; run it with sudo")
    tool("ip")
    tool("tc")


def run(argv, timeout=COMMAND_TIMEOUT_S):
    """Run one command; return its stdout, or raise TestbedError with its stderr."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"timed out after {timeout}s: {' '.join(argv)}") from exc
    if proc.returncode != 0:
        raise TestbedError(f"command failed ({proc.returncode}): {' '.join(argv)}: "
                           f"{proc.stderr.strip()}")
    return proc.stdout


def ip(ns, *args):
    """`ip -n NS ARGS...` (NS None: the caller's own namespace)."""
    prefix = [tool("ip")] + (["-n", ns] if ns else [])
    return run(prefix + list(args))


def tc(ns, *args):
    """`tc -n NS ARGS...`."""
    return run([tool("tc"), "-n", ns, *args])


def links(ns):
    """{ifname: link record} of a namespace, from `ip -j link show`."""
    return {rec["ifname"]: rec for rec in json.loads(ip(ns, "-j", "link", "show") or "[]")}


def netns_names():
    """Names of all named network namespaces (those under /var/run/netns)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_add(name):
    ip(None, "netns", "add", name)


def netns_del(name):
    ip(None, "netns", "del", name)


def write_sysctls(ns, values):
    """Write /proc/sys/net/... keys inside namespace NS; keys the kernel lacks are skipped.

    /proc/sys/net shows the namespace of the process that opens it, hence the
    short shell run under `ip netns exec` rather than a write from here.
    """
    script = "".join(f"[ -w {path} ] && echo {value} > {path}; "
                     for path, value in values.items())
    run([tool("ip"), "netns", "exec", ns, "sh", "-c", script + "true"])
