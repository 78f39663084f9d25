.venv/bin/python -m r2comm.sim validate --json bench/out/sim_validate.json
