#!/usr/bin/env bash
# A/B of builds in one run on a GPU machine: `epx bench` of each build in turn, repeated, so that
# drift of the machine falls on every side alike. Prints the graph one-launch medians per build and
# round, and keeps each run's JSON (OUT_DIR/BUILD_ROUND.json; a name already taken, as by an
# earlier run into the same folder, gets a suffix instead of being overwritten).
# Usage: tools/diag/ab_bench.sh OUT_DIR ROUNDS BUILD... [-- bench flags]
#   e.g. tools/diag/ab_bench.sh ab 2 build-base build-dev -- --backends low_latency --tokens 128,4096
# A BUILD may carry flags of its own after a colon, added to the shared ones for that side only:
#   tools/diag/ab_bench.sh ab 2 build "build:--combine push"
#   (default flags: --backends low_latency --tokens 128,4096 --iters 200 --no-verify)
set -uo pipefail
out=$1 rounds=$2
shift 2
builds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do builds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
flags=("$@")
[ ${#flags[@]} -eq 0 ] && flags=(--backends low_latency --tokens 128,4096 --iters 200 --no-verify)
mkdir -p "$out"
for ((i = 1; i <= rounds; i++)); do
  for spec in "${builds[@]}"; do
    b=${spec%%:*} own=""
    [ "$spec" != "$b" ] && own=${spec#*:}
    name=$(basename "$b")$(echo "$own" | tr -c 'A-Za-z0-9\n' '_' | sed 's/^_*/_/; s/_*$//; s/^_$//')
    echo "=== $name, round $i${own:+ ($own)}"
    json=$out/${name}_$i.json k=2
    while [ -e "$json" ]; do json=$out/${name}_${i}_$k.json; k=$((k + 1)); done
    # shellcheck disable=SC2086  # a side's own flags split at spaces
    timeout 300 "$b/epx" bench "${flags[@]}" $own --json "$json" 2>&1 |
      grep -E "graph one_per_gpu|verify|FAIL|commit" | sed -E 's/.*(commit [0-9a-f]+).*/\1/'
  done
done
