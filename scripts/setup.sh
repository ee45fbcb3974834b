#!/usr/bin/env bash
# Idempotent environment setup for hira's tests.
#  - apt: pocl-opencl-icd ocl-icd-opencl-dev opencl-headers clinfo (only if missing)
#  - pip: numpy pytest mako pyopencl==2026.1.4 (only if not importable / wrong version)
#  - pyopencl 2026.1.4 sdist (for its test suite) unpacked into <repo>/.hira/pyopencl-2026.1.4/
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYOPENCL_VERSION="2026.1.4"
HIRA_DIR="$REPO/.hira"
SDIST_DIR="$HIRA_DIR/pyopencl-$PYOPENCL_VERSION"
PYTHON="${PYTHON:-python3}"

log() { echo "[setup] $*"; }

# ---------------------------------------------------------------- apt
missing_apt=()
command -v clinfo >/dev/null 2>&1 || missing_apt+=(clinfo)
[ -f /usr/include/CL/cl.h ] || missing_apt+=(opencl-headers)
# ocl-icd-opencl-dev provides the linkable libOpenCL.so (unversioned symlink)
have_libopencl=0
for f in /usr/lib/*/libOpenCL.so /usr/lib/libOpenCL.so /usr/local/lib/libOpenCL.so; do
    [ -e "$f" ] && have_libopencl=1
done
[ "$have_libopencl" = 1 ] || missing_apt+=(ocl-icd-opencl-dev)
if [ ! -f /etc/OpenCL/vendors/pocl.icd ]; then
    missing_apt+=(pocl-opencl-icd)
fi
if [ "${#missing_apt[@]}" -gt 0 ]; then
    log "installing apt packages: ${missing_apt[*]}"
    if [ "$(id -u)" -ne 0 ]; then
        echo "[setup] ERROR: need root to apt-get install ${missing_apt[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y pocl-opencl-icd ocl-icd-opencl-dev opencl-headers clinfo
else
    log "apt packages present (clinfo, opencl-headers, ocl-icd-opencl-dev, pocl-opencl-icd)"
fi

# ---------------------------------------------------------------- pip
pip_needed=()
"$PYTHON" -c 'import numpy' >/dev/null 2>&1 || pip_needed+=(numpy)
"$PYTHON" -c 'import pytest' >/dev/null 2>&1 || pip_needed+=(pytest)
"$PYTHON" -c 'import mako' >/dev/null 2>&1 || pip_needed+=(mako)
if ! "$PYTHON" -c "import pyopencl, sys; sys.exit(0 if pyopencl.VERSION_TEXT == '$PYOPENCL_VERSION' else 1)" >/dev/null 2>&1; then
    pip_needed+=("pyopencl==$PYOPENCL_VERSION")
fi
if [ "${#pip_needed[@]}" -gt 0 ]; then
    log "pip installing: ${pip_needed[*]}"
    "$PYTHON" -m pip install --disable-pip-version-check "${pip_needed[@]}"
else
    log "python packages present (numpy, pytest, mako, pyopencl==$PYOPENCL_VERSION)"
fi

# ---------------------------------------------------------------- sdist
if [ -f "$SDIST_DIR/test/test_wrapper.py" ]; then
    log "pyopencl sdist already unpacked at $SDIST_DIR"
else
    log "downloading pyopencl $PYOPENCL_VERSION sdist into $HIRA_DIR"
    mkdir -p "$HIRA_DIR"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download --disable-pip-version-check --no-deps \
        --no-binary pyopencl -d "$tmp" "pyopencl==$PYOPENCL_VERSION"
    tarball="$(ls "$tmp"/pyopencl-"$PYOPENCL_VERSION".tar.gz)"
    rm -rf "$SDIST_DIR"
    tar -xzf "$tarball" -C "$HIRA_DIR"
    [ -f "$SDIST_DIR/test/test_wrapper.py" ] || {
        echo "[setup] ERROR: sdist unpacked but $SDIST_DIR/test/test_wrapper.py missing" >&2
        exit 1
    }
    log "unpacked sdist to $SDIST_DIR"
fi

log "done"
