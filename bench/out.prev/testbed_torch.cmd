.venv/bin/python bench/testbed_torch.py --part main --out bench/out
