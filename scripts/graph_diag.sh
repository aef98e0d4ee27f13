#!/usr/bin/env bash
# Graph replay of in-process ranks on one GPU: the all-to-all alone replays at 32 ranks, the MoE
# layer's graphs stop from 20 ranks (and, with several graphs per step, at 8). What the MoE graph
# adds: conditional SWITCH nodes (the expert stage), per-rank host threads, cuBLASLt GEMMs. The
# first two are separated here with `epx check --graph-conditional / --rank-threads` (identity
# expert, no GEMM), at 32 and 8 ranks; then serve-bench's graph at 16, 20 and 32 ranks on a small
# shape. ~2 min when every step passes; each failing step stops at EPX_TIMEOUT_MS.
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
C="$build/epx check --tokens 128 --iters 1"
step check_w32_graph $C --world 32 --graph 10
step check_w32_cond $C --world 32 --graph 10 --graph-conditional
step check_w32_threads $C --world 32 --graph 10 --rank-threads
step check_w32_cond_threads $C --world 32 --graph 10 --graph-conditional --rank-threads
step check_w8_cond_threads $C --world 8 --graph 200 --graph-conditional --rank-threads
step check_w8_cond_threads_expert $C --world 8 --graph 200 --graph-conditional --rank-threads \
  --layout expert --dtype fp8
SMALL="--hidden 2048 --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 128"
SMALL="$SMALL --osl 8 --chunk-size 64 --max-batched-tokens 256 --layers 1 --cuda-graph"
for w in 16 20 32; do
  step "serve_w${w}_graph" "$build/epx" serve-bench --world "$w" --experts $((w * 2)) $SMALL \
    --backends low_latency
done
