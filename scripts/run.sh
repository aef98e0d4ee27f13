#!/usr/bin/env bash
# The main job: set up, build, then check the low_latency backend on the GPU for the
# DeepSeek-R1 shape (8 in-process ranks, fp8 dispatch, bf16 combine) against the CPU reference.
# Extra arguments go to `epx check`. Without a GPU it says so and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
exec build/epx check "$@"
