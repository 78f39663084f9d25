.venv/bin/python bench/testbed_verbs.py --out bench/out
