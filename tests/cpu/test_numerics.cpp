// bf16 / fp8 e4m3fn conversions and 1x128 block quantisation of the CPU reference.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "reference/reference.hpp"

namespace epx::ref {
namespace {

float bits_to_float(uint32_t u) {
  return std::bit_cast<float>(u);
}
float pow2(int e) {
  return std::ldexp(1.0f, e);
}

// ---- bf16 -----------------------------------------------------------------------------------

TEST(Bf16, HandPickedValues) {
  EXPECT_EQ(bf16_from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(-2.0f), 0xC000);
  EXPECT_EQ(bf16_from_float(448.0f), 0x43E0);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_from_float(1.0f + pow2(-8)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(bf16_from_float(1.0f + 3 * pow2(-8)), 0x3F82);
  // Just above the halfway point rounds up.
  EXPECT_EQ(bf16_from_float(1.0f + pow2(-8) + pow2(-20)), 0x3F81);
  // Just below 1 + 2^-7's upper half stays.
  EXPECT_EQ(bf16_from_float(1.0f + pow2(-7) + pow2(-9)), 0x3F81);
  // Overflow rounds to infinity; infinities stay.
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_from_float(-std::numeric_limits<float>::infinity()), 0xFF80);
  // NaN becomes the canonical quiet NaN 0x7FFF (cvt.rn.bf16.f32).
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
  EXPECT_EQ(bf16_from_float(-std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
  EXPECT_EQ(bf16_from_float(bits_to_float(0x7F800001u)), 0x7FFF);  // signalling NaN
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7FFF)));
  // Subnormals: the smallest bf16 subnormal is 2^-133; float subnormals below half of it
  // flush to zero, above it round to it.
  EXPECT_EQ(bf16_to_float(0x0001), pow2(-133));
  EXPECT_EQ(bf16_from_float(pow2(-133)), 0x0001);
  EXPECT_EQ(bf16_from_float(pow2(-134)), 0x0000);               // tie -> even (0)
  EXPECT_EQ(bf16_from_float(pow2(-134) + pow2(-149)), 0x0001);  // above the tie
  EXPECT_EQ(bf16_from_float(-pow2(-135)), 0x8000);
  EXPECT_EQ(bf16_from_float(3 * pow2(-134)), 0x0002);  // tie 1|2 -> 2
  // The largest subnormal rounds up into the smallest normal.
  EXPECT_EQ(bf16_from_float(bits_to_float(0x007FFFFFu)), 0x0080);
}

TEST(Bf16, EveryValueRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(bf16_from_float(f), b) << std::hex << b;
  }
}

// Independent oracle: the result is the nearer of the two bf16 neighbours (truncation and the
// next value away from zero), the even one on a tie; past the largest finite value that next
// value is infinity.
TEST(Bf16, RandomFloatsRoundToNearestEven) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    if ((u & 0x7F800000u) == 0x7F800000u) continue;   // skip inf/NaN
    if (i % 4 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  // exact ties, a quarter of the time
    const float f = bits_to_float(u);
    const uint16_t down = static_cast<uint16_t>(u >> 16);
    const uint16_t up = static_cast<uint16_t>(down + 1);
    // The step to the next magnitude is that of down's binade (2^-133 among subnormals); in
    // double the step above the largest finite bf16 is 2^128 - max, where IEEE overflows to inf.
    const int biased = (down >> 7) & 0xFF;
    const double step = std::ldexp(1.0, biased == 0 ? -133 : biased - 127 - 7);
    const double dv = bf16_to_float(down);
    const double uv = std::signbit(f) ? dv - step : dv + step;
    const double df = std::fabs(static_cast<double>(f) - dv);
    const double uf = std::fabs(uv - f);
    const uint16_t want = df < uf ? down : uf < df ? up : ((down & 1) == 0 ? down : up);
    ASSERT_EQ(bf16_from_float(f), want) << std::hexfloat << f;
  }
}

// ---- fp8 e4m3fn -------------------------------------------------------------------------------

