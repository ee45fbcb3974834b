#!/usr/bin/env bash
# Run pyopencl's own test suite (from the 2026.1.4 sdist unpacked by
# scripts/setup.sh) natively and under hira, and compare per-test outcomes.
#
#   scripts/pyopencl-suite.sh [--ci] [--native-only] [--hira-only] [pytest args...]
#
#   --ci           only test_wrapper.py test_enqueue_copy.py test_array.py
#   --native-only  run only natively
#   --hira-only    run only under `$HIRA run --`
#   pytest args    passed through (e.g. test_wrapper.py, -k image, -x)
#
# Both runs use, from <repo>/.hira/pyopencl-2026.1.4/test:
#   PYOPENCL_TEST=portable python -m pytest -q -p no:cacheprovider
#   --deselect test/test_array.py::test_xdg_cache_home --junitxml=<out>/<tag>-<mode>.xml
# (node ids are relative to the sdist root, which holds pyproject.toml, hence
# the test/ prefix; a bare test_array.py::... would silently match nothing).
# Logs and junit xml go to <repo>/target/pyopencl-suite/.
#
# Exit status: with both runs, nonzero iff some test that passed natively did
# not pass under hira. With a single run, pytest's own exit status.
#
# Environment: HIRA (default <repo>/target/release/hira), PYTHON (python3),
#   SUITE_TIMEOUT (seconds per pytest run, default 5400).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYOPENCL_VERSION="2026.1.4"
TESTDIR="$REPO/.hira/pyopencl-$PYOPENCL_VERSION/test"
HIRA="${HIRA:-$REPO/target/release/hira}"
PYTHON="${PYTHON:-python3}"
TIMEOUT="${SUITE_TIMEOUT:-5400}"
OUT="$REPO/target/pyopencl-suite"
CI_MODULES=(test_wrapper.py test_enqueue_copy.py test_array.py)

ci=0
do_native=1
do_hira=1
pytest_extra=()
for arg in "$@"; do
    case "$arg" in
        --ci) ci=1 ;;
        --native-only) do_hira=0 ;;
        --hira-only) do_native=0 ;;
        -h|--help) sed -n 2,23p "$0"; exit 0 ;;
        *) pytest_extra+=("$arg") ;;
    esac
done
if [ "$do_native" = 0 ] && [ "$do_hira" = 0 ]; then
    echo "pyopencl-suite: --native-only and --hira-only are mutually exclusive" >&2
    exit 2
fi
if [ ! -f "$TESTDIR/test_wrapper.py" ]; then
    echo "pyopencl-suite: $TESTDIR missing; run scripts/setup.sh first" >&2
    exit 1
fi
if [ "$do_hira" = 1 ] && [ ! -x "$HIRA" ]; then
    echo "pyopencl-suite: hira binary not found at $HIRA (build it, set HIRA=, or use --native-only)" >&2
    exit 1
fi

modules=()
[ "$ci" = 1 ] && modules=("${CI_MODULES[@]}")

mkdir -p "$OUT"
tag=full
[ "${#pytest_extra[@]}" -gt 0 ] && tag=custom
[ "$ci" = 1 ] && tag=ci

cache_dir="${POCL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pocl}"
cache_state() {
    local kb=0
    [ -d "$cache_dir" ] && kb=$(du -sk "$cache_dir" | cut -f1)
    if [ "$kb" -lt 20480 ]; then echo "cold (${kb} KiB in $cache_dir)"; else echo "warm ($((kb / 1024)) MiB in $cache_dir)"; fi
}

