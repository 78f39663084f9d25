"""r2comm.testbed: an emulated multi-NIC, rail-optimised cluster on one Linux machine.

Hosts are network namespaces, NICs are veth pairs into per-rail bridges, rates
are tbf qdiscs and faults are real link changes; see `fabric` for the layout
and ``python -m r2comm.testbed --help`` for the CLI.  Needs root and iproute2.
`RdmaFabric` (module `rdma`) is the same cluster with real soft-RoCE rails: one
QEMU guest per host (needs the packages scripts/rdma-deps.sh installs).
"""
from ._iproute import TestbedError
from .fabric import Fabric, fabric_tags, kill_job, remove_all, remove_fabric
from .rates import format_rate, parse_rate
from .rdma import RdmaFabric

__all__ = ["Fabric", "RdmaFabric", "TestbedError", "fabric_tags", "kill_job", "remove_all",
           "remove_fabric", "format_rate", "parse_rate"]
