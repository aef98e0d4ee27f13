#!/usr/bin/env bash
# Set up, build, run every test: the CPU suite, and the GPU suite (reported as skipped when
# no GPU is visible).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
cd build
ctest --output-on-failure -j 2
