#!/usr/bin/env bash
# Set up, build, run every test.
# Usage: scripts/test.sh [--gpu]
#   (no flag)  both halves.
#   --gpu      the GPU half only.
# The CPU half: the CPU suite; the Python package's CPU tests; the CPU suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, built with a second compiler (clang where it is
# there, scripts/sanitize.sh); each fuzz target for a minute (scripts/fuzz.sh: clang; skipped,
# with one line saying so, where clang cannot be had).
# The GPU half: the GPU suites and the Python package's GPU tests. Without a GPU every one of
# them reports itself skipped.
# The Python tests run on the package built in build/python; without python3's headers or
# nanobind the package is not built and its tests are skipped, with one line saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=1
if [ "${1:-}" = --gpu ]; then cpu=0; fi
scripts/setup.sh --tests build

pytest_on() {  # pytest_on FILES...: the Python package's tests, when it was built
  if [ -f build/python/epx/__init__.py ]; then
    PYTHONPATH=build/python python3 -m pytest -q -rs -p no:cacheprovider "$@"
  else
    echo "python: skipped: the package was not built (no python3 headers or nanobind)"
  fi
}

if [ $cpu = 1 ]; then
  echo "== CPU half"
  (cd build && ctest --output-on-failure -j 2 -E 'gpu_tests$')
  pytest_on tests/python/test_cpu*.py
fi
echo "== GPU half"
# (one at a time: the suites share the GPU)
(cd build && ctest --output-on-failure -R 'gpu_tests$')
pytest_on tests/python/test_gpu*.py
if [ $cpu = 1 ]; then
  echo "== CPU half: sanitizers and fuzzers"
  scripts/sanitize.sh
  scripts/fuzz.sh 60
fi
