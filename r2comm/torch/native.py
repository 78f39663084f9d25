"""The torch backend's native part: _backend.cpp, a c10d::Backend (r2comm's collectives as
torch's dispatcher sees Gloo's), built against the torch that is installed
(torch.utils.cpp_extension, once per torch version and source, into a cache folder) and loaded
into the process.

When: `python -m r2comm.torch build` builds it (scripts/env.sh does, at install), or the first
process group of the backend does (about a minute on two cores; the ranks of a job wait for one
build). Without a C++ compiler or ninja it raises R2commBuildError naming what to install.
R2COMM_CACHE_DIR: the cache folder (default $XDG_CACHE_HOME/r2comm, else ~/.cache/r2comm).
R2COMM_SANITIZE (scripts/asan.sh) builds a sanitized one, in a folder of its own.

The cache is this user's only (cache.py): its folders are made 0700 and refused, with the
build, when another user owns one or may write to it (or to a folder above it); a build goes
into a staging folder renamed into place, with its library's sha256 recorded, and a library
whose sha256 is not the recorded one is never loaded; the ranks of a job wait for one build
through a lock that ends with the process holding it (at most BUILD_WAIT s).
"""
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig

import torch

from ..errors import R2commBuildError
from . import cache

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "_backend.cpp")
_CORE = os.path.join(os.path.dirname(_HERE), "_core")      # r2_capi.h
_HEADERS = (os.path.join(_CORE, "r2_capi.h"),)
_NAME = "r2comm_torch_backend"
_loaded = {}          # "module": the extension, once loaded
_LAYOUT = "3"         # the cache's layout (cache.py: staged, recorded), part of a folder's name
_FOLDER = "torch-backend"
BUILD_WAIT = 900.0    # s: longest a process waits for another's build


def cache_root():
    """R2COMM_CACHE_DIR, else $XDG_CACHE_HOME/r2comm, else ~/.cache/r2comm."""
    return os.environ.get("R2COMM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "r2comm")


def _key():
    """The name of this torch's, this source's and these flags' build folder."""
    digest = hashlib.sha256()
    for path in (_SOURCE,) + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(f"{_LAYOUT}|{torch.__version__}|{torch.compiled_with_cxx11_abi()}|"
                  f"{sys.version}|{sysconfig.get_platform()}|{_flags()}".encode())
    return digest.hexdigest()[:16]


def cache_dir():
    """The folder of this torch's and this source's build."""
    return os.path.join(cache_root(), _FOLDER, _key())


def _flags():
    """(compile flags, link flags): R2COMM_SANITIZE (scripts/asan.sh) builds it sanitized too."""
    sanitize = os.environ.get("R2COMM_SANITIZE", "").strip()
    if sanitize:
        return ([f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-O1", "-g",
                 "-fno-sanitize-recover=all"], [f"-fsanitize={sanitize}"])
    return ["-O2"], []


def missing_tools():
    """What a build needs and this machine lacks: [] or names with how to get them."""
    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a C++17 compiler ({cxx!r} not found: apt install g++, or set CXX)")
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bindir) is None:
        missing.append("ninja (pip install ninja)")
    return missing


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
    """Build the extension into cache_dir() (or find it there, checked) and import it;
    raises R2commBuildError, saying why, where it cannot be built or the cache is not this
    user's only (cache.UnsafeCache)."""
    try:
        parent = cache.private_folder(os.path.join(cache.private_root(cache_root()), _FOLDER))
        folder = os.path.join(parent, _key())
        lib = cache.published(folder)
        if lib is None:
            with cache.lock(folder + ".lock", BUILD_WAIT):
                lib = cache.published(folder)        # another process's build, just finished
                if lib is None:
                    return _build_into(folder)
    except OSError as exc:
        raise R2commBuildError(f"r2comm.torch: the backend's build cache "
                               f"{cache_root()} cannot be used ({exc})") from exc
    try:
        return _import(lib)
    except ImportError as exc:
        raise R2commBuildError(f"r2comm.torch: the backend's library {lib} does not import "
                               f"({exc}); remove {folder}") from exc


def _build_into(folder):
    """Build the extension in a staging folder and publish it as `folder` (its lock held)."""
    from torch.utils import cpp_extension
    missing = missing_tools()
    if missing:
        raise R2commBuildError(
            f"r2comm.torch: building the backend against torch {torch.__version__} needs "
            + " and ".join(missing))
    cache.clear_staging(folder)
    stage = cache.staging(folder)
    # ninja from the virtualenv of this Python, where PATH does not name it
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    try:
        cflags, ldflags = _flags()
        module = cpp_extension.load(_NAME, [_SOURCE], build_directory=stage,
                                    extra_cflags=cflags, extra_ldflags=ldflags,
                                    extra_include_paths=[_CORE], verbose=False)
        lib = _library(stage)
        if lib is None:
            raise R2commBuildError(f"no {_NAME} library in {stage} after the build")
        cache.publish(stage, folder, lib)
        return module
    except R2commBuildError:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise R2commBuildError(
            f"r2comm.torch: the backend did not build in {folder} against torch "
            f"{torch.__version__} ({exc})") from exc


def loaded():
    """The extension if it was loaded in this process, else None (never builds)."""
    return _loaded.get("module")


def module():
    """The extension's module, built or loaded at most once per process (R2commBuildError
    where it cannot be had)."""
    mod = _loaded.get("module")
    if mod is None:
        mod = _loaded["module"] = build()
    return mod

