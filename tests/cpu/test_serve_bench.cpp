// `epx serve-bench`'s CPU half (apps/epx/serve_sched.hpp): the chunked-prefill scheduler on a
// hand-checked workload and on random ones (invariants), the percentile definition against
// numpy's default ("linear") values, the latency report, and the decode graph buckets and pieces.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "serve_sched.hpp"

namespace epx::cli::serve {
namespace {

// Runs the workload to the end, step k ending at t = k (1, 2, ...); returns the plans.
std::vector<StepPlan> run_all(Scheduler& s) {
  std::vector<StepPlan> plans;
  while (!s.done()) {
    plans.push_back(s.plan_step());
    s.finish_step(double(plans.size()));
  }
  return plans;
}

TEST(ServeSchedule, HandCheckedChunkedPrefill) {
  // Rank 0 holds requests 0 and 2, rank 1 requests 1 and 3; budget 4 tokens per rank per step.
  //  step 1: r0 = prefill 4 of req 0                      -> 4 tokens, 2 chunks of 2
  //  step 2: r0 = prefill 1 of req 0 (done: token 1) + 3 of req 2
  //  step 3: r0 = decode req 0 (token 2) + prefill 2 of req 2 (done: token 1)  -> 3 tokens
  //  step 4: r0 = decode req 0 (token 3, leaves) + decode req 2 (token 2)       -> 2 tokens
  //  step 5: r0 = decode req 2 (token 3, leaves)                                -> 1 token
  Workload w{.world = 2,
             .num_prompts = 4,
             .isl = 5,
             .osl = 3,
             .concurrency = 4,
             .max_batched_tokens = 4,
             .chunk_size = 2};
  Scheduler s(w);
  const std::vector<StepPlan> plans = run_all(s);
  ASSERT_EQ(plans.size(), 5u);
  const std::vector<int> tokens = {4, 4, 3, 2, 1}, decodes = {0, 0, 1, 2, 1},
                         chunks = {2, 2, 2, 1, 1};
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(plans[i].tokens, std::vector<int>(2, tokens[i]));  // both ranks alike
    EXPECT_EQ(plans[i].decode_tokens, std::vector<int>(2, decodes[i]));
    EXPECT_EQ(plans[i].num_chunks, chunks[i]);
    EXPECT_EQ(plans[i].has_prefill(), i < 3);
  }
  EXPECT_EQ(s.steps(), 5);
  EXPECT_EQ(s.output_tokens(), 12);
  const auto& r = s.requests();
  EXPECT_EQ(r[0].token_times, (std::vector<double>{2, 3, 4}));
  EXPECT_EQ(r[1].token_times, (std::vector<double>{2, 3, 4}));
  EXPECT_EQ(r[2].token_times, (std::vector<double>{3, 4, 5}));
  EXPECT_EQ(r[3].rank, 1);
  EXPECT_THROW(s.plan_step(), StateError);
}

TEST(ServeSchedule, ConcurrencyCapAdmitsInIdOrder) {
  // One request in flight: each starts only after the previous one's last token.
  Workload w{.world = 2,
             .num_prompts = 3,
             .isl = 3,
             .osl = 2,
             .concurrency = 1,
             .max_batched_tokens = 8,
             .chunk_size = 8};
  Scheduler s(w);
  const std::vector<StepPlan> plans = run_all(s);
  // Each request: one prefill step (token 1), one decode step (token 2).
  ASSERT_EQ(plans.size(), 6u);
  const auto& r = s.requests();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r[size_t(i)].rank, i % 2);
    EXPECT_EQ(r[size_t(i)].token_times, (std::vector<double>{2.0 * i + 1, 2.0 * i + 2}));
  }
  EXPECT_EQ(plans[2].tokens, (std::vector<int>{0, 3}));  // request 1 on rank 1, alone
}

