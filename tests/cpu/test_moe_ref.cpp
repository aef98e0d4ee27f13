// The CPU reference of the MoE layer (src/reference/moe_ref.hpp): shape validation, seeded
// weights, both routers on hand-checkable cases and over seeds, the fp8 expert pipeline against
// double precision, and the whole layer against an unquantised f64 layer.
//
// Tolerances stated here (measured values in the comments next to each bound):
//  * f32 vs f64 on the same dequantised operands: every GEMM output within
//    (K + 8) * 2^-24 * sum_i |a_i w_i| (the classical bound for f32 accumulation of K terms plus
//    the scale multiplies); silu(h1) * h3 within 16 * 2^-24 relative.
//  * quantised layer vs unquantised f64 layer (same routing): ||d||_F / ||ref||_F < 8e-2 over
//    the batch and < 1.2e-1 per token. Measured on H 256, I 256, E 16, top-4, 32 tokens, seeds
//    1..6, both scorings: 0.055 .. 0.062 over the batch, worst token 0.066 .. 0.084. Five fp8
//    roundings (x, W1/W3, act, W2; e4m3 alone costs ~2.7 % rms per tensor) add up to ~6 %, so
//    6e-2 would sit on the measured values; 8e-2 leaves room for other seeds and shapes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/error.hpp"
#include "reference/moe_ref.hpp"

namespace epx::ref::moe {
namespace {

// ---- helpers --------------------------------------------------------------------------------

constexpr double kF32Unit = 0x1.0p-24;
constexpr double kLayerTolerance = 8e-2;    // relative Frobenius, quantised vs unquantised layer
constexpr double kTokenTolerance = 1.2e-1;  // the same for one token

// H 256, I 256, 16 experts in 4 groups, best 2 groups, top-4, one shared expert of I 256.
MoeShape small_shape(Scoring scoring = Scoring::kSigmoidGrouped) {
  MoeShape s{.hidden = 256,
             .intermediate = 256,
             .num_experts = 16,
             .topk = 4,
             .num_groups = 4,
             .topk_groups = 2,
             .routed_scaling = 2.5f,
             .shared_intermediate = 256,
             .scoring = scoring};
  if (scoring == Scoring::kSoftmax) s.num_groups = s.topk_groups = 1;
  return s;
}

// A shape for routing-only tests (hidden and intermediate are not used).
MoeShape routing_shape(int experts, int groups, int topk_groups, int topk, Scoring scoring) {
  return MoeShape{.hidden = 128,
                  .intermediate = 128,
                  .num_experts = experts,
                  .topk = topk,
                  .num_groups = groups,
                  .topk_groups = topk_groups,
                  .routed_scaling = 2.5f,
                  .shared_intermediate = 0,
                  .scoring = scoring};
}

// Weights are the slowest thing to make; tests share them per (scoring, seed).
const MoeWeights& small_weights(uint64_t seed) {
  static std::map<uint64_t, MoeWeights> cache;
  auto it = cache.find(seed);
  if (it == cache.end()) it = cache.emplace(seed, make_moe_weights(small_shape(), seed)).first;
  return it->second;
}

// The logit whose sigmoid is s.
float logit_of(double s) { return static_cast<float>(std::log(s / (1.0 - s))); }
double sigmoid(double l) { return 1.0 / (1.0 + std::exp(-l)); }

double rel_frobenius(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

testing::AssertionResult rel_frobenius_below(const std::vector<float>& got,
                                             const std::vector<double>& want, double bound) {
  if (got.size() != want.size()) {
    return testing::AssertionFailure() << "size " << got.size() << ", expected " << want.size();
  }
  const double rel = rel_frobenius(got, want);
  if (!(rel < bound)) {
    return testing::AssertionFailure() << "||d|| / ||ref|| = " << rel << ", bound " << bound;
  }
  return testing::AssertionSuccess() << "||d|| / ||ref|| = " << rel;
}

// A GEMM output computed in f32 against its f64 value: |got - want| <= (K + 8) u sum |terms|.
testing::AssertionResult within_dot_bound(const std::vector<float>& got,
                                          const std::vector<double>& want,
                                          const std::vector<double>& abs_sum, int k,
                                          const char* what) {
  if (got.size() != want.size()) {
    return testing::AssertionFailure()
           << what << ": size " << got.size() << ", expected " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = (k + 8) * kF32Unit * abs_sum[i];
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= bound)) {
      return testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", f64 "
                                         << want[i] << ", |d| " << d << " > bound " << bound;
    }
  }
  return testing::AssertionSuccess();
}

// out[M][N] = a[M][K] . w[N][K]^T in f64, with the sums of |terms| for the error bound.
struct DotF64 {
  std::vector<double> value;
  std::vector<double> abs_sum;
};
DotF64 gemm_nt_f64(const std::vector<double>& a, const std::vector<double>& w, int m, int n,
                   int k) {
  DotF64 r{std::vector<double>(static_cast<size_t>(m) * n),
           std::vector<double>(static_cast<size_t>(m) * n)};
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0.0, abs = 0.0;
      for (int t = 0; t < k; ++t) {
        const double p = a[static_cast<size_t>(i) * k + t] * w[static_cast<size_t>(j) * k + t];
        s += p;
        abs += std::fabs(p);
      }
      r.value[static_cast<size_t>(i) * n + j] = s;
      r.abs_sum[static_cast<size_t>(i) * n + j] = abs;
    }
  }
  return r;
}

// fp8 values times their 1x128 scales, in double (exact: 4-bit times 24-bit mantissas).
std::vector<double> dequant_rows_f64(const std::vector<uint8_t>& q,
                                     const std::vector<float>& scales, int cols) {
  std::vector<double> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    const size_t row = i / cols, col = i % cols;
    out[i] = static_cast<double>(fp8_to_float(q[i])) *
             static_cast<double>(scales[row * (cols / 128) + col / 128]);
  }
  return out;
}
std::vector<double> dequant_f64(const Fp8BlockMatrix& m) {
  std::vector<double> out(m.q.size());
  for (int r = 0; r < m.rows; ++r) {
    for (int c = 0; c < m.cols; ++c) {
      out[static_cast<size_t>(r) * m.cols + c] =
          static_cast<double>(fp8_to_float(m.q[static_cast<size_t>(r) * m.cols + c])) *
          static_cast<double>(m.scale_at(r, c));
    }
  }
  return out;
}

// One expert, unquantised and in f64: master weights, bf16 input as given.
std::vector<double> expert_f64(const MasterExpertWeights& w, const double* x) {
  const int h_dim = w.hidden, i_dim = w.intermediate;
  std::vector<double> act(static_cast<size_t>(i_dim));
  for (int i = 0; i < i_dim; ++i) {
    double h1 = 0.0, h3 = 0.0;
    for (int h = 0; h < h_dim; ++h) {
      h1 += x[h] * w.w1[static_cast<size_t>(i) * h_dim + h];
      h3 += x[h] * w.w3[static_cast<size_t>(i) * h_dim + h];
    }
    act[i] = h1 / (1.0 + std::exp(-h1)) * h3;
  }
  std::vector<double> out(static_cast<size_t>(h_dim));
  for (int h = 0; h < h_dim; ++h) {
    double s = 0.0;
    for (int i = 0; i < i_dim; ++i) s += act[i] * w.w2[static_cast<size_t>(h) * i_dim + i];
    out[h] = s;
  }
  return out;
}

