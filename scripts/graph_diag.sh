#!/usr/bin/env bash
# The two open questions of serve-bench's graph mode on one GPU, in one run (~3 min when every
# step passes; each failing step stops at EPX_TIMEOUT_MS):
#   1. 32 in-process ranks stop at the first graph replay: does the all-to-all alone (epx check
#      --graph, --mixed) stop too; at which world size does it start (24 ranks); does it need the
#      SMs held by spinning blocks (1 block per op)?
#   2. a decode graph step is slower than the eager one, also at 1 rank: one MoE layer, eager and
#      graph, at 1 and 8 ranks (step times in the JSON).
# Logs and JSON to $OUT (or graph-diag/). Usage: scripts/graph_diag.sh [build-dir]
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_MODULE_LOADING=EAGER EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-3000}
build=${1:-build}
out=${OUT:-graph-diag}
mkdir -p "$out"
step() {  # step NAME CMD...: one bounded run, its rc and its summary lines
  local name=$1; shift
  echo "=== $name: $*"
  timeout 120 "$@" >"$out/$name.log" 2>&1
  echo "rc $?"
  grep -E "^(PASS|FAIL)|^(naive|allgather|low_latency)|: error|blocked" "$out/$name.log" | head -8
}
step check_w32_graph "$build/epx" check --world 32 --tokens 128 --graph 10 --iters 1
step check_w32_mixed "$build/epx" check --world 32 --tokens 128 --graph 10 --mixed --iters 1
SMALL="--hidden 2048 --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 128"
SMALL="$SMALL --osl 8 --chunk-size 64 --max-batched-tokens 256 --layers 1 --cuda-graph"
step serve_w24_graph "$build/epx" serve-bench --world 24 --experts 48 $SMALL --backends low_latency
echo '{"global": {"num_blocks": 1, "warps_per_block": 32}}' >"$out/b1.launch.json"
step serve_w32_graph_b1 env EPX_CONFIG_PATH="$out/b1.launch.json" "$build/epx" serve-bench \
  --world 32 --experts 64 $SMALL --backends low_latency
for w in 1 8; do
  step "serve_r1_w${w}_l1" "$build/epx" serve-bench --world "$w" --layers 1 --cuda-graph \
    --backends low_latency --json "$out/serve_r1_w${w}_l1.json"
done
