// The high_throughput backend's memory (DESIGN §9: at most 256 MiB per rank at any token count):
// its rings and per-round state are fixed by the launch shape, only an 8-byte destination mask
// per token grows with max_tokens_per_rank; the received rows' areas follow the rows of a call
// (or, with worst_case_output, world x max tokens rows). Also low_latency's memory, pull and
// push combine. Host arithmetic only (no GPU).
#include <gtest/gtest.h>

#include "epx/all2all.hpp"

namespace epx {
namespace {

EpConfig r1(int max_tokens, DispatchDtype dtype) {
  EpConfig c;
  c.world_size = 8;
  c.hidden = 7168;
  c.num_experts = 256;
  c.topk = 8;
  c.max_tokens_per_rank = max_tokens;
  c.dtype = dtype;
  return c;
}

constexpr size_t kMiB = size_t(1) << 20;

TEST(HighThroughputMemory, AtMost256MiBAtAnyTokenCount) {
  for (DispatchDtype d : {DispatchDtype::kBF16ToFP8, DispatchDtype::kFP8, DispatchDtype::kBF16}) {
    const size_t small = buffer_bytes(Backend::kHighThroughput, r1(128, d));
    for (int tokens : {1024, 4096, 16384, kMaxTokensPerRank}) {
      const size_t bytes = buffer_bytes(Backend::kHighThroughput, r1(tokens, d));
      EXPECT_LE(bytes, 256 * kMiB) << tokens << " tokens, " << to_string(d);
      // Only the per-token destination masks grow (8 bytes a token, plus alignment).
      EXPECT_LE(bytes - small, size_t(tokens - 128) * 8 + 256) << tokens;
    }
  }
  // low_latency's receive areas, for comparison, grow with every token.
  EXPECT_GT(buffer_bytes(Backend::kLowLatency, r1(16384, DispatchDtype::kBF16ToFP8)), 1024 * kMiB);
}

TEST(HighThroughputMemory, WorstCaseHoldsEveryRow) {
  EpConfig c = r1(4096, DispatchDtype::kBF16ToFP8);
  const size_t sized = buffer_bytes(Backend::kHighThroughput, c);
  c.worst_case_output = true;
  const size_t worst = buffer_bytes(Backend::kHighThroughput, c);
  // fp8 row + bf16 partial per row of world x max tokens
  EXPECT_GE(worst - sized, size_t(c.capacity()) * size_t(c.hidden) * 3);
}

// low_latency at the R1 shape, token-major (DESIGN §9: at most 64 MiB at 128 max tokens per rank,
// 512 MiB at 1024): pull combine holds the receive area and the partials; push adds one area of
// W x max_tokens rows of H bf16 per round in flight, into which the ranks write the partials.
TEST(LowLatencyMemory, PullAndPushWithinTheTargets) {
  for (const int tokens : {128, 1024}) {
    EpConfig pull = r1(tokens, DispatchDtype::kBF16ToFP8);
    const size_t bytes = buffer_bytes(Backend::kLowLatency, pull);
    EXPECT_LE(bytes, size_t(tokens == 128 ? 22 : 171) * kMiB) << tokens;
    EpConfig push = pull;
    push.combine = CombineMode::kPush;
    const size_t area = size_t(pull.capacity()) * pull.hidden * 2;
    EXPECT_GE(buffer_bytes(Backend::kLowLatency, push), bytes + area) << tokens;
    EXPECT_LE(buffer_bytes(Backend::kLowLatency, push), bytes + area + 4096) << tokens;
    EXPECT_LE(buffer_bytes(Backend::kLowLatency, push), size_t(tokens == 128 ? 64 : 512) * kMiB);
    pull.combine = CombineMode::kPull;  // auto is pull where no world says otherwise
    EXPECT_EQ(buffer_bytes(Backend::kLowLatency, pull), bytes) << tokens;
    pull.rounds_in_flight = push.rounds_in_flight = 2;
    EXPECT_GE(buffer_bytes(Backend::kLowLatency, push),
              buffer_bytes(Backend::kLowLatency, pull) + 2 * area)
        << tokens;
  }
  // naive's combine is an all-reduce: no pushed area whatever the mode says.
  EpConfig naive = r1(128, DispatchDtype::kBF16ToFP8);
  const size_t nb = buffer_bytes(Backend::kNaive, naive);
  naive.combine = CombineMode::kPush;
  EXPECT_EQ(buffer_bytes(Backend::kNaive, naive), nb);
}

}  // namespace
}  // namespace epx
