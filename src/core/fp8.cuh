#pragma once
// fp8 e4m3 1x128 block quantisation on the device, shared by every kernel that quantises. The
// rule is ref::quantize_fp8's (src/reference/numerics.cpp), bit for bit: over one block of
// kFp8BlockSize values, a = amax > 0 ? amax : 1 (amax = max |x|, NaN never wins), scale = a / 448,
// q = e4m3(x * (448 / a)) rounded to nearest even and saturated to +-448 (NaN -> 0x7F), all in
// f32 with IEEE rounding; or, with round_scale, a power-of-two scale (fp8_block_scale_pow2).
// Included by .cu files only.

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "epx/config.hpp"

namespace epx::dev {

inline constexpr float kFp8E4m3Max = 448.0f;  // largest finite e4m3 value

// The scale of a block whose largest magnitude is `amax`, and its reciprocal that quantises.
struct Fp8BlockScale {
  float scale;  // dequantised value = fp8 value * scale
  float inv;    // fp8 value = e4m3(value * inv)
};
__device__ __forceinline__ Fp8BlockScale fp8_block_scale(float amax) {
  const float a = amax > 0.0f ? amax : 1.0f;
  return {a / kFp8E4m3Max, kFp8E4m3Max / a};
}

// EpConfig::round_scale's rule (ref::pow2_fp8_scale): scale = 2^e, e = ceil(log2(t)) of
// t = max(amax, 1e-4) * f32(1/448), read off t's bits (t is normal or infinite); inv = 1 / scale,
// exact (0 for an infinite amax, as the reference).
inline constexpr float kFp8Pow2AmaxFloor = 1e-4f;
__device__ __forceinline__ Fp8BlockScale fp8_block_scale_pow2(float amax) {
  const float t = fmaxf(amax, kFp8Pow2AmaxFloor) * (1.0f / kFp8E4m3Max);
  const uint32_t bits = __float_as_uint(t);
  const int e = int((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0 ? 1 : 0);
  const float scale = __uint_as_float(uint32_t(127 + e) << 23);
  return {scale, __frcp_rn(scale)};
}

// Two values to e4m3 (cvt.rn.satfinite.e4m3x2.f32): `lo` in the low byte.
__device__ __forceinline__ uint16_t fp8x2_e4m3(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// One lane's kPerLane fp8 bytes, in order: 4 -> uint32_t, 8 -> uint2, 16 -> uint4 (one 16-byte
// store: on the H200 a dispatch-shaped scatter of fp8 rows runs 5 % faster with 16-byte stores
// than with 8-byte ones, tools/diag/scatter_probe.cu).
template <int kPerLane>
using Fp8Lane = std::conditional_t<kPerLane == 4, uint32_t,
                                   std::conditional_t<kPerLane == 8, uint2, uint4>>;

// Quantises a 1x128 block spread over kFp8BlockSize / kPerLane consecutive lanes, each holding
// kPerLane consecutive values v (lanes without data pass zeros). Every lane of the warp must
// call. Returns this lane's bytes; `scale` receives the block's scale (in every lane), a power of
// two with `round_scale` (warp-uniform; no default, so that no caller forgets the config's).
template <int kPerLane>
__device__ __forceinline__ Fp8Lane<kPerLane> quantize_fp8_block(const float (&v)[kPerLane],
                                                                float& scale,
                                                                bool round_scale) {
  static_assert(kPerLane == 4 || kPerLane == 8 || kPerLane == 16,
                "a lane packs its bytes into 4, 8 or 16 bytes");
  constexpr int kLanes = kFp8BlockSize / kPerLane;
  static_assert(kLanes * kPerLane == kFp8BlockSize && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a block is a power-of-two group of lanes within one warp");
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));  // fmaxf drops NaN
#pragma unroll
  for (int off = kLanes / 2; off >= 1; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const Fp8BlockScale s = round_scale ? fp8_block_scale_pow2(amax) : fp8_block_scale(amax);
  scale = s.scale;
  Fp8Lane<kPerLane> out;
  uint16_t* pairs = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i)
    pairs[i] = fp8x2_e4m3(v[2 * i] * s.inv, v[2 * i + 1] * s.inv);
  return out;
}

}  // namespace epx::dev
