# Sourced by tools/diag/build_variants.sh and stage_suite.sh: applies a variant's patch
# (tools/diag/variants/NAME.patch) to this tree and takes it out again, also on exit.
variant_applied=""
variant_undo() {
  if [ -n "$variant_applied" ]; then git apply -R "$variant_applied"; fi
  variant_applied=""
}
variant_apply() {  # variant_apply NAME: exits when the tree is not clean or the patch does not apply
  local patch=tools/diag/variants/$1.patch
  if ! git diff --quiet -- src include; then
    echo "$0: src/ or include/ has uncommitted changes; commit or stash them first" >&2
    exit 2
  fi
  [ -f "$patch" ] || { echo "$0: no $patch" >&2; exit 2; }
  if ! git apply --check "$patch" 2>/dev/null; then
    echo "$0: $1 does not apply to this tree (base $(sed -n 's/^base: //p' "$patch"))" >&2
    exit 1
  fi
  git apply "$patch"
  variant_applied=$patch
}
trap variant_undo EXIT
