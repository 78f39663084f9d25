.venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench allgather -m 8:16M --peer mpi --rounds 2 --budget 0.1 --check --json bench/out/allgather.json --plot bench/out/allgather.png
