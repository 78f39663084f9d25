"""The torch backend's build cache is this user's only (issue 40, item 4; r2comm/torch/cache.py,
native.py): a shared object planted in it, by another uid or in a folder another uid may write,
is never loaded (its constructor never runs), nor is a library whose sha256 is not the one
recorded at its build; a build killed half-way leaves nothing that blocks the next
(native.module() returns, bounded); new cache folders are 0700; R2COMM_CACHE_DIR places the
build; no compiler: an error naming what to install. Each scenario loads the backend in a
subprocess; a planted library's constructor creates the file named by R2COMM_TEST_MARKER.
Where the tests run as root, the other user is uid 65534 (setpriv)."""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

from r2comm.errors import R2commBuildError  # noqa: E402
from r2comm.torch import cache, native  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = 65534
AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT or not shutil.which("setpriv"),
                                reason="needs root (another uid: setpriv, chown)")
LIB = "r2comm_torch_backend.so"


@pytest.fixture(scope="module")
def genuine():
    """The folder of a real build of the backend (the default cache; built if missing)."""
    native.build()
    return native.cache_dir()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A shared object whose constructor creates $R2COMM_TEST_MARKER."""
    d = tmp_path_factory.mktemp("planted")
    src = d / "boom.c"
    src.write_text(textwrap.dedent("""
        #include <stdio.h>
        #include <stdlib.h>
        __attribute__((constructor)) static void boom(void) {
            const char* p = getenv("R2COMM_TEST_MARKER");
            FILE* f = p ? fopen(p, "w") : NULL;
            if (f) fclose(f);
        }
        """))
    out = d / LIB
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=120)
    return str(out)


@pytest.fixture
def scratch():
    """A folder under /tmp that other uids can traverse (pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="r2comm-backend-cache-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _folder(root, monkeypatch):
    """cache_dir() for cache root `root`."""
    monkeypatch.setenv("R2COMM_CACHE_DIR", root)
    folder = native.cache_dir()
    monkeypatch.delenv("R2COMM_CACHE_DIR")
    return folder


def _record(folder, lib):
    with open(lib, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(folder, cache.RECORD), "w") as f:
        f.write(f"{digest} {os.path.basename(lib)}\n")


def _plant(folder, planted):
    """The planted library in `folder`, with a record that matches it."""
    os.makedirs(folder, exist_ok=True)
    shutil.copy(planted, os.path.join(folder, LIB))
    _record(folder, os.path.join(folder, LIB))


HELPER = ("from r2comm.torch import native; m = native.module(); "
          "print('HELPER', hasattr(m, 'R2commBackend'), flush=True)")


def _helper(root, marker, timeout=120, wait=True):
    """native.module() in a subprocess with cache root `root`: (returncode, output)."""
    env = dict(os.environ, R2COMM_CACHE_DIR=root, R2COMM_TEST_MARKER=marker, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", HELPER], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return p
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"native.module() did not return in {timeout} s: {out[-2000:]}")
    return p.returncode, out


def _refused(root, marker, why):
    """Loading the backend raises UnsafeCache naming `why`; the planted constructor never
    ran."""
    rc, out = _helper(root, marker)
    assert rc != 0 and "UnsafeCache" in out and why in out, out[-3000:]
    assert not os.path.exists(marker), "the planted library was loaded"


@needs_root
def test_a_cache_that_others_may_write_is_refused(scratch, planted, monkeypatch):
    """A shared cache root (mode 0777): uid 65534 creates the build folder and plants a library
    with a matching record. Old code: imported it (the constructor ran in this root process)."""
    root = os.path.join(scratch, "shared")
    os.mkdir(root)
    os.chmod(root, 0o777)
    folder = _folder(root, monkeypatch)
    stage = os.path.join(scratch, "stage")
    os.mkdir(stage)
    _plant(stage, planted)
    os.chmod(stage, 0o755)
    for name in os.listdir(stage):
        os.chmod(os.path.join(stage, name), 0o755)
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "sh", "-c", f'mkdir -p "{folder}" && cp -p "{stage}"/* "{folder}"/'],
                   check=True, timeout=60)
    assert os.stat(os.path.join(folder, LIB)).st_uid == NOBODY
    _refused(root, os.path.join(scratch, "ran"), "writable by group or others")


@needs_root
@pytest.mark.parametrize("case", ["folder of another uid", "library of another uid",
                                  "group-writable folder", "folder above of another uid"])
def test_a_folder_or_file_not_this_users_only_is_refused(scratch, planted, monkeypatch, case):
    """A private cache root (0700, this user's) whose build folder, or the library in it, is
    another uid's or group-writable, or a cache under a folder another uid owns: refused.
    Old code: loaded the planted library."""
    above = os.path.join(scratch, "above")
    os.mkdir(above, 0o755)
    root = os.path.join(above, "cache")
    os.mkdir(root, 0o700)
    folder = _folder(root, monkeypatch)
    os.makedirs(os.path.dirname(folder), 0o700)
    os.mkdir(folder, 0o700)
    _plant(folder, planted)
    why = {"folder of another uid": f"owned by uid {NOBODY}",
           "library of another uid": f"owned by uid {NOBODY}",
           "group-writable folder": "writable by group or others",
           "folder above of another uid": f"above the cache {root}) is owned by uid {NOBODY}"}
    if case == "folder of another uid":
        os.chown(folder, NOBODY, NOBODY)
    elif case == "library of another uid":
        os.chown(os.path.join(folder, LIB), NOBODY, NOBODY)
    elif case == "group-writable folder":
        os.chmod(folder, 0o770)
    else:
        os.chown(above, NOBODY, NOBODY)
    _refused(root, os.path.join(scratch, "ran"), why[case])


