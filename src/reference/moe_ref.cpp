// CPU reference of the MoE layer: shape validation, seeded weights, router, fp8 experts.
// Written for clarity and for the order of operations stated in moe_ref.hpp, not for speed;
// tests use small shapes.

#include "reference/moe_ref.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/error.hpp"

namespace epx::ref::moe {
namespace {

std::string str(int v) { return std::to_string(v); }

// "[a][b]", built by appending (GCC 12 warns falsely on "literal" + std::string&& chains).
std::string dims(int a, int b) {
  std::string s = "[";
  s += str(a);
  s += "][";
  s += str(b);
  s += "]";
  return s;
}

// Index of the largest v[i] among allowed i, scanning ascending so a tie keeps the lower index;
// -1 when nothing is allowed. A strict comparison never lets a NaN win and never throws it out
// once it is first, so the result is deterministic whatever the values.
template <typename Allowed>
int argmax_first(std::span<const float> v, Allowed&& allowed) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(v.size()); ++i) {
    if (!allowed(i)) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

// m has positive dimensions that are multiples of 128, rows * cols codes and one scale per block.
bool matrix_consistent(const Fp8BlockMatrix& m) {
  return m.rows > 0 && m.cols > 0 && m.rows % kWeightBlock == 0 && m.cols % kWeightBlock == 0 &&
         m.q.size() == static_cast<size_t>(m.rows) * static_cast<size_t>(m.cols) &&
         m.scales.size() == static_cast<size_t>(m.rows / kWeightBlock) *
                                static_cast<size_t>(m.cols / kWeightBlock);
}

void check_expert(const ExpertWeights& w, int hidden, int intermediate, const std::string& who) {
  const auto dims_of = [](const Fp8BlockMatrix& m) { return dims(m.rows, m.cols); };
  const auto ok = [](const Fp8BlockMatrix& m, int rows, int cols) {
    return m.rows == rows && m.cols == cols && matrix_consistent(m);
  };
  const std::string ih = dims(intermediate, hidden) + " with matching q and scales";
  const std::string hi = dims(hidden, intermediate) + " with matching q and scales";
  EPX_CHECK(ok(w.w1, intermediate, hidden), InputError, who + ".w1", dims_of(w.w1), ih);
  EPX_CHECK(ok(w.w3, intermediate, hidden), InputError, who + ".w3", dims_of(w.w3), ih);
  EPX_CHECK(ok(w.w2, hidden, intermediate), InputError, who + ".w2", dims_of(w.w2), hi);
}

void check_weights(const MoeShape& shape, const MoeWeights& w) {
  const size_t e = static_cast<size_t>(shape.num_experts);
  EPX_CHECK(w.gate.size() == e * static_cast<size_t>(shape.hidden), InputError,
            "weights.gate.size()", w.gate.size(),
            "num_experts * hidden = " + std::to_string(e * static_cast<size_t>(shape.hidden)));
  EPX_CHECK(w.correction_bias.size() == e, InputError, "weights.correction_bias.size()",
            w.correction_bias.size(), "num_experts = " + str(shape.num_experts));
  EPX_CHECK(w.experts.size() == e, InputError, "weights.experts.size()", w.experts.size(),
            "num_experts = " + str(shape.num_experts));
  for (size_t i = 0; i < e; ++i) {
    check_expert(w.experts[i], shape.hidden, shape.intermediate,
                 "weights.experts[" + std::to_string(i) + "]");
  }
  EPX_CHECK(w.shared.has_value() == shape.has_shared_expert(), InputError, "weights.shared",
            w.shared ? "present" : "absent",
            std::string(shape.has_shared_expert() ? "present" : "absent") +
                " (shared_intermediate = " + str(shape.shared_intermediate) + ")");
  if (w.shared) check_expert(*w.shared, shape.hidden, shape.shared_intermediate, "weights.shared");
}

void check_tokens(std::span<const uint16_t> x, int num_tokens, int hidden) {
  EPX_CHECK(num_tokens >= 0, InputError, "num_tokens", num_tokens, ">= 0");
  EPX_CHECK(x.size() == static_cast<size_t>(num_tokens) * static_cast<size_t>(hidden), InputError,
            "x.size()", x.size(), "num_tokens * hidden = " + str(num_tokens) + " * " + str(hidden));
}

void check_expert_id(const MoeShape& shape, int expert) {
  EPX_CHECK((expert >= 0 && expert < shape.num_experts) ||
                (expert == kSharedExpert && shape.has_shared_expert()),
            InputError, "expert", expert,
            "in [0, num_experts = " + str(shape.num_experts) + ")" +
                (shape.has_shared_expert() ? " or kSharedExpert = -1"
                                           : " (this shape has no shared expert)"));
}

// [rows][cols] f32 from the tensor's generator stream.
std::vector<float> generate(uint64_t seed, GenTensor tensor, int expert, size_t count,
                            double stddev) {
  const uint64_t key = generator_key(seed, tensor, expert);
  const float step = generator_step(stddev);
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(centred_uniform_sum(key, i)) * step;
  return v;
}

float silu(float h) { return h / (1.0f + std::exp(-h)); }

}  // namespace

const char* to_string(Scoring s) {
  switch (s) {
    case Scoring::kSigmoidGrouped:
      return "sigmoid_grouped";
    case Scoring::kSoftmax:
      return "softmax";
  }
  return "unknown";
}

// ---- fp8 block matrices ----------------------------------------------------------------------

float Fp8BlockMatrix::scale_at(int r, int c) const {
  return scales[static_cast<size_t>(r / kWeightBlock) * static_cast<size_t>(cols / kWeightBlock) +
                static_cast<size_t>(c / kWeightBlock)];
}

float Fp8BlockMatrix::value(int r, int c) const {
  return fp8_table()[q[static_cast<size_t>(r) * cols + c]] * scale_at(r, c);
}

std::vector<float> Fp8BlockMatrix::dequantize() const {
  std::vector<float> out(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) out[static_cast<size_t>(r) * cols + c] = value(r, c);
  }
  return out;
}

