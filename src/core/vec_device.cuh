#pragma once
// Device helpers for moving rows, shared by every backend's kernels: warp constants, addressing
// inside a rank's buffer, rank masks, and bf16 vectors of 8 elements in 16 bytes. Included by
// .cu files only.

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace epx::dev {

inline constexpr int kWarpSize = 32;
inline constexpr uint32_t kFullWarp = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T* at(uint8_t* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Lowest rank of a non-empty rank mask.
__device__ __forceinline__ int lowest_rank(uint64_t mask) {
  return __ffsll(static_cast<long long>(mask)) - 1;
}

__device__ __forceinline__ void bf16x8_to_float(const int4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float (&f)[8]) {
  bf16x8_to_float(*reinterpret_cast<const int4*>(p), f);
}

// Rounds 8 f32 sums to bf16 once each and stores them as one 16-byte vector.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const float (&acc)[8]) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<int4*>(dst) = o;
}

}  // namespace epx::dev
