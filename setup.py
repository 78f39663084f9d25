"""Build r2comm's Cython engine (C++ mode, -O3)."""
import os
from setuptools import setup, Extension
from Cython.Build import cythonize

flags = ["-O3", "-std=c++17", "-fno-strict-aliasing"]
link = []
if os.environ.get("R2COMM_NATIVE", "0") == "1":
    flags.append("-march=native")
# R2COMM_SANITIZE=address,undefined builds the engine with AddressSanitizer/UBSan (checks, not
# speed). Python must then run with the sanitizer runtime preloaded: see scripts/asan.sh.
sanitize = os.environ.get("R2COMM_SANITIZE", "").strip()
if sanitize:
    flags = [f for f in flags if not f.startswith("-O")] + [
        f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-O1", "-g",
        "-fno-sanitize-recover=all"]
    link = [f"-fsanitize={sanitize}"]

def ext(name):
    return Extension(f"r2comm._core.{name}", [f"r2comm/_core/{name}.pyx"],
                     language="c++", extra_compile_args=flags, extra_link_args=link,
                     include_dirs=["r2comm/_core"], libraries=["pthread"])

setup(
    ext_modules=cythonize([ext("engine")],
                          compiler_directives={"language_level": 3, "boundscheck": False,
                                               "wraparound": False, "cdivision": True},
                          annotate=False),
)
