.venv/bin/python bench/testbed_degraded.py --hosts 3 --rate 500mbit --mib 64 --out bench/out
