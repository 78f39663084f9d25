.venv/bin/python bench/testbed_failover.py --ranks 2,4 --job-timeout 60 --out bench/out
