"""mpi4py's own test files, vendored unmodified (see README.md here): they run under
tests/mpi4py_suite.py (mpiexec, the adapter), never collected by pytest directly."""
collect_ignore_glob = ["*.py"]
