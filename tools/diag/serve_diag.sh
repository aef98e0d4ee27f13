#!/usr/bin/env bash
# serve-bench at 8 in-process ranks on one GPU, small shape, under several launch shapes: which
# ones finish, every rank's error for those that do not, and the cuBLASLt algorithms chosen
# (CUBLASLT_LOG_LEVEL=2). Logs to $OUT (or serve-diag/). Usage: tools/diag/serve_diag.sh [build-dir]
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/diag/diag_env.sh serve-diag "${1:-build}"
S="--world 8 --experts 64 --hidden 2048 --intermediate 512 --shared-intermediate 512"
S="$S --num-prompts 16 --isl 128 --osl 8 --chunk-size 64 --max-batched-tokens 256"
one() {  # one NAME LAUNCH-JSON|default [serve-bench flags...]
  local name=$1 launch=$2; shift 2
  local cfg=()
  if [ "$launch" != default ]; then
    echo "$launch" >"$out/$name.launch.json"
    cfg=(EPX_CONFIG_PATH="$out/$name.launch.json")
  fi
  echo "=== $name (launch: $launch)"
  env "${cfg[@]}" CUBLASLT_LOG_LEVEL=2 timeout 90 "$build/epx" serve-bench $S "$@" >"$out/$name.log" 2>&1
  echo "rc $?"
  grep -E "^  rank [0-9]+:|error|launch shapes|^(naive|allgather|low_latency)" "$out/$name.log" | head -20
  grep -E "cublasLtMatmul" "$out/$name.log" | sort -u | head -12  # cuBLASLt's own trace
}
B16='{"global": {"num_blocks": 16, "warps_per_block": 32}}'
one b16w32 "$B16" --backends low_latency
one b8w16 '{"global": {"num_blocks": 8, "warps_per_block": 16}}' --backends low_latency
one default default --cuda-graph
