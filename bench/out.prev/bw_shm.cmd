.venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench bw -m 1K:4M --peer mpi --rounds 2 --budget 0.2 --json bench/out/bw_shm.json --plot bench/out/bw.png
