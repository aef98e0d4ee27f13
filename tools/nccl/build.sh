#!/usr/bin/env bash
# Builds NCCL from a source tree for one GPU architecture, with only the functions epx calls
# (all-gather, bf16 reduce-scatter, f32 all-reduce, send/recv), into OUT/lib/libnccl.so.2 and
# OUT/include: a library small enough to carry to a machine without network (about 31 MB for
# sm_90, against 216 MB for the PyPI wheel). epx then builds against OUT/include and loads the
# library through EPX_NCCL_LIBRARY.
# Usage: tools/nccl/build.sh NCCL_SOURCE OUT [ARCH=90]
# e.g. (NCCL 2.30.7, whose NCCL_MULTI_RANK_GPU_ENABLE lets ranks of one node share a GPU):
#   tools/nccl/build.sh ~/src/nccl .nccl230 && EPX_NCCL_LIBRARY=$PWD/.nccl230/lib/libnccl.so.2 ...
set -euo pipefail
src=$(cd "${1:?NCCL_SOURCE: an NCCL source tree}" && pwd)
out=${2:?OUT: where lib/ and include/ go}
arch=${3:-90}
cuda=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d /tmp/epx-nccl.XXXXXX)
trap 'rm -rf "$work"' EXIT
# The CUDA include folder without any NCCL headers in it: a toolkit that ships an older NCCL
# would otherwise shadow the tree's own nccl_device headers.
mkdir -p "$work/cudainc"
for f in "$cuda"/include/*; do
  case $(basename "$f") in nccl*) ;; *) ln -s "$f" "$work/cudainc/";; esac
done
make -C "$src" -j"$(nproc)" src.build BUILDDIR="$work/build" CUDA_HOME="$cuda" \
  CUDA_INC="$work/cudainc" NVCC_GENCODE="-gencode=arch=compute_$arch,code=sm_$arch" \
  ONLY_FUNCS="AllGather * *|ReduceScatter Sum bf16 * *|AllReduce Sum f32 * *|SendRecv"
mkdir -p "$out/lib"
rm -rf "$out/include"
cp -r "$work/build/include" "$out/include"
cp "$(readlink -f "$work/build/lib/libnccl.so.2")" "$out/lib/libnccl.so.2"
grep -h 'define NCCL_\(MAJOR\|MINOR\|PATCH\) ' "$out/include/nccl.h" | tr '\n' ' '
echo "-> $out/lib/libnccl.so.2 ($(du -h "$out/lib/libnccl.so.2" | cut -f1))"
