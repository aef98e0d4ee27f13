#!/usr/bin/env bash
# Builds the `epx` CLI of kernel variants that are not in the library (a variant's GPU suite:
# tools/diag/stage_suite.sh): each is a patch under tools/diag/variants (NAME.patch: a diff against
# the commit on its "base:" line, with what it changes under it), applied to this tree, built in
# BUILD (an existing build of this tree, so that only the files the patch touches recompile), copied
# to OUT/NAME/, and taken out again. NAME `head` is the tree as it is. Runs on the CPU machine;
# carry OUT to the GPU machine and compare the variants there (tools/diag/ht_variants.sh).
# Usage: tools/diag/build_variants.sh OUT BUILD NAME...
#   e.g. tools/diag/build_variants.sh build-var build head ht-meta ht-meta-bulk ht-meta-pipe
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/diag/build_variants.sh OUT BUILD NAME...}
build=${2:?usage: tools/diag/build_variants.sh OUT BUILD NAME...}
shift 2
[ -f "$build/CMakeCache.txt" ] || { echo "build_variants: $build is not a configured build" >&2; exit 2; }
if ! git diff --quiet -- src include; then
  echo "build_variants: src/ or include/ has uncommitted changes; commit or stash them first" >&2
  exit 2
fi
targets=(epx_cli)
applied=""
undo() {
  if [ -n "$applied" ]; then git apply -R "$applied"; fi
  applied=""
}
trap undo EXIT
for name in "$@"; do
  if [ "$name" != head ]; then
    patch=tools/diag/variants/$name.patch
    [ -f "$patch" ] || { echo "build_variants: no $patch" >&2; exit 2; }
    if ! git apply --check "$patch" 2>/dev/null; then
      echo "build_variants: $name does not apply to this tree (base $(sed -n 's/^base: //p' "$patch"))" >&2
      exit 1
    fi
    git apply "$patch"
    applied=$patch
  fi
  echo "=== $name"
  mkdir -p "$out/$name"
  if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >"$out/$name/build.log" 2>&1; then
    grep -E -A3 "error" "$out/$name/build.log" | head -40 >&2
    echo "build_variants: $name did not build (log: $out/$name/build.log)" >&2
    exit 1
  fi
  cp "$build/epx" "$out/$name/epx"
  git rev-parse --short HEAD > "$out/$name/commit"
  undo
done
# The build is left as the tree is.
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
ls -l "$out"/*/epx
