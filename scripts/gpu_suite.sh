#!/usr/bin/env bash
# Builds (unless a build with the binaries is already there) and runs the GPU suite plus the
# `epx check` runs of the DeepSeek-R1 shape, on a machine with an NVIDIA GPU. Ends with one
# "gpu-total: N passed, N failed" line. Logs go to build/gpu-logs, and as one archive
# (gpu-logs.tar.gz) to $OUT when that is set.
# Usage: scripts/gpu_suite.sh [build-dir] [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
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
  if "$@" >"$logs/$name.log" 2>&1; then passed=$((passed+1)); echo "    ok: $(tail -n 1 "$logs/$name.log")"
  else failed=$((failed+1)); echo "    FAILED:"; tail -n 15 "$logs/$name.log" | sed 's/^/      /'; fi
}

# GoogleTest suite: each test counts.
"$build/tests/epx_gpu_tests" --gtest_brief=1 2>&1 | tee "$logs/gpu_tests.log" | grep -E "FAILED|gpu-suite:|^\[  (PASSED|FAILED)" | head -40
line=$(grep -E "^gpu-suite: " "$logs/gpu_tests.log" | tail -n 1)
p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
if [ -z "$line" ]; then failed=$((failed+1)); echo "gpu test binary did not finish"; else passed=$((passed+p)); failed=$((failed+f)); fi

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

[ -n "${OUT:-}" ] && tar -czf "$OUT/gpu-logs.tar.gz" -C "$build" gpu-logs
echo "gpu-total: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
