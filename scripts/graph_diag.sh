#!/usr/bin/env bash
# Graph replay of in-process ranks on one GPU: the all-to-all alone replays at 32 ranks, the MoE
# layer's graphs stop from 20 ranks (and at 8 with several graphs per step). The timeout reports
# name each rank's call: a rank that reports the same call as its peers started late (its kernel
# waited behind another's), one call lower ran on a stale epoch. What the MoE graphs add, tried
# one at a time on the all-to-all alone (identity expert, no GEMM): SWITCH nodes
# (--graph-conditional), a host thread per rank (--rank-threads), several executable graphs per
# rank (--graph-execs, as serve-bench's 7 buckets); then serve-bench at 16, 20 and 32 ranks with
# all buckets, with one (--graph-buckets), and with one graph of all ranks (--graph-scope world);
# then the R1 shape at 8 ranks. ~3 min when every step passes; a failing step stops at
# EPX_TIMEOUT_MS. Logs to $OUT (or graph-diag/). Usage: scripts/graph_diag.sh [build-dir]
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/diag_env.sh graph-diag "${1:-build}"
step() {  # step NAME CMD...: one bounded run, its rc and its summary lines
  local name=$1; shift
  echo "=== $name: $*"
  timeout 120 "$@" >"$out/$name.log" 2>&1
  echo "rc $?"
  grep -E "^(PASS|FAIL)|^(naive|allgather|low_latency)|error|blocked" "$out/$name.log" | head -12
}
C="$build/epx check --tokens 128 --iters 1"
step check_w32_graph $C --world 32 --graph 10
step check_w32_cond $C --world 32 --graph 10 --graph-conditional
step check_w32_threads $C --world 32 --graph 10 --rank-threads
step check_w32_execs $C --world 32 --graph 21 --graph-execs 7
step check_w32_all $C --world 32 --graph 21 --graph-execs 7 --graph-conditional --rank-threads
step check_w8_all $C --world 8 --graph 210 --graph-execs 7 --graph-conditional --rank-threads
SMALL="--hidden 2048 --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 128"
SMALL="$SMALL --osl 8 --chunk-size 64 --max-batched-tokens 256 --layers 1 --cuda-graph"
for w in 16 20 32; do
  step "serve_w${w}_graph" "$build/epx" serve-bench --world "$w" --experts $((w * 2)) $SMALL \
    --backends low_latency
  step "serve_w${w}_graph_b8" "$build/epx" serve-bench --world "$w" --experts $((w * 2)) $SMALL \
    --backends low_latency --graph-buckets 8
  step "serve_w${w}_graph_world" "$build/epx" serve-bench --world "$w" --experts $((w * 2)) \
    $SMALL --backends low_latency --graph-scope world
done
# DeepSeek-R1 shape, 8 ranks, 2 layers: graph against eager decode steps, per-rank and world graphs
# (step_ms and graph_launch_ms in the JSON).
for scope in rank world; do
  step "serve_r1_w8_$scope" "$build/epx" serve-bench --world 8 --cuda-graph --backends low_latency \
    --graph-scope "$scope" --json "$out/serve_r1_w8_$scope.json"
done
# Where a graph step's time goes (R1 shape, 8 ranks, 2 layers): GPU kernel totals of an eager-only
# run and of an eager + graph run (their difference is the graph pass), with EPX_DIAG_NSYS=1 where
# nsys is installed (up to 5 more minutes).
if [ -n "${EPX_DIAG_NSYS:-}" ] && command -v nsys >/dev/null 2>&1; then
  R1="--world 8 --backends low_latency --num-prompts 32 --osl 32"
  for mode in eager graph; do
    flag=""; [ "$mode" = graph ] && flag="--cuda-graph"
    timeout 150 nsys profile -q -t cuda --cuda-graph-trace=node -o "$out/prof_$mode" -f true \
      "$build/epx" serve-bench $R1 $flag >"$out/prof_$mode.log" 2>&1
    echo "=== nsys $mode: rc $?"
    nsys stats -q -r cuda_gpu_kern_sum -f csv "$out/prof_$mode.nsys-rep" 2>/dev/null \
      | head -25 | cut -c1-200 | tee "$out/kern_sum_$mode.csv"
    rm -f "$out/prof_$mode.nsys-rep" "$out/prof_$mode.sqlite"
  done
fi
