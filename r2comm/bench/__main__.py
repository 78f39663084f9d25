"""Entry point: ``mpiexec -n 2 python -m r2comm.bench <subcommand> ...``."""
import sys

from .cli import main

sys.exit(main())
