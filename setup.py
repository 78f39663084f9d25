"""Build r2comm's Cython engine (C++ mode, -O3)."""
import os
from setuptools import setup, Extension
from Cython.Build import cythonize

flags = ["-O3", "-std=c++17", "-fno-strict-aliasing"]
if os.environ.get("R2COMM_NATIVE", "0") == "1":
    flags.append("-march=native")

def ext(name):
    return Extension(f"r2comm._core.{name}", [f"r2comm/_core/{name}.pyx"],
                     language="c++", extra_compile_args=flags,
                     include_dirs=["r2comm/_core"], libraries=["pthread"])

setup(
    ext_modules=cythonize([ext("engine")],
                          compiler_directives={"language_level": 3, "boundscheck": False,
                                               "wraparound": False, "cdivision": True},
                          annotate=False),
)
