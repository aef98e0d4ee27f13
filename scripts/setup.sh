#!/usr/bin/env bash
# Installs what epx needs (Debian/Ubuntu packages, PyPI), then configures and builds it.
# Usage: scripts/setup.sh [--tests] [build-dir]   (default: build)
#   (no flag)  the main job: the library and the `epx` CLI. Needs cmake, a C++20 compiler, the
#              CUDA toolkit and the headers of nlohmann/json, CLI11 and fmt; a missing one stops
#              the script with the package to install.
#   --tests    also the test suites (GoogleTest: required) and the Python package (python3's
#              headers, nanobind and pytest: optional; without them the package is left out,
#              said in one line). Without the CUDA toolkit only the CPU parts are built.
# Packages are installed where that is possible (apt-get as root or through sudo, pip); without
# a network nothing is installed, what is missing is named, and the build goes on with what is
# there. Extra CMake arguments come from $CMAKE_ARGS (CI sets -DEPX_WERROR=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh
tests=0
if [ "${1:-}" = --tests ]; then tests=1; shift; fi
build=${1:-build}

have_nvcc() { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }
have_python_h() {
  python3 -c 'import os, sysconfig; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")'
}
need_pkg required cmake command -v cmake
need_pkg required g++ command -v c++
need_pkg required nlohmann-json3-dev have_header nlohmann/json.hpp
need_pkg required libcli11-dev have_header CLI/CLI.hpp
need_pkg required libfmt-dev have_header fmt/format.h
if [ $tests = 1 ]; then
  need_pkg required libgtest-dev have_header gtest/gtest.h
  command -v python3 >/dev/null && need_pkg optional python3-dev have_python_h
fi
install_needed
if [ ${#missing_required[@]} -gt 0 ]; then
  echo "setup: missing, and could not be installed here: ${missing_required[*]}" >&2
  echo "setup: install them (apt-get install ${missing_required[*]}) and run this again" >&2
  exit 1
fi

cuda=ON
if ! have_nvcc; then
  if [ $tests = 0 ]; then
    echo "setup: no CUDA toolkit (nvcc): the main job needs it (CUDA 12.8 or newer, for sm_90)" >&2
    exit 1
  fi
  echo "setup: no CUDA toolkit (nvcc) found: building the CPU parts only"
  cuda=OFF
fi

args=(-DCMAKE_BUILD_TYPE=Release -DEPX_ENABLE_CUDA=$cuda)
if [ $tests = 1 ]; then
  python=OFF  # nanobind and pytest from PyPI when missing; without them the package is left out
  if ! command -v python3 >/dev/null; then
    echo "setup: skipped: the Python package (no python3)"
  elif ! have_python_h; then
    echo "setup: skipped: the Python package (no Python.h: apt-get install python3-dev)"
  else
    python3 -c 'import nanobind, pytest' 2>/dev/null ||
      timeout 300 python3 -m pip install -q --retries 1 --timeout 20 nanobind scikit-build-core pytest >/dev/null 2>&1 || true
    if python3 -c 'import nanobind, pytest' 2>/dev/null; then python=ON
    else echo "setup: skipped: the Python package (no nanobind/pytest: pip install nanobind pytest)"; fi
  fi
  args+=(-DEPX_BUILD_TESTS=ON -DEPX_BUILD_PYTHON=$python
         -DPython_EXECUTABLE="$(command -v python3 || echo python3)")
else
  # The main job's build leaves a tree that --tests later extends: the tests are configured
  # wherever GoogleTest is there (not built), the Python package keeps its earlier setting.
  if have_header gtest/gtest.h; then args+=(-DEPX_BUILD_TESTS=ON); else args+=(-DEPX_BUILD_TESTS=OFF); fi
fi
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S . -B "$build" "${args[@]}" ${CMAKE_ARGS:-} >/dev/null
if [ $tests = 1 ]; then
  cmake --build "$build" -j "$(nproc)"
else
  cmake --build "$build" -j "$(nproc)" --target epx_cli
fi
