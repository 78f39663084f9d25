.venv/bin/python bench/testbed_hier.py --rate 1gbit --size 64M --rounds 5 --out bench/out