// The layer without fp8 anywhere (f64, master weights) for a given routing.
std::vector<double> layer_f64(const MoeShape& shape, uint64_t seed, const std::vector<uint16_t>& x,
                              int num_tokens, const RouterOutput& routing) {
  std::map<int, MasterExpertWeights> masters;
  const auto master = [&](int e) -> const MasterExpertWeights& {
    auto it = masters.find(e);
    if (it == masters.end())
      it = masters.emplace(e, make_master_expert_weights(shape, seed, e)).first;
    return it->second;
  };
  const int h_dim = shape.hidden;
  std::vector<double> y(static_cast<size_t>(num_tokens) * h_dim, 0.0);
  std::vector<double> xd(static_cast<size_t>(h_dim));
  for (int n = 0; n < num_tokens; ++n) {
    for (int h = 0; h < h_dim; ++h) xd[h] = bf16_to_float(x[static_cast<size_t>(n) * h_dim + h]);
    double* yn = y.data() + static_cast<size_t>(n) * h_dim;
    for (int k = 0; k < routing.topk; ++k) {
      const int e = routing.ids[static_cast<size_t>(n) * routing.topk + k];
      if (e < 0) continue;
      const double wk = routing.weights[static_cast<size_t>(n) * routing.topk + k];
      const std::vector<double> out = expert_f64(master(e), xd.data());
      for (int h = 0; h < h_dim; ++h) yn[h] += wk * out[h];
    }
    if (shape.has_shared_expert()) {
      const std::vector<double> out = expert_f64(master(kSharedExpert), xd.data());
      for (int h = 0; h < h_dim; ++h) yn[h] += out[h];
    }
  }
  return y;
}

// Runs fn, expects an exception of type E whose message contains every piece.
template <typename E>
testing::AssertionResult throws_naming(const std::function<void()>& fn,
                                       const std::vector<std::string>& pieces) {
  try {
    fn();
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& p : pieces) {
      if (what.find(p) == std::string::npos) {
        return testing::AssertionFailure() << "message \"" << what << "\" lacks \"" << p << "\"";
      }
    }
    return testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "wrong exception type: " << e.what();
  }
  return testing::AssertionFailure() << "nothing thrown";
}

RouterOutput route_one(const MoeShape& shape, const std::vector<float>& logits,
                       const std::vector<float>& bias) {
  return route_from_logits(shape, logits, bias, 1);
}

// ---- shape validation -----------------------------------------------------------------------

// The reference and the layer share one shape type (include/epx/moe_shape.hpp).
static_assert(std::is_same_v<MoeShape, epx::MoeShape>);
static_assert(std::is_same_v<Scoring, epx::MoeScoring>);

TEST(MoeShape, ValidShapes) {
  const MoeShape r1 = MoeShape::deepseek_r1();
  EXPECT_NO_THROW(r1.validate());
  EXPECT_EQ(r1.hidden, 7168);
  EXPECT_EQ(r1.intermediate, 2048);
  EXPECT_EQ(r1.num_experts, 256);
  EXPECT_EQ(r1.topk, 8);
  EXPECT_EQ(r1.num_groups, 8);
  EXPECT_EQ(r1.topk_groups, 4);
  EXPECT_EQ(r1.routed_scaling, 2.5f);
  EXPECT_EQ(r1.shared_intermediate, 2048);
  EXPECT_EQ(r1.scoring, Scoring::kSigmoidGrouped);
  EXPECT_NO_THROW(small_shape().validate());
  EXPECT_NO_THROW(small_shape(Scoring::kSoftmax).validate());
  // One group: the group score is never needed, so one expert per group is fine.
  EXPECT_NO_THROW(routing_shape(1, 1, 1, 1, Scoring::kSigmoidGrouped).validate());
  // softmax ignores routed_scaling, so any value is accepted there.
  MoeShape soft = small_shape(Scoring::kSoftmax);
  soft.routed_scaling = 0.0f;
  EXPECT_NO_THROW(soft.validate());
  EXPECT_STREQ(to_string(Scoring::kSigmoidGrouped), "sigmoid_grouped");
  EXPECT_STREQ(to_string(Scoring::kSoftmax), "softmax");
}

