#!/usr/bin/env bash
# Build the OpenCL test programs and diff their output natively vs under hira.
#
#   scripts/programs.sh [--native-only] [--build-only]
#
# Programs:
#   tests/programs/c/*.c      -> target/programs/<name>   (cc -O2 x.c -lOpenCL -lpthread):
#                                info.c, vecadd.c, svm.c (coarse- and fine-grained SVM;
#                                run a second time with fine grain off, through mirrors),
#                                buffers.c (transfers and maps; run a second time with
#                                buffers kept out of the arena, HIRA_ARENA_BUFFERS=0),
#                                waits.c (waits for launches; run a second time without
#                                the event board, HIRA_EVENT_BOARD=0)
#   examples/rust-opencl3     -> target/programs/rust/release/hira-example-opencl3
#
# Each program is run natively and under `$HIRA run --` (HIRA defaults to
# <repo>/target/release/hira); stdout must be byte-identical. With
# --native-only each program is run natively twice instead (determinism check).
# Outputs are kept in target/programs/out/<name>.{native,hira}.{out,err}.
#
# Environment:
#   HIRA               hira binary (default <repo>/target/release/hira)
#   POCL_MEMORY_LIMIT  defaults to 2 (GiB). PoCL derives CL_DEVICE_GLOBAL_MEM_SIZE
#                      and CL_DEVICE_MAX_MEM_ALLOC_SIZE from the currently free
#                      memory, so without a fixed limit info output drifts between
#                      runs. hira's server must see the same value (inherit env).
#   PROGRAM_TIMEOUT    per-run timeout in seconds (default 300)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

NATIVE_ONLY=0
BUILD_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --native-only) NATIVE_ONLY=1 ;;
        --build-only) BUILD_ONLY=1 ;;
        -h|--help) sed -n 2,23p "$0"; exit 0 ;;
        *) echo "programs.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

HIRA="${HIRA:-$REPO/target/release/hira}"
export POCL_MEMORY_LIMIT="${POCL_MEMORY_LIMIT:-2}"
TIMEOUT="${PROGRAM_TIMEOUT:-300}"
OUT="$REPO/target/programs"
LOGS="$OUT/out"
mkdir -p "$OUT" "$LOGS"

if [ "$NATIVE_ONLY" = 0 ] && [ "$BUILD_ONLY" = 0 ] && [ ! -x "$HIRA" ]; then
    echo "programs.sh: hira binary not found at $HIRA (build it or pass --native-only)" >&2
    exit 1
fi