TEST(Fp8, HandPickedValues) {
  EXPECT_EQ(fp8_from_float(0.0f), 0x00);
  EXPECT_EQ(fp8_from_float(-0.0f), 0x80);
  EXPECT_EQ(fp8_from_float(1.0f), 0x38);
  EXPECT_EQ(fp8_from_float(-1.5f), 0xBC);
  EXPECT_EQ(fp8_from_float(240.0f), 0x77);
  EXPECT_EQ(fp8_from_float(256.0f), 0x78);
  // The largest finite value, and saturation above it (satfinite, not NaN).
  EXPECT_EQ(fp8_from_float(448.0f), 0x7E);
  EXPECT_EQ(fp8_from_float(449.0f), 0x7E);
  EXPECT_EQ(fp8_from_float(464.0f), 0x7E);  // the tie with the (absent) next value 480
  EXPECT_EQ(fp8_from_float(465.0f), 0x7E);
  EXPECT_EQ(fp8_from_float(1e9f), 0x7E);
  EXPECT_EQ(fp8_from_float(-1e9f), 0xFE);
  EXPECT_EQ(fp8_from_float(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fp8_from_float(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(fp8_from_float(std::numeric_limits<float>::max()), 0x7E);
  // NaN -> 0x7F whatever the sign.
  EXPECT_EQ(fp8_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(fp8_from_float(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_TRUE(std::isnan(fp8_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_to_float(0xFF)));
  // Ties between normals go to the even mantissa.
  EXPECT_EQ(fp8_from_float(1.0625f), 0x38);  // 1 | 1.125 -> 1
  EXPECT_EQ(fp8_from_float(1.1875f), 0x3A);  // 1.125 | 1.25 -> 1.25
  EXPECT_EQ(fp8_from_float(1.0625f + pow2(-12)), 0x39);
  EXPECT_EQ(fp8_from_float(416.0f), 0x7D);  // 1.625 * 2^8, exact
  EXPECT_EQ(fp8_from_float(432.0f), 0x7E);  // tie 416 | 448 -> 448 (even mantissa 110)
  EXPECT_EQ(fp8_from_float(400.0f), 0x7C);  // tie 384 | 416 -> 384 (even mantissa 100)
  // 15.5 is halfway between 15 (odd mantissa 111 at exponent 3) and 16: goes up to 16.
  EXPECT_EQ(fp8_from_float(15.5f), 0x58);
  // Smallest normal 2^-6 and the subnormal grid of step 2^-9.
  EXPECT_EQ(fp8_from_float(pow2(-6)), 0x08);
  EXPECT_EQ(fp8_from_float(pow2(-9)), 0x01);
  EXPECT_EQ(fp8_from_float(-pow2(-9)), 0x81);
  EXPECT_EQ(fp8_from_float(7 * pow2(-9)), 0x07);
  EXPECT_EQ(fp8_from_float(pow2(-10)), 0x00);              // tie 0 | 1 -> 0
  EXPECT_EQ(fp8_from_float(pow2(-10) + pow2(-20)), 0x01);  // just above the tie
  EXPECT_EQ(fp8_from_float(3 * pow2(-10)), 0x02);          // tie 1 | 2 -> 2
  EXPECT_EQ(fp8_from_float(15 * pow2(-10)), 0x08);         // tie 7 | 8 -> 8 = 2^-6
  EXPECT_EQ(fp8_from_float(-pow2(-11)), 0x80);             // underflows to -0
  EXPECT_EQ(fp8_from_float(bits_to_float(1u)), 0x00);      // float subnormal
  EXPECT_EQ(fp8_to_float(0x01), pow2(-9));
  EXPECT_EQ(fp8_to_float(0x07), 7 * pow2(-9));
  EXPECT_EQ(fp8_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_to_float(0xFE), -448.0f);
  EXPECT_EQ(fp8_to_float(0x38), 1.0f);
}

TEST(Fp8, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const float f = fp8_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_EQ(fp8_from_float(f), 0x7F);
      continue;
    }
    EXPECT_EQ(fp8_from_float(f), c) << c;
    if (c > 0 && c < 0x7E) {
      EXPECT_LT(f, fp8_to_float(static_cast<uint8_t>(c + 1)));  // monotone
    }
  }
}

// Independent oracle: search all 127 finite non-negative codes for the nearest one; a tie goes
// to the code with an even mantissa (equivalently an even code). Values >= 448 saturate.
uint8_t nearest_fp8_by_search(float f) {
  const float a = std::fabs(f);
  uint8_t best = 0;
  double best_d = std::fabs(static_cast<double>(a));
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(static_cast<double>(a) - fp8_to_float(static_cast<uint8_t>(c)));
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_d = d;
    }
  }
  if (a >= 448.0f) best = 0x7E;
  return std::signbit(f) ? static_cast<uint8_t>(best | 0x80) : best;
}

TEST(Fp8, MatchesNearestEvenSearch) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  std::vector<float> values;
  for (int i = 0; i < 20000; ++i) {
    const float mag = std::exp2(exponent(rng));
    values.push_back((rng() & 1) ? mag : -mag);
  }
  // Every midpoint between neighbouring codes, and just either side of it.
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = fp8_to_float(static_cast<uint8_t>(c));
    const float hi = fp8_to_float(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: both are short in binary
    values.insert(values.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), -mid});
  }
  for (float f : values) {
    ASSERT_EQ(fp8_from_float(f), nearest_fp8_by_search(f)) << std::hexfloat << f;
  }
}

// ---- 1x128 block quantisation ----------------------------------------------------------------

TEST(Quantize, ZeroBlockUsesScaleOf1Over448) {
  std::vector<uint16_t> x(256, 0);
  x[200] = bf16_from_float(-0.0f);
  std::vector<uint8_t> q(256, 0xAA);
  std::vector<float> s(2);
  quantize_fp8(x.data(), 1, 256, q.data(), s.data());
  EXPECT_EQ(s[0], 1.0f / 448.0f);
  EXPECT_EQ(s[1], 1.0f / 448.0f);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(q[i], i == 200 ? 0x80 : 0x00) << i;
}

TEST(Quantize, HandComputedBlock) {
  // Block amax 448 gives scale 1 and q = fp8(x); block amax 2 gives scale 2/448 and q = fp8(224x).
  std::vector<uint16_t> x(256, 0);
  x[0] = bf16_from_float(448.0f);
  x[1] = bf16_from_float(-3.0f);
  x[2] = bf16_from_float(1.0625f);  // a tie at scale 1 -> 1.0
  x[128] = bf16_from_float(-2.0f);
  x[129] = bf16_from_float(0.5f);
  x[130] = bf16_from_float(pow2(-14));  // 224 * 2^-14 = 0.01367 -> subnormal 7 * 2^-9
  std::vector<uint8_t> q(256);
  std::vector<float> s(2);
  quantize_fp8(x.data(), 1, 256, q.data(), s.data());
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], fp8_from_float(-3.0f));
  EXPECT_EQ(q[2], 0x38);
  EXPECT_EQ(s[1], 2.0f / 448.0f);
  EXPECT_EQ(q[128], 0xFE);                    // -448
  EXPECT_EQ(q[129], fp8_from_float(112.0f));  // 0.5 * 224
  EXPECT_EQ(q[130], 0x07);
  std::vector<float> out(256);
  dequantize_fp8(q.data(), s.data(), 1, 256, out.data());
  EXPECT_EQ(out[0], 448.0f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[128], -448.0f * (2.0f / 448.0f));
  EXPECT_EQ(out[129], fp8_to_float(q[129]) * (2.0f / 448.0f));
}

TEST(Quantize, FollowsTheStatedFormula) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int rows = 5, hidden = 512;
  std::vector<uint16_t> x(rows * hidden);
  for (auto& v : x) v = bf16_from_float(normal(rng) * 3.0f);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(rows * hidden / 128);
  quantize_fp8(x.data(), rows, hidden, q.data(), s.data());
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < hidden / 128; ++g) {
      float amax = 0;
      for (int i = 0; i < 128; ++i)
        amax = std::max(amax, std::fabs(bf16_to_float(x[r * hidden + g * 128 + i])));
      ASSERT_EQ(s[r * 4 + g], amax / 448.0f);
      for (int i = 0; i < 128; ++i) {
        const int j = r * hidden + g * 128 + i;
        ASSERT_EQ(q[j], fp8_from_float(bf16_to_float(x[j]) * (448.0f / amax)));
      }
    }
  }
}

// Error bound used here. With inv = 448/a and y = x*inv, fp8 rounding gives |q - y| <= 2^-4 |y|
// for |y| >= 2^-6 (4 significant bits) and <= 2^-10 below that (subnormal step 2^-9). Back in
// x units, |dequant - x| <= 2^-4 |x| + 2^-10 * scale, plus a few f32 ulps of amax for the
// multiplications (we allow 2^-20 * amax). This implies the looser |dequant - x| <= 2^-4 * amax.
TEST(Quantize, ErrorWithinTheFp8Bound) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const int hidden = 128 * (1 + trial % 4);
    const float magnitude = std::exp2(static_cast<float>(trial % 40) - 20.0f);
    std::vector<uint16_t> x(hidden);
    for (auto& v : x) {
      float f = normal(rng) * magnitude;
      if (rng() % 97 == 0) f *= 20.0f;  // outliers
      if (rng() % 13 == 0) f *= 1e-4f;  // values deep in the subnormal range of the block
      v = bf16_from_float(f);
    }
    std::vector<uint8_t> q(hidden);
    std::vector<float> s(hidden / 128);
    std::vector<float> back(hidden);
    quantize_fp8(x.data(), 1, hidden, q.data(), s.data());
    dequantize_fp8(q.data(), s.data(), 1, hidden, back.data());
    for (int g = 0; g < hidden / 128; ++g) {
      float amax = 0;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16_to_float(x[g * 128 + i])));
      for (int i = 0; i < 128; ++i) {
        const float xi = bf16_to_float(x[g * 128 + i]);
        const double err = std::fabs(static_cast<double>(back[g * 128 + i]) - xi);
        const double bound =
            std::ldexp(std::fabs(xi), -4) + std::ldexp(s[g], -10) + std::ldexp(amax, -20);
        ASSERT_LE(err, bound) << "trial " << trial << " x " << xi << " amax " << amax;
        ASSERT_LE(err, std::ldexp(amax, -4) * (1 + 1e-6));
        ASSERT_NE(q[g * 128 + i] & 0x7F, 0x7F) << "no NaN codes for finite input";
      }
    }
  }
}

// round_scale (DeepEP's rule): the scale is the power of two at or above amax / 448, amax at
// least 1e-4; hand-computed blocks.
TEST(Quantize, RoundScaleHandComputed) {
  EXPECT_EQ(pow2_fp8_scale(448.0f), 1.0f);             // amax / 448 = 1 exactly
  EXPECT_EQ(pow2_fp8_scale(449.0f), 2.0f);             // just above: up to 2
  EXPECT_EQ(pow2_fp8_scale(224.0f), 0.5f);             // 0.5 exactly
  EXPECT_EQ(pow2_fp8_scale(3.0f), pow2(-7));           // 3 / 448 = 0.0067 in (2^-8, 2^-7]
  EXPECT_EQ(pow2_fp8_scale(0.0f), pow2(-22));          // 1e-4 / 448 = 2.2e-7 in (2^-23, 2^-22]
  EXPECT_EQ(pow2_fp8_scale(1e-6f), pow2(-22));         // below the floor: as 1e-4
  std::vector<uint16_t> x(256, 0);
  x[0] = bf16_from_float(3.0f);
  x[1] = bf16_from_float(-1.5f);
  x[128] = bf16_from_float(448.0f);
  x[129] = bf16_from_float(1.0625f);  // a tie at scale 1 -> 1.0
  std::vector<uint8_t> q(256);
  std::vector<float> s(2);
  quantize_fp8(x.data(), 1, 256, q.data(), s.data(), /*round_scale=*/true);
  EXPECT_EQ(s[0], pow2(-7));
  EXPECT_EQ(q[0], fp8_from_float(384.0f));    // 3 * 128
  EXPECT_EQ(q[1], fp8_from_float(-192.0f));   // -1.5 * 128
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(q[128], 0x7E);
  EXPECT_EQ(q[129], 0x38);
  // Every scale a power of two and every value within the fp8 bound at that scale.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> y(128 * 64);
  for (size_t i = 0; i < y.size(); ++i)
    y[i] = bf16_from_float(normal(rng) * std::exp2(float(int(i / 128) % 30) - 15.0f));
  std::vector<uint8_t> qy(y.size());
  std::vector<float> sy(64), back(y.size());
  quantize_fp8(y.data(), 1, int(y.size()), qy.data(), sy.data(), true);
  dequantize_fp8(qy.data(), sy.data(), 1, int(y.size()), back.data());
  for (int g = 0; g < 64; ++g) {
    int e = 0;
    ASSERT_EQ(std::frexp(sy[g], &e), 0.5f) << g;
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16_to_float(y[g * 128 + i])));
    ASSERT_EQ(sy[g], pow2_fp8_scale(amax)) << g;
    ASSERT_LE(amax / sy[g], 448.0f) << g;
    for (int i = 0; i < 128; ++i) {
      const float xi = bf16_to_float(y[g * 128 + i]);
      ASSERT_EQ(qy[g * 128 + i], fp8_from_float(xi / sy[g])) << g << " " << i;
      ASSERT_LE(std::fabs(back[g * 128 + i] - xi), std::ldexp(std::fabs(xi), -4) + std::ldexp(sy[g], -10));
    }
  }
}