Fp8BlockMatrix quantize_fp8_block128(std::span<const float> m, int rows, int cols) {
  EPX_CHECK(rows >= 0 && rows % kWeightBlock == 0, InputError, "rows", rows,
            "a non-negative multiple of 128");
  EPX_CHECK(cols >= 0 && cols % kWeightBlock == 0, InputError, "cols", cols,
            "a non-negative multiple of 128");
  EPX_CHECK(m.size() == static_cast<size_t>(rows) * static_cast<size_t>(cols), InputError,
            "m.size()", m.size(), "rows * cols = " + str(rows) + " * " + str(cols));
  Fp8BlockMatrix out;
  out.rows = rows;
  out.cols = cols;
  out.q.resize(m.size());
  const int block_rows = rows / kWeightBlock;
  const int block_cols = cols / kWeightBlock;
  out.scales.resize(static_cast<size_t>(block_rows) * block_cols);
  for (int bi = 0; bi < block_rows; ++bi) {
    for (int bj = 0; bj < block_cols; ++bj) {
      const auto at = [&](int i, int j) {
        return static_cast<size_t>(bi * kWeightBlock + i) * cols + bj * kWeightBlock + j;
      };
      float amax = 0.0f;  // NaN never wins a comparison, as in quantize_fp8
      for (int i = 0; i < kWeightBlock; ++i) {
        for (int j = 0; j < kWeightBlock; ++j) amax = std::max(amax, std::fabs(m[at(i, j)]));
      }
      const float a = amax > 0.0f ? amax : 1.0f;
      const float inv = kFp8Max / a;
      out.scales[static_cast<size_t>(bi) * block_cols + bj] = a / kFp8Max;
      for (int i = 0; i < kWeightBlock; ++i) {
        for (int j = 0; j < kWeightBlock; ++j) out.q[at(i, j)] = fp8_from_float(m[at(i, j)] * inv);
      }
    }
  }
  return out;
}

// ---- generation ------------------------------------------------------------------------------

uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t generator_key(uint64_t seed, GenTensor tensor, int expert) {
  const uint64_t id = (static_cast<uint64_t>(tensor) << 32) |
                      static_cast<uint64_t>(static_cast<uint32_t>(expert + 1));
  return splitmix64_mix(seed ^ splitmix64_mix(id));
}

int32_t centred_uniform_sum(uint64_t key, uint64_t index) {
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  int32_t sum = 0;
  for (uint64_t c = 2 * index; c < 2 * index + 2; ++c) {
    const uint64_t h = splitmix64_mix(key + (c + 1) * kGamma);
    for (int lane = 0; lane < 4; ++lane) sum += static_cast<int32_t>((h >> (16 * lane)) & 0xFFFF);
  }
  return sum - 4 * 65535;  // 8 lanes of mean 65535 / 2
}