# ------------------------------------------------------------------ build
names=()
bins=()
echo "== building C programs"
for src in "$REPO"/tests/programs/c/*.c; do
    name="$(basename "$src" .c)"
    echo "   cc -O2 $src -> target/programs/$name"
    cc -O2 -Wall -o "$OUT/$name" "$src" -lOpenCL -lpthread
    names+=("$name")
    bins+=("$OUT/$name")
done
echo "== building examples/rust-opencl3"
cargo build --release --quiet --manifest-path "$REPO/examples/rust-opencl3/Cargo.toml" \
    --target-dir "$OUT/rust"
names+=("rust-opencl3")
bins+=("$OUT/rust/release/hira-example-opencl3")
[ "$BUILD_ONLY" = 1 ] && exit 0

# ------------------------------------------------------------------ run
# run_one <label> <name> <cmd...>: writes $LOGS/<name>.<label>.{out,err}, returns rc
run_one() {
    local label="$1" name="$2"
    shift 2
    local start end rc=0
    start=$(date +%s%N)
    timeout "$TIMEOUT" "$@" >"$LOGS/$name.$label.out" 2>"$LOGS/$name.$label.err" || rc=$?
    end=$(date +%s%N)
    local ms=$(( (end - start) / 1000000 ))
    printf '   %-14s %-7s rc=%d  %d.%03ds\n' "$name" "$label" "$rc" $((ms / 1000)) $((ms % 1000))
    return "$rc"
}

pass=0
fail=0
failed=()
echo "== running (POCL_MEMORY_LIMIT=$POCL_MEMORY_LIMIT)"
for i in "${!names[@]}"; do
    name="${names[$i]}"
    bin="${bins[$i]}"
    ok=1
    rc_a=0
    run_one native "$name" "$bin" || rc_a=$?
    if [ "$NATIVE_ONLY" = 1 ]; then
        other=native2
        rc_b=0
        run_one native2 "$name" "$bin" || rc_b=$?
    else
        other=hira
        rc_b=0
        run_one hira "$name" "$HIRA" run -- "$bin" || rc_b=$?
    fi
    if [ "$rc_a" != 0 ]; then
        echo "   $name: native run failed (rc=$rc_a); stderr tail:"; tail -n 5 "$LOGS/$name.native.err" | sed 's/^/     | /'
        ok=0
    fi
    if [ "$rc_b" != 0 ]; then
        echo "   $name: $other run failed (rc=$rc_b); stderr tail:"; tail -n 5 "$LOGS/$name.$other.err" | sed 's/^/     | /'
        ok=0
    fi
    if ! diff -u --label "$name (native)" --label "$name ($other)" \
            "$LOGS/$name.native.out" "$LOGS/$name.$other.out" >"$LOGS/$name.diff"; then
        echo "   $name: stdout differs (native vs $other):"
        head -n 40 "$LOGS/$name.diff" | sed 's/^/     | /'
        ok=0
    fi
    if [ "$ok" = 1 ]; then
        echo "PASS $name"
        pass=$((pass + 1))
    else
        echo "FAIL $name"
        fail=$((fail + 1))
        failed+=("$name")
    fi
done

# The verdict on a second run: verdict <status of the comparison> <label> <program> <what>
# <rc of the run>; on failure the diff and the end of stderr are shown.
verdict() {
    local ok="$1" label="$2" prog="$3" what="$4" rc="$5"
    if [ "$ok" = 0 ]; then
        echo "PASS $prog ($what)"
        pass=$((pass + 1))
    else
        echo "   $prog ($label): rc=$rc or stdout differs:"
        head -n 40 "$LOGS/$prog.$label.diff" 2>/dev/null | sed 's/^/     | /'
        tail -n 5 "$LOGS/$prog.$label.err" | sed 's/^/     | /'
        echo "FAIL $prog ($what)"
        fail=$((fail + 1))
        failed+=("$prog-$label")
    fi
}

# Coarse-grained SVM through guest mirrors, what hira does where the device offers no fine
# grain (on a CPU device every SVM allocation lives in the shared arena): svm.c once more,
# through a router of its own whose servers offer no fine-grained SVM (HIRA_FINE_SVM=0),
# compared with the native run on every line that does not depend on fine grain.
if [ "$NATIVE_ONLY" = 0 ] && [ -x "$OUT/svm" ]; then
    sock="$OUT/mirrors.sock"
    rm -f "$sock"
    HIRA_FINE_SVM=0 "$HIRA" serve --socket "$sock" --idle-exit 60s \
        >"$LOGS/svm.mirrors-router.log" 2>&1 &
    rpid=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    rc=0
    run_one mirrors svm "$HIRA" run --router "$sock" -- "$OUT/svm" || rc=$?
    kill "$rpid" 2>/dev/null || true
    wait "$rpid" 2>/dev/null || true
    coarse() {
        grep -v -e 'fine-grain' -e 'followed a pointer' -e 'kernel walked' \
            -e 'atomic increments' -e 'copied out of fine' "$1" || true
    }
    same=0
    { [ "$rc" = 0 ] && diff -u --label "svm (native, coarse lines)" --label "svm (mirrors)" \
        <(coarse "$LOGS/svm.native.out") <(coarse "$LOGS/svm.mirrors.out") \
        >"$LOGS/svm.mirrors.diff"; } || same=$?
    verdict "$same" mirrors svm "coarse-grained SVM through mirrors" "$rc"
fi

# A program once more under hira with `env` in the application's environment, compared line
# for line with its native run: again <label> <program> <env> <what>.
again() {
    local label="$1" prog="$2" env="$3" what="$4" rc=0 same=0
    [ "$NATIVE_ONLY" = 0 ] && [ -x "$OUT/$prog" ] || return 0
    run_one "$label" "$prog" env "$env" "$HIRA" run -- "$OUT/$prog" || rc=$?
    { [ "$rc" = 0 ] && diff -u --label "$prog (native)" --label "$prog ($label)" \
        "$LOGS/$prog.native.out" "$LOGS/$prog.$label.out" >"$LOGS/$prog.$label.diff"; } || same=$?
    verdict "$same" "$label" "$prog" "$what" "$rc"
}

# Buffers outside the arena, what hira does on devices that are not the CPU, for transfers
# with events, and under memory over-subscription.
again ordinary buffers HIRA_ARENA_BUFFERS=0 "outside the arena"
# Waits for launches through the server, as when the event board cannot answer (a kernel
# longer than the board's wait, a failure): every wait of waits.c goes that way.
again noboard waits HIRA_EVENT_BOARD=0 "waits without the event board"

mode=$([ "$NATIVE_ONLY" = 1 ] && echo "native vs native" || echo "native vs hira")
echo "programs ($mode): $pass passed, $fail failed${failed:+ (${failed[*]})}"
[ "$fail" = 0 ]
