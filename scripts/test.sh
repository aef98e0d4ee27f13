#!/usr/bin/env bash
# Set up, build, run every test: the CPU suite, and the GPU suite (reported as skipped when
# no GPU is visible); then the Python package's tests on the package built in build/python (its
# GPU tests report themselves skipped without torch or a GPU); then the reliability checks of
# docs/reliability.md: the CPU suite again under AddressSanitizer + UndefinedBehaviorSanitizer, and
# each fuzz target for a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
(cd build && ctest --output-on-failure -j 2)
if [ -f build/python/epx/__init__.py ]; then
  PYTHONPATH=build/python python3 -m pytest -q -rs -p no:cacheprovider tests/python
else
  echo "python: the package was not built (no python3 headers or nanobind): its tests did not run"
fi
scripts/sanitize.sh
scripts/fuzz.sh 60
