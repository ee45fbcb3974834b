#!/usr/bin/env bash
# THE test command for hira (see README):
#   1. cargo build --release --workspace
#   2. cargo test  --release --workspace
#   3. scripts/programs.sh            (C + Rust OpenCL programs, native vs hira)
#   4. scripts/pyopencl-suite.sh --ci (pyopencl's own tests, native vs hira)
# Prints a banner per stage and a final "N passed, M failed" line; exits
# nonzero if any stage failed. If the build fails, later stages are not run
# (they are counted as failed). Installs what is missing first (scripts/setup.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh

passed=0
failed=0
results=()

banner() {
    echo
    echo "================================================================"
    echo "== $*"
    echo "================================================================"
}

# stage <name> <cmd...>
stage() {
    local name="$1"
    shift
    banner "stage: $name"
    echo "\$ $*"
    local start rc=0
    start=$(date +%s)
    "$@" || rc=$?
    local secs=$(( $(date +%s) - start ))
    if [ "$rc" = 0 ]; then
        passed=$((passed + 1))
        results+=("PASS  $name (${secs}s)")
        echo "== stage $name: PASS (${secs}s)"
    else
        failed=$((failed + 1))
        results+=("FAIL  $name (exit $rc, ${secs}s)")
        echo "== stage $name: FAIL (exit $rc, ${secs}s)" >&2
    fi
    return "$rc"
}

skip() {
    failed=$((failed + 1))
    results+=("SKIP  $1 (not run: build failed)")
}

if stage "cargo build" cargo build --release --workspace; then
    stage "cargo test" cargo test --release --workspace || true
    stage "generated coverage table is current" bash -c \
        'cargo run --release -q -p hira-gen -- coverage | diff -u docs/opencl-coverage.md -' || true
    stage "programs" scripts/programs.sh || true
    stage "pyopencl suite (--ci)" scripts/pyopencl-suite.sh --ci || true
else
    skip "cargo test"
    skip "generated coverage table is current"
    skip "programs"
    skip "pyopencl suite (--ci)"
fi

banner "summary"
for r in "${results[@]}"; do echo "  $r"; done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