TEST(ServeSchedule, DecodesFirstWhenTheBudgetIsShort) {
  // Budget 1 per rank: once request 0 decodes, request 1's prefill waits for it to finish.
  Workload w{.world = 1,
             .num_prompts = 2,
             .isl = 1,
             .osl = 3,
             .concurrency = 2,
             .max_batched_tokens = 1,
             .chunk_size = 1};
  Scheduler s(w);
  run_all(s);
  EXPECT_EQ(s.requests()[0].token_times, (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(s.requests()[1].token_times, (std::vector<double>{4, 5, 6}));
}

TEST(ServeSchedule, InvariantsOnRandomWorkloads) {
  std::mt19937 rng(7);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    Workload w{.world = pick(1, 9),
               .num_prompts = pick(1, 40),
               .isl = pick(1, 300),
               .osl = pick(1, 20),
               .concurrency = pick(1, 50),
               .max_batched_tokens = pick(1, 200),
               .chunk_size = pick(1, 64)};
    SCOPED_TRACE("trial " + std::to_string(trial));
    Scheduler s(w);
    int64_t tokens = 0, decodes = 0;
    while (!s.done()) {
      const StepPlan& p = s.plan_step();
      int need = 1;
      for (int r = 0; r < w.world; ++r) {
        ASSERT_LE(p.tokens[size_t(r)], w.max_batched_tokens);
        ASSERT_LE(p.decode_tokens[size_t(r)], p.tokens[size_t(r)]);
        need = std::max(need, (p.tokens[size_t(r)] + w.chunk_size - 1) / w.chunk_size);
      }
      ASSERT_EQ(p.num_chunks, need);
      tokens += p.total_tokens();
      for (int d : p.decode_tokens) decodes += d;
      s.finish_step(double(s.steps() + 1));
    }
    // Every prompt token once, every output token after the first one decode token.
    EXPECT_EQ(tokens, int64_t(w.num_prompts) * (w.isl + w.osl - 1));
    EXPECT_EQ(decodes, int64_t(w.num_prompts) * (w.osl - 1));
    EXPECT_EQ(s.output_tokens(), s.total_output_tokens());
    for (const RequestRecord& r : s.requests()) {
      ASSERT_EQ(int(r.token_times.size()), w.osl);
      EXPECT_EQ(r.rank, r.id % w.world);
      EXPECT_TRUE(std::is_sorted(r.token_times.begin(), r.token_times.end()));
      EXPECT_EQ(std::adjacent_find(r.token_times.begin(), r.token_times.end()),
                r.token_times.end());  // one token per request per step
    }
    // At most `concurrency` requests between their first and last token at any step; on a rank,
    // first tokens come in id (admission) order.
    for (int k = 1; k <= s.steps(); ++k) {
      int in_flight = 0;
      for (const RequestRecord& r : s.requests())
        in_flight += r.token_times.front() <= k && k <= r.token_times.back();
      ASSERT_LE(in_flight, w.concurrency) << "step " << k;
    }
    for (size_t i = size_t(w.world); i < s.requests().size(); ++i)
      EXPECT_LE(s.requests()[i - size_t(w.world)].token_times.front(),
                s.requests()[i].token_times.front());
  }
}

TEST(ServeSchedule, BadFlagsNameFlagValueAndBound) {
  const Workload ok;
  struct Case {
    Workload w;
    std::string text;
  };
  auto with = [&](auto edit) {
    Workload w = ok;
    edit(w);
    return w;
  };
  const std::vector<Case> cases = {
      {with([](Workload& w) { w.world = 33; }), "--world = 33, expected in [1, 32]"},
      {with([](Workload& w) { w.world = 0; }), "--world = 0"},
      {with([](Workload& w) { w.num_prompts = 0; }), "--num-prompts = 0, expected in [1, "},
      {with([](Workload& w) { w.isl = 0; }), "--isl = 0"},
      {with([](Workload& w) { w.osl = -1; }), "--osl = -1"},
      {with([](Workload& w) { w.concurrency = 0; }), "--concurrency = 0, expected at least 1"},
      {with([](Workload& w) { w.max_batched_tokens = 0; }), "--max-batched-tokens = 0"},
      {with([](Workload& w) { w.chunk_size = 0; }), "--chunk-size = 0, expected in [1, 65536]"},
  };
  EXPECT_NO_THROW(validate(ok));
  for (const Case& c : cases) {
    try {
      validate(c.w);
      ADD_FAILURE() << "no error for " << c.text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(c.text), std::string::npos) << e.what();
    }
    EXPECT_THROW(Scheduler{c.w}, ConfigError);
  }
}

