"""The torch backend's lean-call helper: _lean.cpp, a small C++ extension built against the
torch that is installed (torch.utils.cpp_extension, once per torch version, in a cache folder),
that reads a synchronous all_reduce's tensor and options in one call (see _lean.cpp).

R2COMM_TORCH_LEAN: unset or "auto" loads it, building it on first use (about 20 s on two
cores; the ranks of a job wait for one build) and falling back, with one warning, to the
backend's Python path where it cannot be built (no C++ compiler, no torch headers); "1" makes
a failed build an error; "0" never uses it. R2COMM_CACHE_DIR: the cache folder (default
$XDG_CACHE_HOME/r2comm, else ~/.cache/r2comm). R2COMM_SANITIZE (scripts/asan.sh) builds a
sanitized one, in a folder of its own.

    python -m r2comm.torch build-lean     # build it now (scripts/env.sh does)
"""
import hashlib
import importlib.util
import os
import sys
import sysconfig
import warnings

import torch

from ..errors import R2commBuildError

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lean.cpp")
_NAME = "r2comm_torch_lean"
_loaded = {}          # "module": the helper, or None once it could not be had


def cache_dir():
    """The folder of this torch's and this source's build."""
    root = os.environ.get("R2COMM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "r2comm")
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(f"{torch.__version__}|{torch.compiled_with_cxx11_abi()}|"
                  f"{sys.version}|{sysconfig.get_platform()}|{_flags()}".encode())
    return os.path.join(root, "torch-lean", digest.hexdigest()[:16])


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
    """Build the helper into cache_dir() (or find it there) and import it; raises
    R2commBuildError, saying why, where it cannot be built."""
    folder = cache_dir()
    path = _library(folder)
    # torch's build holds the folder's "lock" file: another process (a rank of this job) may
    # be building it now, and then cpp_extension.load waits for that build
    if path is not None and not os.path.exists(os.path.join(folder, "lock")):
        try:
            return _import(path)
        except ImportError:
            pass                 # a build of this folder that did not finish: built again
    from torch.utils import cpp_extension
    os.makedirs(folder, exist_ok=True)
    # ninja from the virtualenv of this Python, where PATH does not name it
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    try:
        cflags, ldflags = _flags()
        return cpp_extension.load(_NAME, [_SOURCE], build_directory=folder,
                                  extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
    except Exception as exc:
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

