.venv/bin/python bench/testbed_torch.py --part cycles --cycle-serve cycles=256 --out bench/out
