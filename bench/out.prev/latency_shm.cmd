.venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench latency -m 1:1M --peer mpi,gloo --rounds 3 --budget 0.2 -f --json bench/out/latency_shm.json
