// GPU suite of the low_latency backend on in-process worlds sharing one GPU (DESIGN §7).
// Every case runs dispatch -> identity expert -> combine and compares all outputs with the CPU
// reference: dispatch exactly, combine bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <thread>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"
#include "gpu_group.hpp"
#include "reference/reference.hpp"
#include "testing/harness.hpp"

namespace epx {
namespace {

struct Case {
  const char* name;
  int world, hidden, experts, topk;
  std::vector<int> tokens;  // one count for every rank, or one per rank
  DispatchDtype dtype;
  OutputLayout layout;
  ref::RoutingKind routing;
  ScaleLayout scales = ScaleLayout::kRowMajor;
  bool ids64 = false;
  int iters = 2;
};

using D = DispatchDtype;
using L = OutputLayout;
using R = ref::RoutingKind;

const Case kCases[] = {
    // world 1: everything stays local
    {"w1_h2048_e8_k1_bf16", 1, 2048, 8, 1, {7}, D::kBF16, L::kTokenMajor, R::kUniform},
    {"w1_h4096_e16_k4_fp8_expert", 1, 4096, 16, 4, {128}, D::kFP8, L::kExpertMajor, R::kUniform},
    // world 2 and 3 (3 does not divide the power-of-two expert counts: 24, 48 experts)
    {"w2_h7168_e256_k8_q", 2, 7168, 256, 8, {0, 128}, D::kBF16ToFP8, L::kTokenMajor, R::kUniform},
    {"w2_h2048_e8_k8_bf16_expert", 2, 2048, 8, 8, {1, 7}, D::kBF16, L::kExpertMajor, R::kUniform},
    {"w3_h2048_e24_k4_fp8", 3, 2048, 24, 4, {7, 0, 128}, D::kFP8, L::kTokenMajor, R::kSkewed},
    {"w3_h4096_e48_k8_q_expert_col",
     3,
     4096,
     48,
     8,
     {128, 1, 7},
     D::kBF16ToFP8,
     L::kExpertMajor,
     R::kMasked,
     ScaleLayout::kColumnMajor},
    // world 4
    {"w4_h4096_e32_k4_bf16_masked",
     4,
     4096,
     32,
     4,
     {0, 1, 7, 128},
     D::kBF16,
     L::kTokenMajor,
     R::kMasked},
    {"w4_h7168_e64_k8_q_oneexpert",
     4,
     7168,
     64,
     8,
     {128, 128, 0, 7},
     D::kBF16ToFP8,
     L::kTokenMajor,
     R::kOneExpert},
    {"w4_h7168_e64_k8_q_oneexpert_expert",
     4,
     7168,
     64,
     8,
     {128, 7, 0, 128},
     D::kBF16ToFP8,
     L::kExpertMajor,
     R::kOneExpert},
    {"w4_h2048_e16_k1_fp8_col_ids64",
     4,
     2048,
     16,
     1,
     {1024, 0, 7, 1},
     D::kFP8,
     L::kTokenMajor,
     R::kUniform,
     ScaleLayout::kColumnMajor,
     true},
    // world 8: the DeepSeek-R1 shape and friends
    {"w8_r1_128_q", 8, 7168, 256, 8, {128}, D::kBF16ToFP8, L::kTokenMajor, R::kUniform},
    {"w8_r1_128_bf16", 8, 7168, 256, 8, {128}, D::kBF16, L::kTokenMajor, R::kUniform},
    {"w8_r1_128_fp8_expert", 8, 7168, 256, 8, {128}, D::kFP8, L::kExpertMajor, R::kUniform},
    {"w8_r1_mixed_tokens_q",
     8,
     7168,
     256,
     8,
     {0, 1, 7, 128, 1024, 0, 128, 7},
     D::kBF16ToFP8,
     L::kTokenMajor,
     R::kSkewed},
    {"w8_r1_1024_q",
     8,
     7168,
     256,
     8,
     {1024},
     D::kBF16ToFP8,
     L::kTokenMajor,
     R::kUniform,
     ScaleLayout::kRowMajor,
     false,
     1},
    {"w8_r1_1024_bf16_expert",
     8,
     7168,
     256,
     8,
     {1024},
     D::kBF16,
     L::kExpertMajor,
     R::kUniform,
     ScaleLayout::kRowMajor,
     false,
     1},
    {"w8_h4096_e8_k1_fp8_masked",
     8,
     4096,
     8,
     1,
     {128, 0, 1, 7, 128, 1, 0, 7},
     D::kFP8,
     L::kTokenMajor,
     R::kMasked},
    {"w8_h2048_e128_k4_q_oneexpert_expert",
     8,
     2048,
     128,
     4,
     {7, 128, 1, 0, 128, 7, 1, 128},
     D::kBF16ToFP8,
     L::kExpertMajor,
     R::kOneExpert},
};

class CheckCase : public ::testing::TestWithParam<Case> {};

testing::CheckOptions options_for(const Case& c) {
  testing::CheckOptions o;
  o.cfg.world_size = c.world;
  o.cfg.hidden = c.hidden;
  o.cfg.num_experts = c.experts;
  o.cfg.topk = c.topk;
  o.cfg.dtype = c.dtype;
  o.cfg.layout = c.layout;
  o.cfg.scale_layout = c.scales;
  o.tokens = c.tokens;
  int max_t = 1;
  for (int t : o.tokens) max_t = std::max(max_t, t);
  o.cfg.max_tokens_per_rank = max_t;
  o.routing = c.routing;
  o.ids_int64 = c.ids64;
  o.iters = c.iters;
  o.seed = 11;
  return o;
}

std::string describe(const testing::CheckReport& rep) {
  std::string s;
  for (const auto& m : rep.mismatches) s += "\n  " + m;
  return s;
}

TEST_P(CheckCase, MatchesReference) {
  REQUIRE_GPU();
  const auto rep = testing::run_check(options_for(GetParam()));
  EXPECT_TRUE(rep.ok) << describe(rep);
  EXPECT_EQ(rep.calls, GetParam().iters);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CheckCase, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.name);
                         });

