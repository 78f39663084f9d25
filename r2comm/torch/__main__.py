"""python -m r2comm.torch build: build the backend's native part now (native.py)."""
import sys

from . import native

if sys.argv[1:] != ["build"]:
    sys.exit("usage: python -m r2comm.torch build")
native.build()
print(f"r2comm.torch: the backend is built in {native.cache_dir()}")
