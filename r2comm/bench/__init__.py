"""OSU-style benchmark harness for r2comm: ``python -m r2comm.bench``.

Runs size sweeps of r2comm's collectives and point-to-point calls, optionally
interleaved with the same calls on mpi4py and on torch.distributed/Gloo so
that ratios are measured under the same (noisy) conditions, and a failover
test that fails a rail in the middle of a stream of allreduces.

Modules:
    sizes     size parsing and sweeps (``-m 8:64M``)
    data      deterministic integer-valued inputs and their exact references
    peers     one adapter per library (r2comm, mpi, gloo) with the same calls
    osu       timing loops, rank reduction, medians over rounds
    report    OSU tables, nccl-tests algbw/busbw, JSON
    failover  allreduce stream with a rail fault, pause/throughput analysis
    plot      busbw-vs-size plot and failover timeline (matplotlib, Agg)
    cli       argument parsing and the subcommands
"""
