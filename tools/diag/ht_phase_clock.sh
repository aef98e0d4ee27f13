#!/usr/bin/env bash
# Splits high_throughput's dispatch (count kernel, then transfer kernel) and combine into their
# phases on a GPU machine: a measurement build (-DEPX_MEASUREMENT_BUILD=ON, in build-measure) with
# EPX_PHASE_CLOCK=1 adds, per block and phase, the time since the block started in its kernel,
# and for block 0 of each transfer kernel the time since block 0 of the same rank's count kernel
# started; at exit every rank's object prints the means over its launches, one line per kernel
# (ht_count, ht_transfer, ht_combine; with --one-launch rank 0's object serves the whole group).
# 8 ranks, one launch per GPU, direct mode, worst-case receive areas, CUDA graph replays.
# It runs `epx check`, not `epx bench --no-verify`: check launches once per GPU only, while bench
# also times per-rank launches, which each rank's own clock would add to the one-launch figures.
# check's CPU reference is built once per input set (3 of them, in parallel, before the GPU runs),
# never per replay, and --verify-every 1000 compares only the eager call and the last replay.
# Usage: tools/diag/ht_phase_clock.sh [build-dir] [tokens...]   (default build-measure, 4096 16384)
# Build it where the compiler is (`cmake -S . -B build-measure -DEPX_MEASUREMENT_BUILD=ON &&
# cmake --build build-measure --target epx_cli`) and carry build-measure/epx.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
build=${1:-build-measure}
shift || true
tokens=${*:-4096 16384}
# The means include the first (eager, cold) call: each size runs with 20 and with 200 replays, so
# that its weight shows (1/21 against 1/201; the steady mean is (201 m200 - 21 m20) / 180).
for t in $tokens; do
  for replays in 20 200; do
    echo "=== $t tokens per rank, 8 ranks, one launch per GPU, DeepSeek-R1 shape, high_throughput, $replays replays"
    EPX_PHASE_CLOCK=1 "$build/epx" check --backend high_throughput --one-launch --worst-case-output \
      --tokens "$t" --iters 1 --graph "$replays" --verify-every 1000 2>&1 |
      grep -E "phase clock|PASS|FAIL"
  done
done
