"""python -m r2comm.torch build-lean: build the backend's lean-call helper now (lean.py)."""
import sys

from . import lean

if sys.argv[1:] != ["build-lean"]:
    sys.exit("usage: python -m r2comm.torch build-lean")
lean.build()
print(f"r2comm.torch: lean-call helper ready in {lean.cache_dir()}")