float generator_step(double stddev) {
  // Variance of one uniform lane on {0 .. 65535} is (65536^2 - 1) / 12; eight are summed.
  const double sum_std = std::sqrt(8.0 * (65536.0 * 65536.0 - 1.0) / 12.0);
  return static_cast<float>(stddev / sum_std);
}

MasterExpertWeights make_master_expert_weights(const MoeShape& shape, uint64_t seed, int expert) {
  shape.validate();
  check_expert_id(shape, expert);
  MasterExpertWeights m;
  m.hidden = shape.hidden;
  m.intermediate = expert == kSharedExpert ? shape.shared_intermediate : shape.intermediate;
  const size_t elems = static_cast<size_t>(m.hidden) * static_cast<size_t>(m.intermediate);
  const double std_in = 1.0 / std::sqrt(static_cast<double>(m.hidden));
  const double std_down = 1.0 / std::sqrt(static_cast<double>(m.intermediate));
  m.w1 = generate(seed, GenTensor::kW1, expert, elems, std_in);
  m.w3 = generate(seed, GenTensor::kW3, expert, elems, std_in);
  m.w2 = generate(seed, GenTensor::kW2, expert, elems, std_down);
  return m;
}

ExpertWeights make_expert_weights(const MoeShape& shape, uint64_t seed, int expert) {
  const MasterExpertWeights m = make_master_expert_weights(shape, seed, expert);
  ExpertWeights w;
  w.w1 = quantize_fp8_block128(m.w1, m.intermediate, m.hidden);
  w.w3 = quantize_fp8_block128(m.w3, m.intermediate, m.hidden);
  w.w2 = quantize_fp8_block128(m.w2, m.hidden, m.intermediate);
  return w;
}

std::vector<uint16_t> make_gate_weight(const MoeShape& shape, uint64_t seed) {
  shape.validate();
  const std::vector<float> g =
      generate(seed, GenTensor::kGate, kSharedExpert,
               static_cast<size_t>(shape.num_experts) * static_cast<size_t>(shape.hidden),
               1.0 / std::sqrt(static_cast<double>(shape.hidden)));
  std::vector<uint16_t> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = bf16_from_float(g[i]);
  return out;
}

std::vector<float> make_correction_bias(const MoeShape& shape, uint64_t seed) {
  shape.validate();
  return generate(seed, GenTensor::kCorrectionBias, kSharedExpert,
                  static_cast<size_t>(shape.num_experts), kCorrectionBiasStd);
}

MoeWeights make_moe_weights(const MoeShape& shape, uint64_t seed) {
  shape.validate();
  MoeWeights w;
  w.gate = make_gate_weight(shape, seed);
  w.correction_bias = make_correction_bias(shape, seed);
  w.experts.reserve(static_cast<size_t>(shape.num_experts));
  for (int e = 0; e < shape.num_experts; ++e)
    w.experts.push_back(make_expert_weights(shape, seed, e));
  if (shape.has_shared_expert()) w.shared = make_expert_weights(shape, seed, kSharedExpert);
  return w;
}

std::vector<uint16_t> make_moe_input(const MoeShape& shape, int num_tokens, uint64_t seed) {
  shape.validate();
  EPX_CHECK(num_tokens >= 0, InputError, "num_tokens", num_tokens, ">= 0");
  const size_t elems = static_cast<size_t>(num_tokens) * static_cast<size_t>(shape.hidden);
  const std::vector<float> v = generate(seed, GenTensor::kInput, kSharedExpert, elems, 1.0);
  const uint64_t outlier_key = generator_key(seed, GenTensor::kInputOutlier, kSharedExpert);
  std::vector<uint16_t> x(elems);
  for (size_t i = 0; i < elems; ++i) {
    float f = v[i];
    const uint64_t o = splitmix64_mix(outlier_key + (i + 1) * 0x9E3779B97F4A7C15ull);
    if ((o & 511u) == 0) {
      // Large activations in a few channels, as real hidden states have; they make the 1x128
      // scales of a row differ between blocks.
      const float magnitude = static_cast<float>(16 + ((o >> 9) & 7u));
      f = f < 0.0f ? -magnitude : magnitude;
    }
    x[i] = bf16_from_float(f);
  }
  return x;
}

// ---- router ----------------------------------------------------------------------------------

