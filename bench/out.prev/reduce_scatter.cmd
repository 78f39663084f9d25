.venv/bin/mpiexec -n 2 .venv/bin/python -m r2comm.bench reduce_scatter -m 8:16M --peer mpi --rounds 2 --budget 0.1 --check --json bench/out/reduce_scatter.json --plot bench/out/reduce_scatter.png
