# Sourced by tools/diag/build_variants.sh and stage_suite.sh: applies a variant's patch
# (tools/diag/variants/NAME.patch) to this tree and takes it out again, also on exit. A patch whose
# header has an "on: OTHER" line is a diff on top of variant OTHER, which is applied first.
variant_applied=()
variant_undo() {
  local i
  for ((i = ${#variant_applied[@]} - 1; i >= 0; i--)); do git apply -R "${variant_applied[$i]}"; done
  variant_applied=()
}
variant_apply_one() {  # variant_apply_one NAME: its parent (on:) first, then its own patch
  local patch=tools/diag/variants/$1.patch parent
  [ -f "$patch" ] || { echo "$0: no $patch" >&2; exit 2; }
  parent=$(sed -n '1,3s/^on: //p' "$patch")
  if [ -n "$parent" ]; then variant_apply_one "$parent"; fi
  if ! git apply --check "$patch" 2>/dev/null; then
    echo "$0: $1 does not apply to this tree (base $(sed -n 's/^base: //p' "$patch"))" >&2
    exit 1
  fi
  git apply "$patch"
  variant_applied+=("$patch")
}
variant_apply() {  # variant_apply NAME: exits when the tree is not clean or a patch does not apply
  if ! git diff --quiet -- src include; then
    echo "$0: src/ or include/ has uncommitted changes; commit or stash them first" >&2
    exit 2
  fi
  variant_apply_one "$1"
}
trap variant_undo EXIT
