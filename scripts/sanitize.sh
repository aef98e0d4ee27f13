#!/usr/bin/env bash
# Builds the host code, the `epx` CLI and the CPU tests with AddressSanitizer and
# UndefinedBehaviorSanitizer in build-asan/ (device code and what nvcc compiles stay plain) and
# runs the CPU tests there. Any report fails its test: undefined behaviour aborts, leaks and
# memory errors end the process with an error.
# This build is also the second compiler's: clang (host code, and nvcc's host compiler) where it
# can be had, every target of the tree, so that its warnings are seen (errors with
# CMAKE_ARGS=-DEPX_WERROR=ON, as in CI). Without clang it builds with the default compiler.
# Usage: scripts/sanitize.sh [build-dir]   (default: build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh
build=${1:-build-asan}

need_pkg optional clang command -v clang++
install_needed
compiler=()
if command -v clang++ >/dev/null; then
  compiler=(-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CUDA_HOST_COMPILER=clang++)
else
  skipped sanitize "the second compiler (no clang++: apt-get install clang); building with c++"
fi
cuda=ON
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then cuda=OFF; fi
# -O1 -g1: what ASan's reports need (line tables), at half the compile time of -O2 -g.
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_ENABLE_CUDA=$cuda "${compiler[@]}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DEPX_SANITIZE=address,undefined \
  ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null

# protect_shadow_gap=0: the CUDA driver maps memory where ASan's shadow gap would be (on a
# machine with a GPU the CUDA runtime fails to initialise otherwise). detect_leaks stays on.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cd "$build"
# The CPU tests only: the GPU suites and the install test are not built here.
ctest --output-on-failure -j 2 --timeout 300 -E 'gpu_tests$|^epx_install_consumer$'
