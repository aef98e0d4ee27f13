#!/usr/bin/env bash
# The main job: set up, build, then `epx bench`: the three backends side by side on the GPU
# (8 in-process ranks, DeepSeek-R1 shape, fp8 dispatch, bf16 combine, 128 and 4096 tokens per
# rank), each checked against the CPU reference before it is timed; JSON goes to bench.json.
# Extra arguments go to `epx bench`. Without a GPU it says so and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
exec build/epx bench --json bench.json "$@"
