#!/usr/bin/env bash
# The serve-bench comparison on one GPU: the default run (DeepSeek-R1 shape, every backend, eager
# and CUDA-graph decode) at 8 and at 32 in-process ranks, tables on stdout and JSON per world.
# Usage: scripts/serve_tables.sh [build-dir] [out-dir] [serve-bench flags...]
#   (out-dir defaults to $OUT, else serve-out; e.g. `build "" --graph-scope world`)
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_MODULE_LOADING=EAGER
build=${1:-build}
out=${2:-${OUT:-serve-out}}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
rc=0
for w in 8 32; do
  echo "=== serve-bench --world $w --cuda-graph"
  timeout "${EPX_SERVE_TIMEOUT_S:-270}" "$build/epx" serve-bench --world "$w" --cuda-graph \
    --json "$out/serve_w$w.json" "$@" || rc=1
done
exit $rc