std::vector<float> router_logits(const MoeShape& shape, std::span<const uint16_t> gate,
                                 std::span<const uint16_t> x, int num_tokens) {
  shape.validate();
  check_tokens(x, num_tokens, shape.hidden);
  const int h_dim = shape.hidden;
  const int e_dim = shape.num_experts;
  EPX_CHECK(gate.size() == static_cast<size_t>(e_dim) * static_cast<size_t>(h_dim), InputError,
            "gate.size()", gate.size(),
            "num_experts * hidden = " + str(e_dim) + " * " + str(h_dim));
  std::vector<float> xf(static_cast<size_t>(h_dim));
  std::vector<float> logits(static_cast<size_t>(num_tokens) * e_dim);
  for (int n = 0; n < num_tokens; ++n) {
    for (int h = 0; h < h_dim; ++h) xf[h] = bf16_to_float(x[static_cast<size_t>(n) * h_dim + h]);
    for (int e = 0; e < e_dim; ++e) {
      const uint16_t* g = gate.data() + static_cast<size_t>(e) * h_dim;
      float acc = 0.0f;
      for (int h = 0; h < h_dim; ++h) acc += xf[h] * bf16_to_float(g[h]);  // exact products
      logits[static_cast<size_t>(n) * e_dim + e] = acc;
    }
  }
  return logits;
}

RouterOutput route_from_logits(const MoeShape& shape, std::span<const float> logits,
                               std::span<const float> correction_bias, int num_tokens) {
  shape.validate();
  const int e_dim = shape.num_experts;
  const int k_dim = shape.topk;
  EPX_CHECK(num_tokens >= 0, InputError, "num_tokens", num_tokens, ">= 0");
  EPX_CHECK(logits.size() == static_cast<size_t>(num_tokens) * static_cast<size_t>(e_dim),
            InputError, "logits.size()", logits.size(),
            "num_tokens * num_experts = " + str(num_tokens) + " * " + str(e_dim));
  const bool grouped = shape.scoring == Scoring::kSigmoidGrouped;
  if (grouped) {
    EPX_CHECK(correction_bias.size() == static_cast<size_t>(e_dim), InputError,
              "correction_bias.size()", correction_bias.size(),
              "num_experts = " + str(e_dim) + " for scoring sigmoid_grouped");
  }
  RouterOutput out;
  out.num_tokens = num_tokens;
  out.topk = k_dim;
  out.ids.assign(static_cast<size_t>(num_tokens) * k_dim, -1);
  out.weights.assign(static_cast<size_t>(num_tokens) * k_dim, 0.0f);

  const int per_group = shape.experts_per_group();
  std::vector<float> score(static_cast<size_t>(e_dim));   // s (sigmoid) or p (softmax)
  std::vector<float> choice(static_cast<size_t>(e_dim));  // what experts are ranked by
  std::vector<float> group_score(static_cast<size_t>(shape.num_groups));
  std::vector<char> group_kept(static_cast<size_t>(shape.num_groups));
  std::vector<char> taken(static_cast<size_t>(e_dim));

  for (int n = 0; n < num_tokens; ++n) {
    const float* l = logits.data() + static_cast<size_t>(n) * e_dim;
    if (grouped) {
      for (int e = 0; e < e_dim; ++e) {
        score[e] = 1.0f / (1.0f + std::exp(-l[e]));
        choice[e] = score[e] + correction_bias[e];
      }
      // group score = best + second best choice of the group
      for (int g = 0; g < shape.num_groups; ++g) {
        const std::span<const float> members(choice.data() + g * per_group, per_group);
        const int first = argmax_first(members, [](int) { return true; });
        float sum = members[first];
        if (per_group >= 2) {
          const int second = argmax_first(members, [&](int i) { return i != first; });
          sum += members[second];
        }
        group_score[g] = sum;
      }
      std::fill(group_kept.begin(), group_kept.end(), 0);
      for (int t = 0; t < shape.topk_groups; ++t) {
        const int g = argmax_first(group_score, [&](int i) { return group_kept[i] == 0; });
        group_kept[g] = 1;
      }
    } else {
      float m = l[0];
      for (int e = 1; e < e_dim; ++e) m = std::max(m, l[e]);
      float z = 0.0f;
      for (int e = 0; e < e_dim; ++e) {
        score[e] = std::exp(l[e] - m);
        z += score[e];
      }
      for (int e = 0; e < e_dim; ++e) {
        score[e] = score[e] / z;
        choice[e] = score[e];
      }
      std::fill(group_kept.begin(), group_kept.end(), 1);  // one group, always kept
    }
    // now group_kept[g] says whether group g's experts may be picked
    std::fill(taken.begin(), taken.end(), 0);
    int32_t* ids = out.ids.data() + static_cast<size_t>(n) * k_dim;
    float* weights = out.weights.data() + static_cast<size_t>(n) * k_dim;
    for (int k = 0; k < k_dim; ++k) {
      const int e = argmax_first(
          choice, [&](int i) { return taken[i] == 0 && group_kept[i / per_group] != 0; });
      taken[e] = 1;
      ids[k] = e;
    }
    float total = 0.0f;
    for (int k = 0; k < k_dim; ++k) total += score[ids[k]];
    for (int k = 0; k < k_dim; ++k) {
      if (grouped) {
        weights[k] = total > 0.0f ? score[ids[k]] / total * shape.routed_scaling : 0.0f;
      } else {
        weights[k] = score[ids[k]] / total;
      }
    }
  }
  return out;
}

