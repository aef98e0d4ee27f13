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
# The Python package's extension (python/) is built in the same tree when python3 has its headers.
if command -v python3 >/dev/null; then
  python3 -c 'import os, sysconfig; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' \
    2>/dev/null || need+=(python3-dev)
fi
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
python=OFF  # nanobind and pytest from PyPI when missing; without them the package is left out
if command -v python3 >/dev/null; then
  python3 -c 'import nanobind, pytest' 2>/dev/null ||
    python3 -m pip install -q nanobind scikit-build-core pytest >/dev/null 2>&1 ||
    echo "setup: could not install nanobind/pytest: building without the Python package"
  python3 -c 'import nanobind' 2>/dev/null && python=ON
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEPX_ENABLE_CUDA=$cuda \
  -DEPX_BUILD_PYTHON=$python -DPython_EXECUTABLE="$(command -v python3 || echo python3)" >/dev/null
cmake --build "$build" -j "$(nproc)"
