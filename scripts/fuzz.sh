#!/usr/bin/env bash
# Builds the fuzz targets of tests/fuzz (libFuzzer, ASan, UBSan; clang, host code only) in
# build-fuzz/ and runs each for SECONDS (default 60), all at once, over its seed corpus
# (tests/fuzz/corpus/<target>, read only; what the run learns stays in build-fuzz/corpus).
# Exit 1 when a target finds something: its input is saved as build-fuzz/findings/<target>-*,
# and `build-fuzz/tests/fuzz/<target> <that file>` replays it.
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=build-fuzz
targets=(fuzz_launch_json fuzz_env fuzz_cli_flags)

source scripts/packages.sh
# clang and its libFuzzer runtime (a package of its own on Debian: libclang-rt-<major>-dev)
can_fuzz() {
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer - -o /dev/null
}
need_pkg optional clang command -v clang++
install_needed
if command -v clang++ >/dev/null; then
  need_pkg optional "libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev" can_fuzz
  install_needed
fi
if ! command -v clang++ >/dev/null || ! can_fuzz >/dev/null 2>&1; then
  skipped fuzz "the fuzzers (they need clang and libFuzzer: apt-get install clang libclang-rt-<N>-dev)"
  exit 0
fi
cxx=$(command -v clang++)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
  -DEPX_ENABLE_CUDA=OFF -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_FUZZERS=ON ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >/dev/null

mkdir -p "$build/findings"
pids=()
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t"
  # -timeout: one input that takes seconds is a finding too.
  "$build/tests/fuzz/$t" "$build/corpus/$t" "tests/fuzz/corpus/$t" \
    -max_total_time="$seconds" -max_len=4096 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$build/findings/$t-" >"$build/$t.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  t=${targets[$i]}
  rc=0
  wait "${pids[$i]}" || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/$t.log" | tail -1)
  corpus=$(ls "$build/corpus/$t" | wc -l)
  if [ "$rc" -eq 0 ]; then
    echo "fuzz: $t: ${runs:-?} inputs in ${seconds} s, corpus $corpus, no findings"
  else
    failed=1
    echo "fuzz: $t: FINDING (exit $rc) after ${runs:-?} inputs; log $build/$t.log:" >&2
    grep -E "epx fuzz finding|ERROR|SUMMARY|Test unit written" "$build/$t.log" >&2 || tail -20 "$build/$t.log" >&2
  fi
done
exit $failed
