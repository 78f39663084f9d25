"""python -m r2comm.torch build-lean: build the backend's lean-call helper now (lean.py)."""
import os
import sys

from . import lean

if sys.argv[1:] != ["build-lean"]:
    sys.exit("usage: python -m r2comm.torch build-lean")
print(f"r2comm.torch: lean-call helper ready in {os.path.dirname(lean.build().__file__)}")