def test_a_library_whose_sha256_is_not_the_recorded_one_is_not_loaded(tmp_path, genuine,
                                                                       planted, monkeypatch):
    """A copy of a real build, its library then replaced (same owner, same mode). Old code:
    loaded it."""
    root = str(tmp_path / "cache")
    folder = _folder(root, monkeypatch)
    os.makedirs(os.path.dirname(folder), 0o700)
    shutil.copytree(genuine, folder)
    with open(planted, "rb") as src, open(os.path.join(folder, LIB), "wb") as dst:
        dst.write(src.read())
    _refused(root, str(tmp_path / "ran"), "sha256 is not the one recorded")


def test_a_copy_of_a_real_build_loads(tmp_path, genuine, monkeypatch):
    """The checks pass on what the build published (and its folders stay 0700)."""
    root = str(tmp_path / "cache")
    folder = _folder(root, monkeypatch)
    os.makedirs(os.path.dirname(folder), 0o700)
    shutil.copytree(genuine, folder)
    rc, out = _helper(root, str(tmp_path / "ran"))
    assert rc == 0 and "HELPER True" in out, out[-3000:]


@pytest.mark.slow   # two real builds of the helper: 80 s (the lock itself: the test below)
def test_a_build_killed_half_way_does_not_block_the_next(tmp_path, monkeypatch):
    """A build killed (SIGKILL, with its compiler) half-way through, then two processes that
    want the backend at once: both get it within the bound, from one build, and the cache's
    new folders are 0700 with nothing left of the killed build. Old code: the killed build's
    `lock` made every later build wait for ever. (The bound, 850 s, is under native.BUILD_WAIT
    and leaves room for one build of the backend on a loaded two-core machine: 75 s unloaded,
    over 400 s at load 10.)"""
    root = str(tmp_path / "xdg" / "r2comm")
    env = dict(os.environ, R2COMM_CACHE_DIR=root, PYTHONPATH=ROOT)
    victim = subprocess.Popen([sys.executable, "-c", "from r2comm.torch import native; native.build()"],
                              cwd=ROOT, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and victim.poll() is None:
            if any("lock" in files for _, _, files in os.walk(root)):
                break                        # torch's build lock: the build is under way
            time.sleep(0.05)
        assert victim.poll() is None, "the build ended before it could be killed"
        time.sleep(1.0)                      # the compiler running
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
    t0 = time.monotonic()
    procs = [_helper(root, str(tmp_path / "ran"), wait=False) for _ in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, 850 - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("native.module() after a killed build did not return in 850 s")
    assert all(p.returncode == 0 and "HELPER True" in o for p, o in zip(procs, outs)), outs
    folder = _folder(root, monkeypatch)
    parent = os.path.dirname(folder)
    names = sorted(os.listdir(parent))
    assert names == sorted([os.path.basename(folder), os.path.basename(folder) + ".lock"]), \
        names                                      # one build, no staging folder left
    for d in (root, parent, folder):
        assert os.stat(d).st_mode & 0o777 == 0o700, (d, oct(os.stat(d).st_mode))


def test_the_build_lock_ends_with_its_holder(tmp_path):
    """cache.lock: a live holder makes a waiter give up after its bound, naming the holder's
    pid; once the holder is killed (SIGKILL) the lock is taken at once."""
    path = str(tmp_path / "x.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from r2comm.torch import cache\n"
         "with cache.lock(sys.argv[1], 5):\n    print('held', flush=True); time.sleep(120)",
         path], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(R2commBuildError, match=f"pid {holder.pid}"):
            with cache.lock(path, 1.0):
                pass
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait(30)
    t0 = time.monotonic()
    with cache.lock(path, 10.0):
        assert time.monotonic() - t0 < 2


def test_no_compiler_is_an_error_naming_what_to_install(tmp_path):
    """A machine without a C++ compiler (CXX names none) and an empty cache: loading the
    backend raises R2commBuildError naming the compiler to install, and leaves no build
    folder behind; R2COMM_CACHE_DIR places the cache."""
    root = str(tmp_path / "cache")
    code = ("import sys; from r2comm.torch import native\n"
            "assert native.cache_dir().startswith(sys.argv[1]), native.cache_dir()\n"
            "native.module()")
    env = dict(os.environ, R2COMM_CACHE_DIR=root, CXX="/nonexistent/c++", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code, root], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout
    assert "R2commBuildError" in p.stderr and "apt install g++" in p.stderr, p.stderr[-3000:]
    built = [f for _, _, files in os.walk(root) for f in files if f.endswith(".so")]
    assert not built, built
