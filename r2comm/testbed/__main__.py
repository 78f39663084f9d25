"""Command line: ``python -m r2comm.testbed {up,down,status,degrade,nic-down,nic-up,flap,
blackhole,unblackhole,exec,torchrun,rdma-up,rdma-down,rdma-run}``.

Each command is a short-lived process working on the fabric named by
--tag/--fabric (default: $R2COMM_TESTBED_FABRIC, else the only fabric up),
which is what lets one shell inject faults while a job runs in another.
`status`, `degrade`, `nic-down` and `nic-up` also work on an RDMA fabric
(`rdma`: one QEMU guest per host with soft-RoCE rails).
"""
import argparse
import json
import os
import signal
import sys

from ._iproute import TestbedError
from .fabric import (DEFAULT_TAG, RAIL_MTU, SIDES, Fabric, fabric_tags, remove_all, remove_fabric,
                     resolve_tag)
from .place import exec_in_fabric
from .rates import format_rate
from . import rdma


def _add_tag(parser, default=None):
    parser.add_argument("--tag", "--fabric", dest="tag", default=default,
                        help="which fabric (default: $R2COMM_TESTBED_FABRIC, else the only one up)")


def _add_nic(parser):
    parser.add_argument("host", type=int, help="host index (0-based)")
    parser.add_argument("nic", type=int, help="rail NIC index (0-based)")
    _add_tag(parser)


