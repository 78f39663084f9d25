"""Build r2comm's Cython engine (C++ mode, -O3)."""
import os
from setuptools import setup, Extension
from setuptools.command.build_ext import build_ext
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

def ext(name, libraries=()):
    # engine.pyx includes its parts (r2comm/_core/*.pxi) as text: cythonize finds them next to
    # it and regenerates the C++ when one changes; include_dirs is for the C headers (r2_*.h)
    return Extension(f"r2comm._core.{name}", [f"r2comm/_core/{name}.pyx"],
                     language="c++", extra_compile_args=flags, extra_link_args=link,
                     include_dirs=["r2comm/_core"], libraries=["pthread", *libraries])


def have_verbs():
    """libibverbs' header and development library (apt: libibverbs-dev): the verbs module is
    built only where both exist; r2comm works without it (TCP rails).  R2COMM_VERBS=0 skips
    it, R2COMM_VERBS=1 makes its absence an error."""
    import glob
    want = os.environ.get("R2COMM_VERBS", "auto")
    if want == "0":
        return False
    dirs = ["/usr/lib", "/usr/lib64", "/usr/local/lib", *glob.glob("/usr/lib/*-linux-gnu")]
    found = (any(os.path.exists(f"{d}/include/infiniband/verbs.h") for d in ("/usr", "/usr/local"))
             and any(glob.glob(f"{d}/libibverbs.so") for d in dirs))
    if want == "1" and not found:
        raise SystemExit("R2COMM_VERBS=1 but infiniband/verbs.h or libibverbs.so is missing "
                         "(apt install libibverbs-dev)")
    return found


def want_test_hooks():
    """The test extension (r2comm._core.testing: fuzz and fake transports, wire and crypto
    helpers, ShmEnd, hooks into a live engine): R2COMM_TEST_HOOKS=1 builds it, 0 leaves it out;
    unset, only a development build gets it (`build_ext --inplace`, `pip install -e`), so a
    wheel (`pip install .`) holds the production engine alone. The engine is the same either
    way: the hooks are a separate module that cimports it (engine.pxd)."""
    want = os.environ.get("R2COMM_TEST_HOOKS", "").strip()
    if want in ("0", "1"):
        return want == "1"
    if want:
        raise SystemExit(f"R2COMM_TEST_HOOKS={want!r}: 0 or 1")
    return None          # decided by the kind of build (DevBuildExt)


JOBS = min(4, os.cpu_count() or 1)     # extensions compiled side by side, Cython's threads


class DevBuildExt(build_ext):
    """build_ext that leaves the test extension out of a non-development build (see
    want_test_hooks)."""
    def finalize_options(self):
        super().finalize_options()
        want = want_test_hooks()
        if want is None:
            want = bool(self.inplace or getattr(self, "editable_mode", False))
        if not want:
            self.extensions = [x for x in self.extensions if x.name != "r2comm._core.testing"]
        if not self.parallel:              # the extensions compile side by side (-j)
            self.parallel = JOBS


extensions = [ext("engine"), ext("shm_segments"), ext("testing")]
if have_verbs():
    extensions.append(ext("verbs", libraries=["ibverbs"]))

setup(
    cmdclass={"build_ext": DevBuildExt},
    ext_modules=cythonize(extensions,
                          compiler_directives={"language_level": 3, "boundscheck": False,
                                               "wraparound": False, "cdivision": True},
                          annotate=False, nthreads=JOBS),
)
