#!/usr/bin/env bash
# Installs what epx needs to build (Debian/Ubuntu packages) and configures + builds it.
# Usage: scripts/setup.sh [build-dir]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/fmt/format.h ] || need+=(libfmt-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
# The fuzzers (scripts/fuzz.sh): clang and its libFuzzer runtime (a package of its own on Debian).
clang_major=14
if command -v clang++ >/dev/null; then
  clang_major=$(clang++ -dumpversion | cut -d. -f1)
else
  need+=(clang)
fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer - -o /dev/null >/dev/null 2>&1; then
  need+=(libclang-rt-$clang_major-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

cuda=ON
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no CUDA toolkit (nvcc) found: building the CPU parts only"
  cuda=OFF
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEPX_ENABLE_CUDA=$cuda >/dev/null
cmake --build "$build" -j "$(nproc)"