def _parser():
    top = argparse.ArgumentParser(prog="python -m r2comm.testbed",
                                  description="Emulated rail-optimised multi-NIC cluster "
                                              "(network namespaces; needs root and iproute2).")
    sub = top.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="build a fabric")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--nics", type=int, default=2, help="rail NICs per host")
    up.add_argument("--rate", default="unlimited",
                    help="per-NIC rate, e.g. 1gbit (default unlimited)")
    up.add_argument("--mtu", type=int, default=RAIL_MTU,
                    help=f"rail NIC MTU (default {RAIL_MTU}, jumbo frames)")
    _add_tag(up, default=DEFAULT_TAG)

    down = sub.add_parser("down", help="remove a fabric (or all, also after a crash)")
    _add_tag(down)
    down.add_argument("--all", action="store_true", help="every r2tb-* namespace and state file")

    status = sub.add_parser("status", help="hosts, NICs, link states, rates")
    _add_tag(status)
    status.add_argument("--json", action="store_true")

    degrade = sub.add_parser("degrade", help="change a NIC's rate (both directions)")
    _add_nic(degrade)
    degrade.add_argument("rate", help="e.g. 200mbit, or unlimited")

    nic_down = sub.add_parser("nic-down", help="take a rail link down",
                              description="On an RDMA fabric: QEMU set_link off (the guest loses "
                                          "carrier; --side does not apply).")
    _add_nic(nic_down)
    nic_down.add_argument("--side", choices=SIDES, default="host",
                          help="host: NIC set down; switch: port down (host sees no carrier)")

    _add_nic(sub.add_parser("nic-up", help="bring a rail link back up"))

    flap = sub.add_parser("flap", help="down/up a rail link COUNT times (blocks)")
    _add_nic(flap)
    flap.add_argument("--period", type=float, default=1.0, help="seconds per down+up cycle")
    flap.add_argument("--count", type=int, default=3)
    flap.add_argument("--side", choices=SIDES, default="host")

    _add_nic(sub.add_parser("blackhole", help="drop all packets silently, link stays up"))
    _add_nic(sub.add_parser("unblackhole", help="stop dropping"))

    exe = sub.add_parser("exec", help="run a command (an MPI rank) inside its host",
                         description="Under mpiexec, each rank joins host rank*H//size; "
                                     "sets R2COMM_RAILS, R2COMM_CTRL_ADDR, R2COMM_TESTBED_HOST.")
    _add_tag(exe)
    exe.add_argument("--host", type=int, help="place on this host instead of by rank")
    exe.add_argument("argv", nargs=argparse.REMAINDER, help="-- command ...")

    tr = sub.add_parser("torchrun", help="one torchrun per host (node rank = host)",
                        description="Runs `python -m torch.distributed.run` in every host "
                                    "namespace, rendezvous at host 0's management address.")
    _add_tag(tr)
    tr.add_argument("--nproc-per-node", type=int, default=1)
    tr.add_argument("--port", type=int, help="rendezvous port (default: derived from the pid)")
    tr.add_argument("--timeout", type=float, help="end the job after this many seconds")
    tr.add_argument("argv", nargs=argparse.REMAINDER, help="-- script.py args ...")

    def add_shape(parser, tag_default=None):
        parser.add_argument("--hosts", type=int, default=2, help="guests (default 2)")
        parser.add_argument("--nics", type=int, default=2, help="rail NICs per guest (default 2)")
        parser.add_argument("--memory", type=int, default=rdma.DEFAULT_MEMORY_MB,
                            help=f"guest memory, MiB (default {rdma.DEFAULT_MEMORY_MB})")
        parser.add_argument("--mtu", type=int, default=rdma.DEFAULT_MTU,
                            help=f"rail NIC MTU (default {rdma.DEFAULT_MTU})")
        parser.add_argument("--boot-timeout", type=float, default=rdma.BOOT_TIMEOUT_S)
        _add_tag(parser, default=tag_default)

    rup = sub.add_parser("rdma-up", help="boot an RDMA fabric (QEMU guests, soft-RoCE rails)",
                         description="Boots one TCG guest per host with virtme-ng; rail k is NIC "
                                     "nic<k> (198.18.k.(h+1)/24) with soft-RoCE device rxe<k>.")
    add_shape(rup, tag_default=rdma.DEFAULT_TAG)
    rdown = sub.add_parser("rdma-down", help="stop an RDMA fabric (or all, also after a crash)")
    _add_tag(rdown)
    rdown.add_argument("--all", action="store_true")
    rrun = sub.add_parser("rdma-run", help="boot an RDMA fabric, run N ranks on it, tear it down",
                          description="Rank r runs on guest r*H//N with R2COMM_RANK, R2COMM_SIZE, "
                                      "R2COMM_STORE_DIR, R2COMM_RAILS, R2COMM_CTRL_ADDR, "
                                      "R2COMM_TESTBED_HOST, R2COMM_TRANSPORT=verbs; output is "
                                      "relayed as '[rank] line'; exits with the ranks' status "
                                      "(124 on timeout, 130 on Ctrl-C).")
    add_shape(rrun)
    rrun.add_argument("-n", "--np", dest="nranks", type=int, required=True, help="ranks")
    rrun.add_argument("--timeout", type=float, default=600.0,
                      help="seconds the ranks may run (default 600; boot not counted)")
    rrun.add_argument("--keep", action="store_true",
                      help="run on the already booted fabric --fabric and leave it up")
    rrun.add_argument("argv", nargs=argparse.REMAINDER, help="-- command ...")
    return top


def _print_status(fab, rows):
    print(f"fabric {fab.tag}: {fab.hosts} hosts x {fab.nics} NICs, "
          f"default rate {format_rate(fab.rate)}, MTU {fab.mtu}")
    print(f"{'host':<5}{'netns':<24}{'nic':<6}{'address':<16}{'state':<18}{'rate':<11}"
          f"{'host-side':<12}switch-side")
    for row in rows:
        ns = fab.host_ns(row["host"]) if row["nic"] == 0 else ""
        print(f"{row['host']:<5}{ns:<24}{row['ifname']:<6}{row['addr']:<16}{row['state']:<18}"
              f"{row['rate']:<11}{row['host_link']:<12}{row['switch_link']}")
    for host in range(fab.hosts):
        print(f"host {host} mgmt {fab.mgmt_addr(host)} (unshaped, never failed)")


def _down(args):
    if args.all:
        removed = remove_all()
    else:
        removed = remove_fabric(resolve_tag(args.tag))
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))


def _rdma_target(tag):
    """The RDMA fabric TAG names (or the only fabric up, if it is an RDMA one), else None."""
    tag = tag or os.environ.get("R2COMM_TESTBED_FABRIC")
    if tag:
        return rdma.RdmaFabric.attach(tag) if tag in rdma.rdma_tags() else None
    if not fabric_tags() and rdma.rdma_tags():
        return rdma.RdmaFabric.attach()
    return None