// Push combine (EpConfig::combine = push): every rank writes each partial into its token's rank,
// which sums from its own memory. The reference's bits, as pull gives, on token- and expert-major
// shapes, worlds of 1 to 8, empty ranks, skewed, masked and one-expert routing, and under
// allgather_reducescatter; then one launch, graph replays mixed with eager calls, the halves and
// two rounds in flight.
class PushCase : public ::testing::TestWithParam<std::tuple<Backend, int>> {};

TEST_P(PushCase, MatchesReference) {
  REQUIRE_GPU();
  const auto [backend, index] = GetParam();
  auto o = options_for(kCases[index]);
  o.backend = backend;
  o.cfg.combine = CombineMode::kPush;
  const auto rep = testing::run_check(o);
  EXPECT_TRUE(rep.ok) << describe(rep);
  EXPECT_EQ(rep.calls, kCases[index].iters);
}

INSTANTIATE_TEST_SUITE_P(Combine, PushCase,
                         ::testing::Values(std::tuple{Backend::kLowLatency, 0},
                                           std::tuple{Backend::kLowLatency, 3},
                                           std::tuple{Backend::kLowLatency, 5},
                                           std::tuple{Backend::kLowLatency, 6},
                                           std::tuple{Backend::kLowLatency, 8},
                                           std::tuple{Backend::kLowLatency, 12},
                                           std::tuple{Backend::kLowLatency, 13},
                                           std::tuple{Backend::kAllgatherReduceScatter, 4},
                                           std::tuple{Backend::kAllgatherReduceScatter, 13}),
                         [](const ::testing::TestParamInfo<std::tuple<Backend, int>>& i) {
                           return std::string(to_string(std::get<0>(i.param))) + "_" +
                                  kCases[std::get<1>(i.param)].name;
                         });

// Power-of-two scales (EpConfig::round_scale): every shape quantised in dispatch matches the
// reference's bytes and scales, under low_latency and allgather_reducescatter.
TEST(RoundScale, MatchesReferenceOnEveryQuantisedShape) {
  REQUIRE_GPU();
  int shapes = 0;
  for (const Case& c : kCases) {
    if (c.dtype != DispatchDtype::kBF16ToFP8) continue;
    for (const Backend b : {Backend::kLowLatency, Backend::kAllgatherReduceScatter}) {
      if (b != Backend::kLowLatency && c.layout == OutputLayout::kExpertMajor) continue;
      auto o = options_for(c);
      o.backend = b;
      o.cfg.round_scale = true;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << c.name << " " << to_string(b) << describe(rep);
    }
    ++shapes;
  }
  EXPECT_GE(shapes, 5);
}

// `base` (one call) as one launch, graph replays mixed with eager calls, the halves and two
// rounds in flight: each against the reference.
void check_launch_variants(testing::CheckOptions base) {
  base.iters = 1;
  auto one = base;
  one.one_launch = true;
  one.iters = 2;
  auto graph = base;
  graph.graph_replays = 20;
  graph.mixed = true;
  auto halves = base;
  halves.halves = true;
  halves.iters = 2;
  auto rounds = base;
  rounds.cfg.rounds_in_flight = 2;
  rounds.graph_replays = 10;
  rounds.iters = 2;
  for (const auto& [what, o] : {std::pair{"one launch", one}, std::pair{"graph, mixed", graph},
                                std::pair{"halves", halves}, std::pair{"two rounds", rounds}}) {
    const auto rep = testing::run_check(o);
    EXPECT_TRUE(rep.ok) << what << describe(rep);
    EXPECT_GT(rep.calls, 0) << what;
  }
}

TEST(PushCombine, OneLaunchGraphMixedHalvesAndTwoRounds) {
  REQUIRE_GPU();
  auto base = options_for(kCases[13]);  // w8_r1_mixed_tokens_q
  base.cfg.combine = CombineMode::kPush;
  check_launch_variants(base);
}

