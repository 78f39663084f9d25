"""The torch backend's lean-call helper: _lean.cpp, a small C++ extension built against the
torch that is installed (torch.utils.cpp_extension, once per torch version, in a cache folder),
that reads a synchronous all_reduce's tensor and options in one call (see _lean.cpp).

R2COMM_TORCH_LEAN: unset or "auto" loads it, building it on first use (about 20 s on two
cores; the ranks of a job wait for one build) and falling back, with one warning, to the
backend's Python path where it cannot be built (no C++ compiler, no torch headers); "1" makes
a failed build an error; "0" never uses it. R2COMM_CACHE_DIR: the cache folder (default
$XDG_CACHE_HOME/r2comm, else ~/.cache/r2comm). R2COMM_SANITIZE (scripts/asan.sh) builds a
sanitized one, in a folder of its own.

The cache is this user's only (cache.py): its folders are made 0700 and refused, with the
helper, when another user owns one or may write to it (or to a folder above it); a build goes
into a staging folder renamed into place, with its library's sha256 recorded, and a library
whose sha256 is not the recorded one is never loaded; the ranks of a job wait for one build
through a lock that ends with the process holding it (at most BUILD_WAIT s).

    python -m r2comm.torch build-lean     # build it now (scripts/env.sh does)
"""
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import warnings

import torch

from ..errors import R2commBuildError
from . import cache

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lean.cpp")
_NAME = "r2comm_torch_lean"
_loaded = {}          # "module": the helper, or None once it could not be had
_LAYOUT = "2"         # the cache's layout (cache.py: staged, recorded), part of a folder's name
BUILD_WAIT = 900.0    # s: longest a process waits for another's build of the helper


def cache_root():
    """R2COMM_CACHE_DIR, else $XDG_CACHE_HOME/r2comm, else ~/.cache/r2comm."""
    return os.environ.get("R2COMM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "r2comm")


def _key():
    """The name of this torch's, this source's and these flags' build folder."""
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(f"{_LAYOUT}|{torch.__version__}|{torch.compiled_with_cxx11_abi()}|"
                  f"{sys.version}|{sysconfig.get_platform()}|{_flags()}".encode())
    return digest.hexdigest()[:16]


def cache_dir():
    """The folder of this torch's and this source's build."""
    return os.path.join(cache_root(), "torch-lean", _key())


def _flags():
    """(compile flags, link flags): R2COMM_SANITIZE (scripts/asan.sh) builds it sanitized too."""
    sanitize = os.environ.get("R2COMM_SANITIZE", "").strip()
    if sanitize:
        return ([f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-O1", "-g",
                 "-fno-sanitize-recover=all"], [f"-fsanitize={sanitize}"])
    return ["-O2"], []


def _library(folder):
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for name in (_NAME + suffix, _NAME + ".so"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def _import(path):
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build():
    """Build the helper into cache_dir() (or find it there, checked) and import it; raises
    R2commBuildError, saying why, where it cannot be built or the cache is not this user's
    only (cache.UnsafeCache)."""
    try:
        parent = cache.private_folder(os.path.join(cache.private_root(cache_root()),
                                                   "torch-lean"))
        folder = os.path.join(parent, _key())
        lib = cache.published(folder)
        if lib is None:
            with cache.lock(folder + ".lock", BUILD_WAIT):
                lib = cache.published(folder)        # another process's build, just finished
                if lib is None:
                    return _build_into(folder)
    except OSError as exc:
        raise R2commBuildError(f"r2comm.torch: the lean-call helper's cache "
                               f"{cache_root()} cannot be used ({exc})") from exc
    try:
        return _import(lib)
    except ImportError as exc:
        raise R2commBuildError(f"r2comm.torch: the lean-call helper {lib} does not import "
                               f"({exc}); remove {folder}") from exc


def _build_into(folder):
    """Build the helper in a staging folder and publish it as `folder` (its lock held)."""
    from torch.utils import cpp_extension
    cache.clear_staging(folder)
    stage = cache.staging(folder)
    # ninja from the virtualenv of this Python, where PATH does not name it
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    try:
        cflags, ldflags = _flags()
        module = cpp_extension.load(_NAME, [_SOURCE], build_directory=stage,
                                    extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
        lib = _library(stage)
        if lib is None:
            raise R2commBuildError(f"no {_NAME} library in {stage} after the build")
        cache.publish(stage, folder, lib)
        return module
    except Exception as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise R2commBuildError(
            f"r2comm.torch: the lean-call helper did not build in {folder} ({exc}); "
            "R2COMM_TORCH_LEAN=0 leaves it out (small all_reduce calls then cost about 1.8 "
            "µs more)") from exc


def disable():
    """No helper for the rest of this process (the backend found it does not fit)."""
    _loaded["module"] = None


def helper():
    """The helper's module, initialised, or None where R2COMM_TORCH_LEAN=0 or (auto) it could
    not be built. Built at most once per process."""
    if "module" in _loaded:
        return _loaded["module"]
    want = os.environ.get("R2COMM_TORCH_LEAN", "auto").strip().lower() or "auto"
    if want not in ("0", "1", "auto"):
        raise R2commBuildError(f"R2COMM_TORCH_LEAN={want!r}: 0, 1 or auto")
    module = None
    if want != "0":
        try:
            module = build()
            module.init(torch.distributed.AllreduceOptions)
        except R2commBuildError as exc:
            if want == "1":
                raise
            warnings.warn(f"{exc}; using the Python path", RuntimeWarning, stacklevel=2)
            module = None
    _loaded["module"] = module
    return module