RouterOutput route(const MoeShape& shape, const MoeWeights& weights, std::span<const uint16_t> x,
                   int num_tokens) {
  shape.validate();
  check_weights(shape, weights);
  const std::vector<float> logits = router_logits(shape, weights.gate, x, num_tokens);
  return route_from_logits(shape, logits, weights.correction_bias, num_tokens);
}

// ---- experts ---------------------------------------------------------------------------------

std::vector<float> fp8_gemm_nt(std::span<const uint8_t> a_q, std::span<const float> a_scales, int m,
                               const Fp8BlockMatrix& w) {
  const int k_dim = w.cols;
  const int n_dim = w.rows;
  const int blocks = k_dim / kWeightBlock;
  EPX_CHECK(matrix_consistent(w), InputError, "w",
            dims(w.rows, w.cols) + " with " + std::to_string(w.q.size()) + " codes, " +
                std::to_string(w.scales.size()) + " scales",
            "positive multiples of 128 with rows * cols codes and one scale per 128x128 block");
  EPX_CHECK(m >= 0, InputError, "m", m, ">= 0");
  EPX_CHECK(a_q.size() == static_cast<size_t>(m) * static_cast<size_t>(k_dim), InputError,
            "a_q.size()", a_q.size(), "m * w.cols = " + str(m) + " * " + str(k_dim));
  EPX_CHECK(a_scales.size() == static_cast<size_t>(m) * static_cast<size_t>(blocks), InputError,
            "a_scales.size()", a_scales.size(),
            "m * w.cols / 128 = " + str(m) + " * " + str(blocks));
  const std::array<float, 256>& table = fp8_table();
  // Unscaled fp8 values of both operands, decoded once.
  std::vector<float> wf(w.q.size());
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = table[w.q[i]];
  std::vector<float> af(static_cast<size_t>(k_dim));
  std::vector<float> out(static_cast<size_t>(m) * n_dim);
  for (int r = 0; r < m; ++r) {
    for (int i = 0; i < k_dim; ++i) af[i] = table[a_q[static_cast<size_t>(r) * k_dim + i]];
    const float* sa = a_scales.data() + static_cast<size_t>(r) * blocks;
    for (int c = 0; c < n_dim; ++c) {
      const float* wrow = wf.data() + static_cast<size_t>(c) * k_dim;
      const float* sw = w.scales.data() + static_cast<size_t>(c / kWeightBlock) * blocks;
      float acc = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        float p = 0.0f;
        for (int i = b * kWeightBlock; i < (b + 1) * kWeightBlock; ++i) p += af[i] * wrow[i];
        acc = std::fmaf(p, sa[b] * sw[b], acc);
      }
      out[static_cast<size_t>(r) * n_dim + c] = acc;
    }
  }
  return out;
}

ExpertStages expert_forward_stages(const ExpertWeights& w, std::span<const uint16_t> x,
                                   int num_tokens) {
  const int h_dim = w.hidden();
  const int i_dim = w.intermediate();
  EPX_CHECK(h_dim > 0 && h_dim % kWeightBlock == 0 && i_dim > 0 && i_dim % kWeightBlock == 0,
            InputError, "expert [I][H]", dims(i_dim, h_dim), "positive multiples of 128");
  check_expert(w, h_dim, i_dim, "expert");
  check_tokens(x, num_tokens, h_dim);
  ExpertStages s;
  s.num_tokens = num_tokens;
  s.hidden = h_dim;
  s.intermediate = i_dim;
  const size_t n = static_cast<size_t>(num_tokens);
  s.x_q.resize(n * h_dim);
  s.x_scales.resize(n * (h_dim / kFp8BlockSize));
  quantize_fp8(x.data(), num_tokens, h_dim, s.x_q.data(), s.x_scales.data());
  s.h1 = fp8_gemm_nt(s.x_q, s.x_scales, num_tokens, w.w1);
  s.h3 = fp8_gemm_nt(s.x_q, s.x_scales, num_tokens, w.w3);
  s.act.resize(n * i_dim);
  s.act_bf16.resize(n * i_dim);
  for (size_t i = 0; i < s.act.size(); ++i) {
    s.act[i] = silu(s.h1[i]) * s.h3[i];
    s.act_bf16[i] = bf16_from_float(s.act[i]);
  }
  s.act_q.resize(n * i_dim);
  s.act_scales.resize(n * (i_dim / kFp8BlockSize));
  quantize_fp8(s.act_bf16.data(), num_tokens, i_dim, s.act_q.data(), s.act_scales.data());
  s.out = fp8_gemm_nt(s.act_q, s.act_scales, num_tokens, w.w2);
  return s;
}