// make_all2all_group(backend, cfg, a world of 2) throws a ConfigError naming each of `words`.
void expect_refused(Backend backend, const EpConfig& cfg,
                    std::initializer_list<const char*> words) {
  InProcessWorld world(2);
  try {
    (void)make_all2all_group(backend, cfg, world);
    ADD_FAILURE() << "expected a ConfigError from " << to_string(backend);
  } catch (const ConfigError& e) {
    for (const char* w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

// Push is refused by name where it cannot work: naive's combine is an all-reduce over every
// rank's rows, and a masked sender's reserved rows may carry no metadata.
TEST(PushCombine, RefusedWithNaiveAndWithMasking) {
  REQUIRE_GPU();
  EpConfig c = gpu_test::small_config();
  c.world_size = 2;
  c.combine = CombineMode::kPush;
  EpConfig masked = c;
  masked.mask_failed_ranks = true;
  expect_refused(Backend::kNaive, c, {"combine = push", "backend naive"});
  expect_refused(Backend::kLowLatency, masked, {"combine = push", "mask_failed_ranks = true"});
}

// LogFMT combine (EpConfig::combine_format = logfmt): each partial crosses encoded and the
// token's rank adds the decoded values in rank order. The reference models the same codec
// (src/core/logfmt.hpp), so the bits must match: token- and expert-major shapes (expert-major
// rows are folded in f32 and rounded to bf16 before they are encoded), pull and push, then one
// launch, graph replays mixed with eager calls, the halves and two rounds in flight.
TEST(LogFMT, MatchesReferencePullAndPush) {
  REQUIRE_GPU();
  int runs = 0;
  for (int index = 0; index < int(std::size(kCases)); ++index) {
    const Case& c = kCases[index];
    if (c.hidden % 128 != 0) continue;  // (LogFMT blocks are 128 values)
    if (*std::max_element(c.tokens.begin(), c.tokens.end()) > 128) continue;  // (decode sizes)
    for (const CombineMode mode : {CombineMode::kPull, CombineMode::kPush}) {
      auto o = options_for(c);
      o.cfg.combine_format = CombineFormat::kLogFMT;
      o.cfg.combine = mode;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << c.name << " " << to_string(mode) << describe(rep);
      ++runs;
    }
  }
  EXPECT_GE(runs, 12);
  auto base = options_for(kCases[13]);  // w8_r1_mixed_tokens_q
  base.cfg.combine_format = CombineFormat::kLogFMT;
  check_launch_variants(base);
}

// LogFMT is low_latency's: the other backends refuse it by name.
TEST(LogFMT, RefusedByTheOtherBackends) {
  REQUIRE_GPU();
  EpConfig c = gpu_test::small_config();
  c.world_size = 2;
  c.combine_format = CombineFormat::kLogFMT;
  for (const Backend b :
       {Backend::kNaive, Backend::kAllgatherReduceScatter, Backend::kHighThroughput})
    expect_refused(b, c, {"combine_format = logfmt"});
}

// The highest-slot combine order is high_throughput's; the others refuse it by name.
TEST(CombineOrder, HighestSlotRefusedByTheOtherBackends) {
  REQUIRE_GPU();
  EpConfig c = gpu_test::small_config();
  c.world_size = 2;
  c.combine_order = CombineOrder::kHighestSlot;
  for (const Backend b : {Backend::kNaive, Backend::kAllgatherReduceScatter, Backend::kLowLatency})
    expect_refused(b, c, {"combine_order = highest_slot", "high_throughput's"});
}

// The baselines on every token-major case: same contract (every token delivered), same bits.
class BaselineCase : public ::testing::TestWithParam<std::tuple<Backend, int>> {};

TEST_P(BaselineCase, MatchesReference) {
  REQUIRE_GPU();
  const auto [backend, index] = GetParam();
  auto o = options_for(kCases[index]);
  o.backend = backend;
  const auto rep = testing::run_check(o);
  EXPECT_TRUE(rep.ok) << describe(rep);
  EXPECT_EQ(rep.calls, kCases[index].iters);
}

INSTANTIATE_TEST_SUITE_P(Baselines, BaselineCase,
                         ::testing::Combine(::testing::Values(Backend::kNaive,
                                                              Backend::kAllgatherReduceScatter),
                                            ::testing::Values(0, 2, 4, 6, 7, 9, 10, 11, 13, 16)),
                         [](const ::testing::TestParamInfo<std::tuple<Backend, int>>& i) {
                           return std::string(to_string(std::get<0>(i.param))) + "_" +
                                  kCases[std::get<1>(i.param)].name;
                         });

TEST(Baselines, GraphReplaysAndMixed) {
  REQUIRE_GPU();
  for (Backend b : {Backend::kNaive, Backend::kAllgatherReduceScatter}) {
    for (bool mixed : {false, true}) {
      auto o = options_for(kCases[10]);
      o.backend = b;
      o.iters = 1;
      o.graph_replays = 100;
      o.mixed = mixed;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << to_string(b) << (mixed ? " mixed" : "") << describe(rep);
      EXPECT_EQ(rep.calls, 101);
    }
  }
}

// The comparison itself can fail: one flipped bit in one rank's output is caught.
TEST(LowLatency, CorruptedOutputIsDetected) {
  REQUIRE_GPU();
  auto o = options_for(kCases[10]);
  o.iters = 1;
  o.corrupt_rank = 3;
  const auto rep = testing::run_check(o);
  ASSERT_FALSE(rep.ok);
  ASSERT_FALSE(rep.mismatches.empty());
  EXPECT_NE(rep.mismatches[0].find("rank 3 combine y"), std::string::npos) << rep.mismatches[0];
}

TEST(LowLatency, ThousandGraphReplays) {
  REQUIRE_GPU();
  auto o = options_for(kCases[10]);
  o.iters = 1;
  o.graph_replays = 1000;
  o.pool = 3;
  const auto rep = testing::run_check(o);
  EXPECT_TRUE(rep.ok) << describe(rep);
  EXPECT_EQ(rep.calls, 1001);
}

TEST(LowLatency, MixedEagerAndGraph) {
  REQUIRE_GPU();
  for (const Case& c : {kCases[10], kCases[12]}) {
    auto o = options_for(c);
    o.iters = 1;
    o.graph_replays = 50;
    o.mixed = true;
    const auto rep = testing::run_check(o);
    EXPECT_TRUE(rep.ok) << c.name << describe(rep);
    EXPECT_EQ(rep.calls, 51);
  }
}

// The expert inside a conditional SWITCH node (as MoeLayer's captured expert stage), every rank
// capturing and replaying from its own host thread, three executable graphs per rank replayed in
// turn (as serve-bench's buckets): token-major with a rank without tokens, and expert-major; as
// one graph per call and split in three (dispatch, expert, combine; MoeLayer::set_capture_split).
TEST(LowLatency, ConditionalExpertGraphFromRankThreads) {
  REQUIRE_GPU();
  for (const Case& c : {kCases[16], kCases[12]}) {
    for (bool mixed : {false, true}) {
      for (bool split : {false, true}) {
        auto o = options_for(c);
        o.iters = 1;
        o.graph_replays = 50;
        o.mixed = mixed;
        o.conditional = true;
        o.rank_threads = true;
        o.graph_execs = 3;
        o.graph_split = split;
        const auto rep = testing::run_check(o);
        EXPECT_TRUE(rep.ok) << c.name << (mixed ? " mixed" : "") << (split ? " split" : "")
                            << describe(rep);
        EXPECT_EQ(rep.calls, 51);
      }
    }
  }
}

// ---- error paths ---------------------------------------------------------------------------

using gpu_test::Group;
using gpu_test::small_config;

class InvalidIds : public ::testing::TestWithParam<Backend> {};

TEST_P(InvalidIds, AreReportedAndTheTokenIsNotSent) {
  REQUIRE_GPU();
  const Backend backend = GetParam();
  EpConfig cfg = small_config();
  Group g(cfg, 2, backend);
  const int N = 4, K = 4, H = 2048;
  std::vector<uint16_t> x(size_t(N) * H, 0x3f80);  // 1.0
  std::vector<float> w(N * K, 0.25f);
  std::vector<int32_t> good = {0, 5, 9, 13, 1, 2, 3, 4, -1, -1, 8, -1, 15, 14, 13, 12};
  std::vector<int32_t> bad = good;
  bad[2 * K + 1] = 16;  // token 2, slot 1: outside [-1, 16)
  std::vector<uint16_t*> ys;
  std::vector<DispatchResult> res(2);
  for (int r = 0; r < 2; ++r) {
    DispatchInput in;
    in.num_tokens = N;
    in.x = g.upload(x);
    in.topk_ids = g.upload(r == 1 ? bad : good);
    in.topk_weights = g.upload(w);
    res[r] = g.a2a[r]->dispatch(in, g.streams[r]);
    ys.push_back(g.upload(std::vector<uint16_t>(size_t(N) * H, 0x7fff)));
  }
  for (int r = 0; r < 2; ++r) g.a2a[r]->combine(g.a2a[r]->combine_buffer(), ys[r], g.streams[r]);
  // Rank 0 is fine (the round completed everywhere: no hang); rank 1 reports the bad id.
  EXPECT_NO_THROW(g.a2a[0]->synchronize(g.streams[0]));
  try {
    g.a2a[1]->synchronize(g.streams[1]);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("topk_ids[2][1] = 16"), std::string::npos) << m;
    EXPECT_NE(m.find("[0, 16)"), std::string::npos) << m;
  }
  // Token 2 of rank 1 went nowhere. low_latency: rank 1 (experts 8..15) receives rank 0's
  // tokens 0, 2, 3 and rank 1's tokens 0, 3; rank 0 receives tokens 0, 1 of both ranks. The
  // baselines deliver every valid token everywhere: 4 + 3 rows on each rank.
  const bool every = backend != Backend::kLowLatency;
  int32_t m0 = 0, m1 = 0;
  EPX_CUDA_CHECK(cudaMemcpy(&m0, res[0].recv_count, 4, cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(cudaMemcpy(&m1, res[1].recv_count, 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(m0, every ? 7 : 4);
  ASSERT_EQ(m1, every ? 7 : 5);
  std::vector<int32_t> src_rank(m1), src_idx(m1);
  EPX_CUDA_CHECK(cudaMemcpy(src_rank.data(), res[1].recv_src_rank, 4 * m1, cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(cudaMemcpy(src_idx.data(), res[1].recv_src_idx, 4 * m1, cudaMemcpyDeviceToHost));
  // Rows in any order (EpConfig::deterministic is off; the naive backend orders them anyway).
  std::vector<std::pair<int32_t, int32_t>> rows;
  for (int j = 0; j < m1; ++j) rows.emplace_back(src_rank[j], src_idx[j]);
  std::sort(rows.begin(), rows.end());
  using Rows = std::vector<std::pair<int32_t, int32_t>>;
  EXPECT_EQ(rows, every ? (Rows{{0, 0}, {0, 1}, {0, 2}, {0, 3}, {1, 0}, {1, 1}, {1, 3}})
                        : (Rows{{0, 0}, {0, 2}, {0, 3}, {1, 0}, {1, 3}}));
  // The invalid token's output row is written, as zeros.
  std::vector<uint16_t> y(size_t(N) * H);
  EPX_CUDA_CHECK(cudaMemcpy(y.data(), ys[1], y.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(y[2 * H], 0);
  EXPECT_EQ(y[3 * H - 1], 0);
  // The object refuses further calls.
  DispatchInput empty;
  EXPECT_THROW(g.a2a[1]->dispatch(empty, g.streams[1]), StateError);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, InvalidIds,
                         ::testing::Values(Backend::kLowLatency, Backend::kNaive,
                                           Backend::kAllgatherReduceScatter),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return std::string(to_string(i.param));
                         });

// NaN and infinity are data (epx/all2all.hpp): every backend sends them as the reference does,
// bf16 as bytes and bf16 quantised to fp8 by the reference's block rule (a NaN is not the amax; a
// block with +-Inf gets the scale +Inf), and combine sums them with IEEE rules.
class NonFinite : public ::testing::TestWithParam<Backend> {};

TEST_P(NonFinite, TravelAsTheContractSays) {
  REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  for (const DispatchDtype dtype : {DispatchDtype::kBF16, DispatchDtype::kBF16ToFP8}) {
    SCOPED_TRACE(to_string(dtype));
    EpConfig cfg = small_config();
    cfg.dtype = dtype;
    cfg.timeout_ms = 10000;
    // high_throughput sized per call would wait on the host for the other rank's counts.
    cfg.worst_case_output = GetParam() == Backend::kHighThroughput;
    Group g(cfg, 2, GetParam());
    const int N = 2, K = 4, H = cfg.hidden, groups = H / kFp8BlockSize;
    // Row 0: a NaN in block 0 (whose amax is 2), +Inf in block 1, -Inf in block 2; row 1 finite.
    std::vector<uint16_t> x(size_t(N) * H, ref::bf16_from_float(0.5f));
    x[3] = ref::bf16_from_float(std::numeric_limits<float>::quiet_NaN());
    x[7] = ref::bf16_from_float(-2.0f);
    x[127] = x[3];  // last in its block
    x[130] = ref::bf16_from_float(inf);
    x[300] = ref::bf16_from_float(-inf);
    for (int h = 0; h < H; ++h) x[size_t(H) + h] = ref::bf16_from_float(1.0f + float(h % 7));
    std::vector<uint8_t> q(x.size());
    std::vector<float> qs(size_t(N) * groups);
    ref::quantize_fp8(x.data(), N, H, q.data(), qs.data());
    ASSERT_EQ(qs[1], inf);  // the rule under test, as the reference has it
    ASSERT_EQ(q[3], 0x7F);
    // Every token to experts 0 (rank 0) and 8 (rank 1): every backend delivers 4 rows per rank.
    const std::vector<int32_t> ids = {0, 8, -1, -1, 0, 8, -1, -1};
    const std::vector<float> w(size_t(N) * K, 0.5f);
    std::vector<DispatchResult> res(2);
    for (int r = 0; r < 2; ++r) {
      DispatchInput in;
      in.num_tokens = N;
      in.x = g.upload(x);
      in.topk_ids = g.upload(ids);
      in.topk_weights = g.upload(w);
      res[r] = g.a2a[r]->dispatch(in, g.streams[r]);
    }
    for (int r = 0; r < 2; ++r) g.a2a[r]->synchronize(g.streams[r]);
    const bool fp8 = dtype == DispatchDtype::kBF16ToFP8;
    const size_t row_bytes = size_t(H) * (fp8 ? 1 : 2);
    std::vector<std::vector<uint16_t>> partials(2);
    for (int r = 0; r < 2; ++r) {
      int32_t m = 0;
      EPX_CUDA_CHECK(cudaMemcpy(&m, res[r].recv_count, 4, cudaMemcpyDeviceToHost));
      ASSERT_EQ(m, 4) << "rank " << r;
      std::vector<uint8_t> rx(size_t(m) * row_bytes);
      std::vector<float> rs(size_t(m) * groups);
      std::vector<int32_t> src_idx(m);
      EPX_CUDA_CHECK(cudaMemcpy(rx.data(), res[r].recv_x, rx.size(), cudaMemcpyDeviceToHost));
      EPX_CUDA_CHECK(
          cudaMemcpy(src_idx.data(), res[r].recv_src_idx, 4 * size_t(m), cudaMemcpyDeviceToHost));
      if (fp8) {
        EPX_CUDA_CHECK(
            cudaMemcpy(rs.data(), res[r].recv_scales, rs.size() * 4, cudaMemcpyDeviceToHost));
      }
      for (int j = 0; j < m; ++j) {
        const int n = src_idx[size_t(j)];
        ASSERT_TRUE(n == 0 || n == 1) << n;
        const uint8_t* want = fp8 ? q.data() + size_t(n) * H
                                  : reinterpret_cast<const uint8_t*>(x.data() + size_t(n) * H);
        EXPECT_EQ(std::memcmp(rx.data() + size_t(j) * row_bytes, want, row_bytes), 0)
            << "rank " << r << " row " << j << " (token " << n << ")";
        if (fp8) {
          EXPECT_EQ(std::memcmp(rs.data() + size_t(j) * groups, qs.data() + size_t(n) * groups,
                                size_t(groups) * 4),
                    0)
              << "rank " << r << " scales of row " << j;
        }
      }
      // Each received row's partial is its token's x: y = 2x, NaN and Inf included.
      partials[size_t(r)].resize(size_t(m) * H);
      for (int j = 0; j < m; ++j)
        std::copy_n(x.begin() + ptrdiff_t(src_idx[size_t(j)]) * H, H,
                    partials[size_t(r)].begin() + ptrdiff_t(j) * H);
      EPX_CUDA_CHECK(cudaMemcpy(res[r].combine_buffer, partials[size_t(r)].data(),
                                partials[size_t(r)].size() * 2, cudaMemcpyHostToDevice));
    }
    std::vector<uint16_t*> ys;
    for (int r = 0; r < 2; ++r) {
      ys.push_back(g.upload(std::vector<uint16_t>(size_t(N) * H, 0x1234)));
      g.a2a[r]->combine(res[r].combine_buffer, ys.back(), g.streams[r]);
    }
    for (int r = 0; r < 2; ++r) {
      g.a2a[r]->synchronize(g.streams[r]);
      std::vector<uint16_t> y(size_t(N) * H);
      EPX_CUDA_CHECK(cudaMemcpy(y.data(), ys[size_t(r)], y.size() * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < y.size(); ++i) {
        const uint16_t want = ref::bf16_from_float(2.0f * ref::bf16_to_float(x[i]));
        if (y[i] != want) {
          ADD_FAILURE() << "rank " << r << " y[" << i / H << "][" << i % H << "] = 0x" << std::hex
                        << y[i] << ", expected 0x" << want;
          break;
        }
      }
      EXPECT_EQ(y[127], 0x7FFF);  // NaN
      EXPECT_EQ(y[130], 0x7F80);  // +Inf
      EXPECT_EQ(y[300], 0xFF80);  // -Inf
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, NonFinite,
                         ::testing::Values(Backend::kLowLatency, Backend::kHighThroughput,
                                           Backend::kNaive, Backend::kAllgatherReduceScatter),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return std::string(to_string(i.param));
                         });

TEST(LowLatency, RepeatedExpertInTokenIsReported) {
  REQUIRE_GPU();
  Group g(small_config(), 1);
  const int N = 2, K = 4, H = 2048;
  std::vector<uint16_t> x(size_t(N) * H, 0x3f80);
  std::vector<float> w(N * K, 0.25f);
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 4, -1};
  DispatchInput in;
  in.num_tokens = N;
  in.x = g.upload(x);
  in.topk_ids = g.upload(ids);
  in.topk_weights = g.upload(w);
  g.a2a[0]->dispatch(in, g.streams[0]);
  try {
    g.a2a[0]->synchronize(g.streams[0]);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("topk_ids[1][2] = 4 repeats the expert of slot 0"),
              std::string::npos)
        << e.what();
  }
}

// A rank without tokens may pass any y to combine (a chunked forward's empty chunk passes null or
// one past the end of its buffer); with tokens, y is still checked.
TEST(LowLatency, CombineOfNoTokensTakesAnyY) {
  REQUIRE_GPU();
  Group g(small_config(), 1);
  DispatchInput empty;
  g.a2a[0]->dispatch(empty, g.streams[0]);
  EXPECT_NO_THROW(g.a2a[0]->combine(g.a2a[0]->combine_buffer(), nullptr, g.streams[0]));
  EXPECT_NO_THROW(g.a2a[0]->synchronize(g.streams[0]));
  const int N = 2, K = 4, H = 2048;
  std::vector<uint16_t> x(size_t(N) * H, 0x3f80);
  std::vector<float> w(N * K, 0.25f);
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
  DispatchInput in;
  in.num_tokens = N;
  in.x = g.upload(x);
  in.topk_ids = g.upload(ids);
  in.topk_weights = g.upload(w);
  g.a2a[0]->dispatch(in, g.streams[0]);
  try {
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), nullptr, g.streams[0]);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("y = nullptr"), std::string::npos) << e.what();
  }
  g.a2a[0]->synchronize(g.streams[0]);
}

TEST(LowLatency, MissingRankTimesOutNamingIt) {
  REQUIRE_GPU();
  Group g(small_config(), 4);
  const int N = 3, K = 4, H = 2048;
  std::vector<uint16_t> x(size_t(N) * H, 0x3f80);
  std::vector<float> w(N * K, 0.25f);
  std::vector<int32_t> ids = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14};
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 1; r < 4; ++r) {  // rank 0 never calls dispatch
    DispatchInput in;
    in.num_tokens = N;
    in.x = g.upload(x);
    in.topk_ids = g.upload(ids);
    in.topk_weights = g.upload(w);
    g.a2a[r]->dispatch(in, g.streams[r]);
  }
  for (int r = 1; r < 4; ++r) {
    try {
      g.a2a[r]->synchronize(g.streams[r]);
      FAIL() << "rank " << r << ": expected TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("for rank 0"), std::string::npos) << m;
      EXPECT_NE(m.find("rank " + std::to_string(r)), std::string::npos) << m;
      EXPECT_NE(m.find("(call 1)"), std::string::npos) << m;  // the first dispatch
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 0.3 + 2.0);  // within the timeout, plus slack for launch and teardown
  // The process goes on and the objects refuse further calls.
  DispatchInput empty;
  EXPECT_THROW(g.a2a[1]->dispatch(empty, g.streams[1]), StateError);
}

TEST(LowLatency, HostSideInputErrors) {
  REQUIRE_GPU();
  Group g(small_config(), 1);
  DispatchInput in;
  in.num_tokens = 9;  // max is 8
  try {
    g.a2a[0]->dispatch(in, g.streams[0]);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("num_tokens = 9"), std::string::npos) << e.what();
  }
  in.num_tokens = 2;  // null pointers
  EXPECT_THROW(g.a2a[0]->dispatch(in, g.streams[0]), InputError);
  // Host memory instead of device memory: refused before any kernel could fault on it.
  std::vector<uint16_t> host_x(2 * 2048);
  in.x = host_x.data();
  in.topk_ids = g.upload(std::vector<int32_t>(8, 0));
  in.topk_weights = g.upload(std::vector<float>(8, 0.25f));
  try {
    g.a2a[0]->dispatch(in, g.streams[0]);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("expected device memory on GPU"), std::string::npos)
        << e.what();
  }
}

// One launch per GPU (dispatch_group / combine_group): every backend, eager and replayed, equal
// to the reference; with deterministic rows the order itself is compared.
TEST(OneLaunch, MatchesReferenceEveryBackendEagerAndGraph) {
  REQUIRE_GPU();
  for (int index : {2, 5, 10, 12, 13, 16}) {
    for (Backend b : {Backend::kLowLatency, Backend::kAllgatherReduceScatter, Backend::kNaive}) {
      const Case& c = kCases[index];
      if (b != Backend::kLowLatency && c.layout == L::kExpertMajor) continue;
      auto o = options_for(c);
      o.backend = b;
      o.one_launch = true;
      o.iters = 2;
      o.graph_replays = 20;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << c.name << " " << to_string(b) << describe(rep);
      EXPECT_EQ(rep.calls, 22) << c.name << " " << to_string(b);
    }
  }
}

TEST(Deterministic, RowsInSourceOrderPerRankAndOneLaunch) {
  REQUIRE_GPU();
  for (int index : {4, 10, 12, 13, 17}) {
    for (bool one_launch : {false, true}) {
      auto o = options_for(kCases[index]);
      o.cfg.deterministic = true;
      o.one_launch = one_launch;
      o.graph_replays = 10;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << kCases[index].name << describe(rep);
      EXPECT_EQ(rep.calls, kCases[index].iters + 10);
    }
  }
}

// Ranks of different groups, a rank given twice, or mismatched argument counts: InputError
// before anything is launched; the group stays usable.
TEST(OneLaunch, BadRankSetsAreInputErrors) {
  REQUIRE_GPU();
  Group g(small_config(), 2), h(small_config(), 2);
  std::vector<DispatchInput> two(2);
  auto expect_input_error = [](auto&& call, const char* words) {
    try {
      call();
      FAIL() << "expected InputError";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  std::vector<All2All*> mixed{g.a2a[0].get(), h.a2a[1].get()};
  expect_input_error([&] { dispatch_group(mixed, two, g.streams[0]); }, "another group");
  std::vector<All2All*> twice{g.a2a[0].get(), g.a2a[0].get()};
  expect_input_error([&] { dispatch_group(twice, two, g.streams[0]); }, "given twice");
  std::vector<All2All*> both{g.a2a[0].get(), g.a2a[1].get()};
  std::vector<DispatchInput> one(1);
  expect_input_error([&] { dispatch_group(both, one, g.streams[0]); }, "one per rank");
  // Still usable: an empty round for both ranks in one launch.
  const auto res = dispatch_group(both, two, g.streams[0]);
  ASSERT_EQ(res.size(), 2u);
  std::vector<const void*> outs{g.a2a[0]->combine_buffer(), g.a2a[1]->combine_buffer()};
  std::vector<void*> ys{nullptr, nullptr};
  combine_group(both, outs, ys, g.streams[0]);
  EXPECT_NO_THROW(g.a2a[0]->synchronize(g.streams[0]));
  EXPECT_NO_THROW(g.a2a[1]->synchronize(g.streams[0]));
}

// Each op as its halves, every rank's send half then every rank's receive half on one stream:
// equal to the reference (a send half never waits, or this would time out), eager and replayed.
TEST(Halves, EqualTheWholeOpsOnOneStreamEagerAndGraph) {
  REQUIRE_GPU();
  for (int index : {2, 5, 10, 12, 13, 16}) {
    for (Backend b : {Backend::kLowLatency, Backend::kAllgatherReduceScatter}) {
      const Case& c = kCases[index];
      if (b != Backend::kLowLatency && c.layout == L::kExpertMajor) continue;
      auto o = options_for(c);
      o.backend = b;
      o.halves = true;
      o.iters = 2;
      o.graph_replays = 20;
      const auto rep = testing::run_check(o);
      EXPECT_TRUE(rep.ok) << c.name << " " << to_string(b) << describe(rep);
      EXPECT_EQ(rep.calls, 22) << c.name << " " << to_string(b);
    }
  }
}

// A receive half needs its send half; a send half needs its receive half before the next op.
TEST(Halves, CallOrderIsAStateError) {
  REQUIRE_GPU();
  Group g(small_config(), 1);
  All2All& a = *g.a2a[0];
  cudaStream_t s = g.streams[0];
  EXPECT_THROW(a.dispatch_recv(s), StateError);
  EXPECT_THROW(a.combine_recv(nullptr, s), StateError);
  DispatchInput none;
  a.dispatch_send(none, s);
  EXPECT_THROW(a.dispatch(none, s), StateError);
  EXPECT_THROW(a.dispatch_send(none, s), StateError);
  EXPECT_THROW(a.combine(a.combine_buffer(), nullptr, s), StateError);
  (void)a.dispatch_recv(s);
  a.combine_send(a.combine_buffer(), s);
  a.combine_recv(nullptr, s);
  EXPECT_NO_THROW(a.synchronize(s));
  // The whole ops still work after halves.
  (void)a.dispatch(none, s);
  a.combine(a.combine_buffer(), nullptr, s);
  EXPECT_NO_THROW(a.synchronize(s));
}

// Two rounds in flight: every call dispatches two rounds before combining either (dispatch A,
// dispatch B, expert A, combine A, expert B, combine B), each round checked against the
// reference; per-rank streams eager, replayed and mixed (rank 0 eager), one launch per GPU, and
// the halves on one stream.
TEST(RoundsInFlight, TwoInterleavedRoundsMatchTheReference) {
  REQUIRE_GPU();
  struct Mode {
    const char* name;
    bool mixed, one_launch, halves;
  };
  const Mode kModes[] = {{"per-rank", false, false, false},
                         {"mixed", true, false, false},
                         {"one launch", false, true, false},
                         {"halves", false, false, true}};
  for (int index : {2, 5, 10, 12, 13}) {
    for (Backend b : {Backend::kLowLatency, Backend::kAllgatherReduceScatter, Backend::kNaive}) {
      const Case& c = kCases[index];
      if (b != Backend::kLowLatency && c.layout == L::kExpertMajor) continue;
      for (const Mode& m : kModes) {
        if (m.halves && b == Backend::kNaive) continue;  // ordered rows: no halves on one stream
        auto o = options_for(c);
        o.backend = b;
        o.cfg.rounds_in_flight = 2;
        o.mixed = m.mixed;
        o.one_launch = m.one_launch;
        o.halves = m.halves;
        o.iters = 2;
        o.graph_replays = 10;
        const auto rep = testing::run_check(o);
        EXPECT_TRUE(rep.ok) << c.name << " " << to_string(b) << " " << m.name << describe(rep);
        EXPECT_EQ(rep.calls, 12) << c.name << " " << to_string(b) << " " << m.name;
      }
    }
  }
}

// A dispatch with every slot due abandons the oldest round; combine serves the oldest due one.
// Two ranks, one token each routed to both ranks, the expert stage copies the served round's
// received rows into its combine buffer, so y = 2 x of that round (x = 1, 2, 3 for the first,
// second and third dispatch).
TEST(RoundsInFlight, DispatchAfterDispatchAbandonsTheOldestRound) {
  REQUIRE_GPU();
  const int K = 4, H = 2048;
  // Runs `dispatches` rounds, then one combine per entry of `served` (the dispatch it must serve).
  auto run = [&](int rounds, int dispatches, const std::vector<int>& served) {
    SCOPED_TRACE(::testing::Message()
                 << "rounds_in_flight " << rounds << ", " << dispatches << " dispatches");
    EpConfig cfg = gpu_test::small_config();
    cfg.rounds_in_flight = rounds;
    Group g(cfg, 2);
    const std::vector<int32_t> ids = {0, 1, 8, 9};  // experts of both ranks (8 per rank)
    const std::vector<float> w(K, 0.25f);
    const uint16_t kBf16[] = {0x3f80, 0x4000, 0x4040};  // 1, 2, 3
    std::vector<std::vector<DispatchResult>> res(size_t(dispatches),
                                                 std::vector<DispatchResult>(2));
    for (int d = 0; d < dispatches; ++d) {
      const DispatchInput in{.num_tokens = 1,
                             .x = g.upload(std::vector<uint16_t>(H, kBf16[d])),
                             .topk_ids = g.upload(ids),
                             .topk_weights = g.upload(w)};
      for (int r = 0; r < 2; ++r) res[d][r] = g.a2a[r]->dispatch(in, g.streams[r]);
    }
    for (int d : served) {
      std::vector<uint16_t*> ys;
      for (int r = 0; r < 2; ++r) {
        All2All& a = *g.a2a[r];
        EXPECT_EQ(a.combine_buffer(), res[d][r].combine_buffer)
            << "rank " << r << ", dispatch " << d;
        EPX_CUDA_CHECK(cudaMemcpyAsync(res[d][r].combine_buffer, res[d][r].recv_x,
                                       size_t(res[d][r].capacity) * H * 2, cudaMemcpyDeviceToDevice,
                                       g.streams[r]));
        ys.push_back(g.upload(std::vector<uint16_t>(H, 0xffff)));
        a.combine(res[d][r].combine_buffer, ys.back(), g.streams[r]);
      }
      for (int r = 0; r < 2; ++r) g.a2a[r]->synchronize(g.streams[r]);
      for (int r = 0; r < 2; ++r) {
        std::vector<uint16_t> y(H);
        EPX_CUDA_CHECK(cudaMemcpy(y.data(), ys[r], H * 2, cudaMemcpyDeviceToHost));
        const uint16_t want = kBf16[d] + 0x80;  // 2 x: one more exponent step
        EXPECT_EQ(std::count(y.begin(), y.end(), want), H)
            << "rank " << r << ": combine of dispatch " << d << " gave y[0] = 0x" << std::hex
            << y[0] << ", expected 0x" << want;
      }
    }
  };
  run(1, 2, {1});     // the first round abandoned
  run(2, 2, {0, 1});  // two rounds due, combined oldest first
  run(2, 3, {1, 2});  // the third dispatch abandons the first
}

// Masking (EpConfig::mask_failed_ranks): rank 3 of 4 never calls. The others' first round masks
// it when their waits expire and completes without it; the second skips it from the start and
// counts the dropped (token, expert) pairs. Each token goes to one expert on every rank and the
// expert stage copies the received rows, so y = (live ranks) x = 3 x.
TEST(Masking, ARankThatNeverCallsIsMaskedAndTheOthersGoOn) {
  REQUIRE_GPU();
  for (Backend backend : {Backend::kLowLatency, Backend::kAllgatherReduceScatter}) {
    SCOPED_TRACE(to_string(backend));
    EpConfig cfg = gpu_test::small_config();
    cfg.mask_failed_ranks = true;
    Group g(cfg, 4, backend);
    const int N = 3, K = 4, H = 2048;
    std::vector<int32_t> ids;
    for (int n = 0; n < N; ++n)
      for (int e : {0, 4, 8, 12}) ids.push_back(e);  // one expert per rank
    const DispatchInput in{.num_tokens = N,
                           .x = g.upload(std::vector<uint16_t>(size_t(N) * H, 0x3f80)),  // 1
                           .topk_ids = g.upload(ids),
                           .topk_weights = g.upload(std::vector<float>(size_t(N) * K, 0.25f))};
    for (int round = 0; round < 2; ++round) {
      std::vector<uint16_t*> ys;
      for (int r = 0; r < 3; ++r) {
        All2All& a = *g.a2a[r];
        const DispatchResult d = a.dispatch(in, g.streams[r]);
        EPX_CUDA_CHECK(cudaMemcpyAsync(d.combine_buffer, d.recv_x, size_t(d.capacity) * H * 2,
                                       cudaMemcpyDeviceToDevice, g.streams[r]));
        ys.push_back(g.upload(std::vector<uint16_t>(size_t(N) * H, 0xffff)));
        a.combine(d.combine_buffer, ys.back(), g.streams[r]);
      }
      for (int r = 0; r < 3; ++r) {
        ASSERT_NO_THROW(g.a2a[r]->synchronize(g.streams[r])) << "round " << round;
        EXPECT_EQ(g.a2a[r]->masked_ranks(), uint64_t(1) << 3) << "rank " << r;
        // The first round masked rank 3 while waiting: nothing was dropped at its start.
        EXPECT_EQ(g.a2a[r]->dropped_pairs(), uint64_t(round == 0 ? 0 : N)) << "rank " << r;
        std::vector<uint16_t> y(size_t(N) * H);
        EPX_CUDA_CHECK(cudaMemcpy(y.data(), ys[r], y.size() * 2, cudaMemcpyDeviceToHost));
        EXPECT_EQ(std::count(y.begin(), y.end(), uint16_t(0x4040)), N * H)  // 3
            << "rank " << r << " round " << round << ": y[0] = 0x" << std::hex << y[0];
      }
    }
    for (int r = 0; r < 3; ++r) {
      g.a2a[r]->clear_mask(g.streams[r]);
      EXPECT_EQ(g.a2a[r]->masked_ranks(), 0u);
      EXPECT_EQ(g.a2a[r]->dropped_pairs(), 0u);
    }
    EXPECT_EQ(g.a2a[3]->masked_ranks(), 0u);
  }
}

TEST(LowLatency, TooManyBlocksForTheSmBudgetIsAConfigError) {
  REQUIRE_GPU();
  EpConfig c = small_config();
  InProcessWorld world(8);
  LaunchConfigs lc;
  lc.dispatch.num_blocks = world.sm_budget(0) + 1;
  try {
    make_all2all_group(Backend::kLowLatency, c, world, lc);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dispatch.num_blocks"), std::string::npos) << e.what();
  }
}

// More ranks on one GPU than hardware work queues: a clear error before any rank can wait on a
// peer queued behind it (CUDA itself keeps the value its context was created with).
TEST(InProcessWorld, MoreRanksThanHardwareQueuesIsAConfigError) {
  REQUIRE_GPU();
  const char* was = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string saved = was ? was : "";
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2", 1);
  std::string what;
  try {
    InProcessWorld world(3);
  } catch (const ConfigError& e) {
    what = e.what();
  }
  bool two_fit = true;
  try {
    InProcessWorld world(2);
  } catch (const ConfigError&) {
    two_fit = false;
  }
  if (was) {
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", saved.c_str(), 1);
  } else {
    ::unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  }
  EXPECT_NE(what.find("3 ranks on GPU 0"), std::string::npos) << what;
  EXPECT_NE(what.find("CUDA_DEVICE_MAX_CONNECTIONS = 2"), std::string::npos) << what;
  EXPECT_TRUE(two_fit);
}

TEST(Baselines, ExpertMajorIsAConfigError) {
  REQUIRE_GPU();
  EpConfig c = small_config();
  c.layout = OutputLayout::kExpertMajor;
  InProcessWorld world(2);
  EXPECT_THROW(make_all2all_group(Backend::kNaive, c, world), ConfigError);
}

}  // namespace
}  // namespace epx