TEST(MoeShape, EveryInvalidFieldIsNamedWithValueAndBound) {
  struct Case {
    std::function<void(MoeShape&)> mutate;
    std::vector<std::string> pieces;
  };
  const std::vector<Case> cases = {
      {[](MoeShape& s) { s.hidden = 0; }, {"hidden = 0", "a multiple of 128"}},
      {[](MoeShape& s) { s.hidden = 100; }, {"hidden = 100", "a multiple of 128"}},
      {[](MoeShape& s) { s.hidden = kMaxHidden + 128; }, {"hidden = 65664", "kMaxHidden = 65536"}},
      {[](MoeShape& s) { s.intermediate = 0; }, {"intermediate = 0", "a multiple of 128"}},
      {[](MoeShape& s) { s.intermediate = 200; }, {"intermediate = 200", "a multiple of 128"}},
      {[](MoeShape& s) { s.shared_intermediate = -128; },
       {"shared_intermediate = -128", "0 (no shared expert)"}},
      {[](MoeShape& s) { s.shared_intermediate = 100; },
       {"shared_intermediate = 100", "a multiple of 128"}},
      {[](MoeShape& s) { s.num_experts = 0; }, {"num_experts = 0", ">= 1"}},
      {[](MoeShape& s) { s.topk = 0; }, {"topk = 0", "[1, 16]"}},
      {[](MoeShape& s) { s.topk = 17; }, {"topk = 17", "num_experts = 16", "[1, 16]"}},
      {[](MoeShape& s) {
         s.num_experts = 64;
         s.topk_groups = 4;
         s.topk = 33;
       },
       {"topk = 33", "kMaxTopk = 32", "[1, 32]"}},
      {[](MoeShape& s) { s.scoring = static_cast<Scoring>(7); },
       {"scoring = 7", "sigmoid_grouped (0), softmax (1)"}},
      {[](MoeShape& s) {
         s.scoring = Scoring::kSoftmax;
         s.topk_groups = 1;
       },
       {"num_groups = 4", "1 for scoring softmax"}},
      {[](MoeShape& s) {
         s.scoring = Scoring::kSoftmax;
         s.num_groups = 1;
       },
       {"topk_groups = 2", "1 for scoring softmax"}},
      {[](MoeShape& s) { s.num_groups = 0; }, {"num_groups = 0", "in [1, num_experts = 16]"}},
      {[](MoeShape& s) { s.num_groups = 32; }, {"num_groups = 32", "in [1, num_experts = 16]"}},
      {[](MoeShape& s) { s.num_groups = 3; }, {"num_experts = 16", "a multiple of num_groups = 3"}},
      {[](MoeShape& s) { s.num_groups = 16; }, {"num_groups = 16", "best 2 experts"}},
      {[](MoeShape& s) { s.topk_groups = 0; }, {"topk_groups = 0", "in [1, num_groups = 4]"}},
      {[](MoeShape& s) { s.topk_groups = 5; }, {"topk_groups = 5", "in [1, num_groups = 4]"}},
      {[](MoeShape& s) {
         s.topk_groups = 1;
         s.topk = 5;
       },
       {"topk = 5", "experts in the kept groups", "1 * 4 = 4"}},
      {[](MoeShape& s) { s.routed_scaling = 0.0f; }, {"routed_scaling = 0", "finite and > 0"}},
      {[](MoeShape& s) { s.routed_scaling = -1.0f; }, {"routed_scaling = -1", "finite and > 0"}},
      {[](MoeShape& s) { s.routed_scaling = std::numeric_limits<float>::quiet_NaN(); },
       {"routed_scaling = nan", "finite and > 0"}},
      {[](MoeShape& s) { s.routed_scaling = std::numeric_limits<float>::infinity(); },
       {"routed_scaling = inf", "finite and > 0"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    MoeShape s = small_shape();
    cases[i].mutate(s);
    EXPECT_TRUE(throws_naming<ConfigError>([&] { s.validate(); }, cases[i].pieces));
  }
  // Every generator and the router validate the shape first.
  MoeShape bad = small_shape();
  bad.hidden = 100;
  EXPECT_THROW(make_moe_weights(bad, 1), ConfigError);
  EXPECT_THROW(make_moe_input(bad, 1, 1), ConfigError);
  EXPECT_THROW(route_from_logits(bad, {}, {}, 0), ConfigError);
}

TEST(MoeInputErrors, EveryArgumentCheckNamesTheArgument) {
  const MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(1);
  const std::vector<uint16_t> x = make_moe_input(shape, 2, 5);
  const auto no_shared = [] {
    MoeShape s = small_shape();
    s.shared_intermediate = 0;
    return s;
  }();

  // generators
  EXPECT_TRUE(throws_naming<InputError>([&] { make_expert_weights(shape, 1, 16); },
                                        {"expert = 16", "[0, num_experts = 16)"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { make_expert_weights(shape, 1, -2); },
                                        {"expert = -2", "kSharedExpert"}));
  EXPECT_TRUE(
      throws_naming<InputError>([&] { make_master_expert_weights(no_shared, 1, kSharedExpert); },
                                {"expert = -1", "no shared expert"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { make_moe_input(shape, -1, 1); },
                                        {"num_tokens = -1", ">= 0"}));
  // block quantisation
  const std::vector<float> m(128 * 128, 1.0f);
  EXPECT_TRUE(throws_naming<InputError>([&] { quantize_fp8_block128(m, 100, 128); },
                                        {"rows = 100", "multiple of 128"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { quantize_fp8_block128(m, 128, 64); },
                                        {"cols = 64", "multiple of 128"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { quantize_fp8_block128(m, 256, 128); },
                                        {"m.size() = 16384", "rows * cols = 256 * 128"}));
  // router
  EXPECT_TRUE(throws_naming<InputError>([&] { router_logits(shape, w.gate, x, 3); },
                                        {"x.size() = 512", "num_tokens * hidden = 3 * 256"}));
  EXPECT_TRUE(
      throws_naming<InputError>([&] { router_logits(shape, w.gate, x, -1); }, {"num_tokens = -1"}));
  EXPECT_TRUE(
      throws_naming<InputError>([&] { router_logits(shape, std::span(w.gate).first(100), x, 2); },
                                {"gate.size() = 100", "num_experts * hidden = 16 * 256"}));
  const std::vector<float> logits(2 * 16, 0.0f);
  EXPECT_TRUE(
      throws_naming<InputError>([&] { route_from_logits(shape, logits, w.correction_bias, 3); },
                                {"logits.size() = 32", "num_tokens * num_experts = 3 * 16"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { route_from_logits(shape, logits, {}, 2); },
                                        {"correction_bias.size() = 0", "num_experts = 16"}));
  EXPECT_TRUE(throws_naming<InputError>(
      [&] { route_from_logits(shape, logits, w.correction_bias, -1); }, {"num_tokens = -1"}));
  // GEMM and experts
  const ExpertWeights& e0 = w.experts[0];
  std::vector<uint8_t> aq(2 * 256);
  std::vector<float> as(2 * 2, 1.0f);
  EXPECT_TRUE(throws_naming<InputError>([&] { fp8_gemm_nt(aq, as, 3, e0.w1); },
                                        {"a_q.size() = 512", "m * w.cols = 3 * 256"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { fp8_gemm_nt(aq, std::span(as).first(3), 2, e0.w1); },
                                        {"a_scales.size() = 3", "m * w.cols / 128 = 2 * 2"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { fp8_gemm_nt(aq, as, -1, e0.w1); }, {"m = -1"}));
  Fp8BlockMatrix torn = e0.w1;
  torn.q.pop_back();
  EXPECT_TRUE(throws_naming<InputError>(
      [&] { fp8_gemm_nt(aq, as, 2, torn); },
      {"w = [256][256] with 65535 codes, 4 scales", "one scale per 128x128 block"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { expert_forward(e0, x, 3); },
                                        {"x.size() = 512", "num_tokens * hidden = 3 * 256"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { expert_forward(ExpertWeights{}, x, 2); },
                                        {"expert [I][H] = [0][0]", "multiples of 128"}));
  ExpertWeights swapped = e0;
  swapped.w2 = quantize_fp8_block128(std::vector<float>(256 * 128, 1.0f), 128, 256);
  EXPECT_TRUE(throws_naming<InputError>([&] { expert_forward(swapped, x, 2); },
                                        {"expert.w2 = [128][256]", "[256][256]"}));
  Fp8BlockMatrix short_scales = e0.w3;
  short_scales.scales.pop_back();
  ExpertWeights bad_w3 = e0;
  bad_w3.w3 = short_scales;
  EXPECT_TRUE(throws_naming<InputError>([&] { expert_forward(bad_w3, x, 2); },
                                        {"expert.w3 = [256][256]", "matching q and scales"}));
  // the layer: weights that do not fit the shape
  const auto layer_with = [&](const MoeShape& s, const MoeWeights& ww) {
    return [&s, &ww, &x] { moe_forward_reference(s, ww, x, 2); };
  };
  MoeWeights bad = w;
  bad.gate.pop_back();
  EXPECT_TRUE(throws_naming<InputError>(layer_with(shape, bad),
                                        {"weights.gate.size() = 4095", "num_experts * hidden"}));
  bad = w;
  bad.correction_bias.push_back(0.0f);
  EXPECT_TRUE(throws_naming<InputError>(
      layer_with(shape, bad), {"weights.correction_bias.size() = 17", "num_experts = 16"}));
  bad = w;
  bad.experts.pop_back();
  EXPECT_TRUE(throws_naming<InputError>(layer_with(shape, bad),
                                        {"weights.experts.size() = 15", "num_experts = 16"}));
  bad = w;
  bad.experts[5] = swapped;
  EXPECT_TRUE(throws_naming<InputError>(layer_with(shape, bad), {"weights.experts[5].w2"}));
  EXPECT_TRUE(
      throws_naming<InputError>(layer_with(no_shared, w), {"weights.shared = present", "absent"}));
  bad = w;
  bad.shared.reset();
  EXPECT_TRUE(
      throws_naming<InputError>(layer_with(shape, bad), {"weights.shared = absent", "present"}));
  bad = w;
  bad.shared = make_expert_weights(routing_shape(16, 4, 2, 4, Scoring::kSigmoidGrouped), 1, 0);
  EXPECT_TRUE(
      throws_naming<InputError>(layer_with(shape, bad), {"weights.shared.w1 = [128][128]"}));
  // the layer: routing that does not fit
  RouterOutput r = route(shape, w, x, 2);
  RouterOutput short_r = r;
  short_r.weights.pop_back();
  EXPECT_TRUE(
      throws_naming<InputError>([&] { moe_forward_routed(shape, w, x, 2, short_r); },
                                {"routing = [2][4] with 8 ids, 7 weights", "[num_tokens = 2]"}));
  RouterOutput bad_id = r;
  bad_id.ids[1 * 4 + 2] = 16;
  EXPECT_TRUE(throws_naming<InputError>([&] { moe_forward_routed(shape, w, x, 2, bad_id); },
                                        {"routing.ids[1][2] = 16", "[-1, num_experts = 16)"}));
  bad_id.ids[1 * 4 + 2] = -2;
  EXPECT_TRUE(throws_naming<InputError>([&] { moe_forward_routed(shape, w, x, 2, bad_id); },
                                        {"routing.ids[1][2] = -2"}));
  EXPECT_TRUE(throws_naming<InputError>([&] { moe_forward_routed(shape, w, x, 3, r); },
                                        {"x.size() = 512"}));
}

// ---- router: hand-checkable cases -----------------------------------------------------------
// Logits are chosen through their sigmoid, s, so the arithmetic reads in s; expected weights are
// computed in double from the same s and compared within 1e-6.

TEST(RouterSigmoidGrouped, GroupLimitCanDropTheBestSingleExpert) {
  // 8 experts in 4 groups of 2, best 2 groups, top-2. Group scores (sum of both members):
  // g0 = 0.5 + 0.5 = 1.0, g1 = 0.881 + 0.018 = 0.899, g2 = 0.731 + 0.731 = 1.462,
  // g3 = 0.953 + 0.007 = 0.960. Kept: g2, g0. Expert 6 (0.953) is the best single expert but
  // its group loses; the pick is 4 and 5, which tie (lower id first).
  const std::vector<float> logits = {0, 0, 2, -4, 1, 1, 3, -5};
  const std::vector<float> bias(8, 0.0f);
  const RouterOutput r =
      route_one(routing_shape(8, 4, 2, 2, Scoring::kSigmoidGrouped), logits, bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(r.weights[0], 1.25, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.25, 1e-6);
  // With every group kept the best two experts win: 6 (0.953) then 2 (0.881).
  const RouterOutput all =
      route_one(routing_shape(8, 4, 4, 2, Scoring::kSigmoidGrouped), logits, bias);
  EXPECT_EQ(all.ids, (std::vector<int32_t>{6, 2}));
  const double s6 = sigmoid(3), s2 = sigmoid(2);
  EXPECT_NEAR(all.weights[0], s6 / (s6 + s2) * 2.5, 1e-6);
  EXPECT_NEAR(all.weights[1], s2 / (s6 + s2) * 2.5, 1e-6);
}

TEST(RouterSigmoidGrouped, GroupScoreIsTheSumOfTheBestTwo) {
  // 12 experts in 3 groups of 4, best 1 group, top-2.
  //   g0 = {0.90, 0.10, 0.10, 0.10}: best two 1.00, max 0.90, sum 1.20
  //   g1 = {0.60, 0.50, 0.50, 0.50}: best two 1.10, max 0.60, sum 2.10
  //   g2 = {0.80, 0.35, 0.05, 0.05}: best two 1.15, max 0.80, sum 1.25
  // "best two" keeps g2; "max" would keep g0 and "sum of all" g1.
  const std::vector<double> s = {0.90, 0.10, 0.10, 0.10, 0.60, 0.50,
                                 0.50, 0.50, 0.80, 0.35, 0.05, 0.05};
  std::vector<float> logits;
  for (double v : s) logits.push_back(logit_of(v));
  const RouterOutput r = route_one(routing_shape(12, 3, 1, 2, Scoring::kSigmoidGrouped), logits,
                                   std::vector<float>(12, 0.0f));
  EXPECT_EQ(r.ids, (std::vector<int32_t>{8, 9}));
  EXPECT_NEAR(r.weights[0], 0.80 / 1.15 * 2.5, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.35 / 1.15 * 2.5, 1e-6);
}

TEST(RouterSigmoidGrouped, BiasChoosesButDoesNotWeigh) {
  // s0 = 0.731, s1 = 0.5, the rest 0.047; bias +0.3 on expert 1 makes its choice 0.8 > 0.731.
  const MoeShape shape = routing_shape(8, 4, 2, 2, Scoring::kSigmoidGrouped);
  const std::vector<float> logits = {1, 0, -3, -3, -3, -3, -3, -3};
  std::vector<float> bias(8, 0.0f);
  const RouterOutput plain = route_one(shape, logits, bias);
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{0, 1}));
  bias[1] = 0.3f;
  const RouterOutput biased = route_one(shape, logits, bias);
  // Same experts, ranked by choice now; weights come from s alone, so they only swap places.
  EXPECT_EQ(biased.ids, (std::vector<int32_t>{1, 0}));
  const double s0 = sigmoid(1), s1 = 0.5;
  EXPECT_NEAR(biased.weights[0], s1 / (s0 + s1) * 2.5, 1e-6);
  EXPECT_NEAR(biased.weights[1], s0 / (s0 + s1) * 2.5, 1e-6);
  EXPECT_EQ(biased.weights[0], plain.weights[1]);
  EXPECT_EQ(biased.weights[1], plain.weights[0]);
  // A bias large enough brings in an expert of low score: expert 2 (s 0.047, choice 0.847)
  // replaces expert 0, and its small s gives it a small weight.
  bias[2] = 0.8f;
  const RouterOutput pulled = route_one(shape, logits, bias);
  EXPECT_EQ(pulled.ids, (std::vector<int32_t>{2, 1}));
  const double s2 = sigmoid(-3);
  EXPECT_NEAR(pulled.weights[0], s2 / (s2 + s1) * 2.5, 1e-6);
  EXPECT_NEAR(pulled.weights[1], s1 / (s2 + s1) * 2.5, 1e-6);
}

TEST(RouterSigmoidGrouped, BiasCanMoveTheKeptGroup) {
  // Every s is 0.5, so without bias groups and experts all tie and group 0 wins. A bias of 0.1
  // on expert 6 and 0.2 on expert 7 lifts group 3 (score 1.3 against 1.0).
  const MoeShape shape = routing_shape(8, 4, 1, 2, Scoring::kSigmoidGrouped);
  const std::vector<float> logits(8, 0.0f);
  std::vector<float> bias(8, 0.0f);
  EXPECT_EQ(route_one(shape, logits, bias).ids, (std::vector<int32_t>{0, 1}));
  bias[6] = 0.1f;
  bias[7] = 0.2f;
  const RouterOutput r = route_one(shape, logits, bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{7, 6}));
  EXPECT_EQ(r.weights, (std::vector<float>{1.25f, 1.25f}));  // 0.5 / 1.0 * 2.5, exact in f32
}

TEST(RouterSigmoidGrouped, TiesGoToTheLowerId) {
  const std::vector<float> no_bias(8, 0.0f);
  // All equal: groups 0 and 1 are kept, experts 0, 1, 2 picked, weights 2.5 / 3 each.
  const RouterOutput flat = route_one(routing_shape(8, 4, 2, 3, Scoring::kSigmoidGrouped),
                                      std::vector<float>(8, 0.0f), no_bias);
  EXPECT_EQ(flat.ids, (std::vector<int32_t>{0, 1, 2}));
  for (float w : flat.weights) EXPECT_NEAR(w, 2.5 / 3, 1e-6);
  // Group 0 is best; groups 1 and 2 tie for the second place, group 1 wins; inside the kept
  // groups experts 2 and 3 tie for the third pick, expert 2 wins.
  const std::vector<float> logits = {2, 2, 0, 0, 0, 0, -2, -2};
  const RouterOutput r =
      route_one(routing_shape(8, 4, 2, 3, Scoring::kSigmoidGrouped), logits, no_bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2}));
}

TEST(RouterSigmoidGrouped, WeightsSumToTheRoutedScaling) {
  const std::vector<float> logits = {0.3f, -1.2f, 2.2f, 0.1f, -0.4f, 1.7f, 0.9f, -2.5f};
  const std::vector<float> bias = {0.02f, -0.01f, 0.0f, 0.05f, -0.03f, 0.01f, 0.0f, 0.04f};
  MoeShape one = routing_shape(8, 4, 2, 3, Scoring::kSigmoidGrouped);
  one.routed_scaling = 1.0f;
  MoeShape r1 = one;
  r1.routed_scaling = 2.5f;
  const RouterOutput a = route_one(one, logits, bias);
  const RouterOutput b = route_one(r1, logits, bias);
  EXPECT_EQ(a.ids, b.ids);
  double sum = 0.0;
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(b.weights[k], a.weights[k] * 2.5f);  // (s / S) * scaling: one extra multiply
    sum += b.weights[k];
  }
  EXPECT_NEAR(sum, 2.5, 2.5e-6);
}

TEST(RouterSoftmax, PicksTheLargestProbabilitiesAndRenormalises) {
  const MoeShape shape = routing_shape(4, 1, 1, 2, Scoring::kSoftmax);
  // p is proportional to e^l: the pick is 1 (e^3) and 2 (e^2); renormalised over the two,
  // w = e^3 / (e^3 + e^2) = 1 / (1 + e^-1) = 0.731 and 0.269.
  const RouterOutput r = route_one(shape, {1, 3, 2, 0}, {});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(r.weights[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0, 1e-6);
}

TEST(RouterSoftmax, TiesGoToTheLowerIdAndBiasAndScalingAreIgnored) {
  // Experts 2 and 3 tie for the second place: 2 wins.
  const RouterOutput tie =
      route_one(routing_shape(4, 1, 1, 2, Scoring::kSoftmax), {0, 2, 1, 1}, {});
  EXPECT_EQ(tie.ids, (std::vector<int32_t>{1, 2}));
  // All equal: the first three, weights 1/3 each.
  const RouterOutput flat =
      route_one(routing_shape(4, 1, 1, 3, Scoring::kSoftmax), {5, 5, 5, 5}, {});
  EXPECT_EQ(flat.ids, (std::vector<int32_t>{0, 1, 2}));
  for (float w : flat.weights) EXPECT_NEAR(w, 1.0 / 3, 1e-6);
  // A bias and a routed_scaling change nothing.
  MoeShape scaled = routing_shape(4, 1, 1, 2, Scoring::kSoftmax);
  scaled.routed_scaling = 7.0f;
  const RouterOutput other = route_one(scaled, {0, 2, 1, 1}, {100.0f, -100.0f, 0.0f, 50.0f});
  EXPECT_EQ(other.ids, tie.ids);
  EXPECT_EQ(other.weights, tie.weights);
}

// ---- router: properties over seeds ----------------------------------------------------------

// Checks one token's routing against the contract, written with sorting rather than the
// reference's selection scans. Uses the stated f32 formulas for s, choice and group scores.
testing::AssertionResult routing_obeys_contract(const MoeShape& shape, const float* logits,
                                                const std::vector<float>& bias, const int32_t* ids,
                                                const float* weights) {
  const int E = shape.num_experts, K = shape.topk;
  const bool grouped = shape.scoring == Scoring::kSigmoidGrouped;
  std::vector<float> score(E), choice(E);
  if (grouped) {
    for (int e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
      choice[e] = score[e] + bias[e];
    }
  } else {
    const float m = *std::max_element(logits, logits + E);
    float z = 0.0f;
    for (int e = 0; e < E; ++e) z += (score[e] = std::exp(logits[e] - m));
    for (int e = 0; e < E; ++e) choice[e] = score[e] = score[e] / z;
  }
  // kept groups: sort groups by (score desc, id asc)
  const int G = shape.num_groups, per = E / G;
  std::vector<std::pair<float, int>> groups;
  for (int g = 0; g < G; ++g) {
    std::vector<float> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
    std::sort(c.rbegin(), c.rend());
    groups.emplace_back(per >= 2 ? c[0] + c[1] : c[0], g);
  }
  std::sort(groups.begin(), groups.end(), [](auto a, auto b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  std::set<int> kept;
  for (int t = 0; t < (grouped ? shape.topk_groups : 1); ++t) kept.insert(groups[t].second);
  // expected experts: kept-group experts sorted by (choice desc, id asc), first K
  std::vector<int> cand;
  for (int e = 0; e < E; ++e) {
    if (kept.count(e / per)) cand.push_back(e);
  }
  std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  std::set<int> seen, used_groups;
  double sum = 0.0, sum_s = 0.0;
  for (int k = 0; k < K; ++k) {
    if (ids[k] < 0 || ids[k] >= E) return testing::AssertionFailure() << "id " << ids[k];
    if (!seen.insert(ids[k]).second) return testing::AssertionFailure() << "repeated " << ids[k];
    if (!kept.count(ids[k] / per)) {
      return testing::AssertionFailure() << "expert " << ids[k] << " outside the kept groups";
    }
    if (ids[k] != cand[k]) {
      return testing::AssertionFailure()
             << "k " << k << ": id " << ids[k] << ", expected " << cand[k];
    }
    if (!(weights[k] > 0.0f)) return testing::AssertionFailure() << "weight " << weights[k];
    used_groups.insert(ids[k] / per);
    sum += weights[k];
    sum_s += score[ids[k]];
  }
  if (grouped && static_cast<int>(used_groups.size()) > shape.topk_groups) {
    return testing::AssertionFailure() << used_groups.size() << " groups used";
  }
  const double target = grouped ? shape.routed_scaling : 1.0;
  if (std::fabs(sum - target) > 2e-6 * target) {
    return testing::AssertionFailure() << "weights sum to " << sum << ", expected " << target;
  }
  for (int k = 0; k < K; ++k) {  // proportional to the score without bias
    const double want = score[ids[k]] / sum_s * target;
    if (std::fabs(weights[k] - want) > 2e-6 * target) {
      return testing::AssertionFailure() << "weight " << weights[k] << ", expected " << want;
    }
  }
  return testing::AssertionSuccess();
}

TEST(RouterProperties, HoldOverSeedsAndShapes) {
  struct Case {
    int experts, groups, topk_groups, topk;
    Scoring scoring;
  };
  const std::vector<Case> cases = {
      {16, 4, 2, 4, Scoring::kSigmoidGrouped},   // the small layer shape
      {256, 8, 4, 8, Scoring::kSigmoidGrouped},  // DeepSeek-R1 routing
      {64, 8, 1, 8, Scoring::kSigmoidGrouped},   // topk == experts of the kept groups
      {16, 1, 1, 4, Scoring::kSoftmax},         {64, 1, 1, 8, Scoring::kSoftmax},
  };
  constexpr int kTokens = 64;
  int bias_changed = 0, grouped_picks = 0;
  for (const Case& c : cases) {
    const MoeShape shape = routing_shape(c.experts, c.groups, c.topk_groups, c.topk, c.scoring);
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      SCOPED_TRACE("E " + std::to_string(c.experts) + " " + to_string(c.scoring) + " seed " +
                   std::to_string(seed));
      const std::vector<uint16_t> gate = make_gate_weight(shape, seed);
      const std::vector<float> bias = make_correction_bias(shape, seed);
      const std::vector<uint16_t> x = make_moe_input(shape, kTokens, seed + 100);
      const std::vector<float> logits = router_logits(shape, gate, x, kTokens);
      const RouterOutput r = route_from_logits(shape, logits, bias, kTokens);
      ASSERT_EQ(r.num_tokens, kTokens);
      ASSERT_EQ(r.topk, c.topk);
      ASSERT_EQ(r.ids.size(), static_cast<size_t>(kTokens) * c.topk);
      ASSERT_EQ(r.weights.size(), r.ids.size());
      const RouterOutput unbiased =
          route_from_logits(shape, logits, std::vector<float>(c.experts, 0.0f), kTokens);
      for (int n = 0; n < kTokens; ++n) {
        const size_t o = static_cast<size_t>(n) * c.topk;
        ASSERT_TRUE(routing_obeys_contract(shape, logits.data() + n * c.experts, bias,
                                           r.ids.data() + o, r.weights.data() + o))
            << "token " << n;
        if (c.scoring != Scoring::kSigmoidGrouped) continue;
        for (int k = 0; k < c.topk; ++k) {  // picks the bias brought in
          const auto first = unbiased.ids.begin() + o, last = first + c.topk;
          bias_changed += std::find(first, last, r.ids[o + k]) == last;
          ++grouped_picks;
        }
      }
    }
  }
  // The generated bias matters without dominating: it changes a share of the picks (measured
  // 13 % at E 16 top-4, 40 % at E 64 and 44 % at E 256 top-8, 33 % over all three).
  std::printf("[ measured ] correction bias changed %d of %d picks\n", bias_changed, grouped_picks);
  EXPECT_GT(bias_changed, grouped_picks / 10);
  EXPECT_LT(bias_changed, grouped_picks * 6 / 10);
}

TEST(RouterLogits, MatchDoublePrecisionDotProducts) {
  const MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(1);
  constexpr int kTokens = 16;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 9);
  const std::vector<float> logits = router_logits(shape, w.gate, x, kTokens);
  std::vector<double> xd(x.size()), gd(w.gate.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = bf16_to_float(x[i]);
  for (size_t i = 0; i < gd.size(); ++i) gd[i] = bf16_to_float(w.gate[i]);
  const DotF64 want = gemm_nt_f64(xd, gd, kTokens, shape.num_experts, shape.hidden);
  EXPECT_TRUE(within_dot_bound(logits, want.value, want.abs_sum, shape.hidden, "logits"));
  // Logits of std ~1, as the gate's 1/sqrt(H) scaling intends.
  double sq = 0.0;
  for (float l : logits) sq += static_cast<double>(l) * l;
  const double rms = std::sqrt(sq / logits.size());
  EXPECT_GT(rms, 0.5);
  EXPECT_LT(rms, 2.0);
}

// ---- generation -----------------------------------------------------------------------------

// The generator formula as the header documents it, written out again so a device kernel that
// follows the documentation reproduces these bytes.
uint64_t mix_as_documented(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TEST(Generation, FollowsTheDocumentedFormula) {
  EXPECT_EQ(splitmix64_mix(0), 0u);
  EXPECT_EQ(splitmix64_mix(0x1234), mix_as_documented(0x1234));
  const uint64_t seed = 42;
  const MoeShape shape = small_shape();
  const uint64_t key = mix_as_documented(seed ^ mix_as_documented((3ull << 32) | 4u));
  EXPECT_EQ(generator_key(seed, GenTensor::kW1, 3), key);
  EXPECT_EQ(generator_key(seed, GenTensor::kW1, kSharedExpert),
            mix_as_documented(seed ^ mix_as_documented(3ull << 32)));
  const float step = generator_step(1.0 / 16.0);  // 1/sqrt(H = 256)
  EXPECT_EQ(step, static_cast<float>(1.0 / 16.0 / std::sqrt(8.0 * (65536.0 * 65536.0 - 1) / 12)));
  const MasterExpertWeights m = make_master_expert_weights(shape, seed, 3);
  for (uint64_t i : {0ull, 1ull, 777ull, 65535ull}) {
    int64_t sum = 0;
    for (uint64_t c = 2 * i; c < 2 * i + 2; ++c) {
      const uint64_t h = mix_as_documented(key + (c + 1) * 0x9E3779B97F4A7C15ull);
      for (int lane = 0; lane < 4; ++lane) sum += (h >> (16 * lane)) & 0xFFFF;
    }
    const int32_t centred = static_cast<int32_t>(sum - 4 * 65535);
    EXPECT_EQ(centred_uniform_sum(key, i), centred);
    EXPECT_EQ(m.w1[i], static_cast<float>(centred) * step) << "index " << i;
  }
  // The gate is the bf16 rounding of its f32 values.
  const std::vector<uint16_t> gate = make_gate_weight(shape, seed);
  const uint64_t gkey = generator_key(seed, GenTensor::kGate, kSharedExpert);
  EXPECT_EQ(gate[100], bf16_from_float(static_cast<float>(centred_uniform_sum(gkey, 100)) * step));
  // The fp8 weights are the block quantisation of the master weights.
  const ExpertWeights q = make_expert_weights(shape, seed, 3);
  const Fp8BlockMatrix w2 = quantize_fp8_block128(m.w2, m.hidden, m.intermediate);
  EXPECT_EQ(q.w2.q, w2.q);
  EXPECT_EQ(q.w2.scales, w2.scales);
}

TEST(Generation, DeterministicBySeedAndIndependentPerExpert) {
  const MoeShape shape = small_shape();
  const MoeWeights& a = small_weights(1);
  const MoeWeights b = make_moe_weights(shape, 1);
  EXPECT_EQ(a.gate, b.gate);
  EXPECT_EQ(a.correction_bias, b.correction_bias);
  for (int e = 0; e < shape.num_experts; ++e) {
    EXPECT_EQ(a.experts[e].w1.q, b.experts[e].w1.q);
    EXPECT_EQ(a.experts[e].w3.scales, b.experts[e].w3.scales);
    EXPECT_EQ(a.experts[e].w2.q, b.experts[e].w2.q);
  }
  ASSERT_TRUE(a.shared && b.shared);
  EXPECT_EQ(a.shared->w1.q, b.shared->w1.q);
  // Another seed changes everything; another expert or tensor has its own values.
  const MoeWeights& c = small_weights(2);
  EXPECT_NE(a.gate, c.gate);
  EXPECT_NE(a.correction_bias, c.correction_bias);
  EXPECT_NE(a.experts[0].w1.q, c.experts[0].w1.q);
  EXPECT_NE(a.shared->w2.q, c.shared->w2.q);
  EXPECT_NE(a.experts[0].w1.q, a.experts[1].w1.q);
  EXPECT_NE(a.experts[0].w1.q, a.experts[0].w3.q);
  EXPECT_NE(a.experts[0].w1.q, a.shared->w1.q);
  // A rank that generates only its local experts gets the one-rank bytes, also under a shape
  // with a different expert count or routing.
  MoeShape wider = shape;
  wider.num_experts = 64;
  wider.num_groups = 8;
  const ExpertWeights e5 = make_expert_weights(wider, 1, 5);
  EXPECT_EQ(e5.w1.q, a.experts[5].w1.q);
  EXPECT_EQ(e5.w2.scales, a.experts[5].w2.scales);
  // Inputs too.
  EXPECT_EQ(make_moe_input(shape, 4, 3), make_moe_input(shape, 4, 3));
  EXPECT_NE(make_moe_input(shape, 4, 3), make_moe_input(shape, 4, 4));
  EXPECT_TRUE(make_moe_input(shape, 0, 3).empty());
}

struct Moments {
  double mean = 0, std = 0, max_abs = 0;
};
Moments moments(const std::vector<float>& v) {
  Moments m;
  for (float x : v) m.mean += x;
  m.mean /= static_cast<double>(v.size());
  for (float x : v) {
    m.std += (x - m.mean) * (x - m.mean);
    m.max_abs = std::max(m.max_abs, std::fabs(static_cast<double>(x)));
  }
  m.std = std::sqrt(m.std / static_cast<double>(v.size()));
  return m;
}

TEST(Generation, RealisticMagnitudes) {
  MoeShape shape = small_shape();
  shape.intermediate = 512;  // fan-ins differ between the projections
  const MasterExpertWeights m = make_master_expert_weights(shape, 7, 0);
  const auto expect_std = [](const std::vector<float>& v, double want, const char* what) {
    const Moments mo = moments(v);
    EXPECT_NEAR(mo.std, want, 0.02 * want) << what;
    EXPECT_LT(std::fabs(mo.mean), 5 * want / std::sqrt(static_cast<double>(v.size()))) << what;
    EXPECT_LE(mo.max_abs, 4.9 * want) << what;  // Irwin-Hall tails are cut at 4.9 sigma
    EXPECT_GT(mo.max_abs, 3.5 * want) << what;  // but reach well past 3 sigma
  };
  expect_std(m.w1, 1.0 / 16.0, "w1");  // 1/sqrt(H)
  expect_std(m.w3, 1.0 / 16.0, "w3");
  expect_std(m.w2, 1.0 / std::sqrt(512.0), "w2");  // 1/sqrt(I)
  std::vector<float> gate;
  for (uint16_t g : make_gate_weight(shape, 7)) gate.push_back(bf16_to_float(g));
  EXPECT_NEAR(moments(gate).std, 1.0 / 16.0, 0.05 / 16.0);
  MoeShape many = routing_shape(256, 8, 4, 8, Scoring::kSigmoidGrouped);
  EXPECT_NEAR(moments(make_correction_bias(many, 7)).std, kCorrectionBiasStd,
              0.2 * kCorrectionBiasStd);
  // Inputs: std ~1 apart from about one outlier of magnitude 16..23 in 512 elements.
  const std::vector<uint16_t> x = make_moe_input(shape, 64, 7);
  std::vector<float> body;
  int outliers = 0;
  for (uint16_t b : x) {
    const float f = bf16_to_float(b);
    if (std::fabs(f) >= 16.0f) {
      ++outliers;
      EXPECT_LE(std::fabs(f), 23.0f);
    } else {
      body.push_back(f);
    }
  }
  EXPECT_NEAR(moments(body).std, 1.0, 0.03);
  EXPECT_GE(outliers, 10);  // 16384 / 512 = 32 expected
  EXPECT_LE(outliers, 64);
  // 128x128 fp8 quantisation keeps the weights within a few per cent.
  const ExpertWeights q = make_expert_weights(shape, 7, 0);
  const std::vector<float> d = q.w1.dequantize();
  std::vector<double> master(m.w1.begin(), m.w1.end());
  const double rel = rel_frobenius(d, master);
  std::printf("[ measured ] fp8 128x128 weight quantisation: ||d|| / ||w|| = %.4f\n", rel);
  EXPECT_LT(rel, 0.04);  // measured 0.0265
}

TEST(Fp8Blocks, ScalesAreRowMajorPerBlockAndFollowTheAmaxRule) {
  // 256 x 384: 2 x 3 blocks. Block (i, j) holds one element of magnitude 1 + 3 i + j, the rest
  // are small; block (1, 2) is all zero and gets scale 1 / 448.
  constexpr int kRows = 256, kCols = 384;
  std::vector<float> m(kRows * kCols, 0.0f);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      if (i == 1 && j == 2) continue;
      for (int r = 0; r < 128; ++r) {
        for (int c = 0; c < 128; ++c)
          m[(i * 128 + r) * kCols + j * 128 + c] = 0.001f * ((r + c) % 7);
      }
      const float peak = (j % 2 == 0 ? 1.0f : -1.0f) * static_cast<float>(1 + 3 * i + j);
      m[(i * 128 + 17 + i) * kCols + j * 128 + 5 + j] = peak;
    }
  }
  const Fp8BlockMatrix q = quantize_fp8_block128(m, kRows, kCols);
  ASSERT_EQ(q.scales.size(), 6u);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      const float amax = (i == 1 && j == 2) ? 1.0f : static_cast<float>(1 + 3 * i + j);
      EXPECT_EQ(q.scales[i * 3 + j], amax / 448.0f) << "block " << i << "," << j;
      EXPECT_EQ(q.scale_at(i * 128 + 100, j * 128 + 1), amax / 448.0f);
    }
  }
  // The peak of a block quantises to +-448 exactly (codes 0x7E / 0xFE) and dequantises back.
  EXPECT_EQ(q.q[(17) * kCols + 5], 0x7E);
  EXPECT_EQ(q.q[(17) * kCols + 128 + 6], 0xFE);
  EXPECT_EQ(q.value(17, 5), 1.0f);
  EXPECT_NEAR(q.value(128 + 18, 128 + 6), -5.0f, 1e-6f);
  for (int c = 0; c < 128; ++c) EXPECT_EQ(q.q[(128 + 3) * kCols + 256 + c], 0);
  // value() is fp8 * scale; dequantize() agrees with it.
  const std::vector<float> d = q.dequantize();
  EXPECT_EQ(d[(5) * kCols + 200], fp8_to_float(q.q[5 * kCols + 200]) * q.scales[1]);
  EXPECT_EQ(d[(200) * kCols + 300], q.value(200, 300));
}

// ---- expert math ----------------------------------------------------------------------------

// Every stage of the pipeline against double precision on the operands that stage received.
testing::AssertionResult stages_match_f64(const ExpertWeights& w, const std::vector<uint16_t>& x,
                                          int num_tokens, const ExpertStages& s) {
  const int H = w.hidden(), I = w.intermediate();
  // 1. quantisation of the bf16 input: exactly quantize_fp8
  std::vector<uint8_t> xq(x.size());
  std::vector<float> xs(static_cast<size_t>(num_tokens) * (H / 128));
  quantize_fp8(x.data(), num_tokens, H, xq.data(), xs.data());
  if (s.x_q != xq || s.x_scales != xs) return testing::AssertionFailure() << "x_q / x_scales";
  // 2. h1, h3 = dequant(x_q) . dequant(W)^T
  const std::vector<double> a = dequant_rows_f64(s.x_q, s.x_scales, H);
  const DotF64 h1 = gemm_nt_f64(a, dequant_f64(w.w1), num_tokens, I, H);
  const DotF64 h3 = gemm_nt_f64(a, dequant_f64(w.w3), num_tokens, I, H);
  if (auto r = within_dot_bound(s.h1, h1.value, h1.abs_sum, H, "h1"); !r) return r;
  if (auto r = within_dot_bound(s.h3, h3.value, h3.abs_sum, H, "h3"); !r) return r;
  // 3. act = silu(h1) * h3 on the f32 h1, h3; then the bf16 rounding and the fp8 quantisation
  for (size_t i = 0; i < s.act.size(); ++i) {
    const double h = s.h1[i];
    const double want = h / (1.0 + std::exp(-h)) * s.h3[i];
    if (std::fabs(s.act[i] - want) > 16 * kF32Unit * std::fabs(want)) {
      return testing::AssertionFailure() << "act[" << i << "] = " << s.act[i] << ", f64 " << want;
    }
    if (s.act_bf16[i] != bf16_from_float(s.act[i])) {
      return testing::AssertionFailure() << "act_bf16[" << i << "]";
    }
  }
  std::vector<uint8_t> aq(s.act_bf16.size());
  std::vector<float> as(static_cast<size_t>(num_tokens) * (I / 128));
  quantize_fp8(s.act_bf16.data(), num_tokens, I, aq.data(), as.data());
  if (s.act_q != aq || s.act_scales != as) return testing::AssertionFailure() << "act_q / scales";
  // 4. out = dequant(act_q) . dequant(W2)^T
  const DotF64 out =
      gemm_nt_f64(dequant_rows_f64(s.act_q, s.act_scales, I), dequant_f64(w.w2), num_tokens, H, I);
  return within_dot_bound(s.out, out.value, out.abs_sum, I, "out");
}

TEST(ExpertMath, EveryStageMatchesDoublePrecisionOnDequantisedValues) {
  const MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(1);
  constexpr int kTokens = 8;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 11);
  for (const ExpertWeights* e : {&w.experts[3], &w.experts[12], &*w.shared}) {
    const ExpertStages s = expert_forward_stages(*e, x, kTokens);
    ASSERT_EQ(s.num_tokens, kTokens);
    ASSERT_EQ(s.hidden, 256);
    ASSERT_EQ(s.intermediate, 256);
    EXPECT_TRUE(stages_match_f64(*e, x, kTokens, s));
    EXPECT_EQ(expert_forward(*e, x, kTokens), s.out);
  }
  // The measured f32 error is far inside the bound: relative Frobenius of out 4e-8.
  const ExpertStages s = expert_forward_stages(w.experts[3], x, kTokens);
  const DotF64 out = gemm_nt_f64(dequant_rows_f64(s.act_q, s.act_scales, 256),
                                 dequant_f64(w.experts[3].w2), kTokens, 256, 256);
  const double rel = rel_frobenius(s.out, out.value);
  std::printf("[ measured ] expert out, f32 pipeline vs f64 on dequantised values: %.2e\n", rel);
  EXPECT_LT(rel, 1e-6);
}

TEST(ExpertMath, RowsAreIndependentAndIntermediateMayDifferFromHidden) {
  MoeShape shape = small_shape();
  shape.intermediate = 384;
  const ExpertWeights w = make_expert_weights(shape, 5, 2);
  constexpr int kTokens = 3;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 6);
  const ExpertStages all = expert_forward_stages(w, x, kTokens);
  EXPECT_TRUE(stages_match_f64(w, x, kTokens, all));
  for (int n = 0; n < kTokens; ++n) {
    const std::vector<uint16_t> row(x.begin() + n * 256, x.begin() + (n + 1) * 256);
    const std::vector<float> one = expert_forward(w, row, 1);
    EXPECT_TRUE(std::equal(one.begin(), one.end(), all.out.begin() + n * 256)) << "row " << n;
  }
  EXPECT_TRUE(expert_forward(w, {}, 0).empty());
}

// ---- the layer ------------------------------------------------------------------------------

TEST(MoeLayer, IsTheWeightedSumOfExpertsPlusTheSharedExpert) {
  const MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(1);
  constexpr int kTokens = 12;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 21);
  const std::vector<float> y = moe_forward_reference(shape, w, x, kTokens);
  const RouterOutput r = route(shape, w, x, kTokens);
  EXPECT_EQ(moe_forward_routed(shape, w, x, kTokens, r), y);
  // y[n] = fmaf over k ascending of w_k * expert_{id_k}(x[n]), then + shared(x[n]).
  const std::vector<float> shared = expert_forward(*w.shared, x, kTokens);
  for (int n = 0; n < kTokens; ++n) {
    const std::vector<uint16_t> row(x.begin() + n * 256, x.begin() + (n + 1) * 256);
    std::vector<float> acc(256, 0.0f);
    for (int k = 0; k < shape.topk; ++k) {
      const std::vector<float> out = expert_forward(w.experts[r.ids[n * 4 + k]], row, 1);
      for (int h = 0; h < 256; ++h) acc[h] = std::fmaf(r.weights[n * 4 + k], out[h], acc[h]);
    }
    for (int h = 0; h < 256; ++h) acc[h] += shared[n * 256 + h];
    EXPECT_TRUE(std::equal(acc.begin(), acc.end(), y.begin() + n * 256)) << "token " << n;
  }
}

TEST(MoeLayer, RoutedForwardSkipsMinusOneEntries) {
  MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(1);
  constexpr int kTokens = 2;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 22);
  RouterOutput r{.num_tokens = kTokens,
                 .topk = 2,
                 .ids = {-1, 7, -1, -1},
                 .weights = {9.0f, 0.5f, 9.0f, 9.0f}};
  const std::vector<float> y = moe_forward_routed(shape, w, x, kTokens, r);
  const std::vector<float> e7 = expert_forward(w.experts[7], std::span(x).first(256), 1);
  const std::vector<float> shared = expert_forward(*w.shared, x, kTokens);
  for (int h = 0; h < 256; ++h) {
    EXPECT_EQ(y[h], std::fmaf(0.5f, e7[h], 0.0f) + shared[h]);
    EXPECT_EQ(y[256 + h], 0.0f + shared[256 + h]);  // no routed expert: the shared one only
  }
}

TEST(MoeLayer, DeterministicBySeedAndTokensAreIndependent) {
  const MoeShape shape = small_shape();
  constexpr int kTokens = 10;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 31);
  const std::vector<float> y = moe_forward_reference(shape, small_weights(1), x, kTokens);
  const MoeWeights again = make_moe_weights(shape, 1);
  EXPECT_EQ(moe_forward_reference(shape, again, make_moe_input(shape, kTokens, 31), kTokens), y);
  EXPECT_NE(moe_forward_reference(shape, small_weights(2), x, kTokens), y);
  EXPECT_NE(moe_forward_reference(shape, again, make_moe_input(shape, kTokens, 32), kTokens), y);
  // Splitting the batch (as a chunked GPU layer does) changes no bit.
  const std::vector<uint16_t> head(x.begin(), x.begin() + 4 * 256),
      tail(x.begin() + 4 * 256, x.end());
  std::vector<float> parts = moe_forward_reference(shape, again, head, 4);
  const std::vector<float> rest = moe_forward_reference(shape, again, tail, kTokens - 4);
  parts.insert(parts.end(), rest.begin(), rest.end());
  EXPECT_EQ(parts, y);
  EXPECT_TRUE(moe_forward_reference(shape, again, {}, 0).empty());
}

