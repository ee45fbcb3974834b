#!/usr/bin/env bash
# The main job: install what is missing, build, then run several unmodified OpenCL programs
# (C, Rust, Python) at the same time through one hira router sharing the host's device, and
# show each tenant's calls, bytes and device time. Then three tenants whose buffers are three
# times a small device's memory, sharing it through buffer swapping.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

bash scripts/setup.sh
echo "== building hira (release)"
cargo build --release --workspace
bash scripts/programs.sh --build-only

HIRA=$ROOT/target/release/hira
RUN=$(mktemp -d /tmp/hira-demo.XXXXXX)
SOCK=$RUN/router.sock
SWAP_SOCK=$RUN/swap.sock
trap '"$HIRA" ctl --router "$SOCK" shutdown >/dev/null 2>&1 || true; "$HIRA" ctl --router "$SWAP_SOCK" shutdown >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT

echo "== starting a router at $SOCK"
"$HIRA" serve --socket "$SOCK" 2>"$RUN/router.log" &
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done

echo "== five unmodified programs, all at once, through one router"
pids=()
"$HIRA" run --router "$SOCK" -- "$ROOT/target/programs/vecadd" >"$RUN/vecadd.out" 2>&1 & pids+=($!)
"$HIRA" run --router "$SOCK" -- "$ROOT/target/programs/rust/release/hira-example-opencl3" >"$RUN/rust.out" 2>&1 & pids+=($!)
"$HIRA" run --router "$SOCK" -- python3 examples/python/mandelbrot.py 1024 >"$RUN/mandel1.out" 2>&1 & pids+=($!)
"$HIRA" run --router "$SOCK" -- python3 examples/python/mandelbrot.py 2048 >"$RUN/mandel2.out" 2>&1 & pids+=($!)
"$HIRA" run --router "$SOCK" -- clinfo -l >"$RUN/clinfo.out" 2>&1 & pids+=($!)
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for f in vecadd rust mandel1 mandel2 clinfo; do
  echo "-- $f: $(tail -n 1 "$RUN/$f.out")"
done

echo
echo "== per-tenant accounting seen by the router"
"$HIRA" ctl --router "$SOCK" stats
if [ "$fail" -ne 0 ]; then
  echo "a program failed; router log:"; tail -n 30 "$RUN/router.log"; exit 1
fi

echo
echo "== over-subscription: three tenants of 24 MiB each on a 24 MiB device (3x)"
printf 'socket = "%s"\n[scheduler]\npolicy = "rr"\n[memory]\ncapacity = "24MiB"\novercommit = 4\nslots = 8\nplacement = "util"\n' \
  "$SWAP_SOCK" >"$RUN/swap.toml"
"$HIRA" serve --config "$RUN/swap.toml" 2>"$RUN/swap-router.log" &
for _ in $(seq 50); do [ -S "$SWAP_SOCK" ] && break; sleep 0.1; done
pids=()
for seed in 1 2 3; do
  "$HIRA" run --router "$SWAP_SOCK" -- "$HIRA" bench-mem-tenant --buffers 6 --size 4194304 \
    --rounds 3 --seed "$seed" >"$RUN/swap$seed.out" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for seed in 1 2 3; do
  echo "-- tenant $seed: $(tail -n 1 "$RUN/swap$seed.out")"
done
echo
"$HIRA" ctl --router "$SWAP_SOCK" stats | sed -n '/^device memory/,/^$/p'
if [ "$fail" -ne 0 ]; then
  echo "a swapping tenant failed; router log:"; tail -n 30 "$RUN/swap-router.log"; exit 1
fi
