#!/usr/bin/env bash
# Graph replay of in-process ranks on one GPU with SWITCH nodes (the MoE layer's captured expert
# stage with --graph-experts switch). Measured on an H200 (docs/perf-notes.md): the all-to-all
# alone replays at 32 ranks; with its expert in a SWITCH node it stops at the first replay (a
# peer's graph never starts), and splitting dispatch / expert / combine into separate graphs does
# not change that; serve-bench with SWITCH graphs passes at 16 ranks and stops from 20. Here: the
# all-to-all with the SWITCH node, whole and split; serve-bench at 16, 20 and 32 ranks with
# SWITCH graphs, and at 32 unsplit; world scope at 8; the R1 shape at 8 ranks split vs whole.
# ~3 min when every step passes; a failing step stops at EPX_TIMEOUT_MS. Logs to $OUT (or
# graph-diag/). Usage: tools/diag/graph_diag.sh [build-dir]
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/diag/diag_env.sh graph-diag "${1:-build}"
step() {  # step NAME CMD...: one bounded run, its rc and its summary lines
  local name=$1; shift
  echo "=== $name: $*"
  timeout 120 "$@" >"$out/$name.log" 2>&1
  echo "rc $?"
  grep -E "^(PASS|FAIL)|^(naive|allgather|low_latency)|error|blocked|GPU time per piece" \
    "$out/$name.log" | head -12
}
C="$build/epx diag graph-replay --tokens 128 --iters 1"  # the all-to-all alone (`epx check`'s run)
step check_w32_cond $C --world 32 --graph 10 --graph-conditional
step check_w32_cond_split $C --world 32 --graph 10 --graph-conditional --graph-split
step check_w32_all_split $C --world 32 --graph 21 --graph-execs 7 --graph-conditional \
  --rank-threads --graph-split
SMALL="--hidden 2048 --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 128"
SMALL="$SMALL --osl 8 --chunk-size 64 --max-batched-tokens 256 --layers 1 --cuda-graph"
SMALL="$SMALL --graph-experts switch"
for w in 16 20 32; do
  step "serve_w${w}_graph" "$build/epx" serve-bench --world "$w" --experts $((w * 2)) $SMALL \
    --backends low_latency
done
step serve_w32_graph_unsplit "$build/epx" serve-bench --world 32 --experts 64 $SMALL \
  --backends low_latency --graph-split none
step serve_w8_graph_world "$build/epx" serve-bench --world 8 --experts 16 $SMALL \
  --backends low_latency --graph-scope world
# DeepSeek-R1 shape, 8 ranks, 2 layers: graph against eager decode steps, split and one graph
# per step (step_ms and graph_launch_ms in the JSON; split runs also print each piece's GPU time),
# then split with all-rows experts (serve-bench's default on one GPU).
for split in expert none; do
  step "serve_r1_w8_$split" "$build/epx" serve-bench --world 8 --cuda-graph --backends low_latency \
    --graph-experts switch --graph-split "$split" --json "$out/serve_r1_w8_$split.json"
done
step serve_r1_w8_allrows "$build/epx" serve-bench --world 8 --cuda-graph --backends low_latency \
  --json "$out/serve_r1_w8_allrows.json"
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
