#!/usr/bin/env bash
# Makes a vLLM bundle (tools/vllm/bundle.py says what is in it), on a machine that reaches PyPI:
#   tools/vllm/bundle.sh [VERSION (0.34.0)] [--python 3.12] [--out .vllm] [--share-wheels BUNDLE]
# Carry the output folder (default .vllm, ignored by git) to a machine without network.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tools/vllm/bundle.py "$@"
