"""A build cache that only this user can write: the torch backend's C++ part (native.py)
keeps its builds in one, and a shared object found there is loaded into the process, so
whoever can write to it can run code in every rank that loads it (issue 40, item 4).

- Every folder of the cache is made mode 0700 and used only when it is a real folder (no
  link) owned by this user (euid) that neither group nor others may write; every folder above
  the cache root must be owned by this user or root and writable by nobody else unless it is
  sticky (/tmp), or its owner could swap the cache for theirs. UnsafeCache otherwise.
- A build goes into a staging folder of its own (mkdtemp, 0700) next to its final place and is
  renamed into place once complete, with a record of its library's sha256 written first; a
  published folder is loaded only when the library's sha256 is the recorded one.
- Builds of one folder take a lock (flock on a file next to it) that the kernel releases when
  its holder ends, however it ends: a build killed half-way leaves nothing that blocks the next.
"""
import contextlib
import fcntl
import hashlib
import hmac
import os
import shutil
import stat
import tempfile
import time

from ..errors import R2commBuildError

RECORD = "sha256"            # in a published folder: "<sha256 hex> <library file name>\n"
_RECORD_MAX = 4096


class UnsafeCache(R2commBuildError):
    """A cache folder or file that someone else could have written, or that is not what this
    module published there: never loaded."""


def _check(st, path, folder):
    """st (an lstat) is a real folder (folder=True) or regular file owned by this user that
    neither group nor others may write."""
    kind = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    what = "folder" if folder else "file"
    if not kind:
        raise UnsafeCache(f"{path} is not a {what} (a link or something else): not used")
    if st.st_uid != os.geteuid():
        raise UnsafeCache(f"{path} is owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()}): not used")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{path} is writable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): not used")


def _check_above(real):
    """Every folder above `real` (a resolved path) is owned by this user or root and writable
    by nobody else unless sticky."""
    uid = os.geteuid()
    d = os.path.dirname(real)
    while True:
        st = os.lstat(d)
        if st.st_uid not in (uid, 0):
            raise UnsafeCache(f"{d} (above the cache {real}) is owned by uid {st.st_uid}, "
                              "neither this user nor root: not used")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeCache(f"{d} (above the cache {real}) is writable by group or others "
                              f"and not sticky (mode {stat.S_IMODE(st.st_mode):04o}): not used")
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent


def private_root(path):
    """The cache root `path`, its missing folders made 0700, checked with every folder above
    it -> its resolved path (what the caller uses from then on)."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    real = os.path.realpath(path)
    _check_above(real)
    _check(os.lstat(real), real, True)
    return real


def private_folder(path):
    """Folder `path` (its parent checked already), made 0700 if missing, checked."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _check(os.lstat(path), path, True)
    return path


def _open_checked(path, flags=os.O_RDONLY, mode=0o600):
    """An fd of regular file `path` (no link followed) that _check accepts."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        _check(os.fstat(fd), path, False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256(fd):
    digest = hashlib.sha256()
    while True:
        block = os.read(fd, 1 << 20)
        if not block:
            return digest.hexdigest()
        digest.update(block)


def published(folder):
    """The library of published folder `folder` once its checks pass (the folder and its
    files this user's only, the library's sha256 the recorded one); None where there is no
    such folder; UnsafeCache for anything else (it is never loaded, nor replaced: remove it)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    _check(st, folder, True)
    try:
        fd = _open_checked(os.path.join(folder, RECORD))
    except FileNotFoundError:
        raise UnsafeCache(f"{folder} has no record of its library ({RECORD}): not a build this "
                          "module published; remove it") from None
    try:
        text = os.read(fd, _RECORD_MAX + 1)
    finally:
        os.close(fd)
    parts = text.decode("ascii", "replace").split()
    if (len(text) > _RECORD_MAX or len(parts) != 2 or len(parts[0]) != 64
            or any(c not in "0123456789abcdef" for c in parts[0])
            or parts[1] in (".", "..") or "/" in parts[1]):
        raise UnsafeCache(f"{os.path.join(folder, RECORD)} is not a record of a library")
    want, name = parts
    lib = os.path.join(folder, name)
    try:
        fd = _open_checked(lib)
    except FileNotFoundError:
        raise UnsafeCache(f"{lib}, recorded in {folder}, is missing; remove the folder") from None
    try:
        got = _sha256(fd)
    finally:
        os.close(fd)
    if not hmac.compare_digest(got, want):
        raise UnsafeCache(f"{lib}'s sha256 is not the one recorded when it was built: not "
                          "loaded; remove the folder")
    return lib


def staging(folder):
    """A new, empty, private folder to build `folder` in (next to it: renamed into place)."""
    return tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.staging-",
                            dir=os.path.dirname(folder))


def clear_staging(folder):
    """Remove what builds of `folder` that ended half-way left (call with its lock held)."""
    parent, prefix = os.path.dirname(folder), f".{os.path.basename(folder)}.staging-"
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and os.lstat(path).st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)


def publish(stage, folder, lib):
    """Record library `lib` (in staging folder `stage`) and rename `stage` to `folder`."""
    fd = _open_checked(lib)
    try:
        digest = _sha256(fd)
    finally:
        os.close(fd)
    fd = os.open(os.path.join(stage, RECORD),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{digest} {os.path.basename(lib)}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(stage, folder)


@contextlib.contextmanager
def lock(path, timeout):
    """Hold the build lock `path` (flock: released by the kernel when this process ends, so a
    holder that was killed leaves no lock behind). Waits at most `timeout` s for a live holder,
    then raises R2commBuildError naming it."""
    fd = _open_checked(path, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                    raise R2commBuildError(
                        f"{path}: another process (pid {holder or '?'}) has been building "
                        f"for more than {timeout:g} s") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.25)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
