// bf16 and fp8 e4m3fn conversions and 1x128 block quantisation, bit-exact with the kernels
// (cvt.rn.bf16.f32 and cvt.rn.satfinite.e4m3x2.f32).

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>

#include "reference/reference.hpp"

namespace epx::ref {

uint16_t bf16_from_float(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  // NaN -> the canonical quiet NaN, as cvt.rn.bf16.f32 and __float2bfloat16_rn produce.
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  // Round to nearest even on the 16 dropped bits; a carry walks into the exponent, which is
  // right (the largest finite values round to infinity, as IEEE says).
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint8_t fp8_from_float(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7F;  // NaN, whatever its sign (satfinite gives 0x7F)
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::bit_cast<float>(abs);
  // e4m3fn has no infinity; with satfinite everything from 448 up (inf included) is 448 = 0x7E.
  if (a >= kFp8Max) return sign | 0x7E;
  const int exp = static_cast<int>(abs >> 23) - 127;  // unbiased float exponent
  if (exp < -6) {
    // Below the smallest normal 2^-6 the grid is uniform with step 2^-9 (subnormals). a * 2^9
    // is exact and < 8; round it to the nearest integer, ties to even. A result of 8 is the
    // encoding of 2^-6 (exponent field 1, mantissa 0), so the code is the integer itself.
    const float scaled = a * 512.0f;
    const float lower = std::floor(scaled);
    const float frac = scaled - lower;
    int q = static_cast<int>(lower);
    if (frac > 0.5f || (frac == 0.5f && (q & 1) != 0)) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: keep 3 of the 23 mantissa bits, round to nearest even; a carry out of the mantissa
  // increments the exponent field, which is the correct next value.
  const uint32_t mant = abs & 0x7FFFFFu;
  const uint32_t kept = mant >> 20;
  const uint32_t rest = mant & 0xFFFFFu;
  constexpr uint32_t kHalf = 0x80000u;
  uint32_t code = (static_cast<uint32_t>(exp + 7) << 3) | kept;
  if (rest > kHalf || (rest == kHalf && (kept & 1u) != 0)) ++code;
  code = std::min<uint32_t>(code, 0x7E);  // a < 448 cannot round past 448; kept for safety
  return sign | static_cast<uint8_t>(code);
}

float fp8_to_float(uint8_t q) {
  const bool negative = (q & 0x80u) != 0;
  const int exp_field = (q >> 3) & 0xF;
  const int mant = q & 0x7;
  float v;
  if (exp_field == 0xF && mant == 0x7) {
    v = std::nanf("");
  } else if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant * 2^-9
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp_field - 7);
  }
  return negative ? -v : v;
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = fp8_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

float pow2_fp8_scale(float amax) {
  const float t = std::max(amax, kFp8Pow2AmaxFloor) * (1.0f / kFp8Max);
  const uint32_t bits = std::bit_cast<uint32_t>(t);
  // ceil(log2(t)) of a normal t: its exponent, plus one unless t is a power of two
  const int e = int((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0 ? 1 : 0);
  return std::ldexp(1.0f, e);
}

void quantize_fp8(const uint16_t* x, int rows, int hidden, uint8_t* q, float* scales,
                  bool round_scale) {
  const int groups = hidden / kFp8BlockSize;
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < groups; ++g) {
      const uint16_t* in = x + static_cast<int64_t>(r) * hidden + g * kFp8BlockSize;
      uint8_t* out = q + static_cast<int64_t>(r) * hidden + g * kFp8BlockSize;
      // NaN never wins a comparison, so it does not become the amax (fmaxf does the same).
      float amax = 0.0f;
      for (int i = 0; i < kFp8BlockSize; ++i)
        amax = std::max(amax, std::fabs(bf16_to_float(in[i])));
      const float a = amax > 0.0f ? amax : 1.0f;
      const float scale = round_scale ? pow2_fp8_scale(amax) : a / kFp8Max;
      const float inv = round_scale ? 1.0f / scale : kFp8Max / a;  // (exact for a power of two)
      scales[static_cast<int64_t>(r) * groups + g] = scale;
      for (int i = 0; i < kFp8BlockSize; ++i) out[i] = fp8_from_float(bf16_to_float(in[i]) * inv);
    }
  }
}

void dequantize_fp8(const uint8_t* q, const float* scales, int rows, int hidden, float* out) {
  const int groups = hidden / kFp8BlockSize;
  const std::array<float, 256>& value = fp8_table();
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) {
      const int64_t i = static_cast<int64_t>(r) * hidden + h;
      out[i] = value[q[i]] * scales[static_cast<int64_t>(r) * groups + h / kFp8BlockSize];
    }
  }
}

}  // namespace epx::ref
