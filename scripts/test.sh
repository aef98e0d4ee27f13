#!/usr/bin/env bash
# Set up, build, run every test: the CPU suite, and the GPU suite (reported as skipped when
# no GPU is visible); then the reliability checks of docs/reliability.md: the CPU suite again
# under AddressSanitizer + UndefinedBehaviorSanitizer, and each fuzz target for a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
(cd build && ctest --output-on-failure -j 2)
scripts/sanitize.sh
scripts/fuzz.sh 60
