#!/usr/bin/env bash
# Copies what scripts/gpu_suite.sh runs from a build (the CLI, the IPC example, the GPU test
# binaries and the fault-injection rank) into OUT, about 30 MB, so that the suite of a build made
# here (of this tree, or of a variant: tools/diag/build_variants.sh) can be carried to the GPU
# machine and run there as `EPX_SUITE_PARTS=... scripts/gpu_suite.sh OUT`. With a variant NAME,
# its patch (tools/diag/variants/NAME.patch) is applied to this tree, BUILD rebuilt, and the patch
# taken out again.
# Usage: tools/diag/stage_suite.sh OUT BUILD [NAME]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/diag/stage_suite.sh OUT BUILD [NAME]}
build=${2:?usage: tools/diag/stage_suite.sh OUT BUILD [NAME]}
name=${3:-}
tests=(epx_gpu_tests epx_ipc_gpu_tests epx_moe_gpu_tests epx_bad_inputs_gpu_tests epx_fault_rank)
# shellcheck source=tools/diag/variant_patch.sh
source tools/diag/variant_patch.sh
if [ -n "$name" ]; then variant_apply "$name"; fi
cmake --build "$build" -j "$(nproc)" --target epx_cli example_ipc_ranks "${tests[@]}" >/dev/null
mkdir -p "$out/tests"
cp "$build/epx" "$build/example_ipc_ranks" "$out/"
for t in "${tests[@]}"; do cp "$build/tests/$t" "$out/tests/"; done
git rev-parse --short HEAD >"$out/commit"
echo "${name:-head}" >"$out/variant"
variant_undo
if [ -n "$name" ]; then  # the build is left as the tree is
  cmake --build "$build" -j "$(nproc)" --target epx_cli example_ipc_ranks "${tests[@]}" >/dev/null
fi
du -sh "$out"
