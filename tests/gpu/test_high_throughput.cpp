// GPU suite of the high_throughput backend on in-process worlds sharing one GPU: every case runs
// dispatch -> identity expert -> combine and compares all outputs with the CPU reference
// (dispatch exactly and in order: its rows are always ordered by (source rank, source index);
// combine bit for bit), with receive areas sized per call (the host reads the count back) and
// for the worst case (no host read, graph replays), per rank and one launch per GPU; directly
// between the ranks' areas (the default in one process) and through rings (as process worlds),
// with rings small enough that every call laps them many times.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "gpu_group.hpp"
#include "reference/reference.hpp"
#include "testing/harness.hpp"
#include "testing/threads.hpp"

namespace epx {
namespace {

struct HtCase {
  const char* name;
  int world, hidden, experts, topk;
  std::vector<int> tokens;  // one count for every rank, or one per rank
  DispatchDtype dtype;
  ref::RoutingKind routing;
  ScaleLayout scales = ScaleLayout::kRowMajor;
  bool ids64 = false;
};

using D = DispatchDtype;
using R = ref::RoutingKind;

const HtCase kCases[] = {
    {"w1_h2048_e8_k1_bf16", 1, 2048, 8, 1, {7}, D::kBF16, R::kUniform},
    {"w2_h7168_e256_k8_q", 2, 7168, 256, 8, {0, 128}, D::kBF16ToFP8, R::kUniform},
    {"w3_h2048_e24_k4_fp8_col",
     3,
     2048,
     24,
     4,
     {7, 0, 1024},
     D::kFP8,
     R::kSkewed,
     ScaleLayout::kColumnMajor},
    {"w4_h4096_e32_k4_bf16_masked_ids64",
     4,
     4096,
     32,
     4,
     {0, 1, 7, 1024},
     D::kBF16,
     R::kMasked,
     ScaleLayout::kRowMajor,
     true},
    {"w4_h7168_e64_k8_q_oneexpert",
     4,
     7168,
     64,
     8,
     {1024, 128, 0, 7},
     D::kBF16ToFP8,
     R::kOneExpert},
    {"w8_r1_1024_q", 8, 7168, 256, 8, {1024}, D::kBF16ToFP8, R::kUniform},
    {"w8_r1_mixed_fp8", 8, 7168, 256, 8, {0, 1, 7, 128, 4096, 0, 1024, 7}, D::kFP8, R::kSkewed},
    {"w8_h2048_e8_k1_bf16", 8, 2048, 8, 1, {4096, 0, 1, 7, 128, 1, 0, 7}, D::kBF16, R::kUniform},
    // Rows whose 16-byte vectors are no multiple of a warp's (136 fp8, 125 bf16).
    {"w5_h2176_e40_k5_q_col",
     5,
     2176,
     40,
     5,
     {33, 0, 17, 300, 1},
     D::kBF16ToFP8,
     R::kUniform,
     ScaleLayout::kColumnMajor},
    {"w3_h1000_e12_k3_bf16", 3, 1000, 12, 3, {5, 77, 0}, D::kBF16, R::kSkewed},
};

testing::CheckOptions options_for(const HtCase& c, bool worst_case) {
  testing::CheckOptions o;
  o.backend = Backend::kHighThroughput;
  o.cfg.world_size = c.world;
  o.cfg.hidden = c.hidden;
  o.cfg.num_experts = c.experts;
  o.cfg.topk = c.topk;
  o.cfg.dtype = c.dtype;
  o.cfg.scale_layout = c.scales;
  o.cfg.worst_case_output = worst_case;
  o.tokens = c.tokens;
  int max_t = 1;
  for (int t : o.tokens) max_t = std::max(max_t, t);
  o.cfg.max_tokens_per_rank = max_t;
  o.routing = c.routing;
  o.ids_int64 = c.ids64;
  o.iters = 2;
  o.seed = 13;
  return o;
}

std::string describe(const testing::CheckReport& rep) {
  std::string s;
  for (const auto& m : rep.mismatches) s += "\n  " + m;
  return s;
}

// Sized per call (each rank from its own host thread) and for the worst case.
class HtCheck : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(HtCheck, MatchesReferenceInOrder) {
  REQUIRE_GPU();
  const auto [index, worst_case] = GetParam();
  const auto rep = testing::run_check(options_for(kCases[index], worst_case));
  EXPECT_TRUE(rep.ok) << describe(rep);
  EXPECT_EQ(rep.calls, 2);
}

INSTANTIATE_TEST_SUITE_P(Shapes, HtCheck,
                         ::testing::Combine(::testing::Range(0, int(std::size(kCases))),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& i) {
                           return std::string(kCases[std::get<0>(i.param)].name) +
                                  (std::get<1>(i.param) ? "_worst_case" : "_sized");
                         });

// Power-of-two scales (EpConfig::round_scale) on every quantised shape, sized and worst case.
TEST(HighThroughput, RoundScaleMatchesReference) {
  REQUIRE_GPU();
  int shapes = 0;
  for (const HtCase& c : kCases) {
    if (c.dtype != DispatchDtype::kBF16ToFP8) continue;
    for (const bool worst_case : {false, true}) {
      auto o = options_for(c, worst_case);
      o.cfg.round_scale = true;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << c.name << (worst_case ? " worst case" : " sized") << describe(rep);
    }
    ++shapes;
  }
  EXPECT_GE(shapes, 3);
}

// One launch per GPU, sized per call (one host read for the group) and, for the worst case,
// captured once and replayed.
TEST(HighThroughput, OneLaunchSizedAndReplayed) {
  REQUIRE_GPU();
  for (const bool worst_case : {false, true}) {
    auto o = options_for(kCases[6], worst_case);
    o.one_launch = true;
    o.graph_replays = worst_case ? 20 : 0;
    const auto rep = testing::run_check(o);
    EXPECT_TRUE(rep.ok) << (worst_case ? "worst case" : "sized") << describe(rep);
  }
}

// The expert stage writes into the caller's own memory from a stream-ordered pool (what PyTorch's
// caching allocator or expandable segments hand out: not readable from another GPU), not into
// combine_buffer(): direct mode copies it into the combine buffer before the peers read it.
// Per rank and one launch per GPU, sized per call and worst case; on every visible GPU (two or
// more: the peers on other GPUs would fault on the caller's memory without the copy).
TEST(HighThroughput, ExpertOutFromAStreamOrderedPool) {
  REQUIRE_GPU();
  const int gpus = std::min(cuda_device_count(), 4);
  for (const bool worst_case : {false, true}) {
    for (const bool one_launch : {false, true}) {
      auto o = options_for(kCases[4], worst_case);  // 4 ranks, 1024/128/0/7 tokens
      o.pool_expert_out = true;
      o.one_launch = one_launch;
      o.gpus = gpus;
      o.graph_replays = worst_case ? 5 : 0;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << (worst_case ? "worst case" : "sized")
                          << (one_launch ? ", one launch" : ", per rank") << ", " << gpus
                          << " GPU(s)" << describe(rep);
    }
  }
}

// Rings in one process (ring_rows set: what process worlds always use), sized per call on odd
// shapes and for the worst case, and one launch per GPU.
TEST(HighThroughput, RingsInOneProcess) {
  REQUIRE_GPU();
  for (const int index : {2, 4, 6}) {
    for (const bool worst_case : {false, true}) {
      auto o = options_for(kCases[index], worst_case);
      o.launch.dispatch.ring_rows = o.launch.combine.ring_rows = 64;
      o.one_launch = index == 6;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << kCases[index].name << (worst_case ? " worst case" : " sized")
                          << describe(rep);
    }
  }
}

// Graph replays with fresh inputs, and one rank eager while the others replay: the epochs and
// ring positions live on the device and advance with every call, captured or not; without rings
// (the default in one process) and with them.
TEST(HighThroughput, GraphReplaysAndMixed) {
  REQUIRE_GPU();
  for (const int ring_rows : {0, 64}) {
    for (const bool mixed : {false, true}) {
      if (ring_rows != 0 && !mixed) continue;
      auto o = options_for(kCases[5], true);
      o.launch.dispatch.ring_rows = o.launch.combine.ring_rows = ring_rows;
      o.iters = 1;
      o.graph_replays = 100;
      o.mixed = mixed;
      o.verify_every = 10;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << (mixed ? "mixed" : "graph") << " ring_rows " << ring_rows
                          << describe(rep);
      EXPECT_EQ(rep.replays, 100);
    }
  }
}

// Rings of 4 rows with 2-warp blocks and one channel: 4096 tokens per rank lap each ring about a
// thousand times a call, so the writers wait for the readers again and again.
TEST(HighThroughput, SmallRingsLapManyTimes) {
  REQUIRE_GPU();
  auto o = options_for(kCases[7], false);
  o.cfg.world_size = 4;
  o.tokens = {4096, 1, 0, 2048};
  o.cfg.max_tokens_per_rank = 4096;
  for (LaunchConfig* op : {&o.launch.dispatch, &o.launch.combine}) {
    op->num_blocks = 2;
    op->warps_per_block = 2;
    op->ring_rows = 4;
  }
  const auto rep = testing::run_check(o);
  EXPECT_TRUE(rep.ok) << describe(rep);
}

// A rank that never calls: its peers' waits expire with a TimeoutError naming it, and nothing
// hangs (the receiving blocks give up after the timeout without progress).
TEST(HighThroughput, AMissingRankTimesOutNamingIt) {
  REQUIRE_GPU();
  EpConfig c = gpu_test::small_config();
  c.worst_case_output = true;  // no host read: rank 0's dispatch returns at once
  gpu_test::Group g(c, 2, Backend::kHighThroughput);
  const int N = 8;
  std::vector<uint16_t> x(size_t(N) * c.hidden, 0x3f80);
  std::vector<int32_t> ids(size_t(N) * c.topk);
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < c.topk; ++k) ids[size_t(n) * c.topk + k] = (n + 4 * k) % c.num_experts;
  std::vector<float> w(ids.size(), 0.25f);
  DispatchInput in{
      .num_tokens = N, .x = g.upload(x), .topk_ids = g.upload(ids), .topk_weights = g.upload(w)};
  (void)g.a2a[0]->dispatch(in, g.streams[0]);
  try {
    g.a2a[0]->synchronize(g.streams[0]);
    FAIL() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(g.a2a[0]->dispatch(in, g.streams[0]), StateError);
}

// A bf16 configuration of the hand-made cases below (20 s waits: ranks share one GPU).
EpConfig bf16_config(int world, int hidden, int experts, int topk, int max_tokens) {
  EpConfig c;
  c.world_size = world;
  c.hidden = hidden;
  c.num_experts = experts;
  c.topk = topk;
  c.max_tokens_per_rank = max_tokens;
  c.dtype = DispatchDtype::kBF16;
  c.timeout_ms = 20000;
  return c;
}

// DeepEP's normal mode on the core: rank 1 routes by a rank mask with its own per-expert counts
// (DispatchInput::rank_mask) while ranks 0 and 2 route by ids, and combine brings each row's
// top-k weights back and starts its sum from bias rows (CombineExtras). Every output against the
// reference, bit for bit: the rows and their metadata in order, the expert counts, y and the
// summed weights. Directly between the ranks' areas and through rings; each rank on a thread of
// its own, as processes call.
TEST(HighThroughput, RankMaskAndCombineExtrasMatchReference) {
  REQUIRE_GPU();
  EpConfig c = bf16_config(3, 1024, 12, 3, 40);
  c.worst_case_output = true;
  const int W = c.world_size, K = c.topk, H = c.hidden, E = c.num_experts, cap = c.capacity();
  const std::vector<int> tokens = {40, 17, 0};
  std::vector<ref::RankInput> in(static_cast<size_t>(W));
  for (int s = 0; s < W; ++s) {
    const auto routing = ref::make_routing(ref::RoutingKind::kUniform, tokens[s], E, K, 7 + s);
    in[s] = ref::make_rank_input(c, tokens[s], routing, 70 + s);
  }
  // Rank 1: the mask and counts its ids give, and no ids on the wire.
  ref::RankInput& m = in[1];
  m.rank_mask.assign(size_t(m.num_tokens) * W, 0);
  m.expert_counts.assign(size_t(E), 0);
  for (int n = 0; n < m.num_tokens; ++n) {
    for (int k = 0; k < K; ++k) {
      const int e = m.routing.ids[size_t(n) * K + k];
      if (e < 0) continue;
      m.rank_mask[size_t(n) * W + c.expert_rank(e)] = 1;
      ++m.expert_counts[size_t(e)];
    }
  }
  const auto want = ref::dispatch_token_major(c, in);
  // Combine: each row's partial is its x; weights 0.5 j + k + r / 4 (exact in f32); a bias pair
  // for rank 0, one bias row for rank 1, none for rank 2.
  std::vector<std::vector<uint16_t>> partials(static_cast<size_t>(W));
  ref::CombineExtrasRef ex;
  ex.topk_weights.resize(static_cast<size_t>(W));
  ex.bias0.resize(static_cast<size_t>(W));
  ex.bias1.resize(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    const auto& x = want[size_t(r)].x;
    partials[r].resize(x.size() / 2);
    std::memcpy(partials[r].data(), x.data(), x.size());
    for (int j = 0; j < want[r].count; ++j)
      for (int k = 0; k < K; ++k) ex.topk_weights[r].push_back(0.5f * j + k + 0.25f * r);
    const size_t nh = size_t(tokens[r]) * H;
    for (size_t i = 0; i < nh && r < 2; ++i)
      ex.bias0[r].push_back(ref::bf16_from_float(float(int(i % 97) - 48) / 8));
    for (size_t i = 0; i < nh && r == 0; ++i) ex.bias1[r].push_back(ref::bf16_from_float(3.0f));
  }
  const auto want_y = ref::combine_token_major(c, in, want, partials, ref::CombineFormat::kBF16, &ex);

  for (const int ring_rows : {0, 64}) {
    LaunchConfigs lc;
    lc.dispatch.ring_rows = lc.combine.ring_rows = ring_rows;
    gpu_test::Group g(c, W, Backend::kHighThroughput, lc);
    std::vector<DispatchInput> din(static_cast<size_t>(W));
    std::vector<CombineExtras> cex(static_cast<size_t>(W));
    std::vector<void*> out(static_cast<size_t>(W)), y(static_cast<size_t>(W));
    std::vector<float*> y_w(static_cast<size_t>(W));
    for (int s = 0; s < W; ++s) {
      din[s].num_tokens = tokens[s];
      din[s].x = g.upload(in[s].x_bf16);
      if (s == 1) {
        din[s].rank_mask = g.upload(in[s].rank_mask);
        din[s].expert_counts = g.upload(in[s].expert_counts);
      } else {
        din[s].topk_ids = g.upload(in[s].routing.ids);
        din[s].topk_weights = g.upload(in[s].routing.weights);
      }
      std::vector<uint16_t> p(size_t(cap) * H, 0);
      std::copy(partials[s].begin(), partials[s].end(), p.begin());
      out[s] = g.upload(p);
      y[s] = g.upload(std::vector<uint16_t>(size_t(tokens[s]) * H, 0xFFFF));
      std::vector<float> w(size_t(cap) * K, 0.0f);
      std::copy(ex.topk_weights[s].begin(), ex.topk_weights[s].end(), w.begin());
      cex[s].topk_weights = g.upload(w);
      y_w[s] = g.upload(std::vector<float>(size_t(tokens[s]) * K, -1.0f));
      cex[s].y_topk_weights = y_w[s];
      if (!ex.bias0[s].empty()) cex[s].bias[0] = g.upload(ex.bias0[s]);
      if (!ex.bias1[s].empty()) cex[s].bias[1] = g.upload(ex.bias1[s]);
    }
    std::vector<DispatchResult> res(static_cast<size_t>(W));
    testing::run_on_threads(
        W, [](int) { return 0; },
        [&](int s) {
          res[s] = g.a2a[s]->dispatch(din[s], g.streams[s]);
          g.a2a[s]->combine(out[s], y[s], cex[s], g.streams[s]);
          g.a2a[s]->synchronize(g.streams[s]);
        });
    for (int r = 0; r < W; ++r) {
      const auto& w = want[size_t(r)];
      const std::string at = "rank " + std::to_string(r) + ", ring_rows " + std::to_string(ring_rows);
      int32_t count = -1;
      EPX_CUDA_CHECK(cudaMemcpy(&count, res[r].recv_count, 4, cudaMemcpyDeviceToHost));
      ASSERT_EQ(count, w.count) << at;
      auto down = [&](const auto* d, size_t n) {
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(d)>>;
        std::vector<T> h(n);
        if (n > 0) EPX_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
      };
      EXPECT_EQ(down(static_cast<const uint8_t*>(res[r].recv_x), w.x.size()), w.x) << at;
      EXPECT_EQ(down(res[r].recv_src_rank, size_t(count)), w.src_rank) << at;
      EXPECT_EQ(down(res[r].recv_src_idx, size_t(count)), w.src_idx) << at;
      EXPECT_EQ(down(res[r].recv_topk_ids, size_t(count) * K), w.topk_ids) << at;
      EXPECT_EQ(down(res[r].recv_topk_weights, size_t(count) * K), w.topk_weights) << at;
      EXPECT_EQ(down(res[r].expert_counts, size_t(E / W)), w.expert_counts) << at;
      EXPECT_EQ(down(static_cast<const uint16_t*>(y[r]), size_t(tokens[r]) * H), want_y[r]) << at;
      EXPECT_EQ(down(y_w[r], size_t(tokens[r]) * K), ex.y_topk_weights[r]) << at;
    }
  }
}

// CombineOrder::kHighestSlot (DeepEP V2's order): each token's partials added at each rank's
// highest top-k slot, bit for bit with the reference, directly and through rings, with ids of
// -1 among them. The partials are such that rank order gives other bits (checked: the test
// would see a kernel that kept rank order).
TEST(HighThroughput, HighestSlotOrderMatchesReference) {
  REQUIRE_GPU();
  EpConfig c = bf16_config(4, 256, 8, 4, 48);
  c.combine_order = CombineOrder::kHighestSlot;
  const int W = c.world_size, K = c.topk, H = c.hidden, cap = c.capacity();
  const std::vector<int> tokens = {48, 31, 0, 9};
  std::vector<ref::RankInput> in(static_cast<size_t>(W));
  for (int s = 0; s < W; ++s) {
    const auto routing = ref::make_routing(ref::RoutingKind::kMasked, tokens[s], 8, K, 31 + s);
    in[s] = ref::make_rank_input(c, tokens[s], routing, 90 + s);
  }
  const auto want = ref::dispatch_token_major(c, in);
  // Half the partials +-2^20, the others under f32's ulp there: (2^20 - 2^20) + small keeps
  // what (2^20 + small) - 2^20 loses.
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<uint16_t>> partials(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r)
    for (size_t i = 0; i < size_t(want[r].count) * H; ++i)
      partials[r].push_back(ref::bf16_from_float(
          gen() % 2 == 0 ? (gen() % 2 == 0 ? 0x1p20f : -0x1p20f) : std::ldexp(normal(gen), -8)));
  const auto want_y = ref::combine_token_major(c, in, want, partials);
  EpConfig by_rank = c;
  by_rank.combine_order = CombineOrder::kRank;
  EXPECT_NE(ref::combine_token_major(by_rank, in, want, partials), want_y);
  for (const int ring_rows : {0, 64}) {
    LaunchConfigs lc;
    lc.dispatch.ring_rows = lc.combine.ring_rows = ring_rows;
    gpu_test::Group g(c, W, Backend::kHighThroughput, lc);
    std::vector<DispatchInput> din(static_cast<size_t>(W));
    std::vector<void*> out(static_cast<size_t>(W)), y(static_cast<size_t>(W));
    for (int s = 0; s < W; ++s) {
      din[s].num_tokens = tokens[s];
      din[s].x = g.upload(in[s].x_bf16);
      din[s].topk_ids = g.upload(in[s].routing.ids);
      din[s].topk_weights = g.upload(in[s].routing.weights);
      std::vector<uint16_t> p(size_t(cap) * H, 0);
      std::copy(partials[s].begin(), partials[s].end(), p.begin());
      out[s] = g.upload(p);
      y[s] = g.upload(std::vector<uint16_t>(size_t(tokens[s]) * H, 0xFFFF));
    }
    testing::run_on_threads(
        W, [](int) { return 0; },
        [&](int s) {
          (void)g.a2a[s]->dispatch(din[s], g.streams[s]);
          g.a2a[s]->combine(out[s], y[s], g.streams[s]);
          g.a2a[s]->synchronize(g.streams[s]);
        });
    for (int r = 0; r < W; ++r) {
      std::vector<uint16_t> got(size_t(tokens[r]) * H);
      if (!got.empty())
        EPX_CUDA_CHECK(cudaMemcpy(got.data(), y[r], got.size() * 2, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got, want_y[r]) << "rank " << r << ", ring_rows " << ring_rows;
    }
  }
}

// What the backend refuses, by name, before anything is launched.
TEST(HighThroughput, RefusesWhatItCannotDo) {
  REQUIRE_GPU();
  EpConfig c = gpu_test::small_config();
  c.world_size = 2;
  InProcessWorld world(2);
  auto refuses = [&](EpConfig cfg, LaunchConfigs lc, const char* field) {
    try {
      (void)make_all2all_group(Backend::kHighThroughput, cfg, world, lc);
      ADD_FAILURE() << "expected a ConfigError naming " << field;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  EpConfig em = c;
  em.layout = OutputLayout::kExpertMajor;
  refuses(em, {}, "layout");
  EpConfig r2 = c;
  r2.rounds_in_flight = 2;
  refuses(r2, {}, "rounds_in_flight");
  EpConfig push = c;
  push.combine = CombineMode::kPush;
  refuses(push, {}, "combine = push");
  LaunchConfigs odd;
  odd.dispatch.num_blocks = 3;
  refuses(c, odd, "dispatch.num_blocks");
  LaunchConfigs ring;
  ring.combine.warps_per_block = 8;
  ring.combine.ring_rows = 8;
  refuses(c, ring, "combine.ring_rows");
  LaunchConfigs apart;
  apart.dispatch.num_blocks = 4;
  apart.combine.num_blocks = 2;
  refuses(c, apart, "combine.num_blocks");
  LaunchConfigs follows;  // combine left to choose takes the dispatch's channels
  follows.dispatch.num_blocks = 4;
  EXPECT_NO_THROW((void)make_all2all_group(Backend::kHighThroughput, c, world, follows));
  gpu_test::Group g(c, 2, Backend::kHighThroughput);
  EXPECT_THROW(g.a2a[0]->dispatch_send({}, g.streams[0]), ConfigError);
}

}  // namespace
}  // namespace epx
