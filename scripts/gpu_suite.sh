#!/usr/bin/env bash
# Builds (unless a build with the binaries is already there) and runs the GPU suite plus the
# `epx check` runs of the DeepSeek-R1 shape, on a machine with an NVIDIA GPU. Ends with one
# "gpu-total: N passed, N failed" line. Logs go to build/gpu-logs, and as one archive
# (gpu-logs.tar.gz) to $OUT when that is set.
# Usage: scripts/gpu_suite.sh [build-dir] [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
# cuBLASLt (MoE layer) comes from the CUDA toolkit at run time.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
build=${1:-build}
quick=${2:-}
logs=$build/gpu-logs
mkdir -p "$logs"
if [ ! -x "$build/epx" ] || [ ! -x "$build/tests/epx_gpu_tests" ]; then
  scripts/setup.sh "$build" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

passed=0; failed=0
run() {  # run NAME CMD...: one counted check
  local name=$1; shift
  echo "=== $name: $*"
  # A hang must not eat the whole session: every counted run is bounded (exit 124 = timed out).
  if timeout "${EPX_RUN_TIMEOUT_S:-180}" "$@" >"$logs/$name.log" 2>&1; then passed=$((passed+1)); echo "    ok: $(tail -n 1 "$logs/$name.log")"
  else failed=$((failed+1)); echo "    FAILED:"; tail -n 15 "$logs/$name.log" | sed 's/^/      /'; fi
}

# GoogleTest suites: each test counts.
for suite in epx_gpu_tests epx_ipc_gpu_tests epx_moe_gpu_tests; do
  [ -x "$build/tests/$suite" ] || continue
  timeout "${EPX_SUITE_TIMEOUT_S:-420}" "$build/tests/$suite" --gtest_brief=1 >"$logs/$suite.log" 2>&1
  grep -E "FAILED|gpu-suite:|^\[  (PASSED|FAILED)" "$logs/$suite.log" | head -40
  line=$(grep -E "^gpu-suite: " "$logs/$suite.log" | tail -n 1)
  p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  if [ -z "$line" ]; then failed=$((failed+1)); echo "$suite did not finish"; else passed=$((passed+p)); failed=$((failed+f)); fi
done

E="$build/epx check"
for t in 128 1024; do
  for d in bf16-to-fp8 bf16 fp8; do
    for l in token expert; do
      [ -n "$quick" ] && [ "$t" = 1024 ] && continue
      it=2; [ "$t" = 1024 ] && it=1
      run "check_t${t}_${d}_${l}" $E --tokens $t --dtype $d --layout $l --iters $it
    done
  done
done
run check_t128_graph1000 $E --tokens 128 --graph 1000 --iters 1
run check_t128_mixed $E --tokens 128 --graph 100 --mixed --iters 1
run check_t128_expert_graph $E --tokens 128 --layout expert --graph 100 --iters 1
[ -z "$quick" ] && run check_t1024_graph100 $E --tokens 1024 --graph 100 --iters 1
[ -z "$quick" ] && run check_t1024_mixed $E --tokens 1024 --graph 50 --mixed --iters 1

# One process per rank (IpcWorld through `epx launch`), all sharing this machine's GPU: processes
# on one GPU are time-sliced (a round takes milliseconds), so the round counts stay small.
L="$build/epx launch"
EI="$build/epx check --world-kind ipc"
for n in 2 4; do
  run "ipc_example_n${n}" $L -n $n -- "$build/example_ipc_ranks"
  run "ipc_n${n}_t128_token" $L -n $n -- $EI --world $n --tokens 128 --iters 2
  run "ipc_n${n}_t128_expert" $L -n $n -- $EI --world $n --tokens 128 --layout expert --iters 2
  run "ipc_n${n}_t128_graph20" $L -n $n -- $EI --world $n --tokens 128 --graph 20 --iters 1
done
run ipc_example_n2_cuda_ipc $L -n 2 -- "$build/example_ipc_ranks" cuda-ipc
run ipc_n2_t128_mixed $L -n 2 -- $EI --world 2 --tokens 128 --graph 10 --mixed --iters 1
run ipc_n2_t128_naive $L -n 2 -- $EI --world 2 --tokens 128 --backend naive --iters 1

[ -n "${OUT:-}" ] && tar -czf "$OUT/gpu-logs.tar.gz" -C "$build" gpu-logs
echo "gpu-total: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