// The stated fp8 tolerance: the quantised layer against the same layer in f64 with the master
// (unquantised) weights and no activation quantisation, same routing (routing has no fp8 step).
TEST(MoeLayer, QuantisedPipelineIsWithinTheFp8ToleranceOfAnUnquantisedF64Layer) {
  constexpr int kTokens = 32;
  for (Scoring scoring : {Scoring::kSigmoidGrouped, Scoring::kSoftmax}) {
    const MoeShape shape = small_shape(scoring);
    const MoeWeights w =
        scoring == Scoring::kSigmoidGrouped ? small_weights(3) : make_moe_weights(shape, 3);
    const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 41);
    const RouterOutput r = route(shape, w, x, kTokens);
    const std::vector<float> y = moe_forward_routed(shape, w, x, kTokens, r);
    const std::vector<double> want = layer_f64(shape, 3, x, kTokens, r);
    const testing::AssertionResult verdict = rel_frobenius_below(y, want, kLayerTolerance);
    std::printf("[ measured ] %s layer, fp8 vs unquantised f64: %s\n", to_string(scoring),
                verdict.message());
    EXPECT_TRUE(verdict);
    double worst = 0.0;
    for (int n = 0; n < kTokens; ++n) {
      const std::vector<float> yt(y.begin() + n * 256, y.begin() + (n + 1) * 256);
      const std::vector<double> wt(want.begin() + n * 256, want.begin() + (n + 1) * 256);
      EXPECT_TRUE(rel_frobenius_below(yt, wt, kTokenTolerance)) << "token " << n;
      worst = std::max(worst, rel_frobenius(yt, wt));
    }
    std::printf("[ measured ] %s layer, worst token: %.4f\n", to_string(scoring), worst);
  }
}

