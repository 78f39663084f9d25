"""Which transport a job gets from R2COMM_TRANSPORT (run under mpiexec by test_verbs_rails.py):
prints `CHOICE rank transports a,b` or `CHOICE rank ErrorClass message`."""
import r2comm

try:
    comm = r2comm.Communicator()
except r2comm.R2commError as exc:
    from mpi4py import MPI
    print(f"CHOICE {MPI.COMM_WORLD.rank} {type(exc).__name__} {exc}", flush=True)
else:
    print(f"CHOICE {comm.rank} transports {','.join(r.transport for r in comm.rails)} "
          f"engine {sorted(set(t for row in comm.channel.engine.links.transports().values() for t in row))}",
          flush=True)
    comm.Free()
