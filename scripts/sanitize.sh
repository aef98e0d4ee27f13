#!/usr/bin/env bash
# Builds the host code, the `epx` CLI and the CPU tests with AddressSanitizer and
# UndefinedBehaviorSanitizer in build-asan/ (device code and what nvcc compiles stay plain) and
# runs the CPU tests there. Any report fails its test: undefined behaviour aborts, leaks and
# memory errors end the process with an error.
# Usage: scripts/sanitize.sh [build-dir]   (default: build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-asan}

cuda=ON
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then cuda=OFF; fi
# -O1 -g1: what ASan's reports need (line tables), at half the compile time of -O2 -g.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_ENABLE_CUDA=$cuda \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DEPX_SANITIZE=address,undefined >/dev/null
cmake --build "$build" -j "$(nproc)" --target epx_cpu_tests >/dev/null

# protect_shadow_gap=0: the CUDA driver maps memory where ASan's shadow gap would be (on a
# machine with a GPU the CUDA runtime fails to initialise otherwise). detect_leaks stays on.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cd "$build"
# The CPU tests only: the GPU suites and the install test are not built here.
ctest --output-on-failure -j 2 --timeout 300 -E 'gpu_tests$|^epx_install_consumer$'