# run_suite <mode>: runs pytest natively or under hira; sets rc_<mode>, secs_<mode>
run_suite() {
    local mode="$1"
    local xml="$OUT/$tag-$mode.xml" log="$OUT/$tag-$mode.log"
    rm -f "$xml"
    local cmd=("$PYTHON" -m pytest -q -p no:cacheprovider
        --deselect test/test_array.py::test_xdg_cache_home
        --junitxml="$xml"
        ${modules[@]+"${modules[@]}"} ${pytest_extra[@]+"${pytest_extra[@]}"})
    # Under hira, a router of this run's own: its log (router and API servers) is kept
    # beside the pytest log, and its warnings are shown when a test fails.
    local router_dir="$OUT/router-$tag"
    if [ "$mode" = hira ]; then
        cmd=(env HIRA_SOCKET="$router_dir/router.sock" "$HIRA" run -- "${cmd[@]}")
        mkdir -p "$router_dir"
        : > "$router_dir/router.log"
    fi
    echo "== pyopencl suite ($tag, $mode): pocl cache $(cache_state)"
    echo "   cd $TESTDIR && PYOPENCL_TEST=portable ${cmd[*]}"
    local start end rc=0
    start=$(date +%s)
    set +e
    (cd "$TESTDIR" && PYOPENCL_TEST=portable timeout "$TIMEOUT" "${cmd[@]}") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    end=$(date +%s)
    printf -v "rc_$mode" '%s' "$rc"
    printf -v "secs_$mode" '%s' "$((end - start))"
    echo "== $mode: pytest exit $rc, wall $((end - start))s (log: $log)"
    if [ "$mode" = hira ] && [ "$rc" != 0 ]; then
        echo "== hira's warnings and SVM lines during the run ($router_dir/router.log):"
        grep -E " (WARN|ERROR) |arena|SVM" "$router_dir/router.log" | tail -n 60 || true
    fi
}

rc_native=""; rc_hira=""; secs_native=""; secs_hira=""
[ "$do_native" = 1 ] && run_suite native
[ "$do_hira" = 1 ] && run_suite hira

# ---------------------------------------------------------------- compare
"$PYTHON" - "$OUT" "$tag" "$do_native" "$do_hira" "${rc_native:-}" "${rc_hira:-}" \
    "${secs_native:-}" "${secs_hira:-}" <<'PY'
import os, sys
import xml.etree.ElementTree as ET

out, tag, do_native, do_hira, rc_n, rc_h, s_n, s_h = sys.argv[1:9]
modes = [m for m, on in (("native", do_native), ("hira", do_hira)) if on == "1"]
rcs = {"native": rc_n, "hira": rc_h}
secs = {"native": s_n, "hira": s_h}

def outcomes(path):
    if not os.path.exists(path):
        return None
    res = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls = tc.get("classname", "")
        tid = cls.replace(".", "/") + ".py::" + tc.get("name", "")
        oc = "passed"
        for child in tc:
            if child.tag == "failure":
                oc = "failed"
            elif child.tag == "error":
                oc = "error"
            elif child.tag == "skipped":
                oc = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        # a test can appear twice (call failure + teardown error): keep the worst
        prev = res.get(tid)
        if prev is None or prev == "passed":
            res[tid] = oc
    return res

res = {m: outcomes(os.path.join(out, f"{tag}-{m}.xml")) for m in modes}
cats = ["passed", "failed", "error", "skipped", "xfailed", "total"]
print()
print(f"pyopencl suite ({tag}) results")
print(f"  {'outcome':<10}" + "".join(f"{m:>10}" for m in modes))
for c in cats:
    row = f"  {c:<10}"
    for m in modes:
        r = res[m]
        if r is None:
            row += f"{'n/a':>10}"
        else:
            n = len(r) if c == "total" else sum(1 for v in r.values() if v == c)
            row += f"{n:>10}"
    print(row)
print(f"  {'exit':<10}" + "".join(f"{rcs[m]:>10}" for m in modes))
print(f"  {'wall (s)':<10}" + "".join(f"{secs[m]:>10}" for m in modes))

status = 0
if len(modes) == 2:
    n, h = res["native"], res["hira"]
    if n is None:
        print("native run produced no junit xml")
        status = 1
    else:
        h = h or {}
        # Every test that passes natively must pass under hira: no exceptions are listed.
        regress = sorted(t for t, v in n.items() if v == "passed" and h.get(t) != "passed")
        better = sorted(t for t, v in n.items() if v != "passed" and h.get(t) == "passed")
        print()
        print(f"passed natively but not under hira: {len(regress)}")
        for t in regress:
            print(f"  {t}: {h.get(t, 'missing')}")
        if better:
            print(f"passed under hira but not natively: {len(better)}")
            for t in better:
                print(f"  {t}: native {n[t]}")
        status = 1 if regress else 0
        print()
        print("RESULT: " + ("FAIL" if status else "PASS") + f" (pyopencl {tag}: {len(regress)} regressions under hira)")
else:
    m = modes[0]
    try:
        status = int(rcs[m])
    except ValueError:
        status = 1
    if res[m] is None:
        status = status or 1
    print()
    print(f"RESULT: {'PASS' if status == 0 else 'FAIL'} (pyopencl {tag}, {m} only, pytest exit {rcs[m]})")
sys.exit(status)
PY
