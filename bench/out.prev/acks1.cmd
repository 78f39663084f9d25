R2COMM_SHM=0 R2COMM_RAILS=127.0.0.1 .venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench allreduce -m 16M:16M --peer r2comm-noack --rounds 15 --budget 0.3 -f --json bench/out/acks1.json
