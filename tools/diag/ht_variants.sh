#!/usr/bin/env bash
# On a GPU machine: checks and compares variants of the high_throughput dispatch built by
# tools/diag/build_variants.sh (DIR/NAME/epx). First each variant's `epx check` over odd shapes
# (every output against the CPU reference: world 8 one launch with CUDA graphs, mixed token counts
# with 0 and 1; bf16 at world 4; fp8 input with int64 ids at H 2560; column scales with
# power-of-two scales, per-rank launches; top-2 of 48 experts at world 8: more ranks than a token's
# lanes, 6 experts a rank; top-1), one PASS / FAIL line each to OUT/check.txt; then an A/B
# (tools/diag/ab_bench.sh, ROUNDS rounds, each round every variant once) of the variants that
# passed every check, at 4096 and 16384 tokens per rank, worst-case areas, to OUT/ab.txt and
# OUT/ab/*.json. With EPX_AB_ONLY="NAME..." the checks are skipped and only those are compared.
# Usage: tools/diag/ht_variants.sh DIR OUT [ROUNDS]   (ROUNDS default 2)
# EPX_AB_TOKENS (default 4096,16384), EPX_AB_TIMEOUT_S (default 360: the A/B stops there).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
dir=${1:?usage: tools/diag/ht_variants.sh DIR OUT [ROUNDS]}
out=${2:?usage: tools/diag/ht_variants.sh DIR OUT [ROUNDS]}
rounds=${3:-2}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
mkdir -p "$out/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
cases=(
  "r1_w8_graph|--one-launch --worst-case-output --graph 3 --tokens 4096,1000,17,0,333,4095,1,2048"
  "bf16_w4|--dtype bf16 --world 4 --one-launch --worst-case-output --tokens 33,1,0,700"
  "fp8_h2560_ids64|--dtype fp8 --hidden 2560 --experts 96 --topk 6 --ids64 --world 4 --tokens 300,0,5,129"
  "colscale_round_perrank|--scale-layout column --round-scale --tokens 257,3,0,64,1,100,31,200"
  "topk2_e48_w8_graph|--topk 2 --experts 48 --one-launch --worst-case-output --graph 2 --tokens 100,7,0,33,1,200,64,5"
  "topk1_e16_w8|--topk 1 --experts 16 --one-launch --tokens 40,1,0,77,3,64,9,100"
  "perrank_worst_mixed|--worst-case-output --graph 4 --mixed --tokens 300,0,17,64,1,128,5,200"
)
if [ -n "${EPX_AB_ONLY:-}" ]; then
  passed=()
  for name in $EPX_AB_ONLY; do passed+=("$dir/$name"); done
else
  # One variant's cases in turn (a PASS / FAIL line each); its name in OUT/passed when all pass.
  check_variant() {
    local v=$1 name ok=1 c label flags log rc
    name=$(basename "$v")
    for c in "${cases[@]}"; do
      label=${c%%|*} flags=${c#*|}
      log=$out/logs/${name}_$label.log
      # shellcheck disable=SC2086  # the case's flags split at spaces
      timeout 150 "$v/epx" check --backend high_throughput $flags >"$log" 2>&1
      rc=$?
      if [ $rc = 0 ]; then
        echo "PASS $name $label" | tee -a "$out/check.txt"
      else
        ok=0
        echo "FAIL $name $label (exit $rc): $(tail -n 2 "$log" | tr "\n" " ")" | tee -a "$out/check.txt"
      fi
    done
    [ $ok = 1 ] && echo "$name" >>"$out/passed"
  }
  # EPX_CHECK_JOBS variants at once (default 3: each holds a world's worst-case areas on the GPU).
  : >"$out/passed"
  for v in "$dir"/*/; do
    [ -x "$v/epx" ] || continue
    while [ "$(jobs -rp | wc -l)" -ge "${EPX_CHECK_JOBS:-3}" ]; do wait -n; done
    check_variant "${v%/}" &
  done
  wait
  passed=()
  for name in $(sort "$out/passed"); do passed+=("$dir/$name"); done
fi
[ ${#passed[@]} -eq 0 ] && { echo "no variant passed its checks"; exit 1; }
timeout "${EPX_AB_TIMEOUT_S:-360}" tools/diag/ab_bench.sh "$out/ab" "$rounds" "${passed[@]}" -- \
  --backends high_throughput --worst-case-output --tokens "${EPX_AB_TOKENS:-4096,16384}" \
  --iters 50 --no-verify | tee "$out/ab.txt"