TEST(ServeStats, PercentileIsLinearInterpolationLikeNumpy) {
  // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 75, 100]) = 1, 1.75, 2.5, 3.25, 4
  const std::vector<double> v = {1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 25), 1.75);
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile(v, 75), 3.25);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 4);
  // numpy.percentile([10, 20, 40, 80, 160], [25, 90]) = 20, 128
  EXPECT_DOUBLE_EQ(percentile({10, 20, 40, 80, 160}, 25), 20);
  EXPECT_DOUBLE_EQ(percentile({10, 20, 40, 80, 160}, 90), 128);
  EXPECT_DOUBLE_EQ(percentile({5}, 75), 5);
  EXPECT_THROW(percentile({}, 50), InputError);
  EXPECT_THROW(percentile(v, 101), InputError);
  EXPECT_THROW(percentile(v, -1), InputError);
}

TEST(ServeStats, SummaryAndLatencyReport) {
  const Summary s = summarize_values({4, 1, 3, 2});  // unsorted in
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.p25, 1.75);
  EXPECT_DOUBLE_EQ(s.p50, 2.5);
  EXPECT_DOUBLE_EQ(s.p75, 3.25);
  EXPECT_DOUBLE_EQ(s.max, 4);
  EXPECT_EQ(summarize_values({}).count, 0);

  // Request a: tokens at 1, 2, 4 (gaps 1, 2); b: 3, 6 (gap 3); c: no tokens (not counted).
  std::vector<RequestRecord> r(3);
  r[0].token_times = {1, 2, 4};
  r[1].token_times = {3, 6};
  const LatencyReport rep = latency_report(r);
  EXPECT_EQ(rep.itl_s.count, 3);
  EXPECT_DOUBLE_EQ(rep.itl_s.mean, 2);
  EXPECT_DOUBLE_EQ(rep.itl_s.p50, 2);
  EXPECT_EQ(rep.ttft_s.count, 2);
  EXPECT_DOUBLE_EQ(rep.ttft_s.mean, 2);  // (1 + 3) / 2
  EXPECT_EQ(rep.output_tokens, 5);
  EXPECT_DOUBLE_EQ(rep.end_s, 6);
  EXPECT_DOUBLE_EQ(rep.output_tokens_per_s, 5.0 / 6.0);
}

// The decode batch sizes --cuda-graph captures, and the bucket a decode step replays.
TEST(ServeGraphBuckets, DefaultBucketsAndTheBucketOfAStep) {
  Workload w;  // chunk 128, budget 512
  EXPECT_EQ(largest_decode_bucket(w), 128);
  w.chunk_size = 1024;
  EXPECT_EQ(largest_decode_bucket(w), kMaxGraphBatch);  // graphs stay small
  w.max_batched_tokens = 48;
  EXPECT_EQ(largest_decode_bucket(w), 48);  // one step's budget
  EXPECT_EQ(decode_buckets(48), (std::vector<int>{1, 2, 4, 8, 16, 32, 48}));
  EXPECT_EQ(decode_buckets(64), (std::vector<int>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(decode_buckets(1), (std::vector<int>{1}));

  const std::vector<int> buckets = {1, 4, 16};
  EXPECT_EQ(decode_bucket(buckets, 0), 1);  // counted as one token
  EXPECT_EQ(decode_bucket(buckets, 1), 1);
  EXPECT_EQ(decode_bucket(buckets, 2), 4);
  EXPECT_EQ(decode_bucket(buckets, 16), 16);
  EXPECT_EQ(decode_bucket(buckets, 17), 0);  // runs eagerly
}

// The pieces of a split decode graph step, as serve-bench names them in its table and JSON.
TEST(ServeGraphPieces, NamesFollowTheLayers) {
  const std::vector<std::string> two = {"L1 dispatch", "L1 experts", "L1 combine + L2 dispatch",
                                        "L2 experts", "L2 combine"};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(serve::graph_piece_name(i, 5), two[size_t(i)]) << i;
  EXPECT_EQ(serve::graph_piece_name(2, 3), "L1 combine");
  EXPECT_EQ(serve::graph_piece_name(0, 1), "L1 dispatch");
  EXPECT_THROW(serve::graph_piece_name(0, 4), InputError);
  EXPECT_THROW(serve::graph_piece_name(5, 5), InputError);
  EXPECT_THROW(serve::graph_piece_name(-1, 5), InputError);
}

}  // namespace
}  // namespace epx::cli::serve

