#!/usr/bin/env bash
# Same-job A/B of two builds of r2comm's engine: another source tree's (its engine built in
# place, e.g. a worktree of main) against this tree's, allreduce on 2 ranks and 2 loopback rails
# with MPI over TCP alongside, in both build orders (bench/ab_settings.py's `package=` variant:
# the other tree's r2comm is copied as package r2base and its engine rebuilt under that name,
# so both engines run in one process).
#
#   bench/ab_builds.sh OTHER_TREE [SIZE...]        default sizes: 8 64K 1M 4M 16M; ROUNDS=11
#
# v0 is the other tree, v1 this one: "v0/v1 time per round" below 1 means this tree is slower.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OTHER="$(cd "$1" && pwd)"; shift
SIZES=("$@"); [ ${#SIZES[@]} -gt 0 ] || SIZES=(8 64K 1M 4M 16M)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
cp -r "$OTHER/r2comm" "$TMP/r2base"
# Python keeps one extension module per init name: a copied engine built as r2comm._core.engine
# would silently be the same module as this tree's. So the other tree's extensions are rebuilt
# here as r2base._core.* (their sources with the package renamed), flags as setup.py's.
rm -f "$TMP"/r2base/_core/*.so "$TMP"/r2base/_core/*.cpp
sed -i 's/r2comm\._core/r2base._core/g; s/r2comm\/_core/r2base\/_core/g' \
    "$TMP"/r2base/_core/*.pyx "$TMP"/r2base/_core/*.pxd "$TMP"/r2base/_core/*.pxi
( cd "$TMP" && "$PY" - <<'PYEOF'
import glob, os
from setuptools import setup, Extension
from Cython.Build import cythonize
names = [os.path.basename(p)[:-4] for p in glob.glob("r2base/_core/*.pyx")
         if os.path.basename(p) not in ("verbs.pyx", "testing.pyx")]
exts = [Extension(f"r2base._core.{n}", [f"r2base/_core/{n}.pyx"], language="c++",
                  extra_compile_args=["-O3", "-std=c++17", "-fno-strict-aliasing"],
                  include_dirs=["r2base/_core"], libraries=["pthread"]) for n in names]
setup(name="r2base", ext_modules=cythonize(exts, quiet=True, language_level=3),
      script_args=["build_ext", "--inplace", "-q"])
PYEOF
) >"$TMP/build.log" 2>&1 || { tail -20 "$TMP/build.log"; exit 1; }
ls "$TMP"/r2base/_core/engine*.so >/dev/null
export PYTHONPATH="$ROOT:$TMP" R2COMM_RAILS=127.0.0.1,127.0.0.2
export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo
cd "$ROOT"
for s in "${SIZES[@]}"; do
    for order in fwd rev; do
        "$(dirname "$PY")/mpiexec" -n 2 "$PY" bench/ab_settings.py --size "$s" \
            --rounds "${ROUNDS:-11}" --order "$order" "package=r2base" ""
    done
done
