R2COMM_SHM=0 .venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench allreduce -m 16M:16M --peer r2comm-noack --r2comm-last --rounds 15 --budget 0.3 -f --json bench/out/acks_rev.json
