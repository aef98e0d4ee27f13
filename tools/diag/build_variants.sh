#!/usr/bin/env bash
# Builds the `epx` CLI of kernel variants that are not in the library (a variant's GPU suite:
# tools/diag/stage_suite.sh): each is a patch under tools/diag/variants (NAME.patch: a diff against
# the commit on its "base:" line, or with an "on: OTHER" line on top of variant OTHER, with what it
# changes under it), applied to this tree, built in
# BUILD (an existing build of this tree, so that only the files the patch touches recompile), copied
# to OUT/NAME/, and taken out again. NAME `head` is the tree as it is. Runs on the CPU machine;
# carry OUT to the GPU machine and compare the variants there (tools/diag/ht_variants.sh).
# Usage: tools/diag/build_variants.sh OUT BUILD NAME...
#   e.g. tools/diag/build_variants.sh build-var build head my-variant   (tools/diag/variants/my-variant.patch)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/diag/build_variants.sh OUT BUILD NAME...}
build=${2:?usage: tools/diag/build_variants.sh OUT BUILD NAME...}
shift 2
[ -f "$build/CMakeCache.txt" ] || { echo "build_variants: $build is not a configured build" >&2; exit 2; }
targets=(epx_cli)
# shellcheck source=tools/diag/variant_patch.sh
source tools/diag/variant_patch.sh
for name in "$@"; do
  if [ "$name" != head ]; then variant_apply "$name"; fi
  echo "=== $name"
  mkdir -p "$out/$name"
  if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >"$out/$name/build.log" 2>&1; then
    grep -E -A3 "error" "$out/$name/build.log" | head -40 >&2
    echo "build_variants: $name did not build (log: $out/$name/build.log)" >&2
    exit 1
  fi
  cp "$build/epx" "$out/$name/epx"
  git rev-parse --short HEAD > "$out/$name/commit"
  variant_undo
done
# The build is left as the tree is.
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
ls -l "$out"/*/epx
