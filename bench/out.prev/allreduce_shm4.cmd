.venv/bin/mpiexec -n 4 .venv/bin/python -m r2comm.bench allreduce -m 8:64M --peer mpi --rounds 5 --budget 0.2 -f --json bench/out/allreduce_shm4.json