// Every comparison above can fail: feed it wrong answers and watch it object.
TEST(MoeLayer, NegativeChecksCatchWrongAnswers) {
  const MoeShape shape = small_shape();
  const MoeWeights& w = small_weights(3);
  constexpr int kTokens = 32;
  const std::vector<uint16_t> x = make_moe_input(shape, kTokens, 41);
  const RouterOutput r = route(shape, w, x, kTokens);
  const std::vector<double> want = layer_f64(shape, 3, x, kTokens, r);
  ASSERT_TRUE(
      rel_frobenius_below(moe_forward_routed(shape, w, x, kTokens, r), want, kLayerTolerance));
  // (a) routed_scaling forgotten: weights sum to 1 instead of 2.5.
  RouterOutput unscaled = r;
  for (float& v : unscaled.weights) v /= 2.5f;
  EXPECT_FALSE(rel_frobenius_below(moe_forward_routed(shape, w, x, kTokens, unscaled), want,
                                   kLayerTolerance));
  // (b) one token sent to a wrong expert.
  RouterOutput wrong = r;
  wrong.ids[0] = (wrong.ids[0] + 8) % 16;
  const std::vector<float> y_wrong = moe_forward_routed(shape, w, x, kTokens, wrong);
  const std::vector<float> y0(y_wrong.begin(), y_wrong.begin() + 256);
  const std::vector<double> w0(want.begin(), want.begin() + 256);
  EXPECT_FALSE(rel_frobenius_below(y0, w0, kTokenTolerance));
  // (c) the shared expert left out.
  MoeShape no_shared_shape = shape;
  no_shared_shape.shared_intermediate = 0;
  MoeWeights no_shared = w;
  no_shared.shared.reset();
  EXPECT_FALSE(rel_frobenius_below(moe_forward_routed(no_shared_shape, no_shared, x, kTokens, r),
                                   want, kLayerTolerance));
  // (d) one GEMM output off by 1e-2 (its f32 bound is about 2e-4).
  const std::vector<uint16_t> x2(x.begin(), x.begin() + 2 * 256);
  ExpertStages s = expert_forward_stages(w.experts[0], x2, 2);
  ASSERT_TRUE(stages_match_f64(w.experts[0], x2, 2, s));
  s.h3[17] += 1e-2f;
  EXPECT_FALSE(stages_match_f64(w.experts[0], x2, 2, s));
  // (e) a routing that breaks a tie the wrong way.
  const std::vector<float> tie_logits(8, 0.0f);
  const std::vector<int32_t> bad_ids = {1, 0, 2};
  const std::vector<float> ok_weights(3, 2.5f / 3);
  EXPECT_FALSE(routing_obeys_contract(routing_shape(8, 4, 2, 3, Scoring::kSigmoidGrouped),
                                      tie_logits.data(), std::vector<float>(8, 0.0f),
                                      bad_ids.data(), ok_weights.data()));
}

}  // namespace
}  // namespace epx::ref::moe
