#!/usr/bin/env bash
# Splits low_latency's dispatch and combine into their phases on a GPU machine: a measurement
# build (-DEPX_MEASUREMENT_BUILD=ON, in build-measure) with EPX_PHASE_CLOCK=1 adds, per block and
# phase, the time since the block started; at exit every rank's object prints the mean over its
# launches (with --one-launch, rank 0's object serves the whole group: one line per op).
# Usage: tools/diag/phase_clock.sh [build-dir] [tokens...]   (default build-measure, 128 4096)
# Build it where the compiler is (`cmake -S . -B build-measure -DEPX_MEASUREMENT_BUILD=ON &&
# cmake --build build-measure --target epx_cli`) and carry build-measure/epx.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-measure}
shift || true
tokens=${*:-128 4096}
for t in $tokens; do
  replays=200 iters=2; [ "$t" -gt 1024 ] && replays=50 iters=1
  echo "=== $t tokens per rank, 8 ranks, one launch per GPU, DeepSeek-R1 shape"
  # Only the last replay is compared: the CPU reference of every replay at 4096 tokens would take
  # 20-30 s each.
  EPX_PHASE_CLOCK=1 "$build/epx" check --one-launch --tokens "$t" --iters "$iters" --graph "$replays" \
    --verify-every "$replays" 2>&1 |
    grep -E "phase clock|PASS|FAIL"
done