def _print_rdma_status(fab, rows):
    print(f"RDMA fabric {fab.tag}: {fab.hosts} guests x {fab.nics} soft-RoCE rails "
          f"(state {fab.dir})")
    print(f"{'host':<5}{'nic':<6}{'device':<8}{'address':<14}{'state':<7}{'rate':<11}gids")
    for row in rows:
        print(f"{row['host']:<5}{row['ifname']:<6}{row['device']:<8}{row['addr']:<14}"
              f"{row['state']:<7}{row['rate']:<11}{' '.join(row['gids']) or '(booting)'}")


def _rdma_run(args):
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise TestbedError("rdma-run needs a command after --")
    if args.keep:
        fab = rdma.RdmaFabric.attach(args.tag)
    else:
        fab = rdma.RdmaFabric(hosts=args.hosts, nics=args.nics, memory_mb=args.memory,
                              mtu=args.mtu, tag=args.tag or f"run{os.getpid()}")

    def terminate(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, terminate)
    try:
        if not args.keep:
            fab.up(boot_timeout=args.boot_timeout)
        return rdma.run_job(fab, args.nranks, argv, timeout=args.timeout)
    except KeyboardInterrupt:
        print("r2comm.testbed: rdma-run interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            fab.down()
        signal.signal(signal.SIGTERM, old)


def _run(args):
    if args.command == "rdma-up":
        fab = rdma.RdmaFabric(hosts=args.hosts, nics=args.nics, memory_mb=args.memory,
                              mtu=args.mtu, tag=args.tag).up(boot_timeout=args.boot_timeout)
        _print_rdma_status(fab, fab.status())
        return 0
    if args.command == "rdma-down":
        if args.all:
            removed = rdma.remove_all_rdma()
        else:
            removed = [rdma.resolve_rdma_tag(args.tag)]
            rdma.remove_rdma_fabric(removed[0])
        print(f"removed {len(removed)} RDMA fabrics" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if args.command == "rdma-run":
        return _rdma_run(args)
    if args.command in ("status", "degrade", "nic-down", "nic-up"):
        rfab = _rdma_target(args.tag)
        if rfab is not None:
            if args.command == "status":
                rows = rfab.status()
                print(json.dumps(rows, indent=1)) if args.json else _print_rdma_status(rfab, rows)
            elif args.command == "degrade":
                rfab.degrade(args.host, args.nic, args.rate)
            elif args.command == "nic-down":
                rfab.nic_down(args.host, args.nic)
            else:
                rfab.nic_up(args.host, args.nic)
            return 0
    if args.command == "up":
        fab = Fabric(hosts=args.hosts, nics=args.nics, rate=args.rate, tag=args.tag,
                     mtu=args.mtu).up()
        _print_status(fab, fab.status())
        return
    if args.command == "down":
        _down(args)
        return
    fab = Fabric.attach(args.tag)
    if args.command == "status":
        if args.json:
            print(json.dumps(fab.status(), indent=1))
        else:
            _print_status(fab, fab.status())
    elif args.command == "degrade":
        fab.degrade(args.host, args.nic, args.rate)
    elif args.command == "nic-down":
        fab.nic_down(args.host, args.nic, side=args.side)
    elif args.command == "nic-up":
        fab.nic_up(args.host, args.nic)
    elif args.command == "flap":
        fab.flap(args.host, args.nic, period=args.period, count=args.count, side=args.side)
    elif args.command == "blackhole":
        fab.blackhole(args.host, args.nic)
    elif args.command == "unblackhole":
        fab.unblackhole(args.host, args.nic)
    elif args.command == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        exec_in_fabric(fab, argv, host=args.host)
    elif args.command == "torchrun":
        from .launch import torchrun
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return torchrun(fab, argv, args.nproc_per_node, args.port, args.timeout)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return _run(args) or 0
    except TestbedError as exc:
        print(f"r2comm.testbed: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
