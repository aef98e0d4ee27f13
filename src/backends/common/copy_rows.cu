// epx::copy_rows (include/epx/all2all.hpp): a row gather with zero rows, in 16-, 4- or 1-byte
// words as the pointers, strides and row size allow.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCopyBlocks = 1024;

template <typename Word>
__device__ void copy_row(uint8_t* to, const uint8_t* from, size_t words, bool zero) {
  Word* d = reinterpret_cast<Word*>(to);
  const Word* s = reinterpret_cast<const Word*>(from);
  for (size_t v = threadIdx.x; v < words; v += blockDim.x) d[v] = zero ? Word{} : s[v];
}

// One block per row at a time; `word` (16, 4 or 1) divides every address, stride and the row
// size. One kernel for every word size, so that a profile shows one entry under this name.
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_copy_epilogue_impl(uint8_t* __restrict__ dst, size_t dst_stride,
                                const uint8_t* __restrict__ src, size_t src_stride,
                                size_t row_bytes, int64_t rows, const int64_t* __restrict__ index,
                                const bool* __restrict__ zero, int word) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const bool z = zero != nullptr && zero[i];
    const int64_t from = index == nullptr ? i : index[i];
    uint8_t* to = dst + size_t(i) * dst_stride;
    const uint8_t* in = z ? nullptr : src + size_t(from) * src_stride;
    if (word == 16) {
      copy_row<int4>(to, in, row_bytes / 16, z);
    } else if (word == 4) {
      copy_row<uint32_t>(to, in, row_bytes / 4, z);
    } else {
      copy_row<uint8_t>(to, in, row_bytes, z);
    }
  }
}

}  // namespace

void copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
               size_t row_bytes, int64_t rows, const int64_t* index, const bool* zero,
               cudaStream_t stream) {
  EPX_CHECK(rows >= 0, InputError, "copy_rows rows", rows, ">= 0");
  if (rows == 0 || row_bytes == 0) return;
  EPX_CHECK(dst != nullptr, InputError, "copy_rows dst", "null", "a device pointer");
  EPX_CHECK(src != nullptr, InputError, "copy_rows src", "null", "a device pointer");
  EPX_CHECK(dst_stride >= row_bytes, InputError, "copy_rows dst_stride", dst_stride,
            ">= row_bytes = " + std::to_string(row_bytes));
  EPX_CHECK(src_stride >= row_bytes, InputError, "copy_rows src_stride", src_stride,
            ">= row_bytes = " + std::to_string(row_bytes));
  const auto divides = [&](uintptr_t w) {
    return (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | dst_stride |
            src_stride | row_bytes) %
               w ==
           0;
  };
  const int word = divides(16) ? 16 : divides(4) ? 4 : 1;
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kMaxCopyBlocks));
  dispatch_copy_epilogue_impl<<<blocks, kCopyThreads, 0, stream>>>(
      static_cast<uint8_t*>(dst), dst_stride, static_cast<const uint8_t*>(src), src_stride,
      row_bytes, rows, index, zero, word);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx
