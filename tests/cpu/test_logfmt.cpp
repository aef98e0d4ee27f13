// LogFMT-10 (src/core/logfmt.hpp) and the LogFMT combine of the CPU reference: row size, bit
// layout, round trips of many kinds of rows against the documented error bound, the rounding
// against an exact model, and the error of a realistic combine by DeepEP's measure.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/logfmt.hpp"
#include "epx/error.hpp"
#include "reference/reference.hpp"

namespace epx::ref {
namespace {

using logfmt::BlockScale;

uint16_t bf16(float f) {
  return bf16_from_float(f);
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16(v[i]);
  return out;
}

uint32_t meta_of(const std::vector<uint8_t>& row, int block) {
  uint32_t m;
  std::memcpy(&m, row.data() + 4 * block, 4);
  return m;
}

std::string fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// The documented bound, value by value: |d - x| <= (rho + kRelSlack) |x| + kAbsSlack for
// 2^l_min <= |x|,
// |d - x| <= 2^l_min below; the sign is exact (a zero decodes to a zero of its sign). Returns
// the number of values outside it; `first` describes the first.
struct BoundCheck {
  int64_t violations = 0;
  std::string first;
  double worst_rel = 0;  // largest |d - x| / |x| over values at or above 2^l_min
};
BoundCheck check_bound(const std::vector<uint16_t>& x, const std::vector<float>& decoded,
                       const std::vector<uint8_t>& wire, int hidden) {
  BoundCheck c;
  const size_t rows = x.size() / static_cast<size_t>(hidden);
  const size_t stride = static_cast<size_t>(logfmt::row_stride(hidden));
  for (size_t r = 0; r < rows; ++r) {
    std::vector<uint8_t> row(wire.begin() + r * stride, wire.begin() + (r + 1) * stride);
    for (int b = 0; b < hidden / logfmt::kBlockValues; ++b) {
      const BlockScale s = logfmt::block_scale(meta_of(row, b));
      const double rho = logfmt::relative_bound(s) + logfmt::kRelSlack;
      const double floor_level = std::exp2(static_cast<double>(s.log_min));
      for (int i = b * logfmt::kBlockValues; i < (b + 1) * logfmt::kBlockValues; ++i) {
        const size_t at = r * hidden + i;
        const double xv = bf16_to_float(x[at]);
        const double d = decoded[at];
        const double err = std::fabs(d - xv);
        const bool sign_ok = std::signbit(d) == std::signbit(xv);
        bool ok = sign_ok;
        if (std::fabs(xv) >= floor_level) {
          ok = ok && err <= rho * std::fabs(xv) + logfmt::kAbsSlack;
          if (xv != 0) c.worst_rel = std::max(c.worst_rel, err / std::fabs(xv));
        } else {
          ok = ok && err <= floor_level;
        }
        if (!ok && c.violations++ == 0)
          c.first = "row " + std::to_string(r) + " col " + std::to_string(i) + ": x " + fmt_g(xv) +
                    " decoded " + fmt_g(d) + " rho " + std::to_string(rho);
      }
    }
  }
  return c;
}

struct RoundTrip {
  std::vector<uint8_t> wire;
  std::vector<float> decoded;
};
RoundTrip round_trip(const std::vector<uint16_t>& x, int hidden) {
  const int rows = static_cast<int>(x.size() / static_cast<size_t>(hidden));
  RoundTrip t;
  t.wire.resize(static_cast<size_t>(rows) * static_cast<size_t>(logfmt::row_stride(hidden)));
  t.decoded.resize(x.size());
  logfmt_encode(x.data(), rows, hidden, t.wire.data());
  logfmt_decode(t.wire.data(), rows, hidden, t.decoded.data());
  return t;
}

// DeepEP's calc_diff (deep_ep/utils/math.py): 1 - 2 sum(xy) / sum(x^2 + y^2) over x + 1, y + 1.
double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, xx_yy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double a = x[i] + 1, b = y[i] + 1;
    xy += a * b;
    xx_yy += a * a + b * b;
  }
  return 1 - 2 * xy / xx_yy;
}

// ---- size and layout -------------------------------------------------------------------------

TEST(LogFmt, RowBytesAreDeepEpsAndTheRatioAtR1) {
  for (int h : {128, 512, 2048, 4096, 5120, 7168}) {
    // DeepEP's num_logfmt10_bytes: hidden * 10 / 8 + hidden / 128 * 4.
    EXPECT_EQ(logfmt::row_bytes(h), int64_t(h) * 10 / 8 + h / 128 * 4) << h;
    EXPECT_EQ(logfmt::row_stride(h) % 16, 0) << h;
    EXPECT_LT(logfmt::row_stride(h) - logfmt::row_bytes(h), 16) << h;
    if (h % 512 == 0) {
      EXPECT_EQ(logfmt::row_stride(h), logfmt::row_bytes(h)) << h;
    }
  }
  EXPECT_EQ(logfmt::row_bytes(128), 164);
  EXPECT_EQ(logfmt::row_stride(128), 176);
  // DeepSeek-R1: 9184 bytes against 14336, 0.640625 (35.9 % fewer; 37.5 % without the metadata).
  EXPECT_EQ(logfmt::row_bytes(7168), 9184);
  EXPECT_EQ(static_cast<double>(logfmt::row_bytes(7168)) / (7168 * 2), 0.640625);
  EXPECT_EQ(logfmt::meta_bytes(7168), 224);
  EXPECT_EQ(logfmt::group_offset(7168, 1), 224 + 20);
}

TEST(LogFmt, GroupBitLayout) {
  uint32_t codes[16];
  for (int j = 0; j < 16; ++j) codes[j] = 0;
  codes[0] = 0x1FF;
  uint32_t w[5];
  logfmt::pack_group(codes, 0, w);
  EXPECT_EQ(w[0], 0x1FFu);  // code 0: bits 0..8
  codes[0] = 0;
  codes[3] = 0x1FF;  // bits 27..35: crosses from word 0 into word 1
  logfmt::pack_group(codes, 0, w);
  EXPECT_EQ(w[0], 0xF8000000u);
  EXPECT_EQ(w[1], 0xFu);
  codes[3] = 0;
  codes[15] = 0x1FF;  // bits 135..143: word 4, bits 7..15
  logfmt::pack_group(codes, 0x8001u, w);
  EXPECT_EQ(w[4], (0x1FFu << 7) | (0x8001u << 16));  // signs of values 0 and 15 in bits 16, 31

  std::mt19937 rng(7);
  for (int it = 0; it < 2000; ++it) {
    uint32_t in[16], out[16], signs_out = 0;
    for (auto& c : in) c = rng() % 512;
    const uint32_t signs = rng() & 0xFFFFu;
    logfmt::pack_group(in, signs, w);
    logfmt::unpack_group(w, out, signs_out);
    EXPECT_EQ(signs_out, signs);
    for (int j = 0; j < 16; ++j) ASSERT_EQ(out[j], in[j]) << j;
  }
}

TEST(LogFmt, MetaIsAmaxAndAminOfEachBlock) {
  std::vector<float> v(256, 0.5f);
  v[3] = -3.0f;
  v[77] = 0.25f;
  v[128 + 5] = 0.0f;
  v[128 + 9] = -7.5f;
  const RoundTrip t = round_trip(to_bf16(v), 256);
  EXPECT_EQ(meta_of(t.wire, 0), logfmt::pack_meta(bf16(3.0f), bf16(0.25f)));
  EXPECT_EQ(meta_of(t.wire, 1), logfmt::pack_meta(bf16(7.5f), 0));
  EXPECT_EQ(t.decoded[3], -3.0f);  // the block's largest magnitude is exact
  EXPECT_EQ(t.decoded[128 + 9], -7.5f);
  EXPECT_EQ(t.decoded[128 + 5], 0.0f);
}

// ---- round trips -------------------------------------------------------------------------------

struct Kind {
  const char* name;
  float (*draw)(std::mt19937&);
};

float draw_normal(std::mt19937& g) {
  return std::normal_distribution<float>(0, 1)(g);
}
float draw_heavy(std::mt19937& g) {  // Student t with 2 degrees of freedom, and rare 1000x outliers
  const float z = std::normal_distribution<float>(0, 1)(g);
  const float c = std::chi_squared_distribution<float>(2)(g);
  const float t = z / std::sqrt(c / 2 + 1e-12f);
  return std::uniform_int_distribution<int>(0, 499)(g) == 0 ? t * 1000 : t;
}
float draw_sparse(std::mt19937& g) {  // half zeros (both signs)
  const float z = std::normal_distribution<float>(0, 1)(g);
  const int k = std::uniform_int_distribution<int>(0, 3)(g);
  return k == 0 ? 0.0f : k == 1 ? -0.0f : z;
}
float draw_tiny(std::mt19937& g) {  // around and below bf16's smallest normal 2^-126
  return std::ldexp(draw_normal(g), std::uniform_int_distribution<int>(-133, -120)(g));
}
float draw_wide(std::mt19937& g) {  // magnitudes over 2^-60 .. 2^60: blocks span beyond 2^32
  return std::ldexp(draw_normal(g), std::uniform_int_distribution<int>(-60, 60)(g));
}
float draw_negative(std::mt19937& g) {
  return -std::fabs(draw_normal(g)) * 300;
}
float draw_large(std::mt19937& g) {
  return draw_normal(g) * 1e30f;
}

TEST(LogFmt, RoundTripsStayWithinTheBound) {
  const Kind kinds[] = {{"normal", draw_normal}, {"heavy tails", draw_heavy},
                        {"zeros", draw_sparse},  {"tiny", draw_tiny},
                        {"wide", draw_wide},     {"negative", draw_negative},
                        {"large", draw_large}};
  constexpr int kHidden = 7168, kRows = 16;
  std::mt19937 rng(2024);
  for (const Kind& k : kinds) {
    std::vector<float> v(static_cast<size_t>(kHidden) * kRows);
    for (float& f : v) f = k.draw(rng);
    const std::vector<uint16_t> x = to_bf16(v);
    const RoundTrip t = round_trip(x, kHidden);
    const BoundCheck c = check_bound(x, t.decoded, t.wire, kHidden);
    EXPECT_EQ(c.violations, 0) << k.name << ": " << c.first;
    // No block spans more than 2^32, so rho <= (2^(32/510) - 1) / (2^(32/510) + 1) = 0.0217.
    EXPECT_LE(c.worst_rel, 0.0218) << k.name;
    for (size_t i = 0; i < x.size(); ++i) {  // zeros stay zeros of their sign
      if ((x[i] & 0x7FFF) == 0) {
        ASSERT_EQ(std::bit_cast<uint32_t>(t.decoded[i]), uint32_t(x[i]) << 16) << k.name;
      }
    }
  }
}

TEST(LogFmt, NormalRowsErrorDistribution) {
  // Rows as experts produce them: about 0.35 % RMS relative error (bf16's rounding: 0.11 %).
  constexpr int kHidden = 7168, kRows = 64;
  std::mt19937 rng(11);
  std::vector<float> v(static_cast<size_t>(kHidden) * kRows);
  for (float& f : v) f = draw_normal(rng) * 0.1f;
  const std::vector<uint16_t> x = to_bf16(v);
  const RoundTrip t = round_trip(x, kHidden);
  double se = 0, sx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double xv = bf16_to_float(x[i]);
    se += (t.decoded[i] - xv) * (t.decoded[i] - xv);
    sx += xv * xv;
  }
  const double rms = std::sqrt(se / sx);
  EXPECT_GT(rms, 0.001);  // it is lossy: the format is applied
  EXPECT_LT(rms, 0.006);
  const BoundCheck c = check_bound(x, t.decoded, t.wire, kHidden);
  EXPECT_EQ(c.violations, 0) << c.first;
  EXPECT_LT(c.worst_rel, 0.0218);  // a block with a value near zero spans further
}

TEST(LogFmt, RoundingIsNearestOnTheLinearScale) {
  // Exact model in double: the code whose level is nearest to |x|. The codec may differ only
  // for values within 1e-5 (relative) of the midpoint between two levels.
  std::mt19937 rng(5);
  int64_t values = 0, near_ties = 0;
  for (int it = 0; it < 400; ++it) {
    std::vector<float> v(128);
    const int spread = std::uniform_int_distribution<int>(0, 40)(rng);
    for (float& f : v)
      f = std::ldexp(draw_normal(rng),
                     std::uniform_int_distribution<int>(-spread, spread)(rng) / 4);
    const std::vector<uint16_t> x = to_bf16(v);
    const BlockScale s = logfmt::block_scale(logfmt::block_meta(x.data(), 128));
    const double lmin = s.log_min, step = s.step;
    auto level = [&](int c) {
      return c == 0 ? 0.0 : c == 511 ? double(s.amax) : std::exp2(lmin + (c - 1) * step);
    };
    for (uint16_t b : x) {
      const double a = bf16_to_float(uint16_t(b & 0x7FFF));
      int best = 0;
      for (int c = 1; c <= 511; ++c)
        if (std::fabs(level(c) - a) < std::fabs(level(best) - a)) best = c;
      const int got = static_cast<int>(logfmt::encode_magnitude(uint16_t(b & 0x7FFF), s));
      ++values;
      if (got == best) continue;
      ASSERT_EQ(std::abs(got - best), 1) << a;
      const double mid = (level(got) + level(best)) / 2;
      ASSERT_LE(std::fabs(a - mid), 1e-5 * a)
          << "x " << a << " code " << got << " nearest " << best;
      ++near_ties;
    }
  }
  EXPECT_LT(near_ties * 1000, values);  // ties are rare
}

TEST(LogFmt, DegenerateBlocks) {
  constexpr int kHidden = 512;
  std::vector<float> v(kHidden);
  for (int i = 0; i < 128; ++i) v[i] = i % 2 ? 0.3f : -0.3f;    // all equal magnitudes: exact
  for (int i = 128; i < 256; ++i) v[i] = i % 3 ? 0.0f : -0.0f;  // all zeros
  for (int i = 256; i < 384; ++i) v[i] = (i - 256) * 0.01f;     // ramp with a zero
  for (int i = 384; i < 512; ++i) v[i] = -128.0f;               // DeepEP's test rows: rank - 128
  const std::vector<uint16_t> x = to_bf16(v);
  const RoundTrip t = round_trip(x, kHidden);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(t.decoded[i], bf16_to_float(x[i])) << i;
  for (int i = 128; i < 256; ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(t.decoded[i]), uint32_t(x[i]) << 16) << i;
  for (int i = 384; i < 512; ++i) EXPECT_EQ(t.decoded[i], -128.0f) << i;
  const BoundCheck c = check_bound(x, t.decoded, t.wire, kHidden);
  EXPECT_EQ(c.violations, 0) << c.first;
}

TEST(LogFmt, NonFiniteValuePoisonsItsBlockOnly) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> v(256, 0.5f);
    v[200] = bad;
    const RoundTrip t = round_trip(to_bf16(v), 256);
    for (int i = 0; i < 128; ++i) EXPECT_EQ(t.decoded[i], 0.5f);
    for (int i = 128; i < 256; ++i) EXPECT_TRUE(std::isnan(t.decoded[i])) << i;
  }
}

TEST(LogFmt, Log2AndExp2AreAccurate) {
  double worst = 0;
  for (uint32_t b = 1; b < 0x7F80; ++b) {  // every positive finite bf16
    const float x = bf16_to_float(static_cast<uint16_t>(b));
    const double e = std::log2(static_cast<double>(x));
    worst = std::max(worst, std::fabs(logfmt::log2_fixed(x) - e) / std::max(1.0, std::fabs(e)));
  }
  EXPECT_LT(worst, 2e-7);
  std::mt19937 rng(3);
  worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float y = std::uniform_real_distribution<float>(-125.0f, 127.0f)(rng);
    const double e = std::exp2(static_cast<double>(y));
    worst = std::max(worst, std::fabs(logfmt::exp2_fixed(y) - e) / e);
  }
  EXPECT_LT(worst, 2e-7);
  EXPECT_EQ(logfmt::exp2_fixed(0.0f), 1.0f);
  EXPECT_EQ(logfmt::exp2_fixed(-149.0f), std::ldexp(1.0f, -149));  // subnormal, rounded once
}

TEST(LogFmt, HiddenMustHoldWholeBlocks) {
  std::vector<uint16_t> x(192);
  std::vector<uint8_t> wire(1024);
  EXPECT_THROW(logfmt_encode(x.data(), 1, 192, wire.data()), InputError);
}

// ---- combine ----------------------------------------------------------------------------------

struct CombineCase {
  EpConfig cfg;
  std::vector<RankInput> inputs;
  std::vector<TokenMajorRecv> recv;
  std::vector<std::vector<uint16_t>> partials;
};
CombineCase make_case(float scale, uint64_t seed) {
  CombineCase c;
  c.cfg.world_size = 8;
  c.cfg.hidden = 7168;
  c.cfg.num_experts = 64;
  c.cfg.topk = 8;
  c.cfg.max_tokens_per_rank = 16;
  c.cfg.dtype = DispatchDtype::kBF16;
  for (int r = 0; r < 8; ++r) {
    const Routing rt = make_routing(RoutingKind::kUniform, 16, 64, 8, seed + r);
    RankInput in = make_rank_input(c.cfg, 16, rt, seed + 100 + r);
    for (uint16_t& b : in.x_bf16) b = bf16(bf16_to_float(b) * scale);
    c.inputs.push_back(std::move(in));
  }
  c.recv = dispatch_token_major(c.cfg, c.inputs);
  for (int r = 0; r < 8; ++r) {
    EpConfig cr = c.cfg;
    cr.rank = r;
    c.partials.push_back(identity_partials(cr, r, c.recv[r]));
  }
  return c;
}

// The exact sum of the partials each token gets (f64, before any rounding).
std::vector<double> exact_sums(const CombineCase& c, int s) {
  const size_t H = static_cast<size_t>(c.cfg.hidden);
  std::vector<double> y(static_cast<size_t>(c.inputs[s].num_tokens) * H, 0.0);
  for (int r = 0; r < c.cfg.world_size; ++r)
    for (int j = 0; j < c.recv[r].count; ++j) {
      if (c.recv[r].src_rank[j] != s) continue;
      const size_t n = static_cast<size_t>(c.recv[r].src_idx[j]);
      for (size_t h = 0; h < H; ++h) y[n * H + h] += bf16_to_float(c.partials[r][j * H + h]);
    }
  return y;
}

std::vector<double> as_double(const std::vector<uint16_t>& y) {
  std::vector<double> d(y.size());
  for (size_t i = 0; i < y.size(); ++i) d[i] = bf16_to_float(y[i]);
  return d;
}

TEST(LogFmtCombine, WithinDeepEpsToleranceOnEightRanks) {
  // DeepEP's test (tests/legacy/test_low_latency.py) holds combine to calc_diff < 1e-5 with bf16
  // dispatch (9e-4 with fp8), LogFMT or not, on activations of scale 0.5 * U(0, 1) and 0.1.
  for (float scale : {0.5f, 0.1f, 0.02f, 3.0f}) {
    const CombineCase c = make_case(scale, 40);
    const auto y_bf16 = combine_token_major(c.cfg, c.inputs, c.recv, c.partials);
    const auto y_log =
        combine_token_major(c.cfg, c.inputs, c.recv, c.partials, CombineFormat::kLogFMT);
    double worst_log = 0, worst_bf16 = 0;
    for (int s = 0; s < 8; ++s) {
      const std::vector<double> exact = exact_sums(c, s);
      worst_log = std::max(worst_log, calc_diff(exact, as_double(y_log[s])));
      worst_bf16 = std::max(worst_bf16, calc_diff(exact, as_double(y_bf16[s])));
    }
    EXPECT_LT(worst_log, 1e-5) << "scale " << scale;
    EXPECT_GT(worst_log, worst_bf16) << "scale " << scale;  // lossy beyond bf16's rounding
    RecordProperty("calc_diff_scale_" + std::to_string(scale), std::to_string(worst_log));
    std::printf("scale %g: calc_diff LogFMT %.3g, bf16 %.3g\n", scale, worst_log, worst_bf16);
  }
}

TEST(LogFmtCombine, IsTheRankOrderSumOfDecodedPartials) {
  const CombineCase c = make_case(0.5f, 77);
  const auto y = combine_token_major(c.cfg, c.inputs, c.recv, c.partials, CombineFormat::kLogFMT);
  const size_t H = 7168;
  for (int s = 0; s < 8; s += 3) {
    for (int n = 0; n < c.inputs[s].num_tokens; n += 5) {
      std::vector<float> acc(H, 0.0f), d(H);
      for (int r = 0; r < 8; ++r)
        for (int j = 0; j < c.recv[r].count; ++j) {
          if (c.recv[r].src_rank[j] != s || c.recv[r].src_idx[j] != n) continue;
          logfmt_round_trip_row(c.partials[r].data() + j * H, 7168, d.data());
          for (size_t h = 0; h < H; ++h) acc[h] += d[h];
        }
      for (size_t h = 0; h < H; ++h) ASSERT_EQ(y[s][n * H + h], bf16(acc[h])) << s << " " << n;
    }
  }
}

TEST(LogFmtCombine, ExpertMajorWithinDeepEpsTolerance) {
  CombineCase c = make_case(0.5f, 9);
  c.cfg.layout = OutputLayout::kExpertMajor;
  const auto recv = dispatch_expert_major(c.cfg, c.inputs);
  std::vector<std::vector<std::vector<uint16_t>>> out;
  for (const auto& r : recv) out.push_back(identity_expert_outputs(c.cfg, r));
  const auto y_bf16 = combine_expert_major(c.cfg, c.inputs, recv, out);
  const auto y_log = combine_expert_major(c.cfg, c.inputs, recv, out, CombineFormat::kLogFMT);
  for (int s = 0; s < 8; ++s) {
    const double d = calc_diff(as_double(y_bf16[s]), as_double(y_log[s]));
    EXPECT_LT(d, 1e-5) << s;
    EXPECT_GT(d, 0) << s;
  }
}

// ---- the checks can fail ------------------------------------------------------------------------

TEST(LogFmtChecks, AWrongDecoderIsCaught) {
  // A decoder one level off (code c read as level c rather than c - 1): the bound check and
  // DeepEP's measure on a combine both catch it.
  constexpr int kHidden = 7168;
  std::mt19937 rng(1);
  std::vector<float> v(kHidden * 4);
  for (float& f : v) f = draw_normal(rng) * 3.0f;
  const std::vector<uint16_t> x = to_bf16(v);
  RoundTrip t = round_trip(x, kHidden);
  ASSERT_EQ(check_bound(x, t.decoded, t.wire, kHidden).violations, 0);
  const size_t stride = static_cast<size_t>(logfmt::row_stride(kHidden));
  for (size_t r = 0; r < 4; ++r) {
    const uint8_t* row = t.wire.data() + r * stride;
    for (int g = 0; g < kHidden / 16; ++g) {
      uint32_t w[5], codes[16], signs = 0;
      std::memcpy(w, row + logfmt::group_offset(kHidden, g), sizeof w);
      logfmt::unpack_group(w, codes, signs);
      uint32_t meta;
      std::memcpy(&meta, row + 4 * (g / 8), 4);
      const BlockScale s = logfmt::block_scale(meta);
      for (int j = 0; j < 16; ++j) {
        const float m = codes[j] == 0 ? 0.0f : logfmt::exp2_fixed(codes[j] * s.step + s.log_min);
        t.decoded[r * kHidden + g * 16 + j] = (signs >> j) & 1 ? -m : m;
      }
    }
  }
  const BoundCheck c = check_bound(x, t.decoded, t.wire, kHidden);
  EXPECT_GT(c.violations, kHidden);  // nearly every value is off by a step
  std::vector<double> exact(x.size()), got(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    exact[i] = bf16_to_float(x[i]);
    got[i] = t.decoded[i];
  }
  EXPECT_GT(calc_diff(exact, got), 1e-5);  // DeepEP's threshold catches it too
}

}  // namespace
}  // namespace epx::ref