TEST(Quantize, DequantizeIsCodeTimesScale) {
  std::vector<uint8_t> q = {0x38, 0xB8, 0x7E, 0x01};
  std::vector<float> s = {0.25f};
  q.resize(128, 0);
  std::vector<float> out(128);
  dequantize_fp8(q.data(), s.data(), 1, 128, out.data());
  EXPECT_EQ(out[0], 0.25f);
  EXPECT_EQ(out[1], -0.25f);
  EXPECT_EQ(out[2], 112.0f);
  EXPECT_EQ(out[3], pow2(-11));
  EXPECT_EQ(out[4], 0.0f);
}

// NaN and infinity in bf16 quantised to fp8 (the contract in epx/all2all.hpp): a NaN never
// becomes the amax and is sent as 0x7F; a block with +-Inf gets the scale +Inf, its Inf values
// 0x7F and its finite values +-0, so the whole block dequantises to NaN.
TEST(Quantize, NonFiniteValuesFollowTheContract) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> x(384, bf16_from_float(0.5f));
  x[3] = bf16_from_float(std::numeric_limits<float>::quiet_NaN());
  x[7] = bf16_from_float(-2.0f);  // block 0's amax, NaN aside
  x[127] = x[3];                  // last in its block: a comparison that let NaN win would keep it
  x[130] = bf16_from_float(inf);  // block 1
  x[131] = bf16_from_float(-1.0f);
  x[300] = bf16_from_float(-inf);  // block 2
  x[301] = bf16_from_float(-0.5f);
  std::vector<uint8_t> q(384);
  std::vector<float> s(3);
  quantize_fp8(x.data(), 1, 384, q.data(), s.data());
  EXPECT_EQ(s[0], 2.0f / 448.0f);
  EXPECT_EQ(q[3], 0x7F);
  EXPECT_EQ(q[127], 0x7F);
  EXPECT_EQ(q[7], 0xFE);  // -448
  EXPECT_EQ(q[0], fp8_from_float(112.0f));
  for (int b = 1; b < 3; ++b) {
    EXPECT_EQ(s[b], inf) << b;
    for (int i = 128 * b; i < 128 * (b + 1); ++i) {
      const bool negative = i == 131 || i == 301;
      EXPECT_EQ(q[i], (i == 130 || i == 300) ? 0x7F : negative ? 0x80 : 0x00) << i;
    }
  }
  std::vector<float> out(384);
  dequantize_fp8(q.data(), s.data(), 1, 384, out.data());
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_EQ(out[7], -2.0f);
  for (int i = 128; i < 384; ++i) EXPECT_TRUE(std::isnan(out[i])) << i;
  // The same with power-of-two scales: an infinite amax gives scale inf and 1 / scale = 0.
  quantize_fp8(x.data(), 1, 384, q.data(), s.data(), /*round_scale=*/true);
  EXPECT_EQ(s[0], pow2(-7));  // 2 / 448 in (2^-8, 2^-7]
  EXPECT_EQ(q[3], 0x7F);
  EXPECT_EQ(q[7], fp8_from_float(-256.0f));
  EXPECT_EQ(q[0], fp8_from_float(64.0f));
  for (int b = 1; b < 3; ++b) {
    EXPECT_EQ(s[b], inf) << b;
    for (int i = 128 * b; i < 128 * (b + 1); ++i) {
      const bool negative = i == 131 || i == 301;
      EXPECT_EQ(q[i], (i == 130 || i == 300) ? 0x7F : negative ? 0x80 : 0x00) << i;
    }
  }
}

}  // namespace
}  // namespace epx::ref
