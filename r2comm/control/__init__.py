"""The control plane: how ranks find each other (bootstrap, bootstrap_store), start-up,
connections on first use and fail-back (links), the failure detector (liveness), r2comm's own
control tree (tree), communicator ids, NIC facts and the switch rounds that follow them,
the start-up bandwidth measurement, fd budgets. It asks transports (r2comm.transport) for
everything kind-specific through their one object per kind."""