std::vector<float> expert_forward(const ExpertWeights& w, std::span<const uint16_t> x,
                                  int num_tokens) {
  return expert_forward_stages(w, x, num_tokens).out;
}

// ---- the layer -------------------------------------------------------------------------------

std::vector<float> moe_forward_routed(const MoeShape& shape, const MoeWeights& weights,
                                      std::span<const uint16_t> x, int num_tokens,
                                      const RouterOutput& routing) {
  shape.validate();
  check_weights(shape, weights);
  check_tokens(x, num_tokens, shape.hidden);
  const int h_dim = shape.hidden;
  const int k_dim = routing.topk;
  const size_t entries = static_cast<size_t>(num_tokens) * static_cast<size_t>(k_dim);
  EPX_CHECK(routing.num_tokens == num_tokens && k_dim >= 1 && routing.ids.size() == entries &&
                routing.weights.size() == entries,
            InputError, "routing",
            dims(routing.num_tokens, k_dim) + " with " + std::to_string(routing.ids.size()) +
                " ids, " + std::to_string(routing.weights.size()) + " weights",
            "[num_tokens = " + str(num_tokens) + "][topk >= 1], ids and weights of that size");
  for (size_t j = 0; j < entries; ++j) {
    EPX_CHECK(routing.ids[j] >= -1 && routing.ids[j] < shape.num_experts, InputError,
              "routing.ids[" + std::to_string(j / k_dim) + "][" + std::to_string(j % k_dim) + "]",
              routing.ids[j], "in [-1, num_experts = " + str(shape.num_experts) + ")");
  }

  // Each expert runs once on the rows routed to it; out_of[j] is the expert output of entry j.
  std::vector<std::vector<float>> out_of(entries);
  std::vector<uint16_t> rows;
  std::vector<size_t> entry_of_row;
  for (int e = 0; e < shape.num_experts; ++e) {
    rows.clear();
    entry_of_row.clear();
    for (size_t j = 0; j < entries; ++j) {
      if (routing.ids[j] != e) continue;
      const uint16_t* src = x.data() + (j / k_dim) * h_dim;
      rows.insert(rows.end(), src, src + h_dim);
      entry_of_row.push_back(j);
    }
    if (entry_of_row.empty()) continue;
    const std::vector<float> out =
        expert_forward(weights.experts[e], rows, static_cast<int>(entry_of_row.size()));
    for (size_t r = 0; r < entry_of_row.size(); ++r) {
      out_of[entry_of_row[r]].assign(out.begin() + r * h_dim, out.begin() + (r + 1) * h_dim);
    }
  }
  std::vector<float> shared;
  if (weights.shared) shared = expert_forward(*weights.shared, x, num_tokens);

  std::vector<float> y(static_cast<size_t>(num_tokens) * h_dim);
  for (int n = 0; n < num_tokens; ++n) {
    for (int h = 0; h < h_dim; ++h) {
      float acc = 0.0f;
      for (int k = 0; k < k_dim; ++k) {
        const size_t j = static_cast<size_t>(n) * k_dim + k;
        if (routing.ids[j] < 0) continue;
        acc = std::fmaf(routing.weights[j], out_of[j][h], acc);
      }
      if (!shared.empty()) acc += shared[static_cast<size_t>(n) * h_dim + h];
      y[static_cast<size_t>(n) * h_dim + h] = acc;
    }
  }
  return y;
}

std::vector<float> moe_forward_reference(const MoeShape& shape, const MoeWeights& weights,
                                         std::span<const uint16_t> x, int num_tokens) {
  const RouterOutput routing = route(shape, weights, x, num_tokens);
  return moe_forward_routed(shape, weights, x, num_tokens, routing);
}

}  // namespace epx::ref::moe
