#!/usr/bin/env bash
# Where ptxas spills, by source line: compiles one .cu file of the tree for sm_90 (as the library
# build does, with line info), disassembles it, and prints for each kernel its registers, its spill
# bytes and every local-memory load or store (LDL / STL) with the source line it belongs to. A
# spill at a per-batch or set-up line costs nothing; one inside a per-vector loop is worth a
# rewrite. Runs on the CPU machine (no GPU needed).
# Usage: tools/diag/spill_sites.sh FILE.cu [KERNEL-REGEX] [extra nvcc flags...]
#   e.g. tools/diag/spill_sites.sh src/backends/high_throughput/ht_dispatch.cu transfer
#        tools/diag/spill_sites.sh src/backends/peer/combine.cu . -DEPX_MEASUREMENT=1
# nvdisasm comes from the CUDA toolkit when it has one, else from PyPI (nvidia-cuda-nvdisasm),
# installed once under ${XDG_CACHE_HOME:-~/.cache}/epx-diag.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: tools/diag/spill_sites.sh FILE.cu [KERNEL-REGEX] [nvcc flags...]}
pattern=${2:-.}
shift $(($# < 2 ? $# : 2))
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
nvdisasm=$(command -v nvdisasm || true)
[ -z "$nvdisasm" ] && [ -x "$(dirname "$nvcc")/nvdisasm" ] && nvdisasm=$(dirname "$nvcc")/nvdisasm
if [ -z "$nvdisasm" ]; then
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/epx-diag
  nvdisasm=$({ find "$cache" -name nvdisasm -type f 2>/dev/null || true; } | head -n 1)
  if [ -z "$nvdisasm" ]; then
    python3 -m pip install --quiet --no-deps --root-user-action=ignore --target "$cache" \
      nvidia-cuda-nvdisasm >&2
    nvdisasm=$(find "$cache" -name nvdisasm -type f | head -n 1)
  fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$nvcc" -std=c++20 -O3 -DNDEBUG -DFMT_HEADER_ONLY=1 --expt-relaxed-constexpr -lineinfo \
  -arch=sm_90 -cubin -Iinclude -Isrc -Xptxas -v "$@" -x cu "$src" -o "$work/k.cubin" \
  2>"$work/ptxas.txt"
"$nvdisasm" -g -c "$work/k.cubin" >"$work/k.sass"
# ptxas's summary per kernel: "Compiling entry function 'NAME'", then its spill and register lines.
awk '/Compiling entry function/ { match($0, /'\''[^'\'']+'\''/); name = substr($0, RSTART + 1, RLENGTH - 2) }
     /spill stores/ && name != "" { spill[name] = $0 }
     /Used [0-9]+ registers/ && name != "" { match($0, /Used [0-9]+ registers/); regs[name] = substr($0, RSTART, RLENGTH) }
     END { for (n in regs) print n "\t" regs[n] "\t" spill[n] }' "$work/ptxas.txt" |
  sed -E 's/ +/ /g' >"$work/summary.txt"
# Each LDL / STL with the last source line the disassembly named before it.
awk '/^\/\/-+ \.text\./ { name = $2; sub(/^\.text\./, "", name) }
     /\/\/## File/ { match($0, /"[^"]+"/); file = substr($0, RSTART + 1, RLENGTH - 2); sub(/.*\//, "", file)
                    match($0, /line [0-9]+/); line = substr($0, RSTART + 5, RLENGTH - 5) }
     /[[:space:]](LDL|STL)(\.[A-Z0-9.]+)?[[:space:]]/ { op = $0; sub(/.*\*\/[[:space:]]*/, "", op); sub(/[[:space:]]*(;|\(\*).*$/, "", op); sub(/[[:space:]]+$/, "", op)
                    print name "\t" file ":" line "\t" op }' "$work/k.sass" >"$work/sites.txt"
while IFS=$'\t' read -r name regs spill; do
  pretty=$(echo "$name" | c++filt | sed -E 's/\(anonymous namespace\):://g; s/epx::[a-z]+:://g')
  echo "$pretty" | grep -Eq -- "$pattern" || continue
  echo "== $pretty"
  echo "   $regs,$spill"
  grep -F "$name	" "$work/sites.txt" | cut -f2- | sort | uniq -c | sort -k2,2V | sed 's/^/   /' || true
done <"$work/summary.txt"
