// The CPU reference of dispatch and combine: hand-computed cases, routing generators, and
// properties over many seeds and shapes. The checkers below state the contract (DESIGN §4) on
// their own terms, and a negative test shows each of them can fail.

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "reference/reference.hpp"

namespace epx::ref {
namespace {

// ---- helpers --------------------------------------------------------------------------------

EpConfig make_config(int world, int experts, int topk, int hidden, int max_tokens,
                     DispatchDtype dtype) {
  EpConfig c;
  c.world_size = world;
  c.num_experts = experts;
  c.topk = topk;
  c.hidden = hidden;
  c.max_tokens_per_rank = max_tokens;
  c.dtype = dtype;
  c.validate();
  return c;
}

// Written independently of ref::token_valid, so the checkers do not trust the code they check.
bool routable(const EpConfig& cfg, const int32_t* ids) {
  for (int k = 0; k < cfg.topk; ++k) {
    if (ids[k] < -1 || ids[k] >= cfg.num_experts) return false;
    for (int j = 0; j < k; ++j) {
      if (ids[k] >= 0 && ids[j] == ids[k]) return false;
    }
  }
  return true;
}

const int32_t* ids_of(const EpConfig& cfg, const RankInput& in, int n) {
  return in.routing.ids.data() + static_cast<size_t>(n) * cfg.topk;
}
const float* weights_of(const EpConfig& cfg, const RankInput& in, int n) {
  return in.routing.weights.data() + static_cast<size_t>(n) * cfg.topk;
}

int experts_on_rank(const EpConfig& cfg, const int32_t* ids, int rank) {
  int num = 0;
  for (int k = 0; k < cfg.topk; ++k) num += ids[k] >= 0 && ids[k] / cfg.num_local_experts() == rank;
  return num;
}

// What token (s, n) must look like on the wire.
struct Wire {
  std::vector<uint8_t> x;
  std::vector<float> scales;
};
Wire expected_wire(const EpConfig& cfg, const RankInput& in, int n) {
  Wire w;
  const size_t h = static_cast<size_t>(cfg.hidden);
  const size_t groups = static_cast<size_t>(cfg.num_scale_groups());
  switch (cfg.dtype) {
    case DispatchDtype::kBF16:
      for (size_t i = 0; i < h; ++i) {
        const uint16_t b = in.x_bf16[n * h + i];
        w.x.push_back(static_cast<uint8_t>(b & 0xFF));
        w.x.push_back(static_cast<uint8_t>(b >> 8));
      }
      break;
    case DispatchDtype::kFP8:
      w.x.assign(in.x_fp8.begin() + n * h, in.x_fp8.begin() + (n + 1) * h);
      w.scales.assign(in.scales.begin() + n * groups, in.scales.begin() + (n + 1) * groups);
      break;
    case DispatchDtype::kBF16ToFP8:
      w.x.resize(h);
      w.scales.resize(groups);
      quantize_fp8(in.x_bf16.data() + n * h, 1, cfg.hidden, w.x.data(), w.scales.data(),
                   cfg.round_scale);
      break;
  }
  return w;
}

template <typename T>
bool same_bits(const T* a, const T* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(T)) == 0;
}

// Token-major contract: rows strictly ascending in (source rank, source index) (order and
// per-rank dedup), each a valid token with an expert on this rank, carrying the token's bytes,
// scales and full routing row; every such token present (count); expert_counts per local expert.
testing::AssertionResult check_token_major(const EpConfig& cfg,
                                           const std::vector<RankInput>& inputs,
                                           const std::vector<TokenMajorRecv>& recv) {
  const int world = cfg.world_size, topk = cfg.topk, local = cfg.num_local_experts();
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = cfg.wire_fp8() ? static_cast<size_t>(cfg.num_scale_groups()) : 0;
  if (static_cast<int>(recv.size()) != world) return testing::AssertionFailure() << "recv.size()";
  int64_t pairs_expected = 0, pairs_counted = 0;
  for (const RankInput& in : inputs) {
    for (int n = 0; n < in.num_tokens; ++n) {
      if (!routable(cfg, ids_of(cfg, in, n))) continue;
      for (int k = 0; k < topk; ++k) pairs_expected += ids_of(cfg, in, n)[k] >= 0;
    }
  }
  for (int r = 0; r < world; ++r) {
    const TokenMajorRecv& R = recv[r];
    auto fail = [&](int j) {
      return testing::AssertionFailure() << "rank " << r << " row " << j << ": ";
    };
    const size_t m = static_cast<size_t>(R.count);
    if (R.src_rank.size() != m || R.src_idx.size() != m || R.x.size() != m * row_bytes ||
        R.scales.size() != m * groups || R.topk_ids.size() != m * topk ||
        R.topk_weights.size() != m * topk || R.expert_counts.size() != static_cast<size_t>(local)) {
      return fail(-1) << "array sizes do not match count " << R.count;
    }
    int expected_rows = 0;
    for (const RankInput& in : inputs) {
      for (int n = 0; n < in.num_tokens; ++n) {
        const int32_t* ids = ids_of(cfg, in, n);
        expected_rows += routable(cfg, ids) && experts_on_rank(cfg, ids, r) > 0;
      }
    }
    if (R.count != expected_rows)
      return fail(-1) << "count " << R.count << ", expected " << expected_rows;
    std::vector<int32_t> counts(static_cast<size_t>(local), 0);
    int64_t prev_key = -1;
    for (int j = 0; j < R.count; ++j) {
      const int s = R.src_rank[j], n = R.src_idx[j];
      if (s < 0 || s >= world || n < 0 || n >= inputs[s].num_tokens) {
        return fail(j) << "source (" << s << ", " << n << ") out of range";
      }
      const int64_t key = int64_t{s} * (int64_t{1} << 32) + n;
      if (key <= prev_key) return fail(j) << "rows not strictly ascending in (src_rank, src_idx)";
      prev_key = key;
      const int32_t* ids = ids_of(cfg, inputs[s], n);
      if (!routable(cfg, ids)) return fail(j) << "an invalid token was delivered";
      if (experts_on_rank(cfg, ids, r) == 0) return fail(j) << "token has no expert on this rank";
      if (!same_bits(R.topk_ids.data() + j * topk, ids, topk) ||
          !same_bits(R.topk_weights.data() + j * topk, weights_of(cfg, inputs[s], n), topk)) {
        return fail(j) << "routing row differs from the source's";
      }
      const Wire w = expected_wire(cfg, inputs[s], n);
      if (!same_bits(R.x.data() + j * row_bytes, w.x.data(), row_bytes))
        return fail(j) << "payload differs";
      if (groups > 0 && !same_bits(R.scales.data() + j * groups, w.scales.data(), groups)) {
        return fail(j) << "scales differ";
      }
      for (int k = 0; k < topk; ++k) {
        if (ids[k] >= 0 && ids[k] / local == r) ++counts[ids[k] - r * local];
      }
    }
    if (counts != R.expert_counts) return fail(-1) << "expert_counts differ";
    pairs_counted += std::accumulate(counts.begin(), counts.end(), int64_t{0});
  }
  if (pairs_counted != pairs_expected) {
    return testing::AssertionFailure()
           << "expert counts add up to " << pairs_counted << ", expected " << pairs_expected;
  }
  return testing::AssertionSuccess();
}

// Expert-major contract: per local expert, rows strictly ascending in (source rank, source
// index), each a valid token whose id at topk_slot is this expert, with weight = its weight and
// the token's bytes; the counts add up to every valid (token, expert) pair, so each pair is
// delivered exactly once.
testing::AssertionResult check_expert_major(const EpConfig& cfg,
                                            const std::vector<RankInput>& inputs,
                                            const std::vector<ExpertMajorRecv>& recv) {
  const int world = cfg.world_size, topk = cfg.topk, local = cfg.num_local_experts();
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = cfg.wire_fp8() ? static_cast<size_t>(cfg.num_scale_groups()) : 0;
  if (static_cast<int>(recv.size()) != world) return testing::AssertionFailure() << "recv.size()";
  int64_t pairs_expected = 0, pairs_delivered = 0;
  for (const RankInput& in : inputs) {
    for (int n = 0; n < in.num_tokens; ++n) {
      if (!routable(cfg, ids_of(cfg, in, n))) continue;
      for (int k = 0; k < topk; ++k) pairs_expected += ids_of(cfg, in, n)[k] >= 0;
    }
  }
  for (int r = 0; r < world; ++r) {
    const ExpertMajorRecv& R = recv[r];
    if (R.count.size() != static_cast<size_t>(local) || R.x.size() != R.count.size() ||
        R.scales.size() != R.count.size() || R.src_rank.size() != R.count.size() ||
        R.src_idx.size() != R.count.size() || R.topk_slot.size() != R.count.size() ||
        R.weight.size() != R.count.size()) {
      return testing::AssertionFailure() << "rank " << r << ": per-expert arrays sized wrong";
    }
    for (int e = 0; e < local; ++e) {
      const int expert = r * local + e;
      auto fail = [&](int i) {
        return testing::AssertionFailure()
               << "rank " << r << " expert " << expert << " row " << i << ": ";
      };
      const size_t m = static_cast<size_t>(R.count[e]);
      if (R.x[e].size() != m * row_bytes || R.scales[e].size() != m * groups ||
          R.src_rank[e].size() != m || R.src_idx[e].size() != m || R.topk_slot[e].size() != m ||
          R.weight[e].size() != m) {
        return fail(-1) << "array sizes do not match count " << m;
      }
      int64_t prev_key = -1;
      for (size_t i = 0; i < m; ++i) {
        const int s = R.src_rank[e][i], n = R.src_idx[e][i], k = R.topk_slot[e][i];
        if (s < 0 || s >= world || n < 0 || n >= inputs[s].num_tokens || k < 0 || k >= topk) {
          return fail(static_cast<int>(i)) << "source/slot out of range";
        }
        const int64_t key = int64_t{s} * (int64_t{1} << 32) + n;
        if (key <= prev_key) return fail(static_cast<int>(i)) << "rows not strictly ascending";
        prev_key = key;
        const int32_t* ids = ids_of(cfg, inputs[s], n);
        if (!routable(cfg, ids))
          return fail(static_cast<int>(i)) << "an invalid token was delivered";
        if (ids[k] != expert)
          return fail(static_cast<int>(i)) << "topk_slot does not name this expert";
        if (std::memcmp(&R.weight[e][i], weights_of(cfg, inputs[s], n) + k, sizeof(float)) != 0) {
          return fail(static_cast<int>(i)) << "weight differs";
        }
        const Wire w = expected_wire(cfg, inputs[s], n);
        if (!same_bits(R.x[e].data() + i * row_bytes, w.x.data(), row_bytes)) {
          return fail(static_cast<int>(i)) << "payload differs";
        }
        if (groups > 0 && !same_bits(R.scales[e].data() + i * groups, w.scales.data(), groups)) {
          return fail(static_cast<int>(i)) << "scales differ";
        }
      }
      pairs_delivered += static_cast<int64_t>(m);
    }
  }
  if (pairs_delivered != pairs_expected) {
    return testing::AssertionFailure() << pairs_delivered << " rows delivered, expected "
                                       << pairs_expected << " (token, expert) pairs";
  }
  return testing::AssertionSuccess();
}

// Combine of the identity expert: y[n] must equal sum_k w_k * v (v = the token as it went on
// the wire, as floats) within
//     |y - ref| <= (2^-7 + 2^-12) * sum_k w_k * |v|.
// Why: bf16 has unit roundoff 2^-8. The partials (token-major) or the bf16 expert outputs
// (expert-major) are rounded once (<= 2^-8 of sum_k w_k |v| in total, weights being positive),
// the result is rounded once more (<= 2^-8 (1 + 2^-8) of it), and the f32 accumulation of at
// most 32 + 64 terms adds < 2^-17; 2^-12 covers both of the latter small terms.
// Tokens that are invalid or have no valid id must come back as exact +0.
testing::AssertionResult check_combine_close(const EpConfig& cfg,
                                             const std::vector<RankInput>& inputs,
                                             const std::vector<std::vector<uint16_t>>& y) {
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  if (y.size() != inputs.size()) return testing::AssertionFailure() << "y.size()";
  for (size_t s = 0; s < inputs.size(); ++s) {
    const RankInput& in = inputs[s];
    if (y[s].size() != static_cast<size_t>(in.num_tokens) * hidden) {
      return testing::AssertionFailure() << "y[" << s << "] size";
    }
    for (int n = 0; n < in.num_tokens; ++n) {
      const int32_t* ids = ids_of(cfg, in, n);
      const float* w = weights_of(cfg, in, n);
      const bool valid = routable(cfg, ids);
      double wsum = 0;
      for (int k = 0; k < cfg.topk; ++k) wsum += valid && ids[k] >= 0 ? w[k] : 0.0;
      const std::vector<float> v = token_as_float(cfg, in, n);
      for (size_t h = 0; h < hidden; ++h) {
        const uint16_t got = y[s][n * hidden + h];
        if (wsum == 0) {
          if (got != 0) {
            return testing::AssertionFailure() << "token (" << s << ", " << n << ") h " << h
                                               << " is routed nowhere but y has bits " << got;
          }
          continue;
        }
        const double ref = wsum * v[h];
        const double tol = (0x1p-7 + 0x1p-12) * wsum * std::fabs(v[h]);
        const double err = std::fabs(bf16_to_float(got) - ref);
        if (!(err <= tol)) {
          return testing::AssertionFailure()
                 << "token (" << s << ", " << n << ") h " << h << ": y " << bf16_to_float(got)
                 << ", expected " << ref << " +- " << tol;
        }
      }
    }
  }
  return testing::AssertionSuccess();
}

uint16_t bf(float f) { return bf16_from_float(f); }

// ---- token validity ---------------------------------------------------------------------------

TEST(TokenValid, HandCases) {
  const int32_t ok[] = {3, -1, 0, 7};
  const int32_t repeat[] = {3, -1, 3, 7};
  const int32_t too_big[] = {3, 8, 0, 1};
  const int32_t too_small[] = {3, -2, 0, 1};
  const int32_t all_none[] = {-1, -1, -1, -1};
  const int32_t min_int[] = {INT_MIN, 1, 2, 3};
  EXPECT_TRUE(token_valid(ok, 4, 8));
  EXPECT_FALSE(token_valid(repeat, 4, 8));
  EXPECT_FALSE(token_valid(too_big, 4, 8));
  EXPECT_FALSE(token_valid(too_small, 4, 8));
  EXPECT_TRUE(token_valid(all_none, 4, 8));  // valid, routed nowhere
  EXPECT_FALSE(token_valid(min_int, 4, 8));
  EXPECT_TRUE(token_valid(too_big, 1, 8));  // only the first topk entries count
}

// ---- hand-computed dispatch and combine -------------------------------------------------------

// World 2, 4 experts (2 per rank), top-2, hidden 8, bf16.
//   rank 0: t0 -> {0, 1}, t1 -> {1, 2}, t2 -> {3, -1}, t3 -> {-1, -1}
//   rank 1: t0 -> {2, 0}, t1 -> {2, 2} (repeat: invalid), t2 -> {4, 0} (out of range: invalid)
// x[s][n][h] = 64 s + 8 n + h, exact in bf16.
struct Tiny {
  EpConfig cfg = make_config(2, 4, 2, 8, 4, DispatchDtype::kBF16);
  std::vector<RankInput> inputs;
  Tiny() {
    const std::vector<std::vector<int32_t>> ids = {{0, 1, 1, 2, 3, -1, -1, -1}, {2, 0, 2, 2, 4, 0}};
    const std::vector<std::vector<float>> w = {{0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f, 0.0f, 0.0f},
                                               {0.625f, 0.375f, 0.5f, 0.5f, 0.5f, 0.5f}};
    for (int s = 0; s < 2; ++s) {
      RankInput in;
      in.num_tokens = static_cast<int>(ids[s].size()) / 2;
      in.routing.num_tokens = in.num_tokens;
      in.routing.topk = 2;
      in.routing.ids = ids[s];
      in.routing.weights = w[s];
      for (int n = 0; n < in.num_tokens; ++n) {
        for (int h = 0; h < 8; ++h) in.x_bf16.push_back(bf(static_cast<float>(64 * s + 8 * n + h)));
      }
      inputs.push_back(in);
    }
  }
};

TEST(HandDispatch, TokenMajor) {
  Tiny t;
  const auto recv = dispatch_token_major(t.cfg, t.inputs);
  ASSERT_EQ(recv.size(), 2u);
  // Rank 0 holds experts 0, 1: tokens (0,0), (0,1), (1,0) once each.
  EXPECT_EQ(recv[0].count, 3);
  EXPECT_EQ(recv[0].src_rank, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(recv[0].src_idx, (std::vector<int32_t>{0, 1, 0}));
  EXPECT_EQ(recv[0].topk_ids, (std::vector<int32_t>{0, 1, 1, 2, 2, 0}));
  EXPECT_EQ(recv[0].topk_weights, (std::vector<float>{0.5f, 0.5f, 0.25f, 0.75f, 0.625f, 0.375f}));
  EXPECT_EQ(recv[0].expert_counts, (std::vector<int32_t>{2, 2}));
  EXPECT_TRUE(recv[0].scales.empty());
  // Rank 1 holds experts 2, 3: tokens (0,1), (0,2), (1,0).
  EXPECT_EQ(recv[1].count, 3);
  EXPECT_EQ(recv[1].src_rank, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(recv[1].src_idx, (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(recv[1].topk_ids, (std::vector<int32_t>{1, 2, 3, -1, 2, 0}));
  EXPECT_EQ(recv[1].expert_counts, (std::vector<int32_t>{2, 1}));
  // Payload: little-endian bf16 bits. Row 1 of rank 1 is token (0,2): h = 3 holds 19.0 = 0x4198.
  ASSERT_EQ(recv[1].x.size(), 3u * 16);
  EXPECT_EQ(recv[1].x[16 + 6], 0x98);
  EXPECT_EQ(recv[1].x[16 + 7], 0x41);
  // Row 2 of rank 0 is token (1,0): h = 0 holds 64.0 = 0x4280.
  EXPECT_EQ(recv[0].x[32], 0x80);
  EXPECT_EQ(recv[0].x[33], 0x42);
  EXPECT_TRUE(check_token_major(t.cfg, t.inputs, recv));
}

TEST(HandDispatch, EveryRankDeliversEveryValidToken) {
  Tiny t;
  const auto recv = dispatch_token_major(t.cfg, t.inputs, /*every_rank=*/true);
  ASSERT_EQ(recv.size(), 2u);
  // Both ranks get all four of rank 0's tokens (t3, routed nowhere, too) and rank 1's one valid
  // token, in (source, index) order; local expert counts are those of the routed layout.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(recv[r].count, 5) << r;
    EXPECT_EQ(recv[r].src_rank, (std::vector<int32_t>{0, 0, 0, 0, 1})) << r;
    EXPECT_EQ(recv[r].src_idx, (std::vector<int32_t>{0, 1, 2, 3, 0})) << r;
  }
  EXPECT_EQ(recv[0].expert_counts, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(recv[1].expert_counts, (std::vector<int32_t>{2, 1}));
  // Combine of identity partials gives the same bits as with the routed layout: the extra rows
  // carry +0 partials.
  const auto routed = dispatch_token_major(t.cfg, t.inputs);
  std::vector<std::vector<uint16_t>> pr, pe;
  for (int r = 0; r < 2; ++r) {
    pr.push_back(identity_partials(t.cfg, r, routed[r]));
    pe.push_back(identity_partials(t.cfg, r, recv[r]));
  }
  EXPECT_EQ(combine_token_major(t.cfg, t.inputs, routed, pr),
            combine_token_major(t.cfg, t.inputs, recv, pe));
}

TEST(HandDispatch, ExpertMajor) {
  Tiny t;
  const auto recv = dispatch_expert_major(t.cfg, t.inputs);
  ASSERT_EQ(recv.size(), 2u);
  // Rank 0, expert 0: (0,0) at k 0, (1,0) at k 1. Expert 1: (0,0) at k 1, (0,1) at k 0.
  EXPECT_EQ(recv[0].count, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(recv[0].src_rank[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(recv[0].src_idx[0], (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(recv[0].topk_slot[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(recv[0].weight[0], (std::vector<float>{0.5f, 0.375f}));
  EXPECT_EQ(recv[0].src_rank[1], (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(recv[0].src_idx[1], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(recv[0].topk_slot[1], (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(recv[0].weight[1], (std::vector<float>{0.5f, 0.25f}));
  // Rank 1, expert 2: (0,1) at k 1, (1,0) at k 0. Expert 3: (0,2) at k 0.
  EXPECT_EQ(recv[1].count, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(recv[1].src_rank[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(recv[1].src_idx[0], (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(recv[1].topk_slot[0], (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(recv[1].weight[0], (std::vector<float>{0.75f, 0.625f}));
  EXPECT_EQ(recv[1].src_idx[1], (std::vector<int32_t>{2}));
  EXPECT_EQ(recv[1].weight[1], (std::vector<float>{1.0f}));
  // Expert 3's only row is token (0,2): h = 7 holds 23.0 = 0x41B8.
  ASSERT_EQ(recv[1].x[1].size(), 16u);
  EXPECT_EQ(recv[1].x[1][14], 0xB8);
  EXPECT_EQ(recv[1].x[1][15], 0x41);
  EXPECT_TRUE(recv[1].scales[0].empty());
  EXPECT_TRUE(check_expert_major(t.cfg, t.inputs, recv));
}

TEST(HandCombine, TokenMajor) {
  Tiny t;
  const auto recv = dispatch_token_major(t.cfg, t.inputs);
  // Rows: rank 0 = (0,0), (0,1), (1,0); rank 1 = (0,1), (0,2), (1,0).
  std::vector<std::vector<uint16_t>> partials(2, std::vector<uint16_t>(3 * 8));
  for (int h = 0; h < 8; ++h) {
    partials[0][0 * 8 + h] = bf(3.0f);
    partials[0][1 * 8 + h] = bf(1.0f);
    partials[0][2 * 8 + h] = bf(0.5f);
    // (0,1) on rank 1: 2^-8 makes an exact tie with 1 (-> 1.0, even); 2^-8 + 2^-15 is past it.
    partials[1][0 * 8 + h] = h == 0 ? bf(0x1p-8f) : h == 1 ? bf(0x1p-8f + 0x1p-15f) : bf(3.0f);
    partials[1][1 * 8 + h] = bf(-7.0f);
    partials[1][2 * 8 + h] = bf(0.25f);
  }
  const auto y = combine_token_major(t.cfg, t.inputs, recv, partials);
  ASSERT_EQ(y[0].size(), 4u * 8);
  ASSERT_EQ(y[1].size(), 3u * 8);
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(y[0][0 * 8 + h], bf(3.0f));
    EXPECT_EQ(y[0][1 * 8 + h], h == 0 ? 0x3F80 : h == 1 ? 0x3F81 : bf(4.0f)) << h;
    EXPECT_EQ(y[0][2 * 8 + h], bf(-7.0f));
    EXPECT_EQ(y[0][3 * 8 + h], 0x0000);  // routed nowhere: +0
    EXPECT_EQ(y[1][0 * 8 + h], bf(0.75f));
    EXPECT_EQ(y[1][1 * 8 + h], 0x0000);  // invalid
    EXPECT_EQ(y[1][2 * 8 + h], 0x0000);  // invalid
  }
}

// Passes when `call` throws InputError whose message holds `part`.
template <typename F>
testing::AssertionResult input_error_with(F&& call, const std::string& part) {
  try {
    call();
  } catch (const InputError& e) {
    const std::string msg = e.what();
    if (msg.find(part) != std::string::npos) return testing::AssertionSuccess();
    return testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw something else: " << e.what();
  }
  return testing::AssertionFailure() << "did not throw";
}
#define EXPECT_INPUT_ERROR(call, part) EXPECT_TRUE(input_error_with([&] { (void)(call); }, part))

// Routing by rank (DispatchInput::rank_mask): the Tiny rounds routed by the ranks of their ids
// deliver the same rows, the senders' expert counts summed, and no ids or weights.
TEST(HandDispatch, RankMaskRoutesLikeTheIdsItCameFrom) {
  Tiny t;
  const auto by_ids = dispatch_token_major(t.cfg, t.inputs);
  std::vector<RankInput> masked = t.inputs;
  // rank 0's tokens: t0 -> ranks {0}, t1 -> {0, 1}, t2 -> {1}, t3 -> none; rank 1's: t0 -> {0, 1}
  // and the two invalid tokens nowhere (a mask has no invalid ids to drop).
  masked[0].rank_mask = {1, 0, 1, 1, 0, 1, 0, 0};
  masked[1].rank_mask = {1, 1, 0, 0, 0, 0};
  masked[0].expert_counts = {1, 2, 1, 1};
  masked[1].expert_counts = {1, 0, 1, 0};
  const auto by_mask = dispatch_token_major(t.cfg, masked);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(by_mask[r].count, by_ids[r].count) << r;
    EXPECT_EQ(by_mask[r].x, by_ids[r].x) << r;
    EXPECT_EQ(by_mask[r].src_rank, by_ids[r].src_rank) << r;
    EXPECT_EQ(by_mask[r].src_idx, by_ids[r].src_idx) << r;
    EXPECT_EQ(by_mask[r].expert_counts, by_ids[r].expert_counts) << r;
    EXPECT_EQ(by_mask[r].topk_ids, std::vector<int32_t>(by_ids[r].topk_ids.size(), -1)) << r;
    EXPECT_EQ(by_mask[r].topk_weights, std::vector<float>(by_ids[r].topk_ids.size(), 0.0f)) << r;
  }
  // A sender may route one way and its peer the other.
  std::vector<RankInput> mixed = t.inputs;
  mixed[1] = masked[1];
  const auto by_both = dispatch_token_major(t.cfg, mixed);
  EXPECT_EQ(by_both[0].src_idx, by_ids[0].src_idx);
  EXPECT_EQ(by_both[1].expert_counts, by_ids[1].expert_counts);
  // The sizes are checked, naming the field.
  masked[0].rank_mask.pop_back();
  EXPECT_INPUT_ERROR(dispatch_token_major(t.cfg, masked),
                     "inputs[0].rank_mask.size() = 7, expected num_tokens * world_size = 8");
  masked[0].rank_mask.push_back(0);
  masked[0].expert_counts.pop_back();
  EXPECT_INPUT_ERROR(dispatch_token_major(t.cfg, masked), "inputs[0].expert_counts.size()");
  masked[0].expert_counts.push_back(1);
  EXPECT_INPUT_ERROR(dispatch_expert_major(t.cfg, masked),
                     "inputs[0].rank_mask = set, expected empty for the expert-major layout");
}

// Combine's extras: the rows' top-k weights summed back per token in rank order (DeepEP's
// convention: each rank keeps the weights of its own experts, so the sum is the token's row),
// and bias rows that start the f32 sum before the partials, rounded once with them.
TEST(HandCombine, TokenMajorExtras) {
  Tiny t;
  const auto recv = dispatch_token_major(t.cfg, t.inputs);
  CombineExtrasRef ex;
  for (int r = 0; r < 2; ++r) {
    std::vector<float> w = recv[r].topk_weights;  // keep the weights of this rank's experts
    for (size_t i = 0; i < w.size(); ++i)
      if (recv[r].topk_ids[i] < 0 || t.cfg.expert_rank(recv[r].topk_ids[i]) != r) w[i] = 0.0f;
    ex.topk_weights.push_back(w);
  }
  std::vector<std::vector<uint16_t>> partials(2, std::vector<uint16_t>(3 * 8, bf(1.0f)));
  // 2^24 - 2^24 first leaves the partials exact; added after them, 1 + 2^24 would round to 2^24.
  ex.bias0 = {std::vector<uint16_t>(4 * 8, bf(0x1p24f)), std::vector<uint16_t>(3 * 8, bf(0.5f))};
  ex.bias1 = {std::vector<uint16_t>(4 * 8, bf(-0x1p24f)), {}};
  ex.bias1[1].assign(3 * 8, bf(0.25f));
  const auto y = combine_token_major(t.cfg, t.inputs, recv, partials, CombineFormat::kBF16, &ex);
  ASSERT_EQ(ex.y_topk_weights.size(), 2u);
  // Rank 0's tokens: t0 (rank 0 only) -> 0.5, 0.5; t1 (both ranks) -> 0.25, 0.75; t2 (rank 1,
  // expert 3) -> 1, 0; t3 nowhere -> 0, 0. Rank 1's: t0 -> 0.625, 0.375; invalid ones 0.
  EXPECT_EQ(ex.y_topk_weights[0], (std::vector<float>{0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f, 0.0f, 0.0f}));
  EXPECT_EQ(ex.y_topk_weights[1], (std::vector<float>{0.625f, 0.375f, 0.0f, 0.0f, 0.0f, 0.0f}));
  // ((0 + 2^24) - 2^24) + partials: t1 has two partials of 1 -> 2; t3 none -> +0 exactly.
  EXPECT_EQ(y[0][0], bf(1.0f));
  EXPECT_EQ(y[0][8], bf(2.0f));
  EXPECT_EQ(y[0][24], 0x0000);
  EXPECT_EQ(y[1][0], bf(2.75f));   // 0.5 + 0.25 + partials of ranks 0 and 1
  EXPECT_EQ(y[1][8], bf(0.75f));   // invalid token: the bias alone
  // A rank may give no bias row where another gives one.
  ex.bias1[1].clear();
  const auto y1 = combine_token_major(t.cfg, t.inputs, recv, partials, CombineFormat::kBF16, &ex);
  EXPECT_EQ(y1[0], y[0]);
  EXPECT_EQ(y1[1][0], bf(2.5f));
  ex.bias1[1].assign(2 * 8, 0);
  EXPECT_INPUT_ERROR(combine_token_major(t.cfg, t.inputs, recv, partials, CombineFormat::kBF16, &ex),
                     "extras.bias1[1].size() = 16, expected empty or num_tokens * hidden = 24");
  ex.bias1[1].assign(3 * 8, bf(0.25f));
  // The sizes are checked, naming the field.
  ex.topk_weights[1].pop_back();
  EXPECT_INPUT_ERROR(combine_token_major(t.cfg, t.inputs, recv, partials, CombineFormat::kBF16, &ex),
                     "extras.topk_weights[1].size() = 5, expected count * topk = 6");
}

// Three partials 1, 2^-8, 2^-8 must be summed in f32 and rounded once: 1 + 2^-7 (0x3F81).
// Rounding after each addition would give 1.0 twice over. The sum runs in rank order.
TEST(HandCombine, TokenMajorRoundsOnce) {
  const EpConfig cfg = make_config(3, 3, 3, 8, 1, DispatchDtype::kBF16);
  std::vector<RankInput> inputs(3);
  inputs[0].num_tokens = 1;
  inputs[0].routing = {1, 3, {0, 1, 2}, {0.25f, 0.25f, 0.5f}};
  inputs[0].x_bf16.assign(8, bf(1.0f));
  for (int s = 1; s < 3; ++s) inputs[s].routing.topk = 3;
  const auto recv = dispatch_token_major(cfg, inputs);
  for (const auto& r : recv) ASSERT_EQ(r.count, 1);
  // h < 4: 1, 2^-8, 2^-8. h >= 4: 256, -256, 2^-20, where only rank order keeps the 2^-20
  // ((256 - 256) + 2^-20; in the opposite order -256 + 2^-20 rounds back to -256 in f32).
  std::vector<std::vector<uint16_t>> partials(3, std::vector<uint16_t>(8));
  for (int h = 0; h < 8; ++h) {
    partials[0][h] = h < 4 ? bf(1.0f) : bf(256.0f);
    partials[1][h] = h < 4 ? bf(0x1p-8f) : bf(-256.0f);
    partials[2][h] = h < 4 ? bf(0x1p-8f) : bf(0x1p-20f);
  }
  const auto y = combine_token_major(cfg, inputs, recv, partials);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(y[0][h], h < 4 ? 0x3F81 : bf(0x1p-20f)) << h;
  EXPECT_TRUE(y[1].empty());
}

// CombineOrder::kHighestSlot: token (ids 2, 0, 1 on three ranks of one expert each) sums rank 2
// (slot 0), then rank 0 (slot 1), then rank 1 (slot 2). Partials 256, -256, 2^-20 in that order
// keep the 2^-20; in rank order (-256 + 2^-20 rounds to -256 in f32) they give 0.
TEST(HandCombine, HighestSlotOrder) {
  EpConfig cfg = make_config(3, 3, 3, 8, 1, DispatchDtype::kBF16);
  std::vector<RankInput> inputs(3);
  inputs[0].num_tokens = 1;
  inputs[0].routing = {1, 3, {2, 0, 1}, {0.25f, 0.25f, 0.5f}};
  inputs[0].x_bf16.assign(8, bf(1.0f));
  for (int s = 1; s < 3; ++s) inputs[s].routing.topk = 3;
  const auto recv = dispatch_token_major(cfg, inputs);
  std::vector<std::vector<uint16_t>> partials = {std::vector<uint16_t>(8, bf(-256.0f)),
                                                 std::vector<uint16_t>(8, bf(0x1p-20f)),
                                                 std::vector<uint16_t>(8, bf(256.0f))};
  EXPECT_EQ(combine_token_major(cfg, inputs, recv, partials)[0][0], 0x0000);
  cfg.combine_order = CombineOrder::kHighestSlot;
  EXPECT_EQ(combine_token_major(cfg, inputs, recv, partials)[0][0], bf(0x1p-20f));
  // A rank's place is its highest slot: with ids (0, 2, 1) rank 0 (slot 0) adds first.
  std::vector<int> order;
  Routing r6{1, 3, {0, 4, 1}, {}};  // six experts, two a rank: rank 0 holds slots 0 and 2
  ranks_in_highest_slot_order(r6, 0, 2, 3, order);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 0}));  // rank 1 holds none: first, and skipped
  // The order follows the ids: a round routed by a rank mask has none.
  inputs[0].rank_mask = {1, 1, 1};
  inputs[0].expert_counts = {1, 1, 1};
  const auto by_mask = dispatch_token_major(cfg, inputs);
  EXPECT_INPUT_ERROR(combine_token_major(cfg, inputs, by_mask, partials),
                     "inputs[0].rank_mask = set, expected empty with combine_order highest_slot");
}

// DeepEP V2's combine (deep_ep/utils/refs.py, non-expand: each rank reduces its own slots of a
// token in slot order, rounds to bf16, and the token's rank adds those at each rank's highest
// slot, +0 at every other slot, in slot order from the f32 sum of the bias rows), restated
// here: the reference's kHighestSlot gives its bits on random rounds, and rank order does not.
TEST(HandCombine, HighestSlotIsDeepEPV2Order) {
  EpConfig cfg = make_config(4, 16, 8, 128, 64, DispatchDtype::kBF16);
  cfg.combine_order = CombineOrder::kHighestSlot;
  std::vector<RankInput> inputs;
  for (int r = 0; r < 4; ++r)
    inputs.push_back(make_rank_input(
        cfg, 64, make_routing(RoutingKind::kMasked, 64, 16, 8, 17 + r), 100 + r));
  const auto recv = dispatch_token_major(cfg, inputs);
  // y[s][n][k]: the expert output of token n of rank s at slot k, 0 where the id is -1: half
  // of them +-2^20, the others small (under f32's ulp at 2^20), so that the order of the sum
  // shows in its bits ((2^20 - 2^20) + small keeps what (2^20 + small) - 2^20 loses).
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto small = [&] { return bf16_to_float(bf(std::ldexp(normal(gen), -8))); };
  auto draw = [&] { return gen() % 2 == 0 ? (gen() % 2 == 0 ? 0x1p20f : -0x1p20f) : small(); };
  const size_t H = 128, K = 8;
  std::vector<std::vector<float>> y(4), b0(4), b1(4);
  for (int s = 0; s < 4; ++s) {
    y[s].resize(64 * K * H);
    for (size_t i = 0; i < y[s].size(); ++i)
      y[s][i] = inputs[s].routing.ids[i / H] < 0 ? 0.0f : draw();
    for (auto* b : {&b0[s], &b1[s]}) {
      b->resize(64 * H);
      for (float& v : *b) v = small();
    }
  }
  // What each rank passes to combine: its slots of the token summed in slot order, rounded.
  auto rank_partial = [&](int s, int n, int r, size_t h) {
    float acc = 0.0f;
    for (size_t k = 0; k < K; ++k) {
      const int e = inputs[s].routing.ids[n * K + k];
      if (e >= 0 && cfg.expert_rank(e) == r) acc += y[s][(n * K + k) * H + h];
    }
    return bf(acc);
  };
  std::vector<std::vector<uint16_t>> partials(4);
  CombineExtrasRef ex;
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < recv[r].count; ++j)
      for (size_t h = 0; h < H; ++h)
        partials[r].push_back(rank_partial(recv[r].src_rank[j], recv[r].src_idx[j], r, h));
    std::vector<uint16_t> c0, c1;
    for (size_t i = 0; i < b0[r].size(); ++i) c0.push_back(bf(b0[r][i])), c1.push_back(bf(b1[r][i]));
    ex.bias0.push_back(c0);
    ex.bias1.push_back(c1);
  }
  const auto ours = combine_token_major(cfg, inputs, recv, partials, CombineFormat::kBF16, &ex);
  cfg.combine_order = CombineOrder::kRank;
  const auto by_rank = combine_token_major(cfg, inputs, recv, partials, CombineFormat::kBF16, &ex);
  size_t differ = 0;
  for (int s = 0; s < 4; ++s)
    for (int n = 0; n < 64; ++n)
      for (size_t h = 0; h < H; ++h) {
        float acc = b0[s][n * H + h] + b1[s][n * H + h];
        for (size_t k = 0; k < K; ++k) {
          const int e = inputs[s].routing.ids[n * K + k];
          bool highest = e >= 0;
          for (size_t k2 = k + 1; highest && k2 < K; ++k2) {
            const int e2 = inputs[s].routing.ids[n * K + k2];
            if (e2 >= 0 && cfg.expert_rank(e2) == cfg.expert_rank(e)) highest = false;
          }
          acc += highest ? bf16_to_float(rank_partial(s, n, cfg.expert_rank(e), h)) : 0.0f;
        }
        ASSERT_EQ(ours[s][n * H + h], bf(acc)) << s << " " << n << " " << h;
        differ += by_rank[s][n * H + h] != ours[s][n * H + h];
      }
  EXPECT_GT(differ, 0u);  // the order matters on these rounds
}

// p = fmaf(w_1, v_1, fmaf(w_0, v_0, 0)) with w_0 = 1 + 2^-7 + 2^-23, v_0 = -1,
// w_1 = 1 + 2^-23, v_1 = 1 + 2^-7: the exact product w_1 v_1 = 1 + 2^-7 + 2^-23 + 2^-30 cancels
// against p_0 to leave 2^-30. A separate multiply would round the 2^-30 away (y = 0), and the
// opposite k order would too. (Weights need not be positive for the reference.)
TEST(HandCombine, ExpertMajorUsesFmaInSlotOrder) {
  const EpConfig cfg = make_config(1, 2, 2, 8, 1, DispatchDtype::kBF16);
  std::vector<RankInput> inputs(1);
  inputs[0].num_tokens = 1;
  inputs[0].routing = {1, 2, {0, 1}, {1.0f + 0x1p-7f + 0x1p-23f, 1.0f + 0x1p-23f}};
  inputs[0].x_bf16.assign(8, bf(1.0f));
  const auto recv = dispatch_expert_major(cfg, inputs);
  ASSERT_EQ(recv[0].count, (std::vector<int32_t>{1, 1}));
  const std::vector<std::vector<std::vector<uint16_t>>> out = {
      {std::vector<uint16_t>(8, bf(-1.0f)), std::vector<uint16_t>(8, bf(1.0f + 0x1p-7f))}};
  const auto y = combine_expert_major(cfg, inputs, recv, out);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(y[0][h], 0x3080) << h;  // 2^-30
}

TEST(HandCombine, ExpertMajor) {
  Tiny t;
  const auto recv = dispatch_expert_major(t.cfg, t.inputs);
  // Row values: rank 0 e0 = {(0,0): 2, (1,0): 4}, e1 = {(0,0): 6, (0,1): 4};
  //             rank 1 e2 = {(0,1): 8, (1,0): 1}, e3 = {(0,2): -5}.
  auto rows = [](std::vector<float> vals) {
    std::vector<uint16_t> out;
    for (float v : vals) out.insert(out.end(), 8, bf(v));
    return out;
  };
  const std::vector<std::vector<std::vector<uint16_t>>> out = {{rows({2, 4}), rows({6, 4})},
                                                               {rows({8, 1}), rows({-5})}};
  const auto y = combine_expert_major(t.cfg, t.inputs, recv, out);
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(y[0][0 * 8 + h], bf(4.0f));   // 0.5 * 2 + 0.5 * 6
    EXPECT_EQ(y[0][1 * 8 + h], bf(7.0f));   // 0.25 * 4 (rank 0) + 0.75 * 8 (rank 1)
    EXPECT_EQ(y[0][2 * 8 + h], bf(-5.0f));  // 1 * -5
    EXPECT_EQ(y[0][3 * 8 + h], 0x0000);
    EXPECT_EQ(y[1][0 * 8 + h], bf(2.125f));  // 0.375 * 4 (rank 0) + 0.625 * 1 (rank 1)
    EXPECT_EQ(y[1][1 * 8 + h], 0x0000);
    EXPECT_EQ(y[1][2 * 8 + h], 0x0000);
  }
}

TEST(HandDispatch, Fp8PassesBytesAndScalesThrough) {
  const EpConfig cfg = make_config(2, 2, 1, 128, 2, DispatchDtype::kFP8);
  std::vector<RankInput> inputs(2);
  for (int s = 0; s < 2; ++s) {
    inputs[s].num_tokens = 1;
    inputs[s].routing = {1, 1, {1}, {1.0f}};
    inputs[s].x_fp8.resize(128);
    for (int h = 0; h < 128; ++h) inputs[s].x_fp8[h] = static_cast<uint8_t>(h + 100 * s);
    inputs[s].scales = {0.5f + static_cast<float>(s)};
  }
  const auto tm = dispatch_token_major(cfg, inputs);
  EXPECT_EQ(tm[0].count, 0);
  EXPECT_EQ(tm[0].expert_counts, (std::vector<int32_t>{0}));
  ASSERT_EQ(tm[1].count, 2);
  EXPECT_EQ(tm[1].scales, (std::vector<float>{0.5f, 1.5f}));
  EXPECT_EQ(tm[1].x[5], 5);
  EXPECT_EQ(tm[1].x[128 + 5], 105);
  EXPECT_EQ(tm[1].expert_counts, (std::vector<int32_t>{2}));
  const auto em = dispatch_expert_major(cfg, inputs);
  EXPECT_EQ(em[0].count, (std::vector<int32_t>{0}));
  EXPECT_EQ(em[1].count, (std::vector<int32_t>{2}));
  EXPECT_EQ(em[1].scales[0], (std::vector<float>{0.5f, 1.5f}));
  EXPECT_EQ(em[1].x[0], tm[1].x);
  // The identity expert dequantises: row 0 code 0x38 (1.0) at scale 0.5 -> 0.5; row 1 code
  // 0x64 (48.0) at scale 1.5 -> 72.
  const auto out = identity_expert_outputs(cfg, em[1]);
  EXPECT_EQ(out[0][0x38], bf(0.5f));
  EXPECT_EQ(out[0][128], bf(72.0f));
}

TEST(HandDispatch, Bf16ToFp8Quantises) {
  const EpConfig cfg = make_config(1, 8, 2, 256, 1, DispatchDtype::kBF16ToFP8);
  std::vector<RankInput> inputs(1);
  inputs[0].num_tokens = 1;
  inputs[0].routing = {1, 2, {5, 2}, {0.5f, 0.5f}};
  inputs[0].x_bf16.assign(256, bf(0.0f));
  inputs[0].x_bf16[0] = bf(-2.0f);   // block 0: amax 2 -> scale 2/448, -2 -> -448 (0xFE)
  inputs[0].x_bf16[1] = bf(1.0f);    //                              1 -> 224 (0x76)
  inputs[0].x_bf16[200] = bf(8.0f);  // block 1: amax 8 -> scale 8/448, 8 -> 448 (0x7E)
  const auto tm = dispatch_token_major(cfg, inputs);
  ASSERT_EQ(tm[0].count, 1);
  EXPECT_EQ(tm[0].scales, (std::vector<float>{2.0f / 448.0f, 8.0f / 448.0f}));
  EXPECT_EQ(tm[0].x[0], 0xFE);
  EXPECT_EQ(tm[0].x[1], 0x76);
  EXPECT_EQ(tm[0].x[2], 0x00);
  EXPECT_EQ(tm[0].x[200], 0x7E);
  EXPECT_EQ(tm[0].expert_counts, (std::vector<int32_t>{0, 0, 1, 0, 0, 1, 0, 0}));
  const auto v = token_as_float(cfg, inputs[0], 0);
  EXPECT_EQ(v[0], -448.0f * (2.0f / 448.0f));
  EXPECT_EQ(v[200], 448.0f * (8.0f / 448.0f));
}

// The same token with round_scale: scales 2^-7 (2 / 448 rounded up) and 2^-5 (8 / 448).
TEST(HandDispatch, Bf16ToFp8WithRoundScale) {
  EpConfig cfg = make_config(1, 8, 2, 256, 1, DispatchDtype::kBF16ToFP8);
  cfg.round_scale = true;
  std::vector<RankInput> inputs(1);
  inputs[0].num_tokens = 1;
  inputs[0].routing = {1, 2, {5, 2}, {0.5f, 0.5f}};
  inputs[0].x_bf16.assign(256, bf(0.0f));
  inputs[0].x_bf16[0] = bf(-2.0f);   // -2 * 2^7 = -256
  inputs[0].x_bf16[1] = bf(1.0f);    //  1 * 2^7 = 128
  inputs[0].x_bf16[200] = bf(8.0f);  //  8 * 2^5 = 256
  const auto tm = dispatch_token_major(cfg, inputs);
  ASSERT_EQ(tm[0].count, 1);
  EXPECT_EQ(tm[0].scales, (std::vector<float>{1.0f / 128.0f, 1.0f / 32.0f}));
  EXPECT_EQ(tm[0].x[0], fp8_from_float(-256.0f));
  EXPECT_EQ(tm[0].x[1], fp8_from_float(128.0f));
  EXPECT_EQ(tm[0].x[2], 0x00);
  EXPECT_EQ(tm[0].x[200], fp8_from_float(256.0f));
  const auto v = token_as_float(cfg, inputs[0], 0);
  EXPECT_EQ(v[0], -2.0f);
  EXPECT_EQ(v[200], 8.0f);
}

TEST(HandCombine, IdentityPartialsUseOnlyLocalWeights) {
  Tiny t;
  const auto recv = dispatch_token_major(t.cfg, t.inputs);
  // Rank 1 row 0 is token (0,1) with ids {1, 2}: only expert 2 (weight 0.75) is local.
  const auto p1 = identity_partials(t.cfg, 1, recv[1]);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(p1[h], bf(0.75f * static_cast<float>(8 + h)));
  // Rank 0 row 0 is token (0,0) with ids {0, 1}: both local, 0.5 x + 0.5 x = x.
  const auto p0 = identity_partials(t.cfg, 0, recv[0]);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(p0[h], bf(static_cast<float>(h)));
}

// ---- errors ---------------------------------------------------------------------------------

TEST(ReferenceErrors, BadInputsAreRefused) {
  Tiny t;
  EXPECT_THROW(dispatch_token_major(t.cfg, {t.inputs[0]}), InputError);
  auto short_x = t.inputs;
  short_x[1].x_bf16.pop_back();
  EXPECT_THROW(dispatch_expert_major(t.cfg, short_x), InputError);
  auto too_many = t.inputs;
  too_many[0].num_tokens = 5;  // > max_tokens_per_rank = 4
  EXPECT_THROW(dispatch_token_major(t.cfg, too_many), InputError);
  EpConfig bad = t.cfg;
  bad.num_experts = 5;
  EXPECT_THROW(dispatch_token_major(bad, t.inputs), ConfigError);
  const auto recv = dispatch_token_major(t.cfg, t.inputs);
  std::vector<std::vector<uint16_t>> partials = {std::vector<uint16_t>(24),
                                                 std::vector<uint16_t>(23)};
  EXPECT_THROW(combine_token_major(t.cfg, t.inputs, recv, partials), InputError);
  auto dup = recv;
  dup[0].src_idx[1] = 0;  // two rows claim token (0,0)
  partials[1].resize(24);
  EXPECT_THROW(combine_token_major(t.cfg, t.inputs, dup, partials), InputError);
}

// ---- routing generators ---------------------------------------------------------------------

void expect_weights_normalised(const Routing& r) {
  for (int n = 0; n < r.num_tokens; ++n) {
    double sum = 0;
    bool any = false;
    for (int k = 0; k < r.topk; ++k) {
      const float w = r.weights[n * r.topk + k];
      if (r.ids[n * r.topk + k] >= 0) {
        ASSERT_GT(w, 0.0f);
        sum += w;
        any = true;
      } else {
        ASSERT_EQ(w, 0.0f);
      }
    }
    if (any) {
      ASSERT_NEAR(sum, 1.0, 1e-5) << "token " << n;
    }
  }
}

TEST(Routing, UniformIsDistinctAndInRange) {
  for (int topk : {1, 4, 8}) {
    const Routing r = make_routing(RoutingKind::kUniform, 500, 16, topk, 42);
    ASSERT_EQ(r.ids.size(), 500u * topk);
    std::vector<int> hist(16, 0);
    for (int n = 0; n < 500; ++n) {
      ASSERT_TRUE(token_valid(&r.ids[n * topk], topk, 16));
      for (int k = 0; k < topk; ++k) {
        ASSERT_GE(r.ids[n * topk + k], 0);
        ++hist[r.ids[n * topk + k]];
      }
    }
    for (int e = 0; e < 16; ++e) EXPECT_GT(hist[e], 500 * topk / 16 / 2) << e;  // roughly uniform
    expect_weights_normalised(r);
  }
  const Routing all = make_routing(RoutingKind::kUniform, 20, 8, 8, 1);  // K == E
  for (int n = 0; n < 20; ++n) {
    std::vector<int32_t> ids(all.ids.begin() + n * 8, all.ids.begin() + n * 8 + 8);
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  }
}

TEST(Routing, DeterministicBySeed) {
  const Routing a = make_routing(RoutingKind::kSkewed, 64, 64, 8, 9);
  const Routing b = make_routing(RoutingKind::kSkewed, 64, 64, 8, 9);
  const Routing c = make_routing(RoutingKind::kSkewed, 64, 64, 8, 10);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_NE(a.ids, c.ids);
}

TEST(Routing, SkewedFavoursFourHotExperts) {
  const Routing r = make_routing(RoutingKind::kSkewed, 1000, 64, 8, 3, /*hot_expert=*/20);
  int hot = 0;
  for (int n = 0; n < 1000; ++n) {
    ASSERT_TRUE(token_valid(&r.ids[n * 8], 8, 64));
    for (int k = 0; k < 8; ++k) {
      ASSERT_GE(r.ids[n * 8 + k], 0);
      hot += r.ids[n * 8 + k] >= 20 && r.ids[n * 8 + k] < 24;
    }
  }
  // Uniform would put 4/64 of 8000 picks there (500); the skew puts most tokens on all four.
  EXPECT_GT(hot, 3000);
  expect_weights_normalised(r);
}

TEST(Routing, OneExpert) {
  const Routing r = make_routing(RoutingKind::kOneExpert, 10, 32, 4, 1, 17);
  for (int n = 0; n < 10; ++n) {
    EXPECT_EQ(r.ids[n * 4], 17);
    for (int k = 1; k < 4; ++k) EXPECT_EQ(r.ids[n * 4 + k], -1);
    EXPECT_EQ(r.weights[n * 4], 1.0f);
  }
}

TEST(Routing, MaskedDropsAboutAQuarter) {
  const Routing r = make_routing(RoutingKind::kMasked, 4000, 64, 8, 5);
  int masked = 0, fully_masked = 0;
  for (int n = 0; n < 4000; ++n) {
    ASSERT_TRUE(token_valid(&r.ids[n * 8], 8, 64));
    int m = 0;
    for (int k = 0; k < 8; ++k) m += r.ids[n * 8 + k] == -1;
    masked += m;
    fully_masked += m == 8;
  }
  EXPECT_GT(masked, 32000 * 0.2);
  EXPECT_LT(masked, 32000 * 0.3);
  EXPECT_GT(fully_masked, 200);
  expect_weights_normalised(r);
}

TEST(Routing, TokenCounts) {
  EXPECT_EQ(make_token_counts(4, 128, 7, 1), (std::vector<int>{7, 7, 7, 7}));
  EXPECT_EQ(make_token_counts(2, 128, 0, 1), (std::vector<int>{0, 0}));
  bool saw_zero = false, saw_max = false, saw_between = false;
  for (uint64_t seed = 0; seed < 50; ++seed) {
    for (int c : make_token_counts(8, 100, -1, seed)) {
      ASSERT_GE(c, 0);
      ASSERT_LE(c, 100);
      saw_zero |= c == 0;
      saw_max |= c == 100;
      saw_between |= c > 0 && c < 100;
    }
  }
  EXPECT_TRUE(saw_zero && saw_max && saw_between);
  EXPECT_EQ(make_token_counts(8, 100, -1, 3), make_token_counts(8, 100, -1, 3));
  EXPECT_THROW(make_token_counts(2, 4, 5, 0), InputError);
}

TEST(Routing, RankInputMagnitudes) {
  const EpConfig bf = make_config(1, 8, 2, 1024, 256, DispatchDtype::kBF16);
  const Routing r = make_routing(RoutingKind::kUniform, 256, 8, 2, 1);
  const RankInput in = make_rank_input(bf, 256, r, 77);
  ASSERT_EQ(in.x_bf16.size(), 256u * 1024);
  EXPECT_TRUE(in.x_fp8.empty());
  double sq = 0;
  int outliers = 0;
  for (uint16_t b : in.x_bf16) {
    const float f = bf16_to_float(b);
    ASSERT_TRUE(std::isfinite(f));
    outliers += std::fabs(f) > 10;
    if (std::fabs(f) <= 10) sq += double(f) * f;
  }
  EXPECT_NEAR(std::sqrt(sq / in.x_bf16.size()), 1.0, 0.05);
  EXPECT_GT(outliers, 100);  // ~1 in 500 of 262144
  EXPECT_LT(outliers, 1000);
  EXPECT_EQ(in.routing.ids, r.ids);

  const EpConfig f8 = make_config(1, 8, 2, 1024, 256, DispatchDtype::kFP8);
  const RankInput q = make_rank_input(f8, 256, r, 77);
  EXPECT_TRUE(q.x_bf16.empty());
  ASSERT_EQ(q.x_fp8.size(), 256u * 1024);
  ASSERT_EQ(q.scales.size(), 256u * 8);
  // The fp8 input is the quantisation of the same bf16 data.
  std::vector<uint8_t> expect_q(in.x_bf16.size());
  std::vector<float> expect_s(q.scales.size());
  quantize_fp8(in.x_bf16.data(), 256, 1024, expect_q.data(), expect_s.data());
  EXPECT_EQ(q.x_fp8, expect_q);
  EXPECT_EQ(q.scales, expect_s);
}

// ---- properties over seeds and shapes --------------------------------------------------------

struct Case {
  EpConfig cfg;
  std::vector<RankInput> inputs;
  int num_invalid = 0;
};

// Damages about one token in 11 so that it becomes invalid, in one of four ways.
int corrupt(const EpConfig& cfg, RankInput& in, std::mt19937_64& rng) {
  int damaged = 0;
  for (int n = 0; n < in.num_tokens; ++n) {
    if (rng() % 11 != 0) continue;
    int32_t* ids = in.routing.ids.data() + static_cast<size_t>(n) * cfg.topk;
    const int k = static_cast<int>(rng() % cfg.topk);
    switch (rng() % 4) {
      case 0:
        ids[k] = cfg.num_experts;
        break;
      case 1:
        ids[k] = -2 - static_cast<int>(rng() % 5);
        break;
      case 2:
        ids[k] = INT_MIN;
        break;
      case 3:
        if (cfg.topk < 2) {
          ids[k] = cfg.num_experts + 7;
        } else {
          const int32_t e = static_cast<int32_t>(rng() % cfg.num_experts);
          ids[0] = e;
          ids[cfg.topk - 1] = e;
        }
        break;
    }
    ++damaged;
  }
  return damaged;
}

Case make_case(uint64_t seed, int world) {
  static const int kTopks[] = {1, 4, 8};
  static const int kExperts[] = {8, 9, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256};
  static const int kMaxTokens[] = {1, 7, 16, 40};
  const int topk = kTopks[(seed + world) % 3];
  std::vector<int> experts;
  for (int e : kExperts) {
    if (e % world == 0 && e >= topk) experts.push_back(e);
  }
  const int num_experts = experts[(seed * 7 + world) % experts.size()];
  const auto dtype = static_cast<DispatchDtype>((seed / 3 + world) % 3);
  const auto kind = static_cast<RoutingKind>((seed + 2 * world) % 4);
  // bf16 rows only need 16 bytes; use a hidden that is not a multiple of 128 now and then.
  const int hidden = dtype == DispatchDtype::kBF16 && seed % 4 == 1 ? 136 : 128 * (1 + seed % 2);
  const int max_tokens = kMaxTokens[seed % 4];

  Case c;
  c.cfg = make_config(world, num_experts, topk, hidden, max_tokens, dtype);
  const std::vector<int> counts = make_token_counts(world, max_tokens, -1, seed);
  std::mt19937_64 rng(seed * 1000003 + world);
  for (int r = 0; r < world; ++r) {
    const int hot = static_cast<int>(rng() % num_experts);
    Routing routing = make_routing(kind, counts[r], num_experts, topk, seed * 64 + r, hot);
    RankInput in = make_rank_input(c.cfg, counts[r], routing, seed * 64 + r + 1000);
    c.num_invalid += corrupt(c.cfg, in, rng);
    c.inputs.push_back(std::move(in));
  }
  return c;
}

std::string describe(const Case& c) {
  // A stream rather than string concatenation: GCC 12 warns falsely (-Wrestrict) on the latter.
  std::ostringstream os;
  os << "world " << c.cfg.world_size << " E " << c.cfg.num_experts << " K " << c.cfg.topk << " H "
     << c.cfg.hidden << " dtype " << to_string(c.cfg.dtype) << " tokens";
  for (const auto& in : c.inputs) os << ' ' << in.num_tokens;
  os << " invalid " << c.num_invalid;
  return os.str();
}

class ReferenceProperties : public ::testing::TestWithParam<int> {};

TEST_P(ReferenceProperties, DispatchAndCombineKeepTheContract) {
  const uint64_t seed = static_cast<uint64_t>(GetParam());
  for (int world : {1, 2, 3, 4, 8}) {
    const Case c = make_case(seed, world);
    SCOPED_TRACE(describe(c));
    const EpConfig& cfg = c.cfg;

    const auto tm = dispatch_token_major(cfg, c.inputs);
    ASSERT_TRUE(check_token_major(cfg, c.inputs, tm));
    std::vector<std::vector<uint16_t>> partials;
    for (int r = 0; r < world; ++r) partials.push_back(identity_partials(cfg, r, tm[r]));
    const auto y_tm = combine_token_major(cfg, c.inputs, tm, partials);
    ASSERT_TRUE(check_combine_close(cfg, c.inputs, y_tm));

    const auto em = dispatch_expert_major(cfg, c.inputs);
    ASSERT_TRUE(check_expert_major(cfg, c.inputs, em));
    std::vector<std::vector<std::vector<uint16_t>>> outs;
    for (int r = 0; r < world; ++r) outs.push_back(identity_expert_outputs(cfg, em[r]));
    const auto y_em = combine_expert_major(cfg, c.inputs, em, outs);
    ASSERT_TRUE(check_combine_close(cfg, c.inputs, y_em));

    // Both layouts deliver the same (token, expert) pairs.
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(tm[r].expert_counts, em[r].count) << "rank " << r;
    }
    // Combine reads the rows' metadata, so a backend that orders rows differently combines to
    // the same bits. Reverse every rank's rows (and their partials) to show it.
    auto tm_rev = tm;
    auto partials_rev = partials;
    const size_t hidden = static_cast<size_t>(cfg.hidden);
    for (int r = 0; r < world; ++r) {
      const int m = tm[r].count;
      for (int j = 0; j < m; ++j) {
        tm_rev[r].src_rank[j] = tm[r].src_rank[m - 1 - j];
        tm_rev[r].src_idx[j] = tm[r].src_idx[m - 1 - j];
        std::copy_n(partials[r].begin() + (m - 1 - j) * hidden, hidden,
                    partials_rev[r].begin() + j * hidden);
      }
    }
    ASSERT_EQ(combine_token_major(cfg, c.inputs, tm_rev, partials_rev), y_tm);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, ReferenceProperties, ::testing::Range(0, 60));

// Every routing kind and dtype in every world, with zero tokens on some ranks, over the
// largest shapes of the suite: exact delivery counts.
TEST(ReferenceCoverage, EveryKindDtypeAndWorld) {
  for (int world : {1, 2, 3, 4, 8}) {
    for (int kind = 0; kind < 4; ++kind) {
      for (int dt = 0; dt < 3; ++dt) {
        const EpConfig cfg =
            make_config(world, world == 3 ? 192 : 256, 8, 128, 32, static_cast<DispatchDtype>(dt));
        std::vector<RankInput> inputs;
        for (int r = 0; r < world; ++r) {
          const int n = r % 2 == 0 ? 32 : 0;  // zero-token ranks still take part
          const Routing routing =
              make_routing(static_cast<RoutingKind>(kind), n, cfg.num_experts, 8, 100 + r, 5);
          inputs.push_back(make_rank_input(cfg, n, routing, 200 + r));
        }
        SCOPED_TRACE("world " + std::to_string(world) + " kind " + std::to_string(kind) +
                     " dtype " + std::to_string(dt));
        const auto tm = dispatch_token_major(cfg, inputs);
        ASSERT_TRUE(check_token_major(cfg, inputs, tm));
        const auto em = dispatch_expert_major(cfg, inputs);
        ASSERT_TRUE(check_expert_major(cfg, inputs, em));
        // Zero-token ranks send nothing and still receive their share.
        for (int r = 1; r < world; r += 2) {
          for (int j = 0; j < tm[r].count; ++j) ASSERT_NE(tm[r].src_rank[j], r);
        }
      }
    }
  }
}

// A token whose only id is out of range is delivered nowhere and combines to zero.
TEST(ReferenceCoverage, AllTokensInvalid) {
  const EpConfig cfg = make_config(2, 8, 1, 128, 8, DispatchDtype::kBF16);
  std::vector<RankInput> inputs;
  for (int r = 0; r < 2; ++r) {
    inputs.push_back(
        make_rank_input(cfg, 8, make_routing(RoutingKind::kOneExpert, 8, 8, 1, 1, 8), r));
  }
  const auto tm = dispatch_token_major(cfg, inputs);
  const auto em = dispatch_expert_major(cfg, inputs);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(tm[r].count, 0);
    EXPECT_EQ(em[r].count, (std::vector<int32_t>(4, 0)));
  }
  const auto y = combine_token_major(cfg, inputs, tm, {{}, {}});
  for (const auto& ys : y) {
    for (uint16_t b : ys) ASSERT_EQ(b, 0);
  }
}

// ---- the checks can fail ------------------------------------------------------------------

TEST(NegativeChecks, CheckersCatchWrongAnswers) {
  const Case c = make_case(15, 4);  // max_tokens 40
  const EpConfig& cfg = c.cfg;
  const auto tm = dispatch_token_major(cfg, c.inputs);
  ASSERT_TRUE(check_token_major(cfg, c.inputs, tm));
  int busy = 0;
  for (int r = 0; r < cfg.world_size; ++r) busy = tm[r].count > tm[busy].count ? r : busy;
  ASSERT_GE(tm[busy].count, 2) << describe(c);

  {  // two rows swapped (metadata only): the order check fires
    auto wrong = tm;
    std::swap(wrong[busy].src_idx[0], wrong[busy].src_idx[1]);
    std::swap(wrong[busy].src_rank[0], wrong[busy].src_rank[1]);
    EXPECT_FALSE(check_token_major(cfg, c.inputs, wrong));
  }
  {  // one payload byte flipped
    auto wrong = tm;
    wrong[busy].x[wrong[busy].x.size() / 2] ^= 0x01;
    EXPECT_FALSE(check_token_major(cfg, c.inputs, wrong));
  }
  {  // a row missing
    auto wrong = tm;
    TokenMajorRecv& R = wrong[busy];
    R.count -= 1;
    R.src_rank.pop_back();
    R.src_idx.pop_back();
    R.x.resize(R.x.size() - static_cast<size_t>(cfg.wire_row_bytes()));
    if (cfg.wire_fp8()) R.scales.resize(R.scales.size() - cfg.num_scale_groups());
    R.topk_ids.resize(R.topk_ids.size() - cfg.topk);
    R.topk_weights.resize(R.topk_weights.size() - cfg.topk);
    EXPECT_FALSE(check_token_major(cfg, c.inputs, wrong));
  }
  {  // an expert count off by one
    auto wrong = tm;
    wrong[busy].expert_counts[0] += 1;
    EXPECT_FALSE(check_token_major(cfg, c.inputs, wrong));
  }

  const auto em = dispatch_expert_major(cfg, c.inputs);
  ASSERT_TRUE(check_expert_major(cfg, c.inputs, em));
  {  // a wrong topk_slot
    auto wrong = em;
    for (auto& slots : wrong[busy].topk_slot) {
      if (!slots.empty()) {
        slots[0] = (slots[0] + 1) % cfg.topk;
        break;
      }
    }
    EXPECT_FALSE(check_expert_major(cfg, c.inputs, wrong));
  }

  // Combine: one element off by 4 bf16 ulps falls outside the tolerance.
  std::vector<std::vector<uint16_t>> partials;
  for (int r = 0; r < cfg.world_size; ++r) partials.push_back(identity_partials(cfg, r, tm[r]));
  auto y = combine_token_major(cfg, c.inputs, tm, partials);
  ASSERT_TRUE(check_combine_close(cfg, c.inputs, y));
  bool changed = false;
  for (auto& ys : y) {
    for (auto& b : ys) {
      if (!changed && std::fabs(bf16_to_float(b)) > 0.5f) {
        b = static_cast<uint16_t>(b + 4);
        changed = true;
      }
    }
  }
  ASSERT_TRUE(changed);
  const testing::AssertionResult verdict = check_combine_close(cfg, c.inputs, y);
  EXPECT_FALSE(verdict);
  EXPECT_NE(std::string(verdict.message()).find("expected"), std::string::npos)
      << verdict.message();
}

}  // namespace
}  // namespace epx::ref
