#!/usr/bin/env bash
# Where dispatch's time goes at the bandwidth-bound sizes, in one run on a GPU machine: the scatter
# probe (what the copy alone reaches against the floor), then the phase clocks of low_latency
# (128, 4096 tokens per rank) and high_throughput (4096), then low_latency with ordered rows
# beside high_throughput at 4096 (the same row order, one kernel against two).
# Usage: tools/diag/dispatch_split.sh RELEASE_BUILD MEASUREMENT_BUILD
#   (RELEASE_BUILD holds epx and scatter_probe, built as tools/diag/scatter_probe.cu says;
#   MEASUREMENT_BUILD an epx built with -DEPX_MEASUREMENT_BUILD=ON)
set -uo pipefail
cd "$(dirname "$0")/../.."
release=${1:-build} measure=${2:-build-measure}
echo "=== scatter probe"
timeout 120 "$release/scatter_probe" 128 4096
echo "=== low_latency phase clock"
timeout 200 tools/diag/phase_clock.sh "$measure" 128 4096
echo "=== high_throughput phase clock"
timeout 120 tools/diag/ht_phase_clock.sh "$measure" 4096
echo "=== ordered low_latency beside high_throughput, 4096 tokens per rank"
timeout 120 "$release/epx" bench --backends low_latency,high_throughput --deterministic \
  --worst-case-output --tokens 4096 --iters 50 --no-verify 2>&1 | grep -E "graph one_per_gpu|commit"
