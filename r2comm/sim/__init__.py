"""r2comm.sim: a flow-level failure simulator driven by r2comm's own planner.

One planner, two executors: the schedules replayed here are the planner's (r2comm/planner),
message by message, with the engine's chunking, striping and failover policy (cluster.py) on a
flow-level model of a rail-optimised fabric (fabric.py, flows.py). `python -m r2comm.sim` is the
command line (predict, validate, workloads, scale)."""
from .fabric import Fabric, FabricState
from .flows import FlowSim, maxmin_rates
from .cluster import Cluster, SimStall, RailView
from .predict import predict, parse_rate, parse_size

__all__ = ["Fabric", "FabricState", "FlowSim", "maxmin_rates", "Cluster", "SimStall",
           "RailView", "predict", "parse_rate", "parse_size"]
